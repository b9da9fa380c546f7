"""Swap faults through the proxy's HTTP side, with the fault injector as the backend (a real vLLM cannot be made
to hold a stream open on a reader that never reads): a call that outlasts the swap's drain bound is cut and
recorded as a failed step naming why, the gate opens again, and later calls go through."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from faults import MODEL, FaultInjector
from test_weights import model_dir

from steptap.middleware.proxy.relay import SWAPPER_KEY


async def test_a_stream_outlasting_the_drain_bound_is_cut_and_recorded_failed(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    injector = FaultInjector(stall_s=60.0)  # the stream stalls after its first chunk, far past the bound
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), swap_drain_timeout_s=0.3,
                             model_dir=str(model_dir(tmp_path / "base")))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    injector.mode = "stall"
    resp = await http.post(f"{proxy.url}/s/slow/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()  # the first chunk is through: the call holds the gate

    swap = await http.post(f"{proxy.url}/admin/weights", json={"path": str(model_dir(tmp_path / "new"))},
                           headers=proxy.control)
    # The fault injector has no /pause: the swap itself fails, but only after the slow call was cut.
    assert swap.status == 502, await swap.text()
    with pytest.raises(aiohttp.ClientPayloadError):  # the agent's stream is cut, it does not hang
        await asyncio.wait_for(resp.read(), 10)
    resp.release()
    assert proxy.app[SWAPPER_KEY].state().cut_calls == 1

    async def recorded() -> dict[str, Any]:
        for _ in range(100):  # the failed step is written by a task spawned as the call was cancelled
            got = await http.get(f"{proxy.url}/sessions/slow", headers=proxy.control)
            data = await got.json()
            if data["steps"]:
                return data
            await asyncio.sleep(0.05)
        raise AssertionError("the cut call left no step")

    step = (await recorded())["steps"][0]
    assert step["status"] == "failed" and step["error"]["type"] == "swap_cut"
    assert "drain bound" in step["error"]["message"]

    injector.mode = "ok"
    ok = await http.post(f"{proxy.url}/s/slow/v1/chat/completions", json={**body, "stream": False})
    assert ok.status == 200  # the gate is open again
