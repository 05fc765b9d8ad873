"""What every provider's webhook becomes: feedback events, the configuration, and the errors.

Pure data: no I/O here or anywhere in :mod:`sendonce.webhooks`. The HTTP route reads the raw body,
fetches (and caches) SNS signing certificates, and maps :attr:`WebhookError.status` to its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Final

from sendonce.errors import SendonceError

HARD_BOUNCE: Final = "hard_bounce"
SOFT_BOUNCE: Final = "soft_bounce"
COMPLAINT: Final = "complaint"
DELIVERED: Final = "delivered"
UNSUBSCRIBE: Final = "unsubscribe"
"""The recipient opted out through the provider (its own unsubscribe link or list management)."""
OTHER: Final = "other"
KINDS: Final = frozenset({HARD_BOUNCE, SOFT_BOUNCE, COMPLAINT, DELIVERED, UNSUBSCRIBE, OTHER})


@dataclass(frozen=True, slots=True)
class FeedbackEvent:
    """One thing a provider tells us about one recipient of one message."""

    provider: str
    """``ses``, ``resend``, ``postmark``, ``sendgrid`` or ``generic``."""
    event_id: str
    """The provider's id of this event, unique per recipient: a replay carries the same id, so
    ingestion keyed on ``(provider, event_id)`` is idempotent."""
    kind: str
    """``hard_bounce``, ``soft_bounce``, ``complaint``, ``delivered``, ``unsubscribe`` or ``other``."""
    email: str | None
    """The recipient, exactly as the provider wrote it (not validated, not normalized)."""
    job_id: str | None
    """Our ``Sendonce-Job-Id``, when the provider echoes it (headers, metadata, custom args, tags)."""
    provider_message_id: str | None
    occurred_at: datetime | None
    """When the provider says it happened, timezone-aware UTC."""
    detail: dict[str, Any]
    """A short, JSON-serializable diagnostic: bounce type and subtype, SMTP status, description."""
    account_id: int | None = None
    """The account the (signed) event names itself (generic format only): for an event that names
    neither a job id nor a provider message id."""


@dataclass(frozen=True, slots=True)
class SubscriptionConfirmation:
    """An SNS ``SubscriptionConfirmation`` or ``UnsubscribeConfirmation`` whose signature verified.

    To confirm a subscription the route GETs ``subscribe_url`` (validated: https, an SNS host). For an
    ``UnsubscribeConfirmation`` the same URL would subscribe the endpoint *again*, so the route should
    only visit it when ``message_type == "SubscriptionConfirmation"``.
    """

    topic_arn: str
    subscribe_url: str
    message_type: str = "SubscriptionConfirmation"


@dataclass(frozen=True)
class WebhookConfig:
    """Secrets and policy for verifying webhooks. A provider whose secret is unset is refused."""

    resend_secret: str | None = None
    """Svix signing secret, ``whsec_<base64>``."""
    sendgrid_public_key: str | None = None
    """The Event Webhook verification key: base64 DER (as the SendGrid UI shows it) or PEM, ECDSA P-256."""
    postmark_token: str | None = None
    """Postmark signs nothing, so we require this shared secret: the HTTP Basic auth password (any
    user name) of the webhook URL, or the header ``X-Sendonce-Webhook-Token``."""
    generic_secret: str | None = None
    """Key of ``Sendonce-Signature: sha256=<hex HMAC-SHA256 of "<Sendonce-Timestamp>.<raw body>">``."""
    sns_cert_host_pattern: str = r"^sns\.[a-z0-9-]+\.amazonaws\.com(\.cn)?$"
    """The whole host of every ``SigningCertURL`` (https only) and ``SubscribeURL`` must match this."""
    sns_topic_arns: frozenset[str] = frozenset()
    """If not empty, only these ``TopicArn`` are accepted. Leave it empty and any AWS account's topic
    can deliver correctly signed notifications (and subscription requests) to the endpoint."""
    tolerance_seconds: int = 300
    """Largest accepted distance between a signed timestamp and now (svix, SendGrid, generic)."""


class WebhookError(SendonceError):
    """The webhook request was refused."""

    status: ClassVar[int] = 400
    """The HTTP status the route should answer with."""


class SignatureError(WebhookError):
    """The webhook signature is missing or invalid."""

    status: ClassVar[int] = 401


class PayloadError(WebhookError):
    """The webhook payload is malformed."""

    status: ClassVar[int] = 400


def not_configured(provider: str) -> SignatureError:
    return SignatureError(f"webhook secret for {provider} is not configured")
