"""A model call's whole (not streamed) reply to the agent: captured into steps (the typed view of vLLM's
bytes where it can, ``replies.py``; else the dict path of ``capture.py``), stripped of what the agent did not
ask for or translated by the call's protocol, recorded, then sent; and vLLM's error answer, passed on (the
agent's mistake, recorded) or raised as the backend's failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from steptap.middleware.exceptions import BackendError, BackendMalformed, BackendUnavailable
from steptap.middleware.proxy import capture, replies
from steptap.middleware.proxy.capture import CHAT, Asked
from steptap.middleware.records import json_encoder

if TYPE_CHECKING:
    from steptap.middleware.backend.boundary import BackendReply
    from steptap.middleware.proxy.prompts import Echo
    from steptap.middleware.proxy.protocols import Protocol
    from steptap.middleware.proxy.recorder import CallRecorder

_decode = msgspec.json.decode
_encode = json_encoder.encode


class PlainReply:
    """The agent's whole reply to one call: ``relay`` vLLM's, ``reply`` a reply built here (a TITO turn's),
    ``upstream_error`` an error status."""

    def __init__(self, recorder: CallRecorder, proto: Protocol | None, asked: Asked, base: str,
                 take_echo: Callable[[bytes], Echo | None]) -> None:
        self.recorder = recorder
        self.proto = proto  # the protocol's translator, or None: vLLM's reply, stripped
        self.endpoint = recorder.endpoint
        self.asked = asked
        self.strip = not (asked.token_ids and asked.logprobs)
        self.base = base  # the replica as configured (never http://localhost)
        self.take_echo = take_echo  # vLLM's echo of a chat prompt's ids taken out (prompts.session_echo)

    async def relay(self, got: BackendReply) -> web.Response:
        data = got.body
        echo = self.take_echo(data) if self.endpoint == CHAT else None
        if self.proto is None:  # typed, stripped in vLLM's bytes; else the dict path
            sent = await self._typed(got, data, echo)
            if sent is not None:
                return sent
        try:
            reply = _decode(data if echo is None else echo[0])
            if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
                raise ValueError("no choices")
        except (msgspec.DecodeError, ValueError):
            raise BackendMalformed(f"backend {self.base} sent a malformed reply (not an OpenAI "
                                   "completion)") from None
        if echo is not None:
            reply["prompt_token_ids"] = echo[2]
        return await self.reply(reply, got.status, data)

    async def _typed(self, got: BackendReply, data: bytes, echo: Echo | None) -> web.Response | None:
        """The reply through a typed view of vLLM's bytes, or None when its shape asks for the dict path."""
        recorder = self.recorder
        view: replies.ReplyView | replies.CompletionView | None
        if self.endpoint == CHAT:
            view = replies.reply_view(data if echo is None else echo[0])
            steps = None if view is None else replies.steps_from_view(
                view, None if echo is None else echo[2], latency_s=recorder.latency(), **recorder.common)
        else:
            view = replies.completion_view(data)
            known = replies.known_prompt(recorder.common["request"])  # the ids vLLM echoes: not decoded
            steps = None if view is None else replies.steps_from_completion(
                view, known, latency_s=recorder.latency(), **recorder.common)
        if view is None or steps is None:
            return None
        body = replies.strip_reply_bytes(data, view, self.asked) if self.strip else data
        if body is None:
            return None
        stop = view.choices[0].stop_reason if view.choices else None
        await recorder.record(steps, stop)  # durable before the reply leaves
        return web.Response(body=body, status=got.status, content_type="application/json")

    async def reply(self, reply: dict[str, Any], status: int, data: bytes | None) -> web.Response:
        """``reply`` (decoded; ``data``: vLLM's bytes of it, if any) captured, recorded and sent."""
        steps = self.recorder.steps(reply)
        if self.proto is not None:
            data = self.proto.reply(reply)
        elif self.strip or data is None:
            capture.strip_reply(reply, self.asked, self.endpoint)
            data = _encode(reply)
        await self.recorder.record(steps, capture.stop_reason(reply))  # durable before the reply leaves
        return web.Response(body=data, status=status, content_type="application/json")

    async def upstream_error(self, status: int, data: bytes) -> web.Response:
        """vLLM's error answer: a 4xx passed on (the agent's mistake, recorded so the session says why);
        a 5xx raised as the backend's failure (a 503 recorded first)."""
        recorder = self.recorder
        if status < 500:  # the agent's mistake, in vLLM's own OpenAI error body: pass it on unchanged
            endpoint = self.proto.endpoint if self.proto is not None else self.endpoint
            recorder.services.metrics.refused_calls.labels(endpoint).inc()
            message = _message(data, 500)
            # recorded, so the session says why (a prompt over the context, a template that refused it); an
            # auto session the backend never accepted a call for stays unopened (refused calls fill no session
            # table)
            if not recorder.session.pending:
                await recorder.record([recorder.failed(
                    f"backend {self.base} refused the call ({status}): {message}", "backend_refused")])
            if self.proto is not None:
                data = self.proto.upstream_error(status, data)
            return web.Response(body=data, status=status, content_type="application/json")
        text = f"backend {self.base} answered {status}: {_message(data, 200)}"
        if status == 503:
            await recorder.record([recorder.failed(text, "backend_error")])
            raise BackendUnavailable(text)
        raise BackendError(text)


def _message(data: bytes, most: int) -> str:
    """The message of an OpenAI error body, else its first ``most`` bytes."""
    try:
        return str(_decode(data)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return data[:most].decode("utf-8", "replace")
