"""Shared test helpers: set up accounts, lists, subscribers and campaigns directly in the store."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
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
) -> Setup:
    async with await connect(url) as conn:
        account_id, key = await make_account(conn)
        list_id = await lists.create_list(conn, account_id, "main")
        await add_subscribers(conn, account_id, emails, [list_id])
        campaign_id = await campaigns.create_campaign(
            conn,
            account_id=account_id,
            name="November news",
            subject="News for {{ email }}",
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
