"""Campaigns: creation, compare-and-set transitions, and counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sendonce.domain.states import CampaignStatus, DeliveryStatus
from sendonce.store.database import Conn
from sendonce.store.queries import query


@dataclass(frozen=True, slots=True)
class Campaign:
    account_id: int
    campaign_id: int
    name: str
    subject: str
    text_body: str
    html_body: str | None
    from_email: str
    from_name: str | None
    status: CampaignStatus
    scheduled_for: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    built_at: datetime | None
    created_at: datetime
    template_id: int | None = None
    paused_reason: str | None = None
    list_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Campaign:
        return cls(**{**row, "status": CampaignStatus(row["status"]), "list_ids": list(row["list_ids"])})


@dataclass(frozen=True, slots=True)
class CampaignCounts:
    total: int
    queued: int
    sending: int
    sent: int
    suppressed: int
    failed: int
    possible_duplicate: int
    possibly_delivered: int = 0
    """Among suppressed and failed: rows an earlier attempt of which may have reached the recipient."""


@dataclass(frozen=True, slots=True)
class TransitionResult:
    """The outcome of a compare-and-set: ``won`` is False when the campaign was not in a source state."""

    won: bool
    status: CampaignStatus | None
    """The status after a win; the status that made the CAS lose otherwise (None: no such campaign)."""
    scheduled_for: datetime | None = None


async def create_campaign(
    conn: Conn,
    *,
    account_id: int,
    name: str,
    subject: str,
    text_body: str,
    html_body: str | None,
    from_email: str,
    from_name: str | None,
    list_ids: list[int],
    template_id: int | None = None,
    max_bounce_rate: float | None = None,
    max_complaint_rate: float | None = None,
) -> int:
    async with conn.transaction():
        cursor = await conn.execute(
            query("create_campaign"),
            {
                "account_id": account_id,
                "name": name,
                "subject": subject,
                "text_body": text_body,
                "html_body": html_body,
                "from_email": from_email,
                "from_name": from_name,
                "template_id": template_id,
                "max_bounce_rate": max_bounce_rate,
                "max_complaint_rate": max_complaint_rate,
            },
        )
        row = await cursor.fetchone()
        assert row is not None
        campaign_id = int(row["campaign_id"])
        await conn.execute(
            query("add_campaign_lists"),
            {"account_id": account_id, "campaign_id": campaign_id, "list_ids": sorted(set(list_ids))},
        )
    return campaign_id


async def get_campaign(conn: Conn, account_id: int, campaign_id: int) -> Campaign | None:
    cursor = await conn.execute(query("get_campaign"), {"account_id": account_id, "campaign_id": campaign_id})
    row = await cursor.fetchone()
    return Campaign.from_row(row) if row else None


_TRANSITION_QUERIES = {
    "approve": "approve_campaign",
    "pause": "pause_campaign",
    "resume": "resume_campaign",
    "cancel": "cancel_campaign",
}


async def transition(
    conn: Conn, account_id: int, campaign_id: int, action: str, *, scheduled_for: datetime | None = None
) -> TransitionResult:
    """Run one compare-and-set transition. Never reads the status to decide: the UPDATE's WHERE does."""
    params: dict[str, Any] = {"account_id": account_id, "campaign_id": campaign_id}
    if action == "approve":
        params["scheduled_for"] = scheduled_for
    cursor = await conn.execute(query(_TRANSITION_QUERIES[action]), params)
    row = await cursor.fetchone()
    if row is not None:
        if action in ("approve", "resume"):
            await conn.execute("SELECT pg_notify('sendonce_work', 'campaign')")
        return TransitionResult(True, CampaignStatus(row["status"]), row["scheduled_for"])
    # Lost: read the status only to explain why.
    cursor = await conn.execute(query("campaign_status"), {"account_id": account_id, "campaign_id": campaign_id})
    current = await cursor.fetchone()
    return TransitionResult(False, CampaignStatus(current["status"]) if current else None)


async def campaign_counts(conn: Conn, account_id: int, campaign_id: int) -> CampaignCounts:
    params = {"account_id": account_id, "campaign_id": campaign_id}
    row = await (await conn.execute(query("campaign_counts"), params)).fetchone()
    assert row is not None
    by_status = {status.value: int(row[status.value]) for status in DeliveryStatus}
    return CampaignCounts(
        total=sum(by_status.values()),
        possible_duplicate=int(row["possible_duplicate"]),
        possibly_delivered=int(row["possibly_delivered"]),
        **by_status,
    )


async def list_possible_duplicates(
    conn: Conn, account_id: int, campaign_id: int | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    cursor = await conn.execute(
        query("list_possible_duplicates"),
        {"account_id": account_id, "campaign_id": campaign_id, "limit": limit},
    )
    return list(await cursor.fetchall())


async def recipients_missing_attributes(
    conn: Conn, account_id: int, campaign_id: int, keys: list[str], limit: int = 1000
) -> list[dict[str, Any]]:
    cursor = await conn.execute(
        query("recipients_missing_attributes"),
        {"account_id": account_id, "campaign_id": campaign_id, "keys": keys, "limit": limit},
    )
    return list(await cursor.fetchall())
