"""The recipe's agent driver: pi on the training tasks as GRPO groups, the held-out tasks every few versions.

    steptap up ... --agents "python examples/pi_learns/loop.py data/pi --workdir runs/pi --eval-every 3"

Run as `steptap up`'s ``--agents`` command (it gets STEPTAP_URL and STEPTAP_CONTROL_TOKEN_FILE), it starts
``steptap tasks run DATA/train --agent pi -n N`` (each training task a group of N pi episodes in local
sandboxes; the learner trains complete groups as they come) and, at policy version 0 and every
``--eval-every`` versions after, ``steptap tasks run DATA/test --mode eval --agent pi -n 1 --limit L``: eval
sessions, never trained on. Each evaluation appends one row per policy version that answered to the metrics
file (``eval_version``, ``eval_accuracy`` = pass@1, ``eval_tool_call_rate``: episodes whose pi made at least
one tool call, ``eval_turns_mean``: model calls per episode), which ``steptap plot`` draws. Both runs keep
their state under ``--workdir``: the same command resumes them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from steptap.middleware.client import SteptapError, SyncSteptapClient, default_control_token

TASKS = [sys.executable, "-m", "steptap.middleware.cli", "tasks", "run"]


def _version(client: SyncSteptapClient) -> int:
    try:
        return int(client.health().get("policy_version", 0))
    except (OSError, ValueError, SteptapError):  # the proxy restarting: ask again at the next poll
        return -1


def eval_rows(summary: dict[str, Any], client: SyncSteptapClient, run_dir: Path) -> list[dict[str, Any]]:
    """One metrics row per policy version that answered: pass@1, the tool-call rate and turns per episode."""
    per: dict[int, dict[str, list[float]]] = {}
    for line in (run_dir / "state.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("status") != "finished" or rec.get("policy_version") is None:
            continue
        steps = client.get_session(rec["session_id"]).steps
        called = any((s.response or {}).get("tool_calls") for s in steps)
        row = per.setdefault(int(rec["policy_version"]), {"calls": [], "turns": []})
        row["calls"].append(1.0 if called else 0.0)
        row["turns"].append(float(len(steps)))
    out = []
    for version, figures in sorted(summary.get("by_version", {}).items(), key=lambda kv: int(kv[0])):
        got = per.get(int(version), {"calls": [], "turns": []})
        n = len(got["turns"])
        out.append({"time": time.time(), "eval_version": int(version), "eval_accuracy": figures["pass@1"],
                    "eval_episodes": figures["episodes"],
                    "eval_tool_call_rate": sum(got["calls"]) / n if n else None,
                    "eval_turns_mean": sum(got["turns"]) / n if n else None})
    return out


def evaluate(args: argparse.Namespace, client: SyncSteptapClient, version: int) -> None:
    run_dir = args.workdir / f"eval-v{version}"
    cmd = [*TASKS, str(args.data / "test"), "--agent", "pi", "--mode", "eval", "-n", "1", "--limit",
           str(args.eval_limit), "--concurrency", str(args.concurrency), "--run-dir", str(run_dir), "--json",
           "--agent-timeout", str(args.agent_timeout)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        print(f"loop: the evaluation at version {version} printed no summary (exit {out.returncode})",
              file=sys.stderr, flush=True)
        return
    rows = eval_rows(json.loads(lines[-1]), client, run_dir)
    with args.metrics_file.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        print(f"loop: held-out at version {r['eval_version']}: pass@1 {r['eval_accuracy']:.3f} over "
              f"{r['eval_episodes']} episodes, tool calls {r['eval_tool_call_rate']}, turns "
              f"{r['eval_turns_mean']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("data", type=Path, help="make_tasks.py's --out: train/ and test/")
    p.add_argument("--workdir", type=Path, default=Path("runs/pi"), help="steptap up's --workdir")
    p.add_argument("--metrics-file", type=Path, default=None, help="default: WORKDIR/metrics.jsonl")
    p.add_argument("-n", type=int, default=8, help="episodes per training task (the learner's group_size)")
    p.add_argument("--rounds", type=int, default=1, help="times through the training split")
    p.add_argument("--concurrency", type=int, default=4, help="pi episodes at once, per run")
    p.add_argument("--eval-every", type=int, default=3, help="policy versions between evaluations")
    p.add_argument("--eval-limit", type=int, default=50, help="held-out tasks per evaluation")
    p.add_argument("--agent-timeout", type=float, default=900.0,
                   help="seconds a pi episode may run (the tasks say 180: on a loaded 2-core CPU most pi "
                        "episodes ran past that mid-call, and a cut call trains nothing)")
    p.add_argument("--no-eval", action="store_true", help="training only")
    args = p.parse_args(argv)
    args.metrics_file = args.metrics_file or args.workdir / "metrics.jsonl"
    url = os.environ.get("STEPTAP_URL")
    if not url:
        p.error("no STEPTAP_URL: run this as `steptap up --agents`, or export the proxy's URL and token")
    client = SyncSteptapClient(url, default_control_token())
    train = subprocess.Popen([*TASKS, str(args.data / "train"), "--agent", "pi", "-n", str(args.n),
                              "--rounds", str(args.rounds), "--concurrency", str(args.concurrency),
                              "--run-dir", str(args.workdir / "train"),
                              "--agent-timeout", str(args.agent_timeout)])
    signal.signal(signal.SIGTERM, lambda *_: (train.terminate(), sys.exit(143)))
    next_eval = None if args.no_eval else 0
    try:
        while train.poll() is None:
            version = _version(client)
            if next_eval is not None and version >= next_eval:
                evaluate(args, client, version)
                next_eval = version + args.eval_every
            time.sleep(5)
        if next_eval is not None:
            evaluate(args, client, _version(client))  # the last version's figures
    finally:
        if train.poll() is None:
            train.terminate()
            train.wait()
    return int(train.returncode or 0)


if __name__ == "__main__":
    sys.exit(main())
