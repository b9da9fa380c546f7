"""Both Python clients take one URL and one option set (issue 41): a real proxy (``create_app``, the whole
control API and stream) served on a unix socket and on TCP named with ``/v1``; each client opens sessions with
every option (``tito`` included), finishes them, and the async one streams them back. A learner config or a
``steptap run --proxy`` with a URL neither client can use is refused when read."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from conftest import free_port

from steptap.middleware.app import create_app
from steptap.middleware.client import (
    SessionOptions,
    SteptapClient,
    SyncSteptapClient,
    proxy_url,
)
from steptap.middleware.client.api import session_body
from steptap.middleware.config import ProxyConfig
from steptap.middleware.log.stream import LOG_KEY
from steptap.middleware.records import SessionOpened
from steptap.middleware.sessions.control import OpenBody

TOKEN = "stc-url-test"
OPTIONS: SessionOptions = {"group_id": "g", "group_size": 2, "mode": "train", "metadata": {"task": "t1"},
                           "idle_timeout_s": 120.0, "tito": True, "train": "all", "side_models": ["haiku"]}


@pytest.fixture(params=["unix", "tcp-v1"])
async def proxy(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, web.Application]]:
    """A real proxy app (in front of no backend: the control API and the stream need none), and the URL a user
    would give for it: ``unix:PATH``, or ``http://127.0.0.1:PORT/v1`` (the agents' base URL)."""
    app = create_app(ProxyConfig(backend="http://127.0.0.1:9", log=str(tmp_path / "log"), control_token=TOKEN,
                                 sweep_interval_s=0.05))
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    with tempfile.TemporaryDirectory(prefix="stc-") as short:  # a unix socket path is at most ~100 bytes
        if request.param == "unix":
            sock = f"{short}/proxy.sock"
            await web.UnixSite(runner, sock).start()
            url = f"unix:{sock}"
        else:
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            url = f"http://127.0.0.1:{port}/v1/"
        try:
            yield url, app
        finally:
            await runner.cleanup()


def _opened(app: web.Application) -> dict[str, SessionOpened]:
    return {r.trajectory_id: r for r in app[LOG_KEY].records() if isinstance(r, SessionOpened)}


async def test_both_clients_open_finish_and_stream_on_one_url(proxy: tuple[str, web.Application]) -> None:
    url, app = proxy

    def sync_side() -> str:
        client = SyncSteptapClient(url, TOKEN, timeout_s=10)
        assert client.health()["status"] in ("ok", "degraded")  # an answer (its backend is down)
        info = client.open_session(session_id="sync-1", **OPTIONS)
        client.finish(info.id, reward=1.0)
        return info.id

    sync_id = await asyncio.to_thread(sync_side)  # the proxy serves on this loop
    async with SteptapClient(url, TOKEN, timeout_s=10) as client:
        info = await client.open_session(session_id="async-1", **OPTIONS)
        assert (await client.get_session(info.id)).metadata == {"task": "t1"}
        await client.finish(info.id, reward=0.5)
        got = [d async for d in client.trajectories("learner", follow=False)]
        assert [(d.trajectory.id, d.trajectory.rewards) for d in got] == [
            (sync_id, {"reward": 1.0}), ("async-1", {"reward": 0.5})]
        await client.ack("learner", got[-1].cursor)
    for opened in _opened(app).values():  # every option reached the proxy, the same from both clients
        assert (opened.group_id, opened.group_size, opened.metadata, opened.idle_timeout_s, opened.tito,
                opened.train, opened.side_models) == ("g", 2, {"task": "t1"}, 120.0, True, "all", ["haiku"])
    assert set(_opened(app)) == {"sync-1", "async-1"}


def test_the_session_options_are_the_proxys() -> None:
    """One option set: what ``POST /sessions`` takes (``OpenBody``) is what both clients offer."""
    body_fields = {f.name for f in msgspec.structs.fields(OpenBody)}
    assert {"session_id" if f == "id" else f for f in body_fields} == set(SessionOptions.__annotations__)
    everything: Any = {**OPTIONS, "session_id": "s1"}
    opened = msgspec.json.decode(msgspec.json.encode(session_body(everything)), type=OpenBody)
    assert (opened.id, opened.tito, opened.train, opened.side_models) == ("s1", True, "all", ["haiku"])
    assert session_body({}) == {"mode": "train"}  # defaults unsent: an older proxy takes the body
    with pytest.raises(TypeError, match="unknown options"):
        session_body({"titto": True})  # type: ignore[typeddict-unknown-key]


def test_one_url_type_names_one_proxy_however_spelled() -> None:
    assert proxy_url("http://p:8400/v1/").name == proxy_url("http://p:8400").name == "http://p:8400"
    unix = proxy_url("unix:/run/steptap.sock")
    assert (unix.base, unix.socket) == ("http://localhost", "/run/steptap.sock")
    for bad in ("ftp://p", "p:8400", "unix:", "http://p:99999"):
        with pytest.raises(ValueError, match="not a proxy URL"):
            proxy_url(bad)
    with pytest.raises(ValueError, match="not a proxy URL"):
        SteptapClient("localhost:8400")  # refused when made, not at its first stream


def test_a_learner_config_or_steptap_run_with_a_bad_proxy_url_is_refused_when_read(tmp_path: Path,
                                                                                   capsys: Any) -> None:
    from steptap.adapters.run import _parse_args
    from steptap.learner.config import load_config

    (tmp_path / "learner.toml").write_text('proxy_urls = ["http://a:1/v1", "http://a:1", "a:2"]\n')
    with pytest.raises(ValueError, match=r"proxy_urls: not a proxy URL: 'a:2'"):
        load_config(tmp_path / "learner.toml")
    with pytest.raises(ValueError, match=r"proxy_urls: not a proxy URL: 'localhost:8400'"):
        load_config(None, {"proxy_url": "localhost:8400"})
    good = load_config(None, {"proxy_urls": ["http://a:1/v1", "http://a:1", "unix:/r/p.sock"]})
    assert good.urls() == ["http://a:1", "unix:/r/p.sock"]  # one proxy named twice is one
    with pytest.raises(SystemExit):
        _parse_args(["--proxy", "localhost:8400", "--control-token", "t", "--", "true"])
    assert "--proxy: not a proxy URL" in capsys.readouterr().err
    assert _parse_args(["--proxy", "unix:/r/p.sock", "--control-token", "t", "--", "true"]).proxy
