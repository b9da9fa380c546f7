"""Who may see the console and who may act through it (docs/SECURITY.md, "The console").

Two roles: ``viewer`` (reads the run and its trajectories) and ``control`` (also marks them). A request
holds a role by a bearer token (the viewer token, ``--viewer-token``, or the control token) or by the
console's cookie. The cookie is got by ``POST /console/api/login`` with a token or a one-time code in
the body, never in a URL: ``steptap up`` prints a link whose code rides in the fragment (``#code=...``),
which browsers never send, and the page exchanges it and wipes it from the address bar. A code is used once
and expires; a cookie session expires too. Actions by cookie also need the ``X-Steptap-Console`` header (a
cross-site form cannot set it; the cookie is ``SameSite=Strict`` besides)."""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from typing import Literal

from aiohttp import web

from steptap.middleware.auth import CONTROL_TOKEN_KEY, bearer
from steptap.middleware.config import CONFIG_KEY
from steptap.middleware.errors import ApiError

Role = Literal["viewer", "control"]
COOKIE = "steptap_console"
CSRF_HEADER = "X-Steptap-Console"
CODE_TTL_S = 600.0  # a printed link works for ten minutes, once (it sits in a terminal's scrollback)
SESSION_TTL_S = 12 * 3600.0
MAX_CODES = 256
MAX_SESSIONS = 1024  # per role: a viewer logging in again and again pushes out only viewers


class Access:
    """One-time codes and cookie sessions, in memory (a proxy restart logs the browser out)."""

    def __init__(self) -> None:
        self.codes: OrderedDict[str, tuple[Role, float]] = OrderedDict()  # code -> (role, expiry)
        # cookie -> (role, expiry), a table per role
        self.tables: dict[Role, OrderedDict[str, tuple[Role, float]]] = {"viewer": OrderedDict(),
                                                                         "control": OrderedDict()}

    @staticmethod
    def _put(table: OrderedDict[str, tuple[Role, float]], role: Role, ttl: float, limit: int) -> str:
        now = time.time()
        for key, (_, exp) in list(table.items()):
            if exp < now:
                del table[key]
        value = secrets.token_urlsafe(24)
        table[value] = (role, now + ttl)
        while len(table) > limit:
            table.popitem(last=False)
        return value

    def mint_code(self, role: Role, ttl_s: float = CODE_TTL_S) -> str:
        return self._put(self.codes, role, ttl_s, MAX_CODES)

    def redeem(self, code: str) -> Role | None:
        """The role of a valid code, which is then spent."""
        role, exp = self.codes.pop(code, (None, 0.0))
        return role if role is not None and exp >= time.time() else None

    def open_session(self, role: Role) -> str:
        return self._put(self.tables[role], role, SESSION_TTL_S, MAX_SESSIONS)

    def session_role(self, cookie: str | None) -> Role | None:
        if not cookie:
            return None
        for table in self.tables.values():
            role, exp = table.get(cookie, (None, 0.0))
            if role is not None:
                return role if exp >= time.time() else None
        return None

    def close_session(self, cookie: str) -> None:
        for table in self.tables.values():
            table.pop(cookie, None)


ACCESS_KEY = web.AppKey("steptap_console_access", Access)


def token_role(request: web.Request, token: str | None) -> Role | None:
    if not token:
        return None
    if hmac.compare_digest(token.encode(), request.app[CONTROL_TOKEN_KEY].encode()):
        return "control"
    viewer = request.app[CONFIG_KEY].viewer_token
    if viewer and hmac.compare_digest(token.encode(), viewer.encode()):
        return "viewer"
    return None


def role_of(request: web.Request) -> tuple[Role | None, bool]:
    """(the request's role, whether it came by cookie)."""
    role = token_role(request, bearer(request))
    if role is not None:
        return role, False
    return request.app[ACCESS_KEY].session_role(request.cookies.get(COOKIE)), True


def require_view(request: web.Request) -> Role:
    role, _ = role_of(request)
    if role is None:
        raise ApiError(401, "the console needs a login: the viewer or control token, or the link steptap up "
                            "printed", "unauthorized")
    return role


def require_act(request: web.Request) -> None:
    """The control role; by cookie, with the console's header too (no cross-site form can act)."""
    role, by_cookie = role_of(request)
    if role is None:
        raise ApiError(401, "this action needs the control token", "unauthorized")
    if role != "control":
        raise ApiError(403, "the viewer token can look, not act: this action needs the control token",
                       "forbidden")
    if by_cookie and request.headers.get(CSRF_HEADER) != "1":
        raise ApiError(403, f"a console action needs the {CSRF_HEADER} header", "forbidden")


def set_cookie(request: web.Request, response: web.StreamResponse, value: str) -> None:
    """The console's cookie; ``Secure`` when the request came over TLS or the proxy is served under an https
    ``public_url`` (a TLS front ahead of it: the proxy itself sees plain HTTP)."""
    public = request.app[CONFIG_KEY].public_url or ""
    secure = request.secure or public.lower().startswith("https://")
    response.set_cookie(COOKIE, value, max_age=int(SESSION_TTL_S), httponly=True, samesite="Strict",
                        secure=secure, path="/console")
