"""Agents that stop reading, and streams that fail after their headers (issue 25, items 4 and 10): a stalled
reader never holds a call slot for good, one peer or one session cannot take every slot, and a stream always
ends (an error event and a close), never hangs. Slow readers need a stream that never ends: the fault
injector's ``flood`` (a stand-in for a backend generating forever, which the real tiny model cannot be made to
do on demand)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import pytest
from conftest import Proxy
from faults import MODEL, DiskFullInjector, FaultInjector

from steptap.middleware import files
from steptap.middleware.records import Step, Trajectory
from steptap.middleware.sessions.control import SESSIONS_KEY

CHAT = "/v1/chat/completions"


def body(stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream}


def stalled_reader(proxy: Proxy, path: str, source: str = "127.0.0.1") -> socket.socket:
    """A raw connection that sends one streamed call and never reads its reply (a small receive buffer, so the
    proxy's writes to it soon block)."""
    host, port = proxy.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    data = json.dumps(body()).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return sock


async def status_of(http: aiohttp.ClientSession, url: str, **kw: Any) -> int:
    async with http.post(url, json=body(stream=False), **kw) as resp:
        await resp.read()
        return resp.status


async def wait_for(predicate: Any, seconds: float = 30.0) -> None:
    """Poll until ``predicate()`` holds; fails (does not hang) after ``seconds``: the bound on a defect."""
    for _ in range(int(seconds / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never held")


async def test_a_reader_that_stops_reading_gives_its_slot_back(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector()
    server = await aiohttp_server(injector.app)
    injector.mode = "flood"
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), max_concurrent_calls=2,
                             stream_write_timeout_s=0.5)
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    socks = [stalled_reader(proxy, f"/s/stall{i}{CHAT}") for i in range(2)]
    try:
        await wait_for(lambda: manager.calls_inflight == 2)
        # both slots held by readers that never read: on today's code every other agent got 429 for good
        await wait_for(lambda: manager.calls_inflight == 0)
        for i in range(2):
            (step,) = manager.sessions[f"auto:stall{i}"].trajectory.steps
            assert step.status == "failed" and step.error.type == "client_stalled", step.error
            assert step.response_token_ids[:1] == [11]  # what arrived is kept
        injector.mode = "ok"
        assert await status_of(http, f"{proxy.url}{CHAT}") == 200
    finally:
        for s in socks:
            s.close()


async def test_one_peer_cannot_take_every_call_slot(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector(stall_s=30.0)
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), max_concurrent_calls=8,
                             max_calls_per_peer=2, max_calls_per_session=1)
    injector.mode = "stall"
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        key = {"Authorization": f"Bearer {(await resp.json())['api_key']}"}
    held = [asyncio.ensure_future(status_of(http, f"{proxy.url}{CHAT}", headers=h)) for h in (key, {})]
    try:
        await wait_for(lambda: injector.calls == 2)
        async with http.post(f"{proxy.url}/s/p9{CHAT}", json=body(stream=False)) as resp:
            err = await resp.json()
            assert resp.status == 429 and err["error"]["code"] == "too_many_calls", err
            assert "max_calls_per_peer" in err["error"]["message"] and resp.headers["Retry-After"] == "1"
        # another peer (another loopback address) still gets in, but one session takes one call at a time
        conn = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with aiohttp.ClientSession(connector=conn) as other:
            # Its session has one in flight
            assert await status_of(other, f"{proxy.url}{CHAT}", headers=key) == 429
            injector.mode = "ok"
            assert await status_of(other, f"{proxy.url}/s/q{CHAT}") == 200
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


# --- item 10: what a stream, a finish or a late step does when the log cannot take the record ---------------


@pytest.mark.parametrize("fault", ["disk_full", "record_too_large"])
async def test_a_stream_whose_step_cannot_be_logged_ends_with_an_error_event(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
    fault: str
) -> None:
    """The headers are out when the step is recorded: a refused record must end the stream (an error event,
    then the connection ends), never leave the agent waiting (it did: no event, no [DONE], no close)."""
    injector = FaultInjector(stall_s=0.3)
    server = await aiohttp_server(injector.app)
    disk = DiskFullInjector(files.write_all)
    monkeypatch.setattr(files, "write_all", disk)
    limit = 4000 if fault == "record_too_large" else 64 * 1024 * 1024
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), max_record_bytes=limit,
                             max_session_bytes=min(limit, 48 * 1024 * 1024))
    text = "x" * 3700 if fault == "record_too_large" else "x"
    injector.mode = "stall"  # the first chunk, then a pause: the disk fills while the stream is open
    call = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}
    async with http.post(f"{proxy.url}{CHAT}", json=call) as resp:
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")
        disk.full = fault == "disk_full"
        rest = await asyncio.wait_for(resp.read(), 20)  # the stream ends: the bound is on the defect (a hang)
    disk.full = False
    events = [line for line in rest.decode().splitlines() if line.startswith("data: ")]
    assert events and b"[DONE]" not in rest, rest[-300:]
    error = json.loads(events[-1][len("data: "):])["error"]
    want = "log_unavailable" if fault == "disk_full" else "record_too_large"
    assert error["code"] == want, error
    await wait_for(lambda: proxy.app[SESSIONS_KEY].calls_inflight == 0)  # type: ignore[index]


async def test_finish_while_the_log_cannot_write_is_a_503_and_can_be_retried(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    injector = FaultInjector()
    server = await aiohttp_server(injector.app)
    disk = DiskFullInjector(files.write_all)
    monkeypatch.setattr(files, "write_all", disk)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"))
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        opened = await resp.json()
    sid = opened["id"]
    assert await status_of(http, f"{proxy.url}{CHAT}",
                           headers={"Authorization": f"Bearer {opened['api_key']}"}) == 200
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    disk.full = True
    async with http.post(f"{proxy.url}/sessions/{sid}/finish", json={"reward": 1.0},
                         headers=proxy.control) as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "log_unavailable"
    session = manager.sessions[sid]
    assert not session.closing and session.trajectory.rewards == {}  # as before the finish: nothing half-done
    disk.full = False
    await wait_for(lambda: not manager.log.degraded)
    async with http.post(f"{proxy.url}/sessions/{sid}/finish", json={"reward": 1.0},
                         headers=proxy.control) as resp:
        assert resp.status == 200, await resp.text()  # was 409 "already closing" for good
    (traj,) = [r for r in manager.log.records() if isinstance(r, Trajectory) and r.id == sid]
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}


async def test_a_step_completing_while_its_session_finishes_is_in_the_trajectory(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector(stall_s=0.5)
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"))
    async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
        opened = await resp.json()
    sid, key = opened["id"], {"Authorization": f"Bearer {opened['api_key']}"}
    assert await status_of(http, f"{proxy.url}{CHAT}", headers=key) == 200  # step 0
    injector.mode = "stall"
    late = asyncio.ensure_future(status_of(http, f"{proxy.url}{CHAT}", headers=key))
    await wait_for(lambda: injector.calls == 2)
    async with http.post(f"{proxy.url}/sessions/{sid}/finish", json={}, headers=proxy.control) as resp:
        assert resp.status == 200
        finished = await resp.json()
    assert await late == 200
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    records = list(manager.log.records())
    (traj,) = [r for r in records if isinstance(r, Trajectory) and r.id == sid]
    logged = [r.index for r in records if isinstance(r, Step) and r.trajectory_id == sid]
    # the Trajectory record refers to its logged steps (delta steps, docs/log.md): both of them
    assert len(traj.step_refs) == 2 and logged == [0, 1], (traj.step_refs, logged)
    assert finished["steps"] == 2  # finish waited for the call in flight
