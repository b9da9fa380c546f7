"""The Gemini API's routes (``/v1beta/models/MODEL:METHOD``, also ``/v1`` and ``/v1alpha``, also under
``/s/<session>``): ``generateContent`` and ``streamGenerateContent?alt=sse`` through the relay
(``relay.model_call``), ``countTokens`` rendered by the session's replica, the models list and one model in
Gemini's shape, and every error in Gemini's body (Google's SDKs parse no other)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from steptap.middleware.backend.pool import POOL_KEY
from steptap.middleware.errors import ApiError
from steptap.middleware.proxy import gemini, relay, routes
from steptap.middleware.proxy.gemini_contents import COUNT, STREAM, split_call
from steptap.middleware.proxy.protocols import Gemini, shaped_errors
from steptap.middleware.records import json_encoder

_decode = msgspec.json.decode
_encode = json_encoder.encode
VERSIONS = "{version:v1beta|v1|v1alpha}"


def add_routes(router: web.UrlDispatcher, prefix: str) -> None:
    """Before ``/s/{agent_session}/{tail}``'s catch-all (an agent's other paths are refused there)."""
    router.add_post(f"{prefix}/{VERSIONS}/models/{{call}}", call)
    router.add_get(f"{prefix}/{{version:v1beta|v1alpha}}/models", models)
    router.add_get(f"{prefix}/{VERSIONS}/models/{{model}}", model)
    router.add_route("*", f"{prefix}/{{version:v1beta|v1alpha}}/{{tail:.*}}", not_served)


def _gemini_error(status: int, message: str) -> bytes:
    return gemini.error_body(status, message)


async def call(request: web.Request) -> web.StreamResponse:
    return await shaped_errors(request, _call(request), _gemini_error)


async def _call(request: web.Request) -> web.StreamResponse:
    _, method = split_call(request.match_info["call"])
    if method == COUNT:
        return await _count_tokens(request)
    if method not in gemini.METHODS:
        raise ApiError(404, f"method {method!r} is not served (generateContent, streamGenerateContent, "
                            "countTokens)", "not_found")
    if method == STREAM and request.query.get("alt") != "sse":
        raise ApiError(400, "streamGenerateContent is served as server-sent events: add ?alt=sse (Google's "
                            "SDKs do)", "invalid_request")
    return await relay.model_call(request, gemini.ENDPOINT)


async def _count_tokens(request: web.Request) -> web.Response:
    """``{"totalTokens": N}``: the length of the prompt a ``generateContent`` call with these contents would
    send, rendered by the session's replica (the same translation and template): what the step's
    ``prompt_token_ids`` will hold."""
    name, _ = split_call(request.match_info["call"])
    ids = await routes.prompt_ids(request, lambda body: Gemini(body, name, count_only=True))
    return web.json_response({"totalTokens": len(ids)})


async def _listed(request: web.Request) -> list[dict[str, object]]:
    status, data = await request.app[POOL_KEY].models()
    if status != 200:
        raise ApiError(502, f"the backend answered {status} to its models list", "backend_error")
    try:
        return list(gemini.models_body(_decode(data))["models"])
    except (msgspec.DecodeError, AttributeError, TypeError):
        raise ApiError(502, "the backend's models list is not vLLM's", "backend_error") from None


async def models(request: web.Request) -> web.StreamResponse:
    """``GET /v1beta/models``: the served models as Gemini ``Model``s (one page)."""
    async def listed() -> web.Response:
        return web.Response(body=_encode({"models": await _listed(request)}), content_type="application/json")

    return await shaped_errors(request, listed(), _gemini_error)


async def model(request: web.Request) -> web.StreamResponse:
    """``GET /v1beta/models/MODEL``: one served model, or a 404."""
    async def one() -> web.Response:
        name = request.match_info["model"].removeprefix("models/")
        for entry in await _listed(request):
            if entry["baseModelId"] == name:
                return web.Response(body=_encode(entry), content_type="application/json")
        raise ApiError(404, f"model {name[:100]!r} is not served here", "not_found")

    return await shaped_errors(request, one(), _gemini_error)


async def not_served(request: web.Request) -> web.Response:
    """Another Gemini API path (files, cached contents, tuned models, embeddings): a 404 in Gemini's shape."""
    return web.Response(body=gemini.error_body(404, f"{request.path[:200]} is not served: this proxy serves "
                                                    "models/MODEL:generateContent, :streamGenerateContent "
                                                    "and :countTokens, and the models list"),
                        status=404, content_type="application/json")
