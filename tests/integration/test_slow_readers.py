"""Agents that stop reading, and streams that fail after their headers (issue 25, items 4 and 10): a stalled reader
never holds a call slot for good, one peer or one session cannot take every slot, and a stream always ends (an
error event and a close), never hangs. Slow readers need a stream that never ends: the fault injector's ``flood``
(a stand-in for a backend generating forever, which the real tiny model cannot be made to do on demand)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
from conftest import Proxy
from faults import MODEL, FaultInjector
from steptap.middleware.sessions.manager import SESSIONS_KEY

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
            assert await status_of(other, f"{proxy.url}{CHAT}", headers=key) == 429  # its session has one in flight
            injector.mode = "ok"
            assert await status_of(other, f"{proxy.url}/s/q{CHAT}") == 200
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
