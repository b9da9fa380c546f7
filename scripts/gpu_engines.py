"""The learner's two engines on one CUDA GPU, without vLLM: a check that needs only torch and the wheels the
learner installs (no CUDA vLLM, which cannot be installed on a machine without a package registry).

    python scripts/gpu_engines.py [--out DIR] [--device cuda|cpu] [--lr 1e-5]

On a tiny model built offline, with an off-policy batch whose recorded logprobs are a float32 CPU
recomputation (the part vLLM's recorded logprobs play) shifted by -0.4 on every other token, it runs
- the torch engine (the model in bf16 on CUDA, as `steptap learn` loads it there), and
- the verl engine (one verl FSDP2 TrainingWorker over NCCL in a local Ray cluster, as `steptap learn --engine
  verl` runs on a GPU; flash-attn or sdpa, `verl_cpu.attention`),
and checks, one PASS/FAIL line each: the GPU is visible; each engine's logprobs of the batch against the
float32 reference (bf16: within 0.25 nats; float32 parameters: within 1e-3); one `train_step` each gives a
finite loss, the two engines' losses agree within 10 %, and the update moves the weights: the share of
weights that changed at a realistic learning rate is printed for each engine (a bf16 weight cannot take an
update much smaller than 1/256 of itself); the verl engine's written weights load in transformers and are
what it trained. A JSON report goes to --out. Exit 0 when every check passed, 1 otherwise, 3 without a GPU.
`--device cpu` runs the same on CPU (the verl engine over gloo) to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from steptap.learner.config import LearnerConfig
from steptap.learner.rows import Batch, build_batch
from steptap.learner.tiny_model import build_tiny_model
from steptap.middleware.records import Sampling, Step, Trajectory

report: dict = {"checks": {}}


def check(name: str, ok: bool, detail: str = "") -> bool:
    report["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def reference_batch(model_dir: Path) -> tuple[Batch, dict[str, torch.Tensor]]:
    """Four groups of two 2-step ``extends`` chains (verl sees multi-turn rows with masked tool tokens);
    recorded logprobs: the float32 CPU model's, minus 0.4 on every other token. Also the initial weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

    trajs = []
    for g in range(4):
        for m in range(2):
            p1, r1 = ids(40 + 7 * g), ids(24)
            p2 = p1 + r1 + ids(12)
            r2 = ids(24)
            full = p2 + r2
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([full])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]
            lp = lp - 0.4 * (torch.arange(len(lp)) % 2)
            steps = [Step(index=0, prompt_token_ids=p1, response_token_ids=r1, prefix="first",
                          sampling=Sampling(), response_logprobs=lp[len(p1) - 1:len(p2) - 13].tolist()),
                     Step(index=1, prompt_token_ids=p2, response_token_ids=r2, prefix="extends",
                          sampling=Sampling(), response_logprobs=lp[len(p2) - 1:].tolist())]
            trajs.append(Trajectory(id=f"t{g}{m}", group_id=f"g{g}", status="finished", steps=steps,
                                    rewards={"r": float(m) + 0.25 * g}))
    return build_batch(trajs, version=0), w0


def true_logprobs(batch: Batch) -> list[torch.Tensor]:
    """The unshifted float32 reference of each sequence's tokens after its first step's prompt (recorded +
    the shift back), NaN where no step's response is (the tool tokens between steps): not compared."""
    out = []
    for seq in batch.sequences:
        first = batch.samples[seq.samples[0]].offset
        lp = torch.full((len(seq.input_ids) - first,), float("nan"))
        for i in seq.samples:
            s = batch.samples[i]
            shift = 0.4 * ((torch.arange(len(s.response_ids)) + s.offset - 1) % 2)
            lp[s.offset - first:s.offset - first + len(s.response_ids)] = torch.tensor(s.logprobs) + shift
        out.append(lp)
    return out


def max_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    keep = ~want.isnan()
    return float((got[:len(want)][keep] - want[keep]).abs().max())


def changed_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    n = moved = 0
    for k, v in before.items():
        if k in after and after[k].shape == v.shape and v.is_floating_point():
            a = after[k].detach().float().cpu()
            n += v.numel()
            moved += int((a != v.detach().float().cpu()).sum())
    return moved / max(n, 1)


def adapter_moved(path: Path) -> float:
    """The largest |lora_B| in a written peft adapter: 0 before any update (peft starts B at zero)."""
    from safetensors.torch import load_file

    found = next(path.rglob("adapter_model.safetensors"), None)
    if found is None:
        return -1.0
    return max(float(t.abs().max()) for k, t in load_file(str(found)).items() if "lora_B" in k)


def run_torch(cfg: LearnerConfig, batch: Batch, ref: list[torch.Tensor], out: Path) -> dict:
    from steptap.learner.engines.torch_engine import TorchEngine

    t0 = time.perf_counter()
    eng = TorchEngine(cfg)
    dev = next(eng.model.parameters()).device
    dtype = str(next(eng.model.parameters()).dtype)
    gap = 0.0
    lay = eng._layout(batch)
    with torch.no_grad():  # through the engine's own forward (its dtype, autocast, padding)
        for q, (seq, want) in enumerate(zip(batch.sequences, ref, strict=True)):
            first = batch.samples[seq.samples[0]].offset
            logits = eng._logits(eng.model, lay, [q])[0, first - 1:].float()
            x = torch.tensor(seq.input_ids[first:], device=logits.device)
            got = torch.log_softmax(logits, -1).gather(-1, x[:, None])[:, 0].cpu()
            gap = max(gap, max_gap(got, want))
        mine = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}  # as loaded (its dtype)
    stats = eng.train_step(batch)
    share = changed_share(mine, eng.model.state_dict())
    lora_b = adapter_moved(eng.write_weights(out / "torch-adapter", version=1)) if cfg.lora_rank else None
    eng.close()
    return dict(device=str(dev), dtype=dtype, gap=gap, loss=stats.loss, grad_norm=stats.grad_norm,
                changed=share, lora_b=lora_b, seconds=time.perf_counter() - t0)


def run_verl(cfg: LearnerConfig, batch: Batch, ref: list[torch.Tensor], w0: dict, out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from steptap.learner.engines.verl_engine import VerlEngine

    t0 = time.perf_counter()
    eng = VerlEngine(cfg)
    try:
        startup = eng.startup_s
        rows = eng._rows(batch)
        lp = eng._logprobs(rows, unit_temperature=True)  # [B, R], float32 on the driver
        gap = max(max_gap(lp[q], want) for q, want in enumerate(ref))
        stats = eng.train_step(batch)
        common = dict(cuda=not eng.cpu, startup_s=startup, gap=gap, loss=stats.loss,
                      grad_norm=stats.grad_norm)
        if cfg.lora_rank:
            lora_b = adapter_moved(eng.write_weights(out / "verl-adapter", version=1))
            return dict(common, lora_b=lora_b, seconds=time.perf_counter() - t0)
        trained = eng.hf_weights()
        written = eng.write_weights(out / "verl-weights", version=1)
        loaded = AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32).state_dict()
        same = all(torch.equal(loaded[k].float(), v.float().cpu()) for k, v in trained.items() if k in loaded)
        dtype = torch.bfloat16 if cfg.model_dtype == "bf16" else torch.float32  # w0 as the workers loaded it
        loaded0 = {k: v.to(dtype) for k, v in w0.items()}
        return dict(common, changed=changed_share(loaded0, trained), written_is_trained=same,
                    seconds=time.perf_counter() - t0)
    finally:
        eng.close()


def moved(r: dict, name: str, a: argparse.Namespace) -> None:
    if a.lora:  # the base stays frozen; the written adapter's B matrices left zero
        check(f"{name} engine loss finite, adapter written and moved",
              math.isfinite(r["loss"]) and r["lora_b"] > 0,
              f"loss {r['loss']:.5g}, max |lora_B| {r['lora_b']:.3g} at lr {a.lr:g}")
    else:
        check(f"{name} engine loss finite, weights moved", math.isfinite(r["loss"]) and r["changed"] > 0,
              f"loss {r['loss']:.5g}, {100 * r['changed']:.1f} % of weights changed at lr {a.lr:g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--verl-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="the verl engine's model_dtype (examples/gsm8k_tool runs bf16)")
    ap.add_argument("--lora", type=int, default=0,
                    help="LoRA rank (and a KL to the base model), 0: full weights")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="gpu-engines-"))
    out.mkdir(parents=True, exist_ok=True)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_engines.py: FAIL: torch sees no CUDA device; nothing was checked", file=sys.stderr)
        return 3
    report["torch"] = torch.__version__
    report["gpu"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    check("the device is visible to torch", True, report["gpu"])
    model_dir = build_tiny_model(out / "tiny-model", seed=0)
    batch, w0 = reference_batch(model_dir)
    ref = true_logprobs(batch)
    base = dict(model_dir=str(model_dir), lr=a.lr, weight_decay=0.0, grad_clip=1.0, truncation_mode="drop",
                device=a.device)
    if a.lora:
        base |= dict(lora_rank=a.lora, lora_alpha=2 * a.lora, kl_coef=0.01)
    results = {}
    runs = {"torch": {}, "torch-bf16": {"model_dtype": "bf16"}, "verl": {"model_dtype": a.verl_dtype}}
    for name, extra in runs.items():
        if name == "torch-bf16" and a.device == "cpu":
            continue  # the torch engine is float32 on CPU whatever model_dtype says
        try:
            cfg = LearnerConfig(**base, **extra, engine=name.split("-")[0]).validate()
            results[name] = (run_verl(cfg, batch, ref, w0, out) if name == "verl"
                             else run_torch(cfg, batch, ref, out))
            print(f"{name}: {json.dumps(results[name])}", flush=True)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            print(f"{name} engine failed:\n{results[name]['error']}", flush=True)
    report["engines"] = results
    t, v = results["torch"], results["verl"]
    bf16 = a.device == "cuda"  # the torch engine's forward runs in bf16 there (autocast or bf16 weights)
    if check("torch engine ran", "error" not in t, t.get("device", "")):
        check("torch engine on the device", t["device"].startswith(a.device), t["device"])
        check("torch engine logprobs vs the float32 reference", t["gap"] <= (0.25 if bf16 else 1e-3),
              f"max gap {t['gap']:.3g} ({t['dtype']})")
        moved(t, "torch", a)
    tb = results.get("torch-bf16")
    if tb is not None and check("torch engine with model_dtype bf16 ran", "error" not in tb) and not a.lora \
            and "error" not in t:
        check("float32 weights keep more of a small update than bf16 weights", t["changed"] > tb["changed"],
              f"{100 * t['changed']:.1f} % vs {100 * tb['changed']:.1f} % of weights changed at lr {a.lr:g}")
    if check("verl engine ran", "error" not in v):
        check("verl engine on the device", v["cuda"] == (a.device == "cuda"), "cuda" if v["cuda"] else "cpu")
        tol = 0.25 if a.verl_dtype == "bf16" else 1e-3
        check("verl engine logprobs vs the float32 reference", v["gap"] <= tol,
              f"max gap {v['gap']:.3g} (model_dtype {a.verl_dtype})")
        moved(v, "verl", a)
        if not a.lora:
            check("verl engine's written weights are what it trained", v["written_is_trained"])
    if "error" not in t and "error" not in v:
        rel = abs(t["loss"] - v["loss"]) / max(abs(v["loss"]), 1e-6)
        check("the two engines' losses agree within 10 %", rel <= 0.10,
              f"torch {t['loss']:.5g}, verl {v['loss']:.5g} ({100 * rel:.2f} %)")
    (out / "gpu_engines.json").write_text(json.dumps(report, indent=1))
    ok = all(c["ok"] for c in report["checks"].values())
    print(f"{'ALL PASSED' if ok else 'SOME FAILED'}; report: {out / 'gpu_engines.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
