"""Suppressions: addresses an account must not mail. They always win, at build and at claim."""

from __future__ import annotations

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
