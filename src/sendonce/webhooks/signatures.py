"""What the signature schemes share: header look-up, timestamp freshness, constant-time comparison."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from datetime import datetime

from sendonce.webhooks.events import SignatureError


def normalize_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Header names lower-cased: HTTP header names are case-insensitive, dict keys are not."""
    return {name.lower(): value for name, value in headers.items()}


def require_header(headers: Mapping[str, str], name: str) -> str:
    """A header the signature scheme needs (``headers`` already normalized)."""
    value = headers.get(name, "").strip()
    if not value:
        raise SignatureError(f"signature missing: no {name} header")
    return value


def check_timestamp(value: str, *, name: str, now: datetime, tolerance_seconds: int) -> int:
    """The signed unix timestamp, refused when it is not an integer or too far from ``now``.

    Bounding the age makes a captured request useless after ``tolerance_seconds``; bounding the
    skew the other way refuses timestamps from the future, which would stretch that window.
    """
    if not value.isascii() or not value.isdigit() or len(value) > 12:
        raise SignatureError(f"{name} is not a unix timestamp: {value[:32]!r}")
    timestamp = int(value)
    skew = now.timestamp() - timestamp
    if abs(skew) > tolerance_seconds:
        when = "old" if skew > 0 else "far in the future"
        raise SignatureError(f"{name} is too {when} ({int(abs(skew))} s; tolerance {tolerance_seconds} s)")
    return timestamp


def secure_equal(a: str | bytes, b: str | bytes) -> bool:
    """Constant-time comparison, so response timing does not reveal how much of a guess was right."""
    left = a.encode("utf-8") if isinstance(a, str) else a
    right = b.encode("utf-8") if isinstance(b, str) else b
    return hmac.compare_digest(left, right)


def require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        # A programming error in the caller, not a bad request: naive datetimes are local time.
        raise ValueError("now must be a timezone-aware datetime")
