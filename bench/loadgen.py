"""The benchmark's load generator: a closed loop of aiohttp clients in its own process.

Run as a worker (``python bench/loadgen.py``): it reads one JSON command per line on stdin and answers one JSON
result per line on stdout, so the orchestrator keeps one warm process for every run and the servers never
share its event loop. A command:

    {"url": ..., "body": "<request JSON>", "headers": {...}, "concurrency": 32,
     "warmup": 50, "requests": 2000, "seconds": 3.0}

``concurrency`` workers each send a request, read the whole reply, and send the next, over one keep-alive
pool: first ``warmup`` calls (not timed), then until ``requests`` calls or ``seconds`` have passed, whichever
comes first. ``url`` may hold ``{worker}``: each worker then calls its own URL (one agent session each). The
result holds calls, errors, the elapsed time, every latency (ms, request sent to last byte
read), the CPU time the processes named in ``watch_pids`` used during the timed phase, and the distinct reply
bodies seen with their counts (bounded), which the orchestrator checks after the
run so checking costs nothing while timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import use_uvloop  # noqa: E402

MAX_DISTINCT = 64  # distinct bodies kept for checking; more means the proxy varies replies per call
REQUEST_TIMEOUT_S = 60.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (``/proc/PID/stat``, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK")


async def run(cmd: dict[str, Any]) -> dict[str, Any]:
    url, body = cmd["url"], cmd["body"].encode()
    headers = {"Content-Type": "application/json", **cmd.get("headers", {})}
    concurrency = int(cmd["concurrency"])
    limit_n, limit_s = int(cmd["requests"]), float(cmd["seconds"])
    bodies: Counter[bytes] = Counter()
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    latencies: list[float] = []
    sent = 0

    connector = aiohttp.TCPConnector(limit=concurrency, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20,
                                     auto_decompress=False) as http:

        async def one(target: str) -> float | None:
            nonlocal sent
            sent += 1
            t0 = time.perf_counter()
            try:
                async with http.post(target, data=body, headers=headers) as r:
                    data = await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return None
            dt = (time.perf_counter() - t0) * 1000.0
            statuses[status] += 1
            if status != 200:
                errors.append(f"HTTP {status}: {data[:300]!r}")
            if data in bodies or len(bodies) < MAX_DISTINCT:
                bodies[data] += 1
            else:
                bodies[b"<more distinct bodies>"] += 1
            return dt

        # Warm-up: connections opened, caches and JITs (none) warm; not timed, but counted as sent.
        warm = int(cmd.get("warmup", 0))
        left = [warm]

        async def warm_worker(i: int) -> None:
            while left[0] > 0:
                left[0] -= 1
                await one(url.format(worker=i))

        await asyncio.gather(*(warm_worker(i) for i in range(concurrency)))
        warm_errors = len(errors)
        bodies.clear()
        statuses.clear()

        watch = [int(p) for p in cmd.get("watch_pids", [])]
        cpu0 = [cpu_seconds(p) for p in watch]
        done = [0]
        start = time.perf_counter()
        deadline = start + limit_s
        last = [start]

        async def worker(i: int) -> None:
            target = url.format(worker=i)
            while done[0] < limit_n and time.perf_counter() < deadline:
                done[0] += 1
                dt = await one(target)
                last[0] = time.perf_counter()
                if dt is not None:
                    latencies.append(dt)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = last[0] - start
        cpu = [cpu_seconds(p) - c0 for p, c0 in zip(watch, cpu0)]

    return {
        "sent": sent,
        "calls": len(latencies),
        "errors": len(errors) - warm_errors,
        "warmup_errors": warm_errors,
        "error_samples": errors[:5],
        "statuses": {str(k): v for k, v in statuses.items()},
        "elapsed_s": elapsed,
        "latencies_ms": latencies,
        "cpu_s": dict(zip(map(str, watch), cpu)),  # CPU (user+system, all threads) each watched pid used
        "bodies": [[b.decode("utf-8", "replace"), n] for b, n in bodies.most_common()],
    }


async def serve_stdin() -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        cmd = json.loads(line)
        if cmd.get("quit"):
            return
        result = await run(cmd)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def main() -> int:
    use_uvloop()
    print(json.dumps({"ready": True, "port": 0}), flush=True)
    asyncio.run(serve_stdin())
    return 0


if __name__ == "__main__":
    sys.exit(main())
