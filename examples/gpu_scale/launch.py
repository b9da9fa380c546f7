"""``steptap up`` for coding-agent CLIs at GPU scale: Codex, Claude Code and pi, unchanged, each running a
Terminal-Bench-style suite of Harbor tasks through ``steptap tasks run`` into one learner.

    python examples/gpu_scale/launch.py --dataset DIR --replicas 3 --learner-gpus 3
    python examples/gpu_scale/launch.py --dataset DIR --print        # the steptap up command, not run

The model is ``--model``, else ``$STEPTAP_GPU_SCALE_MODEL``, else Qwen/Qwen3-4B-Instruct-2507: a directory,
or a hub name fetched once into the Hugging Face cache. The agents are one ``steptap tasks run`` per CLI
(``--agents``, default codex,claude-code,pi), side by side, each task a GRPO group of the config's
``group_size`` episodes, ``--rounds`` groups per task; or, with ``--command``, one run of that plain command
(any program, docs/tasks.md). ``--sandbox harbor`` (default): each episode a Harbor trial in a docker
container built from the task's ``environment/``; the proxy then listens on ``--container-proxy``'s address
(the docker bridge's, 172.17.0.1, by default: the containers and this host reach it, the network beyond does
not).
``--sandbox local``: bubblewrap on this machine, the proxy on loopback.

GPUs placed as every GPU recipe's (``steptap.middleware.launch.gpu_recipe``): replica i on GPU i, the
learner's workers on ``--learner-gpus``. Arguments after ``--`` go to ``steptap up`` unchanged. Settings
and why: docs/gpu-scale.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from urllib.parse import urlsplit

from steptap.middleware.launch import gpu_recipe
from steptap.middleware.launch.up_parser import STEPTAP  # this interpreter's steptap, on PATH or not

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "learner.toml"
MODEL_ENV = "STEPTAP_GPU_SCALE_MODEL"
DEFAULT_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
CLIS = ("codex", "claude-code", "pi")
SAMPLING = "temperature=1.0,top_p=1.0"  # every call at the training values: nothing for truncation to drop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="a folder of Harbor tasks (steptap tasks list checks it)")
    p.add_argument("--agents", default=",".join(CLIS), help="the CLIs, each its own `steptap tasks run`")
    p.add_argument("--command", default="", help="a plain command as the only agent instead of the CLIs "
                   "(the instruction is its last argument)")
    p.add_argument("--sandbox", choices=("harbor", "local"), default="harbor")
    p.add_argument("--harbor-env", default="docker", help="Harbor's environment type (--sandbox harbor)")
    p.add_argument("--container-proxy", default="http://172.17.0.1:8400",
                   help="the proxy as the containers reach it; it listens there (--sandbox harbor)")
    gpu_recipe.add_arguments(p, MODEL_ENV, DEFAULT_MODEL, 65536, "vLLM's context (Claude Code's first prompt "
                             "alone is ~44k tokens)", CONFIG)
    p.add_argument("--rounds", type=int, default=20, help="groups per task and CLI")
    p.add_argument("--limit", type=int, default=0, help="only the first N tasks (0: all)")
    p.add_argument("-n", type=int, default=0, help="episodes per group (default: learner.toml's group_size)")
    p.add_argument("--batch-groups", type=int, default=0, help="override learner.toml's groups per update")
    p.add_argument("--run-dirs", default="", help="where each run keeps its state (default: steptap tasks "
                   "run's runs/tasks-DATASET-AGENT); the same command resumes")
    p.add_argument("--updates", type=int, default=0, help="stop after this many updates (0: the rounds)")
    return p


def side_by_side(commands: list[str]) -> str:
    """One shell command running ``commands`` at once; it waits for all, and fails if one failed."""
    start = " ".join(f"{c} & p{i}=$!;" for i, c in enumerate(commands))
    return f"{start} rc=0; " + " ".join(f'wait "$p{i}" || rc=1;' for i in range(len(commands))) + " exit $rc"


def driver(args: argparse.Namespace, n: int, concurrency: int) -> str:
    """The agents' shell command: one ``steptap tasks run`` per CLI, side by side."""
    names = ["command"] if args.command else [a.strip() for a in args.agents.split(",") if a.strip()]
    if not names or any(a not in CLIS for a in names if a != "command"):
        raise ValueError(f"--agents {args.agents!r}: a comma-separated list of {', '.join(CLIS)}")
    if args.command and args.sandbox == "harbor":
        raise ValueError("--command runs in --sandbox local (in a container the agent is Harbor's: --agents)")
    box = ["--sandbox", "harbor", "--harbor-env", args.harbor_env, "--container-proxy",
           args.container_proxy] if args.sandbox == "harbor" else []
    runs = []
    for name in names:
        cmd = [*STEPTAP, "tasks", "run", args.dataset, "-n", str(n), "--rounds", str(args.rounds),
               "--concurrency", str(concurrency), *box]
        cmd += ["--limit", str(args.limit)] if args.limit else []
        cmd += ["--run-dir", str(Path(args.run_dirs) / f"tasks-{name}")] if args.run_dirs else []
        cmd += ["--", *shlex.split(args.command)] if args.command else ["--agent", name]
        runs.append(shlex.join(cmd))
    return side_by_side(runs)


def up_command(args: argparse.Namespace, up_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``steptap up`` argv and the environment changes it runs with."""
    cfg = gpu_recipe.learner_settings(Path(args.config))
    groups = args.batch_groups or int(cfg.get("batch_groups", 8))
    n = args.n or int(cfg.get("group_size", 8))
    gpus = gpu_recipe.learner_gpus(args)
    clis = 1 if args.command else len([a for a in args.agents.split(",") if a.strip()])
    # each CLI's run keeps one update's episodes in flight, split between the CLIs
    agents = driver(args, n, max(n, groups * n // max(clis, 1)))
    learn = ["--workers", str(max(1, len(gpus)))]
    learn += ["--batch-groups", str(groups)] if args.batch_groups else []
    learn += ["--group-size", str(n)] if args.n else []
    argv = [*STEPTAP, "up", "--model", args.model or os.environ.get(MODEL_ENV) or DEFAULT_MODEL,
            "--config", args.config, "--task", "gpu_scale", "--agents", agents,
            f"--serve-args=--force-sampling {SAMPLING}",
            "--learn-args", shlex.join(learn + shlex.split(args.learn_args))]
    if args.sandbox == "harbor":  # the proxy where the containers reach it, and only there
        url = urlsplit(args.container_proxy)
        if not (url.scheme == "http" and url.hostname and url.port):
            raise ValueError(f"--container-proxy {args.container_proxy!r}: http://ADDRESS:PORT")
        argv += ["--host", url.hostname, "--port", str(url.port)]
    serve, env = gpu_recipe.serving(args, cfg, gpus, args.updates)
    return argv + serve + up_args, env


def main(argv: list[str] | None = None) -> int:
    return gpu_recipe.main(build_parser(), up_command, argv)


if __name__ == "__main__":
    sys.exit(main())
