"""From a claimed row to an :class:`OutgoingMessage`: headers and rendering, in one place.

A campaign's templates are compiled once per worker process and cached; per recipient only the
variable parts are rendered and a few header lines written.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

from sendonce.delivery.render import CompiledTemplate, TemplateError, compile_template
from sendonce.domain.addresses import parse_address
from sendonce.domain.jobs import JOB_ID_HEADER, message_id
from sendonce.domain.message import OutgoingMessage, format_address
from sendonce.store import accounts as account_store
from sendonce.store import campaigns as campaign_store
from sendonce.store.database import Conn
from sendonce.store.outbox import ClaimedDelivery

logger = logging.getLogger(__name__)

CAMPAIGN_VARIABLES = frozenset({"email", "name", "attributes", "subscriber", "campaign"})
"""What a campaign template may use."""


class ComposeError(Exception):
    """This message cannot be built (bad template data, unusable address): fail it, do not retry."""


@dataclass(frozen=True, slots=True)
class CampaignContent:
    account_id: int
    campaign_id: int
    name: str
    subject: CompiledTemplate
    text: CompiledTemplate
    html: CompiledTemplate | None
    from_header: str
    envelope_from: str
    domain: str
    boundary: str


def compile_campaign(
    *, subject: str, text: str, html: str | None
) -> tuple[CompiledTemplate, CompiledTemplate, CompiledTemplate | None]:
    """Compile a campaign's three templates, checking their variables. Raises TemplateError."""
    return (
        compile_template(subject, field="subject", allowed=CAMPAIGN_VARIABLES),
        compile_template(text, field="text", allowed=CAMPAIGN_VARIABLES),
        compile_template(html, html=True, field="html", allowed=CAMPAIGN_VARIABLES) if html is not None else None,
    )


def wire_address(text: str) -> tuple[str, bool]:
    """(address for the SMTP envelope and headers, needs SMTPUTF8). ASCII addresses take a fast path."""
    if text.isascii():
        return text, False
    address = parse_address(text)
    return address.wire, address.smtputf8


class _DateCache:
    """RFC 5322 Date, formatted once per second rather than once per message."""

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def now(self) -> str:
        second = int(time.time())
        if second != self._second:
            self._second, self._value = second, formatdate(second, usegmt=True)
        return self._value


@dataclass(frozen=True, slots=True)
class Sender:
    """Who a transactional message is from: the account's address."""

    account_id: int
    from_header: str
    envelope_from: str
    domain: str


TransactionalComposer = Callable[[ClaimedDelivery, Sender, str], OutgoingMessage]
"""Builds a transactional message from its row, its sender and the current Date header value."""

_ACCOUNT_TTL = 60.0


class Composer:
    def __init__(self, transactional: dict[str, TransactionalComposer] | None = None) -> None:
        self._campaigns: dict[tuple[int, int], CampaignContent] = {}
        self._senders: dict[int, tuple[float, Sender]] = {}
        self._transactional = dict(transactional or {})
        self._date = _DateCache()

    async def _load_sender(self, conn: Conn, account_id: int) -> None:
        cached = self._senders.get(account_id)
        if cached is not None and time.monotonic() - cached[0] < _ACCOUNT_TTL:
            return
        account = await account_store.get_account(conn, account_id)
        if account is None:
            return
        envelope_from, _ = wire_address(account.from_email)
        sender = Sender(
            account_id,
            format_address(account.from_name, envelope_from),
            envelope_from,
            envelope_from.rpartition("@")[2],
        )
        self._senders[account_id] = (time.monotonic(), sender)

    async def prepare(self, conn: Conn, batch: Iterable[ClaimedDelivery]) -> None:
        """Load what the batch needs that is not cached yet (one query per new campaign or account)."""
        for delivery in batch:
            if delivery.blocked:
                continue
            if delivery.campaign_id is None:
                await self._load_sender(conn, delivery.account_id)
                continue
            key = (delivery.account_id, delivery.campaign_id)
            if key in self._campaigns:
                continue
            campaign = await campaign_store.get_campaign(conn, delivery.account_id, delivery.campaign_id)
            if campaign is None:
                continue
            try:
                subject, text, html = compile_campaign(
                    subject=campaign.subject, text=campaign.text_body, html=campaign.html_body
                )
            except TemplateError as exc:
                # Checked when the campaign was created; if it fails now, each row fails with the reason.
                logger.error("campaign %s cannot be compiled: %s", campaign.campaign_id, exc)
                continue
            envelope_from, _ = wire_address(campaign.from_email)
            self._campaigns[key] = CampaignContent(
                account_id=campaign.account_id,
                campaign_id=campaign.campaign_id,
                name=campaign.name,
                subject=subject,
                text=text,
                html=html,
                from_header=format_address(campaign.from_name, envelope_from),
                envelope_from=envelope_from,
                domain=envelope_from.rpartition("@")[2],
                boundary=f"=_so_{secrets.token_hex(12)}",
            )

    def compose(self, delivery: ClaimedDelivery) -> OutgoingMessage:
        try:
            if delivery.campaign_id is not None:
                return self._compose_campaign(delivery)
            composer = self._transactional.get(delivery.kind)
            if composer is None:
                raise ComposeError(f"no composer for mail of kind {delivery.kind!r}")
            cached = self._senders.get(delivery.account_id)
            if cached is None:
                raise ComposeError(f"account {delivery.account_id} could not be loaded")
            return composer(delivery, cached[1], self._date.now())
        except ComposeError:
            raise
        except Exception as exc:
            raise ComposeError(f"{type(exc).__name__}: {exc}") from exc

    def _compose_campaign(self, delivery: ClaimedDelivery) -> OutgoingMessage:
        assert delivery.campaign_id is not None
        content = self._campaigns.get((delivery.account_id, delivery.campaign_id))
        if content is None:
            raise ComposeError(f"campaign {delivery.campaign_id} could not be loaded")
        recipient, smtputf8 = wire_address(delivery.email)
        context: dict[str, Any] = {
            "email": delivery.email,
            "name": delivery.name or "",
            "attributes": delivery.attributes or {},
            "subscriber": {
                "id": delivery.subscriber_id,
                "email": delivery.email,
                "name": delivery.name or "",
                "attributes": delivery.attributes or {},
            },
            "campaign": {"id": content.campaign_id, "name": content.name},
        }
        return OutgoingMessage(
            job_id=delivery.job_id,
            envelope_from=content.envelope_from,
            recipient=recipient,
            smtputf8=smtputf8,
            from_header=content.from_header,
            to_header=format_address(delivery.name, recipient),
            subject=content.subject.render(context),
            text=content.text.render(context),
            html=content.html.render(context) if content.html is not None else None,
            message_id=message_id(delivery.job_id, content.domain),
            date=self._date.now(),
            headers=[(JOB_ID_HEADER, delivery.job_id)],
            boundary=content.boundary,
        )
