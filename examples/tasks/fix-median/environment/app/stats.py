"""Small statistics helpers."""

from __future__ import annotations


def mean(values: list[float]) -> float:
    """The arithmetic mean of a non-empty list of numbers."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values: list[float]) -> float:
    """The median of a non-empty list of numbers: the middle value of the sorted list, or the mean of the
    two middle values when the list has an even length. The input list is left unchanged."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid] + ordered[mid + 1]) / 2


def value_range(values: list[float]) -> float:
    """The largest value minus the smallest of a non-empty list of numbers."""
    if not values:
        raise ValueError("range of an empty list")
    return max(values) - min(values)
