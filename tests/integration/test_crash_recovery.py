"""Crash recovery (issue 3, first Must-show): SIGKILL the writer mid-load, restart on the same log, and prove
nothing acknowledged was lost.

1. The log alone: a writer process appends from many tasks and prints each record once ``append`` returned;
   it is killed mid-load, several times, and every printed record must be in the reopened log.
2. The whole proxy: several concurrent agents run sessions through ``steptap serve`` in front of the real vLLM
   server while a consumer follows the stream and acknowledges; the proxy is SIGKILLed mid-load (twice) and
   restarted on the same log. Every step whose reply reached an agent must be in the log, and every finished
   trajectory must reach the consumer exactly once after de-duplication, including those finished after the
   restarts.

Both run with each log durability setting (`fsync`, `os`): a SIGKILL of the proxy is not a crash of the
machine, so `os` must lose nothing replied either.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Backend, free_port

from steptap.middleware.client import SteptapClient, SteptapError
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import Step, Trajectory

_WRITER = r"""
import asyncio, sys
from steptap.middleware.records import Step, Trajectory
from steptap.middleware.log.wal import TrajectoryLog

async def main(path, prefix, durability):
    log = await TrajectoryLog.open(path, segment_bytes=256 * 1024, durability=durability)
    async def worker(w):
        for i in range(10**9):
            tid = f"{prefix}-{w}-{i}"
            cursor = await log.append(Trajectory(id=tid, status="finished", steps=[
                Step(trajectory_id=tid, prompt_token_ids=list(range(200)), response_token_ids=[w, i])]))
            sys.stdout.write(f"ACK {tid} {cursor}\n")
            sys.stdout.flush()
    await asyncio.gather(*(worker(w) for w in range(32)))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_sigkill_of_a_log_writer_loses_nothing_acknowledged(tmp_path: Path, durability: str) -> None:
    logdir = tmp_path / "log"
    acked: dict[str, str] = {}
    torn = 0
    for rnd in range(3):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WRITER, str(logdir), f"r{rnd}", durability, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        n = 0
        try:
            while n < 400 + 150 * rnd:  # kill at a different point each round
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                assert line, "the writer died on its own"
                _, tid, cursor = line.decode().split()
                acked[tid] = cursor
                n += 1
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        # Lines already in the pipe were acknowledged too (append had returned before they were written).
        rest = await proc.stdout.read()
        for line in rest.decode().splitlines():
            if line.startswith("ACK ") and len(line.split()) == 3:
                _, tid, cursor = line.split()
                acked[tid] = cursor

        log = await TrajectoryLog.open(str(logdir), segment_bytes=256 * 1024)
        try:
            torn += log.stats.torn_records
            logged = {r.id: r for r in log.records() if isinstance(r, Trajectory)}
            missing = set(acked) - set(logged)
            assert not missing, (
                f"round {rnd}: {len(missing)} acknowledged records lost, e.g. {sorted(missing)[:3]}"
            )
            assert all(logged[t].steps[0].prompt_token_ids == list(range(200)) for t in acked)
            # Cursors handed out are real positions: following from one gives what came after it.
            some = sorted(acked, key=lambda t: tuple(map(int, acked[t].split(":"))))[len(acked) // 2]
            async for cur, _traj in log.follow(acked[some], until_idle=0):
                assert tuple(map(int, cur.split(":"))) > tuple(map(int, acked[some].split(":")))
                break
        finally:
            await log.close()
    assert len(acked) >= 1200
    print(f"\nlog writer: {len(acked)} acknowledged records survived 3 SIGKILLs; torn tails cut: {torn}")


# ---- the whole proxy ---------------------------------------------------------------------------------------

TOKEN = "stc-crash-test"
N_AGENTS = 6
CALLS_PER_SESSION = 3


class Proxy:
    """``steptap serve`` as a subprocess on a fixed port and log directory; killable and restartable."""

    def __init__(self, backend: str, logdir: Path, outdir: Path, durability: str = "fsync") -> None:
        self.backend, self.logdir, self.outdir, self.durability = backend, logdir, outdir, durability
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        out = open(self.outdir / f"proxy-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "steptap.middleware.cli", "serve", "--backend", self.backend, "--log",
             str(self.logdir), "--port", str(self.port), "--control-token", TOKEN,
             "--log-durability", self.durability],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "STEPTAP_LOG_LEVEL": "INFO"})
        out.close()
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.output()
                try:
                    async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"proxy did not come up:\n{self.output()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.outdir.glob("proxy-*.log")))


@dataclass
class Ledger:
    """What the agents saw: the replies that reached them, and the sessions whose finish was confirmed."""

    replies: list[tuple[str, list[int], str]] = field(default_factory=list)  # (session, token ids, content)
    finished: set[str] = field(default_factory=set)
    opened: int = 0
    retried_calls: int = 0
    spanned: set[str] = field(default_factory=set)  # sessions continued across a proxy restart
    inflight: int = 0  # chat calls in flight right now
    inflight_at_kill: list[int] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


_RETRY = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, ConnectionError)


async def _agent(aid: int, proxy: Proxy, model: str, ledger: Ledger, stop: asyncio.Event) -> None:
    """Open a session, make a few chat calls (retrying a call cut by the crash on the same session, which the
    proxy rebuilds from its log), finish it with a reward; repeat until told to stop."""
    ctl = SteptapClient(proxy.url, TOKEN, timeout_s=60)
    http = aiohttp.ClientSession()
    try:
        while not stop.is_set():
            try:
                info = await ctl.open_session(metadata={"agent": aid})
            except _RETRY:
                await asyncio.sleep(0.2)
                continue
            except SteptapError as exc:
                if exc.status < 500:
                    raise
                await asyncio.sleep(0.2)
                continue
            ledger.opened += 1
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"agent {aid}: count"}]
            calls = 0
            while calls < CALLS_PER_SESSION:
                body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 1.0,
                        "return_token_ids": True}
                ledger.inflight += 1
                try:
                    async with http.post(f"{info.base_url}/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {info.api_key}"},
                                         timeout=aiohttp.ClientTimeout(total=60)) as r:
                        if r.status >= 500:
                            raise aiohttp.ClientConnectionError(f"status {r.status}")
                        reply = await r.json()
                        if r.status != 200:
                            ledger.unexpected.append(f"chat {info.id}: {r.status} {reply}")
                            break
                except _RETRY:
                    ledger.retried_calls += 1
                    ledger.spanned.add(info.id)
                    await asyncio.sleep(0.2)
                    continue
                finally:
                    ledger.inflight -= 1
                choice = reply["choices"][0]
                content = choice["message"]["content"] or ""
                ledger.replies.append((info.id, list(choice["token_ids"]), content))
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
                calls += 1
            while True:
                try:
                    await ctl.finish(info.id, reward=float(aid))
                    ledger.finished.add(info.id)
                    break
                except _RETRY:
                    await asyncio.sleep(0.2)
                except SteptapError as exc:
                    if exc.status >= 500:
                        await asyncio.sleep(0.2)
                        continue
                    if exc.status == 409:  # the first try was logged before the crash: finished all the same
                        ledger.finished.add(info.id)
                    else:
                        ledger.unexpected.append(f"finish {info.id}: {exc}")
                    break
    finally:
        await http.close()
        await ctl.close()


class _Consumer:
    """A learner-like consumer: a trajectory counts as processed once its ack went through (retried while the
    proxy is down). ``stop()`` ends it the way a process dies, but never inside an ack: an ack whose answer
    was lost may or may not have reached the proxy, which no client can know (a real learner processes before
    it acknowledges, so either way nothing is lost). What it had been delivered but not acknowledged comes
    again after ``start()``."""

    def __init__(self, proxy: Proxy, name: str, dedup: bool, out: list[Trajectory],
                 seen_file: Path | None) -> None:
        self.args = (proxy, name, dedup, out, seen_file)
        self.acking = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None
        self.start()

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        proxy, name, dedup, out, seen_file = self.args
        async with SteptapClient(proxy.url, TOKEN) as c:
            async for d in c.trajectories(name, dedup=dedup, heartbeat_s=0.5, max_backoff_s=0.5,
                                          seen_file=seen_file):
                async with self.acking:
                    while dedup:
                        try:
                            await c.ack(name, d.cursor)
                            break
                        except _RETRY:
                            await asyncio.sleep(0.2)
                    out.append(d.trajectory)

    async def stop(self) -> None:
        assert self.task is not None
        async with self.acking:
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.mark.vllm
@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_sigkill_proxy_mid_load_loses_no_step_and_delivers_each_trajectory_once(
    vllm_server: Backend, tmp_path: Path, durability: str
) -> None:
    proxy = Proxy(vllm_server.url, tmp_path / "log", tmp_path, durability)
    ledger = Ledger()
    stop = asyncio.Event()
    delivered: list[Trajectory] = []
    raw: list[Trajectory] = []
    await proxy.start()
    consumers = [
        _Consumer(proxy, "learner", True, delivered, tmp_path / "seen.txt"),
        _Consumer(proxy, "raw", False, raw, None),
    ]
    agents = [asyncio.create_task(_agent(i, proxy, vllm_server.served_model, ledger, stop))
              for i in range(N_AGENTS)]
    try:
        for kill in range(2):
            # Let load build up: some sessions finished, others mid-way.
            t0 = time.monotonic()
            while len(ledger.finished) < 3 * (kill + 1) or len(ledger.replies) < 10 * (kill + 1):
                assert time.monotonic() - t0 < 120, f"no progress: {ledger}\n{proxy.output()}"
                assert not any(a.done() for a in agents), [a.exception() for a in agents if a.done()]
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)
            ledger.inflight_at_kill.append(ledger.inflight)
            if kill == 0:  # the consumer dies too (never inside an ack); it restarts while the proxy is down
                await consumers[0].stop()
            proxy.kill()
            if kill == 1:
                # SIGKILL rarely cuts a write in half (the kernel finishes the copy); a power cut does. Leave
                # what it would: the start of a frame that never completed. The restart must cut it and say
                # so.
                last = sorted((tmp_path / "log").glob("seg-*.log"))[-1]
                with open(last, "ab") as f:
                    f.write(struct.pack("<II", 5000, 0) + b"\x85partial")
            if kill == 0:  # ... and resumes from its ack
                consumers[0].start()
            await asyncio.sleep(0.5)
            await proxy.start()
        t0 = time.monotonic()
        n = len(ledger.finished)
        while len(ledger.finished) < n + 4:  # sessions opened and finished after the last restart
            assert time.monotonic() - t0 < 120, f"no progress after restart\n{proxy.output()}"
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents), 120)

        t0 = time.monotonic()
        while not ledger.finished <= {t.id for t in delivered}:
            assert time.monotonic() - t0 < 60, "finished trajectories never reached the consumer: " + str(
                sorted(ledger.finished - {t.id for t in delivered}))
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # give a duplicate the chance to show up
    finally:
        stop.set()
        for t in agents:
            t.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        for consumer in consumers:
            await consumer.stop()
        proxy.stop()

    assert not ledger.unexpected, ledger.unexpected
    # the injected torn tail was cut, counted and reported, at the start of the last run's log (read whole:
    # by the end its tail can be other lines)
    logs = [p.read_text(errors="replace") for p in sorted(proxy.outdir.glob("proxy-*.log"))]
    assert "torn record" in logs[-1]
    # a consumer that went away mid-write ends its stream quietly (it was logged as an unhandled error once)
    assert not [log for log in logs if "unhandled error" in log], proxy.output()
    # The kills hit sessions mid-way: some were continued after a restart (rebuilt from the log) and finished.
    assert ledger.spanned & ledger.finished, ledger

    # Exactly once after de-duplication, and only finished trajectories that were asked to finish.
    counts = Counter(t.id for t in delivered)
    assert all(c == 1 for c in counts.values()), [t for t, c in counts.items() if c > 1]
    assert ledger.finished <= set(counts)
    assert set(Counter(t.id for t in raw)) >= ledger.finished  # the raw consumer got each at least once

    # Every step whose reply reached an agent is in the log, with the token ids the agent got.
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    try:
        steps: dict[str, list[Step]] = {}
        for r in log.records():
            if isinstance(r, Step):
                steps.setdefault(r.trajectory_id, []).append(r)
    finally:
        await log.close()
    lost = [(sid, ids) for sid, ids, _ in ledger.replies
            if not any(s.response_token_ids == ids for s in steps.get(sid, []))]
    assert not lost, f"{len(lost)} of {len(ledger.replies)} replies that reached an agent are not in the log"
    # ... and in the delivered trajectory of each finished session.
    by_id = {t.id: t for t in delivered}
    for sid, ids, content in ledger.replies:
        if sid in ledger.finished:
            assert any(s.response_token_ids == ids and (s.response.get("content") or "") == content
                       for s in by_id[sid].steps), (sid, ids)
            assert by_id[sid].status == "finished"
    assert len(ledger.replies) >= 30 and len(ledger.finished) >= 10
    print(f"\ncrash test: {len(ledger.replies)} replies, {len(ledger.finished)} finished, {ledger.opened} "
          "opened, "
          f"{ledger.retried_calls} call tries failed while down, {len(ledger.spanned & ledger.finished)} "
          "finished "
          f"across a restart, calls in flight at the kills {ledger.inflight_at_kill}, raw deliveries "
          f"{len(raw)} for {len(set(t.id for t in raw))} ids")
