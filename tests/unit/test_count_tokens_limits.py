"""``count_tokens`` under a model call's limits (issue 42, items 1 and 11): the same admission (body memory
and JSON node count before decoding, calls in flight, image memory), a look-up of the session that opens
nothing (N x ``max_auto_sessions`` calls on made-up ids leave nothing pending, and agents on new session URLs
are still served), and a render answer without ids is a 502 naming the replica. The backend is the fault
injector: what is tested is the proxy's bookkeeping, not vLLM's render (tests/integration/
test_anthropic_shapes.py renders on the real server)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import uuid
from typing import Any

import aiohttp
from conftest import Proxy
from faults import MODEL, FaultInjector

from steptap.middleware.sessions.control import SESSIONS_KEY

JSON = {"Content-Type": "application/json"}
COUNT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CHAT = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def _proxy(aiohttp_server: Any, make_proxy: Any, injector: FaultInjector, **kw: Any) -> Proxy:
    backend = await aiohttp_server(injector.app)
    proxy: Proxy = await make_proxy(str(backend.make_url("")).rstrip("/"), **kw)
    return proxy


async def _post(http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
                ) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={**JSON, **(headers or {})}) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_count_tokens_on_made_up_ids_opens_nothing_and_leaves_nothing_pending(
        aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession) -> None:
    cap = 3
    proxy = await _proxy(aiohttp_server, make_proxy, FaultInjector(), max_auto_sessions=cap)
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    for _ in range(4 * cap):
        status, body = await _post(http, f"{proxy.url}/s/{uuid.uuid4().hex}/v1/messages/count_tokens", COUNT)
        assert status == 200 and body == {"input_tokens": 3}, body
    assert manager.pending == {} and manager.sessions == {}
    health = await (await http.get(f"{proxy.url}/health")).json()
    assert health["sessions_pending"] == 0 and health["sessions_open"] == 0
    # every agent on a new session URL is still served: the auto-session table has all its room
    for i in range(cap):
        status, body = await _post(http, f"{proxy.url}/s/agent-{i}/v1/chat/completions", CHAT)
        assert status == 200, body
    assert len(manager.sessions) == cap and manager.pending == {}


async def test_count_tokens_is_admitted_like_a_model_call(
        aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession) -> None:
    injector = FaultInjector()
    proxy = await _proxy(aiohttp_server, make_proxy, injector, max_concurrent_calls=1, max_json_nodes=1000)
    url = f"{proxy.url}/v1/messages/count_tokens"
    # more JSON values than max_json_nodes: a 413 before anything is decoded, in Anthropic's shape
    bomb = b'{"model":"' + MODEL.encode() + b'","messages":[' + b"{}," * 2000 + b"{}]}"
    status, body = await _post(http, url, bomb)
    assert status == 413 and body["type"] == "error" and "max_json_nodes" in body["error"]["message"], body
    # one count in flight (its render held by the backend) takes the only slot: a second one is a 429
    injector.mode = "hold"
    first = asyncio.ensure_future(_post(http, url, COUNT))
    while injector.held < 1:
        await asyncio.sleep(0.01)
    injector.mode = "ok"
    status, body = await _post(http, url, COUNT)
    assert status == 429 and "max_concurrent_calls" in body["error"]["message"], body
    status, body = await _post(http, f"{proxy.url}/v1/chat/completions", CHAT)
    assert status == 429, body  # a model call shares the slots with it
    injector.release.set()
    assert (await first) == (200, {"input_tokens": 3})
    status, body = await _post(http, url, COUNT)
    assert status == 200, body


async def test_count_tokens_images_count_against_image_memory(
        aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession) -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2000, 2000)).save(out, format="PNG")  # 12 KB, 16 MB once decoded
    proxy = await _proxy(aiohttp_server, make_proxy, FaultInjector(), max_image_bytes=1 << 20,
                         max_image_memory=8 << 20)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(out.getvalue()).decode()}}
    body = {**COUNT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    status, err = await _post(http, f"{proxy.url}/v1/messages/count_tokens", body)
    assert status == 400 and err["type"] == "error" and "max_image_memory" in err["error"]["message"], err


async def test_a_render_answer_without_ids_is_a_502_naming_the_replica(
        aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession) -> None:
    injector = FaultInjector()
    backend = await aiohttp_server(injector.app)
    name = str(backend.make_url("")).rstrip("/")
    proxy = await make_proxy(name)
    injector.mode = "no_ids"
    status, body = await _post(http, f"{proxy.url}/v1/messages/count_tokens", COUNT)
    assert status == 502 and body["type"] == "error", body
    assert name in body["error"]["message"] and "token_ids" in body["error"]["message"], body
