"""The learner's training tokens/s against a bare transformers training step on the same batch.

    .venv/bin/python bench/learner_throughput.py --model-dir /work/shared-run/tiny --out
    runs/bench-learner.json .venv/bin/python bench/learner_throughput.py --model-dir ./smollm2 --groups 2
    --members 2 \\
        --prompt-tokens 128 --response-tokens 64 --pairs 3      # SmolLM2-135M (steptap pretrained-model)

One batch, built the way the learner builds it: finished one-step trajectories (``--groups`` x ``--members``,
``--prompt-tokens`` + ``--response-tokens`` each, seeded random ids, temperature 1, varied rewards) through
``rows.build_batch``. Two models load from the same directory, each with its own AdamW:

- **bare**: plain torch/transformers on the batch's sequences, micro-batched by the same token budget the
engine
  uses (``--micro-batch-tokens``, consecutive rows while count x longest fits): forward, token log-softmax of
  the targets, a policy-gradient loss over the response tokens (group-normalised rewards as advantages),
  backward with gradient accumulation, clip, one AdamW step;
- **engine**: the torch engine's ``train_step`` (verl's advantages and PPO loss, entropy, the same clip and
  optimizer).

The two alternate (bare first in even pairs), one untimed step each first; tokens/s = the batch's sequence
tokens / the step's wall time. It reports each side's median and the median over pairs of engine / bare.

Checks (any failure: exit status 1): the engine trained every response token of the batch
(``StepStats.tokens``) over every sequence token, its loss and grad norm are finite, and both steps moved
their model's weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import Batch, build_batch
from steptap.middleware.records import Sampling, Step, Trajectory


def make_batch(args: argparse.Namespace, vocab: int) -> Batch:
    rng = random.Random(args.seed)
    trajectories = []
    for g in range(args.groups):
        for m in range(args.members):
            tid = f"g{g}-m{m}"
            step = Step(
                trajectory_id=tid,
                prompt_token_ids=[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)],
                response_token_ids=[rng.randrange(3, vocab) for _ in range(args.response_tokens)],
                response_logprobs=[-rng.uniform(0.5, 8.0) for _ in range(args.response_tokens)],
                sampling=Sampling(temperature=1.0),
            )
            trajectories.append(
                Trajectory(id=tid, group_id=f"g{g}", steps=[step], rewards={"r": float(m % 2)},
                           status="finished")
            )
    return build_batch(trajectories, version=0)


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows whose padded size (count x longest) fits the token budget (the engine's rule)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return groups + [cur] if cur else groups


class BareStep:
    """Forward + backward + AdamW in plain torch/transformers, nothing else."""

    def __init__(self, model_dir: str, cfg: LearnerConfig, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        # The engine's optimizer settings, so that the two AdamW steps do the same work.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas)
        )
        self.grad_clip, self.budget, self.pad_id = cfg.grad_clip, cfg.micro_batch_tokens, pad_id

    def step(self, batch: Batch) -> float:
        seqs = [torch.tensor(s.input_ids) for s in batch.sequences]
        masks, advs = [], []
        rewards: dict[str, list[float]] = {}
        for smp in batch.samples:
            rewards.setdefault(smp.group, []).append(smp.ret)
        for seq in batch.sequences:
            mask, adv = torch.zeros(len(seq.input_ids) - 1), torch.zeros(len(seq.input_ids) - 1)
            for i in seq.samples:
                smp = batch.samples[i]
                rs = rewards[smp.group]
                a = (smp.ret - statistics.mean(rs)) / (statistics.pstdev(rs) + 1e-6)
                mask[smp.offset - 1 : smp.offset - 1 + len(smp.response_ids)] = 1.0
                adv[smp.offset - 1 : smp.offset - 1 + len(smp.response_ids)] = a
            masks.append(mask)
            advs.append(adv)
        n_tokens = float(sum(m.sum() for m in masks))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches([len(s) for s in seqs], self.budget):
            pad = torch.nn.utils.rnn.pad_sequence
            ids = pad([seqs[i] for i in mb], batch_first=True, padding_value=self.pad_id)
            attn = pad([torch.ones_like(seqs[i]) for i in mb], batch_first=True, padding_value=0)
            mask = pad([masks[i] for i in mb], batch_first=True)
            adv = pad([advs[i] for i in mb], batch_first=True)
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            logp = torch.gather(F.log_softmax(logits.float(), -1), -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(logp * adv * mask).sum() / n_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return total


def first_param(model: torch.nn.Module) -> torch.Tensor:
    return next(p for p in model.parameters() if p.requires_grad).detach().clone()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    cfg = LearnerConfig(
        model_dir=args.model_dir, device="cpu", micro_batch_tokens=args.micro_batch_tokens, lr=args.lr,
        seed=args.seed,
    ).validate()
    engine = TorchEngine(cfg)
    bare = BareStep(args.model_dir, cfg, engine.pad_id)
    batch = make_batch(args, int(engine.model.config.vocab_size))
    problems: list[str] = []
    seq_tokens, trained = batch.num_tokens, sum(len(s.response_ids) for s in batch.samples)
    n_micro = len(micro_batches([len(s.input_ids) for s in batch.sequences], args.micro_batch_tokens))

    before = {"bare": first_param(bare.model), "engine": first_param(engine.model)}
    stats = engine.train_step(batch)  # untimed warm-up steps; also the checks' step
    bare.step(batch)
    if stats.tokens != trained or stats.seq_tokens != seq_tokens:
        problems.append(f"engine trained {stats.tokens}/{stats.seq_tokens} tokens, batch has "
                        f"{trained}/{seq_tokens}")
    if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
        problems.append(f"engine loss {stats.loss}, grad norm {stats.grad_norm}")
    for name, model in (("bare", bare.model), ("engine", engine.model)):
        if torch.equal(before[name], first_param(model)):
            problems.append(f"the {name} step did not move its weights")

    pairs = []
    for i in range(args.pairs):
        order = ["bare", "engine"] if i % 2 == 0 else ["engine", "bare"]
        pair: dict[str, Any] = {"pair": i, "order": order}
        for side in order:
            t0 = time.perf_counter()
            engine.train_step(batch) if side == "engine" else bare.step(batch)
            pair[f"{side}_s"] = time.perf_counter() - t0
        pair["ratio"] = pair["bare_s"] / pair["engine_s"]  # engine tokens/s over bare tokens/s
        pairs.append(pair)
        if not args.quiet:
            print(f"pair {i}: bare {pair['bare_s']:.3f} s  engine {pair['engine_s']:.3f} s  "
                  f"engine/bare tokens/s {pair['ratio']:.3f}", flush=True)
    med = statistics.median
    summary = {
        "model": Path(args.model_dir).name, "params": sum(p.numel() for p in bare.model.parameters()),
        "rows": len(batch.sequences), "seq_tokens": seq_tokens, "trained_tokens": trained,
        "micro_batches": n_micro, "threads": torch.get_num_threads(),
        "bare_tokens_per_s": seq_tokens / med([p["bare_s"] for p in pairs]),
        "engine_tokens_per_s": seq_tokens / med([p["engine_s"] for p in pairs]),
        "ratio": med([p["ratio"] for p in pairs]),
    }
    return {"summary": summary, "pairs": pairs, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="a Hugging Face causal LM directory")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--members", type=int, default=2, help="trajectories per group")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--micro-batch-tokens", type=int, default=512, help="token budget of one forward/backward")
    p.add_argument("--pairs", type=int, default=9, help="timed (bare, engine) step pairs, interleaved")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default). 1 by default: on a shared machine other load makes "
        "multi-threaded kernels wait on each other (2 threads at load 7 on 2 cores: 4-30 s a step, 1: 0.8 s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the pairs and the summary as JSON here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0, load_start = time.time(), os.getloadavg()
    result = run(args)
    from proxy_overhead import _git_head

    result["meta"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "wall_s": round(time.time() - t0, 1),
        "loadavg_start": load_start, "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "git": _git_head(),
        "torch": torch.__version__, "args": vars(args),
    }
    s = result["summary"]
    print(
        f"{s['model']} ({s['params'] / 1e6:.1f} M params), {s['rows']} rows, {s['seq_tokens']} tokens "
        f"({s['trained_tokens']} trained), {s['micro_batches']} micro-batches, {s['threads']} threads: bare "
        f"{s['bare_tokens_per_s']:.0f} tokens/s, engine {s['engine_tokens_per_s']:.0f} tokens/s; "
        f"engine / bare {s['ratio']:.3f} (median over {len(result['pairs'])} pairs)"
    )
    print(f"- correctness: {'as expected' if not result['problems'] else result['problems']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
