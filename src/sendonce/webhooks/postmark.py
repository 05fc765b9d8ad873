"""Postmark webhooks.

Postmark does not sign its webhooks; it offers HTTP Basic auth in the webhook URL
(``https://user:token@host/...``) and custom headers. We therefore require a shared secret, as the
Basic auth password (any user name) or in ``X-Sendonce-Webhook-Token``, compared in constant time.
Without a signature over the body and a timestamp, anyone who learns the token can forge and
replay events: keep it long and random, and the URL on https.

One record per request, its kind in ``RecordType``. Bounces and spam complaints are bounce records
with a numeric ``ID``, which is the event id; other records have no id of their own, so theirs is
made of the message id, the record type and (for the kinds that can repeat) the record's time.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from sendonce.domain.jobs import JOB_ID_HEADER
from sendonce.webhooks import fields
from sendonce.webhooks.events import (
    COMPLAINT,
    DELIVERED,
    HARD_BOUNCE,
    OTHER,
    SOFT_BOUNCE,
    UNSUBSCRIBE,
    FeedbackEvent,
    PayloadError,
    SignatureError,
    WebhookConfig,
    not_configured,
)
from sendonce.webhooks.signatures import secure_equal

PROVIDER = "postmark"
TOKEN_HEADER = "x-sendonce-webhook-token"  # noqa: S105 (a header name, not a secret)
_JOB_ID_KEYS = ("sendonce-job-id", "sendonce_job_id")

# Postmark's bounce types (Bounce API). The address does not exist or was deactivated for good:
_SUPPRESSED = {"HardBounce": HARD_BOUNCE, "SpamComplaint": COMPLAINT, "ManualSuppression": UNSUBSCRIBE}
"""A SubscriptionChange's SuppressionReason, when it stops the sending."""
HARD_TYPES = frozenset({"HardBounce", "BadEmailAddress", "ManuallyDeactivated"})
# Delivery failed this time, or the message was refused for its content or the sender's reputation:
SOFT_TYPES = frozenset(
    {
        "Transient",
        "SoftBounce",
        "DnsError",
        "SpamNotification",
        "VirusNotification",
        "Blocked",
        "DMARCPolicy",
        "Unknown",
    }
)
# Everything else (AutoResponder, AddressChange, Subscribe, Unsubscribe, ChallengeVerification,
# OpenRelayTest, Unconfirmed, SMTPApiError, InboundError, TemplateRenderingFailed) is not a bounce.


def parse(headers: Mapping[str, str], body: bytes, config: WebhookConfig) -> list[FeedbackEvent]:
    verify_token(headers, config)
    record = fields.as_object(fields.parse_json(body, "the Postmark payload"), "the Postmark payload")
    record_type = fields.req_str(record, "RecordType")
    message_id = fields.opt_str(record, "MessageID")
    job_id = _job_id(record)

    if record_type in ("Bounce", "SpamComplaint"):
        bounce_type = fields.req_str(record, "Type")
        if record_type == "SpamComplaint" or bounce_type == "SpamComplaint":
            kind = COMPLAINT
        elif bounce_type in HARD_TYPES:
            kind = HARD_BOUNCE
        elif bounce_type in SOFT_TYPES:
            kind = SOFT_BOUNCE
        elif bounce_type == "Unsubscribe":  # TypeCode 16: the recipient asked, by mail, to be removed
            kind = UNSUBSCRIBE
        else:
            kind = OTHER
        inactive = record.get("Inactive")
        return [
            FeedbackEvent(
                provider=PROVIDER,
                event_id=fields.req_id(record, "ID"),
                kind=kind,
                email=fields.req_str(record, "Email"),
                job_id=job_id,
                provider_message_id=message_id,
                occurred_at=fields.opt_iso_time(record, "BouncedAt"),
                detail=fields.detail(
                    type=bounce_type,
                    type_code=record.get("TypeCode") if isinstance(record.get("TypeCode"), int) else None,
                    description=fields.opt_str(record, "Description"),
                    details=fields.opt_str(record, "Details"),
                    inactive=inactive if isinstance(inactive, bool) else None,
                ),
            )
        ]

    if record_type == "Delivery":
        kind, when_key, repeats = DELIVERED, "DeliveredAt", False
        info = fields.detail(details=fields.opt_str(record, "Details"))
    elif record_type in ("Open", "Click"):
        kind, when_key, repeats = OTHER, "ReceivedAt", True
        info = fields.detail(type=record_type)
    elif record_type == "SubscriptionChange":
        # Postmark stopped (or resumed) sending to the address: an unsubscribe through its link or by
        # hand (ManualSuppression), or its own hard bounce or spam complaint. A resume changes nothing
        # here: lifting a suppression is the account's act (DELETE /v1/suppressions/...).
        suppress = record.get("SuppressSending")
        why = fields.opt_str(record, "SuppressionReason")
        kind = _SUPPRESSED.get(why or "", UNSUBSCRIBE) if suppress is True else OTHER
        when_key, repeats = "ChangedAt", True
        info = fields.detail(
            type=record_type,
            suppress_sending=suppress if isinstance(suppress, bool) else None,
            suppression_reason=why,
        )
    else:
        raise PayloadError(f"RecordType {record_type[:64]!r} is not a Postmark webhook record type")

    message = fields.req_str(record, "MessageID")
    occurred_at = fields.opt_iso_time(record, when_key)
    event_id = f"{message}:{record_type}"
    if repeats:  # a message is opened, clicked or (un)subscribed more than once
        event_id += f":{fields.req_str(record, when_key)}"
    return [
        FeedbackEvent(
            provider=PROVIDER,
            event_id=event_id,
            kind=kind,
            email=fields.req_str(record, "Recipient"),
            job_id=job_id,
            provider_message_id=message,
            occurred_at=occurred_at,
            detail=info,
        )
    ]


def verify_token(headers: Mapping[str, str], config: WebhookConfig) -> None:
    if not config.postmark_token:
        raise not_configured(PROVIDER)
    expected = config.postmark_token
    candidates: list[str] = []
    if TOKEN_HEADER in headers:
        candidates.append(headers[TOKEN_HEADER].strip())
    password = _basic_password(headers.get("authorization", ""))
    if password is not None:
        candidates.append(password)
    if not candidates:
        raise SignatureError(
            "postmark webhook token missing: no Basic auth password and no X-Sendonce-Webhook-Token header"
        )
    # Compare every candidate (no early exit), so timing says nothing about which one matched.
    matched = False
    for candidate in candidates:
        if secure_equal(candidate, expected):
            matched = True
    if not matched:
        raise SignatureError("postmark webhook token is invalid")


def _basic_password(authorization: str) -> str | None:
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "basic" or not credentials:
        return None
    # A Basic header that does not decode offers no password: the token header may still hold the
    # right one (a proxy in front may add Authorization of its own), and with neither, the request
    # is refused as missing its token.
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    _user, colon, password = decoded.partition(":")
    return password if colon else None


def _job_id(record: Mapping[str, Any]) -> str | None:
    """``Metadata["sendonce-job-id"]`` (set at send time), else our header if the record lists headers."""
    metadata = fields.opt_object(record, "Metadata")
    if metadata:
        for key in _JOB_ID_KEYS:
            job_id = fields.job_id_value(fields.lookup_ci(metadata, key), f"Metadata.{key}")
            if job_id is not None:
                return job_id
    headers = record.get("Headers")
    if headers is not None:
        value = fields.header_from_list(headers, JOB_ID_HEADER, "Headers", key="Name", value_key="Value")
        return fields.job_id_value(value, f"Headers[{JOB_ID_HEADER}]")
    return None
