"""``steptap doctor RUN_DIR``: a run's health after the fact, from its files (docs/health.md).

    steptap doctor runs/up-20250101-120000              # a `steptap up` work directory
    steptap doctor --metrics m.jsonl --log ./steptap-log   # a learner's metrics file and a proxy's log

It reads the learner's metrics file (its batch rows: groups with reward variance, tokens in the loss and why
the rest were not, replies cut, the logprob gap to vLLM, version lag; and the health check's stop, if it
stopped the run) and the trajectory log, offline and read-only (sessions opened, closed, left open, held for
a pending reward; replies cut by max_tokens), then names what the run's health rules name
(middleware/health.py: the same the learner's check, the console, ``/metrics`` and ``steptap up`` apply), in
plain words. Times are measured to the log's last record, so a finished run reads as it ended.

Exit code: 0 nothing to name, 1 warnings, 3 a stop (nothing could be learned), 2 no run there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from steptap.middleware.health import (
    DEFAULTS,
    Finding,
    ProxyFigures,
    Thresholds,
    batch_rows,
    diagnose,
    summary,
)
from steptap.middleware.records import Held, HeldDropped, SessionOpened, Step, Trajectory

STOP_EXIT = 3  # the learner's own exit code for a stop


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of a learner's metrics file (lines that are not JSON objects skipped)."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def log_figures(location: str) -> ProxyFigures:
    """The proxy's figures as its log tells them, at its last record."""
    from steptap.middleware.log.offline import LogReader

    opened, closed, held = 0, {"finished": 0, "aborted": 0}, {}
    active: dict[str, float] = {}  # an open session's latest activity (unix seconds)
    seen: set[tuple[str, float]] = set()  # a trajectory written twice (a restart re-finalized it) counts once
    replies = cut = 0
    end, error = 0.0, ""
    for r in LogReader(location).records():
        if isinstance(r, SessionOpened) and not r.anonymous:
            opened += 1
            active[r.trajectory_id] = r.at
            end = max(end, r.at)
        elif isinstance(r, Step):
            replies += 1
            cut += r.finish_reason == "length"
            done = r.started_at + r.latency_s
            end = max(end, done)
            if r.trajectory_id in active:
                active[r.trajectory_id] = max(active[r.trajectory_id], done)
        elif isinstance(r, Held):
            held[r.trajectory.id] = r.at
            active.pop(r.trajectory.id, None)
            end = max(end, r.at)
        elif isinstance(r, HeldDropped):
            held.pop(r.trajectory_id, None)
            closed["aborted"] += 1
            end = max(end, r.at)
        elif isinstance(r, Trajectory) and r.status != "running" and (r.id, r.created_at) not in seen:
            seen.add((r.id, r.created_at))
            held.pop(r.id, None)
            active.pop(r.id, None)
            closed["finished" if r.status == "finished" else "aborted"] += 1
            if r.status != "finished" and r.error:
                error = r.error
            end = max(end, r.finished_at or 0.0)
    return ProxyFigures(opened=opened, finished=closed["finished"], aborted=closed["aborted"],
                        open=len(active), held=len(held),
                        idle_s=max((end - t for t in active.values()), default=0.0),
                        held_s=max((end - t for t in held.values()), default=0.0), replies=replies, cut=cut,
                        error=error)


def diagnosis(rows: list[dict[str, Any]], proxy: ProxyFigures | None, t: Thresholds = DEFAULTS
              ) -> dict[str, Any]:
    """What the run's files say: the figures, the findings, the learner's stop."""
    stop = next((r for r in reversed(rows) if "health_stop" in r), None)
    batches = batch_rows(rows)
    return {
        "batches": len(batches),
        "updates": sum("update" in r for r in batches),
        "learner": summary(batches),
        "proxy": None if proxy is None else proxy._asdict(),
        "stopped": None if stop is None else {"cause": stop.get("cause"), "text": stop["health_stop"]},
        "findings": [f._asdict() for f in diagnose(batches, proxy, t)],
    }


def render(d: dict[str, Any]) -> str:
    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    lines = []
    s = d["learner"]
    if s:
        gap = "-" if s["logprob_gap"] is None else f"{s['logprob_gap']:.3g}"
        lines.append(f"learner: {d['batches']} batches ({d['updates']} updates); the last: groups with "
                     f"reward variance {pct(s['groups_varied'])}, tokens in the loss "
                     f"{pct(s['tokens_trained'])}, "
                     f"replies cut {pct(s['replies_cut'])}, logprob gap {gap}, version lag "
                     f"{'-' if s['version_lag'] is None else s['version_lag']}")
    else:
        lines.append("learner: no batch in its metrics file")
    p = d["proxy"]
    if p is not None:
        lines.append(f"proxy (its log): {p['opened']} sessions opened, {p['finished']} finished, "
                     f"{p['aborted']} aborted, {p['open']} left open, {p['held']} waiting for a reward; "
                     f"{p['replies']} replies, {p['cut']} cut by max_tokens")
    if d["stopped"]:
        lines.append(f"the learner's health check stopped the run: {d['stopped']['text']}")
    for f in d["findings"]:
        lines.append(f"{f['level']:<5} {f['cause']}: {f['text']}")
    if not d["findings"]:
        lines.append("nothing to name: the run could learn")
    return "\n".join(lines)


def _paths(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    run = Path(args.run_dir) if args.run_dir else None
    metrics = Path(args.metrics) if args.metrics else run / "metrics.jsonl" if run else None
    log = args.log or (str(run / "trajectories") if run and (run / "trajectories").is_dir() else None)
    return metrics, log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="steptap doctor",
                                description="a run's health after the fact, from its files (docs/health.md)")
    p.add_argument("run_dir", nargs="?", help="a `steptap up` work directory (metrics.jsonl, trajectories/)")
    p.add_argument("--metrics", help="the learner's metrics file (default RUN_DIR/metrics.jsonl)")
    p.add_argument("--log", help="the proxy's trajectory log, a directory or fsspec URL (default "
                   "RUN_DIR/trajectories)")
    p.add_argument("--window", type=int, default=DEFAULTS.window, help="batches a stop needs")
    p.add_argument("--gap-nats", type=float, default=DEFAULTS.gap_nats, help="the largest mean logprob gap")
    p.add_argument("--stall-s", type=float, default=DEFAULTS.stall_s,
                   help="an open session silent this long, a pending reward this old, is named")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    metrics, log = _paths(args)
    if metrics is None and log is None:
        p.error("give RUN_DIR, or --metrics and/or --log")
    try:
        rows = read_rows(metrics) if metrics is not None and metrics.exists() else []
        proxy = log_figures(log) if log else None
    except (OSError, ValueError) as exc:
        p.exit(2, f"steptap doctor: {exc}\n")
    if not rows and proxy is None:
        p.exit(2, f"steptap doctor: no metrics file ({metrics}) and no log: nothing to read\n")
    t = Thresholds(window=args.window, gap_nats=args.gap_nats, stall_s=args.stall_s)
    d = diagnosis(rows, proxy, t)
    print(json.dumps(d, indent=2) if args.json else render(d))
    found: list[Finding] = [Finding(**f) for f in d["findings"]]
    return STOP_EXIT if any(f.level == "stop" for f in found) or d["stopped"] else 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
