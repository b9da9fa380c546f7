"""The files a `steptap up` run leaves in its work directory for operators, scripts and tests: ``stack.json``
(where the running stack is), ``pids.json``, ``summary.json``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from steptap.middleware.client import TOKEN_FILE_ENV, SteptapError, SyncSteptapClient
from steptap.middleware.files import atomic_write  # readers poll these files: never half a file
from steptap.middleware.launch.supervise import Child, Supervisor
from steptap.middleware.launch.view import StatusBoard


class RunFiles:
    """The files of one run in its ``workdir``: the pids of what ``sup`` started, where the stack is, and its
    summary."""

    def __init__(self, workdir: Path, sup: Supervisor) -> None:
        self.workdir = workdir
        self.sup = sup

    def write_pids(self) -> None:
        """Every child's pid, rewritten as each starts (for operators and tests)."""
        pids = {c.name: c.pid for c in self.sup.children if c.pid}
        atomic_write(self.workdir / "pids.json", json.dumps({"up": os.getpid(), **pids}) + "\n")

    def write_stack(self, stack: Stack) -> None:
        """``stack.json``: where scripts and tests find the running stack (the token stays in its own 0600
        file)."""
        body = {"proxy_url": stack.proxy_url, "openai_base_url": f"{stack.proxy_url}/v1",
                "backend": stack.backend, "model": stack.model, "model_dir": stack.model_dir,
                "pid": os.getpid(), "control_token_file": stack.control_token_file, "metrics": stack.metrics}
        atomic_write(self.workdir / "stack.json", json.dumps(body, indent=2) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.workdir / "summary.json"
        atomic_write(path, json.dumps(summary, indent=2) + "\n")
        return path


def announce(stack: Stack) -> list[str]:
    """What tells the operator where the stack is, with a one-time console login link."""
    lines = [
        f"  export OPENAI_BASE_URL={stack.proxy_url}/v1",
        f"  export {TOKEN_FILE_ENV}={stack.control_token_file}   # the control token (0600), for your driver",
        f"  model: {stack.model or stack.model_dir}",
        f"  seed: {stack.seed}   (the learner's and vLLM's; --seed {stack.seed} gives them again)",
    ]
    try:  # a one-time code, in the fragment: it never reaches a server's log, and is spent once used
        link = SyncSteptapClient(stack.proxy_url, stack.token, timeout_s=10).console_link()
        lines.append(f"  console: {link}   (a one-time login link: it expires in ten minutes)")
    except (OSError, ValueError, KeyError, SteptapError) as exc:
        lines.append(f"  console: {stack.proxy_url}/console/ (no login link: {exc})")
    return lines


class Stack(msgspec.Struct, kw_only=True):
    """Where a started stack is: what ``stack.json`` holds (and the token, which it does not)."""

    proxy_url: str
    backend: str
    model: str
    model_dir: str
    control_token_file: str
    metrics: str
    token: str
    seed: int


def summary(board: StatusBoard, *, task: str | None, model: str, model_dir: str, workdir: Path, seed: int,
            t_start: float, t_ready: float | None, stop_reason: str | None, failed: Child | None,
            metrics: Path) -> dict[str, Any]:
    """``summary.json``: what the run did, read from the learner's metrics at its end."""
    board.read_metrics()
    learn_s = (time.time() - t_ready) if t_ready else 0.0
    return {
        "task": task,
        "model": model or model_dir,
        "model_dir": model_dir,
        "workdir": str(workdir),
        "seed": seed,
        "startup_s": round((t_ready or time.time()) - t_start, 1),
        "learning_minutes": round(learn_s / 60.0, 2),
        "updates": board.updates,
        "start_reward": board.first_reward(2),
        "end_reward": board.recent_reward(3),
        "reward_by_policy_version": board.reward_by_version(),
        "policy_versions": board.policy_version,
        "stop_reason": stop_reason,
        # what the run's health names at the end (docs/health.md): empty for a healthy run
        "health": [f._asdict() for f in board.findings()],
        "failed": failed.name if failed else None,
        "metrics": str(metrics),
    }
