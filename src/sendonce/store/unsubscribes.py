"""Unsubscribing from what a campaign was sent to, and the way back."""

from __future__ import annotations

from typing import Any

from sendonce.store.database import Conn
from sendonce.store.queries import query
from sendonce.store.subscribers import ConfirmUrl, enqueue_confirmations

RESUBSCRIBE_WITHIN = 86400.0
"""Seconds after an unsubscribe during which the page's link may undo it ("I unsubscribed by
mistake"). The link never expires and is in every forwarded copy of the mail: past this, it only asks
the address to confirm (:func:`rejoin`)."""


async def unsubscribe(conn: Conn, account_id: int, subscriber_id: int, campaign_id: int) -> list[int]:
    """Leave the campaign's lists; returns the lists left now (empty when already done)."""
    params = {"account_id": account_id, "subscriber_id": subscriber_id, "campaign_id": campaign_id}
    return [
        int(r["list_id"]) for r in await (await conn.execute(query("unsubscribe_campaign_lists"), params)).fetchall()
    ]


async def resubscribe(conn: Conn, account_id: int, subscriber_id: int, campaign_id: int) -> list[int]:
    """Undo an unsubscribe from the campaign's lists made within :data:`RESUBSCRIBE_WITHIN`; returns
    the lists joined again (empty: nothing recent to undo)."""
    params = {
        "account_id": account_id,
        "subscriber_id": subscriber_id,
        "campaign_id": campaign_id,
        "within_seconds": RESUBSCRIBE_WITHIN,
    }
    return [
        int(r["list_id"]) for r in await (await conn.execute(query("resubscribe_campaign_lists"), params)).fetchall()
    ]


async def rejoin(
    conn: Conn, account_id: int, subscriber_id: int, campaign_id: int, confirm_url: ConfirmUrl
) -> list[int]:
    """For the campaign's lists left longer ago than :data:`RESUBSCRIBE_WITHIN`: pending again, and a
    confirmation mail to the address (queued here, in the caller's transaction); returns those lists."""
    params = {
        "account_id": account_id,
        "subscriber_id": subscriber_id,
        "campaign_id": campaign_id,
        "within_seconds": RESUBSCRIBE_WITHIN,
    }
    rows = await (await conn.execute(query("rejoin_campaign_lists"), params)).fetchall()
    pending = [(int(r["list_id"]), int(r["subscriber_id"]), int(r["optin_round"])) for r in rows]
    if pending:
        await enqueue_confirmations(conn, account_id, pending, confirm_url)
    return [p[0] for p in pending]


async def state(conn: Conn, account_id: int, subscriber_id: int, campaign_id: int) -> list[dict[str, Any]]:
    params = {
        "account_id": account_id,
        "subscriber_id": subscriber_id,
        "campaign_id": campaign_id,
        "within_seconds": RESUBSCRIBE_WITHIN,
    }
    return list(await (await conn.execute(query("subscription_state"), params)).fetchall())
