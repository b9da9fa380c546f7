"""Images after admission (issue 42, item 2): a call is admitted and routed before its images are read, so a
refused call (an unknown model, a 429, the backend's 400) decodes and stores nothing; decoded pixels count
against ``max_image_memory`` from the image's header, before decoding; decoding runs on the images' own small
executor, never the loop's default one (the log stream and reward callbacks use that); an image file is
written only with the step that names it. The backend is the fault injector: what is tested is what the proxy
decodes and keeps."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import json
import threading
from pathlib import Path
from typing import Any

import aiohttp
from conftest import Proxy
from faults import MODEL, FaultInjector

from steptap.middleware.config import ProxyConfig
from steptap.middleware.delta import full_steps
from steptap.middleware.log.images import IMAGES_DIR, ImageStore
from steptap.middleware.proxy import vision
from steptap.middleware.records import image_digest
from steptap.middleware.sessions.control import SESSIONS_KEY

JSON = {"Content-Type": "application/json"}


def png(size: tuple[int, int], color: tuple[int, int, int] = (0, 0, 0)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def chat(model: str, *images: bytes) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "look"}]
    urls = [f"data:image/png;base64,{base64.b64encode(i).decode()}" for i in images]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": parts}]}


async def _proxy(aiohttp_server: Any, make_proxy: Any, injector: FaultInjector, **kw: Any) -> Proxy:
    backend = await aiohttp_server(injector.app)
    proxy: Proxy = await make_proxy(str(backend.make_url("")).rstrip("/"), **kw)
    return proxy


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, data=json.dumps(body).encode(), headers=JSON) as resp:
        return resp.status, await resp.json(content_type=None)


def _images_on_disk(proxy: Proxy) -> list[str]:
    folder = proxy.log_dir / IMAGES_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def test_refused_calls_decode_and_store_nothing(
        aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession) -> None:
    injector = FaultInjector()
    proxy = await _proxy(aiohttp_server, make_proxy, injector, max_concurrent_calls=1)
    memory = proxy.app[vision.IMAGE_MEMORY_KEY]  # type: ignore[index]
    image = png((40, 30))
    # an unknown model: a 404 before any image is read
    status, body = await _post(http, f"{proxy.url}/s/a/v1/chat/completions", chat("nope", image))
    assert status == 404, body
    # the only slot taken (a call held by the backend): a 429 before any image is read
    injector.mode = "hold"
    first = asyncio.ensure_future(_post(http, f"{proxy.url}/v1/chat/completions", chat(MODEL)))
    while injector.held < 1:
        await asyncio.sleep(0.01)
    status, body = await _post(http, f"{proxy.url}/s/b/v1/chat/completions", chat(MODEL, image))
    assert status == 429, body
    injector.release.set()
    assert (await first)[0] == 200
    assert _images_on_disk(proxy) == []
    assert memory.decoded == 0  # no image was decoded for either
    # the backend refuses the call (a pending auto session: nothing recorded): decoded, never stored
    injector.mode = "error400"
    status, body = await _post(http, f"{proxy.url}/s/c/v1/chat/completions", chat(MODEL, image))
    assert status == 400, body
    assert _images_on_disk(proxy) == []
    assert memory.decoded == 1 and memory.held == 0
    assert proxy.app[SESSIONS_KEY].pending == {}  # type: ignore[index]
    # accepted: stored with the step that names it
    injector.mode = "ok"
    status, body = await _post(http, f"{proxy.url}/s/d/v1/chat/completions", chat(MODEL, image))
    assert status == 200, body
    assert _images_on_disk(proxy) == [image_digest(image)]
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    [step] = full_steps(manager.sessions["auto:d"].trajectory.steps)
    assert [i.sha256 for i in step.images] == [image_digest(image)]


async def test_decoded_pixels_count_against_image_memory_before_decoding(
        aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession) -> None:
    proxy = await _proxy(aiohttp_server, make_proxy, FaultInjector(), max_image_bytes=1 << 20,
                         max_image_memory=8 << 20)
    memory = proxy.app[vision.IMAGE_MEMORY_KEY]  # type: ignore[index]
    small, big = png((1000, 1000)), png((2000, 2000))  # 4 MB and 16 MB decoded; a few KB each encoded
    status, body = await _post(http, f"{proxy.url}/v1/chat/completions", chat(MODEL, big))
    assert status == 400 and body["error"]["code"] == "invalid_image", body
    assert "max_image_memory" in body["error"]["message"]
    # two that fit one by one but not together in one call: refused before the second is decoded
    wide = png((1000, 1100))
    status, body = await _post(http, f"{proxy.url}/v1/chat/completions", chat(MODEL, small, wide))
    assert status == 400 and "max_image_memory" in body["error"]["message"], body
    assert memory.decoded == 1 and memory.held == 0
    status, body = await _post(http, f"{proxy.url}/v1/chat/completions", chat(MODEL, small))
    assert status == 200, body


async def test_images_decode_on_their_own_executor(tmp_path: Path) -> None:
    """The loop's default executor busy (all its threads blocked): an image is still read and decoded."""
    loop = asyncio.get_running_loop()
    busy = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    loop.set_default_executor(busy)
    blocked = loop.run_in_executor(None, gate.wait)
    cfg = ProxyConfig(backend="x")
    memory = vision.ImageMemory(cfg.max_image_memory)
    pics = vision.CallImages(cfg, memory, ImageStore(tmp_path))
    try:
        reading = asyncio.ensure_future(pics.read(chat(MODEL, png((8, 8)))))
        # either the read finishes, or it queued work behind the blocked thread (what it must never do)
        while not reading.done() and busy._work_queue.empty():
            await asyncio.sleep(0.01)
        assert reading.done() and busy._work_queue.empty(), "an image was decoded on the default executor"
        await reading
        assert [i.width for i in pics.images] == [8] and memory.decoded == 1
    finally:
        gate.set()
        await blocked
        memory.close()
