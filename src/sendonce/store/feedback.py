"""What the receiving side says: bounces and complaints, and the campaign limits they trip.

* a hard bounce suppresses the address (reason ``bounce``) and marks the subscriber bounced;
* a complaint suppresses at once (reason ``complaint``) and unsubscribes the subscriber;
* so does an unsubscribe the provider took (its own link, its list management; reason ``unsubscribe``);
* soft bounces are counted; ``soft_bounce_limit`` of them within ``soft_bounce_period`` suppress;
* a sending campaign whose bounce or complaint rate passes its limit is paused (CAS) and an alert
  raised, once it has attempted at least ``min_sample`` messages;
* so is a campaign whose sender the transport refuses (a 5xx to MAIL FROM, a provider's 403).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.domain.states import SuppressionReason
from sendonce.store import alerts
from sendonce.store.database import Conn
from sendonce.store.outbox import MESSAGE_ID_LIMIT, storable
from sendonce.store.queries import query
from sendonce.webhooks import FeedbackEvent

SUPPRESSING = {
    "hard_bounce": SuppressionReason.BOUNCE,
    "complaint": SuppressionReason.COMPLAINT,
    "unsubscribe": SuppressionReason.UNSUBSCRIBE,
}
_CAMPAIGN_JOB_ID = re.compile(r"campaign:([0-9]+):[^:]*")
"""``campaign:<campaign_id>:<subscriber_id>``, in ASCII digits: ``str.isdigit`` takes "²", which ``int`` refuses."""
_ACCOUNT_FOREIGN_KEY = "feedback_events_account_id_fkey"
_EVENT_ID_LIMIT = 200
"""Characters of a provider's event id stored as they are: the id is in the events' primary key,
whose entries hold at most about 2.7 kB (an id built from a long message id and address passed it,
and the provider's every retry met the same error)."""


def _event_key(event_id: str) -> str:
    """The event's id as stored: a longer one as its digest, the same for every replay."""
    if len(event_id) <= _EVENT_ID_LIMIT:
        return event_id
    return "sha256:" + hashlib.sha256(event_id.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class FeedbackPolicy:
    max_bounce_rate: float = 0.05
    max_complaint_rate: float = 0.003
    min_sample: int = 100
    soft_bounce_limit: int = 3
    soft_bounce_period: timedelta = timedelta(days=30)


@dataclass(frozen=True, slots=True)
class Ingested:
    new: bool
    """False: seen before (a provider retry), or not attributable to any account."""
    account_id: int | None
    campaign_id: int | None
    suppressed: bool


async def _one(conn: Conn, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
    return await (await conn.execute(query(name), params)).fetchone()


def _storable_json(value: Any) -> Any:
    """``value`` (parsed JSON) with every string, keys included, as PostgreSQL can store it: a NUL or a
    lone surrogate in a remote server's diagnostic made the whole request fail, every time the
    provider retried it, and its bounce was never applied. Without recursion: a generic event's
    detail may be nested as deeply as the JSON parser allowed."""
    root = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        container, key = stack.pop()
        item = container[key]
        if isinstance(item, str):
            container[key] = storable(item)
        elif isinstance(item, dict):
            copy = {storable(k) if isinstance(k, str) else k: v for k, v in item.items()}
            container[key] = copy
            stack.extend((copy, k) for k in copy)
        elif isinstance(item, list):
            copy_list = list(item)
            container[key] = copy_list
            stack.extend((copy_list, i) for i in range(len(copy_list)))
    return root[0]


def _storable_event(event: FeedbackEvent) -> FeedbackEvent:
    """The event with its text as it can be stored (see :func:`_storable_json`): what providers relay
    of remote servers is not ours to refuse."""

    def text(value: str | None) -> str | None:
        return None if value is None else storable(value)

    return replace(
        event,
        event_id=storable(event.event_id),
        email=text(event.email),
        job_id=text(event.job_id),
        provider_message_id=text(event.provider_message_id),
        detail=_storable_json(event.detail),
    )


async def _link(conn: Conn, event: FeedbackEvent) -> dict[str, Any] | None:
    if event.job_id:
        campaign = _CAMPAIGN_JOB_ID.fullmatch(event.job_id)
        # Not past 19 digits: beyond bigint anyway, and int() refuses more than 4300.
        if campaign is not None and (len(campaign[1]) > 19 or int(campaign[1]) >= 2**63):
            return None
        campaign_id = int(campaign[1]) if campaign is not None else None
        row = await _one(conn, "find_delivery_by_job_id", {"job_id": event.job_id, "campaign_id": campaign_id})
        if row is not None:
            return row
    if event.provider_message_id:
        # SendGrid reports "<X-Message-Id>.filter...": the part before the first dot is the id
        for candidate in dict.fromkeys([event.provider_message_id, event.provider_message_id.split(".")[0]]):
            # as the record stored it: a long id is kept to its first MESSAGE_ID_LIMIT characters
            stored = storable(candidate)[:MESSAGE_ID_LIMIT]
            row = await _one(conn, "find_delivery_by_message_id", {"message_id": stored})
            if row is not None:
                return row
    return None


async def ingest(conn: Conn, event: FeedbackEvent, policy: FeedbackPolicy) -> Ingested:
    """Record one provider event, once, and apply its effects (call it inside a transaction).

    The event is linked to its delivery by job id, then by the provider's message id; an event of
    our generic format may name its account instead (inside the signed body). Anything else cannot
    be attributed to an account and is ignored, as is an event naming an account that does not exist.
    """
    event = _storable_event(event)
    delivery = await _link(conn, event)
    owner = delivery["account_id"] if delivery is not None else event.account_id
    if owner is None:
        return Ingested(False, None, None, False)
    email = event.email or (delivery["email"] if delivery is not None else None)  # as reported: kept with the event
    email_key: str | None = None
    suppress_email = email
    if delivery is not None:
        # What bounced is the message we sent, to its recipient, whatever address the provider
        # names: a DSN's Final-Recipient may be a forwarding alias's target (which was suppressed
        # while our subscriber stayed confirmed), or a form that does not parse (nobody suppressed).
        email_key, suppress_email = delivery["email_key"], delivery["email"]
    elif email:
        try:
            email_key = parse_address(email).key
        except InvalidAddress:
            email_key = None
    if delivery is None and email_key is None:
        # Neither its delivery nor an address that parses: it can say nothing about anyone. Not
        # recorded, so that the same event corrected (same id) is not taken for its replay.
        return Ingested(False, None, None, False)
    suppressed = False
    try:
        async with conn.transaction():  # a savepoint inside the caller's transaction
            inserted = await _one(
                conn,
                "insert_feedback_event",
                {
                    "account_id": owner,
                    "provider": event.provider,
                    "event_id": _event_key(event.event_id),
                    "kind": event.kind,
                    "email": email,
                    "email_key": email_key,
                    "job_id": event.job_id,
                    "delivery_id": delivery["delivery_id"] if delivery is not None else None,
                    "occurred_at": event.occurred_at,
                    "detail": Jsonb(event.detail),
                },
            )
            if inserted is None:
                return Ingested(False, owner, delivery["campaign_id"] if delivery else None, False)
            reason = SUPPRESSING.get(event.kind)
            if event.kind == "soft_bounce" and email_key:
                await conn.execute(query("lock_soft_bounces"), {"account_id": owner, "email_key": email_key})
                count = await _one(
                    conn,
                    "count_soft_bounces",
                    {"account_id": owner, "email_key": email_key, "period": policy.soft_bounce_period},
                )
                if count and count["n"] >= policy.soft_bounce_limit:
                    reason = SuppressionReason.BOUNCE
            if reason is not None and email_key:
                await conn.execute(
                    query("add_suppression"),
                    {"account_id": owner, "email_key": email_key, "email": suppress_email, "reason": reason.value},
                )
                await conn.execute(
                    query("set_subscriber_status_for_feedback"),
                    {
                        "account_id": owner,
                        "email_key": email_key,
                        "status": "bounced" if reason is SuppressionReason.BOUNCE else "unsubscribed",
                    },
                )
                suppressed = True
            if delivery is not None and event.kind in ("hard_bounce", "soft_bounce", "complaint"):
                await conn.execute(
                    query("set_delivery_feedback"),
                    {"account_id": owner, "delivery_id": delivery["delivery_id"], "kind": event.kind},
                )
    except psycopg.errors.ForeignKeyViolation as exc:
        if exc.diag.constraint_name != _ACCOUNT_FOREIGN_KEY:
            raise
        # The account an event names itself (generic format) does not exist; a delivery's does. Such an
        # event is as unattributable as one that names no account, and the request's others still count.
        return Ingested(False, None, None, False)
    return Ingested(True, owner, delivery["campaign_id"] if delivery is not None else None, suppressed)


async def check_campaign(
    conn: Conn, account_id: int, campaign_id: int, policy: FeedbackPolicy
) -> dict[str, Any] | None:
    """Pause a sending campaign whose bounce or complaint rate is over its limit; returns the new alert."""
    row = await _one(
        conn,
        "campaign_feedback",
        {
            "account_id": account_id,
            "campaign_id": campaign_id,
            "default_bounce_rate": policy.max_bounce_rate,
            "default_complaint_rate": policy.max_complaint_rate,
        },
    )
    if row is None or row["status"] != "sending" or row["attempted"] < policy.min_sample:
        return None
    attempted = int(row["attempted"])
    bounce_rate = row["bounces"] / attempted
    complaint_rate = row["complaints"] / attempted
    if bounce_rate > row["max_bounce_rate"]:
        reason = f"bounce rate {bounce_rate:.1%} is over its limit of {row['max_bounce_rate']:.1%}"
    elif complaint_rate > row["max_complaint_rate"]:
        reason = f"complaint rate {complaint_rate:.2%} is over its limit of {row['max_complaint_rate']:.2%}"
    else:
        return None
    return await _pause(
        conn,
        account_id,
        campaign_id,
        {"reason": reason, "attempted": attempted, "bounces": row["bounces"], "complaints": row["complaints"]},
    )


async def pause_for_refused_sender(conn: Conn, account_id: int, campaign_id: int, reason: str) -> dict[str, Any] | None:
    """Pause a sending campaign whose sender's mail cannot go out (see ``Retry.sender_wide``: the
    transport refuses the sender, the account's DKIM key cannot be read), rather than fail its rows
    one by one; returns the new alert. Its rows wait, queued, for the resume."""
    return await _pause(conn, account_id, campaign_id, {"reason": storable(reason[:1000]), "sender_refused": True})


async def _pause(conn: Conn, account_id: int, campaign_id: int, detail: dict[str, Any]) -> dict[str, Any] | None:
    # The pause and its alert together: a pause committed alone would leave the campaign paused
    # with no alert, and a retry finds it no longer 'sending'.
    async with conn.transaction():
        paused = await _one(
            conn,
            "pause_campaign_with_reason",
            {"account_id": account_id, "campaign_id": campaign_id, "reason": detail["reason"]},
        )
        if paused is None:  # someone else paused (or finished) it first
            return None
        return await alerts.raise_alert(
            conn,
            account_id,
            "campaign_paused",
            f"campaign:{campaign_id}",
            str(time.time_ns()),
            {"campaign_id": campaign_id, **detail},
        )
