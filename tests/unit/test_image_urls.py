"""Image URLs the proxy fetches (issue 42, items 5 and 6): the allow-list names hosts, and the address a name
resolves to is checked too (loopback, link-local, private and metadata addresses are refused unless listed
as IPs), the connection goes to the address checked (a second lookup could answer another), every failed
fetch says the same words (no status or port oracle), and an image larger than one network read is read
whole up to the limit. A real local aiohttp server serves the images; a stand-in resolver (named as such)
answers for made-up names."""

from __future__ import annotations

import asyncio
import io
import random
import socket
from typing import Any

import pytest
from aiohttp import web
from test_vision_images import gather

from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.proxy.image_urls import FETCH_FAILED


def png(size: tuple[int, int], noise: bool = False) -> bytes:
    from PIL import Image

    img = Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3)) if noise \
        else Image.new("RGB", size, (255, 0, 0))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


RED = png((4, 3))
LARGE = png((300, 300), noise=True)  # ~270 KB: more than one network read


def chat(url: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture
async def images(aiohttp_server: Any) -> Any:
    async def image(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "secret.png":
            return web.Response(status=401, text="who are you")
        if name == "moved.png":
            raise web.HTTPFound("/img/red.png")
        if name == "large.png":  # several writes, apart: the reader sees several network reads
            resp = web.StreamResponse(headers={"Content-Type": "image/png"})
            await resp.prepare(request)
            for i in range(0, len(LARGE), 1 << 16):
                await resp.write(LARGE[i:i + (1 << 16)])
                await asyncio.sleep(0.02)
            await resp.write_eof()
            return resp
        return web.Response(body=RED, content_type="image/png")

    app = web.Application()
    app.router.add_get("/img/{name}", image)
    server = await aiohttp_server(app, host="127.0.0.1")
    return server.port


async def _refused(url: str, cfg: ProxyConfig) -> str:
    with pytest.raises(ApiError) as err:
        await gather(chat(url), cfg, {})
    assert err.value.status == 400 and err.value.code == "invalid_image"
    return err.value.message


async def test_a_name_that_resolves_to_loopback_is_refused_unless_the_address_is_listed(images: int) -> None:
    by_name = ProxyConfig(backend="x", image_urls=["localhost"])
    message = await _refused(f"http://localhost:{images}/img/red.png", by_name)
    assert message == FETCH_FAILED
    for allowed in (["localhost", "127.0.0.1"], ["127.0.0.1"], ["localhost", "127.0.0.0/8"]):
        cfg = ProxyConfig(backend="x", image_urls=allowed)
        host = "127.0.0.1" if allowed == ["127.0.0.1"] else "localhost"
        [image] = await gather(chat(f"http://{host}:{images}/img/red.png"), cfg, {})
        assert image.data == RED
    anyone = ProxyConfig(backend="x", image_urls=["*"])  # any name, never an address inside
    for url in (f"http://127.0.0.1:{images}/img/red.png", f"http://localhost:{images}/img/red.png",
                "http://169.254.169.254/latest/meta-data", "http://[::ffff:127.0.0.1]:9/x",
                "http://10.1.2.3/x", "http://[fd00:ec2::254]/x"):
        assert await _refused(url, anyone) == FETCH_FAILED, url


async def test_every_failed_fetch_says_the_same_words(images: int) -> None:
    cfg = ProxyConfig(backend="x", image_urls=["127.0.0.1"], image_url_timeout_s=5)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a refused connection
    try:
        messages = {await _refused(url, cfg) for url in (
            f"http://127.0.0.1:{images}/img/secret.png",  # 401
            f"http://127.0.0.1:{images}/img/moved.png",  # a redirect
            f"http://127.0.0.1:{closed.getsockname()[1]}/img/red.png",  # nothing listens
        )}
    finally:
        closed.close()
    assert len(messages) == 1, messages  # one text: no answer, port or address tells itself apart
    assert messages == {FETCH_FAILED}
    assert "401" not in FETCH_FAILED and "127.0.0.1" not in FETCH_FAILED


async def test_the_connection_goes_to_the_address_checked(images: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in resolver: the name answers a listed address once, then an address that is not (DNS
    rebinding between the check and the connection)."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    answers = ["127.0.0.1", "10.9.9.9"]
    asked: list[str] = []

    async def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "pinned.test":
            return await real(host, *args, **kwargs)
        asked.append(host)
        return await real(answers[min(len(asked), 2) - 1], *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", rebinding)
    cfg = ProxyConfig(backend="x", image_urls=["pinned.test", "127.0.0.1"])
    [image] = await gather(chat(f"http://pinned.test:{images}/img/red.png"), cfg, {})
    assert image.data == RED and asked == ["pinned.test"]


async def test_an_image_larger_than_one_read_is_read_whole(images: int) -> None:
    cfg = ProxyConfig(backend="x", image_urls=["127.0.0.1"], max_image_bytes=1 << 20)
    [image] = await gather(chat(f"http://127.0.0.1:{images}/img/large.png"), cfg, {})
    assert image.data == LARGE and len(LARGE) > 200_000
    small = ProxyConfig(backend="x", image_urls=["127.0.0.1"], max_image_bytes=len(LARGE) - 1)
    assert await _refused(f"http://127.0.0.1:{images}/img/large.png", small) == FETCH_FAILED
