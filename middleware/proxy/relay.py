"""The model-call handlers (the other agent-facing routes are in routes.py, the SSE relay in sse.py, the
upstream body in serving.py). ``model_call``: identify -> gate -> forward -> capture -> record once -> reply.

The agent's body is decoded once (it is recorded as the step's ``request`` anyway) and re-encoded with only
our keys changed, never through a Struct (unknown fields would be lost). The upstream reply is parsed once;
``capture`` builds the steps from it and strips what the agent did not ask for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from steptap.middleware.backend.boundary import Backend, BackendReply, BackendStream
from steptap.middleware.backend.client import Parts
from steptap.middleware.backend.pool import POOL_KEY, Replica
from steptap.middleware.config import CONFIG_KEY
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
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.proxy import capture, replies, tito, vision
from steptap.middleware.proxy.call_state import CALL_STATES_KEY
from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked
from steptap.middleware.proxy.protocols import PROTOCOL_ENDPOINTS, Protocol, anthropic_errors, open_protocol
from steptap.middleware.proxy.serving import (
    SEED_DROPPED,
    _sticky_id,
    _upstream_body,
    admitted_body,
    decode_body,
    patch_request,
)
from steptap.middleware.proxy.sse import StreamRelay
from steptap.middleware.proxy.validate import check_model_call
from steptap.middleware.records import Step, json_encoder
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.sessions.identity import identify
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.sessions.session import LiveSession
from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.spans import Spans
from steptap.middleware.weights.swapper import CUT_MESSAGE

logger = logging.getLogger("steptap.relay")

_decode = msgspec.json.decode
_encode = json_encoder.encode
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
    started_at, t0 = time.time(), time.perf_counter()
    async with admitted_body(request) as raw:  # origin, a writable log, the body's limits (serving.py)
        return await _model_call(request, endpoint, raw, started_at, t0)


async def _model_call(
    request: web.Request, endpoint: str, raw: bytes, started_at: float, t0: float
) -> web.StreamResponse:
    app = request.app
    cfg, manager, pool = app[CONFIG_KEY], app[SESSIONS_KEY], app[POOL_KEY]
    ident = identify(request)  # a malformed session id is a 400
    body, ids = decode_body(raw, endpoint, manager, app[CALL_STATES_KEY], ident)
    upstream_endpoint = CHAT if endpoint in PROTOCOL_ENDPOINTS else endpoint
    try:
        # Another protocol rides on chat completions: translated (and checked in its own format) before the
        # rest.
        proto = open_protocol(endpoint, body, request) if endpoint in PROTOCOL_ENDPOINTS else None
        # A prompt decoded as token ids was typed then (strict ints): the edge check skips its 120k items
        edge = proto.chat if proto is not None else body if not ids else {**body, "prompt": []}
        view = check_model_call(edge, upstream_endpoint == CHAT, cfg.max_n)
    except ApiError as exc:  # a refused body: the session it names records why (a failed step)
        await _record_refused(request, ident, endpoint, body, exc.message, started_at, t0)
        raise
    stream = bool(view.stream)
    with manager.admitted(request.remote):  # a 429 beyond max_concurrent_calls or max_calls_per_peer
        served = await pool.route(view.model, manager.side_aliases(ident))  # refused: opens no session
        session = await manager.resolve(ident, request.remote)  # identify
        async with vision.CallImages(cfg, app[vision.IMAGE_MEMORY_KEY], manager.log.images) as pics:
            with manager.first_call(session):  # refused before its call begins: no auto session opened
                if proto is not None:
                    proto.prepare(None if session.trajectory.anonymous else session.id)
                    for field in proto.dropped:
                        app[METRICS_KEY].dropped_fields.labels(endpoint, field).inc()
                # Images once admitted and routed (a refused call decodes none), a stored conversation's
                # too: checked (a 400 or 429, nothing recorded) and held; stored with the step that names
                # them (vision.py)
                await pics.read(edge if proto is None else proto.chat)
            try:
                async with manager.call(session, steps=view.n or 1, size=len(raw)), \
                        app[SWAPPER_KEY].gate() as ticket:  # gate
                    served = ticket.served_model or served  # LoRA mode: the current adapter serves every call
                    # The session's replica, or the least loaded; an anonymous call (one step) holds no sticky
                    # entry (it would only push named sessions out of the pool's bounded map).
                    replica = pool.acquire(pool.pick(_sticky_id(session)))
                    if proto is not None:
                        await proto.adapt(replica.client, served)
                    out, asked = patch_request(pics.upstream(proto, body), upstream_endpoint, served, cfg)
                    call = _Call(request, upstream_endpoint, manager, session, replica, asked, t0,
                                 common=dict(
                        request=pics.logged(body),  # each image as its reference (stored once)
                        sampling=capture.sampling_of(out, bool(cfg.force_sampling), cfg.sampling_defaults),
                        model=view.model or served,
                        served_model=served,
                        backend=replica.name,
                        started_at=started_at,
                        policy_version=ticket.version,
                    ))
                    call.proto, call.spans = proto, ticket.spans
                    if cfg.drop_seed and "seed" in (proto.chat if proto is not None else body):
                        call.notes.append(SEED_DROPPED)  # dropped by patch_request, never sent
                        app[METRICS_KEY].dropped_fields.labels(endpoint, "seed").inc()
                    call.chat, call.pics, call.state = out, pics, app[CALL_STATES_KEY].of(session)
                    call.tito = pics.tito(call.state, upstream_endpoint == CHAT and (cfg.tito or
                                                                                    session.tito))
                    try:
                        payload = _upstream_body(raw, body, out) if proto is None else _encode(out)
                        return await call.run(payload, stream)
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
        await manager.record(session, [step], request.app[CALL_STATES_KEY].of(session).context())
    except DomainError:
        pass


# Backend failures after the call left: the call becomes a failed step (an unreachable backend got nothing).
_RECORDED = (BackendTimeout, BackendError, BackendUnavailable, BackendCut, BackendMalformed)


class _Call(StreamRelay):
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
        self.upstream: Backend = replica.client
        self.asked = asked
        self.t0 = t0
        self.common = common
        self.strip = not (asked.token_ids and asked.logprobs)
        self.acc: capture.ChatStream | capture.CompletionStream | None = None  # a stream's chunks so far
        self.recorded = False  # a step (good or failed) of this call is in the trajectory
        self.proto: Protocol | None = None  # Responses / Messages riding on chat completions
        self.tito = False  # token-in-token-out mode for this session
        self.notes: list[str] = []  # recorded on this call's steps beside the protocol's
        self.chat: dict[str, Any] = {}  # the chat body sent upstream
        self.write_timeout = request.app[CONFIG_KEY].stream_write_timeout_s
        self.heartbeat_s = request.app[CONFIG_KEY].stream_heartbeat_s
        self.spans: Spans | None = None  # where a weight swap switched this call's tokens to a newer version
        self.waiting = False  # the stream's pump waits on the backend: every token it sent so far is counted
        self.pics = vision.NO_IMAGES  # the prompt's images (each step names them)
        self.built: tuple[bytes, list[int]] | None = None  # a TITO turn's prompt (its JSON, its ids)

    async def run(self, payload: bytes | Parts, stream: bool) -> web.StreamResponse:
        if self.tito:
            metrics = self.request.app[METRICS_KEY]
            handles = self.proto.handles if self.proto is not None else None
            turn = await tito.start_turn(self.session, self.state, self.chat, self.upstream, metrics, stream,
                                         handles)
            if not isinstance(turn, str):
                return await self._run_tito(*turn, stream)
            if turn != "first":  # rendered instead: the step says why
                self.notes.append(f"token-in-token-out fell back to rendering: {turn}")
        source: BackendStream | None = None
        try:
            got = await self._forward(payload, stream)  # forward
            self.request.app[POOL_KEY].call_done(self.replica, got.status)
            if isinstance(got, BackendReply):
                return await (self._relay_plain(got) if got.status < 400
                              else self._upstream_error(got.status, got.body))
            source = got
            if got.status >= 400:
                return await self._upstream_error(got.status, await got.read())
            return await self._relay_stream(got, got.status)
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
            # The agent hung up and the server cancelled this handler, or a weight swap cut a call that
            # outlasted its drain bound: keep what arrived as a failed step (in a new task: this one is being
            # cancelled). A swap's cut before the stream began ends as the protocol's error body instead.
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
                self._record_later(self.failed(*why, partial))
            raise
        finally:
            if source is not None:
                source.release()

    async def _forward(self, payload: bytes | Parts, stream: bool) -> BackendReply | BackendStream:
        """Send the call to the session's replica (its reply read whole, or a stream); one that cannot be
        reached got nothing, so it is taken out and the call (with its session) moves to another healthy
        replica, once."""
        try:
            return await (self.upstream.stream if stream else self.upstream.send)(self.endpoint, payload)
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
            return await (self.upstream.stream if stream else self.upstream.send)(self.endpoint, payload)

    # --- token-in-token-out --------------------------------------------------------------------------------

    async def _run_tito(self, turn: tito.Turn, generate: dict[str, Any], stream: bool) -> web.StreamResponse:
        base = self.upstream.name  # the replica as configured (never http://localhost)
        turn.spans = self.spans
        self.built = turn.encoded_prompt()
        # the next turn's JSON continues it (tito.Turn)
        self.state.hold_prompt(self.manager, self.session, self.built)
        try:
            if stream:
                async with turn.stream(generate, self.request.app[METRICS_KEY]) as source:
                    return await self._relay_stream(source, 200)
            reply = await turn.reply(generate)
        except BackendStatus as exc:
            err = tito.backend_error(base, exc)
            if not self.recorded:
                await self.record([self.failed(err.message, "backend_error")])
            raise err from None
        except (BackendUnreachable, BackendTimeout, BackendCut) as exc:  # the client names the replica
            if not self.recorded:
                await self.record([self.failed(f"token-in-token-out call failed: {exc.message}",
                                               "backend_error")])
            raise BackendError(exc.message) from None
        except (msgspec.DecodeError, KeyError) as exc:  # an answer that is not what the route sends
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
                self._record_later(self.failed("agent disconnected", "client_gone", partial))
            raise
        return await self._reply_plain(reply, 200, None)

    # --- capture and record -------------------------------------------------------------------------------

    def failed(self, message: str, type_: str, partial: dict[str, Any] | None = None) -> Step:
        self._count(type_)
        return capture.failed_step(self.endpoint, message, type_, partial, latency_s=self._latency(),
                                   **self.common)

    def _count(self, type_: str) -> None:
        self.request.app[METRICS_KEY].upstream_errors.labels(type_).inc()

    def _latency(self) -> float:
        return time.perf_counter() - self.t0

    async def record(self, steps: list[Step], stop_reason: Any = None) -> None:
        """Append this call's steps to its session; durable when it returns (before the reply completes).
        ``stop_reason``: vLLM's for a one-choice reply (what a TITO session's next turn may extend)."""
        self.recorded = True
        self.request.app[SWAPPER_KEY].label(steps, self.spans)
        for step in steps:
            if self.proto is not None:
                step.endpoint = self.proto.endpoint
                step.notes = list(self.proto.notes)
                self.proto.annotate(step)
            if self.notes:
                step.notes = [*step.notes, *self.notes]
            step.images = self.pics.refs()
        # A translated request's messages as sent upstream (images as references): continuity is judged on
        # them (sessions/prefix.py)
        chat = self.pics.logged(self.chat.get("messages")) if self.proto is not None else None
        async with self.pics.stored():  # the images the steps name: stored only now (the call was accepted)
            await self.manager.record(self.session, steps,
                                      self.state.context(chat if isinstance(chat, list) else None))
        if self.tito:
            tito.end_turn(self.state, self.chat, steps, stop_reason)

    def _record_later(self, step: Step) -> None:
        """A failed step recorded in the background (the agent is gone, the handler returns now); the session
        counts it as a call in flight until it is recorded."""
        self.manager.hold_call(self.session)
        self.manager.spawn(self._record_quietly(step))

    async def _record_quietly(self, step: Step) -> None:
        try:
            async with self.pics.stored():  # its request refers to them
                await self.manager.record(self.session, [step], self.state.context())
        except Exception:  # a background task: log it, there is no agent left to tell
            logger.exception("could not record the failed step of session %s", self.session.id)
        finally:
            self.manager.release_call(self.session)

    # --- replies ------------------------------------------------------------------------------------------

    async def _upstream_error(self, status: int, data: bytes) -> web.Response:
        base = self.upstream.name  # the replica as configured (never http://localhost)
        if status < 500:  # the agent's mistake, in vLLM's own OpenAI error body: pass it on unchanged
            endpoint = self.proto.endpoint if self.proto is not None else self.endpoint
            self.request.app[METRICS_KEY].refused_calls.labels(endpoint).inc()
            try:
                message = _decode(data)["error"]["message"]
            except (msgspec.DecodeError, KeyError, TypeError):
                message = data[:500].decode("utf-8", "replace")
            # recorded, so the session says why (a prompt over the context, a template that refused it); an
            # auto session the backend never accepted a call for stays unopened (refused calls fill no session
            # table)
            if not self.session.pending:
                await self.record([self.failed(f"backend {base} refused the call ({status}): {message}",
                                               "backend_refused")])
            if self.proto is not None:
                data = self.proto.upstream_error(status, data)
            return web.Response(body=data, status=status, content_type="application/json")
        try:
            message = _decode(data)["error"]["message"]
        except (msgspec.DecodeError, KeyError, TypeError):
            message = data[:200].decode("utf-8", "replace")
        text = f"backend {base} answered {status}: {message}"
        if status == 503:
            await self.record([self.failed(text, "backend_error")])
            raise BackendUnavailable(text)
        raise BackendError(text)

    async def _relay_plain(self, got: BackendReply) -> web.Response:
        base = self.upstream.name  # the replica as configured (never http://localhost)
        data = got.body
        echo = self._take_echo(data) if self.endpoint == CHAT else None
        # Typed, stripped in vLLM's bytes; else the dict path
        if self.proto is None:
            view: replies.ReplyView | replies.CompletionView | None
            if self.endpoint == CHAT:
                view = replies.reply_view(data if echo is None else echo[0])
                steps = None if view is None else replies.steps_from_view(
                    view, None if echo is None else echo[2], latency_s=self._latency(), **self.common)
            else:
                view = replies.completion_view(data)
                known = replies.known_prompt(self.common["request"])  # the ids vLLM echoes: not decoded
                steps = None if view is None else replies.steps_from_completion(
                    view, known, latency_s=self._latency(), **self.common)
            if view is not None and steps is not None:
                body = replies.strip_reply_bytes(data, view, self.asked) if self.strip else data
                if body is not None:
                    stop = view.choices[0].stop_reason if view.choices else None
                    await self.record(steps, stop)  # durable before the reply leaves
                    return web.Response(body=body, status=got.status, content_type="application/json")
        try:
            reply = _decode(data if echo is None else echo[0])
            if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
                raise ValueError("no choices")
        except (msgspec.DecodeError, ValueError):
            raise BackendMalformed(f"backend {base} sent a malformed reply (not an OpenAI "
                                   "completion)") from None
        if echo is not None:
            reply["prompt_token_ids"] = echo[2]
        return await self._reply_plain(reply, got.status, data)

    async def _reply_plain(self, reply: dict[str, Any], status: int, data: bytes | None) -> web.Response:
        steps = capture.steps_from_reply(reply, self.endpoint, latency_s=self._latency(), **self.common)
        if self.proto is not None:
            data = self.proto.reply(reply)
        elif self.strip or data is None:
            capture.strip_reply(reply, self.asked, self.endpoint)
            data = _encode(reply)
        await self.record(steps, capture.stop_reason(reply))  # durable before the reply leaves
        return web.Response(body=data, status=status, content_type="application/json")
