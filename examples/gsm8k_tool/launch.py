"""``steptap up`` for the GSM8K + calculator recipe: the flags built from ``learner.toml`` and a few choices.

    python examples/gsm8k_tool/launch.py --data data/gsm8k-tool --replicas 3 --learner-gpus 3
    python examples/gsm8k_tool/launch.py --data DIR --print          # the steptap up command, not run

The model is ``--model``, else ``$STEPTAP_GSM8K_MODEL``, else Qwen/Qwen3-4B-Instruct-2507: a directory, or a
hub name fetched once into the Hugging Face cache (``huggingface_hub.snapshot_download``: ``steptap vllm``
takes a directory). The agents are ``steptap env run`` over
``DATA/train.parquet`` (``make_data.py``) in groups of ``group_size``, as many episodes at once as one update
takes; ``steptap eval`` scores ``DATA/test.parquet`` greedily at start and every ``--eval-every`` versions.

GPUs: replica i runs on GPU i (``steptap up --replicas``); the learner's Ray workers get ``--learner-gpus``
(through ``CUDA_VISIBLE_DEVICES`` of the ``steptap up`` process, which each replica replaces with its own),
one worker each. With one replica and no ``--learner-gpus`` vLLM and the learner share every GPU
(``--gpu-share`` is vLLM's part of the memory). Arguments after ``--`` go to ``steptap up`` unchanged.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from steptap.middleware.launch import gpu_recipe
from steptap.middleware.launch.up_parser import STEPTAP  # this interpreter's steptap, on PATH or not

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "learner.toml"
MODEL_ENV = "STEPTAP_GSM8K_MODEL"
DEFAULT_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
MAX_STEPS = 5  # model calls per episode (Agent-R1: agent.max_steps = 5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="make_data.py's output directory (train/test.parquet)")
    gpu_recipe.add_arguments(p, MODEL_ENV, DEFAULT_MODEL, 8192, "vLLM's context (prompt + 5 steps)", CONFIG)
    p.add_argument("--batch-groups", type=int, default=0, help="override learner.toml's prompts per update")
    p.add_argument("--updates", type=int, default=0, help="stop after this many updates (0: the epochs)")
    p.add_argument("--epochs", type=int, default=15, help="passes over the training rows (Agent-R1: 15)")
    p.add_argument("--rows", type=int, default=0, help="only the first N training rows (0: all)")
    p.add_argument("--eval-rows", type=int, default=0, help="only the first N test rows (0: all 1319)")
    p.add_argument("--eval-every", type=int, default=10, help="policy versions between evaluations")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per model call")
    p.add_argument("--max-steps", type=int, default=MAX_STEPS, help="model calls per episode")
    return p


def up_command(args: argparse.Namespace, up_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``steptap up`` argv and the environment changes it runs with."""
    cfg = gpu_recipe.learner_settings(Path(args.config))
    groups = args.batch_groups or int(cfg.get("batch_groups", 8))
    n = int(cfg.get("group_size", 8))
    gpus = gpu_recipe.learner_gpus(args)
    data = Path(args.data)
    sample = ["--max-tokens", str(args.max_tokens), "--max-steps", str(args.max_steps)]
    agents = [*STEPTAP, "env", "run", str(data / "train.parquet"), "--n", str(n),
              "--concurrency", str(groups * n), "--epochs", str(args.epochs), *sample]
    agents += ["--limit", str(args.rows)] if args.rows else []
    evals = ["--concurrency", "128", "--temperature", "0", *sample]  # held-out accuracy: greedy
    evals += ["--limit", str(args.eval_rows)] if args.eval_rows else []
    learn = ["--workers", str(max(1, len(gpus)))]
    learn += ["--batch-groups", str(groups)] if args.batch_groups else []
    argv = [*STEPTAP, "up", "--model", args.model or os.environ.get(MODEL_ENV) or DEFAULT_MODEL,
            "--config", args.config, "--task", "gsm8k_tool",
            "--agents", shlex.join(agents),
            "--eval", str(data / "test.parquet"), "--eval-every", str(args.eval_every),
            "--eval-args", shlex.join(evals),
            "--learn-args", shlex.join(learn + shlex.split(args.learn_args))]
    serve, env = gpu_recipe.serving(args, cfg, gpus, args.updates)
    return argv + serve + up_args, env


def main(argv: list[str] | None = None) -> int:
    return gpu_recipe.main(build_parser(), up_command, argv)


if __name__ == "__main__":
    sys.exit(main())
