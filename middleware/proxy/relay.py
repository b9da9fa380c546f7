"""Forwarding model calls to vLLM: the upstream ``ClientSession``, request patching (token ids and logprobs
on), the plain and streamed relays, and turning backend failures into OpenAI errors that name the backend.

The agent's body is decoded once (it is recorded as the step's ``request`` anyway) and re-encoded with only
our keys changed, never through a Struct (unknown fields would be lost). The upstream reply is parsed once;
``capture`` builds the steps from it and strips what the agent did not ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp
import msgspec
from aiohttp import web

from steptap.middleware.proxy import capture
from steptap.middleware.proxy.capture import CHAT, COMPLETIONS, Asked
from steptap.middleware.config import CONFIG_KEY, ProxyConfig
from steptap.middleware.errors import ApiError
from steptap.middleware.sessions.identity import identify
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.records import Step
from steptap.middleware.sessions.manager import SESSIONS_KEY, Session, SessionManager

logger = logging.getLogger("steptap.forward")

_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
_JSON_HEADERS = {"Content-Type": "application/json"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_MODELS_REFRESH_S = 2.0  # at most this often, an unknown model name re-reads the backend's /v1/models


class Upstream:
    """One vLLM backend: its HTTP session and the model names it serves."""

    def __init__(self, config: ProxyConfig) -> None:
        base = config.backend.rstrip("/")
        self.base = base.removesuffix("/v1")
        self.config = config
        self.http: aiohttp.ClientSession | None = None
        self.served: list[str] = []
        self._served_at = 0.0

    async def start(self) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.upstream_connect_timeout_s, sock_read=cfg.upstream_timeout_s
        )
        # read_bufsize: SSE lines carrying logprobs get long; a line over twice the buffer raises LineTooLong.
        # The agent's own credential never reaches the backend: it is a steptap key (or anything); the proxy
        # authenticates with the backend's key, when it has one.
        headers = {"Authorization": f"Bearer {cfg.backend_api_key}"} if cfg.backend_api_key else None
        self.http = aiohttp.ClientSession(
            headers=headers,
            timeout=timeout,
            read_bufsize=cfg.read_bufsize,
            # idle connections are dropped before uvicorn's (vLLM's server) 5 s keep-alive closes them
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
            auto_decompress=True,
        )
        try:
            await self.refresh_models()
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.warning(
                "backend %s not answering yet (%s); model names are read on first use", self.base, exc
            )

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def refresh_models(self) -> list[str]:
        assert self.http is not None
        self._served_at = time.monotonic()
        async with self.http.get(f"{self.base}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            resp.raise_for_status()
            data = _decode(await resp.read())
        self.served = [m["id"] for m in data.get("data") or ()]
        return self.served

    async def route(self, model: Any) -> str:
        """The served model for a requested name: itself, or (``--any-model``) the backend's first model."""
        if model in self.served:
            return model
        if not self.served or time.monotonic() - self._served_at > _MODELS_REFRESH_S:
            try:  # a LoRA adapter loaded at runtime appears only in a fresh listing
                await self.refresh_models()
            except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
                if not self.served:
                    raise unreachable(self.base, exc) from exc
            if model in self.served:
                return model
        if model is None or self.config.any_model:
            if not self.served:
                raise ApiError(503, f"backend {self.base} serves no model", "backend_unavailable")
            return self.served[0]
        raise ApiError(
            404,
            f"The model `{model}` does not exist (backend {self.base} serves "
            f"{', '.join(self.served) or 'nothing'}).",
            "model_not_found",
        )


UPSTREAM_KEY = web.AppKey("steptap_upstream", Upstream)
# The weight swapper (weights.py) installs itself here: an object with ``gate()`` (an async context manager
# that holds new calls during a swap) and ``version`` (the policy version of the weights serving the call).
SWAPPER_KEY = web.AppKey("steptap_swapper", object)


def unreachable(base: str, exc: BaseException) -> ApiError:
    return ApiError(502, f"backend {base} is unreachable: {exc or type(exc).__name__}", "backend_unreachable")


def timed_out(base: str, seconds: float) -> ApiError:
    return ApiError(504, f"backend {base} sent nothing for {seconds:g}s", "backend_timeout")


class Ticket(NamedTuple):
    version: int
    served_model: str | None = None  # a LoRA adapter to route to (set by the swapper), else None


@contextlib.asynccontextmanager
async def call_gate(app: web.Application) -> AsyncIterator[Ticket]:
    """The one place every model call passes through on its way upstream: the weight swap holds calls here
    and the policy version is read here, so each step is sampled by exactly one version."""
    swapper: Any = app.get(SWAPPER_KEY)
    if swapper is None:
        yield Ticket(0)
        return
    async with swapper.gate() as ticket:
        yield Ticket(int(ticket.version), getattr(ticket, "served_model", None))


# --- the request --------------------------------------------------------------------------------------------


def _patch(
    body: dict[str, Any], endpoint: str, served: str, cfg: ProxyConfig
) -> tuple[dict[str, Any], Asked]:
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
    if cfg.force_sampling:
        for name, value in cfg.force_sampling.items():
            out[name] = int(value) if name == "top_k" else value
    return out, asked


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _model_call(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _model_call(request, COMPLETIONS)


async def _model_call(request: web.Request, endpoint: str) -> web.StreamResponse:
    app = request.app
    started_at = time.time()
    t0 = time.perf_counter()
    try:
        body = _decode(await request.read())
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    cfg = app[CONFIG_KEY]
    manager = app[SESSIONS_KEY]
    manager.log.ensure_writable()  # 503 while the log cannot write: a call it cannot record is not made
    upstream = app[UPSTREAM_KEY]
    served = await upstream.route(body.get("model"))  # before resolving: a refused call opens no session
    session = await manager.resolve(identify(request))
    stream = bool(body.get("stream"))
    metrics = app[METRICS_KEY]
    manager.begin_call(session)
    try:
        async with call_gate(app) as ticket:
            if ticket.served_model is not None:  # LoRA mode: the current adapter serves every call
                served = ticket.served_model
            out, asked = _patch(body, endpoint, served, cfg)
            common: dict[str, Any] = dict(
                request=body,
                sampling=capture.sampling_of(out, bool(cfg.force_sampling), cfg.sampling_defaults),
                model=body.get("model") or served,
                served_model=served,
                backend=upstream.base,
                started_at=started_at,
                policy_version=ticket.version,
            )
            call = _Call(request, endpoint, manager, session, upstream, asked, common, t0)
            return await call.run(_encode(out), stream)
    finally:
        manager.end_call(session)
        metrics.child(metrics.call_latency, endpoint, "true" if stream else "false").observe(
            time.perf_counter() - t0
        )


class _AgentGone(Exception):
    """The agent closed its connection while we streamed to it."""


class _Call:
    """One model call on its way through: upstream request, relay, capture, record."""

    def __init__(
        self,
        request: web.Request,
        endpoint: str,
        manager: SessionManager,
        session: Session,
        upstream: Upstream,
        asked: Asked,
        common: dict[str, Any],
        t0: float,
    ) -> None:
        self.request = request
        self.endpoint = endpoint
        self.manager = manager
        self.session = session
        self.upstream = upstream
        self.asked = asked
        self.common = common
        self.t0 = t0
        self.strip = not (asked.token_ids and asked.logprobs)
        self.acc: capture.ChatStream | capture.CompletionStream | None = None  # a stream's chunks so far
        self.recorded = False  # a step (good or failed) of this call is in the trajectory

    def _failed(self, message: str, type_: str, partial: dict[str, Any] | None = None) -> Step:
        self.request.app[METRICS_KEY].upstream_errors.labels(type_).inc()
        return capture.failed_step(
            self.endpoint, message, type_, partial, latency_s=self._latency(), **self.common
        )

    def _latency(self) -> float:
        return time.perf_counter() - self.t0

    async def _record_failed(self, step: Step) -> None:
        self.recorded = True
        try:
            await self.manager.record(self.session, [step])
        except Exception:
            logger.exception("could not record a failed step")

    async def run(self, payload: bytes, stream: bool) -> web.StreamResponse:
        assert self.upstream.http is not None
        base = self.upstream.base
        url = f"{base}/v1/{'chat/completions' if self.endpoint == CHAT else 'completions'}"
        timeout_s = self.upstream.config.upstream_timeout_s
        try:
            try:
                resp = await self.upstream.http.post(url, data=payload, headers=_JSON_HEADERS)
            except aiohttp.ServerDisconnectedError:
                # a pooled connection the backend had just closed: nothing was answered, send it once more
                resp = await self.upstream.http.post(url, data=payload, headers=_JSON_HEADERS)
        except TimeoutError:
            await self._record_failed(self._failed(f"backend {base} timed out", "backend_timeout"))
            raise timed_out(base, timeout_s) from None
        except (aiohttp.ClientError, OSError) as exc:
            self.request.app[METRICS_KEY].upstream_errors.labels("backend_unreachable").inc()
            raise unreachable(base, exc) from None
        try:
            if resp.status >= 400:
                return await self._upstream_error(resp)
            if stream:
                return await self._relay_stream(resp)
            return await self._relay_plain(resp)
        except asyncio.CancelledError:
            # The agent hung up and the server cancelled this handler: keep what arrived as a failed step
            # (a new task: this one is being cancelled).
            if not self.recorded:
                partial = self.acc.reply() if self.acc is not None else None
                self.manager.spawn(
                    self._record_failed(self._failed("agent disconnected", "client_gone", partial))
                )
            raise
        finally:
            resp.release()

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
        await self._record_failed(
            self._failed(f"backend {base} answered {resp.status}: {message}", "backend_error")
        )
        status = 503 if resp.status == 503 else 502
        raise ApiError(
            status,
            f"backend {base} answered {resp.status}: {message}",
            "backend_unavailable" if status == 503 else "backend_error",
        )

    async def _relay_plain(self, resp: aiohttp.ClientResponse) -> web.Response:
        base = self.upstream.base
        try:
            data = await resp.read()
        except TimeoutError:
            await self._record_failed(self._failed(f"backend {base} timed out", "backend_timeout"))
            raise timed_out(base, self.upstream.config.upstream_timeout_s) from None
        except aiohttp.ClientError as exc:
            await self._record_failed(self._failed(f"backend {base} cut the reply: {exc}", "backend_cut"))
            raise ApiError(502, f"backend {base} cut the reply: {exc}", "backend_cut") from None
        try:
            reply = _decode(data)
            if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
                raise ValueError("no choices")
        except (msgspec.DecodeError, ValueError):
            await self._record_failed(
                self._failed(f"backend {base} sent a malformed reply", "backend_malformed")
            )
            raise ApiError(
                502,
                f"backend {base} sent a malformed reply (not an OpenAI completion)",
                "backend_malformed_reply",
            ) from None
        steps = capture.steps_from_reply(reply, self.endpoint, latency_s=self._latency(), **self.common)
        if self.strip:
            capture.strip_reply(reply, self.asked, self.endpoint)
            data = _encode(reply)
        self.recorded = True
        await self.manager.record(self.session, steps)  # durable before the reply leaves
        return web.Response(body=data, status=resp.status, content_type="application/json")

    async def _relay_stream(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        base = self.upstream.base
        out = web.StreamResponse(status=resp.status, headers=_SSE_HEADERS)
        await out.prepare(self.request)
        acc = self.acc = capture.new_stream(self.endpoint)
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
            failure = (
                f"backend {base} sent nothing for {self.upstream.config.upstream_timeout_s:g}s mid-stream",
                "backend_timeout",
            )
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            failure = (f"backend {base} cut the stream: {exc or type(exc).__name__}", "backend_cut")
        except _LineTooLong:
            failure = (f"backend {base} sent an over-long stream line", "backend_malformed")
        except _AgentGone:
            # the agent went away: nothing reached it in full; keep what arrived as a failed step
            await self._record_failed(self._failed("agent disconnected", "client_gone", acc.reply()))
            return out
        finally:
            await batches.aclose()
        if failure is None and not done:
            failure = (f"backend {base} ended the stream without [DONE]", "backend_cut")
        if failure is not None:
            await self._record_failed(self._failed(failure[0], failure[1], acc.reply()))
            if upstream_error is not None:  # vLLM's own error event, then [DONE], as vLLM sends it
                tail = upstream_error + _DONE
            else:  # a cut stream ends with an error event (the SDKs raise on it), never a clean [DONE]
                code = failure[1]
                tail = (
                    b"data: "
                    + _encode({"error": {"message": failure[0], "type": code, "code": code}})
                    + b"\n\n"
                )
        else:
            steps = capture.steps_from_reply(
                acc.reply(), self.endpoint, latency_s=self._latency(), **self.common
            )
            self.recorded = True
            await self.manager.record(self.session, steps)  # durable before [DONE]
            tail = _DONE
        try:
            await out.write(tail)
            await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        if done:
            # Read the body's end (the blank line and chunked terminator after [DONE]): a response released
            # unread closes its connection instead of returning it to the pool (a TCP connect per call).
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.wait_for(resp.content.read(), 1.0)
        return out


class _LineTooLong(Exception):
    pass


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


async def models(request: web.Request) -> web.Response:
    upstream = request.app[UPSTREAM_KEY]
    assert upstream.http is not None
    try:
        async with upstream.http.get(
            f"{upstream.base}/v1/models", timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            data = await r.read()
            status = r.status
    except TimeoutError:
        raise timed_out(upstream.base, 10) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise unreachable(upstream.base, exc) from None
    return web.Response(body=data, status=status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Liveness and the backend's state (never a secret): 200 when the backend answers, else 503."""
    upstream = request.app[UPSTREAM_KEY]
    assert upstream.http is not None
    state: dict[str, Any] = {"url": upstream.base, "healthy": False, "models": upstream.served}
    try:
        async with upstream.http.get(f"{upstream.base}/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
            state["healthy"] = r.status == 200
            if r.status != 200:
                state["error"] = f"HTTP {r.status}"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
    swapper: Any = request.app.get(SWAPPER_KEY)
    log: Any = request.app[SESSIONS_KEY].log
    log_state = {"degraded": log.degraded, "error": log.degraded_reason}
    healthy = state["healthy"] and not log.degraded
    body = {
        "status": "ok" if healthy else "degraded",
        "log": log_state,
        "backends": [state],
        "sessions_open": len(request.app[SESSIONS_KEY].sessions),
        "policy_version": int(swapper.version) if swapper is not None else 0,
        "weights": swapper.state() if swapper is not None else None,  # swap state (weights.py)
    }
    return web.Response(body=_encode(body), status=200 if healthy else 503, content_type="application/json")
