"""verl's metrics (a number, a list of them, or ``Metric`` objects, per micro-batch and rank) reduced to the
floats of ``StepStats``."""

from __future__ import annotations

from typing import Any


def values(v: Any) -> list[float]:
    if v is None:
        return []
    if not isinstance(v, list):
        v = [v]
    out = []
    for x in v:
        x = getattr(x, "value", x)  # verl Metric
        out += values(x) if isinstance(x, list) else [float(x)]
    return out


def mean(v: Any) -> float:
    vals = values(v)
    return sum(vals) / len(vals) if vals else 0.0


def total(v: Any) -> float:
    return sum(values(v))


def last(v: Any) -> float:
    vals = values(v)
    return vals[-1] if vals else 0.0
