"""Bounce and complaint webhooks: ``POST /v1/webhooks/{provider}`` (ses, resend, postmark, sendgrid, generic).

Each request is verified (signature or shared secret) before anything is read from it. Ingestion is
idempotent on the provider's event id: a provider that retries, or sends the same event twice, has
its event applied once. Events are linked to their delivery by our job id, else by the provider's
message id; an event that names neither is ignored, unless it is of the generic format and names its
account inside the signed body (a query parameter would not be covered by the signature).
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Path, Request

from sendonce.api.deps import connection
from sendonce.api.problems import Problem
from sendonce.api.services import services_of
from sendonce.store import feedback
from sendonce.webhooks import PROVIDERS, SubscriptionConfirmation, WebhookError, parse_webhook, schemas

logger = logging.getLogger(__name__)
router = APIRouter(tags=["webhooks"])

_CERTIFICATES: dict[str, bytes] = {}


def _fetch_certificate(url: str) -> bytes:
    # parse_webhook has checked the URL (https, an SNS host, a .pem path) before calling this
    cached = _CERTIFICATES.get(url)
    if cached is None:
        response = httpx.get(url, timeout=10.0, follow_redirects=False)
        response.raise_for_status()
        cached = _CERTIFICATES[url] = response.content
    return cached


@router.post(
    "/v1/webhooks/{provider}",
    openapi_extra=schemas.OPENAPI,  # the route reads its body and headers itself: documented for senders
)
async def receive(
    provider: Annotated[str, Path(max_length=32)],
    request: Request,
) -> dict[str, Any]:
    services = services_of(request)
    if provider not in PROVIDERS:
        raise Problem(404, f"unknown webhook provider {provider!r}; known: {', '.join(sorted(PROVIDERS))}")
    config = services.webhook_config
    if provider == "ses" and not config.sns_topic_arns:
        raise Problem(401, "SES webhooks are not configured: set SENDONCE_SNS_TOPIC_ARNS to the topics to accept")
    body = await request.body()
    try:
        parsed = await asyncio.to_thread(
            parse_webhook,
            provider,
            dict(request.headers),
            body,
            config,
            now=datetime.now(UTC),
            fetch_certificate=_fetch_certificate,
        )
    except WebhookError as exc:
        raise Problem(exc.status, str(exc), kind="webhook-rejected", title="Webhook rejected") from None
    except httpx.HTTPError as exc:
        raise Problem(503, f"the signing certificate could not be fetched: {exc}; retry later") from None
    if isinstance(parsed, SubscriptionConfirmation):
        confirmed = False
        if parsed.message_type == "SubscriptionConfirmation" and services.settings.sns_auto_confirm:
            host = urlsplit(parsed.subscribe_url).hostname or ""
            if not re.fullmatch(config.sns_cert_host_pattern, host):
                raise Problem(400, "the SubscribeURL is not an SNS address")
            try:
                response = await asyncio.to_thread(httpx.get, parsed.subscribe_url, timeout=10.0)
            except httpx.HTTPError as exc:
                # SNS sends the confirmation again when it gets no 2xx: a retry may reach it
                raise Problem(503, f"the SubscribeURL could not be reached: {exc}; retry later") from None
            if response.status_code >= 500:
                raise Problem(503, f"the SubscribeURL answered {response.status_code}; retry later")
            confirmed = response.status_code == 200
        return {"subscription": parsed.topic_arn, "confirmed": confirmed}
    new = unattributed = 0
    campaigns: set[tuple[int, int]] = set()
    # A connection only now: a forged or slow request (its body, a certificate fetch) holds none.
    async with connection(request) as conn:
        async with conn.transaction():  # the whole request or nothing: a provider retries a failed one
            for event in parsed:
                result = await feedback.ingest(conn, event, services.feedback)
                if result.account_id is None:
                    unattributed += 1
                    continue
                new += result.new
                # Replays too: a provider retries a request whose campaign check failed after its
                # events were committed, and the check must be made then (it pauses at most once).
                if result.campaign_id is not None and event.kind in ("hard_bounce", "complaint"):
                    campaigns.add((result.account_id, result.campaign_id))
        # Each after the commit, in a statement of its own: it counts the campaign's committed
        # feedback, this request's and that of requests committed meanwhile.
        for account_id, campaign_id in sorted(campaigns):
            alert = await feedback.check_campaign(conn, account_id, campaign_id, services.feedback)
            if alert is not None:
                logger.warning("campaign %s paused: %s", campaign_id, alert["detail"]["reason"])
                services.notify(account_id, alert)
    return {"received": len(parsed), "new": new, "unattributed": unattributed}
