"""A text report of who bought what."""

from __future__ import annotations

from shop import orders, users


def report() -> str:
    lines = []
    for name in users.get_users():
        items = ", ".join(f"{qty} {item}" for item, qty in orders.orders_of(name))
        lines.append(f"{name}: {items or 'nothing'}")
    lines.append(f"first buyer: {users.get_user(orders.ORDERS[0][0])}")
    return "\n".join(lines)
