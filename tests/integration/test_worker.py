"""The worker against a real SMTP inbox and a real Resend-compatible server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections import Counter
from typing import Any

import httpx
import psycopg
import psycopg.sql
import pytest
from prometheus_client import CollectorRegistry
from psycopg.rows import dict_row

from sendonce.chaos.harness import within_victims_lease
from sendonce.chaos.processes import death_note
from sendonce.chaos.sinks import SmtpSink
from sendonce.delivery import worker as worker_module
from sendonce.delivery.metrics import WorkerCollector
from sendonce.delivery.worker import Held, Worker, WorkerConfig, _Lane, _Result
from sendonce.domain.addresses import parse_address
from sendonce.domain.states import SuppressionReason
from sendonce.faults import DEATH_NOTE
from sendonce.outbox import enqueue_async
from sendonce.store import alerts, campaigns, outbox, suppressions, unsubscribes
from sendonce.store.database import Conn, connect, create_pool
from sendonce.store.feedback import FeedbackPolicy
from sendonce.store.rate_limits import Rate
from sendonce.testing.inbox import Inbox, InboxFaults
from sendonce.testing.resend_server import ResendFaults, ResendServer
from sendonce.testing.tcp_proxy import TcpProxy
from sendonce.transports.base import Accepted, Permanent, Retry
from sendonce.transports.registry import transport_from_url
from tests.helpers import (
    campaign_setup,
    campaign_status,
    composer,
    emails,
    make_account,
    proxy_target,
    run_to_drain,
    running_worker,
    through_proxy,
)

FAST = {"tick": 0.2, "lease": 5.0, "backoff_base": 0.05, "backoff_cap": 0.2}


async def _wait_status(url: str, account_id: int, campaign_id: int, status: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current, _ = await campaign_status(url, account_id, campaign_id)
        if current == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"campaign did not reach {status!r} (is {current!r})")


async def _prebuild(url: str) -> None:
    async with await connect(url) as conn:
        await outbox.start_due_campaigns(conn)
        while isinstance(await outbox.build_next_chunk(conn, 5000), outbox.BuildProgress):
            pass


async def test_two_workers_share_a_campaign_and_every_address_gets_it_once(database_url: str, inbox: Inbox) -> None:
    addresses = emails(400)
    setup = await campaign_setup(database_url, addresses, html="<p>Hi {{ email }}</p>")
    config = WorkerConfig(concurrency=4, batch_size=10, drain=True, **FAST)
    stats = await asyncio.gather(
        run_to_drain(database_url, transport_from_url(inbox.url), config),
        run_to_drain(database_url, transport_from_url(inbox.url), config),
    )
    assert inbox.by_recipient() == dict.fromkeys(addresses, 1)
    assert sum(s.sent for s in stats) == 400
    assert all(s.sent > 0 for s in stats)
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert status == "sent"
    assert (counts.total, counts.sent, counts.possible_duplicate) == (400, 400, 0)
    # a lane with its next row in hand sends that row's envelope with the current content (RFC 2920)
    assert inbox.envelopes_behind_content > 100
    message = inbox.messages[0].parsed()
    assert message["Sendonce-Job-Id"].startswith(f"campaign:{setup.campaign_id}:")
    assert message["Message-ID"] == f"<{message['Sendonce-Job-Id'].replace(':', '.')}@sender.test>"
    assert message["From"] == "Acme News <news@sender.test>"
    assert message.get_body(("html",)) is not None


async def test_transient_failures_are_retried_and_permanent_ones_bounce(database_url: str) -> None:
    attempts: Counter[str] = Counter()

    def reject(address: str) -> str | None:
        attempts[address] += 1
        if address == "user000001@example.test" and attempts[address] <= 2:
            return "451 4.7.1 greylisted, try again"
        if address == "user000002@example.test":
            return "550 5.1.1 no such user"
        if address == "user000003@example.test":
            return "452 4.2.2 mailbox full"
        return None

    setup = await campaign_setup(database_url, emails(5))
    with Inbox(faults=InboxFaults(reject=reject)) as inbox:
        config = WorkerConfig(concurrency=2, drain=True, max_failures=3, **FAST)
        await run_to_drain(database_url, transport_from_url(inbox.url), config)
        received = inbox.by_recipient()
    assert received == {
        "user000000@example.test": 1,
        "user000001@example.test": 1,
        "user000004@example.test": 1,
    }
    assert attempts["user000001@example.test"] == 3
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert status == "sent"
    assert (counts.sent, counts.failed, counts.total) == (3, 2, 5)
    async with await connect(database_url) as conn:
        rows = await (
            await conn.execute("SELECT email, status, failures, last_error FROM sendonce.deliveries ORDER BY email")
        ).fetchall()
        by_email = {r["email"]: r for r in rows}
        assert "550" in by_email["user000002@example.test"]["last_error"]
        assert "gave up after 3 failures" in by_email["user000003@example.test"]["last_error"]
        suppressed = await (await conn.execute("SELECT email_key, reason FROM sendonce.suppressions")).fetchall()
        bounced = await (
            await conn.execute("SELECT email FROM sendonce.subscribers WHERE status = 'bounced'")
        ).fetchall()
    # the hard bounce suppresses the address; the soft one (452) does not
    assert suppressed == [{"email_key": "user000002@example.test", "reason": "bounce"}]
    assert bounced == [{"email": "user000002@example.test"}]


async def test_pause_stops_sending_and_resume_finishes_exactly_once(database_url: str) -> None:
    addresses = emails(120)
    setup = await campaign_setup(database_url, addresses)
    assert setup.campaign_id is not None
    with Inbox(faults=InboxFaults(late=1.0, late_seconds=0.02)) as inbox:
        worker = Worker(
            database_url,
            transport_from_url(inbox.url),
            WorkerConfig(concurrency=2, batch_size=5, **FAST),
            composer=composer(),
        )
        task = asyncio.create_task(worker.run())
        assert await asyncio.to_thread(inbox.wait_for, 20, 30)
        async with await connect(database_url) as conn:
            assert (await campaigns.transition(conn, setup.account_id, setup.campaign_id, "pause")).won
        await asyncio.sleep(FAST["lease"] / 3 + 1.0)  # at most until the next renewal
        paused_at = len(inbox.messages)
        await asyncio.sleep(1.0)
        assert len(inbox.messages) == paused_at
        assert paused_at < 120
        async with await connect(database_url) as conn:
            assert (await campaigns.transition(conn, setup.account_id, setup.campaign_id, "resume")).won
        await _wait_status(database_url, setup.account_id, setup.campaign_id, "sent")
        worker.stop()
        await task
        assert inbox.by_recipient() == dict.fromkeys(addresses, 1)
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert (counts.sent, counts.total, counts.queued, counts.sending) == (120, 120, 0, 0)


async def test_a_row_made_ahead_is_not_started_and_a_pause_still_gives_it_back(database_url: str) -> None:
    # A lane makes its next message while the current one waits at its gate (its envelope may go out
    # with the current content). Until that row's own send begins, a pause must still reach it.
    setup = await campaign_setup(database_url, emails(4))
    assert setup.campaign_id is not None
    await _prebuild(database_url)
    c = composer()
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(**FAST), composer=c)
    async with await connect(database_url) as conn:
        batch = await outbox.claim_batch(
            conn, limit=2, lease_seconds=30, worker=worker.name, transport_idempotent=False
        )
        await c.prepare(conn, batch)
    loop = asyncio.get_running_loop()
    ahead = Held(batch[0], lease_end=loop.time() + 30)
    assert worker._prepare(ahead) is not None
    assert not ahead.started
    # the next renewal finds the campaign paused: a row not started is given back, not sent
    renewal = outbox.Renewal(renewed={ahead.delivery.key: False}, busy={})
    worker._apply_renewal([ahead], renewal, loop.time() + 30)
    assert ahead.release
    assert worker._settled_unsent(ahead)
    assert [(r.held, r.outcome) for r in worker._results] == [(ahead, None)]


async def test_a_pause_reaches_a_row_whose_lane_waits_at_the_gate(database_url: str) -> None:
    # A lane sends a message's envelope, then waits at the gate for its previous message's record
    # before the content. A pause (or an opt-out) that a renewal brought then did not reach the row:
    # "started" was set before the envelope, and only unstarted rows were given back. Here the
    # records wait on a lock this test holds, so the second row waits at its gate for as long.
    setup = await campaign_setup(database_url, emails(2))
    assert setup.campaign_id is not None
    await _prebuild(database_url)
    lock: list[psycopg.Connection[Any]] = []

    def reject(address: str) -> str | None:
        if not lock:  # the claim has committed: the records of its rows wait for this lock
            conn = psycopg.connect(database_url)
            conn.execute("SELECT 1 FROM sendonce.deliveries WHERE campaign_id = %s FOR UPDATE", (setup.campaign_id,))
            lock.append(conn)
        return None

    config = WorkerConfig(concurrency=1, batch_size=2, **FAST)
    with Inbox(faults=InboxFaults(reject=reject)) as inbox:
        async with running_worker(database_url, transport_from_url(inbox.url), config) as worker:
            try:
                deadline = time.monotonic() + 30
                while not (len(worker._held) == 2 and sum(h.done for h in worker._held.values()) == 1):
                    assert time.monotonic() < deadline, "the first outcome never came"
                    await asyncio.sleep(0.01)
                [waiting] = [h for h in worker._held.values() if not h.done]
                assert waiting.started and not waiting.content  # its envelope is out; at the gate
                async with await connect(database_url) as conn:
                    assert (await campaigns.transition(conn, setup.account_id, setup.campaign_id, "pause")).won
                while not waiting.release:  # the next renewal finds the campaign paused
                    assert time.monotonic() < deadline, "the pause never reached the row at the gate"
                    await asyncio.sleep(0.01)
            finally:
                for conn in lock:
                    conn.rollback()  # the first record goes through; the gate then withholds the second
                    conn.close()
            while worker._held:
                assert time.monotonic() < deadline, "the rows were never settled"
                await asyncio.sleep(0.01)
    assert len(inbox.messages) == 1
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert (status, counts.sent, counts.queued) == ("paused", 1, 1)


async def test_a_late_outcome_of_an_old_attempt_leaves_the_new_claim_held(database_url: str) -> None:
    # The worker lost its lease on a row (an outage), the row was re-queued and this same worker
    # claimed it again. The old attempt's outcome, recorded late, is refused (fencing), and must not
    # make the worker forget the new claim: that one is still being sent, and must stay renewed.
    setup = await campaign_setup(database_url, emails(1))
    await _prebuild(database_url)
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(**FAST), composer=composer())
    loop = asyncio.get_running_loop()
    async with await connect(database_url) as conn:
        claim: dict[str, Any] = {"limit": 1, "lease_seconds": 30, "worker": worker.name, "transport_idempotent": False}
        [old] = await outbox.claim_batch(conn, **claim)
        await conn.execute("UPDATE sendonce.deliveries SET lease_expires_at = now() - interval '1 second'")
        assert len(await outbox.requeue_expired(conn)) == 1
        [new] = await outbox.claim_batch(conn, **claim)
        assert (old.key, new.attempt) == (new.key, old.attempt + 1)
        held = Held(new, lease_end=loop.time() + 30)
        worker._held[new.key] = held
        await worker._record(conn, [_Result(Held(old, lease_end=loop.time()), Accepted("250 ok"))])
    assert worker.stats.fenced_out == 1
    assert worker._held.get(new.key) is held
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert counts.sending == 1 and counts.sent == 0


@pytest.mark.parametrize("new_first", [True, False])
@pytest.mark.parametrize("old_sent", [False, True])
async def test_two_attempts_of_one_row_in_one_group_are_each_settled(
    database_url: str, new_first: bool, old_sent: bool
) -> None:
    # As above, but the new claim's outcome (sent) and the old claim's reach the recorder in one
    # group: the old one given back (its deadline had passed), or sent (its record was late). Each is
    # settled on its own: the new claim is sent and forgotten, the old one is never counted as sent;
    # nothing stays held (a draining worker would never end, and an idle one would not look for work
    # until its next tick).
    setup = await campaign_setup(database_url, emails(1))
    await _prebuild(database_url)
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(**FAST), composer=composer())
    loop = asyncio.get_running_loop()
    async with await connect(database_url) as conn:
        claim: dict[str, Any] = {"limit": 1, "lease_seconds": 30, "worker": worker.name, "transport_idempotent": False}
        [old] = await outbox.claim_batch(conn, **claim)
        await conn.execute("UPDATE sendonce.deliveries SET lease_expires_at = now() - interval '1 second'")
        assert len(await outbox.requeue_expired(conn)) == 1
        [new] = await outbox.claim_batch(conn, **claim)
        held_new = Held(new, lease_end=loop.time() + 30)
        worker._held[new.key] = held_new
        old_outcome = Accepted("250 ok") if old_sent else None
        group = [_Result(held_new, Accepted("250 ok")), _Result(Held(old, lease_end=loop.time()), old_outcome)]
        await worker._record(conn, group if new_first else group[::-1])
    assert worker._held == {}
    assert (worker.stats.sent, worker.stats.fenced_out) == (1, int(old_sent))
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert counts.sent == 1


_DOUBTS = {
    # An attempt reached the provider but its answer was lost (the row is uncertain), then the row
    # waited: a campaign paused overnight, a long outage.
    "answer lost": "UPDATE sendonce.deliveries SET status = 'queued', uncertain = true, sent_at = NULL, "
    "uncertain_since = now() - make_interval(hours => %(h)s)",
    # The provider accepted it and the worker was killed before recording it; no worker ran (or the
    # database was down) until now, when the expired lease is found. The doubt began at the claim,
    # not now: dated now, a re-send past the key's life would look fresh and go unrecorded.
    "worker killed": "UPDATE sendonce.deliveries SET status = 'sending', sent_at = NULL, "
    "updated_at = now() - make_interval(hours => %(h)s), "
    "lease_expires_at = now() - make_interval(hours => %(h)s) + interval '30 seconds'",
}


@pytest.mark.parametrize("doubt", list(_DOUBTS))
@pytest.mark.parametrize(("hours", "provider_forgot"), [(25, True), (1, False)])
async def test_a_resend_past_the_idempotency_key_life_goes_to_the_ledger(
    database_url: str, doubt: str, hours: int, provider_forgot: bool
) -> None:
    # The doubt began 25 hours ago, past the 24 hours Resend keeps a key, or 1 hour ago.
    setup = await campaign_setup(database_url, emails(1))
    with ResendServer() as provider:
        await run_to_drain(database_url, transport_from_url(provider.url), WorkerConfig(drain=True, **FAST))
        async with await connect(database_url) as conn:
            await conn.execute(_DOUBTS[doubt], {"h": hours})
            # its campaign was paused meanwhile (or never finished), and goes on now
            await conn.execute("UPDATE sendonce.campaigns SET status = 'sending', finished_at = NULL")
        if provider_forgot:
            provider.forget_keys()
        await run_to_drain(database_url, transport_from_url(provider.url), WorkerConfig(drain=True, **FAST))
        copies = max(provider.by_job().values())
    async with await connect(database_url) as conn:
        ledger = await campaigns.list_possible_duplicates(conn, setup.account_id)
    if provider_forgot:
        # the key was forgotten, so the provider delivered it again: not silent, it is in the ledger
        assert copies == 2
        assert [row["reason"] for row in ledger] == ["resend_after_idempotency_key_expired"]
    else:
        assert copies == 1 and ledger == []  # within the key's life the provider dropped the re-send
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert counts.sent == 1 and counts.possible_duplicate == len(ledger)


async def test_an_uncertain_outcome_recorded_late_dates_its_doubt_from_the_claim(database_url: str) -> None:
    # The provider's answer was lost (a timeout), and the database was unreachable for a day before
    # the worker could record that: the doubt is as old as the claim, and the next claim ledgers it.
    await campaign_setup(database_url, emails(1))
    await _prebuild(database_url)
    claim: dict[str, Any] = {
        "limit": 1,
        "lease_seconds": 30,
        "worker": "w",
        "transport_idempotent": True,
        "key_life": 24 * 3600.0,
    }
    async with await connect(database_url) as conn:
        [row] = await outbox.claim_batch(conn, **claim)
        await conn.execute("UPDATE sendonce.deliveries SET updated_at = now() - interval '25 hours'")
        retry = outbox.RetryRecord(row.account_id, row.delivery_id, row.attempt, 0.0, "timed out", uncertain=True)
        assert await outbox.record_retry(conn, [retry]) == {row.key}
        [again] = await outbox.claim_batch(conn, **claim)
        ledger = await (await conn.execute("SELECT attempt, reason FROM sendonce.possible_duplicates")).fetchall()
    assert again.uncertain
    assert ledger == [{"attempt": again.attempt, "reason": "resend_after_idempotency_key_expired"}]


@pytest.mark.parametrize("kind", ["campaign", "transactional"])
async def test_a_row_whose_key_another_sender_used_fails_and_says_why(database_url: str, kind: str) -> None:
    # Another installation sharing the provider's API key (so the same job ids) sent its own message
    # under this row's key first. The provider answers our first attempt with a 409: the row fails,
    # saying why, rather than being recorded sent when our message was never delivered.
    if kind == "campaign":
        await campaign_setup(database_url, emails(2))
        await _prebuild(database_url)
    else:
        async with await connect(database_url) as conn:
            account_id, _ = await make_account(conn)
            for n in range(2):
                await enqueue_async(
                    conn, account_id=account_id, to=f"t{n}@example.test", subject="s", text="t", key=f"k{n}"
                )
    async with await connect(database_url) as conn:
        rows = await (await conn.execute("SELECT job_id FROM sendonce.deliveries ORDER BY delivery_id")).fetchall()
    taken = rows[0]["job_id"]
    with ResendServer() as provider:
        base = provider.url.replace("resend+http://re_test_key@", "http://")
        foreign = {"from": "x@other.test", "to": ["y@other.test"], "subject": "theirs", "text": "theirs"}
        response = await asyncio.to_thread(
            httpx.post,
            f"{base}/emails",
            json=foreign,
            headers={"Authorization": f"Bearer {provider.api_key}", "Idempotency-Key": taken},
        )
        assert response.status_code == 200
        await run_to_drain(database_url, transport_from_url(provider.url), WorkerConfig(drain=True, **FAST))
        delivered = provider.by_job()
    assert delivered == {taken: 1, rows[1]["job_id"]: 1}  # the first is the other sender's message
    async with await connect(database_url) as conn:
        ended = await (
            await conn.execute("SELECT job_id, status::text, last_error FROM sendonce.deliveries ORDER BY delivery_id")
        ).fetchall()
        ledger = await (await conn.execute("SELECT count(*) AS n FROM sendonce.possible_duplicates")).fetchone()
    assert [(row["job_id"], row["status"]) for row in ended] == [(taken, "failed"), (rows[1]["job_id"], "sent")]
    assert "already used by another sender" in ended[0]["last_error"]
    assert ledger == {"n": 0}


async def test_a_relay_that_is_down_holds_the_mail_and_is_probed_not_hammered(database_url: str) -> None:
    # The relay resets every connection for a while (down, restarting, a firewall): a failure of the
    # transport, not of any message. No message may fail for it, however long it lasts, the lanes
    # pause between tries rather than running the whole queue into the refusing relay, and the
    # worker's metrics say the transport is down.
    addresses = emails(40)
    setup = await campaign_setup(database_url, addresses)
    config = WorkerConfig(
        concurrency=2, drain=True, max_failures=2, tick=0.2, lease=5.0, backoff_base=0.5, backoff_cap=1.0
    )
    with Inbox() as inbox, TcpProxy(target_host="127.0.0.1", target_port=inbox.port) as proxy:
        proxy.cut()
        worker = Worker(database_url, transport_from_url(f"smtp://127.0.0.1:{proxy.port}"), config, composer=composer())
        registry = CollectorRegistry()
        registry.register(WorkerCollector(worker))
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(2.0)  # the outage lasts
        async with asyncio.timeout(30):
            while proxy.refused < 4:  # met the outage, paused, and probed it again
                await asyncio.sleep(0.05)
        async with await connect(database_url) as conn:
            row = await (
                await conn.execute(
                    "SELECT count(*) FILTER (WHERE status = 'failed') AS failed, max(failures) AS failures,"
                    " max(last_error) AS error FROM sendonce.deliveries"
                )
            ).fetchone()
        assert row is not None and (row["failed"], row["failures"]) == (0, 0)
        assert (row["error"] or "").startswith("connect:"), row
        assert (registry.get_sample_value("sendonce_worker_transport_outage_seconds") or 0) > 0
        assert (registry.get_sample_value("sendonce_worker_transport_failures_total") or 0) >= 4
        proxy.heal()
        await asyncio.wait_for(task, 60)
        refused = proxy.refused
        received = inbox.by_recipient()
    assert received == dict.fromkeys(addresses, 1)
    assert refused < len(addresses)  # probed: fewer tries than there were messages waiting
    assert registry.get_sample_value("sendonce_worker_transport_outage_seconds") == 0
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (counts.sent, counts.failed) == (40, 0)


async def test_a_relay_that_refuses_the_sender_pauses_the_campaign_and_loses_nothing(database_url: str) -> None:
    # The relay refuses the campaign's sender (a 5xx to MAIL FROM: not allowed to send for that
    # domain). It used to fail every row in turn on its first try, and the campaign ended "sent" with
    # nothing delivered. The campaign pauses instead, saying why, with an alert; no row fails, the
    # refused one counts one try and the others are given back uncounted; once the relay is fixed a
    # resume sends each address once.
    addresses = emails(20)
    setup = await campaign_setup(database_url, addresses)
    refusing = True
    faults = InboxFaults(refuse_sender=lambda _: "553 5.7.1 Sender address rejected" if refusing else None)
    config = WorkerConfig(concurrency=2, batch_size=5, drain=True, max_failures=2, **FAST)
    with Inbox(faults=faults) as inbox:
        # one lane holding the whole campaign: the rows it has not started go back at the refusal, not
        # at the lease's next renewal once the pause is recorded (each would meet the refusal in turn)
        one_lane = WorkerConfig(concurrency=1, batch_size=20, drain=True, max_failures=2, **FAST)
        await run_to_drain(database_url, transport_from_url(inbox.url), one_lane)  # drained: nothing it may send
        assert inbox.messages == []
        assert faults.counts["sender_refused"] == 1, faults.counts
        async with await connect(database_url) as conn:
            campaign = await campaigns.get_campaign(conn, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
            rows = await (
                await conn.execute(
                    "SELECT status::text, failures, count(*) AS n FROM sendonce.deliveries GROUP BY 1, 2 ORDER BY 2"
                )
            ).fetchall()
            raised = await alerts.list_alerts(conn, setup.account_id)  # type: ignore[arg-type]
        assert campaign is not None and campaign.status.value == "paused"
        assert "553 5.7.1 Sender address rejected" in (campaign.paused_reason or ""), campaign.paused_reason
        assert rows == [{"status": "queued", "failures": 0, "n": 19}, {"status": "queued", "failures": 1, "n": 1}]
        assert [(a["kind"], a["detail"]["sender_refused"]) for a in raised] == [("campaign_paused", True)]
        refusing = False  # the operator fixes the relay, then resumes
        async with await connect(database_url) as conn:
            resumed = await campaigns.transition(conn, setup.account_id, setup.campaign_id, "resume")  # type: ignore[arg-type]
            assert resumed.won
        await run_to_drain(database_url, transport_from_url(inbox.url), config)
        received = inbox.by_recipient()
    assert received == dict.fromkeys(addresses, 1)
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (status, counts.sent, counts.failed) == ("sent", 20, 0)


async def test_a_refusal_wrongly_read_as_the_senders_cannot_pause_a_campaign_for_ever(database_url: str) -> None:
    # A server refuses one recipient in words that read as a refusal of us. Each resume would meet
    # it again and pause the campaign again, never to finish: the refusal counts as one of the row's
    # tries, so after them the row fails (suppressing nobody) and the campaign ends.
    addresses = emails(4)
    setup = await campaign_setup(database_url, addresses)
    odd = addresses[2]
    faults = InboxFaults(reject=lambda address: "554 5.7.1 Relay access denied" if address == odd else None)
    config = WorkerConfig(concurrency=1, batch_size=4, drain=True, max_failures=3, **FAST)
    statuses = []
    with Inbox(faults=faults) as inbox:
        for _ in range(6):
            await run_to_drain(database_url, transport_from_url(inbox.url), config)
            status, _ = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
            statuses.append(status)
            if status != "paused":
                break
            async with await connect(database_url) as conn:
                await campaigns.transition(conn, setup.account_id, setup.campaign_id, "resume")  # type: ignore[arg-type]
        received = inbox.by_recipient()
    assert statuses == ["paused", "paused", "sent"], statuses
    assert received == {a: 1 for a in addresses if a != odd}
    async with await connect(database_url) as conn:
        row = await (
            await conn.execute("SELECT status::text, last_error FROM sendonce.deliveries WHERE email = %s", [odd])
        ).fetchone()
        suppressed = await (await conn.execute("SELECT count(*) AS n FROM sendonce.suppressions")).fetchone()
    assert row is not None and row["status"] == "failed", row
    assert row["last_error"].startswith("gave up after 3 failures: rcpt: 554"), row
    assert suppressed == {"n": 0}


async def test_a_stale_attempts_refused_sender_pauses_nothing(database_url: str) -> None:
    # The refusal of an attempt whose lease ran out arrives after another worker re-claimed the row
    # (perhaps once the sender was fixed and the campaign resumed): it is fenced out, and it must not
    # pause the campaign again, with an old reason.
    setup = await campaign_setup(database_url, emails(1))
    await _prebuild(database_url)
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(**FAST), composer=composer())
    claim: dict[str, Any] = {"limit": 1, "lease_seconds": 30, "worker": worker.name, "transport_idempotent": False}
    refused = Retry("mail: 553 5.7.1 Sender address rejected", sender_wide=True)
    async with await connect(database_url) as conn:
        [old] = await outbox.claim_batch(conn, **claim)
        await conn.execute("UPDATE sendonce.deliveries SET lease_expires_at = now() - interval '1 second'")
        assert len(await outbox.requeue_expired(conn)) == 1
        [new] = await outbox.claim_batch(conn, **{**claim, "worker": "another"})
        await worker._record(conn, [_Result(Held(old, lease_end=0.0), refused)])
        campaign = await campaigns.get_campaign(conn, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
        raised = await alerts.list_alerts(conn, setup.account_id)  # type: ignore[arg-type]
        assert worker.stats.fenced_out == 1
        assert campaign is not None and campaign.status.value == "sending" and raised == []
        # the current attempt's refusal does pause it
        await worker._record(conn, [_Result(Held(new, lease_end=0.0), refused)])
        campaign = await campaigns.get_campaign(conn, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert campaign is not None and campaign.status.value == "paused"


async def test_a_group_recorded_again_after_a_lost_commit_answer_still_checks_its_bounces(database_url: str) -> None:
    # The recorder's commit went through but its answer was lost (the connection dropped): the group is
    # recorded again, finds its rows recorded already, and the hard bounce in it was not counted as
    # new, so its campaign's bounce rate was never checked.
    setup = await campaign_setup(database_url, emails(2))
    await _prebuild(database_url)
    policy = FeedbackPolicy(max_bounce_rate=0.1, min_sample=1)
    worker = Worker(
        database_url,
        transport_from_url("smtp://127.0.0.1:9"),
        WorkerConfig(**FAST, feedback=policy),
        composer=composer(),
    )
    claim: dict[str, Any] = {"limit": 1, "lease_seconds": 30, "worker": worker.name, "transport_idempotent": False}
    bounce = Permanent("rcpt: 550 5.1.1 user unknown", hard_bounce=True)
    async with await connect(database_url) as conn:
        [row] = await outbox.claim_batch(conn, **claim)
        # the first run of the group, whose commit's answer never came back
        first = await outbox.record_failed(
            conn, [outbox.FailedRecord(row.account_id, row.delivery_id, row.attempt, bounce.error, hard_bounce=True)]
        )
        assert first.recorded == {row.key}
        await worker._record(conn, [_Result(Held(row, lease_end=0.0), bounce)])  # the group again
        assert worker._dirty_campaigns == {(setup.account_id, setup.campaign_id)}
        await worker._check_campaigns(conn)  # as the recorder does once the group is settled
        campaign = await campaigns.get_campaign(conn, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert campaign is not None and campaign.status.value == "paused"


async def test_replies_that_are_not_utf8_are_recorded_and_the_worker_goes_on(database_url: str) -> None:
    # A relay answering in Latin-1 (or with a NUL): the reply is read as lone surrogates, which
    # PostgreSQL's text refuses. The record failed and the worker stopped, with the accepted message
    # unrecorded: re-sent by the next worker (a duplicate), which stopped the same way.
    addresses = emails(3)
    setup = await campaign_setup(database_url, addresses)
    received: list[bytes] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 relais ESMTP\r\n")
        while line := await reader.readline():
            command = line[:4].upper()
            if command == b"EHLO":
                writer.write(b"250-relais\r\n250 8BITMIME\r\n")
            elif command == b"RCPT" and addresses[0].encode() in line:
                writer.write(b"550 5.1.1 Destinataire inconnu: bo\xeete inexistante\r\n")
            elif command == b"DATA":
                writer.write(b"354 Allez-y\r\n")
                await writer.drain()
                content = b""
                while not content.endswith(b"\r\n.\r\n"):
                    content += await reader.readline()
                received.append(content)
                writer.write(b"250 2.0.0 Message accept\xe9\x00 pour livraison\r\n")
            elif command == b"QUIT":
                writer.write(b"221 Au revoir\r\n")
                await writer.drain()
                break
            else:
                writer.write(b"250 OK\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        config = WorkerConfig(concurrency=1, batch_size=3, drain=True, **FAST)
        await run_to_drain(database_url, transport_from_url(f"smtp://127.0.0.1:{port}"), config)
    assert len(received) == 2
    async with await connect(database_url) as conn:
        rows = await (
            await conn.execute(
                "SELECT status::text, transport_message_id AS id, last_error FROM sendonce.deliveries ORDER BY email"
            )
        ).fetchall()
    assert [row["status"] for row in rows] == ["failed", "sent", "sent"]
    assert "Destinataire inconnu: bo?te inexistante" in rows[0]["last_error"], rows[0]
    assert rows[1]["id"] == "250 2.0.0 Message accept?\ufffd pour livraison", rows[1]
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (status, counts.sent, counts.failed, counts.possible_duplicate) == ("sent", 2, 1, 0)


async def test_a_message_the_relay_closes_on_every_time_fails_after_its_tries(database_url: str) -> None:
    # A 421 to the content was a transport outage, uncounted: a message a relay's filter answers so
    # every time was tried for ever (94 tries in 20 s in a review's run), and its campaign never
    # left "sending". It is this message's try: counted, and the campaign finishes.
    tries: Counter[str] = Counter()

    def refuse(address: str) -> str | None:
        tries[address] += 1
        return "421 4.7.0 Message rejected, closing connection" if address == "user000001@example.test" else None

    setup = await campaign_setup(database_url, emails(5))
    with Inbox(faults=InboxFaults(refuse_content=refuse)) as inbox:
        config = WorkerConfig(concurrency=2, drain=True, max_failures=3, **FAST)
        stats = await run_to_drain(database_url, transport_from_url(inbox.url), config)
        received = inbox.by_recipient()
    assert tries["user000001@example.test"] == 3 and "user000001@example.test" not in received
    assert len(received) == 4 and set(received.values()) == {1}
    assert stats.transport_failures == 0
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert (status, counts.sent, counts.failed) == ("sent", 4, 1)


async def test_a_refused_sender_of_a_transactional_message_is_retried_counted(database_url: str) -> None:
    # No campaign to pause: the message is retried like any other transient failure, and fails after
    # its tries (retried uncounted, it would be tried for ever).
    async with await connect(database_url) as conn:
        account_id, _ = await make_account(conn)
        await enqueue_async(conn, account_id=account_id, to="t@example.test", subject="s", text="t", key="k")
    faults = InboxFaults(refuse_sender=lambda _: "550 5.7.1 Sender rejected")
    with Inbox(faults=faults) as inbox:
        config = WorkerConfig(drain=True, max_failures=2, **FAST)
        await run_to_drain(database_url, transport_from_url(inbox.url), config)
        assert faults.counts["sender_refused"] == 2
    async with await connect(database_url) as conn:
        row = await (
            await conn.execute("SELECT status::text, failures, last_error FROM sendonce.deliveries")
        ).fetchone()
    assert row is not None and row["status"] == "failed", row
    assert row["last_error"].startswith("gave up after 2 failures: mail: 550"), row


@pytest.mark.parametrize(
    "retry_after",
    ["1e300", "1e9", "Fri, 31 Dec 9999 23:59:59 GMT", "inf", "nan"],
    ids=["1e300", "1e9", "a-date-in-9999", "inf", "nan"],
)
async def test_a_providers_retry_after_cannot_park_a_row_past_the_backoff_cap(
    database_url: str, retry_after: str
) -> None:
    # A 500 asking for a Retry-After beyond any interval PostgreSQL can hold (1e300) made the record
    # fail: the worker crashed, and so did every worker the re-sent row met. A large valid one parked
    # the row for decades, and its campaign stayed "sending". The worker honours it up to its cap.
    setup = await campaign_setup(database_url, emails(2))
    faults = ResendFaults(server_error=1.0, server_error_retry_after=retry_after)
    with ResendServer(faults=faults) as provider:
        config = WorkerConfig(drain=True, max_failures=3, **FAST)
        await run_to_drain(database_url, transport_from_url(provider.url), config, timeout=30)
        assert faults.counts["500"] == 2 * 3
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (status, counts.failed) == ("sent", 2)


async def test_a_provider_id_too_long_for_its_index_is_recorded_cut_short(database_url: str) -> None:
    # The provider's id is indexed (webhooks find their delivery by it). One past what an index
    # entry holds made the record fail; the worker took that for an outage and kept the group, and
    # then recorded nothing more: its rows stayed 'sending' as long as it ran, renewed.
    setup = await campaign_setup(database_url, emails(6))
    with ResendServer(faults=ResendFaults(id_length=6000)) as provider:
        await run_to_drain(database_url, transport_from_url(provider.url), WorkerConfig(drain=True, **FAST), timeout=30)
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (status, counts.sent) == ("sent", 6)
    async with await connect(database_url) as conn:
        ids = await (await conn.execute("SELECT transport_message_id FROM sendonce.deliveries")).fetchall()
    assert {len(row["transport_message_id"]) for row in ids} == {outbox.MESSAGE_ID_LIMIT}


@pytest.mark.parametrize("transport", ["smtp", "resend"])
async def test_the_metrics_say_where_a_workers_time_goes(database_url: str, transport: str) -> None:
    # Claims, grouped records, and the time the connections held a message back for the previous
    # one's record: over SMTP every message after a connection's first waits for one; through an
    # idempotent provider none does (there is no such rule to keep).
    await campaign_setup(database_url, emails(12))
    config = WorkerConfig(concurrency=2, batch_size=4, drain=True, **FAST)
    with Inbox() as inbox, ResendServer() as provider:
        url = inbox.url if transport == "smtp" else provider.url
        worker = Worker(database_url, transport_from_url(url), config, composer=composer())
        registry = CollectorRegistry()
        registry.register(WorkerCollector(worker))
        stats = await asyncio.wait_for(worker.run(), 60)
    assert stats.sent == 12

    def metric(name: str) -> float:
        value = registry.get_sample_value(f"sendonce_worker_{name}")
        assert value is not None, name
        return value

    assert metric("claims_total") >= 3  # 12 rows, 4 a claim
    assert metric("claim_seconds_total") > 0
    assert 1 <= metric("record_groups_total") <= 12
    assert metric("record_seconds_total") > 0
    assert metric("lane_waits_total") >= 1  # the connections start before the first claim has answered
    if transport == "smtp":
        # each connection's next content waits for its previous record (a commit's round trip, where
        # the next envelope's replies are already in): a gate that let them through would count none
        assert metric("record_waits_total") >= 1 and metric("record_wait_seconds_total") > 0
        assert metric("record_waits_total") <= 12 - 2  # not the first message of either connection
    else:
        assert metric("record_waits_total") == metric("record_wait_seconds_total") == 0


async def _paused_by_a_rate_limit(
    database_url: str, provider: ResendServer, backoff: float, lease: float = 5.0
) -> tuple[Worker, Any]:
    """A worker (one lane) whose first request met a 429: its lane is pausing, holding a row."""
    config = WorkerConfig(concurrency=1, batch_size=5, tick=0.2, lease=lease, backoff_base=backoff, backoff_cap=backoff)
    worker = Worker(database_url, transport_from_url(provider.url), config, composer=composer())
    task = asyncio.create_task(worker.run())
    async with asyncio.timeout(30):
        while provider.faults.counts["429"] < 1 or worker._outage_until == 0.0:
            await asyncio.sleep(0.02)
    return worker, task


async def test_a_campaign_paused_while_the_lanes_wait_out_an_outage_is_not_sent(database_url: str) -> None:
    # Over an idempotent transport a send has no gate: the row a lane took while the provider asked
    # it to slow down is looked at again when the pause ends. Its campaign was paused meanwhile: it is
    # given back, not sent.
    setup = await campaign_setup(database_url, emails(10))
    with ResendServer(faults=ResendFaults(rate_limited=1.0)) as provider:
        worker, task = await _paused_by_a_rate_limit(database_url, provider, backoff=4.0)  # a pause of 2-6 s
        async with await connect(database_url) as conn:
            paused = await campaigns.transition(conn, setup.account_id, setup.campaign_id, "pause")  # type: ignore[arg-type]
            assert paused.won
        provider.faults.rate_limited = 0.0
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(worker._outage_until - loop.time(), 0.0) + 1.0)  # the pause is over
        worker.stop()
        await asyncio.wait_for(task, 30)
        assert provider.accepted == []
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (counts.sent, counts.sending, counts.queued) == (0, 0, 10)


async def test_an_opt_out_while_the_lanes_wait_out_an_outage_is_honoured(database_url: str) -> None:
    # Rows a worker holds through an outage are renewed, not claimed again, so the claim's opt-out
    # check never saw them again: recipients who were suppressed or left the list meanwhile got the
    # campaign once the transport answered (a review found it). The renewal now makes the claim's
    # check too, and what has not started is given back; its re-claim settles it.
    addresses = emails(10)
    setup = await campaign_setup(database_url, addresses)
    with ResendServer(faults=ResendFaults(rate_limited=1.0)) as provider:
        # a pause of 4-12 s; a renewal every second
        worker, task = await _paused_by_a_rate_limit(database_url, provider, backoff=8.0, lease=3.0)
        assert worker.held_count > 0
        async with await connect(database_url) as conn:
            for address in addresses[:5]:
                await suppressions.add_suppression(
                    conn, setup.account_id, parse_address(address), SuppressionReason.MANUAL
                )
            for address in addresses[5:]:
                cursor = await conn.execute(
                    "SELECT subscriber_id FROM sendonce.subscribers WHERE account_id = %s AND email = %s",
                    (setup.account_id, address),
                )
                row = await cursor.fetchone()
                assert row is not None
                await unsubscribes.unsubscribe(conn, setup.account_id, row["subscriber_id"], setup.campaign_id)  # type: ignore[arg-type]
        provider.faults.rate_limited = 0.0
        async with asyncio.timeout(40):
            while True:  # every row settled: sent (the hole) or not
                _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
                if counts.sending == counts.queued == 0:
                    break
                await asyncio.sleep(0.1)
        worker.stop()
        await asyncio.wait_for(task, 30)
        assert provider.accepted == []
    assert counts.sent == 0


async def test_a_stop_does_not_wait_out_an_outage_pause(database_url: str) -> None:
    setup = await campaign_setup(database_url, emails(10))
    with ResendServer(faults=ResendFaults(rate_limited=1.0)) as provider:
        worker, task = await _paused_by_a_rate_limit(database_url, provider, backoff=60.0)  # a pause of 30-60 s
        worker.stop()
        await asyncio.wait_for(task, 10)  # the lane stops waiting; what it held is given back
    _, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)  # type: ignore[arg-type]
    assert (counts.sent, counts.sending) == (0, 0)


async def test_an_outage_of_days_keeps_its_pause_within_the_probe_interval(database_url: str) -> None:
    # Each pause doubles, up to one probe a minute; thousands of them (a relay down for days) must
    # neither overflow the backoff's arithmetic nor stretch the pause.
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(), composer=composer())
    loop = asyncio.get_running_loop()
    for _ in range(5000):
        worker._outage_until = 0.0  # the last pause is over: the next failure starts the next one
        worker._note_transport(Retry("connect: refused", transport_wide=True))
    assert worker._outage_streak == 5000
    assert 0 < worker._outage_until - loop.time() <= 60.0
    worker._note_transport(Accepted("250 ok"))
    assert worker._outage_streak == 0


async def test_graceful_stop_gives_back_what_was_not_started(database_url: str) -> None:
    addresses = emails(60)
    setup = await campaign_setup(database_url, addresses)
    with Inbox(faults=InboxFaults(late=1.0, late_seconds=0.05)) as inbox:
        worker = Worker(
            database_url,
            transport_from_url(inbox.url),
            WorkerConfig(concurrency=2, batch_size=20, **FAST),
            composer=composer(),
        )
        task = asyncio.create_task(worker.run())
        assert await asyncio.to_thread(inbox.wait_for, 3, 30)
        worker.stop()
        stats = await asyncio.wait_for(task, 30)
        assert stats.released > 0
        async with await connect(database_url) as conn:
            open_rows = await (
                await conn.execute("SELECT count(*) AS n FROM sendonce.deliveries WHERE status = 'sending'")
            ).fetchone()
            ledger = await campaigns.list_possible_duplicates(conn, setup.account_id)
        assert open_rows == {"n": 0}
        assert ledger == []  # released rows were never started: re-sending them is not a duplicate
        await run_to_drain(database_url, transport_from_url(inbox.url), WorkerConfig(drain=True, **FAST))
        assert inbox.by_recipient() == dict.fromkeys(addresses, 1)


async def _run_with_a_recording_bug(database_url: str, inbox: Inbox, *, recorders: int, failures: int) -> None:
    """Run a worker (one connection) whose first ``failures`` record calls raise, as a bug would (not an
    outage: that is retried); the worker must stop with that error, within the time limit."""
    worker = Worker(
        database_url,
        transport_from_url(inbox.url),
        WorkerConfig(concurrency=1, recorders=recorders, batch_size=10, **FAST),
        composer=composer(),
    )
    record = worker._record
    calls = 0

    async def record_with_a_bug(conn: Any, results: Any) -> bool:
        nonlocal calls
        calls += 1
        if calls <= failures:
            raise RuntimeError("a bug while recording")
        return await record(conn, results)

    worker._record = record_with_a_bug  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a bug while recording"):
        await asyncio.wait_for(worker.run(), 30)


async def _statuses(url: str, campaign_id: int | None) -> dict[str, set[str]]:
    async with await connect(url) as conn:
        rows = await (
            await conn.execute(
                "SELECT status::text, email FROM sendonce.deliveries WHERE campaign_id = %s", (campaign_id,)
            )
        ).fetchall()
    statuses: dict[str, set[str]] = {}
    for row in rows:
        statuses.setdefault(row["status"], set()).add(row["email"])
    return statuses


async def test_a_recorder_that_crashes_stops_the_worker_instead_of_hanging_it(database_url: str) -> None:
    # The recorder ends and the worker stops. The lane whose next content waits for the lost record
    # must be let go and send nothing more: else run() never returns and the housekeeper renews the
    # unrecorded rows' leases for ever.
    addresses = emails(30)
    setup = await campaign_setup(database_url, addresses)
    with Inbox() as inbox:
        await _run_with_a_recording_bug(database_url, inbox, recorders=1, failures=1_000_000)
        # one connection: at most one message went out unrecorded, the one the recorder failed on
        assert sum(inbox.by_recipient().values()) == 1
        # nothing was recorded: the sent one is re-sent (in the ledger) once its lease runs out
        assert set(await _statuses(database_url, setup.campaign_id)) <= {"queued", "sending"}
        await run_to_drain(database_url, transport_from_url(inbox.url), WorkerConfig(drain=True, **FAST))
        assert set(inbox.by_recipient()) == set(addresses)
        async with await connect(database_url) as conn:
            ledger = await campaigns.list_possible_duplicates(conn, setup.account_id)
        # every duplicate is in the ledger (which also names the unstarted rows: their leases ran out too)
        twice = {job for job, n in inbox.by_job().items() if n > 1}
        assert len(twice) == 1  # the one sent before the crash, re-sent after its lease ran out
        assert twice <= {entry["job_id"] for entry in ledger}


async def test_the_group_of_a_crashed_recorder_is_recorded_by_the_other_one(database_url: str) -> None:
    addresses = emails(30)
    setup = await campaign_setup(database_url, addresses)
    with Inbox() as inbox:
        await _run_with_a_recording_bug(database_url, inbox, recorders=2, failures=1)
    # what went out before the worker stopped is recorded, the failed group included
    delivered = inbox.by_recipient()
    assert sum(delivered.values()) >= 1
    assert (await _statuses(database_url, setup.campaign_id)).get("sent") == set(delivered)


@pytest.mark.parametrize("transport", ["resend", "smtp"])
async def test_a_worker_cut_off_from_the_database_stops_sending_before_its_lease_ends(
    database_url: str, transport: str
) -> None:
    """Over HTTP, without the deadline check the worker would go on sending its whole claim (30
    messages). Over SMTP the lane stops sooner by itself (its next content waits for the previous
    record, which cannot be written): there the deadline shows after the heal, when the message held at
    the gate must be given back, not sent as the expired attempt (a second copy of a row re-claimed)."""
    setup = await campaign_setup(database_url, emails(30))
    await _prebuild(database_url)
    config = WorkerConfig(concurrency=1, batch_size=30, lease=2.0, tick=0.2)
    # Both answer each message 0.2 s late: the claim would take 6 s to send, three leases.
    resend = ResendServer(faults=ResendFaults(delay_seconds=0.2)).start()
    inbox = Inbox(faults=InboxFaults(late=1.0, late_seconds=0.2)).start()

    def sent_at() -> list[float]:
        """When each message reached the provider or the inbox (the inbox: its content, before the answer)."""
        if transport == "resend":
            return [t for t, _ in resend.request_log]
        return [m.received_at for m in inbox.messages]

    try:
        with TcpProxy(**proxy_target(database_url)) as proxy:  # type: ignore[arg-type]
            url = resend.url if transport == "resend" else inbox.url
            worker = Worker(
                through_proxy(database_url, proxy.port), transport_from_url(url), config, composer=composer()
            )
            task = asyncio.create_task(worker.run())
            while not sent_at():
                await asyncio.sleep(0.005)
            proxy.pause()  # before the first renewal: the lease can no longer be extended
            first = sent_at()[0]
            await asyncio.sleep(config.lease * 2)
            during = sent_at()
            assert max(during) <= first + config.lease - config.margin + 0.1
            assert len(during) < 30
            proxy.heal()
            await _wait_status(database_url, setup.account_id, setup.campaign_id, "sent", timeout=60)
            worker.stop()
            await task
        if transport == "resend":
            assert resend.by_job() == Counter(dict.fromkeys(resend.by_job(), 1))
            assert len(resend.accepted) == 30
        else:
            # The one in flight at the pause may have been accepted unrecorded: at most that one
            # comes twice (one connection), and it is in the ledger.
            assert set(inbox.by_recipient()) == set(emails(30))
            twice = {job for job, n in inbox.by_job().items() if n > 1}
            assert sum(n - 1 for n in inbox.by_job().values()) <= config.concurrency
            async with await connect(database_url) as conn:
                ledger = {r["job_id"] for r in await campaigns.list_possible_duplicates(conn, setup.account_id)}
            assert twice <= ledger
    finally:
        resend.stop()
        inbox.stop()


@pytest.mark.parametrize("transport", ["resend", "smtp"])
async def test_a_zombie_worker_cannot_complete_rows_taken_over_by_another(database_url: str, transport: str) -> None:
    """The isolated worker's late outcomes are refused (fencing); the successor finishes the campaign."""
    addresses = emails(20)
    setup = await campaign_setup(database_url, addresses)
    await _prebuild(database_url)
    config = WorkerConfig(concurrency=2, batch_size=20, lease=2.0, tick=0.2)
    # Slow transports: the zombie's first messages are still in flight when the partition starts,
    # so their outcomes can only reach the database after it heals.
    resend = ResendServer(faults=ResendFaults(delay_seconds=0.3)).start()
    inbox = Inbox(faults=InboxFaults(late=1.0, late_seconds=0.3)).start()
    url = resend.url if transport == "resend" else inbox.url
    try:
        with TcpProxy(**proxy_target(database_url)) as proxy:  # type: ignore[arg-type]
            zombie = Worker(
                through_proxy(database_url, proxy.port), transport_from_url(url), config, composer=composer()
            )
            zombie_task = asyncio.create_task(zombie.run())
            while not (resend.request_log or inbox.data_started):
                await asyncio.sleep(0.002)
            # The zombie's first message is at the provider (answered in 0.3 s): its outcome can only
            # reach the database once the partition heals, after its rows were taken over.
            proxy.pause()
            await asyncio.sleep(config.lease + 0.5)
            successor = Worker(
                database_url,
                transport_from_url(url),
                WorkerConfig(concurrency=2, lease=2.0, tick=0.2),
                composer=composer(),
            )
            successor_task = asyncio.create_task(successor.run())
            await _wait_status(database_url, setup.account_id, setup.campaign_id, "sent", timeout=60)
            proxy.heal()
            # the zombie's pending outcomes reach the database now, and are refused
            deadline = time.monotonic() + 30
            while zombie.stats.fenced_out == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            zombie.stop()
            successor.stop()
            zombie_stats, _ = await asyncio.gather(zombie_task, successor_task)
        assert zombie_stats.fenced_out >= 1
        status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
        assert status == "sent" and counts.sent == 20
        if transport == "resend":
            assert sorted(t for e in resend.accepted for t in e.to) == sorted(addresses)
            assert counts.possible_duplicate == 0
        else:
            received = inbox.by_recipient()
            assert set(received) == set(addresses)
            duplicated = {job for job, n in inbox.by_job().items() if n > 1}
            async with await connect(database_url) as conn:
                ledger = {r["job_id"] for r in await campaigns.list_possible_duplicates(conn, setup.account_id)}
            # the zombie's first message reached the inbox before the cut and was never recorded: its
            # successor sent it again, so there is at least that duplicate to find in the ledger
            assert duplicated and duplicated <= ledger
            # at most the message in flight on each of the zombie's connections
            assert sum(n - 1 for n in received.values()) <= config.concurrency
    finally:
        resend.stop()
        inbox.stop()


async def test_internationalized_addresses(database_url: str) -> None:
    addresses = ["josé@example.test", "ann@bücher.test"]
    await campaign_setup(database_url, addresses)
    with Inbox() as inbox:
        await run_to_drain(database_url, transport_from_url(inbox.url), WorkerConfig(drain=True, **FAST))
        assert inbox.by_recipient() == {"josé@example.test": 1, "ann@xn--bcher-kva.test": 1}


async def test_a_non_ascii_mailbox_fails_clearly_without_smtputf8(database_url: str) -> None:
    setup = await campaign_setup(database_url, ["josé@example.test", "ann@example.test"])
    with Inbox(smtputf8=False) as inbox:
        await run_to_drain(database_url, transport_from_url(inbox.url), WorkerConfig(drain=True, **FAST))
        assert inbox.by_recipient() == {"ann@example.test": 1}
    async with await connect(database_url) as conn:
        row = await (
            await conn.execute("SELECT status, last_error FROM sendonce.deliveries WHERE email = 'josé@example.test'")
        ).fetchone()
    assert row is not None and row["status"] == "failed" and "SMTPUTF8" in row["last_error"]
    del setup


async def test_a_list_locked_for_an_instant_is_built_without_waiting_for_the_tick(
    database_url: str, inbox: Inbox
) -> None:
    """A builder that finds the campaign row locked looks again shortly: nobody else may wake it."""
    setup = await campaign_setup(database_url, emails(30))
    async with await connect(database_url) as conn:
        await outbox.start_due_campaigns(conn)  # sending, list not built
    holder = await connect(database_url, autocommit=False)
    await holder.execute("SELECT 1 FROM sendonce.campaigns FOR UPDATE")
    config = WorkerConfig(tick=60, lease=5, concurrency=2)
    worker = Worker(database_url, transport_from_url(inbox.url), config, composer=composer())
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(1.0)  # the builder met the lock
        await holder.rollback()
        await _wait_status(database_url, setup.account_id, setup.campaign_id, "sent", timeout=15)  # type: ignore[arg-type]
    finally:
        await holder.close()
        worker.stop()
        await task
    assert len(inbox.messages) == 30


async def test_a_held_row_that_renewal_found_locked_is_kept_with_its_deadline(database_url: str) -> None:
    """A row another transaction held locked during renewal (reported busy) stays the worker's, with
    the deadline it had; only a row that is gone is revoked (never sent)."""
    from sendonce.delivery.worker import Held

    await campaign_setup(database_url, emails(3))
    async with await connect(database_url) as conn:
        await outbox.start_due_campaigns(conn)
        while isinstance(await outbox.build_next_chunk(conn, 100), outbox.BuildProgress):
            pass
        a, b, c = await outbox.claim_batch(conn, limit=3, lease_seconds=30, worker="w", transport_idempotent=False)
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(**FAST), composer=composer())
    held = [Held(d, lease_end=100.0) for d in (a, b, c)]
    worker._apply_renewal(held, outbox.Renewal(renewed={a.key: True}, busy={b.key: True}), lease_end=200.0)
    assert [(h.lease_end, h.revoked, h.release) for h in held] == [
        (200.0, False, False),
        (100.0, False, False),
        (100.0, True, False),
    ]
    assert worker.stats.lost_leases == 1
    # a busy row of a campaign paused meanwhile is given back like any other unstarted row
    worker._apply_renewal(held[1:2], outbox.Renewal(renewed={}, busy={b.key: False}), lease_end=300.0)
    assert (held[1].lease_end, held[1].revoked, held[1].release) == (100.0, False, True)


def _worker_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_read_only_database_is_retried_until_it_takes_writes_and_the_outage_shows_in_metrics(
    database_url: str, inbox: Inbox
) -> None:
    # A failover that leaves the worker on a server that takes no writes (a standby, a demoted
    # primary): reads work, every claim fails. The worker keeps trying (an outage ends), sends
    # nothing meanwhile, shows the outage at /metrics, and sends everything once writes come back.
    import httpx
    import psycopg
    from psycopg import sql

    from sendonce.delivery.metrics import serve_metrics

    await campaign_setup(database_url, emails(3))
    admin = psycopg.connect(database_url, autocommit=True)
    database = sql.Identifier(admin.info.dbname)
    admin.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database))
    worker = Worker(database_url, transport_from_url(inbox.url), WorkerConfig(**FAST), composer=composer())
    server, _ = serve_metrics(worker, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    task = asyncio.create_task(worker.run())
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            deadline = time.monotonic() + 30
            while True:
                metrics = _worker_metrics((await client.get(url)).text)
                claim_outage = metrics.get(("sendonce_worker_database_outage_seconds", (("operation", "claim"),)), 0)
                if metrics["sendonce_worker_database_failures_total", ()] >= 3 and claim_outage > 0:
                    break
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.05)
            assert not task.done()
            assert inbox.messages == []
            assert metrics["sendonce_worker_outcomes_total", (("outcome", "sent"),)] == 0

            admin.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))
            assert await asyncio.to_thread(inbox.wait_for, 3)
            deadline = time.monotonic() + 30
            while True:
                metrics = _worker_metrics((await client.get(url)).text)
                outages = {k: v for k, v in metrics.items() if k[0] == "sendonce_worker_database_outage_seconds"}
                if metrics["sendonce_worker_outcomes_total", (("outcome", "sent"),)] == 3 and not any(outages.values()):
                    break
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.05)
            assert ("sendonce_worker_database_outage_seconds", (("operation", "claim"),)) in outages
        assert sorted(inbox.by_recipient().values()) == [1, 1, 1]
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        server.shutdown()
        server.server_close()
        admin.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))
        admin.close()


async def test_a_workers_database_sessions_plan_by_index(database_url: str) -> None:
    # Every lane of a worker (claimer, recorders, housekeeper, builder) is a session whose cached plans
    # must not depend on the outbox's size when they were made (see
    # test_the_pipeline_keeps_finding_rows_by_key_as_the_outbox_grows): a lane opened without
    # stable_plans would plan as any session does.
    lane = _Lane(database_url)
    try:
        conn = await lane.get()
        cursor = await conn.execute(
            "SELECT current_setting('enable_seqscan') AS seq, current_setting('enable_hashjoin') AS hash,"
            " current_setting('enable_mergejoin') AS merge"
        )
        assert await cursor.fetchone() == {"seq": "off", "hash": "off", "merge": "off"}
    finally:
        await lane.reset()


async def test_the_recorder_plans_its_statement_once_not_for_every_group(database_url: str) -> None:
    # PostgreSQL planned record_sent afresh for every group (a custom plan fits the arrays given, so
    # the generic one never looked cheaper). The recorder's session keeps one plan. Without
    # plan_cache_mode = force_generic_plan there, every prepared run here was a custom plan.
    seen: list[list[dict[str, Any]]] = []  # the statement's plan counts after each group

    class Peeking(Worker):
        async def _record(self, conn: Conn, results: list[_Result]) -> bool:
            recorded = await super()._record(conn, results)
            cursor = await conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE '%transport_message_id = u.message_id%'"
                " AND statement NOT LIKE '%pg_prepared_statements%'"  # this query, prepared too
            )
            seen.append(await cursor.fetchall())
            return recorded

    await campaign_setup(database_url, emails(12))
    with Inbox() as inbox:
        # one connection, one recorder: over SMTP each message waits for the record of the one
        # before it, so every message is a group of its own (psycopg prepares at the sixth run)
        config = WorkerConfig(concurrency=1, recorders=1, drain=True, **FAST)
        stats = await asyncio.wait_for(
            Peeking(database_url, transport_from_url(inbox.url), config, composer=composer()).run(), 60
        )
        assert sum(inbox.by_recipient().values()) == 12
    assert stats.record_groups >= 7
    (plans,) = seen[-1]
    assert plans["custom_plans"] == 0 and plans["generic_plans"] > 0, plans


@pytest.mark.parametrize("database_default", ["off", "remote_apply"])
async def test_commits_are_durable_whatever_the_database_default_and_fast_records_change_only_the_recorders(
    database_url: str, database_default: str
) -> None:
    # A database's (or role's) synchronous_commit = off let a claim's commit return before its flush:
    # a crash of PostgreSQL then forgot the claim after the relay took the message, and the row went
    # out again as a fresh attempt with no ledger entry. Every sendonce session raises off to on and
    # keeps any other choice of the operator's; --fast-records turns it off for the recorders alone.
    name = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    async with await connect(database_url) as conn:
        await conn.execute(
            psycopg.sql.SQL("ALTER DATABASE {} SET synchronous_commit = {}").format(
                psycopg.sql.Identifier(str(name)), psycopg.sql.Literal(database_default)
            )
        )
    durable_setting = "on" if database_default == "off" else database_default

    async def setting(conn: Conn) -> str:
        cursor = await conn.execute("SELECT current_setting('synchronous_commit') AS s")
        row = await cursor.fetchone()
        assert row is not None
        return str(row["s"])

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True, row_factory=dict_row) as plain:
        assert await setting(plain) == database_default  # what a session gets without sendonce's setup
    seen: dict[str, str] = {}
    for durable in (True, False):
        worker = Worker(
            database_url,
            transport_from_url("smtp://127.0.0.1:9"),
            WorkerConfig(**FAST, durable_records=durable),
            composer=composer(),
        )
        for role, lane in (("claimer", _Lane(database_url)), ("recorder", worker._recorder_lane())):
            try:
                conn = await lane.get()
                seen[f"{role}, durable={durable}"] = await setting(conn)
                cursor = await conn.execute("SELECT current_setting('plan_cache_mode') AS s")
                plans = await cursor.fetchone()
                assert plans is not None
                assert role == "claimer" or plans["s"] == "force_generic_plan"
            finally:
                await lane.reset()
    pool = create_pool(database_url, min_size=1, max_size=1)  # the API's
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            seen["api pool"] = await setting(conn)
    finally:
        await pool.close()
    assert seen == {
        "claimer, durable=True": durable_setting,
        "recorder, durable=True": durable_setting,
        "claimer, durable=False": durable_setting,
        "recorder, durable=False": "off",
        "api pool": durable_setting,
    }


async def test_rows_claimed_before_the_connection_was_lost_are_given_back_not_left_to_their_lease(
    database_url: str,
) -> None:
    # The claim committed, then the claimer's connection died in the statements that follow it (here
    # the per-domain rate). Its rows are given back at once: left to their lease they would come back
    # as doubtful, and over SMTP each one's re-send would be written to the ledger as a possible
    # duplicate, though nothing had been sent.
    cut: list[int] = []

    class Cut(Worker):
        async def _domain_gate(self, conn: Conn, batch: list[Any]) -> list[Any]:
            if batch and not cut:
                cut.append(len(batch))
                async with await connect(database_url) as other:  # and wait until it is gone
                    await other.execute("SELECT pg_terminate_backend(%s, 10000)", [conn.info.backend_pid])
            return await super()._domain_gate(conn, batch)

    setup = await campaign_setup(database_url, emails(8))
    with Inbox() as inbox:
        config = WorkerConfig(drain=True, domain_rates={"example.test": Rate(1000, 1)}, **FAST)
        stats = await asyncio.wait_for(
            Cut(database_url, transport_from_url(inbox.url), config, composer=composer()).run(), 60
        )
        assert inbox.by_recipient() == Counter(dict.fromkeys(emails(8), 1))
    assert cut and stats.released == cut[0]
    async with await connect(database_url) as conn:
        ledger = await campaigns.list_possible_duplicates(conn, setup.account_id)
    assert ledger == []  # left to their lease, every row of that claim would be here


async def test_a_lane_whose_setup_fails_leaves_no_connection_open(database_url: str) -> None:
    lane = _Lane(database_url, setup="SET plan_cache_mode = 'no such mode' /* lane-setup-probe */")
    with pytest.raises(Exception, match="plan_cache_mode"):
        await lane.get()
    async with await connect(database_url) as conn:
        for _ in range(100):  # a closed session's server process ends a moment later
            cursor = await conn.execute(
                "SELECT count(*) AS n FROM pg_stat_activity"
                " WHERE query LIKE '%%lane-setup-probe */' AND pid <> pg_backend_pid()"
            )
            left = await cursor.fetchone()
            if left == {"n": 0}:
                break
            await asyncio.sleep(0.02)
        assert left == {"n": 0}


async def test_a_death_note_tells_a_row_given_back_from_one_sent_and_unrecorded(database_url: str) -> None:
    """What a worker would write in its death note while two outcomes wait to be recorded: a row the
    server refused for now (451: back to the queue, unsent) is marked given back, and a row the server
    accepted is not. The chaos suite credits a copy that arrives within the victim's lease to the
    victim only for the second kind: the first may be claimed and sent by another worker as soon as
    its retry is recorded."""
    addresses = emails(2)
    refused, accepted = addresses
    setup = await campaign_setup(database_url, addresses)
    await _prebuild(database_url)  # both rows queued: one claim takes them
    lock: list[psycopg.Connection[Any]] = []
    looked = threading.Event()  # set once the worker has been looked at: no lock after that

    def reject(address: str) -> str | None:
        if not lock and not looked.is_set():
            # The rows are claimed (a send follows the claim's commit): lock them, so that the
            # records wait and both outcomes stay pending while the worker is looked at.
            conn = psycopg.connect(database_url)
            conn.execute("SELECT 1 FROM sendonce.deliveries WHERE campaign_id = %s FOR UPDATE", (setup.campaign_id,))
            lock.append(conn)
        return "451 4.7.1 greylisted, try again" if address == refused else None

    config = WorkerConfig(concurrency=1, batch_size=2, **FAST)
    with Inbox(faults=InboxFaults(reject=reject)) as inbox:
        async with running_worker(database_url, transport_from_url(inbox.url), config) as worker:
            try:
                deadline = time.monotonic() + 30
                while not (len(worker._held) == 2 and all(held.done for held in worker._held.values())):
                    assert time.monotonic() < deadline, "the two outcomes never came"
                    await asyncio.sleep(0.01)
                seen = {"at": time.time(), **worker._witness()}
                note = death_note(f"{DEATH_NOTE}after_accept {json.dumps(seen)}\n")
                arrivals = SmtpSink.arrivals_of(inbox, "main")
            finally:
                looked.set()
                for conn in lock:
                    conn.rollback()  # the records go through before the worker is stopped
                    conn.close()
    assert note is not None and note[1] is not None
    witness = note[1]
    rows = {row.job: row for row in witness.held}
    assert len(rows) == 2
    [arrival] = arrivals
    assert arrival.recipient == accepted
    sent_row = rows[arrival.job_id]
    [back_row] = [row for job, row in rows.items() if job != arrival.job_id]
    assert not sent_row.given_back and within_victims_lease(witness, sent_row, arrival)
    assert back_row.given_back
    # a copy of the refused row arriving at once, from whoever claims it next, is not the victim's
    later = dataclasses.replace(arrival, job_id=back_row.job, recipient=refused, at=back_row.claimed + 0.5)
    assert not within_victims_lease(witness, back_row, later)


async def test_a_listener_whose_connection_went_silent_connects_again(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A connection whose packets are dropped (a partition, a NAT that forgot it) never errors: the
    # listener waited on it for ever, and new work waited for the next tick. Silent for a while, it
    # now asks the connection whether it still answers, and connects again when it does not.
    monkeypatch.setattr(worker_module, "_LISTENER_CHECK_EVERY", 0.3, raising=False)
    with TcpProxy(**proxy_target(database_url)) as proxy:  # type: ignore[arg-type]
        config = WorkerConfig(db_timeout=1.0, **FAST)
        url = through_proxy(database_url, proxy.port)
        worker = Worker(url, transport_from_url("smtp://127.0.0.1:9"), config, composer=composer())
        listener = asyncio.create_task(worker._listener())
        try:
            async with asyncio.timeout(30):
                while proxy.connections < 1 or not worker._wake.is_set():  # listening
                    await asyncio.sleep(0.05)
                proxy.pause()  # nothing flows, nothing is closed
                while proxy.connections < 2:  # a new connection (itself silent while paused)
                    await asyncio.sleep(0.05)
        finally:
            proxy.heal()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener


def test_a_lease_that_cuts_the_transports_timeout_is_named_at_start(caplog: pytest.LogCaptureFixture) -> None:
    # a send must end before its lease does: with --lease 1 every send had about 0.6 s, whatever
    # ?timeout= said, and a relay answering in a second was given up on (and, over SMTP, sent again)
    transport = transport_from_url("smtp://127.0.0.1:2525?timeout=30")
    with caplog.at_level(logging.WARNING, logger="sendonce"):
        Worker("postgresql://unused", transport, WorkerConfig(lease=1), composer=composer())._warn_of_short_sends()
        Worker("postgresql://unused", transport, WorkerConfig(lease=30), composer=composer())._warn_of_short_sends()
        short = transport_from_url("smtp://127.0.0.1:2525?timeout=1")
        Worker("postgresql://unused", short, WorkerConfig(lease=2), composer=composer())._warn_of_short_sends()
    [warning] = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "short_sends"]
    assert "a 1s lease cuts each send to about 0.6s" in warning and "--lease 49 or more" in warning, warning


async def test_a_bounce_recorded_during_a_campaign_check_is_checked_again(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two recorders share the campaigns to check: one's bounce, committed while the other's check of
    # that campaign was reading, was forgotten when the check ended (its count could not include it)
    setup = await campaign_setup(database_url, emails(1))
    key = (setup.account_id, setup.campaign_id)
    worker = Worker(database_url, transport_from_url("smtp://127.0.0.1:9"), WorkerConfig(**FAST), composer=composer())
    checking = asyncio.Event()

    async def check(*args: object) -> None:
        checking.set()
        await asyncio.sleep(0.1)

    monkeypatch.setattr(worker_module.feedback, "check_campaign", check)

    async def another_recorders_bounce() -> None:
        await checking.wait()
        worker._dirty_campaigns.add(key)  # what _record does for a hard bounce it committed

    worker._dirty_campaigns.add(key)
    async with await connect(database_url) as conn:
        await asyncio.gather(worker._check_campaigns(conn), another_recorders_bounce())
    assert worker._dirty_campaigns == {key}  # to be checked again

    async def fails(*args: object) -> None:
        raise psycopg.OperationalError("lost")

    monkeypatch.setattr(worker_module.feedback, "check_campaign", fails)
    async with await connect(database_url) as conn:
        with pytest.raises(psycopg.OperationalError):
            await worker._check_campaigns(conn, force=True)
    assert worker._dirty_campaigns == {key}  # a check that failed is made again
