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
import tomllib
from pathlib import Path
from typing import Any

from steptap.middleware.launch.up_parser import STEPTAP  # this interpreter's steptap, on PATH or not

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "learner.toml"
MODEL_ENV = "STEPTAP_GSM8K_MODEL"
DEFAULT_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
MAX_STEPS = 5  # model calls per episode (Agent-R1: agent.max_steps = 5)


def learner_settings(path: Path = CONFIG) -> dict[str, Any]:
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    return raw.get("learner", raw)


def model_dir(name: str) -> str:
    """A local model directory: ``name`` itself, or the hub repository's snapshot in the Hugging Face cache
    (downloaded the first time; ``HF_HUB_OFFLINE=1`` uses the cache only)."""
    if Path(name).is_dir():
        return name
    from huggingface_hub import snapshot_download

    print(f"launch: fetching {name} into the Hugging Face cache (once)", file=sys.stderr, flush=True)
    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="make_data.py's output directory (train/test.parquet)")
    p.add_argument("--model", default="", help=f"model directory or hub name (default ${MODEL_ENV}, else "
                   f"{DEFAULT_MODEL})")
    p.add_argument("--config", default=str(CONFIG), help="the learner TOML")
    p.add_argument("--replicas", type=int, default=1, help="vLLM servers, replica i on GPU i")
    p.add_argument("--backend", action="append", default=[], help="use running vLLM server(s) instead")
    p.add_argument("--learner-gpus", default="", help="GPU indices for the learner's workers, e.g. 3 or 6,7")
    p.add_argument("--gpu-share", type=float, default=0.0, help="vLLM's --gpu-memory-utilization (default: "
                   "0.85 beside a learner on its own GPUs, 0.45 when they share)")
    p.add_argument("--max-model-len", type=int, default=8192, help="vLLM's context (prompt + 5 steps)")
    p.add_argument("--batch-groups", type=int, default=0, help="override learner.toml's prompts per update")
    p.add_argument("--updates", type=int, default=0, help="stop after this many updates (0: the epochs)")
    p.add_argument("--epochs", type=int, default=15, help="passes over the training rows (Agent-R1: 15)")
    p.add_argument("--rows", type=int, default=0, help="only the first N training rows (0: all)")
    p.add_argument("--eval-rows", type=int, default=0, help="only the first N test rows (0: all 1319)")
    p.add_argument("--eval-every", type=int, default=10, help="policy versions between evaluations")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per model call")
    p.add_argument("--max-steps", type=int, default=MAX_STEPS, help="model calls per episode")
    p.add_argument("--learn-args", default="", help="more `steptap learn` flags")
    p.add_argument("--print", action="store_true", help="print the steptap up command instead of running it")
    return p


def up_command(args: argparse.Namespace, up_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``steptap up`` argv and the environment changes it runs with."""
    cfg = learner_settings(Path(args.config))
    groups = args.batch_groups or int(cfg.get("batch_groups", 8))
    n = int(cfg.get("group_size", 8))
    gpus = [g for g in args.learner_gpus.split(",") if g.strip()]
    if args.backend and args.replicas > 1:
        raise ValueError("--backend names running servers; --replicas starts them: give one of the two")
    if gpus and not args.backend and args.replicas < 2:  # up pins replicas to GPUs only if several
        raise ValueError("--learner-gpus needs --replicas 2 or more (one replica runs on the learner's GPUs)")
    if gpus and any(int(g) < args.replicas for g in gpus):
        raise ValueError(f"--learner-gpus {args.learner_gpus}: GPUs 0..{args.replicas - 1} serve replicas")
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
    if args.backend:
        argv += [a for b in args.backend for a in ("--backend", b)]
    else:
        share = args.gpu_share or (0.85 if gpus else 0.45)
        vllm = ["--max-lora-rank", str(int(cfg.get("lora_rank", 16)) or 16), "--max-model-len",
                str(args.max_model_len), "--", "--gpu-memory-utilization", str(share)]
        argv += ["--replicas", str(args.replicas), f"--vllm-args={shlex.join(vllm)}"]
    if args.updates:
        argv += ["--max-updates", str(args.updates)]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {}
    return argv + up_args, env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, up_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(ours)
    try:
        cmd, env = up_command(args, up_args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.print:  # the model as named: nothing is fetched
        print(" ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)]))
        return 0
    at = cmd.index("--model") + 1
    cmd[at] = model_dir(cmd[at])
    # steptap up replaces this process: its signals and exit status are the run's.
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
