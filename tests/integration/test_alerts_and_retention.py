"""Retry-abuse alerts through the API (stored once, posted to a webhook) and outbox retention."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from sendonce.delivery.worker import WorkerConfig
from sendonce.store import outbox
from sendonce.store.database import connect
from sendonce.testing.inbox import Inbox
from sendonce.transports.registry import transport_from_url
from tests.conftest import ApiServer
from tests.helpers import campaign_setup, emails, run_to_drain

ADMIN = {"Authorization": "Bearer test-admin-token"}


class Hook:
    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                hook.posts.append(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.close()


def _account(c: httpx.Client) -> dict[str, str]:
    key = c.post("/v1/accounts", json={"name": "a", "from_email": "a@acme.test"}, headers=ADMIN).json()["api_key"]
    return {"Authorization": f"Bearer {key}"}


def test_a_replay_burst_raises_exactly_one_alert_and_normal_traffic_none(database_url: str, hook: Hook) -> None:
    import time

    with (
        ApiServer(
            database_url, secret="x" * 32, alert_webhook_url=hook.url, abuse_min_repeats=15, abuse_window="1h"
        ) as api,
        httpx.Client(base_url=api.url, timeout=30) as c,
    ):
        auth = _account(c)
        # normal traffic: distinct people signing up, the odd retry
        for i in range(30):
            c.post("/v1/signups", json={"email": f"user{i}@example.test", "origin": "web"}, headers=auth)
            if i % 10 == 0:
                c.post("/v1/signups", json={"email": f"user{i}@example.test", "origin": "web"}, headers=auth)
        assert c.get("/v1/alerts", headers=auth).json()["items"] == []
        # a client stuck in a retry loop
        for _ in range(60):
            c.post("/v1/signups", json={"email": "loop@example.test", "origin": "app"}, headers=auth)
        alerts = c.get("/v1/alerts", headers=auth).json()["items"]
        assert [(a["kind"], a["subject"]) for a in alerts] == [("replay_burst", "client:127.0.0.1")]
        assert alerts[0]["detail"]["repeats_in_window"] >= 15
        deadline = time.monotonic() + 10
        while not hook.posts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(hook.posts) == 1
        assert hook.posts[0]["subject"] == "client:127.0.0.1"
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.alerts").fetchone() == (1,)


def test_an_alert_that_cannot_be_stored_leaves_the_committed_answer_standing(database_url: str, hook: Hook) -> None:
    import time

    # The alert is stored after the signup committed. A connection lost at that moment (here: the
    # alert's insert ends its own session) must not turn the answer into a 503 "nothing was
    # written": the repeat was answered from its window, and says so.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION sendonce.test_end_session() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER end_session BEFORE INSERT ON sendonce.alerts"
            " FOR EACH ROW EXECUTE FUNCTION sendonce.test_end_session()"
        )
    with (
        # one bucket for the whole test, so where the clock's bucket boundary falls cannot split the burst
        ApiServer(
            database_url, secret="x" * 32, abuse_min_repeats=15, abuse_window="1h", alert_webhook_url=hook.url
        ) as api,
        httpx.Client(base_url=api.url, timeout=30) as c,
    ):
        auth = _account(c)
        statuses = [
            c.post("/v1/signups", json={"email": "loop@example.test", "origin": "app"}, headers=auth).status_code
            for _ in range(40)
        ]
        assert statuses == [201] + [200] * 39
        metrics = c.get("/metrics").text
        assert 'sendonce_alerts_unrecorded_total{kind="replay_burst"} 1.0' in metrics
        deadline = time.monotonic() + 10
        while not hook.posts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(p["kind"], p["subject"], p["stored"], p["id"]) for p in hook.posts] == [
            ("replay_burst", "client:127.0.0.1", False, None)
        ]
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.alerts").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (1,)


async def test_prune_archives_and_deletes_only_finished_old_rows(database_url: str, tmp_path: Path) -> None:
    finished = await campaign_setup(database_url, emails(5))
    with Inbox() as inbox:
        await run_to_drain(database_url, transport_from_url(inbox.url), WorkerConfig(tick=0.2, lease=5, drain=True))
    await campaign_setup(database_url, emails(3, "other.test"))
    async with await connect(database_url) as aconn:  # a campaign still running: built, partly sent
        await outbox.start_due_campaigns(aconn)
        while isinstance(await outbox.build_next_chunk(aconn, 100), outbox.BuildProgress):
            pass
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE sendonce.deliveries SET status = 'sent' WHERE email = 'user000000@other.test'")
        conn.execute("UPDATE sendonce.deliveries SET updated_at = now() - interval '100 days'")
        # one finished row was sent twice, maybe: its ledger entry goes to the archive with it
        conn.execute(
            "INSERT INTO sendonce.possible_duplicates (account_id, delivery_id, attempt, job_id, campaign_id, reason) "
            "SELECT account_id, delivery_id, 2, job_id, campaign_id, 'lease expired after the send began' "
            "FROM sendonce.deliveries WHERE email = %s",
            (emails(5)[0],),
        )
        conn.execute("UPDATE sendonce.deliveries SET uncertain = true WHERE email = %s", (emails(5)[0],))
    archive = tmp_path / "archive.jsonl"
    env = {**os.environ, "SENDONCE_DATABASE_URL": database_url}
    dry = subprocess.run(
        [sys.executable, "-m", "sendonce.cli", "outbox", "prune", "--older-than", "90d", "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "would remove at least 5 rows" in dry.stderr
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (8,)
    done = subprocess.run(
        [sys.executable, "-m", "sendonce.cli", "outbox", "prune", "--older-than", "90d", "--archive", str(archive)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "removed 5 outbox rows" in done.stderr
    rows = [json.loads(line) for line in archive.read_text().splitlines()]
    assert sorted(r["email"] for r in rows) == emails(5)
    assert {r["status"] for r in rows} == {"sent"}
    twice = next(r for r in rows if r["email"] == emails(5)[0])
    assert twice["uncertain"] is True and twice["ledger_entries"] == 1
    assert [(e["attempt"], e["reason"]) for e in twice["ledger"]] == [(2, "lease expired after the send began")]
    assert all(r["ledger"] == [] and r["uncertain"] is False for r in rows if r is not twice)
    # when each ended, and what it was tied to, go with it
    assert all({"updated_at", "uncertain_since", "feedback", "feedback_at", "operation_key"} <= set(r) for r in rows)
    assert all(r["updated_at"] for r in rows)
    with psycopg.connect(database_url) as conn:
        # the running campaign's rows, sent or not, are all still there
        assert conn.execute("SELECT count(*) FROM sendonce.deliveries").fetchone() == (3,)
        assert conn.execute(
            "SELECT status FROM sendonce.campaigns WHERE campaign_id = %s", (finished.campaign_id,)
        ).fetchone() == ("sent",)

    def prune(age: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "sendonce.cli", "outbox", "prune", "--older-than", age]
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)

    bad = prune("soon")
    assert bad.returncode == 2 and "--older-than" in bad.stderr
    # a report that comes for a row removed already suppresses nobody: a day at least is kept
    hasty = prune("0s")
    assert hasty.returncode == 2 and "under a day" in hasty.stderr, hasty.stderr
