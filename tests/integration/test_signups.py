"""Signup verification: one mail per window, whatever the retries; the transactional outbox."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import psycopg
import psycopg.types.json
import pytest
from prometheus_client.parser import text_string_to_metric_families

import sendonce.errors
import sendonce.outbox
from sendonce.delivery.worker import WorkerConfig
from sendonce.store.database import connect
from sendonce.store.queries import query
from sendonce.testing.inbox import Inbox, InboxFaults
from sendonce.transports.registry import transport_from_url
from tests.conftest import ApiServer
from tests.helpers import campaign_setup, emails, make_account, run_to_drain, running_worker

ADMIN = {"Authorization": "Bearer test-admin-token"}
SECRET = "s3cret-for-tests-0123456789abcdef"
DRAIN = WorkerConfig(tick=0.2, lease=5, drain=True, backoff_base=0.05)


def account(client: httpx.Client) -> tuple[int, dict[str, str]]:
    body = client.post("/v1/accounts", json={"name": "acme", "from_email": "hello@acme.test"}, headers=ADMIN).json()
    return body["id"], {"Authorization": f"Bearer {body['api_key']}"}


@pytest.fixture
def api(database_url: str) -> Iterator[ApiServer]:
    with ApiServer(database_url, secret=SECRET, public_url="https://app.acme.test") as server:
        yield server


@pytest.fixture
def client(api: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=30) as c:
        yield c


def signup(client: httpx.Client, auth: dict[str, str], email: str = "ann@example.test", **extra: Any) -> httpx.Response:
    return client.post("/v1/signups", json={"email": email, "origin": "web", **extra}, headers=auth)


def verify_link(message: Any) -> str:
    text = message.parsed().get_body(("plain",)).get_content()
    match = re.search(r"https://app\.acme\.test/v1/signups/verify\?token=(\S+)", text)
    assert match, text
    return match.group(1)


async def send_all(database_url: str, inbox: Inbox) -> None:
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)


async def test_one_mail_for_repeated_requests_and_the_same_answer(
    client: httpx.Client, database_url: str, inbox: Inbox
) -> None:
    _, auth = account(client)
    first = signup(client, auth, name="Ann")
    assert first.status_code == 201, first.text
    assert first.json() == {"signup_id": first.json()["signup_id"], "status": "pending", "verification": "queued"}
    repeats = [signup(client, auth, email="ANN@Example.test", origin=" WEB ") for _ in range(5)]
    assert {r.status_code for r in repeats} == {200}
    assert all(r.json() == first.json() for r in repeats)
    await send_all(database_url, inbox)
    assert len(inbox.messages) == 1
    message = inbox.messages[0].parsed()
    assert message["Subject"] == "Confirm your email address"
    assert message["From"] == "hello@acme.test"
    assert message["List-Unsubscribe"] is None  # transactional mail is not a mailing list
    assert message["Sendonce-Job-Id"].startswith("signup:")
    # another origin is another operation
    assert signup(client, auth, origin="app").status_code == 201


def test_a_repeat_takes_no_lock_and_writes_nothing_unless_it_changes_the_signup(
    client: httpx.Client, database_url: str
) -> None:
    # A repeat inside an open window only reads: it is answered while another transaction holds the
    # window row (before, each repeat locked it, so repeats of one address queued there one by one,
    # and each wrote a new version of the signup row, flushed to disk at its commit).
    _, auth = account(client)
    first = signup(client, auth, name="Ann", locale="en")
    assert first.status_code == 201
    with psycopg.connect(database_url) as conn:
        version = conn.execute("SELECT xmin::text FROM sendonce.signups").fetchone()
        assert conn.execute("SELECT 1 FROM sendonce.signup_windows FOR UPDATE").fetchall() == [(1,)]
        for extra in ({}, {"name": "Ann"}, {"name": "Ann", "locale": "en"}):
            repeat = client.post(
                "/v1/signups", json={"email": "ann@example.test", "origin": "web", **extra}, headers=auth, timeout=10
            )
            assert (repeat.status_code, repeat.text) == (200, first.text)
        conn.rollback()
        assert conn.execute("SELECT xmin::text FROM sendonce.signups").fetchone() == version
    # a repeat that changes a field takes the locking way, and the change is kept
    assert signup(client, auth, redirect_url="https://app.acme.test/next").status_code == 200
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT name, locale, redirect_url FROM sendonce.signups").fetchall() == [
            ("Ann", "en", "https://app.acme.test/next")
        ]
        # verified: a repeat is answered "not needed", without a write either
        conn.execute("UPDATE sendonce.signups SET status = 'verified'")
        conn.commit()
        version = conn.execute("SELECT xmin::text FROM sendonce.signups").fetchone()
        conn.execute("SELECT 1 FROM sendonce.signup_windows FOR UPDATE")
        repeat = signup(client, auth)
        assert repeat.status_code == 200
        assert repeat.json()["verification"] == "not_needed"
        conn.rollback()
        assert conn.execute("SELECT xmin::text FROM sendonce.signups").fetchone() == version


async def test_concurrent_identical_requests_queue_one_mail(
    client: httpx.Client, api: ApiServer, database_url: str, inbox: Inbox
) -> None:
    _, auth = account(client)
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as c:
        responses = await asyncio.gather(
            *[
                c.post("/v1/signups", json={"email": "bob@example.test", "origin": "app"}, headers=auth)
                for _ in range(30)
            ]
        )
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 29 + [201]
    assert len({r.text for r in responses}) == 1
    await send_all(database_url, inbox)
    assert inbox.by_recipient() == {"bob@example.test": 1}


@pytest.mark.parametrize("elapsed", ["1 second", "59 seconds", "30 minutes", "3599 seconds"])
async def test_a_retry_across_any_clock_boundary_is_still_a_repeat(
    client: httpx.Client, database_url: str, inbox: Inbox, elapsed: str
) -> None:
    """The seed rounded a timestamp into the key: a retry 1 s later across the hour sent twice. Here the
    window runs from the first request (1 h by default), whatever the wall clock says."""
    _, auth = account(client)
    assert signup(client, auth).status_code == 201
    with psycopg.connect(database_url) as conn:
        # the first request was `elapsed` ago: e.g. at 09:59:59, and this retry at 10:00:00
        conn.execute(f"UPDATE sendonce.signup_windows SET opened_at = now() - interval '{elapsed}'")  # noqa: S608
    assert signup(client, auth).status_code == 200
    await send_all(database_url, inbox)
    assert len(inbox.messages) == 1


async def test_a_window_never_outlives_the_link_its_mail_carries(database_url: str, inbox: Inbox) -> None:
    """Inside the window a repeat queues nothing; past the link's life that would leave the person
    with a dead link and no way to get a new one. The window ends with the link (a review found it)."""
    settings = {"public_url": "https://app.acme.test", "signup_window": "2h", "verify_ttl": "1h"}
    with ApiServer(database_url, secret=SECRET, **settings) as api, httpx.Client(base_url=api.url) as c:
        _, auth = account(c)
        assert signup(c, auth).status_code == 201
        assert signup(c, auth).status_code == 200  # a repeat while the link lives
        with psycopg.connect(database_url) as conn:
            # 61 minutes later: inside the 2 h window, past the link's hour
            conn.execute("UPDATE sendonce.signup_windows SET opened_at = now() - interval '61 minutes'")
        assert signup(c, auth).status_code == 201  # the first link is dead: a new one goes out
        await send_all(database_url, inbox)
        assert inbox.by_recipient() == {"ann@example.test": 2}


async def test_the_first_request_after_the_window_sends_a_new_mail(
    client: httpx.Client, database_url: str, inbox: Inbox
) -> None:
    _, auth = account(client)
    assert client.patch("/v1/account", json={"signup_window": "1s"}, headers=auth).json()["signup_window"] == "1s"
    assert signup(client, auth).status_code == 201
    assert signup(client, auth).status_code == 200
    time.sleep(1.1)
    second = signup(client, auth)
    assert second.status_code == 201
    assert signup(client, auth).status_code == 200
    await send_all(database_url, inbox)
    jobs = [m.job_id for m in inbox.messages]
    assert len(jobs) == 2 and len(set(jobs)) == 2
    # both links work until they expire
    for message in inbox.messages:
        assert client.post("/v1/signups/verify", json={"token": verify_link(message)}).status_code == 200


async def test_concurrent_requests_after_the_window_open_one_new_window(
    client: httpx.Client, api: ApiServer, database_url: str, inbox: Inbox
) -> None:
    _, auth = account(client)
    assert signup(client, auth).status_code == 201
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE sendonce.signup_windows SET opened_at = now() - interval '2 hours'")
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as c:
        responses = await asyncio.gather(
            *[
                c.post("/v1/signups", json={"email": "ann@example.test", "origin": "web"}, headers=auth)
                for _ in range(20)
            ]
        )
    assert sorted(r.status_code for r in responses) == [200] * 19 + [201]
    await send_all(database_url, inbox)
    assert len(inbox.messages) == 2


def test_bad_input_is_refused_clearly(client: httpx.Client, database_url: str) -> None:
    _, auth = account(client)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"email": "not-an-address", "origin": "web"}, "not a valid email address"),
        ({"email": "a@example.test", "origin": "fax"}, "origin must be one of web, app, api"),
        ({"email": "a@example.test"}, "origin"),
        ({"email": "a@example.test", "origin": "web", "redirect_url": "javascript:alert(1)"}, "redirect_url"),
        ({"email": "a@example.test", "origin": "web", "locale": "<script>"}, "locale"),
    ]
    for body, expected in cases:
        response = client.post("/v1/signups", json=body, headers=auth)
        assert response.status_code == 422, (body, response.text)
        assert expected in response.json()["detail"], response.text
    assert client.post("/v1/signups", json={"email": "a@example.test", "origin": "web"}).status_code == 401
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.signups").fetchone() == (0,)


async def test_a_suppressed_address_gets_a_clear_422_and_no_mail(
    client: httpx.Client, database_url: str, inbox: Inbox
) -> None:
    _, auth = account(client)
    client.post("/v1/suppressions", json={"email": "gone@example.test", "reason": "bounce"}, headers=auth)
    response = signup(client, auth, email="gone@example.test")
    assert response.status_code == 422
    assert response.json()["type"].endswith("address-suppressed")
    await send_all(database_url, inbox)
    assert inbox.messages == []


def test_an_address_suppressed_inside_its_window_is_refused_on_repeat(client: httpx.Client) -> None:
    # The window is open and its answer stored, but the address bounced since: a repeat is told so,
    # not "queued" (the read-only way to answer a repeat checks the suppressions too).
    _, auth = account(client)
    assert signup(client, auth).status_code == 201
    assert signup(client, auth).status_code == 200
    client.post("/v1/suppressions", json={"email": "ann@example.test", "reason": "bounce"}, headers=auth)
    repeat = signup(client, auth)
    assert repeat.status_code == 422, repeat.text
    assert repeat.json()["type"].endswith("address-suppressed")


def test_another_accounts_registrations_are_invisible(client: httpx.Client) -> None:
    _, alice = account(client)
    _, bob = account(client)
    assert signup(client, alice, email="shared@example.test").status_code == 201
    # Bob's answer is exactly that of a first request: nothing reveals Alice's signup
    second = signup(client, bob, email="shared@example.test")
    assert second.status_code == 201
    assert second.json()["verification"] == "queued"


def test_per_address_rate_limit_answers_429_and_queues_nothing(database_url: str) -> None:
    with (
        ApiServer(database_url, secret=SECRET, signup_rate_per_address="2/h", signup_window="1s") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        _, auth = account(c)
        for _ in range(2):
            assert signup(c, auth, origin="web").status_code in (200, 201)
            time.sleep(1.05)
        limited = signup(c, auth)
        assert limited.status_code == 429
        assert int(limited.headers["Retry-After"]) >= 1
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (2,)
        # another address is not limited by this one
        assert signup(c, auth, email="other@example.test").status_code == 201


def test_an_account_burst_below_eight_still_admits_signups_at_its_rate(database_url: str) -> None:
    """The account's bucket is split by address; with a burst of 5 an eighth of it would never hold a
    whole token, and every address of such a shard would be refused for ever."""
    with (
        ApiServer(database_url, secret=SECRET, signup_rate_per_account="5/s") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        _, auth = account(c)
        started = time.monotonic()
        codes = [signup(c, auth, email=f"burst{i}@example.test").status_code for i in range(40)]
        earned = 5 * (time.monotonic() - started)  # tokens the account earned meanwhile
        assert set(codes) == {201, 429} and 1 <= codes.count(201) <= 5 + earned
        time.sleep(1.2)  # every part of the bucket has earned a token again
        assert signup(c, auth, email="later@example.test").status_code == 201


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "same-idempotency-key"])
@pytest.mark.parametrize("ambiguous", [False, True])
async def test_a_repeat_after_the_windows_mail_failed_queues_it_again(
    client: httpx.Client, database_url: str, ambiguous: bool, keyed: bool
) -> None:
    """A repeat inside the window is told "queued": when the window's mail ended failed and no attempt
    of it may have reached the person, that must be true again, so the repeat queues a new one. If the
    last attempt was ambiguous (the connection dropped after the content), it may have arrived: then
    the window holds, and "one request or twenty, one mail" stays true. The same with the request's
    Idempotency-Key, which every 503 tells the client to retry with: the stored "queued" was replayed
    for 24 hours while no mail went out (a review found it)."""
    _, auth = account(client)
    if keyed:
        auth = {**auth, "Idempotency-Key": "signup-ann-1"}
    assert signup(client, auth).status_code == 201
    faults = InboxFaults(drop_after_data=1.0) if ambiguous else InboxFaults(temp_fail=1.0)
    with Inbox(faults=faults) as broken:
        await run_to_drain(database_url, transport_from_url(broken.url), replace(DRAIN, max_failures=1))
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT status::text, uncertain FROM sendonce.deliveries").fetchall() == [
            ("failed", ambiguous)
        ]
    repeat = signup(client, auth)
    # keyed, the ambiguous case replays the first answer (201); without a key a repeat is a 200
    assert repeat.status_code == (201 if keyed or not ambiguous else 200), repeat.text
    assert repeat.json()["verification"] == "queued"
    assert repeat.headers.get("Idempotent-Replayed") == ("true" if keyed and ambiguous else None)
    with Inbox() as inbox:
        await send_all(database_url, inbox)
        assert len(inbox.messages) == (0 if ambiguous else 1)
    # and the new window, its mail sent, absorbs repeats again (keyed: the new answer is replayed)
    again = signup(client, auth)
    assert again.status_code == (201 if keyed else 200)
    assert again.json() == repeat.json()
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (1 if ambiguous else 2,)


async def test_pruning_keeps_the_failed_mail_of_the_current_window(database_url: str) -> None:
    # `outbox prune --older-than` shorter than the signup window: the certainly failed mail of the
    # current window must stay, or the next repeat reads the window as healthy and is told "queued".
    # The API's window here (a day) is not the prune's business: it used to judge "still open" with
    # its own setting (one hour by default) and took the row while the API still read the window open.
    from sendonce.store import outbox

    with (
        ApiServer(database_url, secret=SECRET, public_url="https://app.acme.test", signup_window="24h") as api,
        httpx.Client(base_url=api.url) as client,
    ):
        _, auth = account(client)
        assert signup(client, auth).status_code == 201
        with Inbox(faults=InboxFaults(reject=lambda _: "451 4.7.1 try again later")) as broken:
            await run_to_drain(database_url, transport_from_url(broken.url), replace(DRAIN, max_failures=1))
        with psycopg.connect(database_url) as conn:
            conn.execute("UPDATE sendonce.deliveries SET updated_at = now() - interval '2 hours'")
            conn.execute("UPDATE sendonce.signup_windows SET opened_at = now() - interval '2 hours'")
        async with await connect(database_url) as conn:
            assert await outbox.prune(conn, timedelta(hours=1)) == []
            assert signup(client, auth).status_code == 201  # the dead mail was read: queued again
            # the failed mail now belongs to a window that was replaced: it may go
            pruned = await outbox.prune(conn, timedelta(hours=1))
            assert [(row["status"], row["job_id"].endswith(":1")) for row in pruned] == [("failed", True)]


async def test_verify_once_twice_forged_and_expired(database_url: str, inbox: Inbox) -> None:
    with (
        ApiServer(database_url, secret=SECRET, public_url="https://app.acme.test", verify_ttl="2s") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        _, auth = account(c)
        list_id = c.post("/v1/lists", json={"name": "members"}, headers=auth).json()["id"]
        c.patch("/v1/account", json={"signup_list_id": list_id}, headers=auth)
        signup_id = signup(c, auth, name="Ann", redirect_url="https://app.acme.test/welcome").json()["signup_id"]
        await send_all(database_url, inbox)
        token = verify_link(inbox.messages[0])
        page = c.get("/v1/signups/verify", params={"token": token})
        assert page.status_code == 200 and "<form" in page.text  # a click, not a fetch, verifies
        (action,) = re.findall(r'action="([^"]*)"', page.text)  # relative: works behind a path prefix
        assert urljoin("https://example.com/mail/v1/signups/verify?token=x", action).endswith("/mail/v1/signups/verify")
        first = c.post("/v1/signups/verify", json={"token": token})
        assert first.json() == {"signup_id": signup_id, "status": "verified", "already_verified": False}
        again = c.post("/v1/signups/verify", json={"token": token})
        assert again.status_code == 200 and again.json()["already_verified"] is True
        human = c.post("/v1/signups/verify", data={"token": token})
        assert human.status_code == 303 and human.headers["location"] == "https://app.acme.test/welcome"
        forged = token[:-3] + ("AAA" if not token.endswith("AAA") else "BBB")
        assert c.post("/v1/signups/verify", json={"token": forged}).status_code == 400
        assert c.post("/v1/signups/verify", json={"token": "garbage"}).status_code == 400
        assert c.get("/v1/signups/verify", params={"token": forged}).status_code == 400
        # the page's button, with a forged token or a form that cannot be read: a page, not JSON
        pressed = c.post("/v1/signups/verify", data={"token": forged})
        assert pressed.status_code == 400 and pressed.headers["content-type"].startswith("text/html")
        assert "this verification link is not valid" in pressed.text
        crowded = c.post(
            "/v1/signups/verify",
            content="&".join(f"f{n}=x" for n in range(1100)),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert crowded.status_code == 400 and crowded.headers["content-type"].startswith("text/html"), crowded.text
        # the verified person is a confirmed member of the account's signup list
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "SELECT s.status, m.status FROM sendonce.subscribers s "
                "JOIN sendonce.list_members m USING (account_id, subscriber_id)"
            ).fetchone()
        assert row == ("confirmed", "confirmed")
        # a signup after verification queues nothing
        assert signup(c, auth).json() == {"signup_id": signup_id, "status": "verified", "verification": "not_needed"}
        # expiry
        other = signup(c, auth, email="late@example.test").json()["signup_id"]
        await send_all(database_url, inbox)
        late_token = verify_link(next(m for m in inbox.messages if "late@" in m.rcpt_to[0]))
        time.sleep(3.2)
        expired = c.post("/v1/signups/verify", json={"token": late_token})
        assert expired.status_code == 400 and expired.json()["type"].endswith("token-expired")
        # verifying twice answers 200 again, however old the link: it was "expired, ask again" (and
        # asking again answered not_needed)
        old = c.post("/v1/signups/verify", json={"token": token})
        assert old.json() == {"signup_id": signup_id, "status": "verified", "already_verified": True}, old.text
        assert c.post("/v1/signups/verify", data={"token": token}).status_code == 303
        page = c.get("/v1/signups/verify", params={"token": token})  # the link, opened again
        assert page.status_code == 200 and "already confirmed" in page.text and "<form" not in page.text
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT status FROM sendonce.signups WHERE signup_id = %s", (other,)).fetchone() == (
                "pending",
            )


async def test_verifying_after_an_unsubscribe_rejoins_only_when_the_mail_was_asked_for_after_it(
    client: httpx.Client, database_url: str, inbox: Inbox
) -> None:
    # Someone who unsubscribed, then signed up again and confirmed from their mailbox, has chosen to come
    # back: they used to be told "verified" and stay unsubscribed (and a later signup answered
    # not_needed, so nothing could bring them back). An unsubscribe after the request (an old link
    # clicked later) still wins, and so does a bounce.
    aid, auth = account(client)
    list_id = client.post("/v1/lists", json={"name": "members"}, headers=auth).json()["id"]
    client.patch("/v1/account", json={"signup_list_id": list_id}, headers=auth)

    def make(email: str, status: str) -> None:
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "INSERT INTO sendonce.subscribers (account_id, email, email_key, status) VALUES (%s, %s, %s, %s) "
                "RETURNING subscriber_id",
                (aid, email, email, status),
            ).fetchone()
            assert row is not None
            membership = "confirmed" if status == "bounced" else status  # a bounce is the mailbox's
            conn.execute(
                "INSERT INTO sendonce.list_members (account_id, list_id, subscriber_id, status) "
                "VALUES (%s, %s, %s, %s)",
                (aid, list_id, row[0], membership),
            )

    def statuses(email: str) -> tuple[str, str] | None:
        with psycopg.connect(database_url) as conn:
            return conn.execute(  # type: ignore[return-value]
                "SELECT s.status::text, m.status::text FROM sendonce.subscribers s "
                "JOIN sendonce.list_members m USING (account_id, subscriber_id) WHERE s.email_key = %s",
                (email,),
            ).fetchone()

    make("back@example.test", "unsubscribed")  # left, then asks again
    make("bounced@example.test", "bounced")
    assert signup(client, auth, email="back@example.test").status_code == 201
    assert signup(client, auth, email="bounced@example.test").status_code == 201
    assert signup(client, auth, email="changed@example.test").status_code == 201
    make("changed@example.test", "unsubscribed")  # asked, then left (an import of their opt-out, say)
    await send_all(database_url, inbox)
    for message in inbox.messages:
        assert client.post("/v1/signups/verify", json={"token": verify_link(message)}).status_code == 200
    assert statuses("back@example.test") == ("confirmed", "confirmed")
    assert statuses("bounced@example.test") == ("bounced", "confirmed")  # still no campaign: it bounced
    assert statuses("changed@example.test") == ("unsubscribed", "unsubscribed")

    # An address suppressed meanwhile (a complaint) is not confirmed again: lifting the suppression later
    # must not bring back what the complaint ended.
    make("complained@example.test", "unsubscribed")
    assert signup(client, auth, email="complained@example.test").status_code == 201
    await send_all(database_url, inbox)
    link = verify_link(next(m for m in inbox.messages if "complained@" in m.rcpt_to[0]))
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO sendonce.suppressions (account_id, email_key, email, reason) VALUES (%s, %s, %s, 'complaint')",
            (aid, "complained@example.test", "complained@example.test"),
        )
    assert client.post("/v1/signups/verify", json={"token": link}).status_code == 200
    assert statuses("complained@example.test") == ("unsubscribed", "unsubscribed")

    # The link of an earlier mail is judged by when that mail was asked for, not by a later request's
    # time (the window's row is rewritten at each new mail): asked, left, asked again, old link clicked.
    client.patch("/v1/account", json={"signup_window": "1s"}, headers=auth)
    assert signup(client, auth, email="old@example.test").status_code == 201
    await send_all(database_url, inbox)
    first_link = verify_link(next(m for m in inbox.messages if "old@" in m.rcpt_to[0]))
    make("old@example.test", "unsubscribed")
    time.sleep(1.2)  # the window runs out: the next request is a new mail
    assert signup(client, auth, email="old@example.test").status_code == 201
    assert client.post("/v1/signups/verify", json={"token": first_link}).status_code == 200
    assert statuses("old@example.test") == ("unsubscribed", "unsubscribed")


async def test_rotating_the_secret_neither_reopens_nor_breaks_windows(database_url: str, inbox: Inbox) -> None:
    new_secret = "rotated-secret-abcdefghijklmnop"
    with (
        ApiServer(database_url, secret=SECRET, public_url="https://app.acme.test") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        _, auth = account(c)
        assert signup(c, auth).status_code == 201
        assert signup(c, auth, email="bob@example.test").status_code == 201
    await send_all(database_url, inbox)
    old_token = verify_link(next(m for m in inbox.messages if m.rcpt_to == ("ann@example.test",)))
    with (
        ApiServer(database_url, secret=new_secret, secret_previous=SECRET, public_url="https://app.acme.test") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        assert signup(c, auth).status_code == 200  # the window opened under the old secret is still open
        assert signup(c, auth, email="new@example.test").status_code == 201
        assert c.post("/v1/signups/verify", json={"token": old_token}).status_code == 200  # old links still work
    with (
        ApiServer(database_url, secret=new_secret, public_url="https://app.acme.test") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        # once the previous secret is dropped, its links are refused; its windows are still the
        # windows (a repeat inside one got a 201, and a second mail, while windows were found by key)
        assert c.post("/v1/signups/verify", json={"token": old_token}).status_code == 400
        assert signup(c, auth, email="bob@example.test").status_code == 200
    with (
        ApiServer(database_url, secret="a-third-secret-abcdefghijklmnop", public_url="https://app.acme.test") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        # and a process with yet another secret (a host that made its own) finds them too
        assert signup(c, auth, email="bob@example.test").status_code == 200
        assert signup(c, auth, email="new@example.test").status_code == 200
    await send_all(database_url, inbox)
    assert sorted(r for m in inbox.messages for r in m.rcpt_to) == [
        "ann@example.test",
        "bob@example.test",
        "new@example.test",
    ]


async def test_a_window_replaced_under_another_secret_stays_over_after_a_prune(database_url: str, inbox: Inbox) -> None:
    # Secret A opens a window whose mail certainly fails; secret B (a rotation, another host) opens the
    # next one, whose mail fails too; a prune takes the first window's dead mail (it is no longer the
    # current window's). Back on A (a rollback), the first window must not read as open: it was told
    # "queued" for nothing until it ran out.
    from sendonce.store import outbox

    dead = Inbox(faults=InboxFaults(reject=lambda _: "451 4.2.0 mailbox busy, try later"))  # until it gives up
    other = "b-secret-abcdefghijklmnopqrstuv"
    with dead:
        for secret in (SECRET, other):
            with (
                ApiServer(database_url, secret=secret, public_url="https://app.acme.test") as api,
                httpx.Client(base_url=api.url) as c,
            ):
                if secret == SECRET:
                    _, auth = account(c)
                assert signup(c, auth, email="bob@example.test").status_code == 201
            await run_to_drain(database_url, transport_from_url(dead.url), replace(DRAIN, max_failures=1))
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE sendonce.deliveries SET updated_at = now() - interval '8 days'")
    async with await connect(database_url) as conn:
        pruned = await outbox.prune(conn, timedelta(days=7))
    assert [row["job_id"].split(":")[2] for row in pruned] == ["1"]  # the first window's mail
    with (
        ApiServer(database_url, secret=SECRET, public_url="https://app.acme.test") as api,
        httpx.Client(base_url=api.url) as c,
    ):
        assert signup(c, auth, email="bob@example.test").status_code == 201  # a new mail, queued
    await send_all(database_url, inbox)
    assert [m.rcpt_to for m in inbox.messages] == [("bob@example.test",)]


async def test_a_window_opens_at_the_clock_time_not_at_its_transaction_start(database_url: str) -> None:
    # Windows of one signup open one after another under its row lock; the latest is the last opened.
    # Stamped with now() (the transaction's start), a request that began first but waited on the lock
    # would open a window that looks older than the one it follows.
    async with await connect(database_url) as conn:
        account_id, _ = await make_account(conn)
        signup_row = await (
            await conn.execute(
                "INSERT INTO sendonce.signups (account_id, email, email_key, origin) "
                "VALUES (%s, 'a@b.test', 'a@b.test', 'web') RETURNING signup_id",
                (account_id,),
            )
        ).fetchone()
        assert signup_row is not None
        async with conn.transaction():
            await asyncio.sleep(0.2)  # as if waiting for the signup's lock
            params = {"account_id": account_id, "operation_key": "k", "signup_id": signup_row["signup_id"]}
            await conn.execute(query("open_window"), {**params, "answer": None, "window": timedelta(hours=1)})
            row = await (
                await conn.execute(
                    "SELECT opened_at > now() + interval '0.1 seconds' AS late FROM sendonce.signup_windows"
                )
            ).fetchone()
    assert row == {"late": True}


async def test_client_idempotency_keys(client: httpx.Client, database_url: str) -> None:
    aid, auth = account(client)
    key = {"Idempotency-Key": "signup-ann-1"}
    first = client.post("/v1/signups", json={"email": "ann@example.test", "origin": "web"}, headers={**auth, **key})
    assert first.status_code == 201
    replay = client.post("/v1/signups", json={"origin": "web", "email": "ann@example.test"}, headers={**auth, **key})
    assert replay.status_code == 201 and replay.json() == first.json()
    assert replay.headers["Idempotent-Replayed"] == "true"
    different = client.post("/v1/signups", json={"email": "bob@example.test", "origin": "web"}, headers={**auth, **key})
    assert different.status_code == 422 and different.json()["type"].endswith("idempotency-key-reused")
    # other routes too; the key is scoped to the account
    lst = client.post("/v1/lists", json={"name": "a"}, headers={**auth, "Idempotency-Key": "k2"})
    assert client.post("/v1/lists", json={"name": "a"}, headers={**auth, "Idempotency-Key": "k2"}).json() == lst.json()
    _, other = account(client)
    assert client.post("/v1/lists", json={"name": "a"}, headers={**other, "Idempotency-Key": "k2"}).json() != lst.json()
    # two keys on one request: which one was meant cannot be told (the first was taken, silently)
    two = client.post(
        "/v1/lists", json={"name": "two"}, headers=[*auth.items(), ("Idempotency-Key", "k2"), ("Idempotency-Key", "k9")]
    )
    assert two.status_code == 422 and "one Idempotency-Key" in two.json()["detail"]
    # a failed request stores nothing: the same key works once the request is fixed
    bad = client.post("/v1/lists", json={"name": ""}, headers={**auth, "Idempotency-Key": "k3"})
    assert bad.status_code == 422
    assert client.post("/v1/lists", json={"name": "ok"}, headers={**auth, "Idempotency-Key": "k3"}).status_code == 201
    # in flight: another transaction holds the key
    async with await connect(database_url, autocommit=False) as holder:
        await holder.execute(
            """INSERT INTO sendonce.idempotency_keys (account_id, idempotency_key, request_hash, method, path,
                                                      response_status, response_body, expires_at)
               VALUES (%s, 'busy', 'x', 'POST', '/v1/lists', 0, '', now() + interval '1 day')""",
            (aid,),
        )
        busy = await asyncio.to_thread(
            client.post, "/v1/lists", json={"name": "b"}, headers={**auth, "Idempotency-Key": "busy"}
        )
        assert busy.status_code == 409 and busy.json()["type"].endswith("in-flight")
        await holder.rollback()
    assert client.post("/v1/lists", json={"name": "b"}, headers={**auth, "Idempotency-Key": "busy"}).status_code == 201
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.lists").fetchone() == (4,)  # a, a (other), ok, b
        assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (1,)


async def test_an_expired_idempotency_key_starts_over(client: httpx.Client, database_url: str) -> None:
    # The key was used for another request more than a day ago: its answer expired, and the key
    # serves the new request (one statement reserves it, so a prune of the old row meanwhile is moot).
    aid, auth = account(client)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            """INSERT INTO sendonce.idempotency_keys (account_id, idempotency_key, request_hash, method, path,
                                                      response_status, response_body, expires_at)
               VALUES (%s, 'old', 'another request', 'POST', '/v1/lists', 201, '{}', now() - interval '2 hours')""",
            (aid,),
        )
    first = client.post("/v1/lists", json={"name": "n"}, headers={**auth, "Idempotency-Key": "old"})
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    replay = client.post("/v1/lists", json={"name": "n"}, headers={**auth, "Idempotency-Key": "old"})
    assert replay.json() == first.json() and replay.headers["Idempotent-Replayed"] == "true"


def test_a_sealed_answer_under_a_retired_secret_is_a_clear_409(database_url: str) -> None:
    # POST /v1/accounts stores its answer (it holds the API key) sealed under the server secret. Once
    # that secret is neither the current nor the previous one, the replay cannot be read: a 409 that
    # says so, not a 500 on every retry.
    body = {"name": "acme", "from_email": "hello@acme.test"}
    headers = {**ADMIN, "Idempotency-Key": "create-acme"}
    with ApiServer(database_url, secret=SECRET) as api, httpx.Client(base_url=api.url) as c:
        created = c.post("/v1/accounts", json=body, headers=headers)
        assert created.status_code == 201
    with (
        ApiServer(database_url, secret="rotated-secret-abcdefghijklmnop", secret_previous=SECRET) as api,
        httpx.Client(base_url=api.url) as c,
    ):
        assert c.post("/v1/accounts", json=body, headers=headers).json() == created.json()
    with ApiServer(database_url, secret="rotated-secret-abcdefghijklmnop") as api, httpx.Client(base_url=api.url) as c:
        lost = c.post("/v1/accounts", json=body, headers=headers)
    assert lost.status_code == 409, lost.text
    assert lost.headers["content-type"].startswith("application/problem+json")
    assert lost.json()["type"].endswith("idempotency-answer-unreadable")
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.accounts").fetchone() == (1,)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"X-Order Id": "1"}, "not a header name"),
        ({"X-Order:Id": "1"}, "not a header name"),
        ({"X-Ördér": "1"}, "not a header name"),
        ({"X-Note\r\nBcc": "x@evil.test"}, "not a header name"),
        ({"From ": "boss@example.test"}, "not a header name"),
        ({"from": "boss@example.test"}, "written by sendonce"),
        ({"Sendonce-Job-Id": "message:1:other"}, "written by sendonce"),
        ({"Content-Transfer-Encoding": "base64"}, "written by sendonce"),
        # a relay's metadata, echoed by its webhooks: another account's job id would send a bounce there
        ({"X-PM-Metadata-sendonce-job-id": "campaign:1:1"}, "written by sendonce"),
        ({"X-SMTPAPI": '{"unique_args": {"sendonce_job_id": "campaign:1:1"}}'}, "written by sendonce"),
        ({"X-Note": "one\r\nBcc: x@evil.test"}, "on one line"),
        ({"X-Count": 3}, "on one line"),
        # a name so long its header cannot start on its line: the value would be folded after the colon
        ({"X-" + "n" * 80: "1"}, "at most 76 characters"),
    ],
)
async def test_enqueue_refuses_headers_that_would_be_dropped_or_break_the_message(
    database_url: str, headers: dict[str, str], message: str
) -> None:
    """Refused when enqueued, with the reason, rather than dropped or mangled at send time; nothing is
    written."""
    async with await connect(database_url) as conn:
        from tests.helpers import make_account

        aid, _ = await make_account(conn)
    with psycopg.connect(database_url) as conn:
        with pytest.raises(sendonce.errors.InvalidInput, match=message):
            sendonce.outbox.enqueue(
                conn, account_id=aid, to="a@example.test", subject="s", text="t", key="k", headers=headers
            )
        sendonce.outbox.enqueue(
            conn, account_id=aid, to="a@example.test", subject="s", text="t", key="k", headers={"X-Order-Id": "1"}
        )
        assert conn.execute("SELECT payload->'headers' FROM sendonce.deliveries").fetchall() == [({"X-Order-Id": "1"},)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("subject", "a\x00b"),
        ("text", "broken \ud800 text"),
        ("html", "<p>\x00</p>"),
        ("key", "k\udfff"),
        ("key", 5),
        ("headers", {"X-Note": "a\x00b"}),
    ],
    ids=["nul-subject", "surrogate-text", "nul-html", "surrogate-key", "int-key", "nul-header"],
)
async def test_enqueue_refuses_what_postgresql_cannot_store_and_leaves_the_callers_transaction_usable(
    database_url: str, field: str, value: object
) -> None:
    # PostgreSQL refused a NUL or a lone surrogate itself, which failed the application's whole
    # transaction (InFailedSqlTransaction), and a non-text key was a TypeError: InvalidInput, nothing
    # written, as documented
    async with await connect(database_url) as conn:
        from tests.helpers import make_account

        aid, _ = await make_account(conn)
    fields: dict[str, Any] = {"to": "a@example.test", "subject": "s", "text": "t", "key": "k", field: value}
    with psycopg.connect(database_url) as conn:
        with pytest.raises(sendonce.errors.InvalidInput):
            sendonce.outbox.enqueue(conn, account_id=aid, **fields)
        sendonce.outbox.enqueue(conn, account_id=aid, to="a@example.test", subject="s", text="t", key="ok")
        conn.commit()
        assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (1,)


async def test_a_row_written_before_the_header_check_fails_clearly_instead_of_injecting(
    database_url: str, inbox: Inbox
) -> None:
    """Rows enqueued before enqueue checked header names still go out through the composer: a name
    that would break the header block fails the row (permanent, with the reason); nothing is sent."""
    async with await connect(database_url) as conn:
        from tests.helpers import make_account

        aid, _ = await make_account(conn)
    ids: dict[str, int | None] = {}
    with psycopg.connect(database_url) as conn:
        for key, headers in [
            ("bad", {"X-Note\r\nBcc": "x@evil.test"}),
            ("good", {"X-Note": "ok", "From": "boss@x.test"}),
        ]:
            done = sendonce.outbox.enqueue(
                conn, account_id=aid, to=f"{key}@example.test", subject="s", text="t", key=key
            )
            ids[key] = done.delivery_id
            conn.execute(
                "UPDATE sendonce.deliveries SET payload = jsonb_set(payload, '{headers}', %s) WHERE delivery_id = %s",
                (psycopg.types.json.Jsonb(headers), done.delivery_id),
            )
    await send_all(database_url, inbox)
    assert inbox.by_recipient() == {"good@example.test": 1}
    sent = inbox.messages[0].parsed()
    assert sent["X-Note"] == "ok" and sent["From"] == "Acme News <news@sender.test>"  # a reserved name is dropped
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT status::text, last_error FROM sendonce.deliveries WHERE delivery_id = %s", (ids["bad"],)
        ).fetchone()
    assert row is not None and row[0] == "failed" and "not a header name" in row[1]


async def test_enqueue_in_the_callers_transaction(database_url: str, inbox: Inbox) -> None:
    async with await connect(database_url) as conn:
        from tests.helpers import make_account

        aid, _ = await make_account(conn)
    with psycopg.connect(database_url) as conn:
        try:
            with conn.transaction():
                sendonce.outbox.enqueue(conn, account_id=aid, to="rolled@example.test", subject="s", text="t", key="k1")
                raise RuntimeError("the caller's transaction fails after enqueueing")
        except RuntimeError:
            pass
        with conn.transaction():
            done = sendonce.outbox.enqueue(
                conn, account_id=aid, to="kept@example.test", subject="Order", text="ok", key="order-1"
            )
            again = sendonce.outbox.enqueue(
                conn, account_id=aid, to="kept@example.test", subject="Order", text="ok", key="order-1"
            )
    assert done.created and not again.created and done.job_id == again.job_id
    async with await connect(database_url, autocommit=False) as aconn:
        async with aconn.transaction():
            result = await sendonce.outbox.enqueue_async(
                aconn,
                account_id=aid,
                to="async@example.test",
                subject="Hi",
                text="there",
                html="<b>there</b>",
                key="a-1",
            )
        assert result.created
    await send_all(database_url, inbox)
    assert inbox.by_recipient() == {"kept@example.test": 1, "async@example.test": 1}
    html = next(m for m in inbox.messages if m.rcpt_to == ("async@example.test",)).parsed().get_body(("html",))
    assert html is not None and "<b>there</b>" in html.get_content()


async def test_a_signup_during_a_large_campaign_jumps_the_queue(client: httpx.Client, database_url: str) -> None:
    setup = await campaign_setup(database_url, emails(3000))
    del setup
    _, auth = account(client)
    with Inbox() as inbox:
        config = WorkerConfig(concurrency=2, batch_size=20, tick=0.2, lease=5)
        async with running_worker(database_url, transport_from_url(inbox.url), config):
            await asyncio.to_thread(inbox.wait_for, 200, 60)
            before = len(inbox.messages)
            assert signup(client, auth, email="urgent@example.test").status_code == 201
            deadline = time.monotonic() + 30
            while not any(m.rcpt_to == ("urgent@example.test",) for m in inbox.messages):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            position = next(i for i, m in enumerate(inbox.messages) if m.rcpt_to == ("urgent@example.test",))
        # only what the worker already held locally went before it, not the thousands still queued
        assert position - before <= config.batch_size * 3
        assert len(inbox.messages) < 3000


def test_metrics_count_absorbed_repeats(client: httpx.Client) -> None:
    aid, auth = account(client)
    signup(client, auth)
    for _ in range(3):
        signup(client, auth)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    repeats = {
        (s.labels["account"], s.labels["mechanism"]): s.value
        for s in families["sendonce_absorbed_repeats"].samples
        if s.name.endswith("_total")
    }
    assert repeats[(str(aid), "window")] == 3
    by_client = [s for s in families["sendonce_absorbed_repeats_by_client"].samples if s.name.endswith("_total")]
    assert by_client[0].labels["client"] == "127.0.0.1" and by_client[0].value == 3


def test_outbox_listing_is_paged_and_audited(client: httpx.Client) -> None:
    _, auth = account(client)
    for i in range(5):
        signup(client, auth, email=f"p{i}@example.test")
    page = client.get("/v1/outbox", params={"event": "signup_verification_requested", "limit": 2}, headers=auth).json()
    assert len(page["items"]) == 2 and page["next_cursor"]
    seen = [item["email"] for item in page["items"]]
    while page["next_cursor"]:
        page = client.get("/v1/outbox", params={"limit": 2, "cursor": page["next_cursor"]}, headers=auth).json()
        seen += [item["email"] for item in page["items"]]
    assert seen == [f"p{i}@example.test" for i in reversed(range(5))]
    assert client.get("/v1/outbox", params={"cursor": "nonsense"}, headers=auth).status_code == 422
    assert client.get("/v1/outbox", params={"event": "fax"}, headers=auth).status_code == 422


@pytest.fixture
def primary_and_standby(tmp_path: Path) -> Iterator[tuple[str, Callable[[], str]]]:
    """A primary of its own (embedded binaries, whatever the suite's server is), and a function that
    makes a streaming standby of it, as it is then, and returns its URL."""
    import shutil

    from sendonce.store.embedded import EmbeddedPostgres
    from sendonce.store.migrations import upgrade

    primary = EmbeddedPostgres(tmp_path / "primary" / "pgdata")
    primary.start()
    standby = tmp_path / "standby"

    def make_standby() -> str:
        standby.mkdir(mode=0o700)
        if primary.owner:  # started by root: the server's own user owns its files
            shutil.chown(standby, primary.owner)
        # from the socket the embedded server listens on, in its folder; a fast checkpoint (the
        # default, spread, waits for most of a checkpoint interval)
        primary.run_binary("pg_basebackup", "-D", str(standby), "-R", "-X", "stream", "-c", "fast",
                           "-h", str(primary.data_dir), "-U", "postgres")  # fmt: skip
        for lock in standby.glob(".s.PGSQL.*"):  # the primary's socket lock, copied with its folder
            lock.unlink()
        options = f"-k {standby} -c listen_addresses=''"
        primary.run_binary("pg_ctl", "-D", str(standby), "-w", "-o", options, "-l", str(standby / "log"), "start")
        return f"postgresql://postgres:@/sendonce?host={standby}"

    try:
        upgrade(primary.ensure_database())
        yield primary.url(), make_standby
    finally:
        if (standby / "postmaster.pid").exists():
            primary.run_binary("pg_ctl", "-D", str(standby), "-w", "-m", "immediate", "stop")
        primary.stop()


def test_a_standby_does_not_answer_repeats_it_may_be_behind_on(
    primary_and_standby: tuple[str, Callable[[], str]],
) -> None:
    """During a failover the API may reach a standby. It could be behind the primary on a signup's
    mail that certainly failed, which a repeat must re-queue rather than answer "queued" for: a repeat
    is not answered from a standby (503, retry), and the primary still answers it."""
    primary_url, make_standby = primary_and_standby
    with (
        ApiServer(primary_url, secret=SECRET, public_url="https://app.acme.test") as api,
        httpx.Client(base_url=api.url, timeout=30) as client,
    ):
        _, auth = account(client)
        assert signup(client, auth).status_code == 201
        standby_url = make_standby()
        with psycopg.connect(standby_url) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
            # the standby has the signup and its open window: a lookup there could answer the repeat
            assert conn.execute("SELECT count(*) FROM sendonce.signup_windows").fetchone() == (1,)
        with (
            ApiServer(standby_url, secret=SECRET, public_url="https://app.acme.test") as on_standby,
            httpx.Client(base_url=on_standby.url, timeout=30) as replica_client,
        ):
            repeat = signup(replica_client, auth)
        assert repeat.status_code == 503, repeat.text
        assert repeat.headers["content-type"].startswith("application/problem+json")
        assert signup(client, auth).status_code == 200
