"""Swap faults through the proxy's HTTP side, with the fault injector as the backend (a real vLLM cannot be
made to hold a stream open on a reader that never reads): a call that outlasts the swap's drain bound is cut
and ends as the protocol's error (an error event once its stream began, an OpenAI error body before any header
went out) with its step recorded failed naming why; the gate opens again and later calls go through."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
from faults import MODEL, FaultInjector
from test_weights import model_dir

from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.swapper import CUT_MESSAGE

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def _setup(aiohttp_server: Any, make_proxy: Any, tmp_path: Path, mode: str) -> tuple[FaultInjector,
                                                                                           Any]:
    injector = FaultInjector(stall_s=60.0)  # a stall lasts far past the bound
    injector.mode = mode
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), swap_drain_timeout_s=0.3,
                             swap_mode="drain",
                             model_dir=str(model_dir(tmp_path / "base")))
    return injector, proxy


async def _swap(http: aiohttp.ClientSession, proxy: Any, tmp_path: Path) -> None:
    swap = await http.post(f"{proxy.url}/admin/weights", json={"path": str(model_dir(tmp_path / "new"))},
                           headers=proxy.control)
    # The fault injector has no /pause: the swap itself fails, but only after the slow call was cut.
    assert swap.status == 502, await swap.text()
    assert proxy.app[SWAPPER_KEY].state().cut_calls == 1


async def _cut_step(http: aiohttp.ClientSession, proxy: Any, sid: str) -> dict[str, Any]:
    """The session's one step: recorded before the cut call ended, so it is there once the swap answered."""
    got = await http.get(f"{proxy.url}/sessions/{sid}", headers=proxy.control)
    (step,) = (await got.json())["steps"]
    assert step["status"] == "failed" and step["error"]["type"] == "swap_cut"
    assert step["error"]["message"] == CUT_MESSAGE
    return step


def _events(body: bytes) -> list[bytes]:
    parts = (e.strip() for e in body.split(b"\n\n"))
    return [e.removeprefix(b"data: ") for e in parts if e.startswith(b"data: ")]


async def _gate_open(http: aiohttp.ClientSession, proxy: Any, injector: FaultInjector, sid: str) -> None:
    injector.mode = "ok"
    ok = await http.post(f"{proxy.url}/s/{sid}/v1/chat/completions", json=BODY)
    assert ok.status == 200, await ok.text()


async def test_a_stream_outlasting_the_drain_bound_ends_with_an_error_event(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    injector, proxy = await _setup(aiohttp_server, make_proxy, tmp_path, "stall")  # stalls after one chunk
    resp = await http.post(f"{proxy.url}/s/slow/v1/chat/completions", json={**BODY, "stream": True})
    assert resp.status == 200
    await resp.content.readline()  # the first chunk is through: the call holds the gate
    await _swap(http, proxy, tmp_path)
    events = _events(await resp.read())  # a whole body: the stream ends, it is not cut
    assert b"[DONE]" not in events
    assert json.loads(events[-1])["error"] == {"message": CUT_MESSAGE, "type": "swap_cut", "code": "swap_cut"}
    step = await _cut_step(http, proxy, "slow")
    assert step["response_token_ids"] == [11]  # what arrived before the cut is kept
    await _gate_open(http, proxy, injector, "slow")


async def test_a_reader_that_stops_reading_is_cut_and_still_gets_the_error_event(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The slow reader itself: the proxy's writes to it block, the cut waits for it only a bounded time, and
    what was buffered (the error event last) still reaches it when it reads again."""
    injector, proxy = await _setup(aiohttp_server, make_proxy, tmp_path, "flood")
    resp = await http.post(f"{proxy.url}/s/slow/v1/chat/completions", json={**BODY, "stream": True})
    assert resp.status == 200
    await resp.content.readline()
    await _swap(http, proxy, tmp_path)  # returns while the reader still reads nothing
    body = b""
    try:
        async for data in resp.content.iter_any():
            body += data
    except aiohttp.ClientPayloadError:
        pass  # the connection closed behind the buffered bytes; what matters is that they all arrived
    events = _events(body)
    assert len(events) > 1000  # the buffers really were full
    assert json.loads(events[-1])["error"]["code"] == "swap_cut" and b"[DONE]" not in events
    step = await _cut_step(http, proxy, "slow")
    assert len(step["response_token_ids"]) > 1000
    await _gate_open(http, proxy, injector, "slow")


async def test_a_call_cut_before_its_reply_gets_an_openai_error_body(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    injector, proxy = await _setup(aiohttp_server, make_proxy, tmp_path, "stall")
    call = asyncio.ensure_future(http.post(f"{proxy.url}/s/plain/v1/chat/completions", json=BODY))
    while proxy.app[SWAPPER_KEY].state().in_flight == 0:  # the call holds the gate, waiting for its reply
        await asyncio.sleep(0.01)
    await _swap(http, proxy, tmp_path)
    resp = await call
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert error["message"] == CUT_MESSAGE and error["code"] == "swap_cut"
    await _cut_step(http, proxy, "plain")
    await _gate_open(http, proxy, injector, "plain")


async def test_an_anthropic_stream_cut_ends_with_its_own_error_event(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    injector, proxy = await _setup(aiohttp_server, make_proxy, tmp_path, "stall")
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    resp = await http.post(f"{proxy.url}/s/msg/v1/messages", json=body)
    assert resp.status == 200
    while b"content_block_delta" not in await resp.content.readline():  # the first token is through
        pass
    await _swap(http, proxy, tmp_path)
    lines = (await resp.read()).decode().splitlines()
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events  # Anthropic's error event, in its shape
    last = json.loads(next(line for line in reversed(lines)
                           if line.startswith("data: ")).removeprefix("data: "))
    assert last["type"] == "error" and last["error"]["message"] == CUT_MESSAGE
    await _cut_step(http, proxy, "msg")
