"""The audit view of an account's outbox, and its alerts."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.problems import Problem
from sendonce.domain.keys import SIGNUP_EVENT
from sendonce.store import alerts
from sendonce.store.queries import query

router = APIRouter(tags=["outbox"])

EVENTS = {
    SIGNUP_EVENT: SIGNUP_EVENT,
    "list_confirmation_requested": "list_confirmation_requested",
    "message": "message",
    "campaign": "campaign",
}


def _cursor(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        decoded = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode()
        kind, _, number = decoded.partition(":")
        if kind != "d" or not number.isdigit():
            raise ValueError
        return int(number)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Problem(422, "cursor is not valid (use the next_cursor of a previous page)") from None


def _encode(delivery_id: int) -> str:
    return base64.urlsafe_b64encode(f"d:{delivery_id}".encode()).decode().rstrip("=")


@router.get("/v1/outbox")
async def list_outbox(
    account: CurrentAccount,
    conn: Db,
    event: Annotated[str | None, Query(description=f"one of {', '.join(EVENTS)}")] = None,
    since: Annotated[datetime | None, Query()] = None,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    """Outbox events with their state, newest first. Rows are never deleted by sending: sent_at,
    attempts and the transport's message id stay for audit (``sendonce outbox prune`` removes old ones)."""
    if event is not None and event not in EVENTS:
        raise Problem(422, f"event must be one of {', '.join(EVENTS)}")
    rows = await (
        await conn.execute(
            query("list_outbox"),
            {
                "account_id": account.account_id,
                "kind": event,
                "since": since,
                "before": _cursor(cursor),
                "limit": limit,
            },
        )
    ).fetchall()
    items = [
        {
            "id": r["delivery_id"],
            "job_id": r["job_id"],
            "event": r["kind"],
            "status": r["status"],
            "email": r["email"],
            "campaign_id": r["campaign_id"],
            "attempts": r["attempt"],
            "failures": r["failures"],
            "created_at": r["created_at"],
            "sent_at": r["sent_at"],
            "transport_message_id": r["transport_message_id"],
            "last_error": r["last_error"],
        }
        for r in rows
    ]
    next_cursor = _encode(rows[-1]["delivery_id"]) if len(rows) == limit else None
    return {"items": items, "next_cursor": next_cursor}


@router.get("/v1/alerts")
async def list_alerts(
    account: CurrentAccount, conn: Db, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    """Abnormal patterns flagged for this account (replay bursts, many sources for one address, ...)."""
    return {"items": await alerts.list_alerts(conn, account.account_id, limit)}
