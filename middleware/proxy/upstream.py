"""The backend client: one vLLM server's HTTP session, the model names it serves, and the calls the relay makes
to it. Failures leave as domain errors that name the backend (``exceptions.Backend*``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from steptap.middleware.client import split_url
from steptap.middleware.config import ProxyConfig, backend_session
from steptap.middleware.exceptions import (
    BackendTimeout,
    BackendUnavailable,
    BackendUnreachable,
    ModelNotFound,
)

logger = logging.getLogger("steptap.upstream")

_decode = msgspec.json.decode
_JSON_HEADERS = {"Content-Type": "application/json"}
_MODELS_REFRESH_S = 2.0  # at most this often, an unknown model name re-reads the backend's /v1/models
ROUTES = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    # token-in-token-out (proxy/tito.py; vLLM --enable-scale-out); Responses and Messages ride on chat.completions
    "chat.render": "/v1/chat/completions/render",
    "generate": "/inference/v1/generate",
    "chat.derender": "/v1/chat/completions/derender",
}


def unreachable(base: str, exc: BaseException) -> BackendUnreachable:
    return BackendUnreachable(f"backend {base} is unreachable: {exc or type(exc).__name__}")


def timed_out(base: str, seconds: float) -> BackendTimeout:
    return BackendTimeout(f"backend {base} sent nothing for {seconds:g}s")


class Upstream:
    """One vLLM backend: its HTTP session and the model names it serves."""

    def __init__(self, config: ProxyConfig, base: str | None = None) -> None:
        # ``base``: one replica of several (proxy/replicas.py); default the config's single backend.
        # http://host:port, or unix:PATH (reached as http://localhost over the socket; see backend_session)
        self.url = (base or config.backend).rstrip("/").removesuffix("/v1")  # its name in errors and records
        self.base = split_url(self.url)[0].removesuffix("/v1")  # where requests go (http://localhost on a socket)
        self.config = config
        self.http: aiohttp.ClientSession | None = None
        self.served: list[str] = []
        self._served_at = 0.0

    async def start(self) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.upstream_connect_timeout_s, sock_read=cfg.upstream_timeout_s
        )
        # The agent's own credential never reaches the backend: it is a steptap key (or anything); the proxy
        # authenticates with the backend's key, when it has one.
        self.base, self.http = backend_session(
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
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.warning("backend %s not answering yet (%s); model names are read on first use", self.url, exc)

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

    async def route(self, model: str | None) -> str:
        """The served model for a requested name: itself, or (``--any-model``) the backend's first model."""
        if model in self.served:
            return model  # type: ignore[return-value]
        if not self.served or time.monotonic() - self._served_at > _MODELS_REFRESH_S:
            try:  # a LoRA adapter loaded at runtime appears only in a fresh listing
                await self.refresh_models()
            except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
                if not self.served:
                    raise unreachable(self.url, exc) from exc
            if model in self.served:
                return model  # type: ignore[return-value]
        if model is None or self.config.any_model:
            if not self.served:
                raise BackendUnavailable(f"backend {self.url} serves no model")
            return self.served[0]
        raise ModelNotFound(
            f"The model `{model}` does not exist (backend {self.url} serves {', '.join(self.served) or 'nothing'})."
        )

    async def post(self, endpoint: str, payload: bytes) -> aiohttp.ClientResponse:
        """Send a model call; the caller reads and releases the response."""
        assert self.http is not None
        url = self.base + ROUTES[endpoint]
        try:
            try:
                return await self.http.post(url, data=payload, headers=_JSON_HEADERS)
            except aiohttp.ServerDisconnectedError:
                # a pooled connection the backend had just closed: nothing was answered, send it once more
                return await self.http.post(url, data=payload, headers=_JSON_HEADERS)
        except TimeoutError:
            raise timed_out(self.url, self.config.upstream_timeout_s) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise unreachable(self.url, exc) from None

    async def models(self) -> tuple[int, bytes]:
        """The backend's ``/v1/models`` reply, as it sent it."""
        assert self.http is not None
        try:
            async with self.http.get(f"{self.base}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status, await r.read()
        except TimeoutError:
            raise timed_out(self.url, 10) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise unreachable(self.url, exc) from None

    async def health(self) -> dict[str, Any]:
        """The backend's state for ``/health`` (never a secret)."""
        assert self.http is not None
        state: dict[str, Any] = {"url": self.url, "healthy": False, "models": self.served}
        try:
            async with self.http.get(f"{self.base}/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
                state["healthy"] = r.status == 200
                if r.status != 200:
                    state["error"] = f"HTTP {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
        return state


UPSTREAM_KEY = web.AppKey("steptap_upstream", Upstream)
