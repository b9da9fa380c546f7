"""Relaying a model call's SSE stream to the agent: the source's lines batched per network read (the
backend's ``BackendStream``, or a token-in-token-out turn's: the same interface), each event fed to the
capture accumulator and passed on (stripped, or translated by the call's protocol), the steps recorded before
``[DONE]`` (the call's ``CallRecorder``); a failure once the headers are out ends as an error event; a reader
that stalls is cut."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from steptap.middleware.errors import error_body, status_of
from steptap.middleware.exceptions import (
    BackendCut,
    BackendMalformed,
    BackendStatus,
    BackendTimeout,
    BackendUnreachable,
    DomainError,
)
from steptap.middleware.proxy import accumulator, capture, tito
from steptap.middleware.proxy.prompts import ECHO_KEY
from steptap.middleware.proxy.protocols import HEARTBEAT
from steptap.middleware.records import json_encoder
from steptap.middleware.weights.swapper import CUT_MESSAGE, CUT_WRITE_S

if TYPE_CHECKING:
    from steptap.middleware.backend.boundary import BackendStream
    from steptap.middleware.proxy.capture import Asked
    from steptap.middleware.proxy.prompts import Echo
    from steptap.middleware.proxy.protocols import Protocol
    from steptap.middleware.proxy.recorder import CallRecorder
    from steptap.middleware.weights.spans import Spans

_decode = msgspec.json.Decoder(dict[str, Any]).decode  # a chunk that is no object: a ValidationError
_encode = json_encoder.encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class _AgentGone(Exception):
    """The agent closed its connection while we streamed to it."""


class _AgentStalled(_AgentGone):
    """The agent took no byte of its stream for ``stream_write_timeout_s``: its call slot is given back."""


class StreamRelay:
    """One streamed call's relay to the agent: ``run`` a source to the end, its steps recorded once. ``acc``
    holds what arrived so far (a cut call's partial step)."""

    def __init__(self, request: web.Request, recorder: CallRecorder, proto: Protocol | None, asked: Asked,
                 base: str, take_echo: Callable[[bytes], Echo | None], counts: Spans | None,
                 write_timeout: float, heartbeat_s: float) -> None:
        self.request = request
        self.recorder = recorder  # the call's steps into its session
        self.proto = proto  # the protocol's translator, or None: vLLM's events, stripped
        self.endpoint = recorder.endpoint
        self.asked = asked
        self.strip = not (asked.token_ids and asked.logprobs)
        self.base = base  # the replica as configured (never http://localhost)
        self.take_echo = take_echo  # vLLM's echo of a chat prompt's ids taken out (prompts.session_echo)
        # Where a keep swap splits this call, by the tokens relayed (None: vLLM reports it, or no swap can)
        self.counts = counts
        self.write_timeout = write_timeout
        self.heartbeat_s = heartbeat_s  # 0: none
        self.acc = accumulator.new_stream(self.endpoint)  # the capture accumulator
        self.counted = _Counted(self.acc)  # the tokens counted while the pump waits on the backend
        self.failure: tuple[str, str] | None = None  # (message, type)
        self.upstream_error: bytes | None = None  # vLLM's own error event
        self.done = False  # [DONE] came
        self.echo_left = self.endpoint == capture.CHAT  # vLLM echoes the prompt ids in its first chunk

    async def run(self, source: BackendStream, status: int) -> web.StreamResponse:
        """Relay SSE events as they come; the steps are recorded before ``[DONE]``. Once the headers are out a
        failure can no longer be an HTTP error: it is recorded as a failed step and sent as an error event."""
        out = web.StreamResponse(status=status, headers=_SSE_HEADERS)
        # The split is known only while the pump is caught up with vLLM
        if self.counts is not None:
            self.counts.counter = self.counted
            self.counts.relayed = self.acc.token_counts
        await out.prepare(self.request)
        guard = _WriteGuard(self.write_timeout)  # the bound on each write to the agent
        try:
            return await self._relay(source, out, guard)
        finally:
            guard.close()

    async def _relay(self, source: BackendStream, out: web.StreamResponse,
                     guard: _WriteGuard) -> web.StreamResponse:
        recorder = self.recorder
        try:
            if self.proto is not None:
                await _send(out, self.proto.start(), guard)
            await self._pump(source, out, guard)
        except _AgentStalled:  # it stopped reading: keep what arrived, then cut (a close would wait on it)
            try:
                await recorder.record([recorder.failed(
                    f"agent took no byte of its stream for {self.write_timeout:g}s (stream_write_timeout_s)",
                    "client_stalled", self.acc.reply())])
            finally:  # after the record: the abort cancels this handler
                if self.request.transport is not None:
                    self.request.transport.abort()
            return out
        except _AgentGone:  # nothing reached the agent in full; keep what arrived as a failed step
            await recorder.record([recorder.failed("agent disconnected", "client_gone", self.acc.reply())])
            return out
        except asyncio.CancelledError:
            if not self.recorder.services.swapper.take_cut():
                raise
            await self._cut(out)
            return out
        await self._end(out, await self._recorded(), guard, source if self.done else None)
        return out

    async def _recorded(self) -> bytes:
        """The stream's steps recorded (durable before ``[DONE]``); its last event."""
        proto, acc, recorder, failure = self.proto, self.acc, self.recorder, self.failure
        try:
            if failure is None:
                whole = acc.reply()
                await recorder.record(recorder.steps(whole), capture.stop_reason(whole))
                return _DONE if proto is None else proto.finish(acc.reply())
            await recorder.record([recorder.failed(failure[0], failure[1], acc.reply())])
            if proto is not None:
                return proto.stream_error(502, failure[0], failure[1])
            if self.upstream_error is not None:  # vLLM's own error event, then [DONE], as vLLM sends it
                return self.upstream_error + _DONE
            # a cut stream ends with an error event (the SDKs raise on it), never a clean [DONE]
            return _error_event(502, failure[0], failure[1], failure[1])
        except DomainError as exc:
            # The headers are out and the step could not be kept (session full, log full, record too large):
            # the agent learns it from an error event and the stream ends; it never waits for a [DONE].
            status = status_of(exc)
            return (proto.stream_error(status, exc.message, exc.code) if proto is not None
                    else _error_event(status, exc.message, exc.code))

    async def _end(self, out: web.StreamResponse, tail: bytes, guard: _WriteGuard,
                   source: BackendStream | None) -> None:
        """Send the stream's last event and end it; then read the end of ``source`` (the backend's reply, when
        it sent [DONE])."""
        try:
            await _send(out, tail, guard)
            await _send(out, None, guard)  # the end
        except (_AgentGone, ConnectionResetError):  # aiohttp's ClientConnectionResetError is one
            if self.request.transport is not None:  # the step is recorded; a reader that stopped is cut
                self.request.transport.abort()
            return
        if source is not None:
            await source.finish()  # its connection goes back to the pool

    async def _cut(self, out: web.StreamResponse) -> None:
        """A weight swap's cut: what arrived recorded, then an error event and the end, put on the wire
        together; its reader may be the slow one that outlasted the drain, so waiting for it is bounded and
        the connection then closes behind what is buffered (the transport still flushes it)."""
        recorder, proto = self.recorder, self.proto
        await recorder.record([recorder.failed(CUT_MESSAGE, "swap_cut", self.acc.reply())])
        err = {"error": {"message": CUT_MESSAGE, "type": "swap_cut", "code": "swap_cut"}}
        tail = proto.stream_error(503, CUT_MESSAGE, "swap_cut") if proto is not None else (
            b"data: " + _encode(err) + b"\n\n")
        try:
            await asyncio.wait_for(out.write_eof(tail), CUT_WRITE_S)
        except (TimeoutError, ConnectionResetError):
            if self.request.transport is not None:
                self.request.transport.close()

    async def _pump(self, source: BackendStream, out: web.StreamResponse, guard: _WriteGuard) -> None:
        """Feed the source's events to the accumulator and the agent, until ``[DONE]`` (``done``) or a
        ``failure``."""
        base, counted = self.base, self.counted
        batches = source.batches  # the backend's line batches: one read loop
        # Heartbeats only while the backend has sent nothing: when its first bytes are in already (the
        # reader's count of bytes fed), the first read waits on nothing, and needs no task nor timed wait
        beat = b""
        if self.heartbeat_s > 0 and not source.answered:
            beat = HEARTBEAT if self.proto is None else self.proto.heartbeat
        try:
            # One await per network read, not per line, and what one read brought goes out in one write (the
            # events stay exactly as vLLM framed them).
            while True:
                # Waiting here (not on a slow agent's write) the pump has counted every token vLLM sent before
                # (weights/spans.py): where a keep swap splits this call.
                counted.waiting = True
                try:
                    lines = await (self._first_read(batches, out, beat, guard) if beat else anext(batches))
                except StopAsyncIteration:
                    break
                finally:
                    counted.waiting = False
                beat = b""  # the backend answered: its tokens follow one another
                parts = self._events(lines)
                if parts:
                    await _send(out, b"".join(parts), guard)
                if self.done or (self.failure is not None and self.upstream_error is None):
                    break
        except BackendStatus as exc:  # a token-in-token-out route's error answer
            self.failure = (tito.backend_error(base, exc).message, "backend_error")
        except (BackendTimeout, BackendCut, BackendMalformed) as exc:  # the stream's, mapped by backend/
            self.failure = (exc.message, exc.code.removesuffix("_reply"))
        except BackendUnreachable as exc:  # a token-in-token-out call the client could not make
            self.failure = (exc.message, "backend_cut")
        finally:
            await batches.aclose()
        if self.failure is None and not self.done:
            self.failure = (f"backend {base} ended the stream without [DONE]", "backend_cut")

    def _events(self, lines: list[bytes]) -> list[bytes]:
        """One read's lines: each event fed to the accumulator and passed on (as it came, stripped, or
        translated); what goes out to the agent in one write. Sets ``done``, ``failure``."""
        proto, acc, strip, echo_left = self.proto, self.acc, self.strip, self.echo_left
        parts: list[bytes] = []
        for line in lines:
            if not line.startswith(b"data:"):
                if line.strip() and not line.startswith(b":"):  # blank separators, comments
                    self.failure = (f"backend {self.base} sent a malformed stream line", "backend_malformed")
                    break
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                break
            echo = None
            try:
                if echo_left:  # vLLM's first chunk: the echo's ids decoded from what is new (prompts.py)
                    echo_left = self.echo_left = False  # a later chunk is never searched (one holding ids is
                    # decoded whole); find, not ``in``: bytes' ``in`` formats and drops a TypeError each time
                    if payload.find(ECHO_KEY) >= 0:
                        echo = self.take_echo(payload)
                chunk = _decode(payload if echo is None else echo[0])
            except (msgspec.DecodeError, ValueError):
                self.failure = (f"backend {self.base} sent a malformed stream chunk", "backend_malformed")
                break
            if echo is not None:
                chunk["prompt_token_ids"] = echo[2]
            if "error" in chunk and not chunk.get("choices"):
                self._upstream_error(payload, chunk["error"])
                continue  # vLLM follows its error event with [DONE]
            acc.feed(chunk)
            if proto is not None:
                parts.append(proto.feed(chunk))
            elif not strip:
                parts.append(b"data: " + payload + b"\n\n")
            elif capture.strip_chunk(chunk, self.asked, self.endpoint):
                parts.append(b"data: " + _encode(chunk) + b"\n\n")
        return parts

    def _upstream_error(self, payload: bytes, err: Any) -> None:
        self.upstream_error = b"data: " + payload + b"\n\n"
        message = err.get("message") if isinstance(err, dict) else err
        self.failure = (f"backend {self.base} error mid-stream: {message}", "backend_error")

    async def _first_read(self, batches: Any, out: web.StreamResponse, beat: bytes,
                          guard: _WriteGuard) -> list[bytes]:
        """The backend's first read (its prefill), with ``beat`` (an SSE comment) to the agent every
        ``heartbeat_s`` seconds meanwhile: an agent's HTTP idle timeout sees the stream alive (opencode's gave
        up after 300 s without a byte, and a CPU vLLM's prefill of several agents' first prompts took longer),
        and an agent that left is noticed (``_AgentGone``) before the backend answers."""
        read: asyncio.Future[list[bytes]] = asyncio.ensure_future(anext(batches))
        try:
            while not (await asyncio.wait({read}, timeout=self.heartbeat_s))[0]:
                await _send(out, beat, guard)
            return read.result()
        finally:
            if not read.done():  # the agent left, or this call was cancelled: stop the read before aclose
                read.cancel()
                await asyncio.wait({read})


class _Counted:
    """``Spans.counter`` of a stream: its tokens relayed so far while the pump waits on the backend, else
    None. An object, not a closure over the relay: the relay holds the spans (through its recorder), and that
    cycle left every streamed call's objects to the cyclic collector (~140 a call, issue 45)."""

    __slots__ = ("acc", "waiting")

    def __init__(self, acc: accumulator.ChatStream | accumulator.CompletionStream) -> None:
        self.acc = acc
        self.waiting = False  # the pump waits on the backend: every token it sent so far is counted

    def __call__(self) -> dict[int, int] | None:
        return self.acc.token_counts() if self.waiting else None


def _error_event(status: int, message: str, code: str, type_: str | None = None) -> bytes:
    return b"data: " + error_body(message, status, code, type_) + b"\n\n"


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
