"""Alerts: abnormal retry patterns, campaign bounce thresholds. Recorded once per episode."""

from __future__ import annotations

from typing import Any

from psycopg.types.json import Jsonb

from sendonce.store.database import Conn
from sendonce.store.queries import query


async def raise_alert(
    conn: Conn, account_id: int, kind: str, subject: str, episode: str, detail: dict[str, Any]
) -> dict[str, Any] | None:
    """Record an alert; returns it when it is new, None when this episode was already flagged."""
    cursor = await conn.execute(
        query("raise_alert"),
        {"account_id": account_id, "kind": kind, "subject": subject, "episode": episode, "detail": Jsonb(detail)},
    )
    row = await cursor.fetchone()
    if row is None:
        return None
    return {"id": row["alert_id"], "kind": kind, "subject": subject, "detail": detail, "created_at": row["created_at"]}


async def list_alerts(conn: Conn, account_id: int, limit: int = 100) -> list[dict[str, Any]]:
    cursor = await conn.execute(query("list_alerts"), {"account_id": account_id, "limit": limit})
    return [
        {
            "id": r["alert_id"],
            "kind": r["kind"],
            "subject": r["subject"],
            "detail": r["detail"],
            "created_at": r["created_at"],
        }
        for r in await cursor.fetchall()
    ]
