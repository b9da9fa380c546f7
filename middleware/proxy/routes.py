"""The agent-facing routes beside the model calls: the models list, the base URL's probe, Anthropic's
``count_tokens``, and ``/health``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from steptap.middleware.auth import is_control
from steptap.middleware.backend.boundary import Backend
from steptap.middleware.backend.pool import POOL_KEY
from steptap.middleware.errors import ApiError
from steptap.middleware.exceptions import BackendMalformed, BackendStatus
from steptap.middleware.proxy import gemini, tito, vision
from steptap.middleware.proxy import messages as messages_api
from steptap.middleware.proxy.capture import CHAT
from steptap.middleware.proxy.protocols import Messages, Protocol, anthropic_errors
from steptap.middleware.proxy.services import SERVICES_KEY
from steptap.middleware.proxy.serving import (
    _json_object,
    _sticky_id,
    admitted_body,
    forced_sampling,
    patch_request,
)
from steptap.middleware.records import json_encoder
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.sessions.identity import identify
from steptap.middleware.weights.routes import SWAPPER_KEY

_decode = msgspec.json.decode
_encode = json_encoder.encode


async def models(request: web.Request) -> web.Response:
    """The served models; in Anthropic's shape for an Anthropic client, in Gemini's for a Google one (their
    SDKs parse no other)."""
    status, data = await request.app[POOL_KEY].models()
    shape = (messages_api.models_body if messages_api.is_anthropic_client(request.headers) else
             gemini.models_body if gemini.is_gemini_client(request.headers, request.query) else None)
    if status == 200 and shape is not None:
        try:
            data = _encode(shape(_decode(data)))
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
    ids = await prompt_ids(request, lambda body: Messages(body, "", count_only=True))
    return web.json_response({"input_tokens": len(ids)})


async def prompt_ids(request: web.Request, protocol: Callable[[dict[str, Any]], Protocol]) -> list[Any]:
    """The ids of the prompt a model call with this body would send (Anthropic's and Gemini's token counts),
    admitted as a model call is (serving.admitted_body, ``admitted``, images under ``max_image_memory``); the
    session is looked up, never opened (any replica renders alike: the session's own is used when it has
    one)."""
    services = request.app[SERVICES_KEY]
    cfg, manager, pool = services.config, services.sessions, services.pool
    async with admitted_body(request, services) as raw:
        body = _json_object(raw)
        proto = protocol(body)
        ident = identify(request)
        with manager.admitted(request.remote):  # a 429 beyond max_concurrent_calls or max_calls_per_peer
            served = await pool.route(proto.chat.get("model"), manager.side_aliases(ident))
            session = manager.peek(ident)
            upstream = pool.pick(None if session is None else _sticky_id(session)).client
            # images checked and fetched as a call's (vLLM never fetches a URL), never stored
            async with vision.CallImages(cfg, services.images, None) as pics:
                await pics.read(proto.chat)
                await proto.adapt(upstream, served)
                forced = forced_sampling(cfg, session)
                out, _ = patch_request(pics.upstream(proto, body), CHAT, served, cfg, forced)
                return await _rendered_ids(upstream, out)


async def _rendered_ids(upstream: Backend, chat: dict[str, Any]) -> list[Any]:
    """The prompt ids vLLM renders ``chat`` to; an answer without them is a 502 naming the replica."""
    try:  # the client raises BackendUnreachable / BackendTimeout naming the replica
        rendered = await tito.render(upstream, chat)
    except BackendStatus as exc:
        if exc.status in (404, 405):
            raise ApiError(501, "count_tokens renders through the backend's render route: start vLLM with "
                                "--enable-scale-out", "not_supported") from None
        raise ApiError(exc.status if exc.status < 500 else 502,
                       tito.backend_error(upstream.name, exc).message,
                       "backend_error") from None
    except msgspec.DecodeError:
        rendered = None
    ids = rendered.get("token_ids") if isinstance(rendered, dict) else None
    if not isinstance(ids, list):
        raise BackendMalformed(f"backend {upstream.name} answered count_tokens' render without token_ids")
    return ids


async def health(request: web.Request) -> web.Response:
    """Liveness, the log's state, and the replicas' state and load (never a secret): 200 when the log can
    write and one replica takes calls, else 503."""
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
        # auto sessions whose first call is in flight (each counts against max_auto_sessions)
        "sessions_pending": len(request.app[SESSIONS_KEY].pending),
        "policy_version": int(swapper.version),
        "weights": swapper.state(),  # swap state (weights/swapper.py)
    }
    if not is_control(request):
        body = _public_health(body)
    return web.Response(body=_encode(body), status=200 if healthy else 503, content_type="application/json")


# Paths (replica sockets, weights) and error texts, in /health only for the control token.
_PRIVATE_REPLICA = ("url", "reason", "error", "models")
_PRIVATE_WEIGHTS = ("path", "lora_path", "last_error", "degraded", "disk_wanted", "replicas")


def _public_health(body: dict[str, Any]) -> dict[str, Any]:
    weights = msgspec.structs.asdict(body["weights"])
    return {**body,
            "log": {"degraded": body["log"]["degraded"]},
            "backends": [{k: v for k, v in r.items() if k not in _PRIVATE_REPLICA} for r in body["backends"]],
            "weights": {k: v for k, v in weights.items() if k not in _PRIVATE_WEIGHTS}}
