"""Real ``sendonce worker`` processes, killed with SIGKILL at random moments, several times per run.

The verdict comes from what the inbox (SMTP) or the provider (Resend-compatible HTTP) received.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from sendonce.chaos.harness import by_victims_connection, within_victims_lease
from sendonce.chaos.processes import death_note
from sendonce.chaos.sinks import SmtpSink
from sendonce.store import campaigns
from sendonce.store.database import connect
from sendonce.testing.inbox import Inbox
from sendonce.testing.resend_server import ResendServer
from tests.helpers import campaign_setup, campaign_status, emails

LEASE = 2.0


def spawn_worker(
    url: str,
    transport_url: str,
    *,
    drain: bool = False,
    faults: str | None = None,
    log: IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SENDONCE_DATABASE_URL": url, "SENDONCE_TRANSPORT_URL": transport_url}
    env.pop("SENDONCE_FAULTS", None)
    if faults:
        env["SENDONCE_FAULTS"] = faults
    args = [
        sys.executable,
        "-m",
        "sendonce.cli",
        "--log-level",
        "warning",
        "worker",
        "--no-upgrade",
        "--concurrency",
        "4",
        "--batch-size",
        "10",
        "--lease",
        str(LEASE),
        "--tick",
        "0.5",
    ]
    if drain:
        args.append("--drain")
    return subprocess.Popen(
        args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log or subprocess.DEVNULL
    )


@dataclass
class Chaos:
    url: str
    transport_url: str
    log: IO[bytes]
    workers: int = 3
    kills: int = 0
    self_kills: int = 0
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, faults: str | None) -> None:
        self.faults = faults
        self.procs = [
            spawn_worker(self.url, self.transport_url, faults=faults, log=self.log) for _ in range(self.workers)
        ]

    def kill_randomly(self, times: int, progress: callable, total: int) -> None:  # type: ignore[valid-type]
        """SIGKILL a random worker ``times`` times while the campaign is under way, restarting it."""
        rng = random.Random()
        deadline = time.monotonic() + 90
        while self.kills < times and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.15, 0.5))
            self._restart_dead()
            if progress() >= total * 0.95:
                break
            victim = rng.randrange(len(self.procs))
            self.procs[victim].send_signal(signal.SIGKILL)
            self.procs[victim].wait()
            self.kills += 1
            self.procs[victim] = spawn_worker(self.url, self.transport_url, faults=self.faults, log=self.log)

    def _restart_dead(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                assert proc.returncode == -signal.SIGKILL, f"worker exited with {proc.returncode}: see {self.log.name}"
                self.self_kills += 1
                self.procs[i] = spawn_worker(self.url, self.transport_url, faults=self.faults, log=self.log)

    def finish(self) -> None:
        """Stop the chaos; a clean worker drains what is left; then stop everyone gracefully."""
        self._restart_dead()
        drain = spawn_worker(self.url, self.transport_url, drain=True, log=self.log)
        try:
            drain.wait(timeout=120)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self.procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        assert drain.returncode == 0, f"the draining worker failed: see {self.log.name}"

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


@pytest.fixture
def chaos_cleanup() -> Iterator[list[Chaos]]:
    created: list[Chaos] = []
    yield created
    for chaos in created:
        chaos.stop_all()
        chaos.log.close()


async def _ledger(url: str, account_id: int) -> set[str]:
    async with await connect(url) as conn:
        return {str(r["job_id"]) for r in await campaigns.list_possible_duplicates(conn, account_id, limit=100_000)}


@pytest.mark.timeout(300)
async def test_sigkill_with_an_idempotent_transport_no_duplicate_no_loss(
    database_url: str, chaos_cleanup: list[Chaos], tmp_path: Path
) -> None:
    addresses = emails(1500)
    setup = await campaign_setup(database_url, addresses)
    with ResendServer() as server:
        chaos = Chaos(database_url, server.url, (tmp_path / "workers.log").open("ab"))
        chaos_cleanup.append(chaos)
        # also die exactly between "the provider accepted" and "recorded", now and then
        chaos.start(faults="after_accept=0.003")
        await asyncio.to_thread(chaos.kill_randomly, 6, lambda: len(server.accepted), len(addresses))
        await asyncio.to_thread(chaos.finish)
        by_recipient = server.by_recipient()
    assert chaos.kills + chaos.self_kills >= 3
    assert set(by_recipient) == set(addresses), "lost recipients"
    assert [a for a, n in by_recipient.items() if n > 1] == [], "duplicates through an idempotent transport"
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert status == "sent"
    assert (counts.sent, counts.total, counts.possible_duplicate) == (1500, 1500, 0)


@pytest.mark.timeout(300)
async def test_sigkill_with_smtp_no_loss_and_every_duplicate_is_in_the_ledger(
    database_url: str, chaos_cleanup: list[Chaos], tmp_path: Path
) -> None:
    addresses = emails(1500)
    setup = await campaign_setup(database_url, addresses)
    with Inbox() as inbox:
        chaos = Chaos(database_url, inbox.url, (tmp_path / "workers.log").open("ab"))
        chaos_cleanup.append(chaos)
        chaos.start(faults="after_accept=0.003")
        await asyncio.to_thread(chaos.kill_randomly, 6, lambda: len(inbox.messages), len(addresses))
        await asyncio.to_thread(chaos.finish)
        by_recipient = inbox.by_recipient()
        by_job = inbox.by_job()
    assert chaos.kills + chaos.self_kills >= 3
    assert set(by_recipient) == set(addresses), "lost recipients"
    duplicated = {job for job, n in by_job.items() if n > 1}
    ledger = await _ledger(database_url, setup.account_id)
    if chaos.self_kills:  # a death between accepted and recorded: that message is always sent again
        assert duplicated, "a worker died after its message was accepted, and nothing was sent twice"
    assert duplicated <= ledger, f"duplicates missing from the ledger: {sorted(duplicated - ledger)}"
    # at most the message in flight on each connection of each killed worker
    assert sum(n - 1 for n in by_job.values()) <= (chaos.kills + chaos.self_kills) * 4
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert status == "sent"
    assert counts.sent == counts.total == 1500
    assert counts.possible_duplicate == len(ledger) >= len(duplicated)


@pytest.mark.timeout(180)
def test_the_demo_runs_on_the_embedded_default(tmp_path: Path, pg_admin_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SENDONCE_")}
    env["SENDONCE_HOME"] = str(tmp_path / "home")
    if os.environ.get("SENDONCE_TEST_DATABASE_URL"):
        env["SENDONCE_DATABASE_URL"] = pg_admin_url
    result = subprocess.run(
        [sys.executable, "-m", "sendonce.cli", "demo", "--subscribers", "600", "--workers", "2"],
        env=env,
        capture_output=True,
        timeout=170,
        check=False,
    )
    output = result.stdout.decode()
    assert result.returncode == 0, output + result.stderr.decode()
    assert "every address" in output
    assert "the opted-out address not at all" in output


@pytest.mark.timeout(120)
async def test_a_death_note_names_the_connection_its_last_message_came_by(database_url: str, tmp_path: Path) -> None:
    """The chaos suite tells a dead worker's copies in the inbox by the connections its death note
    names, and by the leases it lists: both must match what the inbox saw, from a real worker."""
    addresses = emails(20)
    await campaign_setup(database_url, addresses)
    log_path = tmp_path / "worker.log"
    with Inbox() as inbox, log_path.open("wb") as log:
        proc = spawn_worker(database_url, inbox.url, faults="after_accept=1", log=log)
        try:
            assert proc.wait(timeout=90) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
        note = death_note(log_path.read_text())
        messages = inbox.messages
        arrivals = SmtpSink.arrivals_of(inbox, "main")
    assert note is not None and note[0] == "after_accept"
    witness = note[1]
    assert witness is not None and witness.held and witness.connections
    # it died at its first accepted message (other lanes' may have arrived meanwhile, one each)
    assert 1 <= len(messages) <= 4 and len(arrivals) == len(messages)
    connections = {(local, server) for local, server, _ in witness.connections}
    for arrival in arrivals:
        [row] = [row for row in witness.held if row.job == arrival.job_id]
        assert not row.given_back and row.until is not None and row.claimed <= arrival.at <= row.until
        assert (arrival.peer_port, arrival.server_port) in connections and arrival.server_port is not None
        assert by_victims_connection(witness, row, arrival)
        assert within_victims_lease(witness, row, arrival)
