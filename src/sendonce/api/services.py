"""What the routes need besides a connection, built once by the app factory."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request

from sendonce.api.abuse import AbuseDetector, Flag
from sendonce.api.metrics import ApiMetrics
from sendonce.domain.keys import KeyRing
from sendonce.faults import Faults
from sendonce.settings import Settings
from sendonce.store import alerts
from sendonce.store.database import Conn
from sendonce.store.signups import SignupLimits

logger = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    keys: KeyRing
    limits: SignupLimits
    metrics: ApiMetrics
    detector: AbuseDetector | None
    faults: Faults = field(default_factory=Faults)
    _webhook_tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def client_address(self, request: Request) -> str:
        if self.settings.trust_forwarded_for:
            forwarded = request.headers.get("x-forwarded-for")
            if forwarded:
                return forwarded.split(",")[0].strip()[:64]
        return request.client.host if request.client else "unknown"

    def verify_url(self, token: str) -> str:
        return f"{self.settings.public_url.rstrip('/')}/v1/signups/verify?token={token}"

    async def record_flags(self, conn: Conn, flags: list[Flag]) -> None:
        """Store new alerts (once per subject, kind and hour across processes); log and post them."""
        import time

        episode = str(int(time.time() // 3600))
        for flag in flags:
            alert = await alerts.raise_alert(conn, flag.account_id, flag.kind, flag.subject, episode, dict(flag.detail))
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
            if self.settings.alert_webhook_url:
                task = asyncio.create_task(self._post(self.settings.alert_webhook_url, flag.account_id, alert))
                self._webhook_tasks.add(task)
                task.add_done_callback(self._webhook_tasks.discard)

    async def _post(self, url: str, account_id: int, alert: dict[str, Any]) -> None:
        body = {"account_id": account_id, **alert, "created_at": alert["created_at"].isoformat()}
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                response = await client.post(url, json=body)
                response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("alert webhook %s failed: %s", url, exc)


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services
