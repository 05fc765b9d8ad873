"""The hand-written MIME writer, checked by parsing its output with the standard library."""

from __future__ import annotations

import email
import email.policy
from email.message import EmailMessage

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sendonce.domain.message import OutgoingMessage, format_address


def _message(**overrides: object) -> OutgoingMessage:
    fields: dict[str, object] = {
        "job_id": "campaign:1:2",
        "envelope_from": "news@sender.test",
        "recipient": "ann@example.test",
        "smtputf8": False,
        "from_header": format_address("Acme News", "news@sender.test"),
        "to_header": format_address("Ann", "ann@example.test"),
        "subject": "Hello",
        "text": "Plain body\nsecond line",
        "html": None,
        "message_id": "<campaign.1.2@sender.test>",
        "date": "Sun, 29 Nov 2026 12:00:00 GMT",
        "headers": [("Sendonce-Job-Id", "campaign:1:2")],
    }
    fields.update(overrides)
    return OutgoingMessage(**fields)  # type: ignore[arg-type]


def _parse(data: bytes) -> EmailMessage:
    parsed = email.message_from_bytes(data, policy=email.policy.default)
    assert isinstance(parsed, EmailMessage)
    return parsed


def test_text_only_message_round_trips() -> None:
    data = _message().as_bytes()
    assert b"\r\n" in data and b"\n" not in data.replace(b"\r\n", b"")
    parsed = _parse(data)
    assert parsed["From"] == "Acme News <news@sender.test>"
    assert parsed["To"] == "Ann <ann@example.test>"
    assert parsed["Message-ID"] == "<campaign.1.2@sender.test>"
    assert parsed["Sendonce-Job-Id"] == "campaign:1:2"
    assert parsed["MIME-Version"] == "1.0"
    assert parsed.get_content_type() == "text/plain"
    assert parsed.get_content().replace("\r\n", "\n") == "Plain body\nsecond line"
    assert not parsed.defects


def test_multipart_with_unicode_subject_name_and_bodies() -> None:
    data = _message(
        subject="Café — ünïcödé news, a subject long enough to need folding across more than one line",
        to_header=format_address("Zoë Ærøskøbing", "zoe@example.test"),
        text="Grüße aus Köln " * 20,
        html="<p>Grüße <b>aus</b> Köln</p>",
    ).as_bytes()
    assert data.isascii()  # 7-bit safe: encoded words and quoted-printable
    assert data.count(b"Content-Transfer-Encoding: quoted-printable") == 2  # non-ASCII bodies
    parsed = _parse(data)
    assert parsed["Subject"] == "Café — ünïcödé news, a subject long enough to need folding across more than one line"
    assert parsed["To"].addresses[0].display_name == "Zoë Ærøskøbing"
    assert parsed.get_content_type() == "multipart/alternative"
    plain = parsed.get_body(("plain",))
    html = parsed.get_body(("html",))
    assert plain is not None and html is not None
    assert plain.get_content().strip() == ("Grüße aus Köln " * 20).strip()
    assert html.get_content().strip() == "<p>Grüße <b>aus</b> Köln</p>"
    assert not parsed.defects


def test_header_injection_through_a_name_or_subject_is_neutralized() -> None:
    data = _message(
        subject="Hi\r\nBcc: victim@example.test",
        to_header=format_address("X\r\nBcc: v@x.test", "a@example.test"),
    ).as_bytes()
    parsed = _parse(data)
    assert parsed["Bcc"] is None


@pytest.mark.parametrize("subject", ["w" * 2000, "word " * 400, "a, " * 500 + "z"], ids=["one-word", "words", "list"])
def test_no_header_line_is_longer_than_998_characters(subject: str) -> None:
    # a long ASCII value was written on one line (a 998-character campaign subject made a line of
    # 1,007): relays refuse or wrap such a line, and a wrap breaks the DKIM signature
    data = _message(subject=subject, headers=[("X-Long", "v" * 1500)]).as_bytes()
    head = data.split(b"\r\n\r\n", 1)[0]
    assert max(len(line) for line in head.split(b"\r\n")) <= 998
    parsed = _parse(data)
    assert parsed["Subject"].strip() == subject.strip() and parsed["X-Long"] == "v" * 1500


def test_list_unsubscribe_is_never_written_as_encoded_words() -> None:
    # RFC 2369 readers take "<url>" items only: an encoded word would lose one-click unsubscribe
    value = f"<https://example.test/u/{'t' * 1000}>, <mailto:unsubscribe@example.test>"  # over 998 even so
    data = _message(headers=[("List-Unsubscribe", value)]).as_bytes()
    assert b"=?utf-8?" not in data
    assert _parse(data)["List-Unsubscribe"] == value


def test_lines_starting_with_a_dot_and_long_lines_survive() -> None:
    text = ".leading dot\n" + "x" * 2000
    parsed = _parse(_message(text=text).as_bytes())
    assert parsed.get_content().replace("\r\n", "\n") == text


def _part_encodings(data: bytes) -> list[str]:
    return [str(part["Content-Transfer-Encoding"]) for part in _parse(data).walk() if not part.is_multipart()]


def test_plain_ascii_bodies_go_as_they_are() -> None:
    html = '<p style="color: #222">Hello <a href="https://x.test/?a=1&b=2">there</a></p>\n'
    data = _message(text="Hello\nsecond line\n", html=html).as_bytes()
    assert _part_encodings(data) == ["7bit", "7bit"]
    assert b'style="color: #222"' in data and b"?a=1&b=2" in data  # no =3D: the body is not re-encoded
    assert b"\n" not in data.replace(b"\r\n", b"")
    parsed = _parse(data)
    html_part, plain = parsed.get_body(("html",)), parsed.get_body(("plain",))
    assert html_part is not None and plain is not None
    assert html_part.get_content().replace("\r\n", "\n") == html
    assert plain.get_content().replace("\r\n", "\n") == "Hello\nsecond line\n"
    assert not parsed.defects


@pytest.mark.parametrize(
    "text",
    [
        "Grüße\n",  # not ASCII
        "x" * 999,  # a line over RFC 5322's 998
        "trailing space \nnext",  # relays may strip it: quoted-printable keeps it (=20)
        "trailing tab\t",
        "a NUL \0 in text",
    ],
)
def test_bodies_that_plain_7bit_cannot_carry_are_quoted_printable(text: str) -> None:
    data = _message(text=text).as_bytes()
    assert _part_encodings(data) == ["quoted-printable"]
    assert data.isascii() and max(len(line) for line in data.split(b"\r\n")) <= 78
    assert _parse(data).get_content().replace("\r\n", "\n") == text


def test_line_ends_are_crlf_whatever_the_template_wrote() -> None:
    data = _message(text="a\rb\r\nc\nd").as_bytes()
    assert _part_encodings(data) == ["7bit"]
    assert data.endswith(b"a\r\nb\r\nc\r\nd")


def test_a_body_cannot_forge_parts_with_the_boundary() -> None:
    # Text from a signup form (a name) or an API payload is ASCII like any other: sent as it is, a line
    # "--<boundary>" in it would end the text part and start one of its author's choosing.
    message = _message(html="<p>hello</p>")
    forged = f"Hi\n--{message.boundary}\nContent-Type: text/html\n\n<a href=https://evil.test>verify</a>\n"
    message.text = forged
    data = message.as_bytes()
    assert _part_encodings(data) == ["quoted-printable", "7bit"]
    parsed = _parse(data)
    parts = [p for p in parsed.walk() if not p.is_multipart()]
    assert [p.get_content_type() for p in parts] == ["text/plain", "text/html"]
    plain = parsed.get_body(("plain",))
    assert plain is not None and plain.get_content().replace("\r\n", "\n") == forged


def test_a_line_of_exactly_998_characters_goes_as_it_is() -> None:
    assert _part_encodings(_message(text="x" * 998).as_bytes()) == ["7bit"]
    assert _part_encodings(_message(text="x" * 999).as_bytes()) == ["quoted-printable"]


@given(st.text(max_size=40), st.sampled_from(["ann@example.test", "a.b+c@sub.example.test"]))
def test_display_names_are_written_as_formataddr_writes_them(name: str, address: str) -> None:
    # the fast path for plain names must give formataddr's answer, quotes and escapes included
    from email.utils import formataddr

    expected = formataddr((name.replace("\r", " ").replace("\n", " "), address), charset="utf-8") if name else address
    assert format_address(name, address) == expected
