"""What recording an anonymous call costs, without HTTP: the capture and record path alone, in process.

    .venv/bin/python bench/record_path.py [--calls 20000] [--concurrency 32] [--dir /tmp]
    PYTHONPATH=/tmp/old .venv/bin/python bench/record_path.py   # another tree (a ``steptap`` package there)

C tasks each make calls in a closed loop, as ``relay`` makes them for a call in no session: the session
resolved, the call held (``SessionManager.call``), the recorded 32-token vLLM reply (bench/fixtures/)
decoded into its typed view and its step built (``replies.steps_from_view``), then recorded
(``SessionManager.record``: its one ``Trajectory`` record appended to a real, fsync'd ``TrajectoryLog`` in a
temp dir under ``--dir``).
Prints the process's CPU time per call (user + system, all threads: the log's writer thread too) and calls/s.
No aiohttp, no upstream, no load generator: the figure moves with the record path's own work, which the
proxy-wide bench (``proxy_overhead.py``) measures inside a much larger, noisier total. Run old and new trees
in turn, a few times each, on a machine as quiet as it gets; the bench checks that the log holds one record
per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import steptap.middleware
from steptap.middleware.config import ProxyConfig
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.proxy import capture, replies
from steptap.middleware.records import Trajectory
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.manager import SessionManager

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "chat_32_tokens.json"


async def run(calls: int, concurrency: int, where: str) -> int:
    fixture = json.loads(FIXTURE.read_text())
    data, request = fixture["reply"].encode(), fixture["request"]
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        log = await TrajectoryLog.open(str(Path(tmp) / "log"))
        manager = SessionManager(ProxyConfig(log=str(Path(tmp) / "log")), log, Metrics(), None, set())
        sampling = capture.sampling_of(request, False)
        anonymous = Identity(source="anonymous")

        async def one() -> None:
            session = await manager.resolve(anonymous, "127.0.0.1")
            async with manager.call(session, steps=1, size=len(data)):
                view = replies.reply_view(data)
                assert view is not None
                steps = replies.steps_from_view(view, None, request=request, sampling=sampling, model="tiny",
                                                served_model="tiny", backend="replay", started_at=time.time(),
                                                policy_version=0, latency_s=0.001)
                assert steps is not None
                await manager.record(session, steps)

        async def worker(n: int) -> None:
            for _ in range(n):
                await one()

        warm = 20
        await asyncio.gather(*(worker(warm) for _ in range(concurrency)))
        each = max(1, calls // concurrency)
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker(each) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        done = each * concurrency
        await log.close()
        records = sum(isinstance(r, Trajectory) and r.anonymous and len(r.steps) == 1
                      for r in (await TrajectoryLog.open(str(Path(tmp) / "log"), readonly=True)).records())
        ok = records == done + warm * concurrency
        print(f"{Path(steptap.middleware.__file__).parents[1]}: {cpu / done * 1e6:.1f} us CPU a call, "
              f"{done / wall:.0f} calls/s at c={concurrency} ({done} calls; load {os.getloadavg()[0]:.2f}); "
              f"log: {records} one-step anonymous trajectories{'' if ok else ', NOT one per call'}")
        return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the log's temp dir goes")
    args = parser.parse_args()
    return asyncio.run(run(args.calls, args.concurrency, args.dir))


if __name__ == "__main__":
    raise SystemExit(main())
