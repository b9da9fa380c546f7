"""The agent-facing protocols that ride on chat completions (Responses, Messages, Gemini): what the relay asks
of each.

A ``Protocol`` holds one call's translation: the chat body sent upstream, the agent's reply built from the
chat reply (plain, or SSE events from chat chunks), and errors in the protocol's own shape. The relay does the
rest exactly as for chat (capture, record once, durability before the reply completes); the step's
``endpoint`` is the protocol's name and its ``request`` the agent's body as sent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from steptap.middleware.backend.boundary import Backend
from steptap.middleware.errors import ApiError, status_of
from steptap.middleware.exceptions import BackendStatus, DomainError
from steptap.middleware.metrics import METRICS_KEY, Metrics
from steptap.middleware.proxy import (
    gemini,
    gemini_contents,
    gemini_request,
    messages,
    messages_request,
    responses,
    responses_request,
    tito,
)
from steptap.middleware.proxy.translation import take_handles

logger = logging.getLogger("steptap.relay")

STORE_KEY = web.AppKey("steptap_response_store", responses.ResponseStore)
PROTOCOL_ENDPOINTS = (responses.ENDPOINT, messages.ENDPOINT, gemini.ENDPOINT)


# An SSE comment: a line starting with ':' is no event (the SSE spec); the OpenAI and Anthropic SDKs, Codex
# and Node's eventsource parsers skip it
HEARTBEAT = b": waiting for the model\n\n"


class Protocol:
    endpoint: str
    chat: dict[str, Any]
    # What was accepted but not honoured, by label (counted in steptap_dropped_fields)
    dropped: list[str] = []
    # what the proxy did that the request does not show (Step.notes): each drop, a translation choice
    notes: list[str] = []  # recorded on the call's steps
    handles: dict[int, str] = {}  # assistant message -> the reasoning handle it was replayed with (tito.py)
    # sent while a stream waits on the backend (sse.py): an SSE comment, which this protocol's clients skip
    heartbeat: bytes = HEARTBEAT

    async def adapt(self, upstream: Backend, served: str) -> None:
        """Translation choices that depend on the backend's template (asked once per replica and model)."""

    def prepare(self, session_id: str | None) -> None:
        """Session-dependent parts of the translation (a stored conversation)."""

    def annotate(self, step: Any) -> None:
        """Protocol facts the step keeps beside the assistant message."""

    def reply(self, chat_reply: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def finish(self, chat_reply: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        raise NotImplementedError

    def upstream_error(self, status: int, data: bytes) -> bytes:
        """vLLM's OpenAI error body (the agent's mistake) in this protocol's shape."""
        return data


class Responses(Protocol):
    endpoint = responses.ENDPOINT

    def __init__(self, body: dict[str, Any], model: str, store: responses.ResponseStore,
                 metrics: Metrics | None = None) -> None:
        self.body = body
        self.store = store
        self.metrics = metrics
        self.tr = responses_request.translate(body, [])  # validates before any session is touched
        self._notes()
        self.shape = responses.Shape(body, body.get("model") or model, self.tr, store.new_id())
        self.handles = self.tr.handles
        self.session_id: str | None = None
        self.events = responses.EventStream(self.shape)

    def _notes(self) -> None:
        """The translation's drops as every protocol states them: notes on the step, labels counted."""
        self.chat = self.tr.chat
        self.notes = [f"{n['field']}: {n['reason']}" for n in self.tr.notes]
        self.dropped = [n["label"] for n in self.tr.notes]

    def prepare(self, session_id: str | None) -> None:
        self.session_id = self.shape.session_id = session_id
        prev = self.body.get("previous_response_id")
        if prev is not None:
            self.tr = responses_request.translate(self.body, self.store.history(session_id, prev))
            self._notes()
            self.shape.tr = self.tr
            self.handles = self.tr.handles

    def annotate(self, step: Any) -> None:
        # which response this is: a later previous_response_id that names it continues this conversation
        step.response["response_id"] = self.shape.id

    def _keep(self, assistant: dict[str, Any]) -> None:
        if self.body.get("store", True) is False:
            return
        conversation = list(self.chat["messages"])
        if self.body.get("instructions") is not None:
            conversation = conversation[1:]  # instructions are not carried over by previous_response_id
        self.store.put(self.session_id, self.shape.id, conversation + [assistant])

    def reply(self, chat_reply: dict[str, Any]) -> bytes:
        response, assistant = self.shape.from_chat(chat_reply)
        self._keep(assistant)
        return json.dumps(response).encode()

    def start(self) -> bytes:
        return self.events.start()

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return self.events.feed(chunk)

    def finish(self, chat_reply: dict[str, Any]) -> bytes:
        out, _, assistant = self.events.finish(chat_reply)
        self._keep(assistant)
        return out

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        return self.events.error(message, code)


class Messages(Protocol):
    endpoint = messages.ENDPOINT

    def __init__(self, body: dict[str, Any], model: str, count_only: bool = False) -> None:
        self.chat = messages_request.to_chat(body, count_only)
        self.handles = take_handles(self.chat["messages"])
        self.shape = messages.Shape(body, body.get("model") or model)
        self.events = messages.EventStream(self.shape)
        drops = messages_request.dropped(body)
        self.dropped = [label for _, label in drops]
        self.notes = [f"dropped {field}: not honoured by this proxy" for field, _ in drops]

    def prepare(self, session_id: str | None) -> None:
        self.shape.session_id = session_id

    def annotate(self, step: Any) -> None:
        step.response["response_id"] = self.shape.id  # what a thinking block's signature names

    async def adapt(self, upstream: Backend, served: str) -> None:
        if messages_request.has_mid_system(self.chat) and not await keeps_mid_system(upstream, served):
            self.chat = {**self.chat, "messages": messages_request.fold_system(self.chat["messages"])}
            self.notes = [*self.notes, "system messages after the first folded into the next user turn "
                                       "(the chat template refuses or drops them)"]

    def reply(self, chat_reply: dict[str, Any]) -> bytes:
        return json.dumps(self.shape.from_chat(chat_reply)).encode()

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return self.events.feed(chunk)

    def finish(self, chat_reply: dict[str, Any]) -> bytes:
        return self.events.finish(chat_reply)

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        return self.events.error(status, message)

    def upstream_error(self, status: int, data: bytes) -> bytes:
        return messages.error_body(status, _upstream_message(data))


class Gemini(Protocol):
    endpoint = gemini.ENDPOINT
    # none: Google's SDK reads its buffer's `data:` events from the start, and a comment there stalls it
    heartbeat = b""

    def __init__(self, body: dict[str, Any], model: str, stream: bool = False,
                 count_only: bool = False) -> None:
        tr = gemini_request.translate(body, model, stream, count_only)  # validates before any session
        self.chat = tr.chat
        self.handles = take_handles(self.chat["messages"])
        self.dropped = [label for _, label, _ in tr.notes]
        self.notes = [f"{field}: {reason}" for field, _, reason in tr.notes]
        self.shape = gemini.Shape(body, model)
        self.events = gemini.EventStream(self.shape)

    def prepare(self, session_id: str | None) -> None:
        self.shape.session_id = session_id

    def annotate(self, step: Any) -> None:
        step.response["response_id"] = self.shape.id  # what a thoughtSignature names

    def reply(self, chat_reply: dict[str, Any]) -> bytes:
        return json.dumps(self.shape.from_chat(chat_reply), ensure_ascii=False).encode()

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return self.events.feed(chunk)

    def finish(self, chat_reply: dict[str, Any]) -> bytes:
        return self.events.finish(chat_reply)

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        return self.events.error(status, message)

    def upstream_error(self, status: int, data: bytes) -> bytes:
        return gemini.error_body(status, _upstream_message(data))


def _upstream_message(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return data[:500].decode("utf-8", "replace")


# (replica URL, served model) -> whether its template renders a system message after the first; bounded (a
# LoRA swap serves a new name per version)
_MID_SYSTEM: dict[tuple[str, str], bool] = {}
_MID_SYSTEM_MAX = 256
_PROBE = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
          {"role": "user", "content": "c"}]


async def keeps_mid_system(upstream: Backend, served: str) -> bool:
    """Whether the served template keeps a mid-conversation system message: rendered with it, and its ids
    differ from the same conversation without it. A backend without the render route (no
    ``--enable-scale-out``) cannot be asked: kept (a template that refuses it then answers the call with
    vLLM's 400)."""
    key = (upstream.name, served)
    if key not in _MID_SYSTEM:
        probe = {"model": served, "messages": _PROBE, "max_tokens": 1}
        try:  # the client raises BackendUnreachable / BackendTimeout naming the replica
            with_it = await tito.render(upstream, probe)
            without = await tito.render(upstream, probe, messages=[_PROBE[0], _PROBE[2]])
            keeps = with_it["token_ids"] != without["token_ids"]
        except BackendStatus as exc:
            if exc.status in (404, 405):
                return True  # not cached: the replica may be restarted with scale-out
            keeps = False  # the template raised on it
        if len(_MID_SYSTEM) >= _MID_SYSTEM_MAX:
            _MID_SYSTEM.clear()
        _MID_SYSTEM[key] = keeps
    return _MID_SYSTEM[key]


def open_protocol(endpoint: str, body: dict[str, Any], request: web.Request) -> Protocol:
    if endpoint == responses.ENDPOINT:
        return Responses(body, "", request.app[STORE_KEY], request.app[METRICS_KEY])
    if endpoint == gemini.ENDPOINT:  # the model and the method are the path's (gemini_routes.py)
        model, method = gemini_contents.split_call(request.match_info["call"])
        return Gemini(body, model, stream=method == gemini_contents.STREAM)
    return Messages(body, "")


async def shaped_errors(request: web.Request, call: Awaitable[web.StreamResponse],
                        body_of: Callable[[int, str], bytes]) -> web.StreamResponse:
    """Await a call; any error it ends in leaves as ``body_of(status, message)``: a protocol whose SDK parses
    only its own error shape (Anthropic's, Google's)."""
    try:
        return await call
    except ApiError as exc:
        return _error(body_of, exc.status, exc.message)
    except DomainError as exc:
        return _error(body_of, status_of(exc), exc.message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(body_of, exc.status, exc.reason or "error")
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error(body_of, 500, "internal proxy error")


def _error(body_of: Callable[[int, str], bytes], status: int, message: str) -> web.Response:
    return web.Response(body=body_of(status, message), status=status, content_type="application/json")


async def anthropic_errors(request: web.Request, call: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    """Await a Messages call; any error it ends in leaves in Anthropic's shape (its SDK parses no other)."""
    return await shaped_errors(request, call, messages.error_body)
