"""Build a transport from ``SENDONCE_TRANSPORT_URL``.

=====================================  ==============================================
``smtp://host:port``                   plain SMTP (port 25 by default)
``smtp+starttls://user:pass@host:587`` SMTP upgraded with STARTTLS, optional login
``smtps://user:pass@host:465``         SMTP over TLS
``resend://API_KEY@host[:port]``       Resend-compatible HTTP API over https
``resend+http://API_KEY@host:port``    the same over plain http (a local server in tests)
=====================================  ==============================================

Query parameters: ``timeout`` (seconds); for SMTP ``verify=false`` to accept any certificate,
``pipelining=false`` to send one command per round trip even where the server offers PIPELINING, and
``relay=postmark|sendgrid|none``: the relay whose webhooks echo the job id only from a header of its
own (``X-PM-Metadata-sendonce-job-id``, ``X-SMTPAPI`` unique_args), added to each message; known by
host name (``smtp.postmarkapp.com``, ``smtp.sendgrid.net``) unless ``none``.
"""

from __future__ import annotations

from urllib.parse import parse_qs, unquote, urlsplit

from sendonce.errors import TransportConfigError
from sendonce.transports.base import Transport
from sendonce.transports.resend import ResendSettings, ResendTransport
from sendonce.transports.smtp import RELAY_HOSTS, RELAYS, SmtpSettings, SmtpTransport

SCHEMES = ("smtp", "smtp+starttls", "smtps", "resend", "resend+http")


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password or parts.username:
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return parts._replace(netloc=f"***@{host}{port}").geturl()
    return url


def _flag(url: str, params: dict[str, str], name: str) -> bool:
    value = params.get(name, "true").lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise TransportConfigError(f"{name} must be true or false in {_redact(url)!r}, not {value!r}")


MAX_TIMEOUT = 3600.0
"""Seconds: a ``?timeout=`` beyond an hour is a typo (the send is also bounded by the lease)."""


def transport_from_url(url: str, *, concurrency: int = 10) -> Transport:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TransportConfigError(f"invalid transport URL {_redact(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise TransportConfigError(
            f"unsupported transport {scheme or '(none)'!r} in {_redact(url)!r}; use one of: {', '.join(SCHEMES)}"
        )
    if not parts.hostname:
        raise TransportConfigError(f"the transport URL {_redact(url)!r} has no host")
    params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    try:
        timeout = float(params.get("timeout", "30"))
    except ValueError:
        raise TransportConfigError(f"timeout must be a number of seconds in {_redact(url)!r}") from None
    if not 0 < timeout <= MAX_TIMEOUT:  # NaN too: a worker with no time to send sends nothing, silently
        raise TransportConfigError(
            f"timeout must be more than 0 and at most {MAX_TIMEOUT:g} seconds in {_redact(url)!r}, not {timeout:g}"
        )
    host = parts.hostname
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if scheme.startswith("resend"):
        key = username or password
        if not key:
            raise TransportConfigError("a resend:// URL needs the API key as its user part: resend://KEY@host")
        http_scheme = "http" if scheme == "resend+http" else "https"
        netloc = f"[{host}]" if ":" in host else host
        if port:
            netloc += f":{port}"
        base = f"{http_scheme}://{netloc}{parts.path.rstrip('/')}"
        return ResendTransport(ResendSettings(base, key, timeout), max_connections=max(concurrency, 1))
    relay = params.get("relay", RELAY_HOSTS.get(host.lower().rstrip("."), "none")).lower()
    if relay not in (*RELAYS, "none"):
        raise TransportConfigError(
            f"relay must be one of {', '.join((*RELAYS, 'none'))} in {_redact(url)!r}, not {relay!r}"
        )
    settings = SmtpSettings(
        host=host,
        port=port or {"smtp": 25, "smtp+starttls": 587, "smtps": 465}[scheme],
        use_tls=scheme == "smtps",
        start_tls=scheme == "smtp+starttls",
        username=username,
        password=password,
        timeout=timeout,
        validate_certs=_flag(url, params, "verify"),
        pipelining=_flag(url, params, "pipelining"),
        relay=None if relay == "none" else relay,
    )
    return SmtpTransport(settings)
