"""Subscribers and list memberships: bulk upserts by email_key."""

from __future__ import annotations

from dataclasses import dataclass, field

from sendonce.domain.addresses import Address
from sendonce.domain.states import SubscriberStatus
from sendonce.store.database import Conn
from sendonce.store.queries import query


@dataclass(slots=True)
class SubscriberInput:
    address: Address
    name: str | None = None
    status: SubscriberStatus | None = None
    """None keeps the existing status (new subscribers are confirmed)."""
    list_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class UpsertResult:
    subscriber_id: int
    created: bool


async def upsert_subscribers(conn: Conn, account_id: int, rows: list[SubscriberInput]) -> list[UpsertResult]:
    """Insert or update ``rows`` in one transaction; one result per input row, in order.

    Rows that normalize to the same address are merged (the later row's fields win, lists add up),
    so a request can never create two subscribers for one address.
    """
    if not rows:
        return []
    merged: dict[str, SubscriberInput] = {}
    for row in rows:
        key = row.address.key
        if key in merged:
            first = merged[key]
            first.name = row.name if row.name is not None else first.name
            first.status = row.status if row.status is not None else first.status
            first.list_ids = sorted(set(first.list_ids) | set(row.list_ids))
        else:
            merged[key] = SubscriberInput(row.address, row.name, row.status, sorted(set(row.list_ids)))
    unique = list(merged.values())
    ids: dict[str, int] = {}
    created: set[str] = set()
    async with conn.transaction():
        cursor = await conn.execute(
            query("insert_subscribers"),
            {
                "account_id": account_id,
                "emails": [r.address.given for r in unique],
                "email_keys": [r.address.key for r in unique],
                "names": [r.name for r in unique],
                "statuses": [r.status.value if r.status else None for r in unique],
            },
        )
        for found in await cursor.fetchall():
            ids[found["email_key"]] = int(found["subscriber_id"])
            created.add(found["email_key"])
        existing = [r for r in unique if r.address.key not in created]
        if existing:
            cursor = await conn.execute(
                query("update_subscribers"),
                {
                    "account_id": account_id,
                    "email_keys": [r.address.key for r in existing],
                    "names": [r.name for r in existing],
                    "statuses": [r.status.value if r.status else None for r in existing],
                },
            )
            for found in await cursor.fetchall():
                ids[found["email_key"]] = int(found["subscriber_id"])
        pairs = [(list_id, ids[r.address.key]) for r in unique for list_id in r.list_ids]
        if pairs:
            await conn.execute(
                query("add_memberships"),
                {
                    "account_id": account_id,
                    "list_ids": [p[0] for p in pairs],
                    "subscriber_ids": [p[1] for p in pairs],
                },
            )
    results = []
    for row in rows:
        key = row.address.key
        # Only the first row of a new address counts as its creation; the others updated it.
        results.append(UpsertResult(ids[key], key in created))
        created.discard(key)
    return results
