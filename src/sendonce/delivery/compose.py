"""From a claimed row to an :class:`OutgoingMessage`: headers and rendering, in one place.

A campaign's templates are compiled once per worker process and cached; per recipient only the
variable parts are rendered and a few header lines written.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from email.utils import formatdate
from html import escape
from pathlib import Path
from typing import Any

from sendonce.delivery.render import CompiledTemplate, compile_template, inline_css
from sendonce.delivery.skeleton import MessageHead, Skeleton
from sendonce.domain.addresses import parse_address
from sendonce.domain.dkim import DkimKey
from sendonce.domain.jobs import JOB_ID_HEADER, message_id
from sendonce.domain.keys import KeyRing
from sendonce.domain.message import OutgoingMessage, format_address
from sendonce.store import accounts as account_store
from sendonce.store import campaigns as campaign_store
from sendonce.store.accounts import DkimSettings
from sendonce.store.database import Conn
from sendonce.store.outbox import ClaimedDelivery

logger = logging.getLogger(__name__)

CAMPAIGN_VARIABLES = frozenset({"email", "name", "attributes", "subscriber", "campaign", "unsubscribe_url"})
"""What a campaign template may use."""

UNSUBSCRIBE_PURPOSE = "unsubscribe"


@dataclass(frozen=True, slots=True)
class Links:
    """Signed links in mail: built on the public URL where people reach the API."""

    keys: KeyRing
    public_url: str
    unsubscribe_mailto: str | None = None
    """Mailbox for a mailto: part of List-Unsubscribe, which someone reads; without one, none."""

    def unsubscribe_token(self, account_id: int, subscriber_id: int, campaign_id: int) -> str:
        return self.keys.sign_stable(UNSUBSCRIBE_PURPOSE, {"a": account_id, "s": subscriber_id, "c": campaign_id})

    def unsubscribe_url(self, token: str) -> str:
        return f"{self.public_url.rstrip('/')}/u/{token}"

    def list_unsubscribe(self, token: str) -> str:
        """RFC 2369 List-Unsubscribe: the one-click URL (RFC 8058), then a mailto: fallback when a
        mailbox for it is configured. sendonce reads no mailbox: a mailto: to one that nobody
        processes (it was unsubscribe@<sending domain> by default) loses every unsubscribe sent there."""
        url = f"<{self.unsubscribe_url(token)}>"
        if not self.unsubscribe_mailto:  # unset, or set empty
            return url
        return f"{url}, <mailto:{self.unsubscribe_mailto}?subject=unsubscribe%20{token}>"


def _footer_text(url: str) -> str:
    return f"\n\n--\nTo stop receiving these emails, unsubscribe: {url}\n"


def _footer_html(html: str, url: str) -> str:
    link = (
        '<p style="font-size:12px;color:#666">To stop receiving these emails, '
        f'<a href="{escape(url, quote=True)}">unsubscribe</a>.</p>'
    )
    lower = html.lower()
    at = lower.rfind("</body>")
    return html[:at] + link + html[at:] if at != -1 else html + link


class ComposeError(Exception):
    """This message cannot be built (bad template data, unusable address): fail it, do not retry."""


class ComposeLater(ComposeError):
    """This message cannot be built now (its DKIM key cannot be read): retry later, with backoff."""


def load_dkim_key(settings: DkimSettings) -> DkimKey:
    """Read an account's DKIM private key from its file or environment variable."""
    if settings.key_file:
        try:
            pem = Path(settings.key_file).read_bytes()
        except OSError as exc:
            raise ComposeLater(
                f"the DKIM key of {settings.domain} cannot be read from {settings.key_file}: {exc}"
            ) from None
    else:
        assert settings.key_env is not None
        value = os.environ.get(settings.key_env)
        if not value:
            raise ComposeLater(f"the DKIM key of {settings.domain} is not in ${settings.key_env}")
        pem = value.replace("\\n", "\n").encode()
    key = DkimKey(settings.domain, settings.selector, pem)
    try:
        key.sign(b"From: check@example.com\r\nSubject: check\r\n\r\ncheck\r\n")
    except Exception as exc:  # dkimpy raises its own types for unusable keys
        raise ComposeLater(f"the DKIM key of {settings.domain} cannot sign: {exc}") from None
    return key


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
    text_shows_unsubscribe_url: bool
    """The text template shows the link itself; otherwise a footer with it is added to that body."""
    html_shows_unsubscribe_url: bool
    """The same, for the HTML body: each body shows the link, whichever template names it."""
    skeleton: Skeleton | None = None
    """The campaign compiled into the bytes it sends, with holes for each recipient's values (None:
    its templates or static parts need the general path for every message)."""


def compile_campaign(
    *, subject: str, text: str, html: str | None
) -> tuple[CompiledTemplate, CompiledTemplate, CompiledTemplate | None]:
    """Compile a campaign's three templates, checking their variables (CSS of the HTML inlined,
    once). Raises TemplateError."""
    return (
        compile_template(subject, field="subject", allowed=CAMPAIGN_VARIABLES),
        compile_template(text, field="text", allowed=CAMPAIGN_VARIABLES),
        compile_template(inline_css(html), html=True, field="html", allowed=CAMPAIGN_VARIABLES)
        if html is not None
        else None,
    )


def campaign_context(
    *,
    email: str,
    name: str | None,
    attributes: dict[str, Any] | None,
    subscriber_id: int | None,
    campaign_id: int | None,
    campaign_name: str,
    unsubscribe_url: str,
) -> dict[str, Any]:
    """What a campaign template sees for one recipient."""
    return {
        "email": email,
        "name": name or "",
        "attributes": attributes or {},
        "subscriber": {"id": subscriber_id, "email": email, "name": name or "", "attributes": attributes or {}},
        "campaign": {"id": campaign_id, "name": campaign_name},
        "unsubscribe_url": unsubscribe_url,
    }


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
    dkim: DkimKey | None = None
    dkim_error: str | None = None
    """The account wants DKIM but its key could not be loaded: messages wait (ComposeLater)."""

    def signing_key(self) -> DkimKey | None:
        if self.dkim_error is not None:
            raise ComposeLater(self.dkim_error)
        return self.dkim


TransactionalComposer = Callable[[ClaimedDelivery, Sender, str], OutgoingMessage]
"""Builds a transactional message from its row, its sender and the current Date header value."""

_ACCOUNT_TTL = 60.0


class Composer:
    def __init__(self, transactional: dict[str, TransactionalComposer] | None = None, *, links: Links) -> None:
        self.links = links
        self._campaigns: dict[tuple[int, int], CampaignContent] = {}
        self._uncompiled: dict[tuple[int, int], str] = {}
        """Campaigns whose content would not compile here, with the reason: tried again at each batch
        (a resumed campaign meets a worker that may compile it now)."""
        self._senders: dict[int, tuple[float, Sender]] = {}
        self._transactional = dict(transactional or {})
        self._date = _DateCache()

    async def _load_sender(self, conn: Conn, account_id: int) -> None:
        cached = self._senders.get(account_id)
        # A sender whose DKIM key could not be read is read again at each batch: the operator who put
        # the key in place and resumed the campaign at once must not meet the old error for a minute.
        if cached is not None and cached[1].dkim_error is None and time.monotonic() - cached[0] < _ACCOUNT_TTL:
            return
        account = await account_store.get_account(conn, account_id)
        if account is None:
            return
        envelope_from, _ = wire_address(account.from_email)
        dkim: DkimKey | None = None
        dkim_error: str | None = None
        if account.dkim is not None:
            try:
                dkim = load_dkim_key(account.dkim)
            except ComposeLater as exc:
                dkim_error = str(exc)
                if cached is None or cached[1].dkim_error != dkim_error:  # once, not at every claim
                    logger.error("%s", exc, extra={"action": "dkim_key_missing", "account_id": account_id})
        sender = Sender(
            account_id,
            format_address(account.from_name, envelope_from),
            envelope_from,
            envelope_from.rpartition("@")[2],
            dkim,
            dkim_error,
        )
        self._senders[account_id] = (time.monotonic(), sender)

    def sender(self, account_id: int) -> Sender:
        cached = self._senders.get(account_id)
        if cached is None:
            raise ComposeLater(f"account {account_id} could not be loaded")
        return cached[1]

    async def prepare(self, conn: Conn, batch: Iterable[ClaimedDelivery]) -> None:
        """Load what the batch needs that is not cached yet (one query per new campaign or account)."""
        senders: set[int] = set()
        for delivery in batch:
            if delivery.blocked:
                continue
            if delivery.account_id not in senders:
                senders.add(delivery.account_id)
                await self._load_sender(conn, delivery.account_id)
            if delivery.campaign_id is None:
                continue
            key = (delivery.account_id, delivery.campaign_id)
            if key in self._campaigns:
                continue
            campaign = await campaign_store.get_campaign(conn, delivery.account_id, delivery.campaign_id)
            if campaign is None:
                continue
            try:
                # On a thread of its own, as the API's check did: how deep a template may nest before the
                # compiler's recursion gives out depends on the stack it starts from (and a big
                # template's compile must not hold up the event loop, its renewals among it).
                subject, text, html = await asyncio.to_thread(
                    compile_campaign, subject=campaign.subject, text=campaign.text_body, html=campaign.html_body
                )
            except Exception as exc:
                # Checked when the campaign was created, so not this recipient's fault: every row would
                # fail alike. Composing waits (the campaign pauses with this reason, see the worker),
                # and one campaign's content never stops the worker.
                self._uncompiled[key] = f"campaign {campaign.campaign_id} cannot be compiled: {exc}"
                logger.error("%s", self._uncompiled[key])
                continue
            self._uncompiled.pop(key, None)
            envelope_from, _ = wire_address(campaign.from_email)
            content = CampaignContent(
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
                text_shows_unsubscribe_url="unsubscribe_url" in text.variables,
                html_shows_unsubscribe_url=html is not None and "unsubscribe_url" in html.variables,
            )
            self._campaigns[key] = replace(content, skeleton=_skeleton(content))

    def compose(self, delivery: ClaimedDelivery) -> OutgoingMessage:
        try:
            if delivery.campaign_id is not None:
                return self._compose_campaign(delivery)
            composer = self._transactional.get(delivery.kind)
            if composer is None:
                raise ComposeError(f"no composer for mail of kind {delivery.kind!r}")
            return composer(delivery, self.sender(delivery.account_id), self._date.now())
        except ComposeError:
            raise
        except Exception as exc:
            raise ComposeError(f"{type(exc).__name__}: {exc}") from exc

    def _compose_campaign(self, delivery: ClaimedDelivery) -> OutgoingMessage:
        assert delivery.campaign_id is not None
        key = (delivery.account_id, delivery.campaign_id)
        content = self._campaigns.get(key)
        if content is None:
            uncompiled = self._uncompiled.get(key)
            if uncompiled is not None:
                raise ComposeLater(uncompiled)
            raise ComposeError(f"campaign {delivery.campaign_id} could not be loaded")
        recipient, smtputf8 = wire_address(delivery.email)
        assert delivery.subscriber_id is not None
        token = self.links.unsubscribe_token(delivery.account_id, delivery.subscriber_id, content.campaign_id)
        unsubscribe_url = self.links.unsubscribe_url(token)
        context = campaign_context(
            email=delivery.email,
            name=delivery.name,
            attributes=delivery.attributes,
            subscriber_id=delivery.subscriber_id,
            campaign_id=content.campaign_id,
            campaign_name=content.name,
            unsubscribe_url=unsubscribe_url,
        )
        dkim = self.sender(delivery.account_id).signing_key()
        head = MessageHead(
            job_id=delivery.job_id,
            recipient=recipient,
            smtputf8=smtputf8,
            to_header=format_address(delivery.name, recipient),
            message_id=message_id(delivery.job_id, content.domain),
            date=self._date.now(),
            list_unsubscribe=self.links.list_unsubscribe(token),
            dkim=dkim,
            key_maybe_used=delivery.uncertain,
        )
        if content.skeleton is not None and dkim is None and not smtputf8:
            try:
                made = content.skeleton.render(context, head, unsubscribe_url)
            except Exception:  # a shortcut that fails must not fail the message: the general path writes it
                logger.exception("%s: the campaign's skeleton failed; the general path writes it", delivery.job_id)
                made = None
            if made is not None:
                return campaign_message(content, head, *made)
        text = content.text.render(context)
        html = content.html.render(context) if content.html is not None else None
        text, html = with_footers(content, text, html, unsubscribe_url)
        return campaign_message(content, head, content.subject.render(context), text, html)


def with_footers(
    content: CampaignContent, text: str, html: str | None, url: str, html_url: str | None = None
) -> tuple[str, str | None]:
    """The bodies as sent: every campaign message shows how to unsubscribe, in both bodies (unless
    that body's template shows the link itself: one that named it only in the text part, or only
    in the subject, left the other bodies without it). ``html_url``: the HTML part's link, if not ``url``."""
    if not content.text_shows_unsubscribe_url:
        text += _footer_text(url)
    if html is not None and not content.html_shows_unsubscribe_url:
        html = _footer_html(html, html_url or url)
    return text, html


def campaign_message(
    content: CampaignContent,
    head: MessageHead,
    subject: str,
    text: str,
    html: str | None,
    smtp_data: bytes | None = None,
) -> OutgoingMessage:
    """One campaign message from its head and its rendered subject and bodies (footers included)."""
    return OutgoingMessage(
        job_id=head.job_id,
        envelope_from=content.envelope_from,
        recipient=head.recipient,
        smtputf8=head.smtputf8,
        from_header=content.from_header,
        to_header=head.to_header,
        subject=subject,
        text=text,
        html=html,
        message_id=head.message_id,
        date=head.date,
        headers=[
            (JOB_ID_HEADER, head.job_id),
            # RFC 2369 and RFC 8058: a one-click unsubscribe that mailbox providers can show
            ("List-Unsubscribe", head.list_unsubscribe),
            ("List-Unsubscribe-Post", "List-Unsubscribe=One-Click"),
            # lets the provider's complaint feedback loop attribute complaints to this campaign
            ("Feedback-ID", f"{content.campaign_id}:{content.account_id}:campaign:sendonce"),
        ],
        boundary=content.boundary,
        dkim=head.dkim,
        key_maybe_used=head.key_maybe_used,
        smtp_data=smtp_data,
    )


def _skeleton(content: CampaignContent) -> Skeleton | None:
    """The campaign's skeleton: the general path below, run once on placeholders. It only ever makes
    sending cheaper: if it cannot be made, whatever the reason, every message takes the general path."""
    try:
        return Skeleton.of(
            content.subject,
            content.text,
            content.html,
            content.boundary,
            footers=lambda text, html, url, html_url: with_footers(content, text, html, url, html_url),
            make=lambda head, subject, text, html: campaign_message(content, head, subject, text, html),
        )
    except Exception:
        logger.exception("campaign %s: no skeleton; its messages take the general path", content.campaign_id)
        return None
