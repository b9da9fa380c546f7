"""What an open session keeps across a proxy restart (its log is rebuilt), over the fault injector as the
backend (no model call is made: what is tested is the session's record)."""

from __future__ import annotations

from typing import Any

import aiohttp
from faults import FaultInjector

from steptap.middleware.sessions.control import SESSIONS_KEY


async def test_a_sessions_tito_flag_survives_a_restart(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    """Issue 25 (lows): ``tito: true`` at open was held in memory only; after a restart the rebuilt session
    went on in text mode."""
    backend = str((await aiohttp_server(FaultInjector().app)).make_url("")).rstrip("/")
    proxy = await make_proxy(backend)
    ids = {}
    for tito in (True, False):
        async with http.post(f"{proxy.url}/sessions", json={"tito": tito}, headers=proxy.control) as resp:
            assert resp.status == 201, await resp.text()
            ids[tito] = (await resp.json())["id"]
    await proxy.server.close()  # the app's cleanup closes its log
    again = await make_proxy(backend, log_dir=proxy.log_dir)
    sessions = again.app[SESSIONS_KEY].sessions
    assert sessions[ids[True]].tito is True and sessions[ids[False]].tito is False
