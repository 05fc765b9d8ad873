"""Bounce and complaint webhooks: verify the request, then parse it into :class:`FeedbackEvent` s.

Pure: no I/O, no database. The route hands over the headers, the raw body (signatures cover the
exact bytes, so it must not be re-serialized), the time, and a function that fetches an SNS signing
certificate; it gets back events to ingest (idempotently, on ``(provider, event_id)``), an SNS
subscription to confirm, or a :class:`WebhookError` whose ``status`` it answers with.

Every provider is verified before its payload is parsed, and a provider whose secret is not
configured is refused: an unverified bounce webhook would let anyone suppress any address.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from sendonce.webhooks import generic, postmark, resend, sendgrid, ses
from sendonce.webhooks.events import (
    FeedbackEvent,
    PayloadError,
    SignatureError,
    SubscriptionConfirmation,
    WebhookConfig,
    WebhookError,
)
from sendonce.webhooks.signatures import normalize_headers, require_aware

__all__ = [
    "PROVIDERS",
    "FeedbackEvent",
    "PayloadError",
    "SignatureError",
    "SubscriptionConfirmation",
    "WebhookConfig",
    "WebhookError",
    "parse_webhook",
]

PROVIDERS = frozenset({ses.PROVIDER, resend.PROVIDER, postmark.PROVIDER, sendgrid.PROVIDER, generic.PROVIDER})


def parse_webhook(
    provider: str,
    headers: Mapping[str, str],
    body: bytes,
    config: WebhookConfig,
    *,
    now: datetime,
    fetch_certificate: Callable[[str], bytes],
) -> list[FeedbackEvent] | SubscriptionConfirmation:
    """Verify and parse one webhook request from ``provider``.

    ``now`` must be timezone-aware. ``fetch_certificate(url)`` returns the PEM at an SNS
    ``SigningCertURL``; it is called only for ``ses``, and only after the URL was checked (https, a
    host matching ``config.sns_cert_host_pattern``, a ``.pem`` path). Its exceptions propagate: a
    certificate that cannot be fetched now is the route's failure to report (5xx, so SNS retries).

    Raises :class:`SignatureError` (401) for a missing, invalid or stale signature or an unconfigured
    provider, and :class:`PayloadError` (400) for an unknown provider or a malformed payload.
    """
    require_aware(now)
    normalized = normalize_headers(headers)
    if provider == ses.PROVIDER:
        return ses.parse(normalized, body, config, now=now, fetch_certificate=fetch_certificate)
    if provider == resend.PROVIDER:
        return resend.parse(normalized, body, config, now=now)
    if provider == postmark.PROVIDER:
        return postmark.parse(normalized, body, config)
    if provider == sendgrid.PROVIDER:
        return sendgrid.parse(normalized, body, config, now=now)
    if provider == generic.PROVIDER:
        return generic.parse(normalized, body, config, now=now)
    raise PayloadError(f"unknown webhook provider {provider[:64]!r}; known: {', '.join(sorted(PROVIDERS))}")
