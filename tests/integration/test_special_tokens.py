"""A special token sampled mid-reply (issue 39): the scripted model (tests/scripted_tools) answers a task
holding ``STEPTAP_SPECIAL`` with ``Before<|endoftext|>after``, the end-of-text token forced between two
words. What text a client is shown of it depends on whether the call offered tools, not on the protocol:
vLLM's hermes tool parser keeps special tokens in the text of a call with tools (its tool-call tags may
be special tokens), and every protocol the proxy serves shows that text as vLLM gave it (chat relayed;
Responses and Messages translated from the same chat reply): ``Beforeafter`` without tools,
``Before<|endoftext|>after`` with them, on chat, Responses and Messages alike, plain and streamed. The
step's ids are the sampled ones either way, and the text with the token, sent back next turn, renders to
those same ids: the session stays one token sequence."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from conftest import http_json

pytestmark = pytest.mark.vllm
TASK = "Say it. STEPTAP_SPECIAL"
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "parameters": SCHEMA}]
MESSAGES_TOOLS = [{"name": "bash", "input_schema": SCHEMA}]


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {
        "Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=300) as reply:
        raw = reply.read().decode()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def _text(base: str, model: str, protocol: str, tools: bool, stream: bool) -> str:
    user = [{"role": "user", "content": TASK}]
    if protocol == "chat":
        body: dict[str, Any] = {"model": model, "messages": user, "max_tokens": 16}
        body |= {"tools": CHAT_TOOLS} if tools else {}
        if not stream:
            return http_json(f"{base}/v1/chat/completions", body)["choices"][0]["message"]["content"]
        chunks = _events(f"{base}/v1/chat/completions", {**body, "stream": True})
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    if protocol == "responses":
        body = {"model": model, "input": TASK, "max_output_tokens": 16}
        body |= {"tools": RESPONSES_TOOLS} if tools else {}
        if not stream:
            reply = http_json(f"{base}/v1/responses", body)
            return "".join(p["text"] for i in reply["output"] if i["type"] == "message" for p in i["content"])
        events = _events(f"{base}/v1/responses", {**body, "stream": True})
        return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    body = {"model": model, "messages": user, "max_tokens": 16} | ({"tools": MESSAGES_TOOLS} if tools else {})
    if not stream:
        headers = {"anthropic-version": "2023-06-01"}
        blocks = http_json(f"{base}/v1/messages", body, headers=headers)["content"]
        return "".join(b.get("text", "") for b in blocks)
    events = _events(f"{base}/v1/messages", {**body, "stream": True})
    return "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta")


def test_every_protocol_shows_a_special_token_as_chat_does(long_proxy: Any, long_vllm: Any) -> None:
    base = long_proxy.url
    seen = {(p, tools, stream): _text(base, long_vllm.served_model, p, tools, stream)
            for p in ("chat", "responses", "messages") for tools in (False, True) for stream in (False, True)}
    assert {k: v for k, v in seen.items() if not k[1]} == {k: "Beforeafter" for k in seen if not k[1]}
    assert {k: v for k, v in seen.items() if k[1]} == {k: "Before<|endoftext|>after" for k in seen if k[1]}


def test_the_text_sent_back_renders_to_the_sampled_ids(long_proxy: Any, long_vllm: Any) -> None:
    from transformers import AutoTokenizer

    from steptap.middleware.client import SyncSteptapClient

    eot = AutoTokenizer.from_pretrained(str(long_vllm.model_dir)).convert_tokens_to_ids("<|endoftext|>")
    base = f"{long_proxy.url}/s/special-tokens-responses"
    items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                    "content": [{"type": "input_text", "text": TASK}]}]
    model = long_vllm.served_model
    reply = http_json(f"{base}/v1/responses", {"model": model, "input": items, "tools": RESPONSES_TOOLS,
                                                "max_output_tokens": 16})
    items += [i for i in reply["output"] if i["type"] == "message"]
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again."}]})
    http_json(f"{base}/v1/responses", {"model": model, "input": items, "tools": RESPONSES_TOOLS,
                                        "max_output_tokens": 4})
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    first, second = client.get_session("auto:special-tokens-responses").steps
    assert eot in first.response_token_ids[1:-1]  # sampled mid-reply, not as its end
    assert second.prefix == "extends"
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.response_token_ids)] == \
        first.prompt_token_ids + first.response_token_ids
