"""Images in model calls (proxy/vision.py and the protocols' translations): each protocol's image parts reach
vLLM as chat ``image_url`` parts; limits and undecodable images are 400s in the protocol's own error shape,
before anything is forwarded or recorded; URL images are fetched only from allowed hosts (a real local aiohttp
server here); the logged request holds references, never the base64 again."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.log.images import IMAGES_DIR, ImageStore
from steptap.middleware.proxy import messages_request, vision
from steptap.middleware.proxy.image_urls import FETCH_FAILED
from steptap.middleware.proxy.responses_request import to_chat as responses_to_chat
from steptap.middleware.records import digest_of_ref, image_digest

CFG = ProxyConfig(backend="http://127.0.0.1:9")


def png(color: tuple[int, int, int], size: tuple[int, int] = (4, 3)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def durl(data: bytes) -> str:
    return f"data:image/png;base64,{b64(data)}"


RED, BLUE = png((255, 0, 0)), png((0, 0, 255), (6, 5))


async def gather(chat: dict[str, Any], cfg: ProxyConfig, known: dict[str, vision.Image] | None = None
                 ) -> list[vision.Image]:
    """The chat body's images as a call reads them (held while it reads, on an image memory of its own);
    ``known`` gets each by its source."""
    memory = vision.ImageMemory(cfg.max_image_memory)
    try:
        with contextlib.ExitStack() as holds:
            return await vision.gather(chat, cfg, {} if known is None else known, memory, holds)
    finally:
        memory.close()


def chat_body(*urls: str) -> dict[str, Any]:
    parts = [{"type": "text", "text": "look"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def responses_body(*urls: str) -> dict[str, Any]:
    return {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "look"}, *({"type": "input_image", "image_url": u} for u in urls)]}]}


def messages_body(*images: bytes, url: str | None = None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": "look"}]
    blocks += [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(i)}}
               for i in images]
    if url is not None:
        blocks.append({"type": "image", "source": {"type": "url", "url": url}})
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": blocks}]}


async def test_each_protocol_reaches_vllm_as_chat_image_parts_in_prompt_order() -> None:
    for chat in (chat_body(durl(RED), durl(BLUE)),
                 responses_to_chat(responses_body(durl(RED), durl(BLUE)), []),
                 messages_request.to_chat(messages_body(RED, BLUE))):
        parts = chat["messages"][-1]["content"]
        assert parts[0] == {"type": "text", "text": "look"}
        assert [p["image_url"]["url"] for p in parts[1:]] == [durl(RED), durl(BLUE)]
        known: dict[str, vision.Image] = {}
        images = await gather(chat, CFG, known)
        assert [(i.sha256, i.mime, i.width, i.height) for i in images] == [
            (image_digest(RED), "image/png", 4, 3), (image_digest(BLUE), "image/png", 6, 5)]
    # a turn without images stays a plain string (what the template saw before)
    assert messages_request.to_chat({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})["messages"] == [
        {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("make", [chat_body, responses_body])
async def test_the_logged_request_holds_references_not_the_bytes(make: Any) -> None:
    body = make(durl(RED), durl(BLUE), durl(RED))  # the same screenshot twice
    chat = body if make is chat_body else responses_to_chat(body, [])
    known: dict[str, vision.Image] = {}
    images = await gather(chat, CFG, known)
    assert [i.sha256 for i in images] == [image_digest(RED), image_digest(BLUE), image_digest(RED)]
    logged = vision.with_refs(body, known)
    text = json.dumps(logged)
    assert b64(RED) not in text and b64(BLUE) not in text
    assert text.count("steptap-image:sha256:") == 3
    assert body["model"] == "m" and b64(RED) in json.dumps(body)  # the agent's body itself is untouched


def test_messages_base64_and_url_sources_become_references() -> None:
    body = messages_body(RED, url="https://example.test/a.png")
    known = {vision.data_url("image/png", b64(RED)): vision.inspect(RED, CFG),
             "https://example.test/a.png": vision.inspect(BLUE, CFG)}
    blocks = vision.with_refs(body, known)["messages"][0]["content"]
    assert digest_of_ref(blocks[1]["source"]["data"]) == image_digest(RED)
    assert blocks[1]["source"]["media_type"] == "image/png"
    assert digest_of_ref(blocks[2]["source"]["url"]) == image_digest(BLUE)


@pytest.mark.parametrize(("chat", "cfg", "words"), [
    (chat_body(durl(RED), durl(BLUE)), ProxyConfig(backend="x", max_images_per_call=1),
     "max_images_per_call"),
    (chat_body(durl(RED)), ProxyConfig(backend="x", max_image_bytes=len(RED) - 1), "max_image_bytes"),
    (chat_body(durl(png((0, 0, 0), (100, 100)))), ProxyConfig(backend="x", max_image_pixels=9999),
     "max_image_pixels"),
    (chat_body("data:image/png;base64," + b64(b"not an image at all")), CFG, "could not be decoded"),
    (chat_body(durl(RED[:40])), CFG, "could not be decoded"),  # truncated
    (chat_body("data:image/png;base64,@@@"), CFG, "could not be decoded"),
    (chat_body("file:///etc/passwd"), CFG, "data URL"),
    (chat_body("https://example.test/a.png"), CFG, "--image-urls"),  # URLs are off by default
])
async def test_limits_and_bad_images_are_400s(chat: dict[str, Any], cfg: ProxyConfig, words: str) -> None:
    with pytest.raises(ApiError) as err:
        await gather(chat, cfg, {})
    assert err.value.status == 400 and err.value.code == "invalid_image"
    assert words in err.value.message


async def test_url_images_are_fetched_from_allowed_hosts_only(aiohttp_server: Any) -> None:
    async def image(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "slow.png":
            await asyncio.sleep(30)
        if name == "moved.png":
            raise web.HTTPFound("/img/red.png")
        data = {"red.png": RED, "big.png": BLUE * 50}.get(name, b"not an image")
        return web.Response(body=data, content_type="image/png")

    app = web.Application()
    app.router.add_get("/img/{name}", image)
    server = await aiohttp_server(app)
    base = str(server.make_url("/img/")).replace("localhost", "127.0.0.1")
    allowed = ProxyConfig(backend="x", image_urls=["127.0.0.1"], image_url_timeout_s=0.5,
                          max_image_bytes=len(BLUE) * 10)
    chat = chat_body(base + "red.png", durl(BLUE))
    known: dict[str, vision.Image] = {}
    images = await gather(chat, allowed, known)
    assert images[0].sha256 == image_digest(RED) and images[0].data == RED
    upstream = vision.with_data(chat, known)  # vLLM gets the bytes the proxy fetched, as a data URL
    assert upstream["messages"][0]["content"][1]["image_url"]["url"] == durl(RED)
    assert chat["messages"][0]["content"][1]["image_url"]["url"] == base + "red.png"
    for name, words in (("big.png", FETCH_FAILED), ("slow.png", FETCH_FAILED), ("moved.png", FETCH_FAILED),
                        ("none", "could not be decoded")):  # one text for every failed fetch (image_urls.py)
        with pytest.raises(ApiError) as err:
            await gather(chat_body(base + name), allowed, {})
        assert words in err.value.message, (name, err.value.message)
    with pytest.raises(ApiError) as err:
        await gather(chat, ProxyConfig(backend="x", image_urls=["images.example"]), {})
    assert "--image-urls" in err.value.message


async def _post(client: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    resp = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
    return resp.status, await resp.json()


async def _backend(aiohttp_server: Any) -> str:
    """The fault injector (its small fixed reply): images are refused before the backend would matter."""
    from faults import FaultInjector

    return str((await aiohttp_server(FaultInjector().app)).make_url("")).rstrip("/")


async def test_a_refused_image_is_a_400_in_each_protocols_shape_and_nothing_is_recorded(
        aiohttp_client: Any, aiohttp_server: Any, tmp_path: Path) -> None:
    from steptap.middleware.app import create_app
    from steptap.middleware.sessions.control import SESSIONS_KEY

    cfg = ProxyConfig(backend=await _backend(aiohttp_server), log=str(tmp_path / "log"), control_token="t",
                      max_image_pixels=10, any_model=True)
    client = await aiohttp_client(create_app(cfg))
    status, body = await _post(client, "/s/vis/v1/chat/completions", chat_body(durl(RED)))
    assert status == 400 and body["error"]["code"] == "invalid_image" and "max_image_pixels" in \
        body["error"]["message"]
    status, body = await _post(client, "/s/vis/v1/responses", responses_body(durl(RED)))
    assert status == 400 and body["error"]["code"] == "invalid_image"
    status, body = await _post(client, "/s/vis/v1/messages", messages_body(RED))
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_image_pixels" in body["error"]["message"]
    log = client.app[SESSIONS_KEY].log
    assert list(log.records()) == [] and not (tmp_path / "log" / IMAGES_DIR).exists()
    # the store's reader route: the control token, a digest, 404 for one it does not hold
    resp = await client.get(f"/images/{image_digest(RED)}")
    assert resp.status == 401
    resp = await client.get(f"/images/{image_digest(RED)}", headers={"Authorization": "Bearer t"})
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "image_not_found"
    resp = await client.get("/images/nothex", headers={"Authorization": "Bearer t"})
    assert resp.status == 400
    await log.images.put([(image_digest(RED), RED)])
    resp = await client.get(f"/images/{image_digest(RED)}", headers={"Authorization": "Bearer t"})
    assert resp.status == 200 and await resp.read() == RED


def test_a_refused_calls_images_leave_only_a_marker() -> None:
    for body in (chat_body(durl(RED)), responses_body(durl(RED)), messages_body(RED)):
        kept = json.dumps(vision.strip_images(body))
        assert b64(RED) not in kept and kept.count(vision.OMITTED) == 1


async def test_a_fetched_image_reads_as_its_reference_in_what_upstream_got(aiohttp_server: Any,
                                                                           tmp_path: Path) -> None:
    """The messages continuity is judged on (the chat body sent upstream, a fetched image as its data URL)
    hold references too, never the bytes."""
    async def image(request: web.Request) -> web.Response:
        return web.Response(body=RED, content_type="image/png")

    app = web.Application()
    app.router.add_get("/red.png", image)
    server = await aiohttp_server(app)
    url = str(server.make_url("/red.png")).replace("localhost", "127.0.0.1")
    cfg = ProxyConfig(backend="x", image_urls=["127.0.0.1"])
    store = ImageStore(tmp_path)
    memory = vision.ImageMemory(cfg.max_image_memory)
    async with vision.CallImages(cfg, memory, store) as pics:
        await pics.read(chat_body(url))
        upstream = pics.upstream(None, chat_body(url))
        assert b64(RED) in json.dumps(upstream)
        logged = pics.logged(upstream["messages"])
        assert b64(RED) not in json.dumps(logged)
        assert digest_of_ref(logged[0]["content"][1]["image_url"]["url"]) == image_digest(RED)
        assert [r.sha256 for r in pics.refs()] == [image_digest(RED)]
        assert store.get(image_digest(RED)) is None  # stored only with the step that names it
        async with pics.stored():
            assert store.get(image_digest(RED)) == RED  # the fetched bytes
    memory.close()


async def test_images_in_flight_are_bounded_together(tmp_path: Path) -> None:
    """Each image's bytes are held while its call is in flight, its pixels while they are decoded."""
    from steptap.middleware.errors import status_of
    from steptap.middleware.exceptions import Overloaded

    wide = png((0, 0, 255), (20, 20))  # 1,600 bytes of pixels
    limit = len(BLUE) + len(wide) + 20 * 20 * 4 - 1  # both calls' bytes and the second's pixels do not fit
    cfg = ProxyConfig(backend="x", max_image_bytes=max(len(BLUE), len(wide)), max_image_memory=limit)
    memory, store = vision.ImageMemory(cfg.max_image_memory), ImageStore(tmp_path)
    async with vision.CallImages(cfg, memory, store) as first:
        await first.read(chat_body(durl(BLUE)))
        assert memory.held == len(BLUE)
        with pytest.raises(Overloaded) as err:  # the second call's pixels would pass the bound: 429
            async with vision.CallImages(cfg, memory, store) as second:
                await second.read(chat_body(durl(wide)))
        assert status_of(err.value) == 429 and "max_image_memory" in err.value.message
        assert memory.held == len(BLUE)
    assert memory.held == 0  # given back when the call ends
    async with vision.CallImages(cfg, memory, store) as second:
        await second.read(chat_body(durl(wide)))
        assert memory.held == len(wide)
    memory.close()


async def test_a_tool_results_screenshot_is_an_image_of_the_prompt() -> None:
    """Computer use: the screenshot comes back in the tool result (Messages ``tool_result``, Responses
    ``function_call_output``), read like a user turn's image and logged as its reference."""
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(BLUE)}}
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "click it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "computer", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": [{"type": "text", "text": "done"}, shot]}]}]}
    responses = {"model": "m", "input": [
        {"type": "function_call", "call_id": "c1", "name": "computer", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "done"}, {"type": "input_image", "image_url": durl(BLUE)}]}]}
    for agent_body, chat in ((body, messages_request.to_chat(body)),
                             (responses, responses_to_chat(responses, []))):
        tool = [m for m in chat["messages"] if m["role"] == "tool"][0]
        assert tool["content"][0] == {"type": "text", "text": "done"}
        known: dict[str, vision.Image] = {}
        assert [i.sha256 for i in await gather(chat, CFG, known)] == [image_digest(BLUE)]
        logged = json.dumps(vision.with_refs(agent_body, known))
        assert b64(BLUE) not in logged and f"steptap-image:sha256:{image_digest(BLUE)}" in logged


async def test_count_tokens_never_lets_vllm_fetch_an_image_url(aiohttp_client: Any, aiohttp_server: Any,
                                                              tmp_path: Path) -> None:
    """``count_tokens`` renders through vLLM: a URL image there is checked as a call's is (a 400 naming
    --image-urls by default), never handed to vLLM to fetch."""
    from steptap.middleware.app import create_app

    cfg = ProxyConfig(backend=await _backend(aiohttp_server), log=str(tmp_path / "log"), control_token="t",
                      any_model=True)
    client = await aiohttp_client(create_app(cfg))
    body = messages_body(url="http://169.254.169.254/latest/meta-data")
    body.pop("max_tokens")
    status, err = await _post(client, "/v1/messages/count_tokens", body)
    assert status == 400 and err["type"] == "error" and "--image-urls" in err["error"]["message"]


async def test_the_learners_resolver_asks_each_proxy_until_one_holds_the_image(aiohttp_server: Any,
                                                                               tmp_path: Path) -> None:
    import asyncio

    from steptap.learner.daemon import _image_resolver
    from steptap.middleware.app import create_app
    from steptap.middleware.sessions.control import SESSIONS_KEY

    cfg = ProxyConfig(backend="http://127.0.0.1:9", log=str(tmp_path / "log"), control_token="t")
    server = await aiohttp_server(create_app(cfg))
    await server.app[SESSIONS_KEY].log.images.put([(image_digest(RED), RED)])
    # the first proxy is down (nothing listens on port 9): the resolver goes on to the next
    resolve = _image_resolver(["http://127.0.0.1:9", str(server.make_url("/"))], "t")
    assert await asyncio.to_thread(resolve, image_digest(RED)) == RED
    assert await asyncio.to_thread(resolve, "0" * 64) is None
