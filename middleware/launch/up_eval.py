"""`steptap up --eval`: the evaluator beside the learner (`steptap eval --every`, a child that may exit) and,
when a run ends on its update count, the evaluation of the version it ended on before the stack stops."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from steptap.middleware.client import TOKEN_ENV
from steptap.middleware.launch.supervise import Child
from steptap.middleware.launch.up_parser import STEPTAP, _split

LAST_EVAL_TIMEOUT_S = 3600.0  # a run's last evaluation (pi's 50 tasks: 18 minutes on 2 cores)


def eval_child(args: argparse.Namespace, proxy_url: str, token: str, served_model: str, metrics_path: Path,
               logs: Path) -> Child:
    """``steptap eval DATA --every N``, appending its reports to the learner's metrics file."""
    argv = [*STEPTAP, "eval", args.eval, "--proxy", proxy_url]
    argv += ["--every", str(args.eval_every), "--metrics-file", str(metrics_path)]
    argv += _split(args.eval_args)
    env = {**os.environ, TOKEN_ENV: token, "STEPTAP_MODEL": served_model}
    return Child("eval", argv, logs / "eval.log", env=env, may_exit=True)


def evaluate_last(child: Child | None, log: Callable[[str], None], interrupted: Callable[[], bool]) -> None:
    """Have the evaluator evaluate the version serving now (it does on SIGUSR1, unless it just did, then
    exits) and wait for it: that figure is the run's result. Ctrl-C (``interrupted``), the evaluator's exit or
    ``LAST_EVAL_TIMEOUT_S`` ends the wait."""
    if child is None or child.proc is None or child.returncode is not None:
        return
    log(f"evaluating the last version before stopping (log: {child.log_path}; Ctrl-C stops now)")
    child.proc.send_signal(signal.SIGUSR1)
    deadline = time.time() + LAST_EVAL_TIMEOUT_S
    while child.returncode is None and time.time() < deadline and not interrupted():
        time.sleep(0.5)
