"""Orders, each by a user (see users.get_user)."""

from __future__ import annotations

from shop.users import get_user

ORDERS = [(1, "tea", 3), (3, "cake", 1), (1, "scone", 2), (2, "tea", 1)]


def orders_of(name: str) -> list[tuple[str, int]]:
    return [(item, qty) for user_id, item, qty in ORDERS if get_user(user_id) == name]


def buyer(index: int) -> str:
    return get_user(ORDERS[index][0])
