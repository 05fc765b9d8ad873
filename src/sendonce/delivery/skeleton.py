"""A campaign compiled once into the bytes it sends, with a hole for each recipient's values.

Every message of a campaign has the same structure: the same headers, the same MIME parts, the same
static text, with a few values per recipient (the name, the address, the unsubscribe link, the job
id). The composer's general path renders the templates, writes the MIME message and dot-stuffs it for
SMTP for every recipient; measured in a worker, that was a quarter to a third of its time per message
(bench/out/steps/README.md). A skeleton is that same general path, run once on placeholders and cut
at them: per recipient only the values are computed and joined in.

It writes only what the general path would write, byte for byte; a property test holds the two to
it. That is the case when each body value is printable ASCII on one line (no line break, no tab),
keeps its line within 998 characters, and does not begin a line with a dot, and the assembled bodies
still qualify for 7bit (no whitespace at a line end, no MIME boundary). Anything else (a name in
another script, a value with a line break, DKIM signing, an SMTPUTF8 recipient, a campaign whose
static parts are not 7bit ASCII or whose templates need Jinja) goes through the general path.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from html import escape as escape_attribute
from operator import itemgetter
from typing import Any

from markupsafe import escape

from sendonce.delivery.render import MAX_OUTPUT, CompiledTemplate, plain_value
from sendonce.domain.dkim import DkimKey
from sendonce.domain.jobs import JOB_ID_HEADER
from sendonce.domain.message import OutgoingMessage, encode_header_value

_MAX_LINE = 998
"""RFC 5322 2.1.1, as the MIME writer checks it for 7bit bodies."""
_HEADER_KEYS = frozenset({"T", "S", "D", "M", "J", "L"})
"""Holes for whole header values: To, Subject, Date, Message-ID, Sendonce-Job-Id, List-Unsubscribe."""


@dataclass(frozen=True, slots=True)
class MessageHead:
    """What a campaign message says about its recipient and itself, beside its rendered content."""

    job_id: str
    recipient: str
    smtputf8: bool
    to_header: str
    message_id: str
    date: str
    list_unsubscribe: str
    """The List-Unsubscribe value (RFC 2369): the one-click URL, then a mailto: fallback if configured."""
    dkim: DkimKey | None = None
    key_maybe_used: bool = True


Footers = Callable[[str, "str | None", str, "str | None"], "tuple[str, str | None]"]
"""(text, html, url, the HTML part's url) -> the bodies with the unsubscribe footers, as the general
path adds them."""
Make = Callable[[MessageHead, str, str, "str | None"], OutgoingMessage]
"""(head, subject, text, html) -> the message, as the general path writes it."""


@dataclass(frozen=True, slots=True)
class _BodyValue:
    """What a value must respect to take its place in the bodies unchanged."""

    budget: int
    """Longest value that keeps every line it is on within 998 characters."""
    line_start: bool
    """It begins a line somewhere: a leading dot would be doubled on the wire."""
    dot_after: bool
    """A dot follows it where it begins a line: empty, it would leave that dot at the line's start."""
    at_end: bool
    """It ends a body that has no line end after it: empty, the body would end as its static part does."""


class _Cut:
    """A probe cut at its placeholders: the pieces to join, its static text and each hole's value."""

    def __init__(self, name: str, text: str, pattern: re.Pattern[str]) -> None:
        pieces = pattern.split(text)
        self.keys: list[str] = pieces[1::2]
        self.statics = {f"~{name}{index}": piece for index, piece in enumerate(pieces[0::2])}
        order = [key for pair in zip(self.statics, [*self.keys, ""], strict=True) for key in pair if key]
        self._pieces: Callable[[Mapping[str, str]], tuple[str, ...]] = (
            itemgetter(*order) if len(order) > 1 else lambda values: (values[order[0]],)
        )

    def fill(self, values: Mapping[str, str]) -> str:
        """The text with ``values`` in its holes (``values`` holds the static pieces too)."""
        return "".join(self._pieces(values))


class Skeleton:
    """A campaign's message with holes: see the module's docstring."""

    def __init__(
        self,
        paths: dict[tuple[str, ...], int],
        subject: _Cut,
        text: _Cut,
        html: _Cut | None,
        wire: _Cut,
        body_values: dict[str, _BodyValue],
        boundary: str,
        footers: bool,
    ) -> None:
        html_keys = set(html.keys) if html is not None else set()
        # (path, its key in text, its key in HTML or None when no HTML part shows it)
        self._paths = tuple(
            (path, f"t{index}", f"h{index}" if f"h{index}" in html_keys else None) for path, index in paths.items()
        )
        self._subject, self._text, self._html, self._wire = subject, text, html, wire
        self._base = {
            **subject.statics,
            **text.statics,
            **(html.statics if html is not None else {}),
            **wire.statics,
        }
        self._body_values = tuple(body_values.items())
        self._footers = footers
        # Written with values, the content must hold these as often as it does with placeholders
        # (more: a value made one): the boundary (the bodies would go quoted-printable), and
        # whitespace before a line end (idem, or a header the general path writes so too).
        probe = wire.fill(self._base | dict.fromkeys(wire.keys, "x"))
        self._counted = tuple((needle, probe.count(needle)) for needle in (boundary, " \r\n", "\t\r\n"))

    @staticmethod
    def of(
        subject: CompiledTemplate,
        text: CompiledTemplate,
        html: CompiledTemplate | None,
        boundary: str,
        *,
        footers: Footers,
        make: Make,
    ) -> Skeleton | None:
        """The campaign's skeleton, or None if its messages need the general path."""
        parts = [template.parts for template in (subject, text, html) if template is not None]
        if any(p is None for p in parts):
            return None  # a template only Jinja can render
        nonce = secrets.token_hex(6)
        pattern = re.compile(f"Zq{nonce}([A-Za-z0-9]+)qZ")

        def hole(key: str) -> str:
            return f"Zq{nonce}{key}qZ"

        paths: dict[tuple[str, ...], int] = {}

        def probe(template: CompiledTemplate, prefix: str) -> str:
            out = []
            for part in template.parts or ():
                if isinstance(part, str):
                    out.append(part)
                else:
                    out.append(hole(f"{prefix}{paths.setdefault(part, len(paths))}"))
            return "".join(out)

        subject_probe = probe(subject, "t")
        text_probe, html_probe = footers(
            probe(text, "t"), probe(html, "h") if html is not None else None, hole("U"), hole("UH")
        )
        head = MessageHead(
            job_id=hole("J"),
            recipient="probe@skeleton.invalid",
            smtputf8=False,
            to_header=hole("T"),
            message_id=hole("M"),
            date=hole("D"),
            list_unsubscribe=hole("L"),
        )
        message = make(head, hole("S"), text_probe, html_probe)
        data = message.smtp_content()
        if not data.isascii():
            return None  # SMTPUTF8 or 8-bit static parts: the general path
        wire = data.decode("ascii")
        if "Content-Transfer-Encoding: quoted-printable" in wire:
            return None  # a static part that is not 7bit: every value would change its encoding
        bodies = [b for b in (text_probe, html_probe) if b is not None]
        found = pattern.findall(wire)
        if sorted(k for k in found if k not in _HEADER_KEYS) != sorted(k for b in bodies for k in pattern.findall(b)):
            return None  # a placeholder changed on the way (it cannot, but then nothing is assumed)
        if sorted(k for k in found if k in _HEADER_KEYS) != sorted(_HEADER_KEYS):
            return None
        body_values: dict[str, _BodyValue] = {}
        for body in bodies:
            if not _analyse(body, pattern, body_values):
                return None
        return Skeleton(
            paths,
            _Cut("s", subject_probe, pattern),
            _Cut("t", text_probe, pattern),
            _Cut("h", html_probe, pattern) if html_probe is not None else None,
            _Cut("w", wire, pattern),
            body_values,
            boundary,
            footers=any(key in ("U", "UH") for key in pattern.findall(text_probe + (html_probe or ""))),
        )

    def render(
        self, context: Mapping[str, Any], head: MessageHead, unsubscribe_url: str
    ) -> tuple[str, str, str | None, bytes] | None:
        """(subject, text, html, SMTP content) for one recipient, or None: the general path must write it."""
        values = self._base.copy()
        for path, text_key, html_key in self._paths:
            value = plain_value(context, path)
            if value is None:
                return None
            values[text_key] = str(value)
            if html_key is not None:
                values[html_key] = str(escape(value))
        if self._footers:
            values["U"] = unsubscribe_url
            values["UH"] = escape_attribute(unsubscribe_url, quote=True)
        for key, rule in self._body_values:
            value = values[key]
            if not (value.isascii() and value.isprintable()) or len(value) > rule.budget:
                return None
            if rule.line_start and value.startswith("."):
                return None
            if not value and ((rule.line_start and rule.dot_after) or rule.at_end):
                return None
        subject = self._subject.fill(values)
        if len(subject) > MAX_OUTPUT:
            return None
        values["S"] = encode_header_value(subject, "Subject")
        values["L"] = encode_header_value(head.list_unsubscribe, "List-Unsubscribe")
        values["J"] = encode_header_value(head.job_id, JOB_ID_HEADER)
        values["T"], values["M"], values["D"] = head.to_header, head.message_id, head.date
        for key in ("T", "M", "D", "S", "L", "J"):
            if "\n" in values[key] and (key in "TMD" or "\n." in values[key]):
                return None  # a header line that would begin with a dot (never written so, but not assumed)
        wire = self._wire.fill(values)
        for needle, count in self._counted:
            if wire.count(needle) != count:
                return None
        text = self._text.fill(values)
        html = self._html.fill(values) if self._html is not None else None
        return subject, text, html, wire.encode("utf-8")


def _analyse(body: str, pattern: re.Pattern[str], rules: dict[str, _BodyValue]) -> bool:
    """Record what each value of ``body`` (a probe) must respect; False if the body cannot take values
    safely at all (two holes side by side, or static text that leaves no room)."""
    normalized = body.replace("\r\n", "\n").replace("\r", "\n")  # as the MIME writer measures lines
    if len(pattern.sub("", normalized)) + 998 * len(pattern.findall(normalized)) > MAX_OUTPUT:
        return False
    for line in normalized.split("\n"):
        pieces = pattern.split(line)
        keys = pieces[1::2]
        if not keys:
            continue
        statics = pieces[0::2]
        if any(not static for static in statics[1:-1]):
            return False  # two values side by side: what lies around each one depends on the other
        room = (_MAX_LINE - sum(map(len, statics))) // len(keys)
        if room < 1:
            return False
        for index, key in enumerate(keys):
            line_start = index == 0 and not statics[0]
            rule = rules.get(key)
            merged = _BodyValue(
                budget=min(room, rule.budget) if rule else room,
                line_start=line_start or (rule.line_start if rule else False),
                dot_after=(line_start and statics[index + 1].startswith(".")) or (rule.dot_after if rule else False),
                at_end=(rule.at_end if rule else False),
            )
            rules[key] = merged
    # a value that ends the body (nothing after it, not even a line end)
    last = pattern.split(normalized)
    if len(last) > 1 and last[-1] == "":
        key = last[-2]
        rule = rules[key]
        rules[key] = _BodyValue(rule.budget, rule.line_start, rule.dot_after, at_end=True)
    return True
