"""The files a `steptap up` run leaves in its work directory for operators, scripts and tests: ``stack.json``
(where the running stack is), ``pids.json``, ``summary.json``. ``RunFiles`` is a mixin of ``Up`` (up.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steptap.middleware.client import TOKEN_FILE_ENV, SteptapError, SyncSteptapClient
from steptap.middleware.files import atomic_write  # readers poll these files: never half a file
from steptap.middleware.launch.supervise import Child, Supervisor
from steptap.middleware.launch.view import StatusBoard

if TYPE_CHECKING:
    import argparse


class RunFiles:
    """``Up``'s files in its work directory."""

    args: argparse.Namespace
    workdir: Path
    metrics_path: Path
    token: str
    token_file: Path
    proxy_url: str
    backend: str
    sup: Supervisor
    stop_reason: str | None
    t_start: float
    t_ready: float | None
    model_dir: str
    served_model: str
    if TYPE_CHECKING:  # Up's
        def _log(self, msg: str) -> None: ...

    def _announce(self) -> None:
        assert self.t_ready is not None  # Up.run sets it just before
        lines = [
            f"ready in {self.t_ready - self.t_start:.0f} s; work directory {self.workdir}",
            f"  export OPENAI_BASE_URL={self.proxy_url}/v1",
            f"  export {TOKEN_FILE_ENV}={self.token_file}   # the control token (0600), for your driver",
            f"  model: {self.served_model or self.model_dir}",
        ]
        try:  # a one-time code, in the fragment: it never reaches a server's log, and is spent once used
            link = SyncSteptapClient(self.proxy_url, self.token, timeout_s=10).console_link()
            lines.append(f"  console: {link}   (a one-time login link)")
        except (OSError, ValueError, KeyError, SteptapError) as exc:
            lines.append(f"  console: {self.proxy_url}/console/ (no login link: {exc})")
        for line in lines:
            self._log(line)
        token_file = self.token_file
        # Where scripts and tests find the running stack (the token stays in its own 0600 file).
        stack = {
            "proxy_url": self.proxy_url,
            "openai_base_url": f"{self.proxy_url}/v1",
            "backend": self.backend,
            "model": self.served_model,
            "model_dir": self.model_dir,
            "pid": os.getpid(),
            "control_token_file": str(token_file),
            "metrics": str(self.metrics_path),
        }
        atomic_write(self.workdir / "stack.json", json.dumps(stack, indent=2) + "\n")

    def _write_pids(self) -> None:
        """Every child's pid, rewritten as each starts (for operators and tests)."""
        pids = {c.name: c.pid for c in self.sup.children if c.pid}
        atomic_write(self.workdir / "pids.json", json.dumps({"up": os.getpid(), **pids}) + "\n")

    def _summary(self, failed: Child | None) -> dict[str, Any]:
        board = getattr(self, "board", None) or StatusBoard(self.proxy_url, self.metrics_path, self.token)
        board.read_metrics()
        learn_s = (time.time() - self.t_ready) if self.t_ready else 0.0
        return {
            "task": self.args.task,
            "model": self.served_model or self.model_dir,
            "model_dir": self.model_dir,
            "workdir": str(self.workdir),
            "startup_s": round((self.t_ready or time.time()) - self.t_start, 1),
            "learning_minutes": round(learn_s / 60.0, 2),
            "updates": board.updates,
            "start_reward": board.first_reward(2),
            "end_reward": board.recent_reward(3),
            "reward_by_policy_version": board.reward_by_version(),
            "policy_versions": board.policy_version,
            "stop_reason": self.stop_reason,
            # what the run's health names at the end (docs/health.md): empty for a healthy run
            "health": [f._asdict() for f in board.findings()],
            "failed": failed.name if failed else None,
            "metrics": str(self.metrics_path),
        }
