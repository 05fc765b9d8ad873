"""SendGrid's Signed Event Webhook.

SendGrid signs ``<X-Twilio-Email-Event-Webhook-Timestamp><raw body>`` with ECDSA P-256 / SHA-256;
the signature (base64, DER-encoded) is in ``X-Twilio-Email-Event-Webhook-Signature``, and the public
verification key is shown in the webhook's settings (base64 DER ``SubjectPublicKeyInfo``). The body
is a JSON array of events; SendGrid flattens a message's custom args (``unique_args``) into each
event, which is how ``sendonce_job_id`` comes back.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sendonce.webhooks import fields
from sendonce.webhooks.events import (
    COMPLAINT,
    DELIVERED,
    HARD_BOUNCE,
    OTHER,
    SOFT_BOUNCE,
    UNSUBSCRIBE,
    FeedbackEvent,
    SignatureError,
    WebhookConfig,
    not_configured,
)
from sendonce.webhooks.signatures import check_timestamp, require_header

PROVIDER = "sendgrid"
SIGNATURE_HEADER = "x-twilio-email-event-webhook-signature"
TIMESTAMP_HEADER = "x-twilio-email-event-webhook-timestamp"
JOB_ID_ARG = "sendonce_job_id"


def parse(headers: Mapping[str, str], body: bytes, config: WebhookConfig, *, now: datetime) -> list[FeedbackEvent]:
    verify_signature(headers, body, config, now=now)
    items = fields.as_list(fields.parse_json(body, "the SendGrid payload"), "the SendGrid payload")
    events: list[FeedbackEvent] = []
    for index, item in enumerate(items):
        events.append(_event(fields.as_object(item, f"[{index}]"), f"[{index}]"))
    return events


def verify_signature(headers: Mapping[str, str], body: bytes, config: WebhookConfig, *, now: datetime) -> None:
    if not config.sendgrid_public_key:
        raise not_configured(PROVIDER)
    public_key = load_public_key(config.sendgrid_public_key)
    signature_b64 = require_header(headers, SIGNATURE_HEADER)
    timestamp = require_header(headers, TIMESTAMP_HEADER)
    check_timestamp(timestamp, name=TIMESTAMP_HEADER, now=now, tolerance_seconds=config.tolerance_seconds)
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("sendgrid signature is not valid base64") from None
    try:
        public_key.verify(signature, timestamp.encode("ascii") + body, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SignatureError("sendgrid signature is invalid") from None


def load_public_key(text: str) -> ec.EllipticCurvePublicKey:
    """The verification key as SendGrid shows it (base64 DER), or PEM."""
    try:
        if "-----BEGIN" in text:
            key = serialization.load_pem_public_key(text.strip().encode("ascii"))
        else:
            key = serialization.load_der_public_key(base64.b64decode("".join(text.split()), validate=True))
    except (ValueError, binascii.Error, UnsupportedAlgorithm):
        raise SignatureError("webhook secret for sendgrid is not a valid public key (base64 DER or PEM)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SignatureError("webhook secret for sendgrid is not an ECDSA P-256 public key")
    return key


def _event(item: Mapping[str, Any], path: str) -> FeedbackEvent:
    event = fields.req_str(item, "event", path)
    reason = fields.opt_str(item, "reason", path)
    bounce_type = fields.opt_str(item, "type", path)
    if event == "bounce":
        # "blocked": refused for now (reputation, content, rate); "bounce" (or no type): the address failed.
        kind = SOFT_BOUNCE if bounce_type == "blocked" else HARD_BOUNCE
    elif event == "dropped":
        # Dropped before sending, for a list SendGrid keeps the address on: its bounces, its spam
        # reports, its unsubscribes (an opt-out it took and we may not have heard of).
        dropped = (reason or "").lower()
        if "bounced address" in dropped:
            kind = HARD_BOUNCE
        elif "spam reporting address" in dropped:
            kind = COMPLAINT
        elif "unsubscribed address" in dropped:
            kind = UNSUBSCRIBE
        else:
            kind = OTHER
    elif event == "spamreport":
        kind = COMPLAINT
    elif event in ("unsubscribe", "group_unsubscribe"):
        # through SendGrid's own link (subscription tracking, an unsubscribe group): an opt-out, taken
        # for the whole account (sendonce's lists are not SendGrid's groups)
        kind = UNSUBSCRIBE
    elif event == "delivered":
        kind = DELIVERED
    else:
        # processed, deferred (SendGrid is still retrying), open, click, group_resubscribe: no opt-out.
        kind = OTHER
    status = item.get("status")
    return FeedbackEvent(
        provider=PROVIDER,
        event_id=fields.req_id(item, "sg_event_id", path),
        kind=kind,
        email=fields.req_str(item, "email", path),
        job_id=fields.job_id_value(item.get(JOB_ID_ARG), f"{path}.{JOB_ID_ARG}"),
        provider_message_id=fields.opt_id(item, "sg_message_id", path),
        occurred_at=fields.opt_unix_time(item, "timestamp", path),
        detail=fields.detail(
            event=event,
            type=bounce_type,
            reason=reason,
            status=status if isinstance(status, str | int) and not isinstance(status, bool) else None,
            response=fields.opt_str(item, "response", path),
            bounce_classification=fields.opt_str(item, "bounce_classification", path),
        ),
    )
