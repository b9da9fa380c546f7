"""The learner's engines on the same batch: start-up time, seconds per update and training tokens/s of the
``torch`` engine (this process) against the ``verl`` engine (verl's TrainingWorker group on a local Ray
cluster, 1 and 2 workers; on CPU over gloo when there is no GPU).

    python bench/engines.py [--model-dir DIR] [--groups 4 --group-size 8 --prompt 32 --response 24]
                            [--updates 4] [--workers 1 2] [--threads 1]

The batch is synthetic (random token ids, GRPO groups with distinct rewards, on-policy logprobs left at a
constant: the speed does not depend on them). Each engine first pays one warm-up update (not timed), then
``--updates`` timed ones on the same batch; the figure is their median. Ratios are against the torch engine
measured in the same run, since absolute times depend on the machine and its load. Prints one JSON line per
engine and a summary table. Without ``--model-dir`` it builds the offline tiny model into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time


def _batch(args: argparse.Namespace, vocab: int):  # type: ignore[no-untyped-def]
    from steptap.learner.rows import build_batch
    from steptap.middleware.records import Sampling, Step, Trajectory

    rnd = random.Random(0)
    trajs = []
    for g in range(args.groups):
        prompt = [rnd.randrange(10, vocab) for _ in range(args.prompt)]
        for m in range(args.group_size):
            resp = [rnd.randrange(10, vocab) for _ in range(args.response)]
            trajs.append(Trajectory(id=f"g{g}m{m}", group_id=f"g{g}", status="finished",
                                    rewards={"r": float(m)},
                                    steps=[Step(prompt_token_ids=prompt, response_token_ids=resp,
                                                response_logprobs=[-8.0] * len(resp), sampling=Sampling())]))
    return build_batch(trajs, version=0)


def _run(name: str, cfg, batch, updates: int) -> dict:  # type: ignore[no-untyped-def]
    from steptap.learner.engines.base import make_engine

    t0 = time.perf_counter()
    eng = make_engine(cfg)
    startup = time.perf_counter() - t0
    try:
        first = eng.train_step(batch)  # warm-up: the first step pays allocations (and, on Ray, lazy imports)
        times = [eng.train_step(batch).seconds for _ in range(updates)]
        t1 = time.perf_counter()
        eng.write_weights(tempfile.mkdtemp(prefix="steptap-bench-w-"))
        export = time.perf_counter() - t1
    finally:
        eng.close()
    per_update = statistics.median(times)
    return {"engine": name, "startup_s": round(startup, 2), "first_update_s": round(first.seconds, 3),
            "s_per_update": round(per_update, 3), "tokens_per_s": round(first.seq_tokens / per_update, 1),
            "seq_tokens": first.seq_tokens, "export_weights_s": round(export, 3), "updates_timed": updates}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=24)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (the torch engine; each verl worker)")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from steptap.learner.config import LearnerConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if not model_dir:
        from steptap.learner.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="steptap-bench-tiny-"), seed=0))
    batch = _batch(args, len(AutoTokenizer.from_pretrained(model_dir)))
    common = dict(model_dir=model_dir, lr=1e-4, weight_decay=0.0, truncation_mode="drop",
                  group_size=args.group_size,
                  micro_batch_tokens=4096, num_threads=args.threads)
    results = [_run("torch", LearnerConfig(**common).validate(), batch, args.updates)]
    for w in args.workers:
        cfg = LearnerConfig(engine="verl", workers=w, worker_cpus=1, **common).validate()
        results.append(_run(f"verl x{w}", cfg, batch, args.updates))
    base = results[0]
    for r in results:
        r["s_per_update_vs_torch"] = round(r["s_per_update"] / base["s_per_update"], 2)
        print(json.dumps(r))
    print(f"\n{'engine':<10} {'start-up s':>10} {'s/update':>9} {'tokens/s':>9} {'x torch':>8}",
          file=sys.stderr)
    for r in results:
        print(f"{r['engine']:<10} {r['startup_s']:>10.1f} {r['s_per_update']:>9.3f} "
              f"{r['tokens_per_s']:>9.0f} "
              f"{r['s_per_update_vs_torch']:>8.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
