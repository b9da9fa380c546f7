"""Memory in aggregate (issue 25, item 3; issue 42): attacks on a `steptap serve` process whose address
space is limited (RLIMIT_AS) end in 4xx, the proxy stays alive, and its peak RSS stays within the bound
docs/limits.md gives (idle + 2 x max_body_memory + max_image_memory). Bodies: dict bombs, oversized and
concurrent large calls, on the model routes and on ``count_tokens``. Images: the image bomb (an 8000x5000 PNG
of zeros, 155 KB that decode to 160 MB), six a call, eight calls at once, to an unknown model (404 before any
image is read) and to the served one (refused from their headers or decoded one at a time under
max_image_memory); refused calls leave no image file. ``count_tokens`` on N x max_auto_sessions made-up
session ids leaves nothing pending. The backend is the fault injector (its small fixed reply, and a render
route): every attack is refused or answered before vLLM would matter, and it cannot be made to hold a slot on
demand."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import os
import resource
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from conftest import CONTROL_TOKEN, free_port
from faults import MODEL, FaultInjector

MIB = 1024 * 1024
BODY_MEMORY = 128 * MIB  # --max-body-memory of the proxy under test
ADDRESS_SPACE = 3 * 1024 * MIB  # RLIMIT_AS: far below what the attacks would take today


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def dict_bomb(size: int) -> bytes:
    """``{"messages":[{},{},...]}``: 3 bytes per dict, ~70 bytes each once decoded."""
    head, tail = b'{"model":"' + MODEL.encode() + b'","messages":[', b"{}]}"
    return head + b"{}," * ((size - len(head) - len(tail)) // 3) + tail


def long_text(size: int, n: int = 1) -> bytes:
    return (b'{"model":"' + MODEL.encode() + b'","n":' + str(n).encode() + b',"messages":[{"role":"user",'
            b'"content":"' + b"x" * size + b'"}]}')


@contextlib.asynccontextmanager
async def serve(backend: str, tmp_path: Path, *flags: str
                ) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    """``steptap serve`` under RLIMIT_AS, up and answering ``/health``; stopped by pid."""
    port = free_port()
    out = open(tmp_path / "serve.out", "wb")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    proc = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "serve", "--backend", backend, "--port", str(port),
         "--log", str(tmp_path / "log"), "--control-token", CONTROL_TOKEN, "--log-durability", "os", *flags],
        stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit,
        env={**os.environ, "STEPTAP_LOG_LEVEL": "WARNING", "MALLOC_ARENA_MAX": "2"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            for _ in range(600):
                try:
                    async with http.get(f"{url}/health"):
                        break
                except aiohttp.ClientConnectionError:
                    assert proc.poll() is None, (tmp_path / "serve.out").read_text()[-2000:]
                    await asyncio.sleep(0.1)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


async def post(http: aiohttp.ClientSession, url: str, data: bytes) -> int:
    try:
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
            return resp.status
    # Refused (413 or 429) before the body was all sent: cut while sending
    except aiohttp.ClientError:
        return 0


async def test_memory_attacks_end_in_4xx_within_the_documented_bound(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    injector = FaultInjector()
    backend = await aiohttp_server(injector.app)
    async with serve(str(backend.make_url("")).rstrip("/"), tmp_path, "--max-body-memory",
                     str(BODY_MEMORY)) as (proc, url), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        idle = rss_kib(proc.pid, "VmRSS") * 1024
        statuses: dict[str, list[int]] = {}
        attacks = {
            "dict bombs at the body limit": [dict_bomb(16 * MIB)] * 8,
            "bodies over the limit": [long_text(40 * MIB)] * 4,
            "many large calls at once": [long_text(6 * MIB)] * 48,
            # recorded once, not 64 times (schema 5): answered, within the bound
            "n=64 of a large request": [long_text(3 * MIB, n=64)] * 4,
        }
        for name, bodies in attacks.items():
            statuses[name] = await asyncio.gather(*(post(http, f"{url}/v1/chat/completions", b)
                                                    for b in bodies))
            assert proc.poll() is None, (name, (tmp_path / "serve.out").read_text()[-3000:])
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200
        bombs = statuses["dict bombs at the body limit"]  # refused before decoding, or past the byte cap
        assert set(bombs) <= {0, 413, 429} and 413 in bombs, statuses
        assert set(statuses["bodies over the limit"]) <= {0, 413}, statuses
        assert set(statuses["many large calls at once"]) <= {0, 200, 429}, statuses
        assert 429 in statuses["many large calls at once"], statuses  # the global byte cap was reached
        wide = statuses["n=64 of a large request"]
        assert set(wide) <= {200, 429} and 200 in wide, statuses
        peak = rss_kib(proc.pid, "VmHWM") * 1024
        print(f"idle RSS {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, bound "
              f"{(idle + 2 * BODY_MEMORY) / MIB:.0f} MiB")
        assert peak <= idle + 2 * BODY_MEMORY, (idle / MIB, peak / MIB)
        async with http.post(f"{url}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 200  # and it still serves


IMAGE_MEMORY = 256 * MIB  # --max-image-memory of the proxy under test: one bomb's pixels fit, two do not
AUTO_SESSIONS = 20  # --max-auto-sessions


def image_bomb(width: int = 8000) -> bytes:
    """A PNG of zeros, 5000 high: at 8000 wide, 40,000,000 pixels (max_image_pixels' default), ~155 KB that
    decode to 160 MB."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, 5000)).save(out, format="PNG")
    return out.getvalue()


def with_images(model: str, *images: bytes) -> bytes:
    urls = [f"data:image/png;base64,{base64.b64encode(i).decode()}" for i in images]
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return json.dumps({"model": model, "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}).encode()


async def test_count_tokens_and_image_bombs_stay_within_the_documented_bound(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    backend = await aiohttp_server(FaultInjector().app)
    images = tmp_path / "log" / "images"
    bomb, other = image_bomb(), image_bomb(7999)  # two images: the same one twice is decoded once
    async with serve(str(backend.make_url("")).rstrip("/"), tmp_path, "--max-body-memory", str(BODY_MEMORY),
                     "--max-image-memory", str(IMAGE_MEMORY), "--max-auto-sessions",
                     str(AUTO_SESSIONS)) as (proc, url), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        idle = rss_kib(proc.pid, "VmRSS") * 1024
        # count_tokens on 3 x max_auto_sessions made-up session ids: answered, nothing left pending
        count = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        counted = await asyncio.gather(*(post(http, f"{url}/s/{uuid.uuid4().hex}/v1/messages/count_tokens",
                                              count) for _ in range(3 * AUTO_SESSIONS)))
        assert set(counted) == {200}, counted
        async with http.get(f"{url}/health", headers={"Authorization": f"Bearer {CONTROL_TOKEN}"}) as resp:
            health = await resp.json()
        assert health["sessions_pending"] == 0 and health["sessions_open"] == 0, health
        chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        opened = await asyncio.gather(*(post(http, f"{url}/s/agent-{i}/v1/chat/completions", chat)
                                        for i in range(AUTO_SESSIONS)))
        assert set(opened) == {200}, opened  # every agent on a new session URL still has its room
        # count_tokens bodies are bounded as a model call's are: refused before decoding
        bombs = await asyncio.gather(*(post(http, f"{url}/v1/messages/count_tokens", dict_bomb(15 * MIB))
                                       for _ in range(4)))
        assert set(bombs) <= {0, 413, 429} and 413 in bombs, bombs
        # the image bomb, six a call, eight calls at once: to an unknown model, a 404 before any image is read
        six = [bomb, other] * 3
        nope = await asyncio.gather(*(post(http, f"{url}/v1/chat/completions", with_images("nope", *six))
                                      for _ in range(8)))
        assert set(nope) == {404}, nope
        # to the served model: six bombs decode past max_image_memory (a 400 from their headers) ...
        sixes = await asyncio.gather(*(post(http, f"{url}/v1/chat/completions", with_images(MODEL, *six))
                                       for _ in range(8)))
        assert set(sixes) <= {400, 429} and 400 in sixes, sixes
        assert not images.exists() or not list(images.iterdir()), "a refused call left an image file"
        # ... one bomb a call is decoded, one at a time within max_image_memory (another at once: a 429)
        one = await asyncio.gather(*(post(http, f"{url}/v1/chat/completions", with_images(MODEL, bomb))
                                     for _ in range(4)))
        assert set(one) <= {200, 429} and 200 in one, one
        assert proc.poll() is None, (tmp_path / "serve.out").read_text()[-3000:]
        assert [p.name for p in images.iterdir()] == [hashlib.sha256(bomb).hexdigest()]
        peak = rss_kib(proc.pid, "VmHWM") * 1024
        bound = idle + 2 * BODY_MEMORY + IMAGE_MEMORY
        print(f"idle RSS {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB")
        assert peak <= bound, (idle / MIB, peak / MIB, bound / MIB)
