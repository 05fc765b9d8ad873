"""Shared test helpers: set up accounts, lists, subscribers and campaigns directly in the store."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID

from sendonce.delivery.compose import Composer, Links
from sendonce.delivery.transactional import default_composer
from sendonce.delivery.worker import Worker, WorkerConfig, WorkerStats
from sendonce.domain.addresses import parse_address
from sendonce.domain.keys import KeyRing
from sendonce.domain.states import SubscriberStatus
from sendonce.store import accounts, campaigns, lists, subscribers
from sendonce.store.database import Conn, connect
from sendonce.transports.base import Transport

TEST_SECRET = "test-secret-0123456789abcdef0123"
"""The secret test workers sign links with; ApiServer in conftest uses the same by default."""
PUBLIC_URL = "http://127.0.0.1:8000"


def composer(public_url: str = PUBLIC_URL, secret: str = TEST_SECRET) -> Composer:
    return default_composer(Links(KeyRing(secret.encode()), public_url))


@dataclass
class Setup:
    account_id: int
    api_key: str
    list_ids: list[int]
    campaign_id: int | None = None


async def make_account(conn: Conn, *, from_email: str = "news@sender.test") -> tuple[int, str]:
    account, key = await accounts.create_account(conn, name="acme", from_email=from_email, from_name="Acme News")
    return account.account_id, key


async def add_subscribers(
    conn: Conn,
    account_id: int,
    emails: Sequence[str],
    list_ids: Sequence[int],
    status: SubscriberStatus | None = None,
) -> list[int]:
    rows = [subscribers.SubscriberInput(parse_address(e), None, status, list(list_ids)) for e in emails]
    results = await subscribers.upsert_subscribers(conn, account_id, rows)
    return [r.subscriber_id for r in results]


async def campaign_setup(
    url: str,
    emails: Sequence[str],
    *,
    approve: bool = True,
    text: str = "Hello {{ email }}",
    html: str | None = None,
    subject: str = "News for {{ email }}",
) -> Setup:
    async with await connect(url) as conn:
        account_id, key = await make_account(conn)
        list_id = await lists.create_list(conn, account_id, "main")
        await add_subscribers(conn, account_id, emails, [list_id])
        campaign_id = await campaigns.create_campaign(
            conn,
            account_id=account_id,
            name="November news",
            subject=subject,
            text_body=text,
            html_body=html,
            from_email="news@sender.test",
            from_name="Acme News",
            list_ids=[list_id],
        )
        if approve:
            result = await campaigns.transition(conn, account_id, campaign_id, "approve")
            assert result.won
    return Setup(account_id, key, [list_id], campaign_id)


def emails(n: int, domain: str = "example.test") -> list[str]:
    return [f"user{i:06d}@{domain}" for i in range(n)]


@contextlib.asynccontextmanager
async def running_worker(
    url: str, transport: Transport, config: WorkerConfig | None = None, **kwargs: object
) -> AsyncIterator[Worker]:
    """A worker running in this event loop; stopped (gracefully) on exit."""
    kwargs.setdefault("composer", composer())
    worker = Worker(url, transport, config or WorkerConfig(tick=0.5, lease=5), **kwargs)  # type: ignore[arg-type]
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


async def run_to_drain(
    url: str, transport: Transport, config: WorkerConfig | None = None, timeout: float = 60, **kwargs: object
) -> WorkerStats:
    config = config or WorkerConfig(tick=0.5, lease=5, drain=True)
    kwargs.setdefault("composer", composer())
    worker = Worker(url, transport, config, **kwargs)  # type: ignore[arg-type]
    return await asyncio.wait_for(worker.run(), timeout)


async def campaign_status(url: str, account_id: int, campaign_id: int) -> tuple[str, campaigns.CampaignCounts]:
    async with await connect(url) as conn:
        campaign = await campaigns.get_campaign(conn, account_id, campaign_id)
        assert campaign is not None
        counts = await campaigns.campaign_counts(conn, account_id, campaign_id)
    return campaign.status.value, counts


def proxy_target(url: str) -> dict[str, object]:
    """Where a libpq URL points, as TcpProxy arguments (Unix socket for the embedded server)."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(url)
    host = str(params.get("host") or "localhost")
    port = int(params.get("port") or 5432)
    if host.startswith("/"):
        return {"target_unix": f"{host}/.s.PGSQL.{port}"}
    return {"target_host": host, "target_port": port}


def through_proxy(url: str, port: int) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(url, host="127.0.0.1", port=port)


def self_signed_pem(
    key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey,
    common_name: str,
    *,
    not_before: datetime,
    not_after: datetime,
    ip_address: str | None = None,
) -> bytes:
    """A self-signed certificate (PEM) for ``key``, valid from ``not_before`` to ``not_after``."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    if ip_address is not None:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip_address))])
        builder = builder.add_extension(san, critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


# == webhook signing ==============================================================================
# The providers' signatures, written from their documents (independently of sendonce.webhooks), with
# the secrets and keys the tests configure: the webhook unit tests and the API fuzz sign with these.
# ``ts`` is always the caller's: the unit tests parse at a fixed time, the fuzz at the real one.

GENERIC_SECRET = "generic-secret-0123456789abcdef"


def generic_headers(body: bytes, *, ts: str, secret: str = GENERIC_SECRET) -> dict[str, str]:
    """Our own scheme: ``sha256=`` and the hex HMAC-SHA256 of ``"<ts>.<body>"``."""
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    return {"Sendonce-Signature": f"sha256={mac}", "Sendonce-Timestamp": ts}


SVIX_KEY = b"resend-test-secret-key-32-bytes!"
SVIX_SECRET = "whsec_" + base64.b64encode(SVIX_KEY).decode()


def svix_headers(body: bytes, *, ts: str, msg_id: str = "msg_2p5Qx0w1", key: bytes = SVIX_KEY) -> dict[str, str]:
    """Resend's (Svix, Standard Webhooks): base64 HMAC-SHA256 of ``"<msg_id>.<ts>.<body>"``."""
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return {"svix-id": msg_id, "svix-timestamp": ts, "svix-signature": "v1," + base64.b64encode(mac).decode()}


POSTMARK_TOKEN = "pm-0c3f9a8e4b7d4f2e9a1b6c5d8e7f0a12"
"""Postmark signs nothing: the token is sent as a header or as the password of Basic auth."""

SENDGRID_KEY = ec.generate_private_key(ec.SECP256R1())
SENDGRID_PUBLIC = base64.b64encode(
    SENDGRID_KEY.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
).decode()


def sendgrid_headers(body: bytes, *, ts: str, key: ec.EllipticCurvePrivateKey = SENDGRID_KEY) -> dict[str, str]:
    """SendGrid's Signed Event Webhook: base64 ECDSA P-256 (SHA-256) of ``"<ts><body>"``."""
    signature = key.sign(ts.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {
        "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
        "X-Twilio-Email-Event-Webhook-Timestamp": ts,
    }


CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-7506a1e35b36ef5a444dd1a8e7cc3ed8.pem"
TOPIC = "arn:aws:sns:us-east-1:123456789012:ses-feedback"
SNS_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def sns_certificate(key: rsa.RSAPrivateKey, *, not_before: datetime, not_after: datetime) -> bytes:
    """A certificate for an SNS signing key, as SNS serves at ``SigningCertURL`` (PEM)."""
    return self_signed_pem(key, "sns.amazonaws.com", not_before=not_before, not_after=not_after)


def sns_sign(envelope: dict[str, Any], key: rsa.RSAPrivateKey = SNS_KEY) -> None:
    """Sign as SNS documents it: "name\\nvalue\\n" for each field, names in byte order; a field absent
    or null is left out (SNS leaves out the Subject of a notification that has none)."""
    if envelope["Type"] == "Notification":
        names = ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
    else:
        names = ["Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type"]
    text = "".join(f"{n}\n{envelope[n]}\n" for n in names if envelope.get(n) is not None)
    algorithm = hashes.SHA1() if envelope["SignatureVersion"] == "1" else hashes.SHA256()  # noqa: S303 (SNS v1 is SHA-1)
    signature = key.sign(text.encode(), padding.PKCS1v15(), algorithm)
    envelope["Signature"] = base64.b64encode(signature).decode()
