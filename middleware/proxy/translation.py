"""What the protocols that ride on chat completions (``responses.py``, ``messages.py``) share: their 400s,
their ids, and how they tell ``sessions/prefix.py`` what conversation a body holds."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from steptap.middleware.errors import ApiError
from steptap.middleware.sessions import prefix


def bad(message: str, where: str | None = None) -> ApiError:
    """A 400 naming the part of the body at fault (the protocol's error shape is applied at its edge)."""
    return ApiError(400, message if where is None else f"{message} (at {where})", "invalid_request")


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(12)}"


def register_chat_view(endpoint: str, to_chat: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Prefix continuity judges a step of ``endpoint`` by the messages of its chat translation (none when the
    body does not translate)."""

    def view(body: dict[str, Any]) -> list[Any] | None:
        try:
            messages: list[Any] = to_chat(body)["messages"]  # a chat body's messages
        except ApiError:
            return None
        return messages

    prefix.CHAT_VIEWS[endpoint] = view
