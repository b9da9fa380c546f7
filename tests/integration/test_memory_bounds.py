"""Memory in aggregate (issue 25, item 3): attacks on a `steptap serve` process whose address space is limited
(RLIMIT_AS) end in 4xx, the proxy stays alive, and its peak RSS stays within the bound docs/limits.md gives
(idle + 2 x max_body_memory). The backend is the fault injector (its small fixed reply): every attack is
refused or answered before vLLM would matter, and it cannot be made to hold a slot on demand."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
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


async def test_memory_attacks_end_in_4xx_within_the_documented_bound(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    injector = FaultInjector()
    backend = await aiohttp_server(injector.app)
    port = free_port()
    out = open(tmp_path / "serve.out", "wb")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    proc = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "serve", "--backend",
         str(backend.make_url("")).rstrip("/"), "--port", str(port), "--log", str(tmp_path / "log"),
         "--control-token", CONTROL_TOKEN, "--max-body-memory", str(BODY_MEMORY), "--log-durability", "os"],
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
            idle = rss_kib(proc.pid, "VmRSS") * 1024

            async def post(data: bytes) -> int:
                try:
                    async with http.post(f"{url}/v1/chat/completions", data=data,
                                         headers={"Content-Type": "application/json"}) as resp:
                        await resp.read()
                        return resp.status
                # Refused (413 or 429) before the body was all sent: cut while sending
                except aiohttp.ClientError:
                    return 0

            statuses: dict[str, list[int]] = {}
            attacks = {
                "dict bombs at the body limit": [dict_bomb(16 * MIB)] * 8,
                "bodies over the limit": [long_text(40 * MIB)] * 4,
                "many large calls at once": [long_text(6 * MIB)] * 48,
                # recorded once, not 64 times (schema 5): answered, within the bound
                "n=64 of a large request": [long_text(3 * MIB, n=64)] * 4,
            }
            for name, bodies in attacks.items():
                statuses[name] = await asyncio.gather(*(post(b) for b in bodies))
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
