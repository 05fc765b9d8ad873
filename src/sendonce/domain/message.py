"""An outgoing message, and its RFC 5322 / MIME form.

The MIME writer is deliberately small: a campaign sends the same structure to every recipient,
so building a full ``email.message.EmailMessage`` per recipient (its policy machinery, header
objects and generator) would cost more than the network. The parts that need care (RFC 2047
encoded words, address quoting, quoted-printable where plain 7bit text will not do) use the
standard library's encoders; tests parse the result back with ``email.policy.default`` to check it.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass, field
from email.header import Header
from email.utils import formataddr

from sendonce.domain.dkim import DkimKey
from sendonce.domain.jobs import JOB_ID_HEADER

CRLF = "\r\n"

RESERVED_HEADERS = frozenset(
    {
        "from",
        "to",
        "subject",
        "date",
        "message-id",
        "mime-version",
        "content-type",
        "content-transfer-encoding",
        "dkim-signature",
        JOB_ID_HEADER.lower(),
    }
)
"""Headers sendonce writes itself (lower case): a transactional message's own headers cannot set them."""
RESERVED_HEADER_PREFIXES = ("x-pm-metadata-", "x-smtpapi")
"""Relays' metadata headers (Postmark's, SendGrid's), which their webhooks echo and sendonce reads to
find a bounce's delivery: set by an account, they could send its own bounce to another account's
delivery, and suppress that account's subscriber."""


def is_reserved_header(name: str) -> bool:
    """A header a transactional message's own headers cannot set (see :data:`RESERVED_HEADERS`)."""
    lowered = name.lower()
    return lowered in RESERVED_HEADERS or lowered.startswith(RESERVED_HEADER_PREFIXES)


_HEADER_NAME = re.compile(r"[!-9;-~]+")


def is_header_name(name: str) -> bool:
    """A header field name (RFC 5322): printable ASCII but the colon, nothing else."""
    return _HEADER_NAME.fullmatch(name) is not None


def encode_header_value(value: str, name: str) -> str:
    """A header value safe for the wire: RFC 2047 encoded words when needed, folded when long.

    ASCII values are folded only between the items of a list (``a, b`` -> ``a,`` CRLF `` b``), never
    inside one: a URL or an address stays whole. One that would still make a line longer than 998
    characters is written as encoded words instead, which fold anywhere.
    """
    cleaned = value.replace("\r", " ").replace("\n", " ")
    if cleaned.isascii():
        if len(cleaned) + len(name) + 2 <= 78:
            return cleaned
        folded = ("," + CRLF + " ").join(cleaned.split(", "))
        if name.lower() in _STRUCTURED or all(len(line) <= MAX_LINE - len(name) - 2 for line in folded.split(CRLF)):
            return folded
        # A line over 998 characters (a long subject without ", "): relays refuse or wrap it, and a
        # wrap breaks the DKIM signature. Encoded words may be folded anywhere.
    return Header(cleaned, "utf-8", header_name=name).encode(linesep=CRLF)


_STRUCTURED = frozenset({"list-unsubscribe", "list-unsubscribe-post"})
"""Headers whose readers take no encoded words (RFC 2369's ``<url>`` items): folded between items only."""

MAX_LINE = 998
"""Characters a line of a message may have, its CRLF aside (RFC 5322 2.1.1)."""


_SPECIALS = re.compile(r'[][\\()<>@,:;".]')
"""RFC 5322 specials (as ``email.utils`` has them): a display name with one is quoted."""


def format_address(name: str | None, address: str) -> str:
    """``Name <addr>`` with the name quoted or RFC 2047 encoded as needed.

    An address with a non-ASCII local part is written raw (UTF-8, RFC 6532): such a message can only
    be sent to a server that offers SMTPUTF8, which the SMTP transport checks.
    """
    if not name:
        return address
    cleaned = name.replace("\r", " ").replace("\n", " ")
    if address.isascii():
        if cleaned.isascii() and not _SPECIALS.search(cleaned):
            return f"{cleaned} <{address}>"  # what formataddr writes for such a name, without its work
        return formataddr((cleaned, address), charset="utf-8")
    return f"{formataddr((cleaned, 'x@x'), charset='utf-8')[: -len('<x@x>')]}<{address}>"


_LINE_END = re.compile(rb"\r\n|\r|\n")


def wire_content(data: bytes) -> bytes:
    """A message as it follows SMTP DATA: CRLF line ends, leading dots doubled (RFC 5321 4.5.2), the
    final dot."""
    # no bare CR and no bare LF: as many CRLFs as LFs and as CRs
    lines = data.count(b"\n")
    if data.count(b"\r\n") != lines or data.count(b"\r") != lines:
        data = _LINE_END.sub(b"\r\n", data)
    if data.startswith(b"."):
        data = b"." + data
    data = data.replace(b"\r\n.", b"\r\n..")
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    return data + b".\r\n"


_MAX_LINE = 998
"""RFC 5322 2.1.1: a line is at most 998 characters, CRLF excluded."""


def _encode_body(text: str, boundary: str) -> tuple[str, str]:
    """(Content-Transfer-Encoding, the body with CRLF line ends) for one text part.

    Plain ASCII text with short lines goes as it is (7bit): most newsletters are such text, and
    quoted-printable would cost a pass over every body and grow it (every ``=`` of an HTML attribute
    becomes ``=3D``). Anything else is quoted-printable of its UTF-8 (RFC 2045): non-ASCII text, a
    line longer than the limit, a NUL, whitespace at the end of a line (relays may strip it, and the
    body would no longer match its DKIM signature under simple canonicalization), or text that holds
    the multipart boundary: a subscriber's name or a payload could otherwise end the part and add
    parts of its own. Boundaries begin with ``=_``, which quoted-printable output cannot contain.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if (
        text.isascii()
        and boundary not in text
        and "\0" not in text
        and " \n" not in text
        and "\t\n" not in text
        and not text.endswith((" ", "\t"))
        and (len(text) <= _MAX_LINE or max(map(len, text.split("\n"))) <= _MAX_LINE)
    ):
        return "7bit", text.replace("\n", CRLF)
    # pure C in binascii
    return "quoted-printable", binascii.b2a_qp(text.encode("utf-8"), istext=True).decode("ascii").replace("\n", CRLF)


@dataclass(slots=True)
class OutgoingMessage:
    """One message to one recipient, as every transport needs it."""

    job_id: str
    envelope_from: str
    recipient: str
    """The recipient as it goes on the wire (A-label domain)."""
    smtputf8: bool
    """The recipient's local part is non-ASCII: the message needs SMTPUTF8 (RFC 6531)."""
    from_header: str
    to_header: str
    subject: str
    text: str
    html: str | None
    message_id: str
    date: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    """Extra headers, in order (Sendonce-Job-Id, List-Unsubscribe, ...)."""
    boundary: str = "=_sendonce_boundary"
    """Begins with ``=_``: quoted-printable output never contains it."""
    dkim: DkimKey | None = None
    """Sign the message with this key (SMTP; an HTTP provider signs with its own)."""
    key_maybe_used: bool = True
    """An earlier attempt of this job may have reached the transport (the row is uncertain), so an
    idempotent provider may know its key already. False: no earlier request can have registered it."""
    smtp_data: bytes | None = None
    """What :meth:`smtp_content` returns, when the composer made it along with the rest (a campaign's
    compiled skeleton: sendonce.delivery.skeleton); None: made from :meth:`as_bytes` when asked."""

    def smtp_content(self) -> bytes:
        """The message as it follows SMTP DATA: ``wire_content(self.as_bytes())``."""
        return self.smtp_data if self.smtp_data is not None else wire_content(self.as_bytes())

    def header_block(self) -> str:
        lines = [
            f"From: {self.from_header}",
            f"To: {self.to_header}",
            f"Subject: {encode_header_value(self.subject, 'Subject')}",
            f"Date: {self.date}",
            f"Message-ID: {self.message_id}",
            "MIME-Version: 1.0",
        ]
        lines.extend(f"{name}: {encode_header_value(value, name)}" for name, value in self.headers)
        return CRLF.join(lines)

    def as_bytes(self) -> bytes:
        """The whole message in RFC 5322 form, CRLF line ends."""
        encoding, text = _encode_body(self.text, self.boundary)
        text_part = f'Content-Type: text/plain; charset="utf-8"{CRLF}Content-Transfer-Encoding: {encoding}'
        if self.html is None:
            body = text_part + CRLF + CRLF + text
        else:
            encoding, html = _encode_body(self.html, self.boundary)
            html_part = f'Content-Type: text/html; charset="utf-8"{CRLF}Content-Transfer-Encoding: {encoding}'
            b = self.boundary
            body = (
                f'Content-Type: multipart/alternative; boundary="{b}"{CRLF}{CRLF}'
                f"--{b}{CRLF}{text_part}{CRLF}{CRLF}{text}{CRLF}"
                f"--{b}{CRLF}{html_part}{CRLF}{CRLF}{html}{CRLF}"
                f"--{b}--{CRLF}"
            )
        data = (self.header_block() + CRLF + body).encode("utf-8")
        if self.dkim is not None:
            return self.dkim.sign(data) + data
        return data
