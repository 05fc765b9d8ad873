"""The one place that wires settings to parts: database, transport, composer, worker."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from urllib.parse import urlsplit

import psycopg
from pydantic import SecretStr

from sendonce.delivery.compose import Composer, Links
from sendonce.delivery.transactional import default_composer
from sendonce.delivery.worker import Worker, WorkerConfig
from sendonce.domain.keys import KeyRing
from sendonce.errors import ConfigurationError
from sendonce.faults import Faults
from sendonce.settings import Settings
from sendonce.store.database import resolve_database_url
from sendonce.store.feedback import FeedbackPolicy
from sendonce.store.rate_limits import Rate
from sendonce.store.shared_secret import shared_secret
from sendonce.transports.base import Transport
from sendonce.transports.registry import transport_from_url
from sendonce.webhooks import WebhookConfig

logger = logging.getLogger(__name__)


def database_url(settings: Settings) -> str:
    return resolve_database_url(settings.database_url, settings.home)


def build_transport(settings: Settings, *, concurrency: int = 10) -> Transport:
    if not settings.transport_url:
        raise ConfigurationError(
            "SENDONCE_TRANSPORT_URL is not set: say where mail goes, e.g. smtp://127.0.0.1:1025 "
            "or resend://API_KEY@api.resend.com"
        )
    return transport_from_url(settings.transport_url, concurrency=concurrency)


def build_composer(settings: Settings) -> Composer:
    return default_composer(
        Links(keyring(settings), settings.public_url, unsubscribe_mailto=settings.unsubscribe_mailto)
    )


def _is_local(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_of_local_links(settings: Settings) -> bool:
    """Mail going out to the world with links to this machine's loopback (SENDONCE_PUBLIC_URL left at
    its default): nobody who receives it can unsubscribe or verify. Logged, not refused (a staging
    relay may be remote while the links are meant to be local); True when it warned."""
    try:
        relay = urlsplit(settings.transport_url or "").hostname
        links = urlsplit(settings.public_url).hostname
    except ValueError:
        return False
    if relay is None or _is_local(relay) or not _is_local(links):
        return False
    logger.warning(
        "mail goes to %s but its unsubscribe and verification links point at %s: set SENDONCE_PUBLIC_URL "
        "to the address where people reach the API",
        relay,
        settings.public_url,
        extra={"action": "public_url_local"},
    )
    return True


def build_worker(
    settings: Settings, config: WorkerConfig, *, url: str | None = None, faults: Faults | None = None
) -> Worker:
    transport = build_transport(settings, concurrency=config.concurrency)
    warn_of_local_links(settings)
    return Worker(
        url or database_url(settings),
        transport,
        config,
        composer=build_composer(settings),
        faults=faults if faults is not None else Faults.from_env(),
    )


def keyring(settings: Settings) -> KeyRing:
    """The server secret, the previous one during a rotation, and the retired ones that still verify
    unsubscribe links.

    Without SENDONCE_SECRET: on an external database (SENDONCE_DATABASE_URL), the secret kept in that
    database, made by the first process that needed it, so every process on it shares one whatever its
    SENDONCE_HOME; on the embedded database, a random secret created once in ``$SENDONCE_HOME/secret``
    (the home holds that database too). Set SENDONCE_SECRET to keep the secret out of the database.
    """
    previous = settings.secret_previous.get_secret_value().encode() if settings.secret_previous else None
    if settings.secret is not None and settings.secret.get_secret_value():
        current = settings.secret.get_secret_value().encode()
    elif settings.database_url:
        path = settings.home / "secret"
        # a secret this home made before the database kept one (an earlier version): offered first
        made_here = path.read_text().strip().encode() if path.exists() else None
        try:
            current = shared_secret(settings.database_url, made_here or secrets.token_urlsafe(48).encode())
        except psycopg.Error as exc:
            raise ConfigurationError(
                "SENDONCE_SECRET is not set, and the secret shared through the database cannot be read "
                f"({str(exc).strip()}): set SENDONCE_SECRET, or make the database reachable"
            ) from None
        if made_here and made_here != current:
            if previous is None:
                # links and keys this home signed stay readable, as after a rotation
                previous = made_here
                logger.warning("the secret in %s is not the database's: the database's signs, that one verifies", path)
            else:
                logger.warning(
                    "the secret in %s is not the database's, and SENDONCE_SECRET_PREVIOUS is set: what it "
                    "signed no longer verifies (add it to SENDONCE_SECRET_RETIRED to keep its unsubscribe links)",
                    path,
                )
    else:
        path = settings.home / "secret"
        if not path.exists():
            # Several processes may start at once: write a complete file aside, then link it into
            # place, which fails if another process got there first (then its secret is the one).
            settings.home.mkdir(parents=True, exist_ok=True)
            draft = path.with_name(f".secret.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(48))
            try:
                os.link(draft, path)
                logger.warning("SENDONCE_SECRET is not set: created a random one in %s", path)
            except FileExistsError:
                pass
            finally:
                draft.unlink()
        current = path.read_text().strip().encode()
    retired = (
        tuple(s.encode() for s in settings.secret_retired.get_secret_value().split()) if settings.secret_retired else ()
    )
    try:
        return KeyRing(current, previous or None, retired)
    except ValueError as exc:
        raise ConfigurationError(f"SENDONCE_SECRET: {exc}") from None


def send_rates(settings: Settings) -> tuple[Rate | None, dict[str, Rate]]:
    """The transport's rate and the per-domain rates, from SENDONCE_RATE_LIMIT and SENDONCE_DOMAIN_RATE_LIMITS."""
    try:
        transport = Rate.parse(settings.rate_limit) if settings.rate_limit else None
        domains: dict[str, Rate] = {}
        for item in (settings.domain_rate_limits or "").split(","):
            if not item.strip():
                continue
            domain, sep, rate = item.partition("=")
            if not sep or not domain.strip():
                raise ValueError(f"{item.strip()!r} is not domain=rate")
            domains[domain.strip().lower()] = Rate.parse(rate)
    except ValueError as exc:
        raise ConfigurationError(f"rate limits: {exc}") from None
    return transport, domains


def feedback_policy(settings: Settings) -> FeedbackPolicy:
    return FeedbackPolicy(
        max_bounce_rate=settings.max_bounce_rate,
        max_complaint_rate=settings.max_complaint_rate,
        min_sample=settings.feedback_min_sample,
        soft_bounce_limit=settings.soft_bounce_limit,
        soft_bounce_period=settings.soft_bounce_period,
    )


def webhook_config(settings: Settings) -> WebhookConfig:
    def secret(value: SecretStr | None) -> str | None:
        return value.get_secret_value() if value is not None and value.get_secret_value() else None

    topics = frozenset(t.strip() for t in (settings.sns_topic_arns or "").split(",") if t.strip())
    return WebhookConfig(
        resend_secret=secret(settings.resend_webhook_secret),
        sendgrid_public_key=settings.sendgrid_webhook_key or None,
        postmark_token=secret(settings.postmark_webhook_token),
        generic_secret=secret(settings.webhook_secret),
        sns_topic_arns=topics,
    )
