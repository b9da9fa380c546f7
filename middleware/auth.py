"""The control token: everything that is not a model call needs it (docs/SECURITY.md, "Parties and
credentials").

The agent is untrusted: its URL or session key reaches the model routes and nothing else, so a session key
(``stk-...``) presented on a control route gets 403, and no credential at all gets 401."""

from __future__ import annotations

import hmac
import secrets

from aiohttp import web

from steptap.middleware.errors import ApiError

CONTROL_TOKEN_KEY = web.AppKey("steptap_control_token", str)
SESSION_KEY_PREFIX = "stk-"


def generate_token() -> str:
    return "stc-" + secrets.token_urlsafe(24)


def bearer(request: web.Request) -> str | None:
    """The bearer token of the request (``Authorization: Bearer T``), or None."""
    header = request.headers.get("Authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def is_control(request: web.Request) -> bool:
    token = bearer(request)
    if token is None:
        return False
    expected = request.app[CONTROL_TOKEN_KEY]
    # Constant-time: the token's prefix must not be guessable from response timing.
    return hmac.compare_digest(token.encode(), expected.encode())


def require_control(request: web.Request) -> None:
    """Raise 401 (no credential) or 403 (an agent's, or a wrong one) unless it holds the control token.

    Agents reach control routes through their session URL (``/s/<id>/...``) or their session key: both are
    refused with 403, the key being valid for model calls only."""
    if is_control(request):
        return
    token = bearer(request)
    if request.match_info.get("agent_session") is not None or request.path.startswith("/s/"):
        raise ApiError(403, "agent credentials cannot use control routes", "forbidden")
    if token is None:
        raise ApiError(
            401,
            "this route needs the control token (Authorization: Bearer ...)",
            "unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )
    raise ApiError(403, "this credential may make model calls only; use the control token", "forbidden")
