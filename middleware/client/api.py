"""What both clients share: the proxy's URL (``proxy_url``: ``unix:PATH`` or ``http(s)://host:port``, ``/v1``
stripped, one type for both), the control API's shapes (the session options, request bodies, the session
reply) and errors as SteptapError."""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict

import msgspec

from steptap.middleware.backend.url import BackendUrl, problem


class SteptapError(Exception):
    """An error answer from the proxy (OpenAI's error body)."""

    def __init__(self, status: int, message: str, type: str | None = None, code: str | None = None) -> None:
        super().__init__(f"{status} {type or 'error'}: {message}" + (f" ({code})" if code else ""))
        self.status = status
        self.message = message
        self.type = type
        self.code = code

    @classmethod
    def from_body(cls, status: int, body: bytes) -> SteptapError:
        try:
            err = json.loads(body)["error"]
            return cls(status, str(err.get("message", "")), err.get("type"), err.get("code"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(status, body.decode("utf-8", "replace")[:500] or f"HTTP {status}")


class SessionInfo(msgspec.Struct, kw_only=True):
    id: str
    base_url: str
    api_key: str


_session_dec = msgspec.json.Decoder(SessionInfo)


def proxy_url(url: str) -> BackendUrl:
    """A proxy's URL, parsed once for both clients: ``http(s)://host:port`` or ``unix:PATH`` (a proxy served
    on a unix socket), a trailing ``/`` and ``/v1`` stripped (the OpenAI base URL an agent is given names the
    same proxy). ``ValueError`` saying what is wrong with any other."""
    why = problem(url)
    if why is not None:
        raise ValueError(f"not a proxy URL: {why}")
    return BackendUrl.parse(url)


class SessionOptions(TypedDict, total=False):
    """Every option of ``POST /sessions`` (docs/sessions.md), the same for both clients' ``open_session``;
    ``session_id`` is the body's ``id``."""

    group_id: str | None
    group_size: int | None
    mode: Literal["train", "eval", "judge"]
    metadata: dict[str, Any] | None
    idle_timeout_s: float | None
    session_id: str | None  # choose its id instead of letting the proxy generate one
    tito: bool  # token-in-token-out (docs/sessions.md, "TITO")
    train: Literal["main", "all"]  # "Side calls and branches"
    side_models: list[str] | None


_BODY_NAMES = {"session_id": "id"}
_DEFAULTS: dict[str, Any] = {"tito": False, "train": "main"}  # the proxy's own: a body an older proxy takes


def session_body(options: SessionOptions) -> dict[str, Any]:
    """The ``POST /sessions`` body of ``options``: unset and default options left out."""
    unknown = set(options) - set(SessionOptions.__annotations__)
    if unknown:
        raise TypeError(f"open_session() got unknown options {sorted(unknown)}; it takes "
                        f"{sorted(SessionOptions.__annotations__)}")
    body: dict[str, Any] = {"mode": options.get("mode", "train")}
    for name, value in options.items():
        if value is not None and name != "mode" and _DEFAULTS.get(name, object()) != value:
            body[_BODY_NAMES.get(name, name)] = value
    return body


def _reward_body(value: float, name: str | None, step: int | str | None,
                 source: str | None = None, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"value": value}
    for k, v in (("name", name), ("step", step), ("source", source), ("provenance", provenance or None)):
        if v is not None:
            body[k] = v
    return body


def _finish_body(reward: float | str | None, status: str, deadline_s: float | None = None,
                 on_deadline: str | float | None = None, error: str | None = None,
                 infra_cause: str | None = None, task_run: Any = None) -> dict[str, Any]:
    """``reward="pending"``: held off the stream until its reward arrives or ``deadline_s`` passes
    (``on_deadline``: "drop" or a reward value; docs/sessions.md); ``error``: why it ended so (kept, cut to
    2000 characters). ``status="infra_error"`` with ``error`` (the reason) and ``infra_cause``: an
    infrastructure failure, never trained (docs/tasks.md); ``task_run`` (a ``records.TaskRun``): how a task
    episode's agent and verifier ended."""
    body: dict[str, Any] = {"status": status}
    for k, v in (("reward", reward), ("deadline_s", deadline_s), ("on_deadline", on_deadline),
                 ("error", None if error is None else error[:2000]), ("infra_cause", infra_cause)):
        if v is not None:
            body[k] = v
    if task_run is not None:
        body["task_run"] = msgspec.to_builtins(task_run)
    return body
