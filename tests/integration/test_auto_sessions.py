"""Auto-created sessions (issue 25, item 5): a call on an id nobody opened opens ``auto:<id>`` only once the
backend accepted it, under its own small cap and a short idle timeout, so calls the backend refuses can never
fill ``max_open_sessions`` and lock the environment's ``POST /sessions`` out. The refusals come from the fault
injector (``error400``: vLLM's answer to a call it refuses)."""

from __future__ import annotations

from typing import Any

import aiohttp
from faults import MODEL, FaultInjector

from steptap.middleware.sessions.control import SESSIONS_KEY

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}


async def test_refused_calls_open_no_session_and_auto_sessions_have_their_own_cap(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector()
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), max_open_sessions=3, max_auto_sessions=2,
                             auto_session_idle_timeout_s=5.0)
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    injector.mode = "error400"
    for i in range(5):
        async with http.post(f"{proxy.url}/s/refused{i}{CHAT}", json=BODY) as resp:
            assert resp.status == 400
    assert not manager.sessions  # nothing opened for calls the backend refused
    for _ in range(3):  # the environment's sessions all open (was 429 once refused calls had filled the cap)
        async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as resp:
            assert resp.status == 201, await resp.text()
    injector.mode = "ok"
    for i in range(2):
        async with http.post(f"{proxy.url}/s/auto{i}{CHAT}", json=BODY) as resp:
            assert resp.status == 200, await resp.text()
    async with http.post(f"{proxy.url}/s/auto9{CHAT}", json=BODY) as resp:
        err = await resp.json()
        assert resp.status == 429 and "max_auto_sessions" in err["error"]["message"], err
    async with http.post(f"{proxy.url}/s/auto0{CHAT}", json=BODY) as resp:
        assert resp.status == 200  # an open auto session takes more calls
    assert manager.sessions["auto:auto0"].trajectory.idle_timeout_s == 5.0
    assert len(manager.sessions["auto:auto0"].trajectory.steps) == 2
