"""The Resend-compatible HTTP API: ``POST {base}/emails`` with ``Idempotency-Key: <job_id>``.

The provider keeps the key for 24 hours and drops a second request with the same key, so a
re-send after a crash is harmless: exactly once, as long as the re-send comes within that window.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import logging
import math
from dataclasses import dataclass
from typing import Any

import httpx

from sendonce.domain.message import OutgoingMessage
from sendonce.transports.base import (
    Accepted,
    Capabilities,
    Channel,
    Follow,
    Gate,
    Outcome,
    Permanent,
    Retry,
    Transport,
    Withheld,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResendSettings:
    base_url: str
    api_key: str
    timeout: float = 30.0


def _retry_after(response: httpx.Response) -> float | None:
    """The provider's Retry-After in seconds (RFC 9110: a number or an HTTP-date), None if there is
    none or it is not a number of seconds ("inf", "nan"). Not capped here: the worker keeps what it
    honours within its own limits, however far ahead this is."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):
            return None
        seconds = (parsed - dt.datetime.now(parsed.tzinfo)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _json_object(response: httpx.Response) -> dict[str, Any] | None:
    """The answer's body, when it is a JSON object (a proxy's HTML page, a list or a string is not)."""
    try:
        body = response.json()
    except (ValueError, RecursionError):  # not JSON, not text, or nested past the parser's depth
        return None
    return body if isinstance(body, dict) else None


def _error_name(body: dict[str, Any] | None) -> str:
    return str(body.get("name") or body.get("code") or "") if body is not None else ""


def _email_id(body: dict[str, Any] | None) -> str | None:
    """The provider's id of the email it accepted: a non-empty string in a JSON object, or None."""
    email_id = body.get("id") if body is not None else None
    return email_id if isinstance(email_id, str) and email_id else None


class ResendTransport(Transport):
    capabilities = Capabilities(name="resend", idempotent=True, key_life=24 * 3600.0)

    def __init__(self, settings: ResendSettings, *, max_connections: int = 100) -> None:
        self.settings = settings
        self.rate_bucket = f"transport:resend:{settings.base_url}"
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.settings.base_url,
                headers={"Authorization": f"Bearer {self.settings.api_key}", "User-Agent": "sendonce"},
                timeout=self.settings.timeout,
                limits=httpx.Limits(
                    max_connections=self._max_connections, max_keepalive_connections=self._max_connections
                ),
            )

    def channel(self) -> ResendChannel:
        return ResendChannel(self)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the transport is not started")
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def payload(message: OutgoingMessage) -> dict[str, Any]:
    """The JSON body: deterministic for a job, so a re-send is the same request as the first."""
    body: dict[str, Any] = {
        "from": message.from_header,
        "to": [message.recipient],
        "subject": message.subject,
        "text": message.text,
        "headers": {"Message-ID": message.message_id, **dict(message.headers)},
    }
    if message.html is not None:
        body["html"] = message.html
    return body


class ResendChannel(Channel):
    def __init__(self, transport: ResendTransport) -> None:
        self.transport = transport

    async def send(
        self, message: OutgoingMessage, *, timeout: float, gate: Gate | None = None, follow: Follow | None = None
    ) -> Outcome:
        # one request per message: nothing to send ahead, ``follow`` is not called
        timeout = min(timeout, self.transport.settings.timeout)  # the URL's ?timeout= caps every request
        if gate is not None:
            left = await gate()
            if left is None:
                return Withheld("withheld before the request")
            timeout = max(min(timeout, left), 0.1)
        try:
            # httpx's timeout bounds each phase (connect, write, each read) on its own: an answer
            # trickling in could outlast the worker's budget, which must end before the claim does
            async with asyncio.timeout(timeout):
                response = await self.transport.client.post(
                    "/emails",
                    json=payload(message),
                    headers={"Idempotency-Key": message.job_id},
                    timeout=timeout,
                )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            # no connection, so no byte of the request went out: the provider has nothing (and it is
            # out of reach for every message alike)
            return Retry(f"{type(exc).__name__}: {exc}"[:500], transport_wide=True)
        except (httpx.TimeoutException, TimeoutError) as exc:
            # The provider may have accepted it before we gave up; the same key makes a re-send safe.
            return Retry(f"timeout: {type(exc).__name__}", uncertain=True)
        except httpx.HTTPError as exc:
            # Any other failure came once the request was (being) written: a connection reset while
            # waiting for the answer, an answer cut short. The provider may have taken the message.
            return Retry(f"{type(exc).__name__}: {exc}"[:500], uncertain=True)
        except Exception as exc:  # anything else must not take the worker down with it
            logger.exception("unexpected error sending %s", message.job_id)
            return Retry(f"unexpected {type(exc).__name__}: {exc}"[:500], uncertain=True)
        status = response.status_code
        body = _json_object(response)  # parsed once: the id of a send, or the name of an error
        name = _error_name(body)
        detail = f"{status} {name or response.reason_phrase}: {response.text[:300]}"
        if 200 <= status < 300:
            email_id = _email_id(body)
            if email_id is None:
                # Not the provider's answer: a captive proxy's page, a base URL that names something
                # else. Recorded as sent, the message would never be delivered. The provider may
                # have it (the same key makes a re-send safe); every message would meet the same.
                return Retry(
                    f"a {status} without an email id, not the provider's answer: {detail}",
                    uncertain=True,
                    transport_wide=True,
                )
            return Accepted(email_id)
        if status == 409:
            if name == "concurrent_idempotent_requests":
                # The first request with this key is still in flight at the provider (an attempt of
                # ours whose answer we gave up waiting for): ask again later. It may yet be taken, so
                # uncertain, whatever that earlier attempt's record said.
                return Retry(detail, uncertain=True, retry_after=_retry_after(response) or 1.0)
            if name != "invalid_idempotent_request":
                # Not the provider's word on the key (a proxy's 409, a name it does not use): nothing
                # says the message went out, so it is not recorded sent; the same key makes a re-send safe.
                return Retry(detail, uncertain=True)
            if not message.key_maybe_used:
                # No earlier attempt of this job can have reached the provider, yet it knows the key:
                # someone else used it (another installation with the same API key, a database
                # recreated within the key's life). Taken for "already sent", our message would be
                # recorded sent and never delivered. It fails, saying why; nothing was delivered.
                return Permanent(
                    f"idempotency key {message.job_id!r} already used by another sender, with another message "
                    f"(another sendonce database with this API key?): {detail}"
                )
            # The key was used already, by an earlier attempt of ours: the message went out then.
            return Accepted(None, note=f"already sent ({detail})")
        if status == 429:
            # slow down: every message alike, for at least Retry-After
            return Retry(detail, retry_after=_retry_after(response), transport_wide=True)
        if status >= 500:
            # It may have taken the message (uncertain). A gateway or an outage (502, 503, 504) is the
            # provider's state, not this message's: not counted against it, and the lanes pause.
            return Retry(
                detail, uncertain=True, retry_after=_retry_after(response), transport_wide=status in (502, 503, 504)
            )
        if status == 401 or (status == 403 and name == "invalid_api_key"):
            # Our API key, not this message (Resend answers 403 invalid_api_key for a revoked one,
            # 401 for none): a key revoked or rotated must not fail every row it meets. Retried, not
            # counted against the message (as an SMTP login refused is), until the operator fixes it.
            # Refused: nothing was delivered.
            return Retry(detail, transport_wide=True)
        if 300 <= status < 400 or status in (404, 405):
            # The base URL, not this message: a redirect (httpx follows none: http to https, a moved
            # API), no such endpoint. Every message would meet it: the lanes pause, nothing counted.
            return Retry(detail, transport_wide=True)
        if status in (408, 425):
            # the server gave up waiting for the request, or asks for it again later: this try's failure
            return Retry(detail)
        if status == 403:
            # The sending account's standing (a domain not verified, a sender not allowed): not this
            # message's content, but not every account's either. A campaign pauses until the
            # operator fixes it; any other message is retried, counted (Retry.sender_wide).
            return Retry(detail, sender_wide=True)
        return Permanent(detail)
