"""A tiny shop: users, orders and a report."""
