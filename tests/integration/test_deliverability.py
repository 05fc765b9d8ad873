"""Deliverability and compliance, read back from a real SMTP inbox and over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urljoin

import httpx
import psycopg
import pytest

from sendonce.delivery.compose import Links, compile_campaign
from sendonce.delivery.render import TemplateError
from sendonce.delivery.worker import Worker, WorkerConfig
from sendonce.domain.keys import KeyRing
from sendonce.store import feedback
from sendonce.store.database import connect
from sendonce.store.feedback import FeedbackPolicy
from sendonce.testing.inbox import Inbox, InboxFaults
from sendonce.testing.resend_server import ResendFaults, ResendServer
from sendonce.transports.registry import transport_from_url
from sendonce.webhooks import FeedbackEvent
from tests.conftest import ApiServer
from tests.helpers import (
    PUBLIC_URL,
    SNS_KEY,
    TEST_SECRET,
    campaign_setup,
    campaign_status,
    composer,
    emails,
    run_to_drain,
    running_worker,
    sns_certificate,
)
from tests.unit.test_webhooks import (
    CERT_URL,
    TOPIC,
    postmark_bounce,
    sns_confirmation,
    sns_notification,
    svix_headers,
)

ADMIN = {"Authorization": "Bearer test-admin-token"}
DRAIN = WorkerConfig(tick=0.2, lease=5, drain=True, backoff_base=0.05)
GENERIC_SECRET = "generic-webhook-secret"
SVIX_SECRET = "whsec_" + base64.b64encode(b"resend-test-secret-key-32-bytes!").decode()
LINKS = Links(KeyRing(TEST_SECRET.encode()), PUBLIC_URL)


@pytest.fixture
def api(database_url: str) -> Iterator[ApiServer]:
    with ApiServer(
        database_url,
        public_url=PUBLIC_URL,
        webhook_secret=GENERIC_SECRET,
        resend_webhook_secret=SVIX_SECRET,
        sns_topic_arns=TOPIC,
        feedback_min_sample=1,
    ) as server:
        yield server


@pytest.fixture
def client(api: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=30) as c:
        yield c


def _one(url: str, sql: str, *params: Any) -> Any:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchone()  # type: ignore[arg-type]


async def test_campaign_messages_carry_compliant_headers_and_a_visible_link(database_url: str, inbox: Inbox) -> None:
    setup = await campaign_setup(
        database_url, ["ann@example.test"], html="<html><body><p>Hi {{ email }}</p></body></html>"
    )
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    message = inbox.messages[0].parsed()
    sid = _one(database_url, "SELECT subscriber_id FROM sendonce.subscribers")[0]
    token = LINKS.unsubscribe_token(setup.account_id, sid, setup.campaign_id)  # type: ignore[arg-type]
    # no mailto: part, unless a mailbox someone reads is configured (sendonce reads none)
    assert message["List-Unsubscribe"] == f"<{PUBLIC_URL}/u/{token}>"
    assert message["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert message["Feedback-ID"] == f"{setup.campaign_id}:{setup.account_id}:campaign:sendonce"
    assert message["Message-ID"] == f"<campaign.{setup.campaign_id}.{sid}@sender.test>"
    assert message["MIME-Version"] == "1.0"
    assert message["Date"].datetime is not None
    text = message.get_body(("plain",)).get_content()
    html = message.get_body(("html",)).get_content()
    assert f"{PUBLIC_URL}/u/{token}" in text
    assert f'href="{PUBLIC_URL}/u/{token}"' in html
    assert html.rstrip().endswith("</body></html>")  # the footer went inside the body


@pytest.mark.parametrize(
    ("subject", "text", "html", "footers"),
    [
        ("News", "Leave: {{ unsubscribe_url }}", "<html><body><p>Hi</p></body></html>", ("html",)),
        ("News", "Hi", "<html><body><a href='{{ unsubscribe_url }}'>leave</a></body></html>", ("text",)),
        ("News {{ unsubscribe_url }}", "Hi", "<html><body><p>Hi</p></body></html>", ("text", "html")),
    ],
    ids=["link-in-text-only", "link-in-html-only", "link-in-subject-only"],
)
async def test_each_body_shows_the_unsubscribe_link_whichever_template_names_it(
    database_url: str, inbox: Inbox, subject: str, text: str, html: str, footers: tuple[str, ...]
) -> None:
    # The footer was left out of both bodies when any of the three templates named the link: one
    # body, or both (a subject), went without it.
    setup = await campaign_setup(database_url, ["ann@example.test"], subject=subject, text=text, html=html)
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    sid = _one(database_url, "SELECT subscriber_id FROM sendonce.subscribers")[0]
    url = f"{PUBLIC_URL}/u/{LINKS.unsubscribe_token(setup.account_id, sid, setup.campaign_id)}"  # type: ignore[arg-type]
    message = inbox.messages[0].parsed()
    for part in ("plain", "html"):
        body = message.get_body((part,)).get_content()
        assert body.count(url) == 1, (part, body)  # the template's link, or the footer's: never none, never two
        footer = "to stop receiving these emails" in body.lower()
        assert footer == (("text" if part == "plain" else "html") in footers), (part, body)


@pytest.mark.parametrize("mailbox", ["unsub@lists.acme.test", ""], ids=["configured", "set-empty"])
async def test_a_configured_unsubscribe_mailbox_is_the_mailto_fallback(
    database_url: str, inbox: Inbox, mailbox: str
) -> None:
    from sendonce.delivery.transactional import default_composer

    setup = await campaign_setup(database_url, ["ann@example.test"])
    links = Links(KeyRing(TEST_SECRET.encode()), PUBLIC_URL, unsubscribe_mailto=mailbox)
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN, composer=default_composer(links))
    sid = _one(database_url, "SELECT subscriber_id FROM sendonce.subscribers")[0]
    token = LINKS.unsubscribe_token(setup.account_id, sid, setup.campaign_id)  # type: ignore[arg-type]
    mailto = f", <mailto:{mailbox}?subject=unsubscribe%20{token}>" if mailbox else ""
    assert inbox.messages[0].parsed()["List-Unsubscribe"] == f"<{PUBLIC_URL}/u/{token}>{mailto}"


async def test_one_click_unsubscribe_mid_campaign(database_url: str, client: httpx.Client) -> None:
    addresses = emails(60)
    setup = await campaign_setup(database_url, addresses)
    sid = _one(database_url, "SELECT subscriber_id FROM sendonce.subscribers WHERE email = %s", addresses[-1])[0]
    token = LINKS.unsubscribe_token(setup.account_id, sid, setup.campaign_id)  # type: ignore[arg-type]
    with Inbox(faults=InboxFaults(late=1.0, late_seconds=0.03)) as inbox:
        worker = Worker(
            database_url,
            transport_from_url(inbox.url),
            WorkerConfig(concurrency=1, batch_size=5, tick=0.2),
            composer=composer(),
        )
        task = asyncio.create_task(worker.run())
        await asyncio.to_thread(inbox.wait_for, 5, 30)
        # the one-click POST of RFC 8058: no cookie, no auth, and the answer is not a redirect
        response = await asyncio.to_thread(
            client.post,
            f"/u/{token}",
            content=b"List-Unsubscribe=One-Click",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert response.status_code == 200 and "set-cookie" not in response.headers
        assert "unsubscribed" in response.text
        again = await asyncio.to_thread(client.post, f"/u/{token}")
        assert again.status_code == 200  # idempotent
        deadline = time.monotonic() + 60
        while (await campaign_status(database_url, setup.account_id, setup.campaign_id))[0] != "sent":  # type: ignore[arg-type]
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        worker.stop()
        await task
        received = inbox.by_recipient()
    assert addresses[-1] not in received
    assert len(received) == 59
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (counts.sent, counts.suppressed) == (59, 1)


def test_a_forged_unsubscribe_token_changes_nothing(database_url: str, client: httpx.Client) -> None:
    token = LINKS.unsubscribe_token(1, 1, 1)
    forged = KeyRing(b"another-secret-0123456789abcdef").sign_stable("unsubscribe", {"a": 1, "s": 1, "c": 1})
    for bad in (forged, token[:-4] + "AAAA", "x" * 40):
        assert client.post(f"/u/{bad}").status_code == 400
        assert client.get(f"/u/{bad}").status_code == 400
    assert _one(database_url, "SELECT count(*) FROM sendonce.list_members WHERE status = 'unsubscribed'") == (0,)


@pytest.mark.parametrize("retired", [True, False])
async def test_an_unsubscribe_link_works_after_its_secret_is_retired(database_url: str, retired: bool) -> None:
    # Mail signed under a secret two rotations ago is still in mailboxes, and its one-click POST must
    # still unsubscribe: the old secret stays in SENDONCE_SECRET_RETIRED, which signs nothing.
    setup = await campaign_setup(database_url, ["ann@example.test"])
    token = LINKS.unsubscribe_token(setup.account_id, 1, setup.campaign_id)  # type: ignore[arg-type]
    settings: dict[str, Any] = {
        "secret": "the-newest-secret-0123456789",
        "secret_previous": "the-one-before-0123456789",
    }
    if retired:
        settings["secret_retired"] = f"some-other-old-secret-0123 {TEST_SECRET}"
    with ApiServer(database_url, **settings) as api, httpx.Client(base_url=api.url, timeout=10) as client:
        response = client.post(
            f"/u/{token}",
            content=b"List-Unsubscribe=One-Click",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
    assert response.status_code == (200 if retired else 400)
    status = _one(database_url, "SELECT status FROM sendonce.list_members")
    assert status == (("unsubscribed",) if retired else ("confirmed",))


async def test_the_unsubscribe_page_asks_first_and_offers_to_resubscribe(
    database_url: str, client: httpx.Client
) -> None:
    setup = await campaign_setup(database_url, ["ann@example.test"])
    token = LINKS.unsubscribe_token(setup.account_id, 1, setup.campaign_id)  # type: ignore[arg-type]
    page = client.get(f"/u/{token}")
    assert page.status_code == 200
    # the form posts back to the page's own URL, also behind a path prefix in SENDONCE_PUBLIC_URL
    (action,) = re.findall(r'action="([^"]*)"', page.text)
    assert urljoin(f"https://example.com/mail/u/{token}", action) == f"https://example.com/mail/u/{token}"
    assert _one(database_url, "SELECT status FROM sendonce.list_members") == ("confirmed",)  # GET changed nothing
    client.post(f"/u/{token}")
    assert _one(database_url, "SELECT status FROM sendonce.list_members") == ("unsubscribed",)
    assert "Resubscribe" in client.get(f"/u/{token}").text
    assert client.post(f"/u/{token}/resubscribe").status_code == 200
    assert _one(database_url, "SELECT status FROM sendonce.list_members") == ("confirmed",)


async def test_an_old_unsubscribe_is_undone_only_by_a_confirmation_to_the_address(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    # The link never expires and travels with every forwarded copy of the mail: it undoes an
    # unsubscribe made by mistake, that day; one made before, only through a mail to the address.
    setup = await campaign_setup(database_url, ["ann@example.test"])
    token = LINKS.unsubscribe_token(setup.account_id, 1, setup.campaign_id)  # type: ignore[arg-type]
    client.post(f"/u/{token}")
    with psycopg.connect(database_url) as conn:
        # two days ago; other writes since (a signup's verification touching the membership) do not
        # make it recent
        conn.execute("UPDATE sendonce.list_members SET unsubscribed_at = now() - interval '2 days', updated_at = now()")
    page = client.get(f"/u/{token}")
    assert page.status_code == 200 and "You are unsubscribed" in page.text and "Send me a mail" in page.text
    for _ in range(3):  # a double submit, a forwarder: one confirmation mail, no subscription
        asked = client.post(f"/u/{token}/resubscribe")
        assert asked.status_code == 200 and "Check your inbox" in asked.text
    assert _one(database_url, "SELECT status FROM sendonce.list_members") == ("pending",)
    kinds = "SELECT kind, count(*) FROM sendonce.deliveries WHERE campaign_id IS NULL GROUP BY kind"
    assert _one(database_url, kinds) == ("list_confirmation_requested", 1)
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    (mail,) = [m for m in inbox.messages if m.parsed()["Subject"].startswith("Confirm")]
    link = re.search(r"/v1/lists/confirm\?token=(\S+)", mail.parsed().get_body(("plain",)).get_content())
    assert link is not None
    assert client.post("/v1/lists/confirm", json={"token": link.group(1)}).json()["already_confirmed"] is False
    assert _one(database_url, "SELECT status FROM sendonce.list_members") == ("confirmed",)
    again = client.post(f"/u/{token}/resubscribe")
    assert again.status_code == 200 and "Welcome back" in again.text


async def test_transactional_mail_has_no_list_unsubscribe(
    database_url: str, inbox: Inbox, client: httpx.Client
) -> None:
    key = client.post("/v1/accounts", json={"name": "a", "from_email": "a@acme.test"}, headers=ADMIN).json()["api_key"]
    client.post(
        "/v1/signups", json={"email": "ann@example.test", "origin": "web"}, headers={"Authorization": f"Bearer {key}"}
    )
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    message = inbox.messages[0].parsed()
    assert message["List-Unsubscribe"] is None and message["List-Unsubscribe-Post"] is None


# -- bounces and complaints --------------------------------------------------------------------------


def _generic(
    client: httpx.Client, events: list[dict[str, Any]], secret: str = GENERIC_SECRET, **params: Any
) -> httpx.Response:
    body = json.dumps({"events": events}).encode()
    ts = str(int(time.time()))
    mac = hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    headers = {"Sendonce-Timestamp": ts, "Sendonce-Signature": f"sha256={mac}", "Content-Type": "application/json"}
    return client.post("/v1/webhooks/generic", content=body, headers=headers, params=params)


async def _sent_campaign(database_url: str, addresses: list[str]) -> Any:
    setup = await campaign_setup(database_url, addresses)
    with Inbox() as inbox:
        await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    return setup


async def test_a_hard_bounce_suppresses_once_however_often_it_is_replayed(
    database_url: str, client: httpx.Client
) -> None:
    await _sent_campaign(database_url, ["ann@example.test", "bob@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries WHERE email = 'ann@example.test'")[0]
    event = {
        "id": "evt-1",
        "type": "hard_bounce",
        "email": "ann@example.test",
        "job_id": job,
        "detail": {"smtp": "550 5.1.1"},
    }
    for _ in range(3):
        response = _generic(client, [event])
        assert response.status_code == 200, response.text
    assert response.json() == {"received": 1, "new": 0, "unattributed": 0}
    assert _one(database_url, "SELECT count(*) FROM sendonce.feedback_events") == (1,)
    assert _one(database_url, "SELECT email_key, reason FROM sendonce.suppressions") == ("ann@example.test", "bounce")
    assert _one(database_url, "SELECT status FROM sendonce.subscribers WHERE email = 'ann@example.test'") == (
        "bounced",
    )
    assert _one(database_url, "SELECT feedback FROM sendonce.deliveries WHERE job_id = %s", job) == ("hard_bounce",)


@pytest.mark.parametrize(
    "reported",
    ["Ann <ann@example.test>", "ann@forward.test"],
    ids=["a-form-that-does-not-parse", "a-forwarding-target"],
)
async def test_a_bounce_linked_to_its_delivery_suppresses_the_address_we_sent_to(
    database_url: str, client: httpx.Client, reported: str
) -> None:
    # The provider's address may not be the one we sent to (a DSN's Final-Recipient behind a
    # forwarding alias), or may not parse: the bounce suppressed that other address, or nobody, and
    # the subscriber stayed confirmed. The job id says which message bounced, and so to whom.
    await _sent_campaign(database_url, ["ann@example.test", "bob@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries WHERE email = 'ann@example.test'")[0]
    response = _generic(client, [{"id": "evt-1", "type": "hard_bounce", "job_id": job, "email": reported}])
    assert response.json() == {"received": 1, "new": 1, "unattributed": 0}, response.text
    assert _one(database_url, "SELECT array_agg(email_key) FROM sendonce.suppressions") == (["ann@example.test"],)
    assert _one(database_url, "SELECT status FROM sendonce.subscribers WHERE email = 'ann@example.test'") == (
        "bounced",
    )
    assert _one(database_url, "SELECT email FROM sendonce.feedback_events") == (reported,)  # as reported


async def test_an_unsubscribe_the_provider_took_opts_the_subscriber_out(
    database_url: str, client: httpx.Client
) -> None:
    # Through the provider's own link (SendGrid's subscription tracking, Postmark's, SES's list
    # management) the recipient opted out; the event was recorded as "other" and nothing changed.
    await _sent_campaign(database_url, ["ann@example.test", "bob@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries WHERE email = 'ann@example.test'")[0]
    response = _generic(client, [{"id": "u-1", "type": "unsubscribe", "email": "ann@example.test", "job_id": job}])
    assert response.json() == {"received": 1, "new": 1, "unattributed": 0}, response.text
    assert _one(database_url, "SELECT email_key, reason FROM sendonce.suppressions") == (
        "ann@example.test",
        "unsubscribe",
    )
    assert _one(database_url, "SELECT status FROM sendonce.subscribers WHERE email = 'ann@example.test'") == (
        "unsubscribed",
    )
    assert _one(database_url, "SELECT status FROM sendonce.subscribers WHERE email = 'bob@example.test'") == (
        "confirmed",
    )


async def test_complaints_suppress_at_once_and_soft_bounces_after_a_few(
    database_url: str, client: httpx.Client
) -> None:
    setup = await _sent_campaign(database_url, ["ann@example.test", "bob@example.test"])
    assert (
        _generic(
            client, [{"id": "c1", "type": "complaint", "email": "ann@example.test", "account_id": setup.account_id}]
        ).json()["new"]
        == 1
    )
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions WHERE email_key = 'ann@example.test'") == (
        "complaint",
    )
    for n in range(3):
        _generic(
            client,
            [{"id": f"s{n}", "type": "soft_bounce", "email": "bob@example.test", "account_id": setup.account_id}],
        )
        suppressed = _one(
            database_url, "SELECT count(*) FROM sendonce.suppressions WHERE email_key = 'bob@example.test'"
        )
        assert suppressed == ((1,) if n == 2 else (0,))
    # an event that names no delivery and no account is not attributable: counted, ignored
    assert _generic(client, [{"id": "x", "type": "complaint", "email": "who@example.test"}]).json()["unattributed"] == 1


async def test_soft_bounces_reported_at_once_still_reach_the_limit(database_url: str) -> None:
    # Two requests for one address at once each counted the committed soft bounces and its own, never
    # the other's: the third soft bounce of the limit arrived and nobody was suppressed (13 of 20
    # addresses in a review's run of concurrent requests).
    setup = await _sent_campaign(database_url, ["bob@example.test"])
    policy = FeedbackPolicy(soft_bounce_limit=3)

    def soft(n: int) -> FeedbackEvent:
        return FeedbackEvent(
            "generic", f"s{n}", "soft_bounce", "bob@example.test", None, None, None, {}, setup.account_id
        )

    async with await connect(database_url) as first, await connect(database_url) as second:
        async with first.transaction():
            assert (await feedback.ingest(first, soft(1), policy)).new
        async with first.transaction():
            assert not (await feedback.ingest(first, soft(2), policy)).suppressed

            async def other() -> bool:
                async with second.transaction():
                    return (await feedback.ingest(second, soft(3), policy)).suppressed

            racing = asyncio.create_task(other())
            await asyncio.wait([racing], timeout=0.5)  # it waits for this transaction (without the lock: done)
        assert await racing
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions WHERE email_key = 'bob@example.test'") == (
        "bounce",
    )


async def test_a_remote_servers_nul_or_broken_text_does_not_lose_the_bounce(
    database_url: str, client: httpx.Client
) -> None:
    # A NUL or a lone surrogate in a diagnostic (relayed from the remote server) made the request a
    # 422 every time the provider sent it, and the bounce was never applied.
    await _sent_campaign(database_url, ["ann@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries")[0]
    event = {
        "id": "evt\u0000-1",
        "type": "hard_bounce",
        "email": "ann@example.test\u0000",
        "job_id": job,
        "detail": {"smtp": "550 5.1.1 user\u0000unknown", "raw\ud800": ["\udfff", {"deep": "\u0000"}]},
    }
    response = _generic(client, [event])
    assert response.status_code == 200, response.text
    assert response.json() == {"received": 1, "new": 1, "unattributed": 0}
    assert _one(database_url, "SELECT email_key, reason FROM sendonce.suppressions") == ("ann@example.test", "bounce")
    assert _one(database_url, "SELECT event_id, detail->>'smtp' FROM sendonce.feedback_events") == (
        "evt\ufffd-1",
        "550 5.1.1 user\ufffdunknown",
    )
    assert _generic(client, [event]).json()["new"] == 0  # and its replay is one


async def test_an_event_named_by_an_address_that_does_not_parse_is_refused_not_swallowed(
    database_url: str, client: httpx.Client
) -> None:
    # It was recorded (200, new) and suppressed nobody; the corrected event, same id, was then taken
    # for a replay and never applied.
    setup = await _sent_campaign(database_url, ["ann@example.test"])
    wrong = {"id": "c1", "type": "complaint", "email": "Ann <ann@example.test>", "account_id": setup.account_id}
    response = _generic(client, [wrong])
    assert response.status_code == 400 and "email is not an email address" in response.json()["detail"]
    # with a job id that names no delivery, it can say nothing about anyone: unattributed, not recorded
    unlinked = dict(wrong, job_id=f"campaign:{setup.campaign_id}:999999")
    assert _generic(client, [unlinked]).json() == {"received": 1, "new": 0, "unattributed": 1}
    assert _one(database_url, "SELECT count(*) FROM sendonce.feedback_events") == (0,)
    assert _generic(client, [dict(wrong, email="ann@example.test")]).json()["new"] == 1
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions") == ("complaint",)


async def test_a_webhook_that_loses_a_deadlock_is_a_503_for_the_provider_to_retry(database_url: str) -> None:
    # SNS and Postmark take a 4xx for final: a deadlock answered 409 (as a TransactionRollback would
    # be elsewhere) would lose the request's bounces. psycopg raises DeadlockDetected as an
    # OperationalError, which the API answers 503. The request holds ann's soft-bounce lock and waits
    # for bob's, which this test holds, then waits for ann's; the request's session detects the cycle
    # (this one's deadlock_timeout is longer) and is rolled back.
    setup = await _sent_campaign(database_url, ["ann@example.test", "bob@example.test"])

    def lock(conn: psycopg.Connection[Any], address: str) -> None:
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('sendonce.soft_bounces:' || %s::text || ':' || %s, 0))",
            (setup.account_id, address),
        )

    events = [
        {"id": f"s-{a}", "type": "soft_bounce", "email": f"{a}@example.test", "account_id": setup.account_id}
        for a in ("ann", "bob")
    ]
    with (
        ApiServer(database_url, webhook_secret=GENERIC_SECRET) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
        psycopg.connect(database_url) as conn,
    ):
        conn.execute("SET deadlock_timeout = '60s'")
        lock(conn, "bob@example.test")
        answer: list[httpx.Response] = []
        request = asyncio.create_task(asyncio.to_thread(lambda: answer.append(_generic(client, events))))
        for _ in range(1000):
            waiting = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND pid <> pg_backend_pid()"
            ).fetchone()
            if waiting and waiting[0]:
                break
            await asyncio.sleep(0.01)
        lock(conn, "ann@example.test")  # granted once the request's transaction is rolled back
        conn.rollback()
        await request
    (response,) = answer
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1
    assert _one(database_url, "SELECT count(*) FROM sendonce.feedback_events") == (0,)


async def test_a_postmark_bounce_of_mail_sent_through_its_smtp_relay_finds_its_delivery(database_url: str) -> None:
    # Postmark's bounce carries no headers of the message, and its MessageID is not in the relay's
    # SMTP reply that a record keeps: every bounce was unattributed and suppressed nobody. Through
    # smtp.postmarkapp.com (or ?relay=postmark) each message names its job in X-PM-Metadata-*, which
    # Postmark echoes in the webhook's Metadata.
    setup = await campaign_setup(database_url, ["ann@example.test", "bob@example.test"])
    with Inbox() as inbox:
        await run_to_drain(database_url, transport_from_url(inbox.url + "?relay=postmark"), DRAIN)
    received = {m.rcpt_to[0]: m.parsed() for m in inbox.messages}
    metadata = received["ann@example.test"]["X-PM-Metadata-sendonce-job-id"]
    assert metadata == received["ann@example.test"]["Sendonce-Job-Id"]
    bounce = postmark_bounce()
    bounce.update(Email="ann@example.test", MessageID="0a1b2c3d-postmark-id")
    with (
        ApiServer(database_url, postmark_webhook_token="pm-token") as server,
        httpx.Client(base_url=server.url, timeout=30, headers={"X-Sendonce-Webhook-Token": "pm-token"}) as client,
    ):
        unlinked = dict(bounce, ID=1, Metadata={})  # as Postmark reported it before: nothing to link
        assert client.post("/v1/webhooks/postmark", json=unlinked).json()["unattributed"] == 1
        linked = dict(bounce, Metadata={"sendonce-job-id": metadata})
        assert client.post("/v1/webhooks/postmark", json=linked).json() == {"received": 1, "new": 1, "unattributed": 0}
    assert _one(database_url, "SELECT email_key, reason FROM sendonce.suppressions") == ("ann@example.test", "bounce")
    assert _one(database_url, "SELECT account_id FROM sendonce.feedback_events WHERE delivery_id IS NOT NULL") == (
        setup.account_id,
    )


def test_webhooks_refuse_bad_signatures_and_payloads(client: httpx.Client, database_url: str) -> None:
    ok = {"id": "e", "type": "hard_bounce", "email": "a@example.test"}
    assert _generic(client, [ok], secret="wrong").status_code == 401
    body = json.dumps({"events": [ok]}).encode()
    assert client.post("/v1/webhooks/generic", content=body).status_code == 401
    assert _generic(client, [{"id": "e", "type": "explosion", "email": "a@example.test"}]).status_code == 400
    assert client.post("/v1/webhooks/carrier-pigeon", content=b"{}").status_code == 404
    assert client.post("/v1/webhooks/postmark", content=b"{}").status_code == 401  # not configured
    assert _one(database_url, "SELECT count(*) FROM sendonce.suppressions") == (0,)


async def test_an_event_naming_an_account_that_does_not_exist_is_unattributed(
    database_url: str, client: httpx.Client
) -> None:
    # It was a 500 (the foreign key of feedback_events), which a provider retries for ever, and the
    # events of the same request that were fine went with it.
    setup = await _sent_campaign(database_url, ["ann@example.test"])
    events = [
        {"id": "gone", "type": "complaint", "email": "ann@example.test", "account_id": setup.account_id + 1000},
        {"id": "here", "type": "complaint", "email": "ann@example.test", "account_id": setup.account_id},
    ]
    response = _generic(client, events)
    assert response.status_code == 200, response.text
    assert response.json() == {"received": 2, "new": 1, "unattributed": 1}
    assert _one(database_url, "SELECT array_agg(event_id) FROM sendonce.feedback_events") == (["here"],)
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions") == ("complaint",)


@pytest.mark.parametrize("campaign_id", ["²", "9" * 4301, str(2**63)])
async def test_a_campaign_job_id_whose_campaign_cannot_exist_is_unattributed(
    database_url: str, client: httpx.Client, campaign_id: str
) -> None:
    # "²".isdigit() is true but int("²") raises, as does int() of more than 4300 digits: these were 500s
    # (2**63 was refused before too: it stays so).
    await _sent_campaign(database_url, ["ann@example.test"])
    event = {"id": "e", "type": "hard_bounce", "email": "ann@example.test", "job_id": f"campaign:{campaign_id}:1"}
    response = _generic(client, [event])
    assert response.status_code == 200, response.text
    assert response.json() == {"received": 1, "new": 0, "unattributed": 1}
    assert _one(database_url, "SELECT count(*) FROM sendonce.feedback_events") == (0,)


async def test_resend_svix_webhook(database_url: str, client: httpx.Client) -> None:
    await _sent_campaign(database_url, ["ann@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries")[0]
    payload = {
        "type": "email.complained",
        "created_at": "2026-11-30T10:00:00.000Z",
        "data": {
            "email_id": "re-1",
            "to": ["ann@example.test"],
            "headers": {"Sendonce-Job-Id": job},
            "created_at": "2026-11-30T10:00:00Z",
        },
    }
    body = json.dumps(payload).encode()
    key = base64.b64decode(SVIX_SECRET.removeprefix("whsec_"))
    headers = svix_headers(body, msg_id="msg_1", ts=str(int(time.time())), key=key)
    for _ in range(2):
        assert client.post("/v1/webhooks/resend", content=body, headers=headers).status_code == 200
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions") == ("complaint",)
    tampered = body.replace(b"ann@", b"bob@")
    assert client.post("/v1/webhooks/resend", content=tampered, headers=headers).status_code == 401


async def test_an_event_id_too_long_for_its_index_is_stored_as_its_digest(
    database_url: str, client: httpx.Client
) -> None:
    # An event id past what an index entry holds (about 2.7 kB: here a Svix id, and per recipient a
    # multi-recipient event's id with its address) made the insert fail, answered 503: the provider
    # retried it for days, and the complaint was never applied.
    await _sent_campaign(database_url, ["ann@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries")[0]
    payload = {
        "type": "email.complained",
        "created_at": "2026-11-30T10:00:00.000Z",
        "data": {"email_id": "re-1", "to": ["ann@example.test"], "headers": {"Sendonce-Job-Id": job}},
    }
    body = json.dumps(payload).encode()
    key = base64.b64decode(SVIX_SECRET.removeprefix("whsec_"))
    headers = svix_headers(body, msg_id="msg_" + secrets.token_urlsafe(6000), ts=str(int(time.time())), key=key)
    answers = [client.post("/v1/webhooks/resend", content=body, headers=headers) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert [a.json()["new"] for a in answers] == [1, 0]  # a replay has the same digest
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions") == ("complaint",)
    (stored,) = _one(database_url, "SELECT event_id FROM sendonce.feedback_events")
    assert stored.startswith("sha256:") and len(stored) == 7 + 64


async def test_an_event_names_a_long_provider_id_as_the_provider_gave_it(
    database_url: str, client: httpx.Client
) -> None:
    # The record keeps a provider's id to its first 500 characters; the event names the whole id,
    # and found no delivery by it.
    setup = await campaign_setup(database_url, ["ann@example.test"])
    with ResendServer(faults=ResendFaults(id_length=3000)) as provider:
        await run_to_drain(database_url, transport_from_url(provider.url), DRAIN)
        (accepted,) = provider.accepted
    payload = {
        "type": "email.complained",
        "created_at": "2026-11-30T10:00:00.000Z",
        "data": {"email_id": accepted.id, "to": ["ann@example.test"]},  # no job id: only the id links it
    }
    body = json.dumps(payload).encode()
    key = base64.b64decode(SVIX_SECRET.removeprefix("whsec_"))
    headers = svix_headers(body, msg_id="msg_long", ts=str(int(time.time())), key=key)
    answer = client.post("/v1/webhooks/resend", content=body, headers=headers)
    assert answer.json() == {"received": 1, "new": 1, "unattributed": 0}, answer.text
    assert _one(database_url, "SELECT account_id, reason FROM sendonce.suppressions") == (setup.account_id, "complaint")


@pytest.fixture
def sns_certificate_at_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The certificate of the test's SNS key, valid today by the real clock (the route checks it
    against that), served from the route's cache for this test only: nothing is fetched."""
    from sendonce.api.routes import webhooks

    now = datetime.now(UTC)
    pem = sns_certificate(SNS_KEY, not_before=now - timedelta(days=1), not_after=now + timedelta(days=1))
    monkeypatch.setitem(webhooks._CERTIFICATES, CERT_URL, pem)


@pytest.mark.usefixtures("sns_certificate_at_hand")
async def test_ses_over_sns_with_a_test_certificate(database_url: str, client: httpx.Client) -> None:
    await _sent_campaign(database_url, ["ann@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries")[0]
    record = {
        "notificationType": "Bounce",
        "bounce": {
            "bounceType": "Permanent",
            "bounceSubType": "General",
            "bouncedRecipients": [
                {"emailAddress": "ann@example.test", "status": "5.1.1", "diagnosticCode": "smtp; 550"}
            ],
            "timestamp": "2026-11-30T10:00:00.000Z",
            "feedbackId": "f-1",
        },
        "mail": {
            "timestamp": "2026-11-30T09:59:00.000Z",
            "messageId": "ses-msg-1",
            "source": "news@sender.test",
            "destination": ["ann@example.test"],
            "headers": [{"name": "Sendonce-Job-Id", "value": job}],
        },
    }
    envelope = sns_notification(record, version="2")
    for _ in range(2):
        response = client.post("/v1/webhooks/ses", content=json.dumps(envelope).encode())
        assert response.status_code == 200, response.text
    assert _one(database_url, "SELECT count(*), min(provider) FROM sendonce.feedback_events") == (1, "ses")
    assert _one(database_url, "SELECT reason FROM sendonce.suppressions") == ("bounce",)
    envelope["Message"] = envelope["Message"].replace("Permanent", "Transient")
    assert client.post("/v1/webhooks/ses", content=json.dumps(envelope).encode()).status_code == 401


@pytest.mark.usefixtures("sns_certificate_at_hand")
@pytest.mark.parametrize("failure", ["unreachable", "502"])
def test_an_sns_subscription_whose_url_fails_is_a_503(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    # A signed SubscriptionConfirmation: the API confirms it by fetching its SubscribeURL. That fetch
    # failing was a 500 (and a 5xx answer a 200 "not confirmed"); SNS sends the confirmation again on
    # a failure, so both are a 503 to retry.
    def subscribe(url: str, **_: Any) -> httpx.Response:
        if failure == "unreachable":
            raise httpx.ConnectError(f"cannot reach {url}")
        return httpx.Response(502)

    monkeypatch.setattr(httpx, "get", subscribe)
    headers = {"x-amz-sns-message-type": "SubscriptionConfirmation"}
    response = client.post("/v1/webhooks/ses", content=json.dumps(sns_confirmation()).encode(), headers=headers)
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert "SubscribeURL" in response.json()["detail"]


async def test_a_campaign_with_too_many_bounces_pauses_itself(database_url: str, client: httpx.Client) -> None:
    addresses = emails(300)
    setup = await campaign_setup(database_url, addresses)

    def reject(address: str) -> str | None:  # 30% of the list no longer exists
        return "550 5.1.1 user unknown" if int(address[4:10]) % 10 < 3 else None

    with Inbox(faults=InboxFaults(reject=reject)) as inbox:
        policy = FeedbackPolicy(max_bounce_rate=0.1, min_sample=40)
        config = WorkerConfig(concurrency=2, batch_size=10, tick=0.2, lease=5, drain=True, feedback=policy)
        await run_to_drain(database_url, transport_from_url(inbox.url), config)
        delivered = len(inbox.messages)
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert status == "paused"
    assert delivered < 200 and counts.queued > 0
    assert counts.failed >= 12  # the hard bounces that tripped it
    alerts = client.get("/v1/alerts", headers=await _key_for(database_url, setup.account_id, client)).json()["items"]
    assert [a["kind"] for a in alerts] == ["campaign_paused"]
    assert "bounce rate" in alerts[0]["detail"]["reason"]
    reason = _one(
        database_url, "SELECT paused_reason FROM sendonce.campaigns WHERE campaign_id = %s", setup.campaign_id
    )[0]
    assert re.match(r"bounce rate \d+\.\d% is over its limit of 10\.0%", reason)
    auth = await _key_for(database_url, setup.account_id, client)
    shown = client.get(f"/v1/campaigns/{setup.campaign_id}", headers=auth).json()
    assert shown["status"] == "paused" and shown["paused_reason"] == reason
    assert client.post(f"/v1/campaigns/{setup.campaign_id}/resume", headers=auth).status_code == 200
    assert client.get(f"/v1/campaigns/{setup.campaign_id}", headers=auth).json()["paused_reason"] is None


async def test_a_bounce_check_that_fails_after_a_record_does_not_hold_up_the_lanes(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The campaign's bounce check ran inside the record, after its commit: a check that failed (or
    # outlasted db_timeout) failed the whole record, which ran again, checked again, failed again,
    # while the lane waiting for it (one unrecorded message per SMTP connection) sent nothing more.
    addresses = emails(6)
    await campaign_setup(database_url, addresses)

    async def refused(*args: object, **kwargs: object) -> None:
        raise psycopg.OperationalError("the bounce check cannot be made now")

    monkeypatch.setattr(feedback, "check_campaign", refused)
    gone = addresses[0]
    with Inbox(faults=InboxFaults(reject=lambda a: "550 5.1.1 user unknown" if a == gone else None)) as inbox:
        config = WorkerConfig(concurrency=1, batch_size=10, tick=0.2, lease=5, backoff_base=0.05)
        async with running_worker(database_url, transport_from_url(inbox.url), config) as worker:
            deadline = time.monotonic() + 30
            while len(inbox.messages) < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        assert sorted(m.rcpt_to[0] for m in inbox.messages) == addresses[1:]
    # each group recorded once: run again, its rows were found recorded and each was reported as
    # "outcome refused, re-claimed by another worker" (a warning that was not true)
    assert worker.stats.fenced_out == 0, worker.stats
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT status::text, count(*) FROM sendonce.deliveries GROUP BY 1 ORDER BY 1").fetchall()
    assert rows == [("failed", 1), ("sent", 5)], rows


async def test_a_bounce_check_that_failed_is_made_again_by_the_providers_retry(
    database_url: str, client: httpx.Client
) -> None:
    """The campaign's bounce rate is checked after the events are committed. A check that failed
    there (the database lost, here a trigger that refuses the pause once) was never made again: the
    provider's retry was a replay, new to no campaign, and the campaign went on sending past its
    limit. A replay is checked too."""
    setup = await _sent_campaign(database_url, ["ann@example.test", "bob@example.test"])
    job = _one(database_url, "SELECT job_id FROM sendonce.deliveries WHERE email = 'ann@example.test'")[0]
    with psycopg.connect(database_url, autocommit=True) as conn:
        # the bounce arrives while the campaign still sends (its last rows in flight elsewhere)
        conn.execute("UPDATE sendonce.campaigns SET status = 'sending', finished_at = NULL")
        conn.execute(
            """CREATE FUNCTION public.refuse_pause() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN RAISE EXCEPTION 'terminating connection' USING ERRCODE = '57P01'; END $$"""
        )
        conn.execute(
            """CREATE TRIGGER refuse_pause BEFORE UPDATE ON sendonce.campaigns FOR EACH ROW
               WHEN (NEW.status = 'paused') EXECUTE FUNCTION public.refuse_pause()"""
        )
    event = {"id": "evt-bounce", "type": "hard_bounce", "email": "ann@example.test", "job_id": job}
    try:
        assert _generic(client, [event]).status_code == 503
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER refuse_pause ON sendonce.campaigns")
            conn.execute("DROP FUNCTION public.refuse_pause()")
    response = _generic(client, [event])  # the provider's retry
    assert response.status_code == 200, response.text
    assert response.json()["new"] == 0  # the failed request's events were committed: a replay
    assert _one(database_url, "SELECT status FROM sendonce.campaigns WHERE campaign_id = %s", setup.campaign_id) == (
        "paused",
    )
    assert _one(database_url, "SELECT count(*) FROM sendonce.feedback_events") == (1,)


async def _key_for(database_url: str, account_id: int, client: httpx.Client) -> dict[str, str]:
    """A fresh API key for an account created in the store (tests only: replaces its hash)."""
    from sendonce.store.accounts import _hash

    async with await connect(database_url) as conn:
        await conn.execute(
            "UPDATE sendonce.accounts SET api_key_hash = %s WHERE account_id = %s", (_hash("x" * 43), account_id)
        )
    return {"Authorization": f"Bearer sk_{account_id}_{'x' * 43}"}


# -- DKIM ---------------------------------------------------------------------------------------------


def _campaign_via_api(client: httpx.Client, auth: dict[str, str], addresses: list[str]) -> int:
    lst = client.post("/v1/lists", json={"name": "news"}, headers=auth).json()["id"]
    client.post(
        "/v1/subscribers", json={"subscribers": [{"email": a, "lists": [lst]} for a in addresses]}, headers=auth
    )
    cid = client.post(
        "/v1/campaigns", json={"name": "n", "subject": "Hello", "text": "Hi {{ email }}", "lists": [lst]}, headers=auth
    ).json()["id"]
    assert client.post(f"/v1/campaigns/{cid}/approve", headers=auth).status_code == 200
    return int(cid)


async def test_dkim_signature_verifies_and_covers_the_unsubscribe_headers(
    database_url: str, client: httpx.Client, inbox: Inbox, tmp_path: Any
) -> None:
    import dkim
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "dkim.pem").write_bytes(pem)
    public = base64.b64encode(
        key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    ).decode()
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    dkim_url = f"/v1/accounts/{body['id']}/dkim"
    config = {"domain": "acme.test", "selector": "s2026", "key_file": str(tmp_path / "dkim.pem")}
    # where the workers read keys is host configuration: an account's own key cannot set it
    assert client.put(dkim_url, json=config, headers=auth).status_code == 401
    assert client.put(dkim_url, json={"domain": "acme.test", "selector": "s1"}, headers=ADMIN).status_code == 422
    response = client.put(dkim_url, json=config, headers=ADMIN)
    assert response.status_code == 200 and response.json()["dkim"]["selector"] == "s2026"
    _campaign_via_api(client, auth, ["ann@example.test"])
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    data = inbox.messages[0].data
    asked: list[bytes] = []

    def dns(name: bytes, timeout: int = 5) -> bytes:
        asked.append(name)
        return f"v=DKIM1; k=rsa; p={public}".encode()

    assert dkim.verify(data, dnsfunc=dns)
    assert asked == [b"s2026._domainkey.acme.test."]
    signature = inbox.messages[0].parsed()["DKIM-Signature"]
    signed = {
        h.strip() for h in re.search(r"h=([^;]+);", signature.replace("\r\n", "").replace(" ", "")).group(1).split(":")
    }  # type: ignore[union-attr]
    assert {"from", "subject", "message-id", "list-unsubscribe", "list-unsubscribe-post"} <= signed
    tampered = data.replace(b"Subject: Hello", b"Subject: Hellp")
    assert not dkim.verify(tampered, dnsfunc=dns)


async def test_a_missing_dkim_key_pauses_the_campaign_instead_of_failing_it_or_sending_unsigned(
    database_url: str, client: httpx.Client, inbox: Inbox, tmp_path: Any
) -> None:
    # The key file is not there yet (a deploy that forgot it). Nothing goes out unsigned. It used to
    # fail each row after its tries (about four minutes), so the campaign ended "sent" with nothing
    # delivered: every message of the sender waits alike, so the campaign pauses, saying why; once
    # the key is in place a resume sends each address once, signed.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    key_file = tmp_path / "dkim.pem"
    client.put(
        f"/v1/accounts/{body['id']}/dkim",
        json={"domain": "acme.test", "selector": "s", "key_file": str(key_file)},
        headers=ADMIN,
    )
    addresses = emails(3)
    cid = _campaign_via_api(client, auth, addresses)
    config = WorkerConfig(tick=0.2, lease=5, drain=True, backoff_base=0.05, backoff_cap=0.2, max_failures=2)
    shared = composer()  # one worker's cache of accounts, across the pause and the resume
    await run_to_drain(database_url, transport_from_url(inbox.url), config, composer=shared)  # drained: paused
    assert inbox.messages == []
    shown = client.get(f"/v1/campaigns/{cid}", headers=auth).json()
    assert shown["status"] == "paused", shown
    assert f"the DKIM key of acme.test cannot be read from {key_file}" in shown["paused_reason"], shown
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT status::text, failures FROM sendonce.deliveries ORDER BY failures").fetchall()
    assert rows == [("queued", 0), ("queued", 0), ("queued", 1)], rows  # one tried; the others held back
    assert [a["kind"] for a in client.get("/v1/alerts", headers=auth).json()["items"]] == ["campaign_paused"]

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    key_file.write_bytes(pem)
    assert client.post(f"/v1/campaigns/{cid}/resume", headers=auth).status_code == 200  # at once
    await run_to_drain(database_url, transport_from_url(inbox.url), config, composer=shared)
    assert inbox.by_recipient() == dict.fromkeys(addresses, 1)
    assert all("DKIM-Signature" in m.parsed() for m in inbox.messages)
    assert client.get(f"/v1/campaigns/{cid}", headers=auth).json()["status"] == "sent"


async def test_a_campaign_the_worker_cannot_compile_pauses_saying_why(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    # Content the API checked, that this worker's compiler refuses (a newer release's tighter limits,
    # say: simulated by changing the stored text). Every row would fail alike, and used to, each with
    # "campaign N could not be loaded" and the reason only in the log: the campaign pauses, saying why.
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    addresses = emails(3)
    cid = _campaign_via_api(client, auth, addresses)
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE sendonce.campaigns SET text_body = 'Hi {{ email' WHERE campaign_id = %s", (cid,))
    config = WorkerConfig(tick=0.2, lease=5, drain=True, backoff_base=0.05, backoff_cap=0.2, max_failures=2)
    shared = composer()
    await run_to_drain(database_url, transport_from_url(inbox.url), config, composer=shared)
    assert inbox.messages == []
    shown = client.get(f"/v1/campaigns/{cid}", headers=auth).json()
    assert shown["status"] == "paused", shown
    assert f"campaign {cid} cannot be compiled: text: template syntax error" in shown["paused_reason"], shown
    assert shown["counts"]["failed"] == 0 and shown["counts"]["queued"] == 3, shown

    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE sendonce.campaigns SET text_body = 'Hi {{ email }}' WHERE campaign_id = %s", (cid,))
    assert client.post(f"/v1/campaigns/{cid}/resume", headers=auth).status_code == 200
    await run_to_drain(database_url, transport_from_url(inbox.url), config, composer=shared)
    assert inbox.by_recipient() == dict.fromkeys(addresses, 1)
    assert client.get(f"/v1/campaigns/{cid}", headers=auth).json()["status"] == "sent"


def _deepest_nesting_that_compiles_on_a_fresh_thread() -> int:
    def compiles(n: int) -> bool:
        try:
            compile_campaign(subject="Hi", text="{{ " + "(" * n + "email" + ")" * n + " }}", html=None)
        except TemplateError:
            return False
        return True

    with ThreadPoolExecutor(1) as pool:
        n = 1
        while pool.submit(compiles, n + 1).result():
            n += 1
            assert n < 10_000
    return n


async def test_a_template_nested_as_deeply_as_the_api_accepts_compiles_in_the_worker(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    # How deep a template may nest before the compiler's recursion gives out depends on the stack it
    # starts from. The API checks on a thread of its own; the worker compiled on its event loop, under
    # its coroutines, and refused what the API had accepted (every row failed). Both compile alike now.
    deepest = _deepest_nesting_that_compiles_on_a_fresh_thread() - 1  # a level of room for the frames around
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    lst = client.post("/v1/lists", json={"name": "news"}, headers=auth).json()["id"]
    addresses = emails(2)
    client.post(
        "/v1/subscribers", json={"subscribers": [{"email": a, "lists": [lst]} for a in addresses]}, headers=auth
    )
    text = "Hi {{ " + "(" * deepest + "email" + ")" * deepest + " }}"
    made = client.post(
        "/v1/campaigns", json={"name": "n", "subject": "Hello", "text": text, "lists": [lst]}, headers=auth
    )
    assert made.status_code == 201, made.text
    cid = made.json()["id"]
    assert client.post(f"/v1/campaigns/{cid}/approve", headers=auth).status_code == 200
    config = WorkerConfig(tick=0.2, lease=5, drain=True, backoff_base=0.05, backoff_cap=0.2, max_failures=2)
    await run_to_drain(database_url, transport_from_url(inbox.url), config)
    assert inbox.by_recipient() == dict.fromkeys(addresses, 1)
    assert client.get(f"/v1/campaigns/{cid}", headers=auth).json()["status"] == "sent"


async def test_a_missing_dkim_key_delays_transactional_mail_instead_of_sending_it_unsigned(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    # No campaign to pause: the message is retried, counted, with backoff.
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    client.put(
        f"/v1/accounts/{body['id']}/dkim",
        json={"domain": "acme.test", "selector": "s", "key_env": "NO_SUCH_DKIM_KEY"},
        headers=ADMIN,
    )
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    assert client.post("/v1/signups", json={"email": "ann@example.test", "origin": "web"}, headers=auth).is_success
    config = WorkerConfig(tick=0.2, lease=5, backoff_base=30)
    async with running_worker(database_url, transport_from_url(inbox.url), config):
        deadline = time.monotonic() + 20
        while _one(database_url, "SELECT coalesce(max(failures), 0) FROM sendonce.deliveries")[0] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    assert inbox.messages == []
    status, error = _one(database_url, "SELECT status, last_error FROM sendonce.deliveries")
    assert status == "queued" and "NO_SUCH_DKIM_KEY" in error


# -- double opt-in -----------------------------------------------------------------------------------


async def test_double_opt_in(database_url: str, client: httpx.Client, inbox: Inbox) -> None:
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    lst = client.post("/v1/lists", json={"name": "Weekly digest", "opt_in": "double"}, headers=auth).json()
    assert lst["opt_in"] == "double"
    people = {
        "subscribers": [
            {"email": "ann@example.test", "lists": [lst["id"]]},
            {"email": "bob@example.test", "lists": [lst["id"]]},
        ]
    }
    for _ in range(3):  # the client retries: still one confirmation mail each
        assert client.post("/v1/subscribers", json=people, headers=auth).status_code == 200
    vouched = {"subscribers": [{"email": "carl@example.test", "lists": [lst["id"]]}], "preconfirm": True}
    client.post("/v1/subscribers", json=vouched, headers=auth)
    first = client.post(
        "/v1/campaigns", json={"name": "n", "subject": "Digest", "text": "Hi", "lists": [lst["id"]]}, headers=auth
    ).json()["id"]
    client.post(f"/v1/campaigns/{first}/approve", headers=auth)
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    subjects = sorted((m.rcpt_to[0], m.parsed()["Subject"]) for m in inbox.messages)
    assert subjects == [
        ("ann@example.test", "Confirm your subscription to Weekly digest"),
        ("bob@example.test", "Confirm your subscription to Weekly digest"),
        ("carl@example.test", "Digest"),  # pending members never receive campaigns
    ]
    ann = next(m for m in inbox.messages if m.rcpt_to == ("ann@example.test",)).parsed()
    token = re.search(r"/v1/lists/confirm\?token=(\S+)", ann.get_body(("plain",)).get_content()).group(1)  # type: ignore[union-attr]
    (action,) = re.findall(r'action="([^"]*)"', client.get("/v1/lists/confirm", params={"token": token}).text)
    assert urljoin("https://example.com/mail/v1/lists/confirm?token=x", action).endswith("/mail/v1/lists/confirm")
    assert client.post("/v1/lists/confirm", json={"token": token}).json()["already_confirmed"] is False
    assert client.post("/v1/lists/confirm", json={"token": token}).json()["already_confirmed"] is True
    assert client.post("/v1/lists/confirm", json={"token": token[:-3] + "xyz"}).status_code == 400
    second = client.post(
        "/v1/campaigns", json={"name": "n2", "subject": "Digest 2", "text": "Hi", "lists": [lst["id"]]}, headers=auth
    ).json()["id"]
    client.post(f"/v1/campaigns/{second}/approve", headers=auth)
    inbox.clear()
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    assert sorted(m.rcpt_to[0] for m in inbox.messages) == ["ann@example.test", "carl@example.test"]


async def test_subscriber_attributes_reach_templates(database_url: str, client: httpx.Client, inbox: Inbox) -> None:
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    rows = [{"email": "ann@example.test", "name": "Ann", "lists": [lst], "attributes": {"city": "Lyon", "plan": "pro"}}]
    assert client.post("/v1/subscribers", json={"subscribers": rows}, headers=auth).status_code == 200
    client.post(
        "/v1/subscribers",
        json={"subscribers": [{"email": "ann@example.test", "attributes": {"plan": "team"}}]},
        headers=auth,
    )
    bad = client.post(
        "/v1/subscribers", json={"subscribers": [{"email": "x@example.test", "attributes": ["nope"]}]}, headers=auth
    )
    assert bad.status_code == 422 and "attributes must be an object" in bad.text
    csv_body = b"email,city\nbob@example.test,Paris\n"
    client.post(f"/v1/subscribers/import?list={lst}", content=csv_body, headers={**auth, "Content-Type": "text/csv"})
    cid = client.post(
        "/v1/campaigns",
        json={
            "name": "n",
            "subject": "News for {{ attributes.city }}",
            "text": "Hi {{ name }} ({{ attributes.city }})",
            "lists": [lst],
        },
        headers=auth,
    ).json()["id"]
    client.post(f"/v1/campaigns/{cid}/approve", headers=auth)
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    got = {m.rcpt_to[0]: m.parsed()["Subject"] for m in inbox.messages}
    assert got == {"ann@example.test": "News for Lyon", "bob@example.test": "News for Paris"}
    assert _one(database_url, "SELECT attributes FROM sendonce.subscribers WHERE email = 'ann@example.test'")[0] == {
        "city": "Lyon",
        "plan": "team",
    }


# -- templates ----------------------------------------------------------------------------------------


async def test_templates_css_text_preview_and_missing_variables_at_approve(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    html = (
        "<html><head><style>.hi { color: #c00; font-weight: bold }</style></head><body>"
        "<p class='hi'>Hello {{ name }}</p><p>Your city: {{ attributes.city }}</p></body></html>"
    )
    template = client.post("/v1/templates", json={"name": "t", "subject": "For {{ name }}", "html": html}, headers=auth)
    assert template.status_code == 201, template.text
    tid = template.json()["id"]
    escape = client.post(
        "/v1/templates",
        json={"name": "x", "subject": "s", "text": "{{ ''.__class__.__mro__[1].__subclasses__() }}"},
        headers=auth,
    )
    assert escape.status_code == 422 and "sandbox" in escape.json()["detail"]
    assert (
        client.post(
            "/v1/templates", json={"name": "x", "subject": "s", "text": "{% include '/etc/passwd' %}"}, headers=auth
        ).status_code
        == 422
    )
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    rows = [
        {"email": "ann@example.test", "name": "Ann", "lists": [lst], "attributes": {"city": "Lyon"}},
        {"email": "bob@example.test", "name": "Bob", "lists": [lst]},  # no city
    ]
    client.post("/v1/subscribers", json={"subscribers": rows}, headers=auth)
    shown = client.post(f"/v1/templates/{tid}/preview", json={"email": "ann@example.test"}, headers=auth)
    assert shown.status_code == 200, shown.text
    preview = shown.json()
    assert preview["subject"] == "For Ann"
    assert 'style="color: #c00;font-weight: bold;"' in preview["html"].replace("; ", ";")
    assert "Hello Ann" in preview["text"] and "Your city: Lyon" in preview["text"]
    missing = client.post(f"/v1/templates/{tid}/preview", json={"email": "bob@example.test"}, headers=auth)
    assert missing.status_code == 422 and "city" in missing.json()["detail"]

    cid = client.post("/v1/campaigns", json={"name": "c", "template_id": tid, "lists": [lst]}, headers=auth).json()[
        "id"
    ]
    refused = client.post(f"/v1/campaigns/{cid}/approve", headers=auth)
    assert refused.status_code == 422 and refused.json()["type"].endswith("template-variable-missing")
    assert "bob@example.test" in refused.json()["detail"]
    assert client.get(f"/v1/campaigns/{cid}", headers=auth).json()["status"] == "draft"  # nothing changed
    client.post(
        "/v1/subscribers",
        json={"subscribers": [{"email": "bob@example.test", "attributes": {"city": "Oslo"}}]},
        headers=auth,
    )
    assert client.post(f"/v1/campaigns/{cid}/approve", headers=auth).status_code == 200
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    bob = next(m for m in inbox.messages if m.rcpt_to == ("bob@example.test",)).parsed()
    assert bob["Subject"] == "For Bob"
    assert "Your city: Oslo" in bob.get_body(("plain",)).get_content()
    assert "color: #c00" in bob.get_body(("html",)).get_content()

    guarded = client.post(
        "/v1/campaigns",
        json={
            "name": "g",
            "subject": "s",
            "text": "{% if attributes.vip is defined %}VIP{% endif %} hi",
            "lists": [lst],
        },
        headers=auth,
    ).json()["id"]
    assert client.post(f"/v1/campaigns/{guarded}/approve", headers=auth).status_code == 200


async def test_a_confirmation_that_can_no_longer_confirm_is_sent_again_once(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    # One confirmation mail per membership, however often the subscriber is added, while that mail
    # can still confirm; once it certainly reached nobody, or its link expired, adding the subscriber
    # again sends one new mail (and racing requests still send one).
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    lst = client.post("/v1/lists", json={"name": "Digest", "opt_in": "double"}, headers=auth).json()["id"]
    ann = {"subscribers": [{"email": "ann@example.test", "lists": [lst]}]}

    def add() -> None:
        assert client.post("/v1/subscribers", json=ann, headers=auth).status_code == 200

    def jobs() -> list[tuple[str, str]]:
        with psycopg.connect(database_url) as conn:
            rows = conn.execute(
                "SELECT job_id, status::text FROM sendonce.deliveries "
                "WHERE kind = 'list_confirmation_requested' ORDER BY delivery_id"
            ).fetchall()
        return [(str(job), str(status)) for job, status in rows]

    changes = {  # each to the last confirmation mail queued
        "failed, maybe arrived": "SET status = 'failed', uncertain = true",
        "certainly not arrived": "SET uncertain = false",
        "a week old": "SET created_at = now() - interval '8 days'",
    }

    def set_last(change: str) -> None:
        with psycopg.connect(database_url) as conn:
            conn.execute(
                psycopg.sql.SQL(
                    "UPDATE sendonce.deliveries {} "
                    "WHERE delivery_id = (SELECT max(delivery_id) FROM sendonce.deliveries)"
                ).format(psycopg.sql.SQL(changes[change]))  # type: ignore[arg-type]
            )

    add()
    add()
    (first,) = jobs()
    assert first[1] == "queued"
    set_last("failed, maybe arrived")  # gave up, but an attempt may have arrived
    add()
    assert len(jobs()) == 1
    set_last("certainly not arrived")
    for _ in range(3):
        add()
    assert [job for job, _ in jobs()] == [first[0], first[0] + ":1"]
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    assert jobs()[-1][1] == "sent"
    add()  # sent, its link still valid: nothing new
    assert len(jobs()) == 2
    set_last("a week old")  # past SENDONCE_OPTIN_TTL (7 days): its link expired
    await asyncio.gather(*(asyncio.to_thread(add) for _ in range(6)))
    assert [job for job, _ in jobs()] == [first[0], first[0] + ":1", first[0] + ":2"]
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    last = inbox.messages[-1].parsed()
    token = re.search(r"/v1/lists/confirm\?token=(\S+)", last.get_body(("plain",)).get_content()).group(1)  # type: ignore[union-attr]
    assert client.post("/v1/lists/confirm", json={"token": token}).json()["already_confirmed"] is False
    add()  # confirmed: nothing more, ever
    assert len(jobs()) == 3


async def test_two_requests_that_race_to_renew_a_confirmation_queue_one_mail(database_url: str) -> None:
    # The second request starts while the first, which moved the membership to its next round and
    # queued that round's mail, has not committed: it waits for it (on the subscriber's row, which
    # every upsert writes first), then finds that mail on its way and queues nothing. (Were it to read
    # the dead round anyway, the move is a compare-and-set on the round read, and the job id is the
    # round's: still one mail.)
    from sendonce.domain.addresses import parse_address
    from sendonce.store.subscribers import SubscriberInput, upsert_subscribers

    async with await connect(database_url) as conn:
        account = await (
            await conn.execute(
                "INSERT INTO sendonce.accounts (name, from_email, api_key_hash) "
                "VALUES ('a', 'news@acme.test', 'x') RETURNING account_id"
            )
        ).fetchone()
        assert account is not None
        account_id = int(account["account_id"])
        lst = await (
            await conn.execute(
                "INSERT INTO sendonce.lists (account_id, name, opt_in) VALUES (%s, 'd', 'double') RETURNING list_id",
                (account_id,),
            )
        ).fetchone()
        assert lst is not None
    row = SubscriberInput(parse_address("ann@example.test"), list_ids=[int(lst["list_id"])])

    def url(list_id: int, subscriber_id: int) -> str:
        return f"https://acme.test/confirm/{list_id}/{subscriber_id}"

    async with await connect(database_url) as conn:
        await upsert_subscribers(conn, account_id, [row], confirm_url=url)
        await conn.execute("UPDATE sendonce.deliveries SET status = 'failed', uncertain = false")
    async with await connect(database_url) as first, await connect(database_url) as second:
        async with first.transaction():
            await upsert_subscribers(first, account_id, [row], confirm_url=url)  # round 1, not committed
            racing = asyncio.create_task(upsert_subscribers(second, account_id, [row], confirm_url=url))
            deadline = time.monotonic() + 10
            async with await connect(database_url) as watcher:
                while not await (
                    await watcher.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                        (second.info.backend_pid,),
                    )
                ).fetchone():
                    assert time.monotonic() < deadline and not racing.done()
                    await asyncio.sleep(0.01)
        await racing
    with psycopg.connect(database_url) as conn:
        jobs = [r[0] for r in conn.execute("SELECT job_id FROM sendonce.deliveries ORDER BY delivery_id")]
    assert len(jobs) == 2 and jobs[1] == jobs[0] + ":1"


@pytest.mark.parametrize(
    ("round_", "mail", "renewed"),
    [
        (2, "failed", True),
        (3, "failed", False),  # the last round: an address never confirmed gets no more mail
        (1, "pruned, its round just begun", False),  # the round's age, not the membership's, decides
        (1, "pruned, its round a week old", True),
    ],
)
def test_confirmation_rounds_stop_and_are_dated_by_their_own_start(
    database_url: str, client: httpx.Client, round_: int, mail: str, renewed: bool
) -> None:
    body = client.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {body['api_key']}"}
    lst = client.post("/v1/lists", json={"name": "Digest", "opt_in": "double"}, headers=auth).json()["id"]
    ann = {"subscribers": [{"email": "ann@example.test", "lists": [lst]}]}
    assert client.post("/v1/subscribers", json=ann, headers=auth).status_code == 200
    started = "now() - interval '8 days'" if mail.endswith("a week old") else "now()"
    with psycopg.connect(database_url) as conn:  # as if it had been sent round_ times already
        conn.execute(
            psycopg.sql.SQL(
                "UPDATE sendonce.list_members SET optin_round = %s, round_started_at = {}, "
                "created_at = now() - interval '30 days'"
            ).format(psycopg.sql.SQL(started)),  # type: ignore[arg-type]
            (round_,),
        )
        if mail == "failed":
            conn.execute(
                "UPDATE sendonce.deliveries SET job_id = job_id || ':' || %s, status = 'failed', uncertain = false",
                (round_,),
            )
        else:
            conn.execute("DELETE FROM sendonce.deliveries")
    assert client.post("/v1/subscribers", json=ann, headers=auth).status_code == 200
    with psycopg.connect(database_url) as conn:
        jobs = [r[0] for r in conn.execute("SELECT job_id FROM sendonce.deliveries")]
    assert any(job.endswith(f":{round_ + 1}") for job in jobs) is renewed
