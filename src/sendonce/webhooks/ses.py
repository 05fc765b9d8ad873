"""Amazon SES notifications, delivered over HTTPS by Amazon SNS.

Authenticity comes from the SNS message signature: an RSA signature (SHA-1 for ``SignatureVersion``
1, SHA-256 for 2) over a canonical string of selected fields, verified with the certificate at
``SigningCertURL``. That URL is chosen by whoever sent the request, so it is checked (https, an SNS
host, a ``.pem`` path) *before* anything fetches it: otherwise anyone could sign with their own
certificate, or make us fetch an arbitrary URL. The route fetches over TLS, which is what ties the
certificate to AWS.

Any AWS account can publish validly signed messages to its own topic, so ``sns_topic_arns`` is what
ties the messages to *our* topics; it is checked before the certificate is fetched, as it is cheap.

Inside a verified ``Notification``, ``Message`` is a JSON string holding the SES record, in either
shape SES uses: ``notificationType`` (identity feedback notifications) or ``eventType`` (event
publishing through a configuration set). One event per recipient, as a bounce or complaint can
name several.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import SplitResult, urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

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
    SubscriptionConfirmation,
    WebhookConfig,
)

PROVIDER = "ses"
JOB_ID_TAG = "sendonce-job-id"

NOTIFICATION = "Notification"
CONFIRMATIONS = frozenset({"SubscriptionConfirmation", "UnsubscribeConfirmation"})

# The fields of the string to sign, in the order SNS documents (byte order of the names).
_SIGNED_NOTIFICATION = ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type")
_SIGNED_CONFIRMATION = ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type")
_HASHES: dict[str, Callable[[], hashes.HashAlgorithm]] = {"1": hashes.SHA1, "2": hashes.SHA256}

_HOST_CHARS = re.compile(r"[a-z0-9.-]+")

_BOUNCE_KINDS = {"permanent": HARD_BOUNCE, "transient": SOFT_BOUNCE, "undetermined": SOFT_BOUNCE}


def parse(
    headers: Mapping[str, str],
    body: bytes,
    config: WebhookConfig,
    *,
    now: datetime,
    fetch_certificate: Callable[[str], bytes],
) -> list[FeedbackEvent] | SubscriptionConfirmation:
    envelope = fields.as_object(fields.parse_json(body, "the SNS message"), "the SNS message")
    message_type = fields.req_str(envelope, "Type")
    if message_type != NOTIFICATION and message_type not in CONFIRMATIONS:
        raise PayloadError(f"Type {message_type[:64]!r} is not an SNS message type")
    announced = headers.get("x-amz-sns-message-type")
    if announced is not None and announced != message_type:
        raise PayloadError(f"x-amz-sns-message-type header {announced[:64]!r} does not match Type {message_type!r}")

    topic_arn = fields.req_str(envelope, "TopicArn")
    if config.sns_topic_arns and topic_arn not in config.sns_topic_arns:
        raise SignatureError(f"TopicArn {topic_arn[:256]!r} is not one of the accepted SNS topics")

    verify_sns_signature(envelope, message_type, config, now=now, fetch_certificate=fetch_certificate)

    if message_type in CONFIRMATIONS:
        subscribe_url = fields.req_str(envelope, "SubscribeURL")
        _check_sns_url(subscribe_url, config, what="SubscribeURL", error=PayloadError)
        return SubscriptionConfirmation(topic_arn=topic_arn, subscribe_url=subscribe_url, message_type=message_type)

    sns_message_id = fields.req_str(envelope, "MessageId")
    record = fields.as_object(fields.parse_json(fields.req_str(envelope, "Message"), "Message"), "Message")
    sent_at = fields.opt_iso_time(envelope, "Timestamp")
    return ses_events(record, sns_message_id, sent_at)


# -- the SNS signature ----------------------------------------------------------------------------


def string_to_sign(envelope: Mapping[str, Any], message_type: str) -> bytes:
    """The canonical form SNS signs: ``name\\nvalue\\n`` for each field present, in the documented order."""
    names = _SIGNED_NOTIFICATION if message_type == NOTIFICATION else _SIGNED_CONFIRMATION
    parts: list[str] = []
    for name in names:
        value = envelope.get(name)
        if value is None:
            if name == "Subject":  # the only optional one
                continue
            raise PayloadError(f"{name} is missing")
        parts.append(f"{name}\n{fields.as_str(value, name)}\n")
    try:
        return "".join(parts).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no text SNS signs, nor any UTF-8 it could send
        raise PayloadError("a signed field is not valid Unicode text") from None


def verify_sns_signature(
    envelope: Mapping[str, Any],
    message_type: str,
    config: WebhookConfig,
    *,
    now: datetime,
    fetch_certificate: Callable[[str], bytes],
) -> None:
    version = fields.opt_id(envelope, "SignatureVersion")
    if version is None:
        raise SignatureError("signature missing: no SignatureVersion")
    algorithm = _HASHES.get(version)
    if algorithm is None:
        raise SignatureError(f"SignatureVersion {version[:16]!r} is not supported (1 or 2)")
    signature_b64 = envelope.get("Signature")
    if not isinstance(signature_b64, str) or not signature_b64:
        raise SignatureError("signature missing: no Signature")
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("Signature is not valid base64") from None
    cert_url = envelope.get("SigningCertURL")
    if not isinstance(cert_url, str) or not cert_url:
        raise SignatureError("signature missing: no SigningCertURL")
    _check_sns_url(cert_url, config, what="SigningCertURL", error=SignatureError, pem=True)
    signed = string_to_sign(envelope, message_type)

    pem = fetch_certificate(cert_url)
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise SignatureError("the certificate at SigningCertURL is not a PEM X.509 certificate") from None
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise SignatureError(
            f"the SNS signing certificate is not valid now (valid {certificate.not_valid_before_utc.isoformat()}"
            f" to {certificate.not_valid_after_utc.isoformat()})"
        )
    public_key = certificate.public_key()
    if not isinstance(public_key, rsa.RSAPublicKey):
        raise SignatureError("the SNS signing certificate does not hold an RSA key")
    try:
        public_key.verify(signature, signed, padding.PKCS1v15(), algorithm())
    except InvalidSignature:
        raise SignatureError("SNS signature is invalid") from None


def _check_sns_url(
    url: str, config: WebhookConfig, *, what: str, error: type[PayloadError | SignatureError], pem: bool = False
) -> SplitResult:
    """An https URL on an SNS host, with no user info, no other port, and (for certificates) a .pem path."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise error(f"{what} is not a valid URL") from None
    if parts.scheme != "https":
        raise error(f"{what} must be an https URL")
    host = parts.hostname or ""
    if parts.username is not None or parts.password is not None or port not in (None, 443):
        raise error(f"{what} must not carry user info or a port")
    # fullmatch: the whole host must match even if a configured pattern forgets its anchors.
    if not _HOST_CHARS.fullmatch(host) or not re.fullmatch(config.sns_cert_host_pattern, host):
        raise error(f"{what} host {host[:128]!r} is not an Amazon SNS host")
    if pem and (not parts.path.endswith(".pem") or parts.query or parts.fragment):
        raise error(f"{what} must point to a .pem file")
    return parts


# -- the SES record -------------------------------------------------------------------------------


def ses_events(record: Mapping[str, Any], sns_message_id: str, sent_at: datetime | None) -> list[FeedbackEvent]:
    """Feedback events of one SES record (``notificationType`` or ``eventType`` shape)."""
    if "eventType" in record:
        record_type = fields.req_str(record, "eventType", "Message")
    else:
        record_type = fields.req_str(record, "notificationType", "Message")

    if record_type in ("Bounce", "Complaint", "Delivery"):
        mail = fields.req_object(record, "mail", "Message")
    else:
        # Not all records describe a message: the setup notification SES sends has no "mail".
        mail = fields.opt_object(record, "mail", "Message") or {}
    message_id = fields.opt_str(mail, "messageId", "Message.mail")
    job_id = _job_id(mail)
    mail_time = fields.opt_iso_time(mail, "timestamp", "Message.mail")

    recipients: list[tuple[str | None, str, dict[str, Any]]] = []  # (email, kind, detail)
    if record_type == "Bounce":
        bounce = fields.req_object(record, "bounce", "Message")
        bounce_type = fields.req_str(bounce, "bounceType", "Message.bounce")
        # SES documents three types; an unknown one is treated as temporary, which suppresses nobody.
        kind = _BOUNCE_KINDS.get(bounce_type.lower(), SOFT_BOUNCE)
        occurred_at = fields.opt_iso_time(bounce, "timestamp", "Message.bounce")
        for index, item in enumerate(fields.req_list(bounce, "bouncedRecipients", "Message.bounce")):
            path = f"Message.bounce.bouncedRecipients[{index}]"
            entry = fields.as_object(item, path)
            recipients.append(
                (
                    fields.req_str(entry, "emailAddress", path),
                    kind,
                    fields.detail(
                        bounce_type=bounce_type,
                        bounce_subtype=fields.opt_str(bounce, "bounceSubType", "Message.bounce"),
                        action=fields.opt_str(entry, "action", path),
                        status=fields.opt_str(entry, "status", path),
                        diagnostic_code=fields.opt_str(entry, "diagnosticCode", path),
                        feedback_id=fields.opt_str(bounce, "feedbackId", "Message.bounce"),
                    ),
                )
            )
    elif record_type == "Complaint":
        complaint = fields.req_object(record, "complaint", "Message")
        occurred_at = fields.opt_iso_time(complaint, "timestamp", "Message.complaint")
        feedback_type = fields.opt_str(complaint, "complaintFeedbackType", "Message.complaint")
        # "not-spam" (RFC 5965) is a report that the message is *not* spam, sent to correct an earlier
        # one: recorded, and it suppresses nobody.
        complaint_kind = OTHER if feedback_type == "not-spam" else COMPLAINT
        info = fields.detail(
            feedback_type=feedback_type,
            complaint_subtype=fields.opt_str(complaint, "complaintSubType", "Message.complaint"),
            feedback_id=fields.opt_str(complaint, "feedbackId", "Message.complaint"),
        )
        for index, item in enumerate(fields.req_list(complaint, "complainedRecipients", "Message.complaint")):
            path = f"Message.complaint.complainedRecipients[{index}]"
            address = fields.req_str(fields.as_object(item, path), "emailAddress", path)
            recipients.append((address, complaint_kind, info))
    elif record_type == "Delivery":
        delivery = fields.req_object(record, "delivery", "Message")
        occurred_at = fields.opt_iso_time(delivery, "timestamp", "Message.delivery")
        info = fields.detail(
            smtp_response=fields.opt_str(delivery, "smtpResponse", "Message.delivery"),
            reporting_mta=fields.opt_str(delivery, "reportingMTA", "Message.delivery"),
        )
        for index, item in enumerate(fields.req_list(delivery, "recipients", "Message.delivery")):
            recipients.append((fields.as_str(item, f"Message.delivery.recipients[{index}]"), DELIVERED, info))
    else:
        # Send, Reject, Open, Click, DeliveryDelay, Rendering Failure, Subscription, setup notices:
        # reported as "other" for the record, one per destination when the message is known; but a
        # Subscription that unsubscribes from every topic is an opt-out (SES's list management).
        occurred_at = None
        info = fields.detail(type=record_type)
        kind = OTHER
        if record_type == "Subscription":
            subscription = fields.opt_object(record, "subscription", "Message") or {}
            occurred_at = fields.opt_iso_time(subscription, "timestamp", "Message.subscription")
            preferences = fields.opt_object(subscription, "newTopicPreferences", "Message.subscription") or {}
            if preferences.get("unsubscribeAll") is True:
                kind = UNSUBSCRIBE
                info = fields.detail(
                    type=record_type,
                    contact_list=fields.opt_str(subscription, "contactList", "Message.subscription"),
                    source=fields.opt_str(subscription, "source", "Message.subscription"),
                )
        destination = fields.opt_list(mail, "destination", "Message.mail")
        recipients = [
            (fields.as_str(item, f"Message.mail.destination[{index}]"), kind, info)
            for index, item in enumerate(destination)
        ] or [(None, kind, info)]

    events: list[FeedbackEvent] = []
    seen: set[str] = set()
    for email, kind, info in recipients:
        event_id = f"{sns_message_id}:{email}" if email is not None else sns_message_id
        if event_id in seen:  # a recipient listed twice is one event, not two with one id
            continue
        seen.add(event_id)
        events.append(
            FeedbackEvent(
                provider=PROVIDER,
                event_id=event_id,
                kind=kind,
                email=email,
                job_id=job_id,
                provider_message_id=message_id,
                occurred_at=occurred_at or mail_time or sent_at,
                detail=info,
            )
        )
    return events


def _job_id(mail: Mapping[str, Any]) -> str | None:
    """Our header, as SES echoes the original headers; else the message tag (event publishing only)."""
    headers = mail.get("headers")
    if headers is not None:
        value = fields.header_from_list(headers, JOB_ID_HEADER, "Message.mail.headers")
        job_id = fields.job_id_value(value, f"Message.mail.headers[{JOB_ID_HEADER}]")
        if job_id is not None:
            return job_id
    tags = fields.opt_object(mail, "tags", "Message.mail")
    if tags:
        return fields.job_id_value(fields.lookup_ci(tags, JOB_ID_TAG), f"Message.mail.tags.{JOB_ID_TAG}")
    return None
