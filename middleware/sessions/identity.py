"""Which session a model call belongs to (docs/SECURITY.md, "Parties and credentials").

In order: the path (``/s/<id>/v1/...``), the ``X-Steptap-Session`` header, a steptap API key
(``Authorization: Bearer stk-...``; Anthropic's SDKs send it as ``x-api-key``, Google's as ``x-goog-api-key``
or ``?key=``). A session opened by ``POST /sessions`` is reached only with its key (with
or without its id); an id alone reaches an auto-created session in its own namespace (``auto:<id>``). Anything
else (no key, ``EMPTY``, an ``sk-...`` key) is anonymous: the call is served and recorded as a one-step
session of its own.
"""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

from steptap.middleware.auth import SESSION_KEY_PREFIX, bearer
from steptap.middleware.exceptions import InvalidRequest

SESSION_HEADER = "X-Steptap-Session"
PATH_PARAM = "agent_session"  # the route variable of /s/{agent_session}/v1/...
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # used with fullmatch: `$` would allow a final \n

Source = Literal["path", "header", "key", "anonymous"]


class Identity(NamedTuple):
    source: Source
    session_id: str | None = None
    key: str | None = None


def valid_session_id(value: str) -> bool:
    return _ID_RE.fullmatch(value) is not None


def identify(request: Any) -> Identity:
    """``request``: anything with ``match_info``, ``headers`` and ``query`` (an aiohttp request; the domain
    imports no aiohttp)."""
    sid = request.match_info.get(PATH_PARAM)
    source: Source = "path"
    if sid is None:
        sid = request.headers.get(SESSION_HEADER)
        source = "header"
    # Anthropic's SDKs send their key as x-api-key; Google's as x-goog-api-key, or in the query as ?key=
    token = (bearer(request) or request.headers.get("x-api-key") or request.headers.get("x-goog-api-key")
             or request.query.get("key"))
    key = token if token is not None and token.startswith(SESSION_KEY_PREFIX) else None
    if sid is not None:
        if not valid_session_id(sid):
            raise InvalidRequest("invalid session id (letters, digits, '.', '_', ':', '-'; at most 128)",
                                 "invalid_session_id")
        return Identity(source, session_id=sid, key=key)  # a keyed session needs its key too (manager)
    if key is not None:
        return Identity("key", key=key)
    return Identity("anonymous")
