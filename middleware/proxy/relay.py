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
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import (
    BackendCut,
    BackendError,
    BackendMalformed,
    BackendTimeout,
    BackendUnavailable,
    BackendUnreachable,
)
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.proxy import capture
from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked
from steptap.middleware.proxy.replicas import POOL_KEY, Replica
from steptap.middleware.proxy.upstream import UPSTREAM_KEY, timed_out
from steptap.middleware.records import Step
from steptap.middleware.sessions.identity import identify
from steptap.middleware.sessions.manager import SESSIONS_KEY, LiveSession, SessionManager

logger = logging.getLogger("steptap.relay")

_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

# The weight swapper (weights/swapper.py) installs itself here: ``gate()`` holds new calls during a swap and
# yields the ticket (policy version, served model) that samples the call.
SWAPPER_KEY = web.AppKey("steptap_swapper", object)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await model_call(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await model_call(request, COMPLETIONS)


async def model_call(request: web.Request, endpoint: str) -> web.StreamResponse:
    app = request.app
    started_at, t0 = time.time(), time.perf_counter()
    body = _json_object(await request.read())
    cfg, manager, pool = app[CONFIG_KEY], app[SESSIONS_KEY], app[POOL_KEY]
    served = await pool.route(body.get("model"))  # before identifying: a refused call opens no session
    session = await manager.resolve(identify(request))  # identify
    stream = bool(body.get("stream"))
    try:
        async with manager.call(session), app[SWAPPER_KEY].gate() as ticket:  # gate
            served = ticket.served_model or served  # LoRA mode: the current adapter serves every call
            replica = pool.acquire(pool.pick(session.id))  # the session's replica, or the least loaded
            out, asked = patch_request(body, endpoint, served, cfg)
            call = _Call(request, endpoint, manager, session, replica, asked, t0, common=dict(
                request=body,
                sampling=capture.sampling_of(out, bool(cfg.force_sampling), cfg.sampling_defaults),
                model=body.get("model") or served,
                served_model=served,
                backend=replica.base,
                started_at=started_at,
                policy_version=ticket.version,
            ))
            try:
                return await call.run(_encode(out), stream)
            finally:
                pool.release(call.replica)
    finally:
        metrics = app[METRICS_KEY]
        metrics.child(metrics.call_latency, endpoint, "true" if stream else "false").observe(
            time.perf_counter() - t0
        )


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


# Backend failures after the call left: the call becomes a failed step (an unreachable backend got nothing).
_RECORDED = (BackendTimeout, BackendError, BackendUnavailable, BackendCut, BackendMalformed)


class _AgentGone(Exception):
    """The agent closed its connection while we streamed to it."""


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
        self.upstream = replica.upstream
        self.asked = asked
        self.t0 = t0
        self.common = common
        self.strip = not (asked.token_ids and asked.logprobs)
        self.acc: capture.ChatStream | capture.CompletionStream | None = None  # a stream's chunks so far
        self.recorded = False  # a step (good or failed) of this call is in the trajectory

    async def run(self, payload: bytes, stream: bool) -> web.StreamResponse:
        resp: aiohttp.ClientResponse | None = None
        try:
            resp = await self._forward(payload)  # forward
            if resp.status >= 400:
                return await self._upstream_error(resp)
            if stream:
                return await self._relay_stream(resp)
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
            pool.take_out(self.replica.base, exc.message, unreachable=True)
            try:
                other = pool.pick(self.session.id, avoid=self.replica.base)
            except (BackendUnavailable, BackendUnreachable):
                raise exc from None
            pool.release(self.replica)
            self.replica, self.upstream = pool.acquire(other), other.upstream
            self.common["backend"] = other.base
            return await self.upstream.post(self.endpoint, payload)

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
        await self.manager.record(self.session, steps)

    async def _record_quietly(self, step: Step) -> None:
        try:
            await self.manager.record(self.session, [step])
        except Exception:  # a background task: log it, there is no agent left to tell
            logger.exception("could not record the failed step of session %s", self.session.id)

    # --- replies ------------------------------------------------------------------------------------------

    async def _upstream_error(self, resp: aiohttp.ClientResponse) -> web.Response:
        base = self.upstream.base
        try:
            data = await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            data = b""
        if resp.status < 500:  # the agent's mistake, in vLLM's own OpenAI error body: pass it on unchanged
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
        base = self.upstream.base
        try:
            data = await resp.read()
        except TimeoutError:
            raise timed_out(base, self.upstream.config.upstream_timeout_s) from None
        except aiohttp.ClientError as exc:
            raise BackendCut(f"backend {base} cut the reply: {exc}") from None
        try:
            reply = _decode(data)
            if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
                raise ValueError("no choices")
        except (msgspec.DecodeError, ValueError):
            raise BackendMalformed(f"backend {base} sent a malformed reply (not an OpenAI completion)") from None
        steps = capture.steps_from_reply(reply, self.endpoint, latency_s=self._latency(), **self.common)
        if self.strip:
            capture.strip_reply(reply, self.asked, self.endpoint)
            data = _encode(reply)
        await self.record(steps)  # durable before the reply leaves
        return web.Response(body=data, status=resp.status, content_type="application/json")

    async def _relay_stream(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """Relay SSE events as they come; the steps are recorded before ``[DONE]``. Once the headers are out a
        failure can no longer be an HTTP error: it is recorded as a failed step and sent as an error event."""
        out = web.StreamResponse(status=resp.status, headers=_SSE_HEADERS)
        await out.prepare(self.request)
        acc = self.acc = capture.new_stream(self.endpoint)
        try:
            failure, upstream_error, done = await self._pump(resp, out, acc)
        except _AgentGone:  # nothing reached the agent in full; keep what arrived as a failed step
            await self.record([self.failed("agent disconnected", "client_gone", acc.reply())])
            return out
        if failure is None:
            await self.record(capture.steps_from_reply(acc.reply(), self.endpoint, latency_s=self._latency(),
                                                       **self.common))  # durable before [DONE]
            tail = _DONE
        else:
            await self.record([self.failed(failure[0], failure[1], acc.reply())])
            if upstream_error is not None:  # vLLM's own error event, then [DONE], as vLLM sends it
                tail = upstream_error + _DONE
            else:  # a cut stream ends with an error event (the SDKs raise on it), never a clean [DONE]
                err = {"error": {"message": failure[0], "type": failure[1], "code": failure[1]}}
                tail = b"data: " + _encode(err) + b"\n\n"
        with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
            await out.write(tail)
            await out.write_eof()
        if done:
            # Read the body's end (the blank line and chunked terminator after [DONE]): a response released
            # unread closes its connection instead of returning it to the pool (a TCP connect per call).
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.wait_for(resp.content.read(), 1.0)
        return out

    async def _pump(
        self, resp: aiohttp.ClientResponse, out: web.StreamResponse, acc: Any
    ) -> tuple[tuple[str, str] | None, bytes | None, bool]:
        """Feed the stream's events to the accumulator and the agent; returns (failure, vLLM's error event,
        whether ``[DONE]`` came)."""
        base = self.upstream.base
        failure: tuple[str, str] | None = None  # (message, type)
        upstream_error: bytes | None = None
        done = False
        batches = _line_batches(resp.content, self.upstream.config.read_bufsize * 2)
        try:
            # One await per network read, not per line, and what one read brought goes out in one write (the
            # events stay exactly as vLLM framed them).
            async for lines in batches:
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
                    if not self.strip:
                        parts.append(b"data: " + payload + b"\n\n")
                    elif capture.strip_chunk(chunk, self.asked, self.endpoint):
                        parts.append(b"data: " + _encode(chunk) + b"\n\n")
                if parts:
                    await _send(out, b"".join(parts))
                if done or (failure is not None and upstream_error is None):
                    break
        except TimeoutError:
            seconds = self.upstream.config.upstream_timeout_s
            failure = (f"backend {base} sent nothing for {seconds:g}s mid-stream", "backend_timeout")
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            failure = (f"backend {base} cut the stream: {exc or type(exc).__name__}", "backend_cut")
        except _LineTooLong:
            failure = (f"backend {base} sent an over-long stream line", "backend_malformed")
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


async def _send(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        raise _AgentGone() from exc


# --- the other agent-facing routes -------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    status, data = await request.app[UPSTREAM_KEY].models()
    return web.Response(body=data, status=status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Liveness and the replicas' state and load (never a secret): 200 when one replica takes calls, else
    503."""
    state = await request.app[POOL_KEY].health()
    swapper: Any = request.app[SWAPPER_KEY]
    body = {
        "status": "ok" if state["healthy"] else "degraded",
        "backends": state["replicas"],
        "sessions_moved": state["sessions_moved"],
        "sessions_open": len(request.app[SESSIONS_KEY].sessions),
        "policy_version": int(swapper.version),
        "weights": swapper.state(),  # swap state (weights/swapper.py)
    }
    return web.Response(body=_encode(body), status=200 if state["healthy"] else 503, content_type="application/json")
