"""Bad inputs and backend failures: each gets its OpenAI error body and status, failures are recorded as
failed steps (never as successes), and the proxy keeps serving afterwards. Backend faults come from the fault
injector (tests/faults.py); the agent's own mistakes are checked against the real server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import msgspec
import pytest
from conftest import Backend, Proxy
from faults import MODEL, FaultInjector, refused_address

from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.sessions.control import SESSIONS_KEY


def assert_openai_error(
    status: int, body: Any, expected_status: int, code: str | None = None
) -> dict[str, Any]:
    assert status == expected_status, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err
    if code is not None:
        assert err["code"] == code, err
    return err


async def call(http: aiohttp.ClientSession, url: str, data: Any, **kw: Any) -> tuple[int, Any]:
    if not isinstance(data, (bytes, str)):
        data = json.dumps(data)
    async with http.post(
        url, data=data, headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw
    ) as resp:
        return resp.status, await resp.json(content_type=None)


def good(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
    }


@pytest.mark.vllm
async def test_agent_mistakes_get_openai_errors_and_the_proxy_keeps_serving(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    url = f"{proxy.url}/v1/chat/completions"
    cases: list[tuple[Any, int, str | None]] = [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        ({**good(vllm_server.served_model), "model": "gpt-4o"}, 404, "model_not_found"),
        ({"model": vllm_server.served_model}, 400, None),  # no messages: vLLM's own 400, passed on unchanged
        ({**good(vllm_server.served_model), "max_tokens": -1}, 400, None),
    ]
    for data, status, code in cases:
        got_status, body = await call(http, url, data)
        err = assert_openai_error(got_status, body, status, code)
        if status == 404:
            assert "gpt-4o" in err["message"]
    # invalid session ids on the path/header
    got_status, body = await call(
        http, url, good(vllm_server.served_model), headers={"X-Steptap-Session": "a b"}
    )
    assert_openai_error(got_status, body, 400, "invalid_session_id")
    status, body = await call(http, url, good(vllm_server.served_model))
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    # unknown routes and methods are OpenAI errors too
    async with http.get(f"{proxy.url}/v1/nothing") as resp:
        assert_openai_error(resp.status, await resp.json(content_type=None), 404)
    async with http.get(url) as resp:
        assert_openai_error(resp.status, await resp.json(content_type=None), 405)
    # nothing was recorded for refused calls: only the one good anonymous call
    m = proxy.app[METRICS_KEY]  # type: ignore[index]
    assert m.steps.value("ok", "true") == 1


@pytest.mark.vllm
async def test_any_model_routes_every_name_and_records_both(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url, any_model=True)
    status, body = await call(
        http, f"{proxy.url}/s/any/v1/chat/completions", {**good("x"), "model": "gpt-4o"}
    )
    assert status == 200 and body["model"] == vllm_server.served_model
    (step,) = proxy.app[SESSIONS_KEY].sessions["auto:any"].trajectory.steps
    assert step.model == "gpt-4o" and step.served_model == vllm_server.served_model
    assert step.request["model"] == "gpt-4o"


@pytest.mark.vllm
async def test_no_auto_create_gives_404(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url, auto_create=False)
    status, body = await call(http, f"{proxy.url}/s/nope/v1/chat/completions", good(vllm_server.served_model))
    assert_openai_error(status, body, 404, "session_not_found")
    status, body = await call(
        http,
        f"{proxy.url}/v1/chat/completions",
        good(vllm_server.served_model),
        headers={"X-Steptap-Session": "nope"},
    )
    assert_openai_error(status, body, 404, "session_not_found")
    assert "nope" not in proxy.app[SESSIONS_KEY].sessions


async def test_unreachable_backend_is_502_naming_it(make_proxy: Any, http: aiohttp.ClientSession) -> None:
    sock, url = refused_address()
    try:
        proxy = await make_proxy(url)
        status, body = await call(http, f"{proxy.url}/v1/chat/completions", good("m"))
        err = assert_openai_error(status, body, 502, "backend_unreachable")
        assert url in err["message"]
        async with http.get(f"{proxy.url}/health", headers=proxy.control) as resp:
            health = await resp.json()
            assert resp.status == 503 and health["status"] == "degraded"
            assert health["backends"][0]["url"] == url and not health["backends"][0]["healthy"]
        async with http.get(f"{proxy.url}/v1/models") as resp:
            assert_openai_error(resp.status, await resp.json(), 502, "backend_unreachable")
    finally:
        sock.close()


@pytest.fixture
async def faulty(aiohttp_server: Any, make_proxy: Any) -> tuple[FaultInjector, Proxy]:
    injector = FaultInjector(stall_s=3.0)
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), upstream_timeout_s=0.5)
    return injector, proxy


async def stream_events(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> list[Any]:
    async with http.post(url, json={**body, "stream": True}, **kw) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    return [
        b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in raw.split("\n\n") if b.startswith("data: ")
    ]


@pytest.mark.parametrize(
    "mode, status, code",
    [
        ("error500", 502, "backend_error"),
        ("error503", 503, "backend_unavailable"),
        ("stall", 504, "backend_timeout"),
        ("malformed", 502, "backend_malformed_reply"),
    ],
)
async def test_backend_faults_plain(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession, mode: str, status: int, code: str
) -> None:
    injector, proxy = faulty
    url = f"{proxy.url}/s/f/v1/chat/completions"
    injector.mode = mode
    got, body = await call(http, url, good(MODEL))
    err = assert_openai_error(got, body, status, code)
    assert proxy.app[SESSIONS_KEY].config.backend in err["message"]  # type: ignore[index]
    injector.mode = "ok"
    got, body = await call(http, url, good(MODEL))
    assert got == 200 and body["choices"][0]["message"]["content"] == "Hello!"
    failed, ok = proxy.app[SESSIONS_KEY].sessions["auto:f"].trajectory.steps  # type: ignore[index]
    assert failed.status == "failed" and failed.error is not None and ok.status == "ok"
    assert ok.response_token_ids == [11, 12, 13] and ok.response_logprobs == [-0.5, -0.25, -0.125]
    assert ok.prefix == "first"  # a failed step is no base for continuity


@pytest.mark.parametrize(
    "mode, type_",
    [
        ("cut", "backend_cut"),
        ("stall", "backend_timeout"),
        ("malformed", "backend_malformed"),
        ("error_event", "backend_error"),
    ],
)
async def test_backend_faults_mid_stream(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession, mode: str, type_: str
) -> None:
    injector, proxy = faulty
    url = f"{proxy.url}/s/c/v1/chat/completions"
    injector.mode = mode
    events = await stream_events(http, url, good(MODEL))
    assert events[0]["choices"][0]["delta"]["content"] == "He"  # what arrived before the fault was relayed
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1
    if mode == "error_event":  # vLLM's own error event is passed on as vLLM sends it
        assert errors[0]["error"]["message"] == "engine died" and events[-1] == "[DONE]"
    else:  # the stream ends with our error event, never with a clean [DONE]
        assert events[-1] is errors[0] and errors[0]["error"]["code"] == type_
    (step,) = proxy.app[SESSIONS_KEY].sessions["auto:c"].trajectory.steps  # type: ignore[index]
    assert step.status == "failed" and step.error.type == type_
    assert step.response_token_ids[:1] == [11]  # the partial reply is kept for inspection
    m = proxy.app[METRICS_KEY]  # type: ignore[index]
    assert m.steps.value("failed", "false") == 1
    injector.mode = "ok"
    events = await stream_events(http, url, good(MODEL))
    assert events[-1] == "[DONE]"
    assert proxy.app[SESSIONS_KEY].sessions["auto:c"].trajectory.steps[-1].status == "ok"  # type: ignore[index]


async def test_openai_client_raises_on_a_cut_stream(faulty: tuple[FaultInjector, Proxy]) -> None:
    import openai

    injector, proxy = faulty
    injector.mode = "cut"
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/sdk/v1", api_key="EMPTY", max_retries=0)
    with pytest.raises(openai.APIError):
        async for _ in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
        ):
            pass
    await client.close()


async def test_agent_hanging_up_mid_stream_records_a_failed_step(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injector = FaultInjector(stall_s=0.5)
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), upstream_timeout_s=5)
    injector.mode = "stall"
    resp = await http.post(f"{proxy.url}/s/gone/v1/chat/completions", json={**good(MODEL), "stream": True})
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    resp.close()  # the agent hangs up while the backend is still generating
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    for _ in range(60):
        await asyncio.sleep(0.05)
        steps = manager.sessions["auto:gone"].trajectory.steps
        if steps:
            break
    (step,) = steps
    assert step.status == "failed" and step.error.type == "client_gone"
    # and the proxy keeps serving
    injector.mode = "ok"
    status, body = await call(http, f"{proxy.url}/s/gone/v1/chat/completions", good(MODEL))
    assert status == 200


async def test_a_stream_waiting_on_the_backend_sends_heartbeats_and_notices_an_agent_that_left(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    """While vLLM prefills (headers out, no token yet) the agent gets an SSE comment every
    ``stream_heartbeat_s``: its idle timer sees the stream alive, the events that follow are vLLM's, and the
    step is recorded whole. An agent that leaves meanwhile is recorded ``client_gone`` without waiting for the
    backend, whose call is let go."""
    injector = FaultInjector()
    server = await aiohttp_server(injector.app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), stream_heartbeat_s=0.05)
    injector.mode = "hold_stream"
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    resp = await http.post(f"{proxy.url}/s/beat/v1/chat/completions", json={**good(MODEL), "stream": True})
    beats = 0
    while beats < 3:  # they keep coming for as long as the backend holds the call
        line = await resp.content.readline()
        assert line in (b": waiting for the model\n", b"\n"), line
        beats += line.startswith(b":")
    pending = manager.sessions.get("auto:beat")  # an auto session exists once its first step is recorded
    assert injector.held == 1 and (pending is None or not pending.trajectory.steps)
    injector.release.set()
    body = await resp.read()
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and all(json.loads(e)["choices"] for e in events[:-1])
    (step,) = manager.sessions["auto:beat"].trajectory.steps
    assert step.status == "ok" and step.response_token_ids

    injector.release.clear()
    resp = await http.post(f"{proxy.url}/s/left/v1/chat/completions", json={**good(MODEL), "stream": True})
    assert (await resp.content.readline()).startswith(b":")
    resp.close()  # the agent leaves during the prefill
    for _ in range(200):
        await asyncio.sleep(0.05)
        if "auto:left" in manager.sessions and manager.sessions["auto:left"].trajectory.steps:
            break
    (step,) = manager.sessions["auto:left"].trajectory.steps  # recorded with the backend never released
    assert step.status == "failed" and step.error.type == "client_gone"
    assert injector.held == 0  # and the backend's call let go (vLLM aborts a request whose connection closes)


async def test_unknown_model_routes_under_a_session_path_are_404(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession
) -> None:
    _, proxy = faulty
    status, body = await call(http, f"{proxy.url}/s/x/v1/embeddings", {"input": "x"})
    assert_openai_error(status, body, 404, "not_found")
    status, body = await call(http, f"{proxy.url}/s/x/sessions", {})
    assert_openai_error(status, body, 403, "forbidden")


async def test_sequential_calls_reuse_one_upstream_connection(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession
) -> None:
    injector, proxy = faulty
    for i in range(6):
        if i % 2:
            assert (await stream_events(http, f"{proxy.url}/v1/chat/completions", good(MODEL)))[
                -1
            ] == "[DONE]"
        else:
            status, _ = await call(http, f"{proxy.url}/v1/chat/completions", good(MODEL))
            assert status == 200
    assert injector.calls == 6 and len(injector.connections) == 1


async def test_events_cut_across_reads_are_reassembled(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession
) -> None:
    injector, proxy = faulty
    injector.mode = "split"
    events = await stream_events(http, f"{proxy.url}/s/split/v1/chat/completions", good(MODEL))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == "Hello!"
    (step,) = proxy.app[SESSIONS_KEY].sessions["auto:split"].trajectory.steps  # type: ignore[index]
    assert step.status == "ok" and step.response_token_ids == [11, 12, 13]


async def test_steps_carry_the_policy_version_read_at_the_gate(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession
) -> None:
    from steptap.middleware.weights.routes import SWAPPER_KEY

    _, proxy = faulty
    swapper = proxy.app[SWAPPER_KEY]  # type: ignore[index]
    for version in (0, 3):
        swapper.policy = msgspec.structs.replace(swapper.policy, version=version)  # as a swap leaves it
        status, _ = await call(http, f"{proxy.url}/s/pv/v1/chat/completions", good(MODEL))
        assert status == 200
    steps = proxy.app[SESSIONS_KEY].sessions["auto:pv"].trajectory.steps  # type: ignore[index]
    assert [s.policy_version for s in steps] == [0, 3]


async def test_agent_credentials_never_reach_the_backend(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    injector = FaultInjector()
    server = await aiohttp_server(injector.app)
    for key, expected in ((None, None), ("backend-secret", "Bearer backend-secret")):
        injector.authorization.clear()
        proxy = await make_proxy(
            str(server.make_url("")).rstrip("/"), log_dir=tmp_path / f"log-{key}", backend_api_key=key
        )
        status, _ = await call(
            http,
            f"{proxy.url}/v1/chat/completions",
            good(MODEL),
            headers={"Authorization": "Bearer sk-agent-key"},
        )
        assert status == 200 and injector.authorization == [expected]


async def test_a_connection_closed_unanswered_is_retried_once(
    faulty: tuple[FaultInjector, Proxy], http: aiohttp.ClientSession
) -> None:
    injector, proxy = faulty
    injector.mode = "disconnect_once"
    status, body = await call(http, f"{proxy.url}/s/retry/v1/chat/completions", good(MODEL))
    assert status == 200 and injector.calls == 2
    steps = proxy.app[SESSIONS_KEY].sessions["auto:retry"].trajectory.steps  # type: ignore[index]
    assert [s.status for s in steps] == ["ok"]
