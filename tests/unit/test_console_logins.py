"""Console logins (issue 42, items 7 to 9): the cookie is ``Secure`` when the proxy is served under an
https ``public_url`` (behind the TLS front docs/SECURITY.md asks for, the proxy itself sees plain HTTP); a
viewer who logs in again and again never logs the operator out (each role has its own table); a one-time
login code lives minutes, not an hour. The backend is a refused address: the console's logins need none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from faults import refused_address

from steptap.middleware.app import create_app
from steptap.middleware.config import ProxyConfig
from steptap.middleware.console import access

TOKEN, VIEWER = "control-token", "viewer-token"


@pytest.fixture
def backend() -> Iterator[str]:
    sock, url = refused_address()
    try:
        yield url
    finally:
        sock.close()


async def _client(aiohttp_client: Any, backend: str, tmp_path: Path, **kw: Any) -> Any:
    cfg = ProxyConfig(backend=backend, log=str(tmp_path / "log"), control_token=TOKEN, viewer_token=VIEWER,
                      **kw)
    return await aiohttp_client(create_app(cfg))


async def _login(client: Any, body: dict[str, str]) -> tuple[int, str]:
    resp = await client.post("/console/api/login", json=body)
    await resp.read()
    cookie = resp.cookies.get(access.COOKIE)
    return resp.status, cookie.value if cookie is not None else ""


async def test_the_cookie_is_secure_under_an_https_public_url(aiohttp_client: Any, backend: str,
                                                             tmp_path: Path) -> None:
    client = await _client(aiohttp_client, backend, tmp_path, public_url="https://run.example")
    resp = await client.post("/console/api/login", json={"token": VIEWER})
    assert resp.status == 200
    cookie = resp.headers["Set-Cookie"]
    assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    plain = await _client(aiohttp_client, backend, tmp_path / "plain")  # http: a browser would drop it
    resp = await plain.post("/console/api/login", json={"token": VIEWER})
    assert resp.status == 200 and "Secure" not in resp.headers["Set-Cookie"]


async def test_a_viewer_logging_in_again_and_again_never_logs_the_operator_out(
        aiohttp_client: Any, backend: str, tmp_path: Path) -> None:
    client = await _client(aiohttp_client, backend, tmp_path)
    status, operator = await _login(client, {"token": TOKEN})
    assert status == 200 and operator
    for _ in range(access.MAX_SESSIONS + 1):
        status, _ = await _login(client, {"token": VIEWER})
        assert status == 200
    resp = await client.get("/console/api/me", cookies={access.COOKIE: operator})
    assert resp.status == 200 and (await resp.json())["role"] == "control"
    await (await client.post("/console/api/logout", cookies={access.COOKIE: operator})).read()
    assert (await client.get("/console/api/me", cookies={access.COOKIE: operator})).status == 401


async def test_a_login_code_lives_minutes(aiohttp_client: Any, backend: str, tmp_path: Path,
                                          monkeypatch: Any) -> None:
    client = await _client(aiohttp_client, backend, tmp_path)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    codes = []
    for _ in range(2):
        resp = await client.post("/console/api/codes", json={"role": "control"}, headers=headers)
        assert resp.status == 201
        codes.append((await resp.json())["code"])
    now = time.time()
    monkeypatch.setattr(access, "time", SimpleNamespace(time=lambda: now + 9 * 60))
    assert (await _login(client, {"code": codes[0]}))[0] == 200
    monkeypatch.setattr(access, "time", SimpleNamespace(time=lambda: now + 11 * 60))
    assert (await _login(client, {"code": codes[1]}))[0] == 401
