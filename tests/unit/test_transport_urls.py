from __future__ import annotations

import pytest

from sendonce.errors import TransportConfigError
from sendonce.transports.registry import transport_from_url
from sendonce.transports.resend import ResendTransport
from sendonce.transports.smtp import SmtpTransport


def test_smtp_urls() -> None:
    plain = transport_from_url("smtp://127.0.0.1:1025")
    assert isinstance(plain, SmtpTransport)
    assert (plain.settings.host, plain.settings.port, plain.settings.use_tls, plain.settings.start_tls) == (
        "127.0.0.1",
        1025,
        False,
        False,
    )
    starttls = transport_from_url("smtp+starttls://user%40x:p%3Ass@mail.example.test:587?timeout=5")
    assert isinstance(starttls, SmtpTransport)
    assert starttls.settings.start_tls is True
    assert (starttls.settings.username, starttls.settings.password, starttls.settings.timeout) == (
        "user@x",
        "p:ss",
        5.0,
    )
    tls = transport_from_url("smtps://mail.example.test")
    assert isinstance(tls, SmtpTransport)
    assert (tls.settings.port, tls.settings.use_tls) == (465, True)
    assert not plain.capabilities.idempotent
    assert plain.settings.pipelining and plain.settings.validate_certs
    serial = transport_from_url("smtp://127.0.0.1:1025?pipelining=false&verify=no")
    assert isinstance(serial, SmtpTransport)
    assert (serial.settings.pipelining, serial.settings.validate_certs) == (False, False)


def test_relays_whose_webhooks_need_a_header_of_their_own() -> None:
    def relay(url: str) -> str | None:
        transport = transport_from_url(url)
        assert isinstance(transport, SmtpTransport)
        return transport.settings.relay

    assert relay("smtp://127.0.0.1:1025") is None
    assert relay("smtp+starttls://u:p@smtp.postmarkapp.com:587") == "postmark"  # known by its host
    assert relay("smtp+starttls://u:p@SMTP.SendGrid.net.:587") == "sendgrid"
    assert relay("smtp+starttls://u:p@smtp.postmarkapp.com:587?relay=none") is None
    assert relay("smtp://127.0.0.1:1025?relay=postmark") == "postmark"
    assert relay("smtp://127.0.0.1:1025?relay=SendGrid") == "sendgrid"
    with pytest.raises(TransportConfigError, match="relay must be one of postmark, sendgrid, none"):
        transport_from_url("smtp://127.0.0.1:1025?relay=mailgun")


def test_resend_urls() -> None:
    https = transport_from_url("resend://re_123@api.resend.com")
    assert isinstance(https, ResendTransport)
    assert https.settings.base_url == "https://api.resend.com"
    assert https.settings.api_key == "re_123"
    local = transport_from_url("resend+http://re_abc@127.0.0.1:8025")
    assert isinstance(local, ResendTransport)
    assert local.settings.base_url == "http://127.0.0.1:8025"
    assert https.capabilities.idempotent


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://host", "unsupported transport"),
        ("smtp://", "no host"),
        ("resend://api.resend.com", "API key"),
        ("smtp://host:notaport", "invalid transport URL"),
        ("smtp://host?timeout=soon", "timeout"),
        ("smtp://host?timeout=-1", "timeout must be more than 0"),
        ("smtp://host?timeout=0", "timeout must be more than 0"),
        ("smtp://host?timeout=nan", "timeout must be more than 0"),
        ("resend+http://k@host?timeout=inf", "timeout must be more than 0"),
        ("smtp://host?pipelining=sometimes", "pipelining must be true or false"),
        ("smtp://host?verify=maybe", "verify must be true or false"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(TransportConfigError, match=message):
        transport_from_url(url)


def test_passwords_are_not_echoed_in_errors() -> None:
    with pytest.raises(TransportConfigError) as excinfo:
        transport_from_url("ftp://user:hunter2@host")
    assert "hunter2" not in str(excinfo.value)


@pytest.mark.parametrize(
    ("transport", "public", "warns"),
    [
        ("smtp://smtp.example.com:587", "http://127.0.0.1:8000", True),
        ("resend://KEY@api.resend.com", "http://localhost:8000", True),
        ("smtp://smtp.example.com:587", "https://mail.acme.example", False),
        ("smtp://127.0.0.1:1025", "http://127.0.0.1:8000", False),  # a local relay: a test set-up
        ("smtp://[::1]:1025", "http://[::1]:8000", False),
    ],
)
def test_a_worker_warns_when_its_links_point_at_loopback_but_mail_leaves(
    transport: str, public: str, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from sendonce.runtime import warn_of_local_links
    from sendonce.settings import load_settings

    settings = load_settings(transport_url=transport, public_url=public)
    assert warn_of_local_links(settings) is warns
    assert ("SENDONCE_PUBLIC_URL" in caplog.text) is warns
