"""Our own webhook format, for any sender that can make an HTTP request.

``Sendonce-Signature: sha256=<hex>`` is HMAC-SHA256 under ``generic_secret`` of
``"<Sendonce-Timestamp>.<raw body>"``, with ``Sendonce-Timestamp`` in unix seconds; putting the
timestamp inside the MAC is what lets us refuse replays older than the tolerance. The body::

    {"events": [{"id": "...", "type": "hard_bounce", "email": "ann@example.com",
                 "job_id": "campaign:42:7", "occurred_at": "2026-01-02T03:04:05Z",
                 "detail": {"smtp_status": "5.1.1"}}]}

It is validated strictly, unknown fields included: a sender's typo should fail loudly, not be
dropped in silence.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.webhooks import fields
from sendonce.webhooks.events import (
    COMPLAINT,
    DELIVERED,
    HARD_BOUNCE,
    SOFT_BOUNCE,
    UNSUBSCRIBE,
    FeedbackEvent,
    PayloadError,
    SignatureError,
    WebhookConfig,
    not_configured,
)
from sendonce.webhooks.signatures import check_timestamp, require_header, secure_equal

PROVIDER = "generic"
SIGNATURE_HEADER = "sendonce-signature"
TIMESTAMP_HEADER = "sendonce-timestamp"
TYPES = (HARD_BOUNCE, SOFT_BOUNCE, COMPLAINT, DELIVERED, UNSUBSCRIBE)
_EVENT_FIELDS = frozenset({"id", "type", "email", "job_id", "account_id", "occurred_at", "detail"})
_MAX_ID_LENGTH = 200
_MAX_DETAIL_BYTES = 4096


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``Sendonce-Signature`` value for a body: what a sender computes, and what we check."""
    mac = hmac.new(secret.encode("utf-8"), str(timestamp).encode("ascii") + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def parse(headers: Mapping[str, str], body: bytes, config: WebhookConfig, *, now: datetime) -> list[FeedbackEvent]:
    verify_signature(headers, body, config, now=now)
    payload = fields.as_object(fields.parse_json(body, "the payload"), "the payload")
    unknown = sorted(set(payload) - {"events"})
    if unknown:
        raise PayloadError(f"unknown field(s) {', '.join(map(repr, unknown))}: the payload holds only 'events'")
    events: list[FeedbackEvent] = []
    seen: set[str] = set()
    for index, item in enumerate(fields.req_list(payload, "events")):
        event = _event(fields.as_object(item, f"events[{index}]"), f"events[{index}]")
        if event.event_id in seen:
            raise PayloadError(f"events[{index}].id {event.event_id!r} appears twice in one request")
        seen.add(event.event_id)
        events.append(event)
    return events


def verify_signature(headers: Mapping[str, str], body: bytes, config: WebhookConfig, *, now: datetime) -> None:
    if not config.generic_secret:
        raise not_configured(PROVIDER)
    signature = require_header(headers, SIGNATURE_HEADER)
    timestamp = require_header(headers, TIMESTAMP_HEADER)
    check_timestamp(timestamp, name=TIMESTAMP_HEADER, now=now, tolerance_seconds=config.tolerance_seconds)
    if not signature.startswith("sha256="):
        raise SignatureError(f"{SIGNATURE_HEADER} must be 'sha256=<hex>'")
    expected = sign(config.generic_secret, int(timestamp), body)
    # Hex is case-insensitive; the comparison itself is constant-time.
    if not secure_equal("sha256=" + signature.removeprefix("sha256=").lower(), expected):
        raise SignatureError(f"{SIGNATURE_HEADER} is invalid")


def _event(item: Mapping[str, Any], path: str) -> FeedbackEvent:
    unknown = sorted(set(item) - _EVENT_FIELDS)
    if unknown:
        raise PayloadError(
            f"{path} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(_EVENT_FIELDS))}"
        )
    event_id = fields.req_str(item, "id", path)
    if len(event_id) > _MAX_ID_LENGTH:
        raise PayloadError(f"{path}.id is longer than {_MAX_ID_LENGTH} characters")
    kind = fields.req_str(item, "type", path)
    if kind not in TYPES:
        raise PayloadError(f"{path}.type {kind[:64]!r} is not one of {', '.join(TYPES)}")
    email = fields.req_str(item, "email", path)
    job_id = fields.opt_str(item, "job_id", path)
    if job_id is None:
        # Named by its address alone, so the address must parse: such an event suppressed nobody, and
        # once recorded under its id, the corrected event was taken for a replay. (With a job id, the
        # delivery names the address, whatever the event's says.)
        try:
            parse_address(email)
        except InvalidAddress as exc:
            raise PayloadError(f"{path}.email is not an email address: {exc}") from None
    account = item.get("account_id")
    if account is not None and (isinstance(account, bool) or not isinstance(account, int) or not 1 <= account < 2**63):
        raise PayloadError(f"{path}.account_id must be a positive integer")
    occurred = fields.opt_str(item, "occurred_at", path)
    occurred_at = None
    if occurred is not None:
        occurred_at = fields.parse_iso_time(occurred, f"{path}.occurred_at", require_offset=True)
    info = fields.opt_object(item, "detail", path) or {}
    try:
        # surrogatepass: a lone surrogate is measured, not refused (it is stored replaced)
        size = len(json.dumps(info, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except RecursionError:
        raise PayloadError(f"{path}.detail is nested too deeply") from None
    if size > _MAX_DETAIL_BYTES:
        raise PayloadError(f"{path}.detail is larger than {_MAX_DETAIL_BYTES} bytes")
    return FeedbackEvent(
        provider=PROVIDER,
        event_id=event_id,
        kind=kind,
        email=email,
        job_id=job_id,
        provider_message_id=None,
        occurred_at=occurred_at,
        detail=info,
        account_id=account,
    )
