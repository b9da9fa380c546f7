"""Relaying a model call's SSE stream to the agent: the backend's lines batched per network read, each event
fed to capture and passed on (stripped, or translated by the call's protocol), the steps recorded before
``[DONE]``; a failure once the headers are out ends as an error event; a reader that stalls is cut.

``StreamRelay`` is a mixin of relay.py's ``_Call``, which holds the call's state these methods read."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from steptap.middleware.backend.boundary import BackendStream
from steptap.middleware.errors import error_body, status_of
from steptap.middleware.exceptions import (
    BackendCut,
    BackendMalformed,
    BackendStatus,
    BackendTimeout,
    BackendUnreachable,
    DomainError,
)
from steptap.middleware.proxy import capture, prompts, tito
from steptap.middleware.proxy.protocols import HEARTBEAT
from steptap.middleware.records import json_encoder
from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.swapper import CUT_MESSAGE, CUT_WRITE_S

if TYPE_CHECKING:
    from steptap.middleware.backend.boundary import Backend
    from steptap.middleware.proxy.call_state import CallState
    from steptap.middleware.proxy.capture import Asked
    from steptap.middleware.proxy.protocols import Protocol
    from steptap.middleware.records import Step
    from steptap.middleware.sessions.manager import SessionManager
    from steptap.middleware.sessions.prefix import Grown
    from steptap.middleware.sessions.session import LiveSession
    from steptap.middleware.weights.spans import Spans

_decode = msgspec.json.decode
_ECHO = b'"prompt_token_ids"'
_encode = json_encoder.encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class _AgentGone(Exception):
    """The agent closed its connection while we streamed to it."""


class _AgentStalled(_AgentGone):
    """The agent took no byte of its stream for ``stream_write_timeout_s``: its call slot is given back."""


class StreamRelay:
    """``_Call``'s stream: relay, pump, the cut's end."""

    request: web.Request
    endpoint: str
    upstream: Backend
    asked: Asked
    common: dict[str, Any]
    strip: bool
    acc: capture.ChatStream | capture.CompletionStream | None
    proto: Protocol | None
    write_timeout: float
    heartbeat_s: float  # 0: none
    spans: Spans | None
    manager: SessionManager
    session: LiveSession
    state: CallState  # what the proxy holds for the session between calls
    built: tuple[bytes, list[int]] | None  # a TITO turn's prompt (its JSON, its ids)
    guard: _WriteGuard  # the stream's bound on each write to the agent
    if TYPE_CHECKING:  # _Call's
        def failed(self, message: str, type_: str, partial: dict[str, Any] | None = None) -> Step: ...
        def _latency(self) -> float: ...
        async def record(self, steps: list[Step], stop_reason: Any = None) -> None: ...

    def _take_echo(self, data: bytes) -> tuple[bytes, bytes, list[int], Grown | None] | None:
        """A chat reply or first chunk with vLLM's echo of the prompt ids taken out (``prompts``)."""
        return prompts.session_echo(data, self.manager, self.session, self.state, self.built)

    async def _relay_stream(self, source: Any, status: int) -> web.StreamResponse:
        """Relay SSE events as they come (``source``: the backend's ``BackendStream``, or a token-in-token-out
        turn's line batches); the steps are recorded before ``[DONE]``. Once the headers are out a failure can
        no longer be an HTTP error: it is recorded as a failed step and sent as an error event."""
        out = web.StreamResponse(status=status, headers=_SSE_HEADERS)
        acc = self.acc = capture.new_stream(self.endpoint)  # set first: from here a cut is not an error body
        # The split is known only while the pump is caught up with vLLM (TITO: from vLLM's weight_versions;
        # its pump also waits on derender, with tokens in hand).
        if self.spans is not None and isinstance(source, BackendStream):
            self.spans.counter = lambda: acc.token_counts() if self.waiting else None
        await out.prepare(self.request)
        self.guard = _WriteGuard(self.write_timeout)
        try:
            return await self._relay(source, out, acc)
        finally:
            self.guard.close()

    async def _relay(self, source: Any, out: web.StreamResponse, acc: Any) -> web.StreamResponse:
        proto = self.proto
        try:
            if proto is not None:
                await _send(out, proto.start(), self.guard)
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
                whole = acc.reply()
                await self.record(capture.steps_from_reply(whole, self.endpoint, latency_s=self._latency(),
                                                           **self.common),
                                  capture.stop_reason(whole))  # durable before [DONE]
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
            # The headers are out and the step could not be kept (session full, log full, record too large):
            # the agent learns it from an error event and the stream ends; it never waits for a [DONE].
            status = status_of(exc)
            tail = (proto.stream_error(status, exc.message, exc.code) if proto is not None
                    else self._error_event(status, exc.message, exc.code))
        await self._end(out, tail, source if done else None)
        return out

    async def _end(self, out: web.StreamResponse, tail: bytes, source: Any) -> None:
        """Send the stream's last event and end it; then read the end of ``source`` (the backend's reply, when
        it sent [DONE])."""
        try:
            await _send(out, tail, self.guard)
            await _send(out, None, self.guard)  # the end
        except (_AgentGone, ConnectionResetError):  # aiohttp's ClientConnectionResetError is one
            if self.request.transport is not None:  # the step is recorded; a reader that stopped is cut
                self.request.transport.abort()
            return
        if isinstance(source, BackendStream):
            await source.finish()  # its connection goes back to the pool

    @staticmethod
    def _error_event(status: int, message: str, code: str, type_: str | None = None) -> bytes:
        return b"data: " + error_body(message, status, code, type_) + b"\n\n"

    async def _end_cut(self, out: web.StreamResponse, tail: bytes) -> None:
        """A cut stream's error event and end, put on the wire together; its reader may be the slow one that
        outlasted the drain, so waiting for it is bounded and the connection then closes behind what is
        buffered (the transport still flushes it)."""
        try:
            await asyncio.wait_for(out.write_eof(tail), CUT_WRITE_S)
        except (TimeoutError, ConnectionResetError):
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
        # the backend's line batches (a BackendStream's, or a token-in-token-out turn's): one read loop
        batches = source.batches if isinstance(source, BackendStream) else source
        proto = self.proto
        echo_left = self.endpoint == capture.CHAT  # vLLM echoes the prompt ids once, in the first chunk
        # Heartbeats only while the backend has sent nothing: when its first bytes are in already (the
        # reader's count of bytes fed), the first read waits on nothing, and needs no task nor timed wait
        answered = isinstance(source, BackendStream) and source.answered
        beating = self.heartbeat_s > 0 and not answered
        beat = (HEARTBEAT if proto is None else proto.heartbeat) if beating else b""
        try:
            # One await per network read, not per line, and what one read brought goes out in one write (the
            # events stay exactly as vLLM framed them).
            while True:
                # Waiting here (not on a slow agent's write) the pump has counted every token vLLM sent before
                # (weights/spans.py): where a keep swap splits this call.
                self.waiting = True
                try:
                    lines = await (self._first_read(batches, out, beat) if beat else anext(batches))
                except StopAsyncIteration:
                    break
                finally:
                    self.waiting = False
                beat = b""  # the backend answered: its tokens follow one another
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
                        # the echo's ids decoded from what is new (prompts.take_echo), the rest as before
                        echo = self._take_echo(payload) if echo_left and _ECHO in payload else None
                        chunk = _decode(payload if echo is None else echo[0])
                        if not isinstance(chunk, dict):
                            raise ValueError
                    except (msgspec.DecodeError, ValueError):
                        failure = (f"backend {base} sent a malformed stream chunk", "backend_malformed")
                        break
                    if echo is not None:
                        chunk["prompt_token_ids"] = echo[2]
                        echo_left = False
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
                    await _send(out, b"".join(parts), self.guard)
                if done or (failure is not None and upstream_error is None):
                    break
        except BackendStatus as exc:  # a token-in-token-out route's error answer
            failure = (tito.backend_error(base, exc).message, "backend_error")
        except (BackendTimeout, BackendCut, BackendMalformed) as exc:  # the stream's, mapped by backend/
            failure = (exc.message, exc.code.removesuffix("_reply"))
        except BackendUnreachable as exc:  # a token-in-token-out call the client could not make
            failure = (exc.message, "backend_cut")
        finally:
            await batches.aclose()
        if failure is None and not done:
            failure = (f"backend {base} ended the stream without [DONE]", "backend_cut")
        return failure, upstream_error, done

    async def _first_read(self, batches: Any, out: web.StreamResponse, beat: bytes) -> list[bytes]:
        """The backend's first read (its prefill), with ``beat`` (an SSE comment) to the agent every
        ``heartbeat_s`` seconds meanwhile: an agent's HTTP idle timeout sees the stream alive (opencode's gave
        up after 300 s without a byte, and a CPU vLLM's prefill of several agents' first prompts took longer),
        and an agent that left is noticed (``_AgentGone``) before the backend answers."""
        read: asyncio.Future[list[bytes]] = asyncio.ensure_future(anext(batches))
        try:
            while not (await asyncio.wait({read}, timeout=self.heartbeat_s))[0]:
                await _send(out, beat, self.guard)
            return read.result()
        finally:
            if not read.done():  # the agent left, or this call was cancelled: stop the read before aclose
                read.cancel()
                await asyncio.wait({read})


class _WriteGuard:
    """The bound on each write to the agent (``stream_write_timeout_s``), one timer per stream: a write marks
    when it began (``since``) and the timer, when it fires, cancels the task only if the write in progress
    began ``timeout_s`` ago, else sets itself for that write's deadline (or ``timeout_s`` from now). The
    bound is as exact as ``asyncio.timeout`` around each write, which cost a timer armed and cancelled per
    write (35 a 32-token stream; ~6x a bare timer, issue 45)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.since: float | None = None  # when the write in progress began
        self.expired = False  # the timer cancelled the task for a write past its bound
        self.cancelling = 0  # the task's cancel requests before the timer's
        self._timer = self.loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        if self.since is None:  # no write now: a later one's deadline is after this one's
            self._timer = self.loop.call_later(self.timeout_s, self._check)
            return
        left = self.since + self.timeout_s - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._check)
        elif self.task is not None:  # the task is suspended in that write: cancelled there
            self.expired, self.cancelling = True, self.task.cancelling()
            self.task.cancel()

    def close(self) -> None:
        self._timer.cancel()


async def _send(out: web.StreamResponse, data: bytes | None, guard: _WriteGuard) -> None:
    """One write to the agent (``None``: the stream's end); a reader that takes nothing for the guard's bound
    is ``_AgentStalled`` (never a ``TimeoutError``: that one means the backend's silence in ``_pump``)."""
    guard.since = guard.loop.time()
    try:
        await (out.write(data) if data is not None else out.write_eof())
    except asyncio.CancelledError:
        # the guard's cancel, unless another came too (a swap's cut, a shutdown): as asyncio.timeout decides
        if guard.expired and guard.task is not None and guard.task.uncancel() <= guard.cancelling:
            raise _AgentStalled() from None
        raise
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one
        raise _AgentGone() from exc
    finally:
        guard.since = None
