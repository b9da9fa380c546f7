"""The control token: everything that is not a model call needs it (docs/SECURITY.md, "Parties and
credentials").

The agent is untrusted: its URL or session key reaches the model routes and nothing else, so a session key
(``stk-...``) presented on a control route gets 403, and no credential at all gets 401."""

from __future__ import annotations

import functools
import hmac
import ipaddress
import secrets
import socket
from urllib.parse import urlsplit

from aiohttp import web

from steptap.middleware.config import ProxyConfig
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


LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain", "ip6-localhost"})
_WILDCARD = frozenset({"", "0.0.0.0", "::"})


@functools.lru_cache(maxsize=1024)  # an agent sends the same Host on every call: parsed once, not per call
def _host_allowed(header: str, host: str, allowed_hosts: tuple[str, ...], public_url: str | None) -> bool:
    name = _host_name(header)
    allowed = {*LOCAL_NAMES, socket.gethostname().lower(), _host_name(host),
               *(_host_name(h) for h in allowed_hosts)}
    if public_url:
        allowed.add(urlsplit(public_url).hostname or "")
    return bool(name) and (name in allowed or (host in _WILDCARD and _ip_literal(name)))


def _host_name(value: str) -> str:
    """``Host``'s name without its port, lower case: ``[::1]:8400`` -> ``::1``."""
    try:
        return (urlsplit("//" + value.strip()).hostname or "").rstrip(".")
    except ValueError:
        return ""


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_model_call_origin(request: web.Request, cfg: ProxyConfig) -> None:
    """A model call must carry a JSON body and an allowed ``Host``. A browser may POST ``text/plain`` or a
    form cross-site without a preflight, and DNS rebinding points a foreign name at 127.0.0.1: both would
    inject prompts into the log. Allowed hosts: localhost names, this machine's name, the bind address, the
    public URL's host, ``--allowed-hosts``; bound to every address (0.0.0.0, ::), any IP literal too
    (rebinding needs a name)."""
    # the exact header first: aiohttp parses it anew for every request (parameters, charset aside)
    if request.headers.get("Content-Type") != "application/json" and \
            request.content_type.lower() != "application/json":
        raise ApiError(415, f"model calls take Content-Type: application/json, not "
                            f"{request.headers.get('Content-Type') or 'none'!r}", "unsupported_media_type")
    header = request.headers.get("Host")
    if header is None:  # HTTP/1.0 without Host: no browser sends that
        return
    if _host_allowed(header, cfg.host, tuple(cfg.allowed_hosts), cfg.public_url):
        return
    raise ApiError(403, f"Host {header[:100]!r} is not one this proxy serves (add it with --allowed-hosts)",
                   "host_not_allowed")
