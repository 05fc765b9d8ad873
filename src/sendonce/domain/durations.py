"""Human durations such as ``90s``, ``15m``, ``1h``, ``90d``."""

from __future__ import annotations

import re
from datetime import timedelta

_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """Parse ``1h30m``, ``90s``, ``15m``; a bare number means seconds. Raises ValueError."""
    cleaned = text.strip().lower()
    if not cleaned:
        raise ValueError("empty duration")
    try:
        seconds = float(cleaned)
    except ValueError:
        pass
    else:
        return _seconds(seconds, text)
    pos = 0
    total = 0.0
    for match in _PART.finditer(cleaned):
        if match.start() != pos and cleaned[pos : match.start()].strip():
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos == 0 or cleaned[pos:].strip():
        raise ValueError(f"not a duration: {text!r} (use forms like 90s, 15m, 1h, 7d)")
    return _seconds(total, text)


def _seconds(seconds: float, text: str) -> timedelta:
    if seconds < 0:  # `outbox prune --older-than -1d` would remove every finished row
        raise ValueError(f"a duration cannot be negative: {text!r}")
    try:
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError):  # longer than a timedelta holds (about 2.7 million years), inf, nan
        raise ValueError(f"not a duration a clock can hold: {text!r}") from None
