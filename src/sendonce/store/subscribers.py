"""Subscribers and list memberships: bulk upserts by email_key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg.types.json import Jsonb

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
    attributes: dict[str, Any] | None = None
    """Merged into the subscriber's attributes (keys given replace the old values)."""


@dataclass(frozen=True, slots=True)
class UpsertResult:
    subscriber_id: int
    created: bool
    kept_status: str | None = None
    """The status it keeps (``unsubscribed``, ``bounced``) where the row asked to confirm it again
    without ``resubscribe``."""


OPTIN_PURPOSE = "optin"

MAX_OPTIN_ROUND = 3
"""A pending membership's confirmation is sent again (the last one certainly undelivered, or its link
expired) until its round reaches this: at most four mails in all to an address whose owner never
confirms, however often an account adds it again."""

ConfirmUrl = Callable[[int, int], str]
"""(list_id, subscriber_id) -> the signed link that confirms that membership."""


async def upsert_subscribers(
    conn: Conn,
    account_id: int,
    rows: list[SubscriberInput],
    *,
    preconfirm: bool = False,
    confirm_url: ConfirmUrl | None = None,
    optin_ttl: timedelta | None = None,
    resubscribe: bool = False,
) -> list[UpsertResult]:
    """Insert or update ``rows`` in one transaction; one result per input row, in order.

    Rows that normalize to the same address are merged (the later row's fields win, lists add up),
    so a request can never create two subscribers for one address. New memberships of double opt-in
    lists are pending, and their confirmation mails are queued in the same transaction. A membership
    still pending whose last confirmation mail certainly reached nobody, or whose link (valid for
    ``optin_ttl``) has expired, gets a new one. A status ``confirmed`` or ``pending`` is not applied to
    a subscriber who unsubscribed or bounced (see :attr:`UpsertResult.kept_status`) unless
    ``resubscribe``: the caller holds their renewed consent.
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
            if row.attributes:
                first.attributes = {**(first.attributes or {}), **row.attributes}
        else:
            merged[key] = SubscriberInput(
                row.address, row.name, row.status, sorted(set(row.list_ids)), dict(row.attributes or {}) or None
            )
    # In address order: two imports with overlapping addresses lock rows in the same order
    unique = sorted(merged.values(), key=lambda row: row.address.key)
    ids: dict[str, int] = {}
    created: set[str] = set()
    kept: dict[str, str] = {}
    async with conn.transaction():
        cursor = await conn.execute(
            query("insert_subscribers"),
            {
                "account_id": account_id,
                "emails": [r.address.given for r in unique],
                "email_keys": [r.address.key for r in unique],
                "names": [r.name for r in unique],
                "statuses": [r.status.value if r.status else None for r in unique],
                "attributes": [Jsonb(r.attributes) if r.attributes else None for r in unique],
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
                    "attributes": [Jsonb(r.attributes) if r.attributes else None for r in existing],
                    "resubscribe": resubscribe,
                },
            )
            for found in await cursor.fetchall():
                ids[found["email_key"]] = int(found["subscriber_id"])
                if found["status_kept"]:
                    kept[found["email_key"]] = str(found["status"])
        pairs = [(list_id, ids[r.address.key]) for r in unique for list_id in r.list_ids]
        if pairs:
            renewed: list[tuple[int, int, int]] = []
            if not preconfirm:
                # Existing memberships still pending whose last confirmation can no longer confirm them
                # (read before the new memberships exist: theirs is queued below, in round 0).
                cursor = await conn.execute(
                    query("renew_stale_optins"),
                    {
                        "account_id": account_id,
                        "list_ids": [p[0] for p in pairs],
                        "subscriber_ids": [p[1] for p in pairs],
                        "link_life_seconds": None if optin_ttl is None else optin_ttl.total_seconds(),
                        "max_round": MAX_OPTIN_ROUND,
                    },
                )
                renewed = [(r["list_id"], r["subscriber_id"], r["optin_round"]) for r in await cursor.fetchall()]
            cursor = await conn.execute(
                query("add_memberships"),
                {
                    "account_id": account_id,
                    "list_ids": [p[0] for p in pairs],
                    "subscriber_ids": [p[1] for p in pairs],
                    "preconfirm": preconfirm,
                },
            )
            pending = renewed + [
                (r["list_id"], r["subscriber_id"], 0) for r in await cursor.fetchall() if r["status"] == "pending"
            ]
            if pending:
                if confirm_url is None:
                    raise ValueError("double opt-in memberships need confirm_url to build their links")
                await enqueue_confirmations(conn, account_id, pending, confirm_url)
    results = []
    for row in rows:
        key = row.address.key
        # Only the first row of a new address counts as its creation; the others updated it.
        results.append(UpsertResult(ids[key], key in created, kept.get(key)))
        created.discard(key)
    return results


async def enqueue_confirmations(
    conn: Conn, account_id: int, pending: list[tuple[int, int, int]], confirm_url: ConfirmUrl
) -> None:
    """Queue the confirmation mail of each (list_id, subscriber_id, round) pending membership given."""
    await conn.execute(
        query("enqueue_optin_confirmations"),
        {
            "account_id": account_id,
            "list_ids": [p[0] for p in pending],
            "subscriber_ids": [p[1] for p in pending],
            "rounds": [p[2] for p in pending],
            "urls": [confirm_url(p[0], p[1]) for p in pending],
        },
    )


async def confirm_membership(
    conn: Conn, account_id: int, list_id: int, subscriber_id: int
) -> tuple[bool, str, str] | None:
    """Confirm a pending membership (double opt-in): (changed now, list name, status); None: no such membership."""
    params = {"account_id": account_id, "list_id": list_id, "subscriber_id": subscriber_id}
    async with conn.transaction():
        changed = await (await conn.execute(query("confirm_optin"), params)).fetchone()
        row = await (await conn.execute(query("membership"), params)).fetchone()
    if row is None:
        return None
    return changed is not None, str(row["list_name"]), str(row["status"])
