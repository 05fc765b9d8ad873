"""Configuration from the environment (``SENDONCE_*``). Only the edges (CLI, API app, demo) read it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sendonce.domain.durations import parse_duration
from sendonce.errors import ConfigurationError


def _duration(value: Any) -> Any:
    if isinstance(value, str):
        return parse_duration(value)
    return value


Duration = Annotated[timedelta, BeforeValidator(_duration)]

SIGNUP_WINDOW_MIN = timedelta(seconds=1)
SIGNUP_WINDOW_MAX = timedelta(days=30)
"""Bounds of a signup window: the server's default (``SENDONCE_SIGNUP_WINDOW``) and each account's own."""


def check_signup_window(window: timedelta) -> timedelta:
    """The window, if within the bounds; else ValueError. A zero window would queue a mail per retry."""
    if not SIGNUP_WINDOW_MIN <= window <= SIGNUP_WINDOW_MAX:
        raise ValueError("must be between 1s and 30d")
    return window


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SENDONCE_", extra="ignore", frozen=True)

    database_url: str | None = None
    """PostgreSQL to use. Unset: the embedded server in ``home``."""
    home: Path = Path(".sendonce")
    """Data folder of the embedded PostgreSQL (and other local state)."""
    transport_url: str | None = None
    """Where mail goes: smtp://, smtp+starttls://, smtps://, resend://, resend+http://."""
    admin_token: SecretStr | None = None
    """Bearer token for the admin routes (creating accounts). Unset: those routes are disabled."""
    secret: SecretStr | None = None
    """Server secret for idempotency keys and signed links."""
    secret_previous: SecretStr | None = None
    """The secret before the last rotation, still accepted for keys and links made with it."""
    secret_retired: SecretStr | None = None
    """Older secrets, separated by spaces, that only verify unsubscribe links: those never expire, and
    mail signed under a secret long replaced is still in mailboxes (and its one-click unsubscribe must
    still work)."""
    public_url: str = "http://127.0.0.1:8000"
    """Base URL where people reach the API (verification and unsubscribe links)."""
    unsubscribe_mailto: str | None = None
    """Mailbox of the mailto: part of List-Unsubscribe, one that someone processes (default: no mailto: part)."""
    signup_window: Duration = Field(default=timedelta(hours=1))
    """Repeats of a signup within this window queue no new mail (1s to 30d)."""
    alert_webhook_url: str | None = None
    max_body_bytes: int = Field(default=1_048_576, ge=1)
    """Largest request body the API reads (CSV imports: ``max_import_bytes``)."""
    max_import_bytes: int = Field(default=50 * 1_048_576, ge=1)
    request_timeout: Duration = Field(default=timedelta(seconds=30))
    """Longest the API takes to answer a request (CSV imports: ten times as long); past it, 503 and
    Retry-After: a database that stopped answering must not hold a client, nor a pooled connection,
    for ever."""
    verify_ttl: Duration = Field(default=timedelta(hours=48))
    """How long a verification link stays valid."""
    optin_ttl: Duration = Field(default=timedelta(days=7))
    """How long a double opt-in confirmation link stays valid."""
    signup_rate_per_address: str = "5/h"
    """New verification mails per address (all origins), as a rate: an inbox cannot be bombed."""
    signup_rate_per_account: str = "200/s burst 2000"
    """New verification mails per account."""
    block_disposable: bool = False
    """Refuse signups from disposable-address domains (422)."""
    abuse_detector: bool = True
    abuse_min_repeats: int = Field(default=20, ge=1)
    """A replay burst is flagged only from this many repeats in one window, whatever the baseline."""
    abuse_window: Duration = Field(default=timedelta(seconds=10))
    """Width of the buckets repeats are counted in (at least 1s)."""
    abuse_sources: int = Field(default=5, ge=2)
    """Distinct client addresses signing up one address within 10 minutes that raise an alert (at least 2:
    one client is not "many sources", and 1 would raise an alert for every address signed up)."""
    trust_forwarded_for: bool = False
    """Take the client address from X-Forwarded-For (only behind a proxy you control)."""

    # sending rates, enforced through PostgreSQL across every worker
    rate_limit: str | None = None
    """Messages through the transport, e.g. ``14/s`` or ``100/s burst 20``."""
    domain_rate_limits: str | None = None
    """Per recipient domain, e.g. ``gmail.com=50/min, yahoo.com=20/s``."""

    # bounces, complaints and their webhooks
    max_bounce_rate: float = Field(default=0.05, ge=0, le=1)
    """A sending campaign whose hard-bounce rate passes this is paused (per-campaign override)."""
    max_complaint_rate: float = Field(default=0.003, ge=0, le=1)
    feedback_min_sample: int = Field(default=100, ge=1)
    """Campaign rates are judged only after this many attempted messages."""
    soft_bounce_limit: int = Field(default=3, ge=1)
    """Soft bounces within soft_bounce_period that suppress an address."""
    soft_bounce_period: Duration = Field(default=timedelta(days=30))
    webhook_secret: SecretStr | None = None
    """Generic webhook format: HMAC key of the Sendonce-Signature header."""
    resend_webhook_secret: SecretStr | None = None
    """Resend (svix) signing secret, whsec_..."""
    sendgrid_webhook_key: str | None = None
    """SendGrid Event Webhook verification key (public, ECDSA)."""
    postmark_webhook_token: SecretStr | None = None
    """Shared secret Postmark sends as the Basic auth password of the webhook URL."""
    sns_topic_arns: str | None = None
    """Comma-separated SNS topics whose SES notifications are accepted (required for ses)."""
    sns_auto_confirm: bool = True
    """Confirm SNS subscriptions to those topics automatically."""

    @field_validator("signup_window")
    @classmethod
    def _signup_window_bounds(cls, value: timedelta) -> timedelta:
        return check_signup_window(value)

    @field_validator("verify_ttl", "optin_ttl", "abuse_window", "soft_bounce_period", "request_timeout")
    @classmethod
    def _at_least_a_second(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        # Zero would expire every link at once, divide by zero in the abuse detector, or count no bounce.
        if value < timedelta(seconds=1):
            raise ValueError("must be at least 1s")
        # And an upper bound each: a value that passed here and failed later did so far from its
        # cause. 30h of request timeout made an idle-session limit past PostgreSQL's integer range,
        # and the API answered 503 to every request; 3,000,000 days of soft-bounce period made
        # "now() - period" out of range at every soft bounce (a review found both).
        most = _MOST[str(info.field_name)]
        if value > most:
            raise ValueError(f"must be at most {_spelled(most)}")
        return value


def _spelled(value: timedelta) -> str:
    return f"{value.days}d" if value.days and not value.seconds else f"{int(value.total_seconds())}s"


_MOST = {
    "request_timeout": timedelta(hours=1),
    "abuse_window": timedelta(days=1),
    "verify_ttl": timedelta(days=365),
    "optin_ttl": timedelta(days=365),
    "soft_bounce_period": timedelta(days=3650),
}


def load_settings(**overrides: Any) -> Settings:
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"SENDONCE_{'_'.join(str(p) for p in error['loc']).upper()}: {error['msg']}" for error in exc.errors()
        )
        raise ConfigurationError(f"invalid configuration: {problems}") from None
