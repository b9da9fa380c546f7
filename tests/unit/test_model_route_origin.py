"""Model routes take JSON from an allowed Host only (issue 25, item 7): a browser page can POST ``text/plain``
cross-site without a preflight, and DNS rebinding points a foreign name at 127.0.0.1; either would inject
prompts into the trajectory log. The backend is the fault injector: what is tested is what the proxy lets
through, not what vLLM answers."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from faults import MODEL, FaultInjector

BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
MESSAGES = json.dumps({"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})


async def _post(http: aiohttp.ClientSession, url: str, body: str, headers: dict[str, str]) -> tuple[int, Any]:
    async with http.post(url, data=body.encode(), headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_model_routes_refuse_bodies_that_are_not_json(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector()
    proxy = await make_proxy(str((await aiohttp_server(injector.app)).make_url("")).rstrip("/"))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        status, body = await _post(http, f"{proxy.url}/v1/chat/completions", BODY, {"Content-Type": ctype})
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", (ctype, body)
        status, body = await _post(http, f"{proxy.url}/s/a/v1/messages", MESSAGES, {"Content-Type": ctype})
        assert status == 415 and body["type"] == "error" and "application/json" in body["error"]["message"]
    assert injector.calls == 0
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        status, body = await _post(http, f"{proxy.url}/v1/chat/completions", BODY, {"Content-Type": ctype})
        assert status == 200, (ctype, body)


async def test_model_routes_refuse_a_foreign_host(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector()
    proxy = await make_proxy(str((await aiohttp_server(injector.app)).make_url("")).rstrip("/"),
                             allowed_hosts=["proxy.internal"])
    port = proxy.url.rsplit(":", 1)[1]
    json_ = {"Content-Type": "application/json"}
    for host in ("rebind.attacker.example", f"rebind.attacker.example:{port}", "127.0.0.1.attacker.example"):
        status, body = await _post(http, f"{proxy.url}/v1/chat/completions", BODY, {**json_, "Host": host})
        assert status == 403 and body["error"]["code"] == "host_not_allowed", (host, body)
        status, body = await _post(http, f"{proxy.url}/v1/messages", MESSAGES, {**json_, "Host": host})
        assert status == 403 and body["type"] == "error"
    assert injector.calls == 0
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}",
                 "proxy.internal:443"):
        status, body = await _post(http, f"{proxy.url}/v1/chat/completions", BODY, {**json_, "Host": host})
        assert status == 200, (host, body)
