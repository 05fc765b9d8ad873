"""Token buckets in PostgreSQL: limits that hold across processes and hosts, and survive restarts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from sendonce.store.database import Conn
from sendonce.store.queries import query

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d*)\s*(s|sec|second|m|min|minute|h|hour|d|day)\s*$", re.IGNORECASE)
_PER = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}


@dataclass(frozen=True, slots=True)
class Rate:
    """``count`` per ``seconds``, with a burst of ``burst`` (default: count)."""

    count: float
    seconds: float
    burst: float | None = None

    @property
    def per_second(self) -> float:
        return self.count / self.seconds

    @property
    def capacity(self) -> float:
        return self.burst if self.burst is not None else max(self.count, 1.0)

    @classmethod
    def parse(cls, text: str) -> Rate:
        """``14/s``, ``50/min``, ``5/h``, ``100/10s``; optional burst as ``50/min burst 10``."""
        main, _, burst = text.partition("burst")
        match = _RATE.match(main)
        if not match:
            raise ValueError(f"not a rate: {text!r} (use forms like 14/s, 50/min, 5/h)")
        count = float(match.group(1))
        seconds = float(match.group(2) or 1) * _PER[match.group(3).lower()]
        if not (0 < count < math.inf and 0 < seconds < math.inf):
            raise ValueError(f"a rate must be positive and finite: {text!r}")
        if not burst.strip():
            return cls(count, seconds)
        try:
            size = float(burst)
        except ValueError:
            raise ValueError(f"not a burst: {text!r} (use forms like 50/min burst 10)") from None
        if not 1 <= size < math.inf:  # a bucket that never holds a whole token would refuse everything
            raise ValueError(f"a burst must be at least 1, and finite: {text!r}")
        return cls(count, seconds, size)


async def take_up_to(conn: Conn, bucket: str, rate: Rate, want: int, account_id: int = 0) -> tuple[int, float]:
    """Take up to ``want`` whole tokens; returns (granted, fraction of a token left over)."""
    row = await (
        await conn.execute(
            query("take_tokens_partial"),
            {
                "account_id": account_id,
                "bucket": bucket,
                "capacity": rate.capacity,
                "rate": rate.per_second,
                "want": want,
            },
        )
    ).fetchone()
    assert row is not None
    return int(row["granted"]), float(row["remaining"])


async def refund(conn: Conn, bucket: str, rate: Rate, amount: int, account_id: int = 0) -> None:
    if amount > 0:
        await conn.execute(
            query("refund_tokens"),
            {"account_id": account_id, "bucket": bucket, "capacity": rate.capacity, "amount": amount},
        )


async def take(conn: Conn, account_id: int, bucket: str, rate: Rate, cost: float = 1.0) -> float | None:
    """Take ``cost`` tokens; None when taken, else the seconds to wait before trying again."""
    params = {
        "account_id": account_id,
        "bucket": bucket,
        "capacity": rate.capacity,
        "rate": rate.per_second,
        "cost": cost,
    }
    row = await (await conn.execute(query("take_tokens"), params)).fetchone()
    if row is not None:
        return None
    wait = await (await conn.execute(query("bucket_wait"), params)).fetchone()
    return float(wait["wait"]) if wait else 1.0
