"""`steptap up`'s command line: its flags (the proxy's own from ``ProxyConfig``) and their parsing, and what
they pass on to the proxy's and the learner's command lines."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from steptap.middleware.client import TOKEN_ENV, TOKEN_FILE_ENV
from steptap.middleware.config import add_proxy_flags

PY = sys.executable
STEPTAP = [PY, "-m", "steptap.middleware.cli"]  # the same interpreter and install as this process


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steptap up", description="`steptap up`: the whole loop in one command.")
    _stack_flags(p)
    _run_flags(p)
    return p


def _stack_flags(p: argparse.ArgumentParser) -> None:
    """What the stack is: the model, vLLM, the proxy, the work directory and its token."""
    p.add_argument("--model", help="model directory or hub name (default: build the offline tiny model)")
    p.add_argument("--config", help="learner TOML (steptap learn --config); overrides below win")
    add_proxy_flags(p, only={"host", "port"})  # the proxy's own defaults (ProxyConfig)
    p.add_argument(
        "--vllm-tcp",
        action="store_true",
        help="serve the managed vLLM on a TCP port of 127.0.0.1 instead of a unix socket in a private "
             "directory "
        "(steptap vllm --insecure-tcp): its dev-mode admin routes (pause, reload weights, weight transfer, "
        "load LoRA) then answer every local process",
    )
    p.add_argument("--vllm-port", type=int, default=0, help="with --vllm-tcp: vLLM's port (0: any free port)")
    p.add_argument(
        "--backend", action="append",
        help="use this running vLLM server (http://host:port or unix:PATH), do not "
        "start one; repeat it for several replicas (the proxy routes among them, the learner swaps them all)"
    )
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="vLLM servers to start (one per GPU when GPUs are present); the proxy routes among "
                        "them")
    p.add_argument(
        "--workdir",
        help="where logs, the trajectory log, checkpoints and metrics go (default: runs/up-<timestamp>)",
    )
    p.add_argument(
        "--control-token-file",
        help=f"the proxy's control token: read from this file, or generated into it (0600) when it does not "
        f"exist. Default: ${TOKEN_ENV}, else generated into WORKDIR/control_token",
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    """What runs on it, how it is watched, when it stops, and what each child is given besides."""
    p.add_argument("--no-learner", action="store_true", help="serve and record only, do not train")
    p.add_argument("--no-view", action="store_true", help="no live view, a status line instead")
    p.add_argument("--status-every", type=float, default=15.0)
    p.add_argument(
        "--agents",
        help="shell command run as the agent population's driver once the stack is up; it gets "
        f"OPENAI_BASE_URL, STEPTAP_URL, STEPTAP_MODEL and {TOKEN_FILE_ENV} (a 0600 file holding the control "
        f"token; never ${TOKEN_ENV}) in its environment, and should keep the token from the agents it starts "
        "(`steptap run` does)",
    )
    p.add_argument(
        "--eval",
        metavar="DATA.parquet",
        help="evaluate this dataset (steptap eval) at start and every --eval-every policy versions; "
        "its accuracy goes into the metrics file beside the training reward",
    )
    p.add_argument("--eval-every", type=int, default=5, help="policy versions between evaluations")
    p.add_argument("--eval-args", default="", help='for `steptap eval`: --eval-args="--env calculator --n 2"')
    p.add_argument("--max-updates", type=int, help="stop after the learner has made this many updates")
    p.add_argument("--seed", type=int,
                   help="the run's seed: the learner's (torch: the LoRA init, dropout) and vLLM's sampler's "
                        "(vLLM --seed, one more per replica); default: a new random one, printed and kept in "
                        "summary.json")
    p.add_argument("--engine", choices=("torch", "verl"),
                   help="the learner's engine (steptap learn --engine)")
    p.add_argument("--duration", type=float, help="stop after this many seconds of running (after start-up)")
    p.add_argument(
        "--stop-at-reward",
        type=float,
        help="stop once the mean reward of the last 3 updates reaches this value",
    )
    p.add_argument("--task", default="", help="task name recorded in summary.json")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds each component may take to "
        "become healthy (the first vLLM start on a machine builds its virtualenv)",
    )
    p.add_argument("--grace", type=float, default=15.0, help="seconds from SIGTERM to SIGKILL at shutdown")
    # One string each, given with "=" since it starts with "--": --learn-args="--lr 1e-5 --lora-rank 8".
    p.add_argument("--vllm-args", default="", help='for `steptap vllm`: --vllm-args="--threads 2"')
    p.add_argument("--serve-args", default="", help='for `steptap serve`: --serve-args="--any-model"')
    p.add_argument("--learn-args", default="", help='for `steptap learn`: --learn-args="--lr 1e-5"')


def _split(text: str) -> list[str]:
    import shlex

    return shlex.split(text) if text else []


def serve_argv(args: argparse.Namespace, backends: list[str], port: int, workdir: Path, token_file: Path,
               metrics: Path, fds: Sequence[int]) -> list[str]:
    """`steptap serve` in front of ``backends``, on ``port`` (or the inherited socket ``fds``)."""
    return [
        *STEPTAP,
        "serve",
        *[arg for url in backends for arg in ("--backend", url)],
        "--host",
        args.host,
        "--port",
        str(port),
        "--log",
        str(workdir / "trajectories"),
        "--control-token-file",  # never on the command line: `ps` shows it to every local user
        str(token_file),
        "--console-learner-metrics",  # the console draws the learner's loss, KL, grad norm
        str(metrics),
        *[arg for fd in fds for arg in ("--listen-fd", str(fd))],
        *_split(args.serve_args),
    ]


def learner_argv(args: argparse.Namespace, proxy_url: str, model_dir: str, metrics: Path, workdir: Path,
                 seed: int) -> list[str]:
    """`steptap learn`'s flags (after ``learn``): the run's, then ``--learn-args`` (later wins)."""
    argv = ["--config", args.config] if args.config else []
    return argv + [
        "--proxy-url",
        proxy_url,
        "--model-dir",
        model_dir,
        "--metrics-file",
        str(metrics),
        "--checkpoint-dir",
        str(workdir / "checkpoints"),
        "--weights-dir",
        str(workdir / "weights"),
        *(["--engine", args.engine] if args.engine else []),
        # The learner stops itself at exactly N updates: up's own check polls once a second, and a fast
        # learner could make another update between that poll and the stop.
        *(["--max-updates", str(args.max_updates)] if args.max_updates else []),
        "--seed", str(seed),
        *_split(args.learn_args),
    ]
