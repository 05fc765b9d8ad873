"""Posting alerts to the optional webhook (SENDONCE_ALERT_WEBHOOK_URL)."""

from __future__ import annotations

import logging
from typing import Any

import httpx

logger = logging.getLogger(__name__)


async def post_alert(url: str, account_id: int, alert: dict[str, Any]) -> None:
    body = {"account_id": account_id, **alert}
    if hasattr(body.get("created_at"), "isoformat"):
        body["created_at"] = body["created_at"].isoformat()
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.post(url, json=body)
            response.raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("alert webhook %s failed: %s", url, exc)
