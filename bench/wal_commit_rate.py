"""The trajectory log's group commit, timed: appends/s and syncs per append at each concurrency, for a fixed
number of seconds each. Moved out of tests/unit (a test asserts what a count shows, never a rate; the counts
are ``tests/unit/test_wal.py``'s ``test_lone_append_is_synced_at_once`` and
``test_group_commit_groups_under_concurrency``).

    .venv/bin/python bench/wal_commit_rate.py [--dir DIR] [--seconds 2] [--concurrency 1 64]

``--dir`` is where the log lives (the disk whose sync is measured; a temp dir by default, removed after).
Exits 1 if a check fails: alone, every append is its own sync; under load (c >= 32), fewer than 0.25 syncs per
append. A rate is printed, never checked.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import Step, Trajectory

RECORD = Trajectory(id="x", status="finished", steps=[
    Step(prompt_token_ids=list(range(300)), response_token_ids=list(range(32)), response_logprobs=[-0.5] * 32)
    for _ in range(4)])


async def run(directory: str, concurrency: int, seconds: float) -> tuple[float, float, float]:
    """(appends/s, syncs/append, bytes/record) over ``seconds`` of ``concurrency`` appenders."""
    log = await TrajectoryLog.open(directory)
    commits0, n = log.stats.commits, 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal n
        while time.monotonic() < stop:
            await log.append(RECORD)
            n += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - t0
    result = n / elapsed, (log.stats.commits - commits0) / n, log.stats.bytes / n
    await log.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where the logs are written (a temp dir by default)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args(argv)
    failed = False
    for c in args.concurrency:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            rate, per, size = asyncio.run(run(d, c, args.seconds))
        print(f"concurrency {c}: {rate:.0f} appends/s, {per:.3f} syncs/append, {size:.0f} B/record")
        if (c == 1 and per != 1.0) or (c >= 32 and per >= 0.25):
            print(f"  FAILED: syncs/append {per:.3f} at concurrency {c}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
