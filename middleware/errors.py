"""OpenAI-style error bodies (``{"error": {"message", "type", "code"}}``) and the middleware that turns any
exception raised by a handler into one, so agents and SDKs always see the format they parse."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from steptap.middleware import exceptions as ex
from steptap.middleware.records import json_encoder

logger = logging.getLogger("steptap.proxy")

_json = json_encoder

# HTTP status -> OpenAI error type (what the official SDKs map to exception classes).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "backend_error",
    503: "backend_unavailable",
    504: "backend_timeout",
}


def error_body(message: str, status: int, code: str | None = None, type_: str | None = None) -> bytes:
    err: dict[str, Any] = {
        "message": message,
        "type": type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "code": code,
    }
    return _json.encode({"error": err})


def error_response(
    message: str, status: int, code: str | None = None, type_: str | None = None
) -> web.Response:
    return web.Response(
        body=error_body(message, status, code, type_), status=status, content_type="application/json"
    )


class ApiError(web.HTTPException):
    """An HTTP error whose body is OpenAI's error object. Raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status_code = status
        super().__init__(
            headers=headers,
            text=error_body(message, status, code, type_).decode(),
            content_type="application/json",
        )
        self.message = message
        self.code = code


# Domain error -> HTTP status: the one place the domain meets HTTP (a subclass before its base).
_STATUS: dict[type[ex.DomainError], int] = {
    ex.InvalidRequest: 400,
    ex.SessionNotFound: 404,
    ex.SessionEvicted: 404,
    ex.SessionClosed: 409,
    ex.SessionExists: 409,
    ex.UnknownSessionKey: 401,
    ex.WrongSessionKey: 403,
    ex.StepNotFound: 404,
    ex.GroupNotFound: 404,
    ex.SessionFull: 409,
    ex.Overloaded: 429,
    ex.ModelNotFound: 404,
    ex.BackendUnreachable: 502,
    ex.BackendUnavailable: 503,
    ex.BackendTimeout: 504,
    ex.BackendStatus: 502,
    ex.BackendError: 502,
    ex.BackendCut: 502,
    ex.BackendMalformed: 502,
    ex.SwapCut: 503,
    ex.SwapRefused: 400,
    ex.StaleVersion: 409,
    ex.SwapUnavailable: 503,
    ex.SwapNotPersisted: 500,
    ex.SwapError: 502,
    ex.RecordTooLarge: 413,
    ex.RequestTooComplex: 413,
    ex.LogUnavailable: 503,
}


def status_of(exc: ex.DomainError) -> int:
    return next((s for cls, s in _STATUS.items() if isinstance(exc, cls)), 500)


def api_error(exc: ex.DomainError) -> ApiError:
    """The OpenAI error a domain error leaves the proxy as."""
    headers = None
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return ApiError(status_of(exc), exc.message, exc.code, headers=headers)


def bad_request(message: str, code: str | None = "invalid_request") -> ApiError:
    return ApiError(400, message, code)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body: our ApiErrors pass through, aiohttp's own HTTP errors (404
    on an unknown route, 405) are rewritten, and anything unexpected becomes a 500 that is logged, never
    leaked."""
    try:
        return await handler(request)
    except ApiError:
        raise
    except ex.DomainError as exc:
        raise api_error(exc) from None
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.reason or "error", exc.status, code=None)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response("internal proxy error", 500, code="internal_error")
