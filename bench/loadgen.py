"""The benchmark's load generator: a closed loop of aiohttp clients in its own process.

Run as a worker (``python bench/loadgen.py``): it reads one JSON command per line on stdin and answers one
JSON result per line on stdout, so the orchestrator keeps one warm process for every run and the servers never
share its event loop. A command:

    {"url": ..., "body": "<request JSON>", "headers": {...}, "concurrency": 32,
     "warmup": 50, "requests": 2000, "seconds": 3.0}

``concurrency`` workers each send a request, read the whole reply, and send the next, over one keep-alive
pool: first ``warmup`` calls (not timed), then until ``requests`` calls or ``seconds`` have passed, whichever
comes first. With ``"targets": [{"name", "url"}, ...]`` instead of ``url``, each worker calls the targets in
turn, call after call (the orchestrator does this at concurrency 1, so every target sees the same noise);
``"block": B`` makes it B timed calls to one target before the next (its caches warm between them).
A URL may hold ``{worker}``: each worker then calls its own URL (one agent session each).

The result holds, per target, calls, errors, every latency (ms, request sent to last byte read) and the
distinct reply bodies seen with their counts (bounded), which the orchestrator checks after the run so that
checking costs nothing while timing; and the elapsed time and the CPU time that the processes named in
``watch_pids`` used during the timed phase.
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
from procs import use_uvloop

MAX_DISTINCT = 64  # distinct bodies kept for checking; more means the proxy varies replies per call
REQUEST_TIMEOUT_S = 60.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants, all their threads (``/proc/PID/stat``,
    clock ticks): ``steptap serve --workers N`` serves from child processes."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    own = (int(fields[11]) + int(fields[12])) / _TICKS
    return own + sum(_gone_is_zero(child) for child in _children(pid))


def _gone_is_zero(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except (FileNotFoundError, ProcessLookupError):  # exited since its parent listed it
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):  # gone since its parent listed it
        return []


_TICKS = os.sysconf("SC_CLK_TCK")


class _Tally:
    """What one target's calls gave: latencies, statuses, errors, distinct bodies."""

    def __init__(self) -> None:
        self.sent = 0
        self.bodies: Counter[bytes] = Counter()
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []
        self.latencies: list[float] = []

    def reset(self) -> None:
        self.bodies.clear()
        self.statuses.clear()
        self.latencies.clear()

    def result(self, warm_errors: int) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "calls": len(self.latencies),
            "errors": len(self.errors) - warm_errors,
            "warmup_errors": warm_errors,
            "error_samples": self.errors[:5],
            "statuses": {str(k): v for k, v in self.statuses.items()},
            "latencies_ms": self.latencies,
            "bodies": [[b.decode("utf-8", "replace"), n] for b, n in self.bodies.most_common()],
        }


async def run(cmd: dict[str, Any]) -> dict[str, Any]:
    """One run. ``targets`` (``[{"name", "url"}, ...]``) are called in turn, call after call, so that at
    concurrency 1 every target sees the same moment-to-moment machine noise; ``url`` alone is one target."""
    targets = cmd.get("targets") or [{"name": "_", "url": cmd["url"]}]
    names = [t["name"] for t in targets]
    body = cmd["body"].encode()
    headers = {"Content-Type": "application/json", **cmd.get("headers", {})}
    concurrency = int(cmd["concurrency"])
    block = max(1, int(cmd.get("block", 1)))  # calls to one target before the next
    limit_n, limit_s = int(cmd["requests"]), float(cmd["seconds"])
    tallies = {n: _Tally() for n in names}

    connector = aiohttp.TCPConnector(limit=concurrency * len(targets), ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=2**20, auto_decompress=False
    ) as http:

        async def one(name: str, url: str, timed: bool) -> None:
            tally = tallies[name]
            tally.sent += 1
            t0 = time.perf_counter()
            try:
                async with http.post(url, data=body, headers=headers) as r:
                    data = await r.read()
                    status = r.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                tally.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return
            dt = (time.perf_counter() - t0) * 1000.0
            tally.statuses[status] += 1
            if status != 200:
                tally.errors.append(f"HTTP {status}: {data[:300]!r}")
            if data in tally.bodies or len(tally.bodies) < MAX_DISTINCT:
                tally.bodies[data] += 1
            else:
                tally.bodies[b"<more distinct bodies>"] += 1
            if timed:
                tally.latencies.append(dt)

        def urls_of(i: int) -> list[tuple[str, str]]:
            return [(t["name"], t["url"].format(worker=i)) for t in targets]

        # Warm-up: connections opened, caches warm; not timed, but counted as sent.
        left = [int(cmd.get("warmup", 0)) * len(targets)]

        async def warm_worker(i: int) -> None:
            mine, k = urls_of(i), i
            while left[0] > 0:
                left[0] -= 1
                await one(*mine[k % len(mine)], timed=False)  # each target its warm-up share
                k += 1

        await asyncio.gather(*(warm_worker(i) for i in range(concurrency)))
        warm_errors = {n: len(t.errors) for n, t in tallies.items()}
        for t in tallies.values():
            t.reset()

        watch = [int(p) for p in cmd.get("watch_pids", [])]
        cpu0 = [cpu_seconds(p) for p in watch]
        done = [0]
        start = time.perf_counter()
        deadline = start + limit_s
        last = [start]

        async def worker(i: int) -> None:
            mine, k = urls_of(i), i
            while done[0] < limit_n and time.perf_counter() < deadline:
                done[0] += 1
                await one(*mine[k // block % len(mine)], timed=True)
                k += 1
                last[0] = time.perf_counter()

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = last[0] - start
        cpu = [cpu_seconds(p) - c0 for p, c0 in zip(watch, cpu0, strict=False)]

    per_target = {n: t.result(warm_errors[n]) for n, t in tallies.items()}
    out: dict[str, Any] = {
        "elapsed_s": elapsed,
        # CPU (user+system, all threads) each watched pid used
        "cpu_s": dict(zip(map(str, watch), cpu, strict=False)),
        "targets": per_target,
    }
    if len(targets) == 1:
        out.update(per_target[names[0]])
    return out


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
