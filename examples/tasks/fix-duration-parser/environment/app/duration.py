"""Durations such as "1h30m" or "2d4h15m30s" as a number of seconds."""

from __future__ import annotations

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> int:
    """The number of seconds in ``text``: one or more groups of digits each followed by a unit (d, h, m or s),
    with no spaces inside, such as "90s", "1h30m" or "2d4h". Leading and trailing whitespace is ignored.
    Anything else (an empty string, a number without a unit, an unknown unit) raises ValueError."""
    total = 0
    number = ""
    for ch in text.strip():
        if ch.isdigit():
            number = ch
        elif ch in UNITS and number:
            total += int(number) * UNITS[ch]
            number = ""
        else:
            raise ValueError(f"not a duration: {text!r}")
    if number or not text.strip():
        raise ValueError(f"not a duration: {text!r}")
    return total
