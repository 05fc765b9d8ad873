"""Resend webhooks, signed by Svix.

The signature is HMAC-SHA256, keyed with the base64 part of the ``whsec_`` secret, over
``"<svix-id>.<svix-timestamp>.<raw body>"``; ``svix-signature`` holds one or more space-separated
``v1,<base64>`` values (several during a secret rotation). The timestamp is inside the MAC, so
refusing old timestamps refuses replays of captured requests.

``svix-id`` identifies the message and is kept across Svix's retries: it is the event id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sendonce.domain.jobs import JOB_ID_HEADER
from sendonce.webhooks import fields
from sendonce.webhooks.events import (
    COMPLAINT,
    DELIVERED,
    HARD_BOUNCE,
    OTHER,
    SOFT_BOUNCE,
    FeedbackEvent,
    SignatureError,
    WebhookConfig,
    not_configured,
)
from sendonce.webhooks.signatures import check_timestamp, require_header, secure_equal

PROVIDER = "resend"
_SECRET_PREFIX = "whsec_"  # noqa: S105 (the prefix, not a secret)
_JOB_ID_TAGS = ("sendonce-job-id", "sendonce_job_id")
_HARD = frozenset({"permanent", "hard"})


def parse(headers: Mapping[str, str], body: bytes, config: WebhookConfig, *, now: datetime) -> list[FeedbackEvent]:
    svix_id = verify_svix(headers, body, config, now=now)
    payload = fields.as_object(fields.parse_json(body, "the Resend payload"), "the Resend payload")
    event_type = fields.req_str(payload, "type")
    data = fields.req_object(payload, "data")
    occurred_at = fields.opt_iso_time(payload, "created_at")

    if event_type == "email.bounced":
        bounce = fields.opt_object(data, "bounce", "data") or {}
        bounce_type = fields.opt_str(bounce, "type", "data.bounce")
        # Resend documents email.bounced as a permanent rejection; the bounce type refines it when present.
        kind = HARD_BOUNCE if bounce_type is None or bounce_type.lower() in _HARD else SOFT_BOUNCE
        info = fields.detail(
            bounce_type=bounce_type,
            bounce_subtype=fields.opt_str(bounce, "subType", "data.bounce"),
            message=fields.opt_str(bounce, "message", "data.bounce"),
        )
    elif event_type == "email.complained":
        kind, info = COMPLAINT, {}
    elif event_type == "email.delivered":
        kind, info = DELIVERED, {}
    else:
        kind, info = OTHER, fields.detail(type=event_type)

    recipients = _recipients(data)
    job_id = _job_id(data)
    message_id = fields.opt_id(data, "email_id", "data")
    if not recipients:
        targets: list[tuple[str | None, str]] = [(None, svix_id)]
    elif len(recipients) == 1:
        targets = [(recipients[0], svix_id)]
    else:
        # One Svix message naming several recipients: one event each, each with its own id.
        targets = [(email, f"{svix_id}:{email}") for email in dict.fromkeys(recipients)]
    return [
        FeedbackEvent(
            provider=PROVIDER,
            event_id=event_id,
            kind=kind,
            email=email,
            job_id=job_id,
            provider_message_id=message_id,
            occurred_at=occurred_at,
            detail=info,
        )
        for email, event_id in targets
    ]


def verify_svix(headers: Mapping[str, str], body: bytes, config: WebhookConfig, *, now: datetime) -> str:
    """Check the Svix signature and timestamp; return the message id (``svix-id``)."""
    if not config.resend_secret:
        raise not_configured(PROVIDER)
    key = _secret_key(config.resend_secret)
    # Svix also sends the Standard Webhooks names (webhook-id, ...) for the same values.
    prefix = "webhook" if "webhook-signature" in headers and "svix-signature" not in headers else "svix"
    msg_id = require_header(headers, f"{prefix}-id")
    timestamp = require_header(headers, f"{prefix}-timestamp")
    signatures = require_header(headers, f"{prefix}-signature")
    check_timestamp(timestamp, name=f"{prefix}-timestamp", now=now, tolerance_seconds=config.tolerance_seconds)

    signed = msg_id.encode("utf-8") + b"." + timestamp.encode("ascii") + b"." + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")
    matched = False
    for candidate in signatures.split():
        version, _, value = candidate.partition(",")
        # Compare every v1 candidate (no early exit), so timing says nothing about which one matched.
        if version == "v1" and secure_equal(value, expected):
            matched = True
    if not matched:
        raise SignatureError("svix signature is invalid")
    return msg_id


def _secret_key(secret: str) -> bytes:
    encoded = secret.strip().removeprefix(_SECRET_PREFIX)
    encoded += "=" * (-len(encoded) % 4)  # tolerate a secret pasted without its padding
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not key:
        raise SignatureError("webhook secret for resend is not a valid whsec_<base64> secret")
    return key


def _recipients(data: Mapping[str, Any]) -> list[str]:
    to = data.get("to")
    if to is None:
        return []
    if isinstance(to, str):
        return [to]
    return [fields.as_str(item, f"data.to[{index}]") for index, item in enumerate(fields.as_list(to, "data.to"))]


def _job_id(data: Mapping[str, Any]) -> str | None:
    """Our header if Resend echoes headers (object or list of {name, value}); else a tag."""
    headers = data.get("headers")
    if isinstance(headers, dict):
        value = fields.lookup_ci(headers, JOB_ID_HEADER)
    elif headers is not None:
        value = fields.header_from_list(headers, JOB_ID_HEADER, "data.headers")
    else:
        value = None
    job_id = fields.job_id_value(value, f"data.headers.{JOB_ID_HEADER}")
    if job_id is not None:
        return job_id
    tags = data.get("tags")
    if tags is None:
        return None
    for name in _JOB_ID_TAGS:
        if isinstance(tags, dict):
            value = fields.lookup_ci(tags, name)
        else:
            value = fields.header_from_list(tags, name, "data.tags")
        job_id = fields.job_id_value(value, f"data.tags.{name}")
        if job_id is not None:
            return job_id
    return None
