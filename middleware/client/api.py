"""The control API's shapes, shared by both clients: request bodies, the session reply, errors as
SteptapError."""

from __future__ import annotations

import json
from typing import Any

import msgspec


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


def _session_body(group_id: str | None, group_size: int | None, mode: str, metadata: dict[str, Any] | None,
                  idle_timeout_s: float | None, session_id: str | None, train: str = "main",
                  side_models: list[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"mode": mode}
    if train != "main":  # the proxy's default: a body an older proxy also takes
        body["train"] = train
    for k, v in (("group_id", group_id), ("group_size", group_size), ("metadata", metadata),
                 ("idle_timeout_s", idle_timeout_s), ("id", session_id), ("side_models", side_models)):
        if v is not None:
            body[k] = v
    return body


def _reward_body(value: float, name: str | None, step: int | str | None,
                 source: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"value": value}
    for k, v in (("name", name), ("step", step), ("source", source)):
        if v is not None:
            body[k] = v
    return body


def _finish_body(reward: float | str | None, status: str, deadline_s: float | None = None,
                 on_deadline: str | float | None = None, error: str | None = None,
                 infra_cause: str | None = None, task_run: Any = None) -> dict[str, Any]:
    """``reward="pending"``: held off the stream until its reward arrives or ``deadline_s`` passes
    (``on_deadline``: "drop" or a reward value; docs/sessions.md). ``status="infra_error"`` with ``error``
    (the reason) and ``infra_cause``: an infrastructure failure, never trained (docs/tasks.md); ``task_run``
    (a ``records.TaskRun``): how a task episode's agent and verifier ended."""
    body: dict[str, Any] = {"status": status}
    for k, v in (("reward", reward), ("deadline_s", deadline_s), ("on_deadline", on_deadline),
                 ("error", error), ("infra_cause", infra_cause)):
        if v is not None:
            body[k] = v
    if task_run is not None:
        body["task_run"] = msgspec.to_builtins(task_run)
    return body
