"""Auto-created sessions per client address (issue 42, item 10): accepted calls on made-up ids from one
address open at most ``max_auto_sessions_per_peer`` sessions, so one caller cannot keep ``max_auto_sessions``
full for everyone; another address still opens its own. Pending first calls count too, and a session that
closes gives its place back. Two real client addresses (127.0.0.1 and 127.0.0.2, both loopback); the backend
is the fault injector (its small fixed reply)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from faults import MODEL, FaultInjector

from steptap.middleware.sessions.control import SESSIONS_KEY

CHAT = json.dumps({"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})


async def _call(http: aiohttp.ClientSession, url: str, sid: str) -> tuple[int, Any]:
    async with http.post(f"{url}/s/{sid}/v1/chat/completions", data=CHAT,
                         headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_one_address_opens_at_most_its_share_of_auto_sessions(
        aiohttp_server: Any, make_proxy: Any) -> None:
    backend = await aiohttp_server(FaultInjector().app)
    proxy = await make_proxy(str(backend.make_url("")).rstrip("/"), max_auto_sessions=4,
                             max_auto_sessions_per_peer=2, auto_session_idle_timeout_s=3600)
    manager = proxy.app[SESSIONS_KEY]
    one = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.1", 0)))
    two = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
    async with one, two:
        for i in range(2):
            assert (await _call(one, proxy.url, f"one-{i}"))[0] == 200
        status, body = await _call(one, proxy.url, "one-2")
        assert status == 429 and "max_auto_sessions_per_peer" in body["error"]["message"], body
        assert (await _call(one, proxy.url, "one-0"))[0] == 200  # its own sessions still take calls
        for i in range(2):  # the table has room for the other address
            assert (await _call(two, proxy.url, f"two-{i}"))[0] == 200
        assert len(manager.sessions) == 4 and manager.pending == {}
        async with one.post(f"{proxy.url}/sessions/auto:one-0/finish", json={},
                            headers=proxy.control) as resp:
            assert resp.status == 200, await resp.text()
        assert (await _call(one, proxy.url, "one-3"))[0] == 200  # a closed one gave its place back
