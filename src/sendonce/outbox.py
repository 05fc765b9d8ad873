"""Enqueue transactional mail inside your own PostgreSQL transaction: the transactional outbox.

An application that shares the database with sendonce writes the mail's outbox row on its own
connection, in its own transaction, next to its own writes::

    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("INSERT INTO orders ...")
        sendonce.outbox.enqueue(
            conn,
            account_id=1,
            to="ann@example.com",
            subject="Your order",
            text="Thanks!",
            key=f"order-confirmation:{order_id}",
        )

The mail exists if and only if that transaction commits: no mail for an order that rolled back, and
no order without its mail when the process dies between the two. A sendonce worker picks the row up
(NOTIFY wakes it at commit) and sends it through the same pipeline as every other mail. ``key`` is
your idempotency key: enqueueing the same key twice queues one message (the second call returns
``created=False``), for as long as the message's outbox row exists: ``sendonce outbox prune`` forgets
the keys of the rows it removes, so prune only rows older than any retry of yours. ``enqueue_async``
does the same on a ``psycopg.AsyncConnection``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from sendonce.domain.addresses import parse_address
from sendonce.domain.message import is_header_name, is_reserved_header
from sendonce.errors import InvalidInput
from sendonce.store.queries import query

__all__ = ["Enqueued", "enqueue", "enqueue_async", "message_job_id"]


@dataclass(frozen=True, slots=True)
class Enqueued:
    job_id: str
    delivery_id: int | None
    created: bool
    """False: a message with this key was enqueued before; nothing new was queued."""


def message_job_id(account_id: int, key: str) -> str:
    """The job id of a message enqueued with ``key``: the same key always gives the same id."""
    digest = hashlib.sha256(f"{account_id}\x1f{key}".encode()).hexdigest()[:40]
    return f"message:{digest}"


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _params(
    *,
    account_id: int,
    to: str,
    subject: str,
    text: str,
    html: str | None,
    key: str,
    priority: int,
    headers: dict[str, str] | None,
    not_before: datetime | None,
) -> dict[str, Any]:
    texts = {"key": key, "to": to, "subject": subject, "text": text, "html": html}
    texts |= {  # a header's value that is not text is refused below, with the header rules
        f"the {name} header's value": value for name, value in (headers or {}).items() if isinstance(value, str)
    }
    for what, value in texts.items():
        if value is None and what == "html":
            continue
        # PostgreSQL refuses a NUL or a lone surrogate in text, failing the caller's whole transaction:
        # refused here instead, before anything is written
        if not isinstance(value, str):
            raise InvalidInput(f"{what} must be a string, not {type(value).__name__}")
        if "\x00" in value or not _encodable(value):
            raise InvalidInput(f"{what} holds a NUL or a lone surrogate, which cannot be stored")
    if not key or len(key) > 255:
        raise InvalidInput("key must be a non-empty string of at most 255 characters")
    if not subject or not text:
        raise InvalidInput("subject and text are required")
    if not 0 <= priority <= 99:
        raise InvalidInput("priority must be within 0..99 (campaign mail is 100)")
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not is_header_name(name) or len(name) > 76:
            raise InvalidInput(
                f"{name!r} is not a header name (printable ASCII, no space, no colon, at most 76 characters)"
            )
        if is_reserved_header(name):
            raise InvalidInput(f"the {name} header is written by sendonce")
        if not isinstance(value, str) or "\r" in value or "\n" in value:
            raise InvalidInput(f"the {name} header's value must be text on one line")
    address = parse_address(to)
    return {
        "account_id": account_id,
        "job_id": message_job_id(account_id, key),
        "priority": priority,
        "email": address.given,
        "email_key": address.key,
        "payload": Jsonb({"subject": subject, "text": text, "html": html, "headers": headers or {}, "key": key}),
        "not_before": not_before,
    }


def enqueue(
    conn: psycopg.Connection[Any],
    *,
    account_id: int,
    to: str,
    subject: str,
    text: str,
    key: str,
    html: str | None = None,
    priority: int = 10,
    headers: dict[str, str] | None = None,
    not_before: datetime | None = None,
) -> Enqueued:
    """Write the message's outbox row on ``conn``, in the caller's current transaction."""
    params = _params(
        account_id=account_id,
        to=to,
        subject=subject,
        text=text,
        html=html,
        key=key,
        priority=priority,
        headers=headers,
        not_before=not_before,
    )
    row = conn.execute(query("enqueue_message"), params).fetchone()
    delivery_id = _first(row)
    return Enqueued(params["job_id"], delivery_id, delivery_id is not None)


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    *,
    account_id: int,
    to: str,
    subject: str,
    text: str,
    key: str,
    html: str | None = None,
    priority: int = 10,
    headers: dict[str, str] | None = None,
    not_before: datetime | None = None,
) -> Enqueued:
    """The same as :func:`enqueue`, on an async connection."""
    params = _params(
        account_id=account_id,
        to=to,
        subject=subject,
        text=text,
        html=html,
        key=key,
        priority=priority,
        headers=headers,
        not_before=not_before,
    )
    row = await (await conn.execute(query("enqueue_message"), params)).fetchone()
    delivery_id = _first(row)
    return Enqueued(params["job_id"], delivery_id, delivery_id is not None)


def _first(row: Any) -> int | None:
    # Works whatever row factory the caller's connection uses.
    if row is None:
        return None
    if isinstance(row, dict):
        return int(next(iter(row.values())))
    if isinstance(row, tuple | list):
        return int(row[0])
    return int(row.delivery_id)
