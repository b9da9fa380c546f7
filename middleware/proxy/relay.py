"""The model-call handlers. One call reads top to bottom in ``model_call``:
identify -> gate -> forward -> capture -> record once -> reply.

The agent's body is decoded once (it is recorded as the step's ``request`` anyway) and re-encoded with only our
keys changed, never through a Struct (unknown fields would be lost). The upstream reply is parsed once;
``capture`` builds the steps from it and strips what the agent did not ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from steptap.middleware.config import CONFIG_KEY, ProxyConfig
from steptap.middleware.errors import ApiError, error_body, status_of
from steptap.middleware.exceptions import (
    RecordTooLarge,
    BackendCut,
    BackendError,
    BackendMalformed,
    BackendTimeout,
    BackendUnavailable,
    BackendUnreachable,
    DomainError,
    SwapCut,
)
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.proxy import capture, replies, tito
from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked
from steptap.middleware.proxy.validate import check_model_call
from steptap.middleware.backend.client import timed_out
from steptap.middleware.backend.pool import POOL_KEY, Replica
from steptap.middleware.proxy import messages as messages_api
from steptap.middleware.proxy.protocols import (
    PROTOCOL_ENDPOINTS,
    Messages,
    Protocol,
    anthropic_errors,
    open_protocol,
)
from steptap.middleware.records import Step
from steptap.middleware.sessions.identity import identify
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.sessions.manager import LiveSession, SessionManager
from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.spans import Spans
from steptap.middleware.weights.swapper import CUT_MESSAGE, CUT_WRITE_S

logger = logging.getLogger("steptap.relay")

_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await model_call(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await model_call(request, COMPLETIONS)


async def responses(request: web.Request) -> web.StreamResponse:
    return await model_call(request, "responses")


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API: every error leaves in Anthropic's shape (its SDK parses no other)."""
    return await anthropic_errors(request, model_call(request, "messages"))


async def model_call(request: web.Request, endpoint: str) -> web.StreamResponse:
    app = request.app
    started_at, t0 = time.time(), time.perf_counter()
    cfg, manager = app[CONFIG_KEY], app[SESSIONS_KEY]
    manager.log.ensure_writable()  # 503 while the log cannot write: a call it cannot record is not made
    if (request.content_length or 0) > cfg.body_limit:
        raise _too_large(cfg)  # declared: refused before a byte is read
    with manager.holdings.body_memory(request.content_length) as held:  # 429 past max_body_memory
        raw = await read_body(request)  # 413 past max_request_bytes
        held.read(raw)  # 413 past max_json_nodes, before anything is decoded
        return await _model_call(request, endpoint, raw, started_at, t0)


async def _model_call(
    request: web.Request, endpoint: str, raw: bytes, started_at: float, t0: float
) -> web.StreamResponse:
    app = request.app
    cfg, manager, pool = app[CONFIG_KEY], app[SESSIONS_KEY], app[POOL_KEY]
    body = _json_object(raw)
    ident = identify(request)  # a malformed session id is a 400
    upstream_endpoint = CHAT if endpoint in PROTOCOL_ENDPOINTS else endpoint
    try:
        # Another protocol rides on chat completions: translated (and checked in its own format) before the rest.
        proto = open_protocol(endpoint, body, app) if endpoint in PROTOCOL_ENDPOINTS else None
        view = check_model_call(proto.chat if proto is not None else body, upstream_endpoint == CHAT, cfg.max_n)
    except ApiError as exc:  # a refused body: the session it names records why (a failed step)
        await _record_refused(request, ident, endpoint, body, exc.message, started_at, t0)
        raise
    stream = bool(view.stream)
    with manager.admitted(request.remote):  # a 429 beyond max_concurrent_calls or max_calls_per_peer
        served = await pool.route(view.model)  # before resolving: a refused call opens no session
        session = await manager.resolve(ident)  # identify
        if proto is not None:
            proto.prepare(None if session.trajectory.anonymous else session.id)
            for field in proto.dropped:
                app[METRICS_KEY].dropped_fields.labels(endpoint, field).inc()
        try:
            async with manager.call(session, steps=view.n or 1, size=len(raw)), \
                    app[SWAPPER_KEY].gate() as ticket:  # gate
                served = ticket.served_model or served  # LoRA mode: the current adapter serves every call
                # The session's replica, or the least loaded; an anonymous call (one step) holds no sticky entry
                # (it would only push named sessions out of the pool's bounded map).
                replica = pool.acquire(pool.pick(_sticky_id(session)))
                if proto is not None:
                    await proto.adapt(replica.client, served)
                out, asked = patch_request(proto.chat if proto is not None else body, upstream_endpoint, served, cfg)
                call = _Call(request, upstream_endpoint, manager, session, replica, asked, t0, common=dict(
                    request=body,
                    sampling=capture.sampling_of(out, bool(cfg.force_sampling), cfg.sampling_defaults),
                    model=view.model or served,
                    served_model=served,
                    backend=replica.name,
                    started_at=started_at,
                    policy_version=ticket.version,
                ))
                call.proto = proto
                call.spans = ticket.spans
                call.tito = bool(cfg.tito or session.tito) and upstream_endpoint == CHAT
                call.chat = out
                try:
                    return await call.run(_upstream_body(raw, body, out) if proto is None else _encode(out), stream)
                finally:
                    pool.release(call.replica)
        finally:
            metrics = app[METRICS_KEY]
            metrics.child(metrics.call_latency, endpoint, "true" if stream else "false").observe(
                time.perf_counter() - t0
            )


async def _record_refused(request: web.Request, ident: Any, endpoint: str, body: dict[str, Any], message: str,
                          started_at: float, t0: float) -> None:
    """A call refused before it left, in a session it names (not an anonymous one): recorded as a failed step
    with the error, so the session view says why the agent got nothing. Best effort: the refusal still leaves
    as it would (a session that cannot be reached or is full keeps nothing)."""
    request.app[METRICS_KEY].refused_calls.labels(endpoint).inc()
    if ident.source == "anonymous":
        return
    manager = request.app[SESSIONS_KEY]
    try:
        session = await manager.resolve(ident)
    except DomainError:
        return
    if session.pending:  # an auto session is opened by an accepted call only: a refused first call opens nothing
        if session.inflight == 0:
            manager.pending.pop(session.id, None)
        return
    model = body.get("model")
    step = capture.failed_step(endpoint, message, "invalid_request", request=body,
                               model=model if isinstance(model, str) else "", started_at=started_at,
                               latency_s=time.perf_counter() - t0)
    try:
        await manager.record(session, [step])
    except DomainError:
        pass


async def read_body(request: web.Request) -> bytes:
    """The request body, bounded by ``body_limit`` (``client_max_size``): a larger one is a 413."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(request.app[CONFIG_KEY]) from None


def _too_large(cfg: ProxyConfig) -> RecordTooLarge:
    return RecordTooLarge(f"request body exceeds the limit of {cfg.body_limit} bytes (max_request_bytes="
                          f"{cfg.max_request_bytes}, max_record_bytes={cfg.max_record_bytes})")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return body


def patch_request(
    body: dict[str, Any], endpoint: str, served: str, cfg: ProxyConfig
) -> tuple[dict[str, Any], Asked]:
    """The body sent upstream: the agent's, with token ids and logprobs turned on and the served model name."""
    out = dict(body)  # shallow: only top-level keys change
    if body.get("model") is not None and body.get("model") != served:
        out["model"] = served
    if endpoint == CHAT:
        asked = Asked(token_ids=bool(body.get("return_token_ids")), logprobs=bool(body.get("logprobs")))
        if not asked.logprobs:
            out["logprobs"] = True
    else:
        asked = Asked(token_ids=bool(body.get("return_token_ids")), logprobs=body.get("logprobs") is not None)
        if not asked.logprobs:
            out["logprobs"] = 0  # the sampled token's logprob only
    if not asked.token_ids:
        out["return_token_ids"] = True
    for name, value in cfg.force_sampling.items():
        out[name] = int(value) if name == "top_k" else value
    return out, asked


def _sticky_id(session: LiveSession) -> str | None:
    return None if session.trajectory.anonymous else session.id


def _upstream_body(raw: bytes, body: dict[str, Any], out: dict[str, Any]) -> bytes:
    """The bytes sent upstream: when the proxy only added keys the agent did not send (token ids, logprobs), the
    agent's own bytes with those keys appended (no re-encode of a long history); else ``out`` encoded."""
    if any(out[k] is not v for k, v in body.items()):
        return _encode(out)  # a value changed (the model name, forced sampling, logprobs turned on)
    if len(out) == len(body):
        return raw  # the agent asked for token ids and logprobs itself: forwarded as it came
    end = raw.rstrip()
    if not body or not end.endswith(b"}"):
        return _encode(out)
    added = b",".join(_encode(k) + b":" + _encode(out[k]) for k in out if k not in body)
    return b"".join((end[:-1], b",", added, b"}"))


# Backend failures after the call left: the call becomes a failed step (an unreachable backend got nothing).
_RECORDED = (BackendTimeout, BackendError, BackendUnavailable, BackendCut, BackendMalformed)


class _AgentGone(Exception):
    """The agent closed its connection while we streamed to it."""


class _AgentStalled(_AgentGone):
    """The agent took no byte of its stream for ``stream_write_timeout_s``: its call slot is given back."""


class _LineTooLong(Exception):
    pass


class _Call:
    """One model call on its way through: forward, relay, capture, record once."""

    def __init__(
        self,
        request: web.Request,
        endpoint: str,
        manager: SessionManager,
        session: LiveSession,
        replica: Replica,
        asked: Asked,
        t0: float,
        common: dict[str, Any],
    ) -> None:
        self.request = request
        self.endpoint = endpoint
        self.manager = manager
        self.session = session
        self.replica = replica
        self.upstream = replica.client
        self.asked = asked
        self.t0 = t0
        self.common = common
        self.strip = not (asked.token_ids and asked.logprobs)
        self.acc: capture.ChatStream | capture.CompletionStream | None = None  # a stream's chunks so far
        self.recorded = False  # a step (good or failed) of this call is in the trajectory
        self.proto: Protocol | None = None  # Responses / Messages riding on chat completions
        self.tito = False  # token-in-token-out mode for this session
        self.chat: dict[str, Any] = {}  # the chat body sent upstream
        self.write_timeout = request.app[CONFIG_KEY].stream_write_timeout_s
        self.spans: Spans | None = None  # where a weight swap switched this call's tokens to a newer version
        self.waiting = False  # the stream's pump waits on the backend: every token it sent so far is counted

    async def run(self, payload: bytes, stream: bool) -> web.StreamResponse:
        if self.tito:
            metrics = self.request.app[METRICS_KEY]
            turn = await tito.start_turn(self.session, self.chat, self.upstream, metrics, stream)
            if turn is not None:
                return await self._run_tito(*turn, stream)
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self._forward(payload)  # forward
            if resp.status >= 400:
                return await self._upstream_error(resp)
            if stream:
                return await self._relay_stream(resp, resp.status)
            return await self._relay_plain(resp)
        except BackendUnreachable:
            self._count("backend_unreachable")  # nothing reached the backend: no step
            raise
        except BackendTimeout as exc:
            if not self.recorded:
                await self.record([self.failed(exc.message, "backend_timeout")])
            raise
        except _RECORDED as exc:  # the one place a failed call is recorded before its error leaves
            if not self.recorded:
                await self.record([self.failed(exc.message, exc.code.removesuffix("_reply"))])
            raise
        except asyncio.CancelledError:
            # The agent hung up and the server cancelled this handler, or a weight swap cut a call that outlasted
            # its drain bound: keep what arrived as a failed step (in a new task: this one is being cancelled).
            # A swap's cut before the stream began ends as the protocol's error body instead.
            if not self.recorded and self.acc is None and self.request.app[SWAPPER_KEY].take_cut():
                await self.record([self.failed(CUT_MESSAGE, "swap_cut")])
                raise SwapCut(CUT_MESSAGE) from None
            if not self.recorded:
                partial = self.acc.reply() if self.acc is not None else None
                self.recorded = True
                if self.request.app[SWAPPER_KEY].was_cut(asyncio.current_task()):
                    why = ("cut by a weight swap: the call outlasted the swap's drain bound "
                           "(--swap-drain-timeout)", "swap_cut")
                else:
                    why = ("agent disconnected", "client_gone")
                self.manager.spawn(self._record_quietly(self.failed(*why, partial)))
            raise
        finally:
            if resp is not None:
                resp.release()

    async def _forward(self, payload: bytes) -> aiohttp.ClientResponse:
        """Send the call to the session's replica; one that cannot be reached got nothing, so it is taken out
        and the call (with its session) moves to another healthy replica, once."""
        try:
            return await self.upstream.post(self.endpoint, payload)
        except BackendUnreachable as exc:
            pool = self.request.app[POOL_KEY]
            pool.take_out(self.replica.name, exc.message, unreachable=True)
            try:
                other = pool.pick(_sticky_id(self.session), avoid=self.replica.name)
            except (BackendUnavailable, BackendUnreachable):
                raise exc from None
            pool.release(self.replica)
            self.replica, self.upstream = pool.acquire(other), other.client
            self.common["backend"] = other.name
            return await self.upstream.post(self.endpoint, payload)

    # --- token-in-token-out --------------------------------------------------------------------------------

    async def _run_tito(self, turn: tito.Turn, generate: dict[str, Any], stream: bool) -> web.StreamResponse:
        base = self.upstream.name  # the replica as configured (never http://localhost)
        turn.spans = self.spans
        try:
            if stream:
                return await self._relay_stream(turn.chunks(generate), 200)
            reply = await turn.reply(generate)
        except tito.TitoError as exc:
            err = tito.backend_error(base, exc)
            if not self.recorded:
                await self.record([self.failed(err.message, "backend_error")])
            raise err from None
        except (BackendUnreachable, BackendTimeout) as exc:  # the client names the replica
            if not self.recorded:
                await self.record([self.failed(f"token-in-token-out call failed: {exc.message}", "backend_error")])
            raise BackendError(exc.message) from None
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError, KeyError) as exc:
            if not self.recorded:
                await self.record([self.failed(f"token-in-token-out call failed: {exc!r}", "backend_error")])
            raise BackendError(f"backend {base} failed a token-in-token-out call: {exc!r}") from None
        except asyncio.CancelledError:  # the agent hung up: keep what arrived as a failed step, as run() does
            if not self.recorded and self.request.app[SWAPPER_KEY].take_cut():  # a swap's cut: an error body
                await self.record([self.failed(CUT_MESSAGE, "swap_cut")])
                raise SwapCut(CUT_MESSAGE) from None
            if not self.recorded:
                partial = self.acc.reply() if self.acc is not None else None
                self.recorded = True
                self.manager.spawn(self._record_quietly(self.failed("agent disconnected", "client_gone", partial)))
            raise
        return await self._reply_plain(reply, 200, None)

    # --- capture and record -------------------------------------------------------------------------------

    def failed(self, message: str, type_: str, partial: dict[str, Any] | None = None) -> Step:
        self._count(type_)
        return capture.failed_step(self.endpoint, message, type_, partial, latency_s=self._latency(), **self.common)

    def _count(self, type_: str) -> None:
        self.request.app[METRICS_KEY].upstream_errors.labels(type_).inc()

    def _latency(self) -> float:
        return time.perf_counter() - self.t0

    async def record(self, steps: list[Step]) -> None:
        """Append this call's steps to its session; durable when it returns (before the reply completes)."""
        self.recorded = True
        self.request.app[SWAPPER_KEY].label(steps, self.spans)
        if self.proto is not None:
            for step in steps:
                step.endpoint = self.proto.endpoint
                step.notes = list(self.proto.notes)
                self.proto.annotate(step)
        await self.manager.record(self.session, steps)
        if self.tito:  # what the next turn extends (a failed or multi-choice call extends nothing)
            self.session.tito_state = tito.next_state(self.chat, steps[0]) if len(steps) == 1 else None

    async def _record_quietly(self, step: Step) -> None:
        try:
            await self.manager.record(self.session, [step])
        except Exception:  # a background task: log it, there is no agent left to tell
            logger.exception("could not record the failed step of session %s", self.session.id)

    # --- replies ------------------------------------------------------------------------------------------

    async def _upstream_error(self, resp: aiohttp.ClientResponse) -> web.Response:
        base = self.upstream.name  # the replica as configured (never http://localhost)
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            data = b""
        if resp.status < 500:  # the agent's mistake, in vLLM's own OpenAI error body: pass it on unchanged
            endpoint = self.proto.endpoint if self.proto is not None else self.endpoint
            self.request.app[METRICS_KEY].refused_calls.labels(endpoint).inc()
            try:
                message = _decode(data)["error"]["message"]
            except (msgspec.DecodeError, KeyError, TypeError):
                message = data[:500].decode("utf-8", "replace")
            # recorded, so the session says why (a prompt over the context, a template that refused it); an auto
            # session the backend never accepted a call for stays unopened (refused calls fill no session table)
            if not self.session.pending:
                await self.record([self.failed(f"backend {base} refused the call ({resp.status}): {message}",
                                               "backend_refused")])
            if self.proto is not None:
                data = self.proto.upstream_error(resp.status, data)
            return web.Response(body=data, status=resp.status, content_type="application/json")
        try:
            message = _decode(data)["error"]["message"]
        except (msgspec.DecodeError, KeyError, TypeError):
            message = data[:200].decode("utf-8", "replace")
        text = f"backend {base} answered {resp.status}: {message}"
        if resp.status == 503:
            await self.record([self.failed(text, "backend_error")])
            raise BackendUnavailable(text)
        raise BackendError(text)

    async def _relay_plain(self, resp: aiohttp.ClientResponse) -> web.Response:
        base = self.upstream.name  # the replica as configured (never http://localhost)
        try:
            data = await resp.read()
        except TimeoutError:
            raise timed_out(base, self.upstream.config.upstream_timeout_s) from None
        except aiohttp.ClientError as exc:
            raise BackendCut(f"backend {base} cut the reply: {exc}") from None
        if self.proto is None and self.endpoint == CHAT:  # typed, stripped in vLLM's bytes; else the dict path
            view = replies.reply_view(data)
            steps = None if view is None else replies.steps_from_view(view, latency_s=self._latency(), **self.common)
            if view is not None and steps is not None:
                body = replies.strip_reply_bytes(data, view, self.asked) if self.strip else data
                if body is not None:
                    await self.record(steps)  # durable before the reply leaves
                    return web.Response(body=body, status=resp.status, content_type="application/json")
        try:
            reply = _decode(data)
            if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
                raise ValueError("no choices")
        except (msgspec.DecodeError, ValueError):
            raise BackendMalformed(f"backend {base} sent a malformed reply (not an OpenAI completion)") from None
        return await self._reply_plain(reply, resp.status, data)

    async def _reply_plain(self, reply: dict[str, Any], status: int, data: bytes | None) -> web.Response:
        steps = capture.steps_from_reply(reply, self.endpoint, latency_s=self._latency(), **self.common)
        if self.proto is not None:
            data = self.proto.reply(reply)
        elif self.strip or data is None:
            capture.strip_reply(reply, self.asked, self.endpoint)
            data = _encode(reply)
        await self.record(steps)  # durable before the reply leaves
        return web.Response(body=data, status=status, content_type="application/json")

    async def _relay_stream(self, source: Any, status: int) -> web.StreamResponse:
        """Relay SSE events as they come (``source``: the backend's lines, a batch per read); the steps are
        recorded before ``[DONE]``. Once the headers are out a failure can no longer be an HTTP error: it is
        recorded as a failed step and sent as an error event."""
        out = web.StreamResponse(status=status, headers=_SSE_HEADERS)
        acc = self.acc = capture.new_stream(self.endpoint)  # set first: from here a cut is not an error body
        # The split is known only while the pump is caught up with vLLM (TITO: from vLLM's weight_versions;
        # its pump also waits on derender, with tokens in hand).
        if self.spans is not None and isinstance(source, aiohttp.ClientResponse):
            self.spans.counter = lambda: acc.token_counts() if self.waiting else None
        await out.prepare(self.request)
        proto = self.proto
        try:
            if proto is not None:
                await _send(out, proto.start(), self.write_timeout)
            failure, upstream_error, done = await self._pump(source, out, acc)
        except _AgentStalled:  # it stopped reading: keep what arrived, then cut (a close would wait on it)
            seconds = self.write_timeout
            try:
                await self.record([self.failed(f"agent took no byte of its stream for {seconds:g}s "
                                               "(stream_write_timeout_s)", "client_stalled", acc.reply())])
            finally:  # after the record: the abort cancels this handler
                if self.request.transport is not None:
                    self.request.transport.abort()
            return out
        except _AgentGone:  # nothing reached the agent in full; keep what arrived as a failed step
            await self.record([self.failed("agent disconnected", "client_gone", acc.reply())])
            return out
        except asyncio.CancelledError:
            if not self.request.app[SWAPPER_KEY].take_cut():
                raise
            await self.record([self.failed(CUT_MESSAGE, "swap_cut", acc.reply())])
            err = {"error": {"message": CUT_MESSAGE, "type": "swap_cut", "code": "swap_cut"}}
            tail = proto.stream_error(503, CUT_MESSAGE, "swap_cut") if proto is not None else (
                b"data: " + _encode(err) + b"\n\n")
            await self._end_cut(out, tail)
            return out
        try:
            if failure is None:
                await self.record(capture.steps_from_reply(acc.reply(), self.endpoint, latency_s=self._latency(),
                                                           **self.common))  # durable before [DONE]
                tail = _DONE if proto is None else proto.finish(acc.reply())
            else:
                await self.record([self.failed(failure[0], failure[1], acc.reply())])
                if proto is not None:
                    tail = proto.stream_error(502, failure[0], failure[1])
                elif upstream_error is not None:  # vLLM's own error event, then [DONE], as vLLM sends it
                    tail = upstream_error + _DONE
                else:  # a cut stream ends with an error event (the SDKs raise on it), never a clean [DONE]
                    tail = self._error_event(502, failure[0], failure[1], failure[1])
        except DomainError as exc:
            # The headers are out and the step could not be kept (session full, log full, record too large): the
            # agent learns it from an error event and the stream ends; it never waits for a [DONE].
            status = status_of(exc)
            tail = (proto.stream_error(status, exc.message, exc.code) if proto is not None
                    else self._error_event(status, exc.message, exc.code))
        try:
            await _send(out, tail, self.write_timeout)
            async with asyncio.timeout(self.write_timeout):
                await out.write_eof()
        except (_AgentGone, TimeoutError, ConnectionResetError, aiohttp.ClientConnectionResetError):
            if self.request.transport is not None:  # the step is recorded; a reader that stopped is cut
                self.request.transport.abort()
            return out
        if done and isinstance(source, aiohttp.ClientResponse) and not source.content.is_eof():
            # Read the body's end (the blank line and chunked terminator after [DONE]): a response released
            # unread closes its connection instead of returning it to the pool (a TCP connect per call). Usually
            # it came with [DONE] (no wait, and no task for wait_for).
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.wait_for(source.content.read(), 1.0)
        return out

    @staticmethod
    def _error_event(status: int, message: str, code: str, type_: str | None = None) -> bytes:
        return b"data: " + error_body(message, status, code, type_) + b"\n\n"

    async def _end_cut(self, out: web.StreamResponse, tail: bytes) -> None:
        """A cut stream's error event and end, put on the wire together; its reader may be the slow one that
        outlasted the drain, so waiting for it is bounded and the connection then closes behind what is
        buffered (the transport still flushes it)."""
        try:
            await asyncio.wait_for(out.write_eof(tail), CUT_WRITE_S)
        except (TimeoutError, ConnectionResetError, aiohttp.ClientConnectionResetError):
            if self.request.transport is not None:
                self.request.transport.close()

    async def _pump(
        self, source: Any, out: web.StreamResponse, acc: Any
    ) -> tuple[tuple[str, str] | None, bytes | None, bool]:
        """Feed the stream's events to the accumulator and the agent; returns (failure, vLLM's error event,
        whether ``[DONE]`` came)."""
        base = self.upstream.name  # the replica as configured (never http://localhost)
        failure: tuple[str, str] | None = None  # (message, type)
        upstream_error: bytes | None = None
        done = False
        if isinstance(source, aiohttp.ClientResponse):
            batches = _line_batches(source.content, self.upstream.config.read_bufsize * 2)
        else:
            batches = source  # already line batches (token-in-token-out)
        proto = self.proto
        try:
            # One await per network read, not per line, and what one read brought goes out in one write (the
            # events stay exactly as vLLM framed them).
            while True:
                # Waiting here (not on a slow agent's write) the pump has counted every token vLLM sent before
                # (weights/spans.py): where a keep swap splits this call.
                self.waiting = True
                try:
                    lines = await anext(batches)
                except StopAsyncIteration:
                    break
                finally:
                    self.waiting = False
                parts: list[bytes] = []
                for line in lines:
                    if not line.startswith(b"data:"):
                        if line.strip() and not line.startswith(b":"):  # blank separators, comments
                            failure = (f"backend {base} sent a malformed stream line", "backend_malformed")
                            break
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = _decode(payload)
                        if not isinstance(chunk, dict):
                            raise ValueError
                    except (msgspec.DecodeError, ValueError):
                        failure = (f"backend {base} sent a malformed stream chunk", "backend_malformed")
                        break
                    if "error" in chunk and not chunk.get("choices"):
                        upstream_error = b"data: " + payload + b"\n\n"
                        err = chunk["error"]
                        message = err.get("message") if isinstance(err, dict) else err
                        failure = (f"backend {base} error mid-stream: {message}", "backend_error")
                        continue  # vLLM follows its error event with [DONE]
                    acc.feed(chunk)
                    if proto is not None:
                        parts.append(proto.feed(chunk))
                    elif not self.strip:
                        parts.append(b"data: " + payload + b"\n\n")
                    elif capture.strip_chunk(chunk, self.asked, self.endpoint):
                        parts.append(b"data: " + _encode(chunk) + b"\n\n")
                if parts:
                    await _send(out, b"".join(parts), self.write_timeout)
                if done or (failure is not None and upstream_error is None):
                    break
        except TimeoutError:
            seconds = self.upstream.config.upstream_timeout_s
            failure = (f"backend {base} sent nothing for {seconds:g}s mid-stream", "backend_timeout")
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            failure = (f"backend {base} cut the stream: {exc or type(exc).__name__}", "backend_cut")
        except _LineTooLong:
            failure = (f"backend {base} sent an over-long stream line", "backend_malformed")
        except tito.TitoError as exc:
            failure = (tito.backend_error(base, exc).message, "backend_error")
        except BackendTimeout as exc:  # a token-in-token-out call the client could not make
            failure = (exc.message, "backend_timeout")
        except BackendUnreachable as exc:
            failure = (exc.message, "backend_cut")
        finally:
            await batches.aclose()
        if failure is None and not done:
            failure = (f"backend {base} ended the stream without [DONE]", "backend_cut")
        return failure, upstream_error, done


async def _line_batches(content: aiohttp.StreamReader, limit: int) -> AsyncIterator[list[bytes]]:
    """The lines of a byte stream, as a list per network read (a line cut between reads waits for its end)."""
    pending = b""
    async for data in content.iter_any():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        if len(pending) > limit:
            raise _LineTooLong
        yield lines
    if pending:
        yield [pending]


async def _send(out: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """One write to the agent; a reader that takes nothing for ``timeout_s`` is ``_AgentStalled`` (never a
    ``TimeoutError``: that one means the backend's silence in ``_pump``)."""
    try:
        async with asyncio.timeout(timeout_s):
            await out.write(data)
    except TimeoutError:
        raise _AgentStalled() from None
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        raise _AgentGone() from exc


# --- the other agent-facing routes -------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    """The served models; in Anthropic's shape for an Anthropic client (its SDK parses no other)."""
    status, data = await request.app[POOL_KEY].models()
    if status == 200 and messages_api.is_anthropic_client(request.headers):
        try:
            data = _encode(messages_api.models_body(_decode(data)))
        except (msgspec.DecodeError, AttributeError, TypeError):
            pass  # not vLLM's list: passed on as it came
    return web.Response(body=data, status=status, content_type="application/json")


async def base_probe(request: web.Request) -> web.Response:
    """``HEAD`` on an agent's base URL (Claude Code checks it is reachable before its first call)."""
    return web.Response(status=200)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """Anthropic's ``POST /v1/messages/count_tokens``: the prompt a Messages call with this body would send,
    rendered by the session's replica (the same translation and template): its length is what the step's
    ``prompt_token_ids`` will hold."""
    return await anthropic_errors(request, _count_tokens(request))


async def _count_tokens(request: web.Request) -> web.Response:
    app = request.app
    body = _json_object(await read_body(request))
    proto = Messages(body, "", count_only=True)
    ident = identify(request)
    pool = app[POOL_KEY]
    served = await pool.route(proto.chat.get("model"))
    session = await app[SESSIONS_KEY].resolve(ident)
    upstream = pool.pick(_sticky_id(session)).client
    await proto.adapt(upstream, served)
    out, _ = patch_request(proto.chat, CHAT, served, app[CONFIG_KEY])
    try:  # the client raises BackendUnreachable / BackendTimeout naming the replica
        rendered = await tito.render(upstream, out)
    except tito.TitoError as exc:
        if exc.status in (404, 405):
            raise ApiError(501, "count_tokens renders through the backend's render route: start vLLM with "
                                "--enable-scale-out", "not_supported") from None
        raise ApiError(exc.status if exc.status < 500 else 502, tito.backend_error(upstream.name, exc).message,
                       "backend_error") from None
    return web.json_response({"input_tokens": len(rendered["token_ids"])})


async def health(request: web.Request) -> web.Response:
    """Liveness, the log's state, and the replicas' state and load (never a secret): 200 when the log can write
    and one replica takes calls, else 503."""
    state = await request.app[POOL_KEY].health()
    swapper = request.app[SWAPPER_KEY]
    log: Any = request.app[SESSIONS_KEY].log
    log_state = {"degraded": log.degraded, "error": log.degraded_reason}
    healthy = state["healthy"] and not log.degraded
    body = {
        "status": "ok" if healthy else "degraded",
        "log": log_state,
        "backends": state["replicas"],
        "sessions_moved": state["sessions_moved"],
        "sessions_open": len(request.app[SESSIONS_KEY].sessions),
        "policy_version": int(swapper.version),
        "weights": swapper.state(),  # swap state (weights/swapper.py)
    }
    return web.Response(body=_encode(body), status=200 if healthy else 503, content_type="application/json")
