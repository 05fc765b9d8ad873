"""The outbox's pipeline queries: claim, renew, record, release, recover, build, finish.

Every function here is one statement (or one short transaction), called by the delivery pipeline.
Outcomes are recorded in groups (``unnest`` arrays), never one round trip per message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from psycopg.rows import tuple_row

from sendonce.store.database import Conn
from sendonce.store.queries import query

Key = tuple[int, int]
"""(account_id, delivery_id): the primary key of a delivery."""


@dataclass(slots=True)
class ClaimedDelivery:
    account_id: int
    delivery_id: int
    job_id: str
    kind: str
    campaign_id: int | None
    subscriber_id: int | None
    email: str
    payload: dict[str, Any]
    attempt: int
    """The fencing token this claim holds."""
    failures: int
    blocked: bool
    """Suppressed or unsubscribed at claim time: already final ('suppressed'), never sent."""
    uncertain: bool
    name: str | None
    attributes: dict[str, Any] | None
    not_before: datetime | None = None
    """Its place in the campaign's queue, with delivery_id: where the claim's cursor moves to."""

    @property
    def key(self) -> Key:
        return (self.account_id, self.delivery_id)


Cursor = dict[tuple[int, int], tuple[datetime, int]]
"""Per campaign (account_id, campaign_id): the queue position (not_before, delivery_id) of the last
row this worker claimed. A claim starts after it."""


def advance(cursor: Cursor, batch: Sequence[ClaimedDelivery]) -> None:
    """Move each campaign's cursor to the furthest row of ``batch`` (never backwards: rows taken from
    behind it, given back earlier, do not move it)."""
    for delivery in batch:
        if delivery.campaign_id is None or delivery.not_before is None:
            continue
        key = (delivery.account_id, delivery.campaign_id)
        position = (delivery.not_before, delivery.delivery_id)
        current = cursor.get(key)
        if current is None or position > current:
            cursor[key] = position


@dataclass(frozen=True, slots=True)
class Fenced:
    """A row and the attempt (fencing token) its worker claimed it with."""

    account_id: int
    delivery_id: int
    attempt: int


@dataclass(frozen=True, slots=True)
class SentRecord:
    account_id: int
    delivery_id: int
    attempt: int
    message_id: str | None
    sent_at: datetime


@dataclass(frozen=True, slots=True)
class RetryRecord:
    account_id: int
    delivery_id: int
    attempt: int
    delay_seconds: float
    error: str
    uncertain: bool
    counted: bool = True
    """False: a transport-wide failure (see Retry.transport_wide), not counted against the message."""


@dataclass(frozen=True, slots=True)
class FailedRecord:
    account_id: int
    delivery_id: int
    attempt: int
    error: str
    hard_bounce: bool = False
    uncertain: bool = False
    """The last attempt may have been taken by the transport (a give-up after an ambiguous answer)."""


@dataclass(frozen=True, slots=True)
class BuildProgress:
    account_id: int
    campaign_id: int
    examined: int
    inserted: int
    done: bool


def storable(text: str) -> str:
    """``text`` as a PostgreSQL text value can hold it. A server's reply may carry bytes that are
    not UTF-8 (read as lone surrogates) or a NUL: stored as is, they made the record fail, and the
    worker stop, and every worker the re-sent row met after it."""
    if text.isascii() and "\x00" not in text:
        return text
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")


_TEXT_COLUMNS = frozenset({"error", "message_id"})
"""Columns that hold what a transport answered."""
MESSAGE_ID_LIMIT = 500
"""Characters of a provider's message id kept: the id is indexed (webhooks find their delivery by
it), and an index entry holds at most about 2.7 kB. A longer one made the record fail; the worker
took that for an outage and kept the group, so it recorded nothing more while it held its rows."""


def _columns(rows: Sequence[Any], *names: str) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {}
    for name in names:
        values = [getattr(row, name) for row in rows]
        if name in _TEXT_COLUMNS:
            limit = MESSAGE_ID_LIMIT if name == "message_id" else None
            values = [None if value is None else storable(value)[:limit] for value in values]
        columns[f"{name}s"] = values
    return columns


T = TypeVar("T", bound="Fenced | SentRecord | RetryRecord | FailedRecord")


def _in_key_order(rows: Sequence[T]) -> list[T]:
    """Statements that update several rows get them in key order, so two workers' statements on
    overlapping rows (a zombie and its successor) lock them in the same order and cannot deadlock."""
    return sorted(rows, key=lambda row: (row.account_id, row.delivery_id))


KEY_LIFE_MARGIN = 3600.0
"""Seconds taken off a provider's key life: the doubt is dated when the row was re-queued or its
failure recorded, up to a lease after the send itself, and the provider's clock is not ours."""


async def claim_batch(
    conn: Conn,
    *,
    limit: int,
    lease_seconds: float,
    worker: str,
    transport_idempotent: bool,
    key_life: float | None = None,
    after: Cursor | None = None,
    turn: int = 0,
) -> list[ClaimedDelivery]:
    """Claim up to ``limit`` due rows. With ``after`` (the worker's cursor), campaign rows are taken
    after it first, then from the front of the queue if that did not fill the batch; the cursor is
    moved past what was claimed. ``key_life``: how long an idempotent transport remembers a key (see
    :class:`~sendonce.transports.base.Capabilities`); a re-send of a row uncertain for longer than
    that, less :data:`KEY_LIFE_MARGIN`, is written to the ledger. ``turn``: the worker's count of its
    claims, by which the accounts with a campaign sending take turns to be claimed from first."""
    positions = sorted((after or {}).items())
    result = conn.cursor(row_factory=tuple_row)  # its columns are ClaimedDelivery's fields, in order
    await result.execute(
        query("claim_batch"),
        {
            "limit": limit,
            "lease_seconds": lease_seconds,
            "worker": worker,
            "transport_idempotent": transport_idempotent,
            "key_life_seconds": None if key_life is None else max(key_life - KEY_LIFE_MARGIN, 0.0),
            "after_accounts": [key[0] for key, _ in positions],
            "after_campaigns": [key[1] for key, _ in positions],
            "after_not_befores": [position[0] for _, position in positions],
            "after_deliveries": [position[1] for _, position in positions],
            "turn": turn % 2**62,
        },
    )
    batch = [ClaimedDelivery(*row) for row in await result.fetchall()]
    if after is not None:
        advance(after, batch)
    return batch


@dataclass(frozen=True, slots=True)
class Renewal:
    renewed: dict[Key, bool]
    """The rows whose lease was extended: {key: still wanted (its campaign sending, its recipient not
    opted out or suppressed since the claim)}."""
    busy: dict[Key, bool]
    """Rows still held (same attempt, still 'sending') whose lease was not extended this time because
    another transaction held their lock for a moment: not lost, but their deadline stays as it was.
    {key: still wanted}."""


async def renew_leases(conn: Conn, held: Sequence[Fenced], lease_seconds: float) -> Renewal:
    """Extend the leases still held. A row in neither part of the answer is no longer this worker's."""
    if not held:
        return Renewal({}, {})
    held = _in_key_order(held)
    cursor = await conn.execute(
        query("renew_leases"),
        {"lease_seconds": lease_seconds, **_columns(held, "account_id", "delivery_id", "attempt")},
    )
    renewed: dict[Key, bool] = {
        (row["account_id"], row["delivery_id"]): bool(row["campaign_active"]) for row in await cursor.fetchall()
    }
    busy: dict[Key, bool] = {}
    skipped = [h for h in held if (h.account_id, h.delivery_id) not in renewed]
    if skipped:
        cursor = await conn.execute(query("held_busy"), _columns(skipped, "account_id", "delivery_id", "attempt"))
        busy = {
            (row["account_id"], row["delivery_id"]): bool(row["campaign_active"]) for row in await cursor.fetchall()
        }
    cursor = await conn.execute(query("held_unwanted"), _columns(held, "account_id", "delivery_id"))
    for row in await cursor.fetchall():
        key = (row["account_id"], row["delivery_id"])
        for answered in (renewed, busy):
            if key in answered:
                answered[key] = False
    return Renewal(renewed, busy)


async def record_sent(conn: Conn, items: Sequence[SentRecord]) -> set[Key]:
    """Mark accepted messages sent; returns the rows recorded (the others were fenced out)."""
    if not items:
        return set()
    items = _in_key_order(items)
    cursor = await conn.execute(
        query("record_sent"),
        _columns(items, "account_id", "delivery_id", "attempt", "message_id", "sent_at"),
    )
    return {(row["account_id"], row["delivery_id"]) for row in await cursor.fetchall()}


async def record_retry(conn: Conn, items: Sequence[RetryRecord]) -> set[Key]:
    if not items:
        return set()
    items = _in_key_order(items)
    cursor = await conn.execute(
        query("record_retry"),
        {
            **_columns(items, "account_id", "delivery_id", "attempt", "error", "uncertain"),
            "delays": [item.delay_seconds for item in items],
            "uncertain": [item.uncertain for item in items],
            "counted": [item.counted for item in items],
        },
    )
    return {(row["account_id"], row["delivery_id"]) for row in await cursor.fetchall()}


@dataclass(frozen=True, slots=True)
class FailedOutcome:
    recorded: set[Key]
    bounced_campaigns: set[tuple[int, int]]
    """(account_id, campaign_id) of campaigns that got a hard bounce: their bounce rate may be over."""


async def record_failed(conn: Conn, items: Sequence[FailedRecord]) -> FailedOutcome:
    """Mark permanent failures; hard bounces also suppress their address, in the same transaction."""
    if not items:
        return FailedOutcome(set(), set())
    items = _in_key_order(items)
    bounced = {(item.account_id, item.delivery_id) for item in items if item.hard_bounce}
    campaigns: set[tuple[int, int]] = set()
    async with conn.transaction():
        cursor = await conn.execute(
            query("record_failed"),
            {
                **_columns(items, "account_id", "delivery_id", "attempt", "error"),
                "hard_bounces": [item.hard_bounce for item in items],
                "uncertain": [item.uncertain for item in items],
            },
        )
        rows = await cursor.fetchall()
        by_account: dict[int, list[tuple[str, str]]] = {}
        for row in rows:
            if (row["account_id"], row["delivery_id"]) in bounced:
                by_account.setdefault(row["account_id"], []).append((row["email_key"], row["email"]))
                if row["campaign_id"] is not None:
                    campaigns.add((row["account_id"], row["campaign_id"]))
        for account_id, pairs in by_account.items():
            pairs.sort()  # one order of addresses for every recorder: concurrent groups do not deadlock
            await conn.execute(
                query("suppress_bounced"),
                {
                    "account_id": account_id,
                    "email_keys": [p[0] for p in pairs],
                    "emails": [p[1] for p in pairs],
                },
            )
    return FailedOutcome({(row["account_id"], row["delivery_id"]) for row in rows}, campaigns)


async def defer_claims(conn: Conn, items: Sequence[tuple[Fenced, float]]) -> int:
    """Put claimed rows back until ``delay`` seconds from now (a rate limit), fenced."""
    if not items:
        return 0
    items = sorted(items, key=lambda item: (item[0].account_id, item[0].delivery_id))
    cursor = await conn.execute(
        query("defer_claims"),
        {
            **_columns([f for f, _ in items], "account_id", "delivery_id", "attempt"),
            "delays": [delay for _, delay in items],
        },
    )
    return len(await cursor.fetchall())


async def release_claims(conn: Conn, items: Sequence[Fenced]) -> int:
    """Give back claimed rows that were never started; returns how many were still ours."""
    if not items:
        return 0
    items = _in_key_order(items)
    cursor = await conn.execute(query("release_claims"), _columns(items, "account_id", "delivery_id", "attempt"))
    row = await cursor.fetchone()
    return int(row["n"]) if row else 0


async def requeue_expired(conn: Conn, limit: int = 1000) -> list[dict[str, Any]]:
    cursor = await conn.execute(query("requeue_expired"), {"limit": limit})
    return list(await cursor.fetchall())


async def start_due_campaigns(conn: Conn) -> list[Key]:
    cursor = await conn.execute(query("start_due_campaigns"))
    return [(row["account_id"], row["campaign_id"]) for row in await cursor.fetchall()]


BUILD_IDLE = "idle"
"""No recipient list needs building."""
BUILD_BUSY = "busy"
"""A list needs building but its campaign row is locked right now (another builder, or a passing
statement): look again in a moment rather than conclude there is nothing to do."""


async def build_next_chunk(conn: Conn, chunk_size: int) -> BuildProgress | str:
    """Build one chunk of one campaign's recipient list; BUILD_IDLE or BUILD_BUSY when none was built."""
    async with conn.transaction():
        cursor = await conn.execute(query("lock_campaign_to_build"))
        target = await cursor.fetchone()
        if target is None:
            pending = await (await conn.execute(query("lists_to_build"))).fetchone()
            return BUILD_BUSY if pending and pending["pending"] else BUILD_IDLE
        cursor = await conn.execute(
            query("build_chunk"),
            {
                "account_id": target["account_id"],
                "campaign_id": target["campaign_id"],
                "after": target["build_cursor"],
                "chunk_size": chunk_size,
            },
        )
        row = await cursor.fetchone()
        assert row is not None
    return BuildProgress(
        target["account_id"],
        target["campaign_id"],
        int(row["examined"]),
        int(row["inserted"]),
        row["built_at"] is not None,
    )


async def finish_campaigns(conn: Conn) -> list[Key]:
    cursor = await conn.execute(query("finish_campaigns"))
    return [(row["account_id"], row["campaign_id"]) for row in await cursor.fetchall()]


async def next_wakeup(conn: Conn) -> float | None:
    """Seconds until the next piece of work becomes due (may be negative: due now); None: nothing."""
    row = await (await conn.execute(query("next_wakeup"))).fetchone()
    if row is None or row["wait"] is None:
        return None
    return float(row["wait"].total_seconds())


async def open_work(conn: Conn) -> bool:
    row = await (await conn.execute(query("open_work"))).fetchone()
    return bool(row and row["open"])


async def prune(conn: Conn, older_than: timedelta, *, limit: int = 5000) -> list[dict[str, Any]]:
    """Delete one batch of finished rows older than ``older_than``; returns them (for an archive).

    Run inside a transaction if the archive must be written before the rows are gone for good.
    """
    cursor = await conn.execute(query("prune_outbox"), {"older_than": older_than, "limit": limit})
    return list(await cursor.fetchall())


async def prune_idempotency_keys(conn: Conn) -> int:
    cursor = await conn.execute(query("prune_idempotency_keys"))
    return cursor.rowcount
