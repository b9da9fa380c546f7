"""What a GPU recipe's ``launch.py`` shares (examples/gsm8k_tool, examples/gpu_scale): the model as a
directory, the learner TOML's settings, where replicas and learner workers sit, the serving flags of
``steptap up``, and the hand-over to it. Each recipe builds its own agents and evaluation; the rest is
here, once."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

UpCommand = Callable[[argparse.Namespace, list[str]], tuple[list[str], dict[str, str]]]


def learner_settings(path: Path) -> dict[str, Any]:
    """The learner TOML's settings (its ``[learner]`` table, or the whole file), as ``steptap learn`` reads
    them."""
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    settings: dict[str, Any] = raw.get("learner", raw)
    return settings


def model_dir(name: str) -> str:
    """A local model directory: ``name`` itself, or the hub repository's snapshot in the Hugging Face cache
    (downloaded the first time; ``HF_HUB_OFFLINE=1`` uses the cache only): ``steptap vllm`` takes a
    directory."""
    if Path(name).is_dir():
        return name
    from huggingface_hub import snapshot_download

    print(f"launch: fetching {name} into the Hugging Face cache (once)", file=sys.stderr, flush=True)
    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])


def add_arguments(p: argparse.ArgumentParser, model_env: str, default_model: str, max_model_len: int,
                  max_model_len_help: str, config: Path) -> None:
    """The options every GPU recipe takes: the model, the learner TOML, GPUs and serving, the run's length."""
    p.add_argument("--model", default="", help=f"model directory or hub name (default ${model_env}, else "
                   f"{default_model})")
    p.add_argument("--config", default=str(config), help="the learner TOML")
    p.add_argument("--replicas", type=int, default=1, help="vLLM servers, replica i on GPU i")
    p.add_argument("--backend", action="append", default=[], help="use running vLLM server(s) instead")
    p.add_argument("--learner-gpus", default="", help="GPU indices for the learner's workers, e.g. 3 or 6,7")
    p.add_argument("--gpu-share", type=float, default=0.0, help="vLLM's --gpu-memory-utilization (default: "
                   "0.85 beside a learner on its own GPUs, 0.45 when they share)")
    p.add_argument("--max-model-len", type=int, default=max_model_len, help=max_model_len_help)
    p.add_argument("--learn-args", default="", help="more `steptap learn` flags")
    p.add_argument("--print", action="store_true", help="print the steptap up command instead of running it")


def learner_gpus(args: argparse.Namespace) -> list[str]:
    """The learner's GPUs, refused where a replica would sit on them: replica i runs on GPU i (``steptap up
    --replicas``), the learner's workers on ``--learner-gpus`` (its ``CUDA_VISIBLE_DEVICES``)."""
    gpus = [g.strip() for g in args.learner_gpus.split(",") if g.strip()]
    if args.backend and args.replicas > 1:
        raise ValueError("--backend names running servers; --replicas starts them: give one of the two")
    if gpus and not args.backend and args.replicas < 2:  # up pins replicas to GPUs only if several
        raise ValueError("--learner-gpus needs --replicas 2 or more (one replica runs on the learner's GPUs)")
    if gpus and any(int(g) < args.replicas for g in gpus):
        raise ValueError(f"--learner-gpus {args.learner_gpus}: GPUs 0..{args.replicas - 1} serve replicas")
    return gpus


def serving(args: argparse.Namespace, cfg: dict[str, Any], gpus: list[str], updates: int
            ) -> tuple[list[str], dict[str, str]]:
    """``steptap up``'s serving flags (running ``--backend`` servers, or replicas it starts, sized to share
    the GPUs with the learner or not), ``--max-updates``, and the environment that places the learner."""
    if args.backend:
        argv = [a for b in args.backend for a in ("--backend", b)]
    else:
        share = args.gpu_share or (0.85 if gpus else 0.45)
        vllm = ["--max-lora-rank", str(int(cfg.get("lora_rank", 16)) or 16), "--max-model-len",
                str(args.max_model_len), "--", "--gpu-memory-utilization", str(share)]
        argv = ["--replicas", str(args.replicas), f"--vllm-args={shlex.join(vllm)}"]
    argv += ["--max-updates", str(updates)] if updates else []
    return argv, ({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {})


def main(parser: argparse.ArgumentParser, up_command: UpCommand, argv: list[str] | None = None) -> int:
    """Parse the recipe's options (arguments after ``--`` go to ``steptap up`` unchanged), then print the
    command (``--print``: the model as named, nothing fetched) or become it: ``steptap up`` replaces this
    process, so its signals and exit status are the run's."""
    argv = sys.argv[1:] if argv is None else argv
    ours, up_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    try:
        cmd, env = up_command(args, up_args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.print:
        print(" ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)]))
        return 0
    at = cmd.index("--model") + 1
    cmd[at] = model_dir(cmd[at])
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
