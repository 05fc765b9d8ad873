"""Suppressions: addresses an account must not mail. They always win, at build and at claim."""

from __future__ import annotations

from typing import Any

from sendonce.domain.addresses import Address
from sendonce.domain.states import SuppressionReason
from sendonce.store.database import Conn
from sendonce.store.queries import query


async def add_suppression(conn: Conn, account_id: int, address: Address, reason: SuppressionReason) -> bool:
    """Suppress ``address``; False when it was suppressed already (the first reason is kept)."""
    cursor = await conn.execute(
        query("add_suppression"),
        {"account_id": account_id, "email_key": address.key, "email": address.given, "reason": reason.value},
    )
    return await cursor.fetchone() is not None


async def delete_suppression(conn: Conn, account_id: int, address: Address) -> bool:
    cursor = await conn.execute(query("delete_suppression"), {"account_id": account_id, "email_key": address.key})
    return await cursor.fetchone() is not None


async def import_suppressions(conn: Conn, account_id: int, rows: list[tuple[Address, SuppressionReason]]) -> int:
    """Suppress ``rows`` in one statement; returns how many were new."""
    if not rows:
        return 0
    cursor = await conn.execute(
        query("import_suppressions"),
        {
            "account_id": account_id,
            "email_keys": [a.key for a, _ in rows],
            "emails": [a.given for a, _ in rows],
            "reasons": [r.value for _, r in rows],
        },
    )
    return len(await cursor.fetchall())


async def export_suppressions(
    conn: Conn, account_id: int, *, after: str = "", limit: int = 5000
) -> list[dict[str, Any]]:
    """One page of the account's suppressions, in ``email_key`` order, after the key ``after``."""
    cursor = await conn.execute(
        query("export_suppressions"), {"account_id": account_id, "after": after, "limit": limit}
    )
    return await cursor.fetchall()
