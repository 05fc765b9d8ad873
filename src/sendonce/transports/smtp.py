"""SMTP through persistent aiosmtplib connections, one per channel, pipelined where the server allows.

Plain SMTP has no idempotency key: if the connection drops after the message data went out and
before the server's final answer, nobody knows whether it was accepted. Such a failure is returned
as an *uncertain* retry, and the re-send is written to the possible-duplicate ledger.

**Pipelining (RFC 2920).** aiosmtplib opens each connection (TCP or TLS, EHLO, STARTTLS, AUTH) and
sends one command per round trip. When the server offers PIPELINING, the channel then takes the
connection over and sends each message in two exchanges instead of four: ``MAIL FROM``, ``RCPT TO``
and ``DATA`` in one write, read back in order; then the content and its final dot. The content is
still the only thing that delivers anything, and it goes out only after every envelope reply came
back positive and the caller's gate agreed. aiosmtplib cannot read several replies to one write (its
protocol keeps one reply and drops data that arrives while that reply waits to be read), so the
replies of a taken-over connection are read by :class:`_Replies`. ``?pipelining=false`` in the
transport URL keeps aiosmtplib's one-command-at-a-time exchange for every message.

When the lane already has its next message (``follow``), that message's envelope goes out in the
same write as the current content (RFC 2920 3.1: the content may begin a group of commands, DATA
ends one): one write and one exchange per message rather than two. The envelope delivers nothing; its
replies are read by the next ``send``, which must be for that message, and any failure of the current
message's exchange closes the connection, and the envelope with it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import TypeGuard, cast

import aiosmtplib
from aiosmtplib import SMTPResponse

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

_MAIL_NEEDS_LOGIN = frozenset({530, 535, 538})
"""Replies to MAIL FROM that ask for authentication or TLS first."""
_MAIL_REFUSES_MESSAGE = frozenset({504, 552, 555})
"""Replies to MAIL FROM about this message: its size, its parameters (SMTPUTF8, BODY=8BITMIME)."""
_MAIL_OUT_OF_STEP = frozenset({500, 502, 503})
"""Replies to MAIL FROM about the command itself (not understood, not in sequence): the session is
out of step, not the sender refused."""

# A connection idle longer than this is probed with RSET before it is trusted with a message.
_IDLE_PROBE_SECONDS = 30.0
_MAX_REPLY_BYTES = 64 * 1024
_NOT_IN_COMMAND = re.compile(r"[\r\n<>]")
"""What an address in MAIL FROM:<...> or RCPT TO:<...> cannot hold."""


@dataclass(frozen=True, slots=True)
class SmtpSettings:
    host: str
    port: int
    use_tls: bool = False
    start_tls: bool | None = False
    username: str | None = None
    password: str | None = None
    timeout: float = 30.0
    validate_certs: bool = True
    local_hostname: str | None = None
    pipelining: bool = True
    """Use RFC 2920 PIPELINING when the server offers it."""
    relay: str | None = None
    """A relay whose webhooks echo a header of its own, not ours (``postmark``, ``sendgrid``; see
    :data:`RELAYS`): each message then carries its job id in that header as well."""


RELAYS = ("postmark", "sendgrid")
"""Relays whose bounce and complaint webhooks carry neither the message's own headers nor an id that
a record keeps (what sendonce keeps is the relay's SMTP reply). Their metadata header is what links
such an event to its delivery; the relay takes the header out before the message goes on."""
RELAY_HOSTS = {
    "smtp.postmarkapp.com": "postmark",
    "smtp-broadcasts.postmarkapp.com": "postmark",
    "smtp.sendgrid.net": "sendgrid",
}
"""Relays known by their host name: their header is added unless the URL says ``relay=none``."""


def relay_header(relay: str | None, job_id: str) -> bytes:
    """The header line (CRLF included) that carries ``job_id`` to ``relay``'s webhooks, or nothing.
    Job ids are ASCII letters, digits, ``_``, ``-`` and ``:``: nothing in them needs quoting, nor
    makes a line that begins with a dot."""
    if relay == "postmark":
        # echoed in the webhooks' Metadata as {"sendonce-job-id": ...}
        return f"X-PM-Metadata-sendonce-job-id: {job_id}\r\n".encode("ascii")
    if relay == "sendgrid":
        # unique_args come back as fields of each event: {"sendonce_job_id": ...}
        return f'X-SMTPAPI: {{"unique_args":{{"sendonce_job_id":"{job_id}"}}}}\r\n'.encode("ascii")
    return b""


class SmtpTransport(Transport):
    capabilities = Capabilities(name="smtp", idempotent=False)

    def __init__(self, settings: SmtpSettings) -> None:
        self.settings = settings
        self.rate_bucket = f"transport:smtp:{settings.host}:{settings.port}"

    def channel(self) -> SmtpChannel:
        return SmtpChannel(self.settings)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


def _can_take_over(transport: object) -> TypeGuard[asyncio.Transport]:
    """Whether the channel can read this connection's replies itself: a stream transport whose
    protocol can be swapped. Duck-typed: uvloop's transports have the whole interface but are not
    subclasses of ``asyncio.Transport`` (an isinstance check silently turned pipelining off there)."""
    return all(callable(getattr(transport, name, None)) for name in ("set_protocol", "write", "abort", "is_closing"))


_ENHANCED_STATUS = re.compile(r"\s*[245]\.(\d{1,3})\.(\d{1,3})(?!\S)")
"""RFC 3463's ``class.subject.detail``, which RFC 2034 servers put first in a reply's text."""


_CLASSIFIED_CHARS = 1000
"""How much of a refusal's text is read for its meaning: the status and the words come first, and a
longer text (a hostile relay may send 64 KiB) would only cost the worker's event loop."""
_ADDRESSES = re.compile(r"<[^<>]*>|(?<!\S)[^\s@]*@\S+")
"""Addresses a reply echoes back: their words are not the reply's (``<relay@example.org>``)."""
_QUOTED = re.compile(
    r"(?s:\bsaid:.*?(?:\(in\s+reply\s+to\b[^)]*\)|\Z))"
    r"|(?m:^Response:.*$)"
    r"|(?s:\bcallout\s+verification\s+failed:.*)",
    re.IGNORECASE,
)
"""A next server's reply that a relay quotes within its own: Postfix's "host mx.example[...] said:
554 5.7.1 Relay access denied (in reply to RCPT TO command)" of a recipient it could not verify, and
Exim's callouts ("Response: ...", "Callout verification failed: ..."). Those words refused the relay
that asked, not us."""
_REFUSES_US = re.compile(
    r"\brelay(?:ing)?\s+(?:access\s+)?(?:denied|not\s+(?:permitted|allowed)|prohibited)"
    r"|\b(?:unable|not\s+(?:permitted|allowed|authori[sz]ed))\s+to\s+relay"
    r"|\bsender\s+(?:address\s+)?(?:rejected|refused|denied|not\s+allowed)"
    r"|\bsender\s+verif(?:y|ication)\s+failed"
    # our sender's own address or domain is bad (Exim, Sendmail: no enhanced status)
    r"|\bsender\s+(?:domain|address)\b[^\n]{0,100}?\b(?:does\s*n[o']t\s+exist|unknown|not\s+found|unroute?able)"
    r"|\bdomain\s+of\s+sender\s+address\b|\bunroute?able\s+sender\b"
    # our client host, its address or our sender's domain on a blocklist
    r"|\bclient\s+host\b[^\n]{0,200}?\b(?:rejected|blocked|denied)"
    r"|\bsender\s+address\s+(?:\[[^\]\n]{0,300}\]\s+)?blocked\b"
    r"|\b(?:black|block|deny)[\s-]?listed\s+(?:at|in|on|by)\b|\b\d{1,3}(?:\.\d{1,3}){3}\]?\s+is\s+listed\b"
    r"|\bin\s+an?\s+black\s*list\b|\bon\s+our\s+block\s*list\b|\bbanned\s+sending\s+IP"
    # our sending quota or rate, spent (a recipient's receiving rate is that message's)
    r"|\bsending\s+(?:limit|quota)|\bmax(?:imum)?\s+(?:e-?mails|messages)\s+per\s+(?:hour|day)"
    r"|\b(?:sender|sending|outbound|submission)\s+rate\b|\breached\s+your\s+daily\s+limit"
    r"|SendAsDenied|SubmissionQuotaExceeded",
    re.IGNORECASE,
)
"""How Postfix, Exim, Gmail and Microsoft word a refusal of us rather than of the recipient: our
relaying, our sender, our client host or address (a blocklist), our sending quota or rate. Postfix
makes its sender and client checks at RCPT by default. Each names what is ours: a recipient's rate
limit, or a recipient "not listed in our directory", is not."""
_ADDRESS_IS_BAD = re.compile(
    r"\b(?:user|mailbox|recipient|address)\s+(?:unknown|not\s+found|unavailable|does\s*n[o']t\s+exist)"
    r"|\bunknown\s+(?:user|mailbox|recipient|address)|\bno\s+such\s+(?:user|mailbox|recipient|address|account)"
    r"|\b(?:does\s+not|doesn't)\s+exist|\bunroute?able\b|\binvalid\s+(?:user|mailbox|recipient|address)"
    r"|\bno\s+mailbox\b|\b(?:account|mailbox)\s+(?:is\s+|has\s+been\s+)?(?:disabled|inactive|closed)"
    r"|\bdoes\s*n[o']t\s+have\s+an?\s+\S+\s+account\b",
    re.IGNORECASE,
)
"""Words that say the recipient's address is bad, for a reply without an enhanced status (Exim,
which sends none by default: "550 Unrouteable address", "550 No Such User Here"; Yahoo's "554
delivery error: dd This user doesn't have a yahoo.com account")."""
_NOT_FOR_GOOD = re.compile(
    r"\b(?:rate|quota|exceed\w*|limit\w*|temporar\w*|later|policy|spam|blocked)\b", re.IGNORECASE
)
"""Words that say a refusal is not about the address being bad, whatever else the reply says."""
_SENDER = re.compile(r"\bsender\b", re.IGNORECASE)


def _permanent_refusal(phase: str, code: int, text: str) -> str:
    """What a 5xx to RCPT or DATA refuses: "address" (the recipient's address is bad: a hard
    bounce), "sender" (the relay will not take mail from us: it does not relay for us, refuses our
    sender, our client host or its address, or our sending quota is spent) or "message" (this
    message, here: content, policy, size, a full mailbox). Anything else it is not sure of is
    "message": that fails one message, suppressing nobody, where a wrong "address" would drop a
    subscriber from every later campaign, and a wrong "sender" pauses a whole campaign."""
    text = text[:_CLASSIFIED_CHARS]
    status = _ENHANCED_STATUS.match(text)
    subject, detail = (int(status[1]), int(status[2])) if status is not None else (None, None)
    if subject == 1 and detail in (7, 8):  # X.1.7, X.1.8: the sender's mailbox or system address
        return "sender"
    # X.1.1-X.1.6 (the destination address: unknown, its system, its syntax, moved), X.1.10 (its
    # domain takes no mail: a null MX, RFC 7505), X.2.1 (the mailbox disabled) say the address is
    # bad, whatever the words (they may quote another server).
    addressing = (subject == 1 and detail in (1, 2, 3, 4, 5, 6, 10)) or (subject, detail) == (2, 1)
    if addressing and phase != "mail":
        return "address"
    # the reply's own words: not an address it echoes, not another server's reply it quotes
    own = _QUOTED.sub(" ", _ADDRESSES.sub(" ", text))
    if _REFUSES_US.search(own) or (subject, detail) == (4, 5):
        return "sender"  # X.4.5, mail system congestion (Gmail: "daily user sending limit exceeded")
    if phase == "mail" or _SENDER.search(own):  # words about a sender are not the recipient's bounce
        return "message"
    if subject is not None:
        # X.1.0, other address status; not a status of a subject-1 detail that RFC 3463 does not
        # define (Microsoft's 5.1.90: "you've reached your daily limit for message recipients")
        return "address" if (subject, detail) == (1, 0) else "message"
    # No enhanced status: RFC 5321's 550, 551 and 553 to RCPT name the mailbox, but Exim's ACLs and
    # its rate and quota limits answer 550 too ("550 Administrative prohibition"): the words decide,
    # and words of a limit or a policy say it is not for good.
    if (
        phase == "rcpt"
        and code in (550, 551, 553, 554)
        and _ADDRESS_IS_BAD.search(own)
        and not _NOT_FOR_GOOD.search(own)
    ):
        return "address"
    return "message"


class ClosedAfter(aiosmtplib.SMTPServerDisconnected):
    """The server closed the connection after these replies, before the rest: often its refusal, then
    the close (a 421; a 5xx to MAIL FROM from a relay that drops such clients)."""

    def __init__(self, replies: list[SMTPResponse]) -> None:
        super().__init__(f"the server closed the connection after {replies[-1].code} {replies[-1].message}"[:300])
        self.replies = replies


class _Replies(asyncio.Protocol):
    """The reading side of a connection taken over from aiosmtplib: replies, in order, however the
    server's bytes arrive (several replies in one segment, one reply over several)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._lost: Exception | None = None
        self._expired = False
        """The current wait for replies ran out of time."""

    @property
    def is_connected(self) -> bool:
        return self._lost is None and not self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self._lost = aiosmtplib.SMTPServerDisconnected("the server closed the connection")
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is None:
            lost = aiosmtplib.SMTPServerDisconnected("connection lost")
            lost.__cause__ = exc
            self._lost = lost
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def lost(self) -> Exception:
        return self._lost or aiosmtplib.SMTPServerDisconnected("connection lost")

    def write(self, data: bytes) -> None:
        if not self.is_connected:
            raise self.lost
        self.transport.write(data)

    def _parse(self) -> SMTPResponse | None:
        """One complete reply from the buffer (RFC 5321 4.2: ``250-...`` lines, then ``250 ...``)."""
        buffer = self._buffer
        end = buffer.find(b"\n")
        if end > 3 and buffer[3] == 0x20 and buffer[:3].isdigit():  # "250 ...": one line, the usual reply
            line = bytes(buffer[:end]).rstrip(b"\r")
            del buffer[: end + 1]
            return SMTPResponse(int(line[:3]), line[4:].decode("utf-8", "surrogateescape"))
        start = 0
        lines: list[bytes] = []
        while True:
            end = buffer.find(b"\n", start)
            if end == -1:
                if len(buffer) > _MAX_REPLY_BYTES:
                    raise aiosmtplib.SMTPResponseException(-1, "reply too long")
                return None
            line = bytes(buffer[start:end]).rstrip(b"\r")
            start = end + 1
            if len(line) < 3 or not line[:3].isdigit() or line[3:4] not in (b"", b" ", b"-"):
                raise aiosmtplib.SMTPResponseException(-1, f"malformed reply line {line[:80]!r}")
            if lines and line[:3] != buffer[:3]:  # the reply's first line starts the buffer
                # RFC 5321 4.2.1: each line of a reply has the same code. "550-..." then "250 ..."
                # cannot be read as either: read as its last line it was "accepted"
                raise aiosmtplib.SMTPResponseException(-1, f"reply lines with different codes {line[:80]!r}")
            lines.append(line[4:])
            if line[3:4] != b"-":
                del buffer[:start]
                return SMTPResponse(int(line[:3]), b"\n".join(lines).decode("utf-8", "surrogateescape"))

    async def replies(self, count: int, timeout: float) -> list[SMTPResponse]:
        """The next ``count`` replies, all within ``timeout`` seconds (aiosmtplib's timeout error if not).
        A connection closed after some of them raises ``ClosedAfter``, with those."""
        got: list[SMTPResponse] = []
        try:
            return await self._replies(count, timeout, got)
        except aiosmtplib.SMTPServerDisconnected as exc:
            if got:
                raise ClosedAfter(got) from exc
            raise

    async def _replies(self, count: int, timeout: float, got: list[SMTPResponse]) -> list[SMTPResponse]:
        while len(got) < count:  # replies already here need no timer (an envelope sent ahead, often)
            response = self._parse()
            if response is None:
                break
            got.append(response)
        if len(got) == count:
            return got
        # A timer that wakes the wait rather than asyncio.timeout(), which cancels and un-cancels
        # the task: this runs for every message, and a cancellation would have to be told apart
        # from the worker's own.
        self._expired = False
        timer = self._loop.call_later(timeout, self._expire)
        try:
            while len(got) < count:
                got.append(await self._reply(timeout))
            return got
        finally:
            timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        self._wake()

    async def _reply(self, timeout: float) -> SMTPResponse:
        while True:
            response = self._parse()
            if response is not None:
                return response
            if self._lost is not None:
                raise self._lost
            if self._expired:
                raise aiosmtplib.SMTPReadTimeoutError(f"no reply from the server within {timeout:g}s")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        # abort, not close: close would still flush what is buffered, e.g. the rest of a message
        # whose reply timed out, and make a duplicate of an uncertain send more likely
        self.transport.abort()


class SmtpChannel(Channel):
    def __init__(self, settings: SmtpSettings) -> None:
        self.settings = settings
        self.rate_bucket = f"transport:smtp:{settings.host}:{settings.port}"
        self._smtp: aiosmtplib.SMTP | None = None
        self._pipe: _Replies | None = None
        """Set when the connection was taken over for pipelining."""
        self._smtputf8 = False
        self._8bitmime = False
        self._dirty = False
        self._last_used = 0.0
        self._ahead: tuple[OutgoingMessage, bytes] | None = None
        """The lane's next message, and its content, whose envelope went out behind the last content."""
        self._transport: asyncio.Transport | None = None
        """The connection's transport, kept to abort it: aiosmtplib drops its own reference when it
        closes after a timeout, and its close still flushes what is buffered."""
        self._opened_at = 0.0
        """Wall-clock time just before the current connection was opened."""

    @property
    def pipelined(self) -> bool:
        return self._pipe is not None

    @property
    def connection(self) -> tuple[int, int, float] | None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return None
        local, server = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
        if not (isinstance(local, tuple) and isinstance(server, tuple) and len(local) >= 2 and len(server) >= 2):
            return None
        return int(local[1]), int(server[1]), self._opened_at

    def _connected(self) -> bool:
        if self._pipe is not None:
            return self._pipe.is_connected
        return self._smtp is not None and self._smtp.is_connected

    async def _rset(self, timeout: float) -> None:
        if self._pipe is not None:
            self._pipe.write(b"RSET\r\n")
            (response,) = await self._pipe.replies(1, timeout)
            if response.code != 250:
                raise aiosmtplib.SMTPResponseException(response.code, response.message)
        else:
            assert self._smtp is not None
            await self._smtp.rset(timeout=timeout)

    async def _connection(self, timeout: float) -> None:
        if self._connected():
            if not self._dirty and time.monotonic() - self._last_used <= _IDLE_PROBE_SECONDS:
                return
            # After a failed transaction, and before reusing an idle connection: reset the envelope,
            # and find out now (not mid-message) whether the server is still there.
            try:
                await self._rset(timeout)
            except (TimeoutError, aiosmtplib.SMTPException, OSError):
                logger.debug("RSET failed; reconnecting")
            else:
                self._dirty = False
                return
        await self.close()
        s = self.settings
        smtp = aiosmtplib.SMTP(
            hostname=s.host,
            port=s.port,
            use_tls=s.use_tls,
            start_tls=s.start_tls,
            username=s.username,
            password=s.password,
            timeout=timeout,
            validate_certs=s.validate_certs,
            local_hostname=s.local_hostname,
        )
        self._opened_at = time.time()
        await smtp.connect(timeout=timeout)
        if smtp.is_ehlo_or_helo_needed:
            # Extensions (SMTPUTF8, 8BITMIME, PIPELINING) are known only after EHLO.
            await smtp.ehlo(timeout=timeout)
        self._smtp = smtp
        self._transport = cast("asyncio.Transport | None", smtp.transport)  # uvloop's: the interface, not the class
        self._smtputf8 = smtp.supports_extension("smtputf8")
        self._8bitmime = smtp.supports_extension("8bitmime")
        transport = smtp.transport
        if s.pipelining and smtp.supports_extension("pipelining") and _can_take_over(transport):
            # Handshake done, no reply pending: from here on this channel reads the replies itself.
            pipe = _Replies(transport)
            transport.set_protocol(pipe)
            self._pipe = pipe
        self._dirty = False

    def _options(self, message: OutgoingMessage, data: bytes) -> tuple[list[str], str] | Permanent:
        """(MAIL FROM parameters, encoding of the envelope), or why this server cannot take the message.
        ``data``: the message, or its content as it follows DATA (ASCII or not alike)."""
        options: list[str] = []
        encoding = "ascii"
        if message.smtputf8:
            if not self._smtputf8:
                return Permanent(
                    f"{message.recipient!r} has a non-ASCII local part and the server does not offer "
                    "SMTPUTF8 (RFC 6531)"
                )
            options.append("SMTPUTF8")
            encoding = "utf-8"
        if not message.smtputf8 and self._8bitmime and not data.isascii():
            options.append("BODY=8BITMIME")
        return options, encoding

    def _envelope(self, message: OutgoingMessage, content: bytes) -> bytes | Permanent:
        """MAIL FROM, RCPT TO and DATA, as one pipelined write."""
        options = self._options(message, content)
        if isinstance(options, Permanent):
            return options
        mail_from, recipient = message.envelope_from, message.recipient
        if _NOT_IN_COMMAND.search(mail_from) or _NOT_IN_COMMAND.search(recipient):
            return Permanent(f"an address cannot go in an SMTP command: {mail_from!r} / {recipient!r}")
        extra = "".join(" " + option for option in options[0])
        try:
            return f"MAIL FROM:<{mail_from}>{extra}\r\nRCPT TO:<{recipient}>\r\nDATA\r\n".encode(options[1])
        except UnicodeEncodeError as exc:
            return Permanent(f"mail: an address cannot be written in ASCII: {exc}"[:500])

    def _content(self, message: OutgoingMessage) -> bytes:
        """The message as it follows DATA, with the relay's header first if it has one."""
        content = message.smtp_content()
        if self.settings.relay is None:
            return content
        return relay_header(self.settings.relay, message.job_id) + content

    def _next_ahead(self, follow: Follow | None) -> tuple[OutgoingMessage, bytes, bytes] | None:
        """The lane's next message, its content and its envelope, if it has one ready to go ahead."""
        if follow is None:
            return None
        try:
            message = follow()
            if message is None:
                return None
            content = self._content(message)
            envelope = self._envelope(message, content)
        except Exception:  # the next message's own send will meet (and report) the same problem
            logger.debug("the next message cannot go ahead", exc_info=True)
            return None
        if isinstance(envelope, Permanent):
            return None
        return message, content, envelope

    async def send(
        self, message: OutgoingMessage, *, timeout: float, gate: Gate | None = None, follow: Follow | None = None
    ) -> Outcome:
        timeout = min(timeout, self.settings.timeout)  # the URL's ?timeout= caps every step
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead[0] is message and self._pipe is not None and self._pipe.is_connected:
                # its envelope went out behind the previous content: read its replies, go on
                return await self._send_pipelined(self._pipe, message, ahead[1], None, timeout, gate, follow)
            # an open transaction this message does not continue: only closing ends it safely
            await self.close()
        phase = "connect"
        try:
            await self._connection(timeout)
            if self._pipe is not None:
                content = self._content(message)
                envelope = self._envelope(message, content)
                if isinstance(envelope, Permanent):
                    return envelope
                return await self._send_pipelined(self._pipe, message, content, envelope, timeout, gate, follow)
            data = relay_header(self.settings.relay, message.job_id) + message.as_bytes()  # aiosmtplib frames it
            options = self._options(message, data)
            if isinstance(options, Permanent):
                return options
            smtp = self._smtp
            assert smtp is not None
            phase = "mail"
            await smtp.mail(message.envelope_from, options=options[0], encoding=options[1], timeout=timeout)
            phase = "rcpt"
            await smtp.rcpt(message.recipient, encoding=options[1], timeout=timeout)
            if gate is not None:
                # The envelope is on the server; nothing is delivered until DATA. The caller may hold
                # the message here (its previous one is being recorded) or withdraw it.
                left = await self._await_gate(gate)
                if left is None:
                    self._dirty = True  # RSET before the next message
                    return Withheld("withheld before DATA")
                timeout = max(min(timeout, left, self.settings.timeout), 0.1)
                if not smtp.is_connected:  # lost while the gate held it: nothing of the content went out
                    raise aiosmtplib.SMTPServerDisconnected("the connection was lost before DATA")
            phase = "data"
            try:
                # aiosmtplib's timeout is per reply (the 354, then the final one): the whole exchange
                # must end within the budget, which the worker keeps inside the lease.
                async with asyncio.timeout(timeout):
                    response = await smtp.data(data, timeout=timeout)
            except TimeoutError:
                raise aiosmtplib.SMTPReadTimeoutError(f"the DATA exchange did not end within {timeout:g}s") from None
        except aiosmtplib.SMTPResponseException as exc:
            # In the data phase this may be the answer to the content (aiosmtplib does not say which
            # reply it was): only a real 4xx or 5xx there says the message was not taken.
            return await self._refused(phase, exc.code, exc.message, content_sent=phase == "data")
        except (TimeoutError, aiosmtplib.SMTPException, OSError) as exc:
            await self.close()
            # Past the start of DATA the server may have accepted the message before we lost it.
            # Before MAIL (no connection, a greeting, TLS or login that failed) the relay is down for
            # every message alike: a transport-wide failure.
            return Retry(f"{phase}: {_describe(exc)}", uncertain=phase == "data", transport_wide=phase == "connect")
        except UnicodeEncodeError as exc:
            # an address that needs SMTPUTF8 where the envelope cannot carry it
            self._dirty = True
            return Permanent(f"{phase}: an address cannot be written in ASCII: {exc}"[:500])
        except Exception as exc:  # anything else must not take the worker down with it
            logger.exception("unexpected error sending %s", message.job_id)
            await self.close()
            return Retry(f"{phase}: unexpected {_describe(exc)}", uncertain=phase == "data")
        self._last_used = time.monotonic()
        return Accepted(f"{response.code} {response.message}"[:300])

    async def _refused(self, phase: str, code: int, text: str, *, content_sent: bool = False) -> Outcome:
        """The server answered, and said no: nothing was delivered by this exchange.

        Unless the content went out and the answer to it is not a 4xx or 5xx: a line that is not a
        reply at all (code -1), or an odd positive one. The server may have taken the message; the
        connection is out of step: close it, and a re-send is a possible duplicate (uncertain)."""
        if content_sent and not 400 <= code < 600:
            await self.close()
            return Retry(f"{phase}: unexpected answer to the content: {code} {text}"[:500], uncertain=True)
        self._dirty = True
        if code == 421:
            # The server is closing the connection (RFC 5321: the service is not available).
            await self.close()
            if content_sent:
                # It read the whole message first, and said no to it: this message's try, counted
                # like a 451 to its content. Uncounted, a message the relay answers so every time
                # (a content or reputation filter's "421 4.7.0") was tried for ever, a few times a
                # second while other mail went through, and held its campaign in "sending". A relay
                # that is down meets the next message at its connection, where a 421 is the outage's.
                # (Without pipelining, aiosmtplib reads DATA's 354 and the content's answer as one
                # exchange: a 421 to the DATA command itself is counted so too.)
                return Retry(f"{phase}: {code} {text}"[:500])
            # At the greeting or to the envelope: its state, not this message's. Retry, not counted,
            # while the lanes pause.
            return Retry(f"{phase}: {code} {text}"[:500], transport_wide=True)
        if phase == "connect":
            # A refused greeting, STARTTLS or login says nothing about this message: the server or
            # its settings are wrong, and every message would fail alike. Retry, not counted against
            # the message, while the lanes pause (the worker's outage backoff).
            await self.close()
            return Retry(f"{phase}: {code} {text}"[:500], transport_wide=True)
        if phase == "mail" and code in _MAIL_NEEDS_LOGIN:
            # Authentication or TLS required (RFC 4954, RFC 3207): this connection's standing, the
            # same for every message, as a refused login is.
            await self.close()
            return Retry(f"{phase}: {code} {text}"[:500], transport_wide=True)
        if phase == "mail" and code == 503 and "auth" in text.lower():
            # "503 ... authentication required" (a server's way of saying 530): transport-wide
            await self.close()
            return Retry(f"{phase}: {code} {text}"[:500], transport_wide=True)
        if phase == "mail" and code in _MAIL_OUT_OF_STEP:
            # a new connection starts a new session; counted, like any failure of this message's try
            await self.close()
            return Retry(f"{phase}: {code} {text}"[:500])
        if phase == "mail" and 500 <= code < 600 and code not in _MAIL_REFUSES_MESSAGE:
            # MAIL FROM names the sender only: a 5xx refuses the sender (not allowed to relay for its
            # domain, a sender policy, this client blocked), never this recipient, and every message
            # from that sender would meet it. Failed at once, a whole campaign would end failed on
            # a relay's setting; the worker pauses the campaign instead (Retry.sender_wide).
            return Retry(f"{phase}: {code} {text}"[:500], sender_wide=True)
        if 500 <= code < 600:
            refusal = _permanent_refusal(phase, code, text)
            if refusal == "sender":
                return Retry(f"{phase}: {code} {text}"[:500], sender_wide=True)
            # Failed for good; a hard bounce (the address suppressed) only when the reply says the
            # address is bad: a 5xx that refuses the content, or says "not by policy", is not the
            # subscriber's fault, and suppressing for it would drop them from every later campaign.
            return Permanent(f"{phase}: {code} {text}"[:500], hard_bounce=refusal == "address")
        return Retry(f"{phase}: {code} {text}"[:500])

    async def _send_pipelined(
        self,
        pipe: _Replies,
        message: OutgoingMessage,
        content: bytes,
        envelope: bytes | None,
        timeout: float,
        gate: Gate | None,
        follow: Follow | None,
    ) -> Outcome:
        """``content``: the message as it follows DATA; ``envelope`` None: it already went out, behind
        the previous message's content."""
        phase = "mail"
        content_sent = False
        try:
            if envelope is not None:
                pipe.write(envelope)
            try:
                mail, rcpt, start = await pipe.replies(3, timeout)
            except ClosedAfter as exc:
                # The server said no, then closed: its no is the answer (nothing of the content went out).
                await self.close()
                for step, response, good in zip(("mail", "rcpt"), exc.replies, ((250,), (250, 251)), strict=False):
                    if response.code not in good:
                        return await self._refused(step, response.code, response.message)
                raise
            if start.code == 354 and (mail.code != 250 or rcpt.code not in (250, 251)):
                # A server must refuse DATA when the envelope failed; one that did not now waits for
                # content that must not be sent. Only closing the connection ends that safely.
                await self.close()
                if mail.code != 250:
                    return await self._refused("mail", mail.code, mail.message)
                return await self._refused("rcpt", rcpt.code, rcpt.message)
            for phase, response, good in (("mail", mail, (250,)), ("rcpt", rcpt, (250, 251)), ("data", start, (354,))):
                if response.code not in good:
                    return await self._refused(phase, response.code, response.message)
            # The lane's next message is made now, while the gate below most often waits anyway (for
            # the previous record), rather than between the gate and this content.
            ahead = self._next_ahead(follow)
            if gate is not None:
                # The server waits for the content; nothing is delivered before its final dot. The
                # caller may hold the message here (its previous one is being recorded) or withdraw it.
                left = await self._await_gate(gate)
                if left is None:
                    # A DATA in progress cannot be reset: close, and the server drops the transaction.
                    await self.close()
                    return Withheld("withheld before the content")
                timeout = max(min(timeout, left, self.settings.timeout), 0.1)
            phase = "data"
            if not pipe.is_connected:  # lost while the gate held it: nothing of the content went out
                raise pipe.lost
            content_sent = True
            if ahead is None:
                pipe.write(content)
            else:
                pipe.write(content + ahead[2])
                # from here, whatever ends this exchange early closes the connection, and this with it
                self._ahead = (ahead[0], ahead[1])
            (response,) = await pipe.replies(1, timeout)
            if response.code != 250:
                return await self._refused("data", response.code, response.message, content_sent=True)
        except aiosmtplib.SMTPResponseException as exc:  # a reply we cannot read
            await self.close()
            return Retry(f"{phase}: {exc.code} {exc.message}"[:500], uncertain=content_sent)
        except (TimeoutError, aiosmtplib.SMTPException, OSError) as exc:
            await self.close()
            # Once the content went out the server may have accepted it before we lost the reply.
            return Retry(f"{phase}: {_describe(exc)}", uncertain=content_sent)
        except Exception as exc:  # anything else must not take the worker down with it
            logger.exception("unexpected error sending %s", message.job_id)
            await self.close()
            return Retry(f"{phase}: unexpected {_describe(exc)}", uncertain=content_sent)
        self._last_used = time.monotonic()
        return Accepted(f"{response.code} {response.message}"[:300])

    async def _await_gate(self, gate: Gate) -> float | None:
        """The caller's gate, awaited while the server holds a transaction open (after RCPT, or
        after the 354). Cancelled there (or failing), the connection is out of step: it is closed, or
        the next message's envelope would be written into this one's content."""
        try:
            return await gate()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._ahead = None
        smtp, self._smtp = self._smtp, None
        pipe, self._pipe = self._pipe, None
        transport, self._transport = self._transport, None
        try:
            if pipe is not None:
                pipe.close()
            else:
                if transport is not None:
                    # abort, as for a taken-over connection (see _Replies.close): a content still
                    # buffered after a timeout must not go out late, and make a duplicate more likely
                    transport.abort()
                if smtp is not None and smtp.is_connected:
                    smtp.close()
        except Exception:  # closing a broken connection may fail; nothing is lost
            logger.debug("closing SMTP connection failed", exc_info=True)
