"""Which session a model call belongs to (DESIGN.md, "Session identity").

In order: the path (``/s/<id>/v1/...``), the ``X-Steptap-Session`` header, a steptap API key
(``Authorization: Bearer stk-...``). Anything else (no key, ``EMPTY``, an ``sk-...`` key) is anonymous: the
call is served and recorded as a one-step session of its own.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from aiohttp import web

from steptap.middleware.auth import SESSION_KEY_PREFIX, bearer
from steptap.middleware.errors import ApiError

SESSION_HEADER = "X-Steptap-Session"
PATH_PARAM = "agent_session"  # the route variable of /s/{agent_session}/v1/...
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

Source = Literal["path", "header", "key", "anonymous"]


class Identity(NamedTuple):
    source: Source
    session_id: str | None = None
    key: str | None = None


def valid_session_id(value: str) -> bool:
    return bool(_ID_RE.match(value))


def identify(request: web.Request) -> Identity:
    sid = request.match_info.get(PATH_PARAM)
    source: Source = "path"
    if sid is None:
        sid = request.headers.get(SESSION_HEADER)
        source = "header"
    if sid is not None:
        if not valid_session_id(sid):
            raise ApiError(
                400,
                "invalid session id (letters, digits, '.', '_', ':', '-'; at most 128)",
                "invalid_session_id",
            )
        return Identity(source, session_id=sid)
    token = bearer(request) or request.headers.get("x-api-key")  # Anthropic's SDK sends its key there
    if token is not None and token.startswith(SESSION_KEY_PREFIX):
        return Identity("key", key=token)
    return Identity("anonymous")
