"""The shop's users."""

from __future__ import annotations

USERS = {1: "ada", 2: "grace", 3: "alan"}


def get_user(user_id: int) -> str:
    """The name of user ``user_id``; KeyError when there is none."""
    return USERS[user_id]


def get_users() -> list[str]:
    """Every user's name, by id."""
    return [get_user(i) for i in sorted(USERS)]
