"""The model-call handlers (the other agent-facing routes are in routes.py). ``model_call``: identify ->
gate -> forward -> capture -> record once -> reply.

The call is a pipeline of owned parts: a source (the backend's reply or stream, or a token-in-token-out
turn's: the same ``BackendStream``), the protocol's translator (protocols.py), the capture accumulator
(accumulator.py), the writer to the agent (a whole reply: plain.py; a stream: sse.py) and one record at the
end (recorder.py). ``_Call`` picks the source and maps its failures; the parts take what they need.

The agent's body is decoded once (it is recorded as the step's ``request`` anyway) and re-encoded with only
our keys changed, never through a Struct (unknown fields would be lost); the upstream body in serving.py. The
upstream reply is parsed once; ``capture`` builds the steps from it and strips what the agent did not ask for.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
from aiohttp import web

from steptap.middleware.backend.boundary import Backend, BackendReply, BackendStream
from steptap.middleware.backend.client import Parts
from steptap.middleware.backend.pool import Replica
from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import (
    BackendCut,
    BackendError,
    BackendMalformed,
    BackendStatus,
    BackendTimeout,
    BackendUnavailable,
    BackendUnreachable,
    DomainError,
    SwapCut,
)
from steptap.middleware.proxy import capture, prompts, tito, vision
from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked
from steptap.middleware.proxy.plain import PlainReply
from steptap.middleware.proxy.prompts import Echo
from steptap.middleware.proxy.protocols import PROTOCOL_ENDPOINTS, Protocol, anthropic_errors, open_protocol
from steptap.middleware.proxy.recorder import CallRecorder
from steptap.middleware.proxy.services import SERVICES_KEY, Services
from steptap.middleware.proxy.serving import (
    SEED_DROPPED,
    _sticky_id,
    _upstream_body,
    admitted_body,
    decode_body,
    forced_sampling,
    patch_request,
)
from steptap.middleware.proxy.sse import StreamRelay
from steptap.middleware.proxy.validate import ChatView, CompletionView, check_model_call
from steptap.middleware.records import json_encoder
from steptap.middleware.sessions.identity import identify
from steptap.middleware.sessions.session import LiveSession
from steptap.middleware.weights.gate import Ticket
from steptap.middleware.weights.spans import Spans
from steptap.middleware.weights.swapper import CUT_MESSAGE

_encode = json_encoder.encode


async def model_call(request: web.Request, endpoint: str) -> web.StreamResponse:
    """One model call, from the agent's bytes to its reply (one coroutine: each frame of the chain is
    resumed at every wait of the call)."""
    started_at, t0 = time.time(), time.perf_counter()
    services = request.app[SERVICES_KEY]  # once a call (services.py)
    async with admitted_body(request, services) as raw:  # origin, a writable log, the body's limits
        cfg, manager, pool = services.config, services.sessions, services.pool
        ident = identify(request)  # a malformed session id is a 400
        body, ids = decode_body(raw, endpoint, manager, services.call_states, ident)
        try:
            call = _checked(request, cfg, endpoint, raw, body, ids, started_at, t0)
        except ApiError as exc:  # a refused body: the session it names records why (a failed step)
            await _record_refused(request, services, ident, endpoint, body, exc.message, started_at, t0)
            raise
        with manager.admitted(request.remote):  # a 429 beyond max_concurrent_calls or max_calls_per_peer
            # refused here: no session opened
            served = await pool.route(call.view.model, manager.side_aliases(ident))
            session = await manager.resolve(ident, request.remote)  # identify
            async with vision.CallImages(cfg, services.images, manager.log.images) as pics:
                with manager.first_call(session):  # refused before its call begins: no auto session opened
                    await _prepare(services, call, session, pics)
                try:
                    async with manager.call(session, steps=call.view.n or 1, size=len(raw)), \
                            services.swapper.gate() as ticket:  # gate
                        served = ticket.served_model or served  # LoRA mode: the current adapter serves
                        return await _forwarded(request, services, call, session, pics, served, ticket)
                finally:
                    services.metrics.call_latency.observe(time.perf_counter() - t0, endpoint,
                                                          "true" if call.view.stream else "false")


# The routes' handlers: partials, not coroutines that await model_call (one frame fewer a call)
chat_completions = functools.partial(model_call, endpoint=CHAT)
completions = functools.partial(model_call, endpoint=COMPLETIONS)
responses = functools.partial(model_call, endpoint="responses")


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API: every error leaves in Anthropic's shape (its SDK parses no other)."""
    return await anthropic_errors(request, model_call(request, "messages"))


class _Incoming(NamedTuple):
    """The agent's call as read and checked, before it is admitted."""

    endpoint: str  # the agent's
    upstream: str  # what it is sent to: chat completions for a protocol riding on it
    raw: bytes
    body: dict[str, Any]
    proto: Protocol | None  # Responses, Messages or Gemini, translated to chat
    edge: dict[str, Any]  # what the edge check read (a token prompt's ids left out: typed when decoded)
    view: ChatView | CompletionView
    started_at: float
    t0: float


def _checked(request: web.Request, cfg: ProxyConfig, endpoint: str, raw: bytes, body: dict[str, Any],
             ids: Any, started_at: float, t0: float) -> _Incoming:
    """The body translated (another protocol rides on chat completions, checked in its own format first)
    and checked at the edge; an ``ApiError`` refuses it."""
    upstream = CHAT if endpoint in PROTOCOL_ENDPOINTS else endpoint
    proto = open_protocol(endpoint, body, request) if endpoint in PROTOCOL_ENDPOINTS else None
    # A prompt decoded as token ids was typed then (strict ints): the edge check skips its 120k items
    edge = proto.chat if proto is not None else body if not ids else {**body, "prompt": []}
    view = check_model_call(edge, upstream == CHAT, cfg.max_n)
    return _Incoming(endpoint, upstream, raw, body, proto, edge, view, started_at, t0)


async def _prepare(services: Services, call: _Incoming, session: LiveSession,
                   pics: vision.CallImages) -> None:
    """The protocol's session-dependent parts; the images read once the call is admitted and routed (a
    refused call decodes none), a stored conversation's too: checked (a 400 or 429, nothing recorded) and
    held; stored with the step that names them (vision.py)."""
    proto = call.proto
    if proto is not None:
        proto.prepare(None if session.trajectory.anonymous else session.id)
        for field in proto.dropped:
            services.metrics.dropped_fields.labels(call.endpoint, field).inc()
    await pics.read(call.edge if proto is None else proto.chat)


async def _forwarded(request: web.Request, services: Services, call: _Incoming, session: LiveSession,
                     pics: vision.CallImages, served: str, ticket: Ticket) -> web.StreamResponse:
    """The call through the gate: on the session's replica, or the least loaded (an anonymous call, one step,
    holds no sticky entry: it would only push named sessions out of the pool's bounded map)."""
    pool = services.pool
    replica = pool.acquire(pool.pick(_sticky_id(session)))
    running: _Call | None = None
    try:
        if call.proto is not None:
            await call.proto.adapt(replica.client, served)
        cfg = services.config
        forced = forced_sampling(cfg, session)
        out, asked = patch_request(pics.upstream(call.proto, call.body), call.upstream, served, cfg, forced)
        running = _Call(request, call.upstream, replica, asked,
                        _recorder(services, call, session, pics, out, served, replica, ticket, bool(forced)))
        payload = _upstream_body(call.raw, call.body, out) if call.proto is None else _encode(out)
        return await running.run(payload, bool(call.view.stream))
    finally:
        pool.release(running.replica if running is not None else replica)  # the one it ended on


def _recorder(services: Services, call: _Incoming, session: LiveSession, pics: vision.CallImages,
              out: dict[str, Any], served: str, replica: Replica, ticket: Ticket,
              forced: bool) -> CallRecorder:
    """The call's recorder: what every step of it shares, and what it adds to them."""
    cfg = services.config
    state = services.call_states.of(session)
    recorder = CallRecorder(services, session, state, call.upstream, call.t0, common=dict(
        request=pics.logged(call.body),  # each image as its reference (stored once)
        sampling=capture.sampling_of(out, forced, cfg.sampling_defaults),
        model=call.view.model or served,
        served_model=served,
        backend=replica.name,
        started_at=call.started_at,
        policy_version=ticket.version,
    ))
    recorder.proto, recorder.spans, recorder.chat, recorder.pics = call.proto, ticket.spans, out, pics
    if cfg.drop_seed and "seed" in (call.proto.chat if call.proto is not None else call.body):
        recorder.notes.append(SEED_DROPPED)  # dropped by patch_request, never sent
        services.metrics.dropped_fields.labels(call.endpoint, "seed").inc()
    recorder.tito = pics.tito(state, call.upstream == CHAT and (cfg.tito or session.tito))
    return recorder


async def _record_refused(request: web.Request, services: Services, ident: Any, endpoint: str,
                          body: dict[str, Any], message: str, started_at: float, t0: float) -> None:
    """A call refused before it left, in a session it names (not an anonymous one): recorded as a failed step
    with the error, so the session view says why the agent got nothing. Best effort: the refusal still leaves
    as it would (a session that cannot be reached or is full keeps nothing)."""
    services.metrics.refused_calls.labels(endpoint).inc()
    if ident.source == "anonymous":
        return
    manager = services.sessions
    try:
        session = await manager.resolve(ident, request.remote)
    except DomainError:
        return
    # An auto session is opened by an accepted call only: a refused first call opens nothing
    if session.pending:
        manager.drop_pending(session)
        return
    model = body.get("model")
    step = capture.failed_step(endpoint, message, "invalid_request", request=vision.strip_images(body),
                               model=model if isinstance(model, str) else "", started_at=started_at,
                               latency_s=time.perf_counter() - t0)
    try:
        await manager.record(session, [step], services.call_states.of(session).context())
    except DomainError:
        pass


# Backend failures after the call left: the call becomes a failed step (an unreachable backend got nothing).
_RECORDED = (BackendTimeout, BackendError, BackendUnavailable, BackendCut, BackendMalformed)


class _Call:
    """One model call on its way through: its source (the backend's, or a token-in-token-out turn's), the
    writer to the agent, the recorder (record once); a failure of the source mapped to a failed step."""

    def __init__(self, request: web.Request, endpoint: str, replica: Replica, asked: Asked,
                 recorder: CallRecorder) -> None:
        self.request = request
        self.services = recorder.services
        self.endpoint = endpoint  # as sent upstream: chat or completions
        self.replica = replica
        self.upstream: Backend = replica.client
        self.asked = asked
        self.recorder = recorder
        self.relay: StreamRelay | None = None  # the stream's relay once it began: a cut is no error body then
        self.built: tuple[bytes, list[int]] | None = None  # a TITO turn's prompt (its JSON, its ids)

    def run(self, payload: bytes | Parts, stream: bool) -> Awaitable[web.StreamResponse]:
        """The call to its end: a token-in-token-out turn, or the backend's reply (a cancel ends as
        ``_cancelled`` says in either)."""
        return self._run_tito(payload, stream) if self.recorder.tito else self._run_backend(payload, stream)

    async def _run_tito(self, payload: bytes | Parts, stream: bool) -> web.StreamResponse:
        try:
            turn = await self._start_turn(stream)
            if turn is not None:
                return await self._run_turn(*turn, stream)
        except asyncio.CancelledError:
            await self._cancelled()
            raise
        return await self._run_backend(payload, stream)  # rendered: the first turn, or a fallback

    async def _start_turn(self, stream: bool) -> tuple[tito.Turn, dict[str, Any]] | None:
        """The token-in-token-out turn when this call extends the session's last, else None (rendered: the
        step says why)."""
        recorder = self.recorder
        handles = recorder.proto.handles if recorder.proto is not None else None
        turn = await tito.start_turn(recorder.session, recorder.state, recorder.chat, self.upstream,
                                     self.services.metrics, stream, handles)
        if not isinstance(turn, str):
            return turn
        if turn != "first":
            recorder.notes.append(f"token-in-token-out fell back to rendering: {turn}")
        return None

    async def _run_backend(self, payload: bytes | Parts, stream: bool) -> web.StreamResponse:
        """The backend's reply to the call as sent: read whole, or streamed."""
        recorder = self.recorder
        source: BackendStream | None = None
        try:
            got = await self._forward(payload, stream)  # forward
            self.services.pool.call_done(self.replica, got.status)
            if isinstance(got, BackendReply):
                return await (self._plain().relay(got) if got.status < 400
                              else self._plain().upstream_error(got.status, got.body))
            source = got
            if got.status >= 400:
                return await self._plain().upstream_error(got.status, await got.read())
            return await self._stream(got, got.status, recorder.spans)
        except BackendUnreachable:
            recorder.count("backend_unreachable")  # nothing reached the backend: no step
            raise
        except BackendTimeout as exc:
            if not recorder.recorded:
                await recorder.record([recorder.failed(exc.message, "backend_timeout")])
            raise
        except _RECORDED as exc:  # the one place a failed call is recorded before its error leaves
            if not recorder.recorded:
                await recorder.record([recorder.failed(exc.message, exc.code.removesuffix("_reply"))])
            raise
        except asyncio.CancelledError:
            await self._cancelled()
            raise
        finally:
            if source is not None:
                source.release()

    async def _run_turn(self, turn: tito.Turn, generate: dict[str, Any], stream: bool) -> web.StreamResponse:
        """A token-in-token-out turn: its stream relayed as the backend's is, or its whole reply."""
        recorder = self.recorder
        turn.spans = recorder.spans
        self.built = turn.encoded_prompt()
        # the next turn's JSON continues it (tito.Turn)
        recorder.state.hold_prompt(recorder.manager, recorder.session, self.built)
        try:
            if stream:
                async with turn.stream(generate, self.services.metrics) as source:
                    return await self._stream(source, 200, recorder.spans if turn.counted else None)
            reply = await turn.reply(generate)
        except (BackendStatus, BackendUnreachable, BackendTimeout, BackendCut, msgspec.DecodeError,
                KeyError) as exc:
            message, err = _turn_failure(self.upstream.name, exc)
            if not recorder.recorded:
                await recorder.record([recorder.failed(message, "backend_error")])
            raise err from None
        return await self._plain().reply(reply, 200, None)

    def _plain(self) -> PlainReply:
        return PlainReply(self.recorder, self.recorder.proto, self.asked, self.upstream.name,
                          self._take_echo())

    async def _stream(self, source: BackendStream, status: int, counts: Spans | None) -> web.StreamResponse:
        cfg = self.services.config
        relay = self.relay = StreamRelay(self.request, self.recorder, self.recorder.proto, self.asked,
                                         self.upstream.name, self._take_echo(), counts,
                                         cfg.stream_write_timeout_s, cfg.stream_heartbeat_s)
        return await relay.run(source, status)

    def _take_echo(self) -> Callable[[bytes], Echo | None]:
        """A chat reply or first chunk with vLLM's echo of the prompt ids taken out (``prompts``): not a bound
        method, which the stream's relay (``self.relay``) would hold in a cycle with this call."""
        return functools.partial(_session_echo, self.recorder, self.built)

    async def _forward(self, payload: bytes | Parts, stream: bool) -> BackendReply | BackendStream:
        """Send the call to the session's replica (its reply read whole, or a stream); one that cannot be
        reached got nothing, so it is taken out and the call (with its session) moves to another healthy
        replica, once."""
        try:
            return await (self.upstream.stream if stream else self.upstream.send)(self.endpoint, payload)
        except BackendUnreachable as exc:
            pool = self.services.pool
            pool.take_out(self.replica.name, exc.message, unreachable=True)
            try:
                other = pool.pick(_sticky_id(self.recorder.session), avoid=self.replica.name)
            except (BackendUnavailable, BackendUnreachable):
                raise exc from None
            pool.release(self.replica)
            self.replica, self.upstream = pool.acquire(other), other.client
            self.recorder.common["backend"] = other.name
            return await (self.upstream.stream if stream else self.upstream.send)(self.endpoint, payload)

    async def _cancelled(self) -> None:
        """The agent hung up and the server cancelled this handler, or a weight swap cut a call that
        outlasted its drain bound: keep what arrived as a failed step (in a new task: this one is being
        cancelled). A swap's cut before the stream began ends as the protocol's error body instead."""
        recorder, swapper = self.recorder, self.services.swapper
        if recorder.recorded:
            return
        if self.relay is None and swapper.take_cut():
            await recorder.record([recorder.failed(CUT_MESSAGE, "swap_cut")])
            raise SwapCut(CUT_MESSAGE) from None
        partial = self.relay.acc.reply() if self.relay is not None else None
        if swapper.was_cut(asyncio.current_task()):
            why = ("cut by a weight swap: the call outlasted the swap's drain bound (--swap-drain-timeout)",
                   "swap_cut")
        else:
            why = ("agent disconnected", "client_gone")
        recorder.record_later(recorder.failed(*why, partial))


def _session_echo(recorder: CallRecorder, built: tuple[bytes, list[int]] | None, data: bytes) -> Echo | None:
    return prompts.session_echo(data, recorder.manager, recorder.session, recorder.state, built)


def _turn_failure(base: str, exc: Exception) -> tuple[str, BackendError]:
    """A token-in-token-out call's failure: its step's message, and the error the agent gets."""
    if isinstance(exc, BackendStatus):
        err = tito.backend_error(base, exc)
        return err.message, err
    if isinstance(exc, DomainError):  # unreachable, timed out, cut: the client names the replica
        return f"token-in-token-out call failed: {exc.message}", BackendError(exc.message)
    # an answer that is not what the route sends
    return (f"token-in-token-out call failed: {exc!r}",
            BackendError(f"backend {base} failed a token-in-token-out call: {exc!r}"))
