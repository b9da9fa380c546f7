"""A model call leaves no reference cycle behind (issue 45). A cycle hands every object of its call (the
request, the session, the steps, a stream's chunks) to the cyclic collector instead of freeing it at once: in
the proxy bench the collector's passes then cost a streamed call more than its capture did. The backend is the
fault injector in its ``ok`` mode (a stand-in: the unit lane runs no vLLM); the proxy, its log and the HTTP on
both sides are real."""

from __future__ import annotations

import gc
import json
from collections import Counter
from typing import Any

import aiohttp
from faults import MODEL, FaultInjector


def _chat(stream: bool) -> str:
    return json.dumps({"model": MODEL, "max_tokens": 3, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]})


async def _calls(http: aiohttp.ClientSession, url: str, n: int) -> None:
    for i in range(n):
        async with http.post(f"{url}/v1/chat/completions", data=_chat(stream=i % 2 == 1),
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()


def _steptap_garbage() -> Counter[str]:
    gc.collect()
    kinds = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                    if type(o).__module__.startswith("steptap."))
    gc.garbage.clear()
    return kinds


async def test_plain_and_streamed_calls_leave_no_reference_cycle(
        aiohttp_server: Any, make_proxy: Any) -> None:
    backend = await aiohttp_server(FaultInjector().app)
    proxy = await make_proxy(str(backend.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as http:
        await _calls(http, proxy.url, 4)  # start-up's own objects (pools, caches, the first session) settle
        gc.disable()
        _steptap_garbage()
        gc.freeze()  # what exists now is out of the count: earlier tests' objects, freed late in this process
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a pass finds, to name it
        try:
            await _calls(http, proxy.url, 20)
            found = _steptap_garbage()
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.unfreeze()
            gc.enable()
    assert not found, f"cycles left by 20 calls (10 plain, 10 streamed): {found.most_common(8)}"
