"""What the routes need besides a connection, built once by the app factory."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from fastapi import Request

from sendonce.api.abuse import AbuseDetector, Flag
from sendonce.api.metrics import ApiMetrics
from sendonce.domain.keys import KeyRing
from sendonce.faults import Faults
from sendonce.notify import post_alert
from sendonce.settings import Settings
from sendonce.store import alerts
from sendonce.store.database import Conn, is_unavailable
from sendonce.store.feedback import FeedbackPolicy
from sendonce.store.signups import SignupLimits
from sendonce.webhooks import WebhookConfig

logger = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    keys: KeyRing
    limits: SignupLimits
    metrics: ApiMetrics
    detector: AbuseDetector | None
    faults: Faults = field(default_factory=Faults)
    feedback: FeedbackPolicy = field(default_factory=FeedbackPolicy)
    webhook_config: WebhookConfig = field(default_factory=WebhookConfig)
    _webhook_tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def client_address(self, request: Request) -> str:
        """The client's address: the peer's, or behind a trusted proxy the one it appended.

        A proxy appends the peer it saw to X-Forwarded-For, after whatever the client sent: only the
        rightmost entry is the proxy's word, the ones before it are the client's (and the abuse
        detector must not take a client's choice of address). Several header lines are one list.
        """
        if self.settings.trust_forwarded_for:
            forwarded = ",".join(request.headers.getlist("x-forwarded-for"))
            last = forwarded.rsplit(",", 1)[-1].strip()
            if last:
                return last[:64]
        return request.client.host if request.client else "unknown"

    def verify_url(self, token: str) -> str:
        return f"{self.settings.public_url.rstrip('/')}/v1/signups/verify?token={token}"

    async def record_flags(self, conn: Conn, flags: list[Flag]) -> None:
        """Store new alerts (once per subject, kind and hour across processes); log and post them.

        Called after the request's own work committed: a database error here must not turn its
        answer into an error (a 503 would tell the client to retry a signup that was written), so
        the alerts it could not store are logged and counted instead, and the answer stands.
        """
        import time

        episode = str(int(time.time() // 3600))
        for index, flag in enumerate(flags):
            try:
                alert = await alerts.raise_alert(
                    conn, flag.account_id, flag.kind, flag.subject, episode, dict(flag.detail)
                )
            except psycopg.Error as exc:
                if is_unavailable(exc):  # not lent again (a standby's session, say): deps.db does not see it
                    await conn.close()
                for lost in flags[index:]:
                    self.metrics.alerts_unrecorded.labels(lost.kind).inc()
                    logger.error(
                        "alert %s for account %s could not be stored (%s): %s %s",
                        lost.kind,
                        lost.account_id,
                        type(exc).__name__,
                        lost.subject,
                        lost.detail,
                        extra={"action": "alert_unrecorded", "account_id": lost.account_id},
                    )
                    # The detector raises a flag once per episode: the webhook is its only other trace.
                    self.notify(
                        lost.account_id,
                        {
                            "id": None,
                            "kind": lost.kind,
                            "subject": lost.subject,
                            "detail": dict(lost.detail),
                            "created_at": datetime.now(UTC),
                            "stored": False,
                        },
                    )
                return
            if alert is None:
                continue
            self.metrics.alerts.labels(flag.kind).inc()
            logger.warning(
                "alert %s for account %s: %s %s",
                flag.kind,
                flag.account_id,
                flag.subject,
                flag.detail,
                extra={"action": "alert", "account_id": flag.account_id},
            )
            self.notify(flag.account_id, alert)

    def notify(self, account_id: int, alert: dict[str, Any]) -> None:
        """Post an alert to the webhook, if one is configured, without holding up the request."""
        if not self.settings.alert_webhook_url:
            return
        task = asyncio.create_task(post_alert(self.settings.alert_webhook_url, account_id, alert))
        self._webhook_tasks.add(task)
        task.add_done_callback(self._webhook_tasks.discard)


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services
