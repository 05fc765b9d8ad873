"""``sendonce demo``: a campaign on the embedded default, a worker killed mid-send, the inbox counted.

Everything is real: the embedded PostgreSQL (or the server of SENDONCE_DATABASE_URL), an aiosmtpd
inbox on loopback, and ``sendonce worker`` subprocesses. The verdict is counted from the inbox,
not from sendonce's own tables.

The demo uses its own database (``sendonce_demo``, recreated on each run) on that server.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sendonce.domain.addresses import parse_address
from sendonce.domain.states import SuppressionReason
from sendonce.errors import ConfigurationError
from sendonce.runtime import feedback_policy, keyring, send_rates
from sendonce.settings import Settings
from sendonce.store import accounts, campaigns, lists, subscribers, suppressions
from sendonce.store.database import connect
from sendonce.store.embedded import EmbeddedPostgres, embedded_for_home
from sendonce.store.migrations import upgrade
from sendonce.testing.inbox import Inbox

DEMO_DATABASE = "sendonce_demo"
TIME_LIMIT = 55.0


@dataclass
class Plan:
    list_a: list[str]
    list_b: list[str]
    case_variants: int
    unique: int


def plan_subscribers(total: int) -> Plan:
    """Two overlapping lists whose union is ``total`` addresses; some overlap differs only by case."""
    addresses = [f"reader{i:05d}@example.test" for i in range(total)]
    split_a = int(total * 0.7)
    start_b = int(total * 0.3)
    list_a = addresses[:split_a]
    list_b = addresses[start_b:]
    variants = min(50, split_a - start_b)
    for offset in range(variants):
        # the same person, typed differently: one subscriber, one message
        local, _, domain = list_b[offset].partition("@")
        list_b[offset] = f"{local.capitalize()}@{domain.upper()}"
    return Plan(list_a, list_b, variants, total)


# Held (a session's advisory lock, on the server's maintenance database) for the whole demo. Two demos
# on one server at once dropped each other's database, sent each other's campaign, and the one that
# had started the embedded server stopped it under the other (a review found it).
_DEMO_LOCK = 0x53454E444F4E4345  # "SENDONCE"


def _demo_database(settings: Settings) -> tuple[str, EmbeddedPostgres | None, psycopg.Connection[Any]]:
    """The demo's scratch database; the embedded server if the demo started it (to stop it after); and
    the connection that holds the demo's lock (closed at the end)."""
    started: EmbeddedPostgres | None = None
    if settings.database_url:
        base = settings.database_url
    else:
        server = embedded_for_home(settings.home)
        if not server.running():
            started = server
        server.start()
        base = server.admin_url()
    # on the maintenance database whatever the URL names: an advisory lock is per database, and two
    # demos given two databases of one server share the one demo database all the same
    lock = psycopg.connect(make_conninfo(base, dbname="postgres"), autocommit=True, options="-c idle_session_timeout=0")
    try:
        row = lock.execute("SELECT pg_try_advisory_lock(%s)", (_DEMO_LOCK,)).fetchone()
        if not (row and row[0]):
            raise ConfigurationError("another sendonce demo is running on this PostgreSQL server; run one at a time")
        lock.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DEMO_DATABASE)))
        lock.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DATABASE)))
    except BaseException:
        lock.close()
        raise
    return make_conninfo(base, dbname=DEMO_DATABASE), started, lock


async def _setup(url: str, plan: Plan) -> tuple[int, int]:
    async with await connect(url) as conn:
        account, _key = await accounts.create_account(
            conn, name="Demo Gazette", from_email="gazette@sender.test", from_name="The Demo Gazette"
        )
        aid = account.account_id
        list_a = await lists.create_list(conn, aid, "weekly")
        list_b = await lists.create_list(conn, aid, "announcements")
        for emails, list_id in ((plan.list_a, list_a), (plan.list_b, list_b)):
            rows = [subscribers.SubscriberInput(parse_address(e), None, None, [list_id]) for e in emails]
            for start in range(0, len(rows), 5000):
                await subscribers.upsert_subscribers(conn, aid, rows[start : start + 5000])
        campaign_id = await campaigns.create_campaign(
            conn,
            account_id=aid,
            name="Demo issue #1",
            subject="The Demo Gazette, issue #1",
            text_body="Hello {{ email }},\n\nThis message should reach you exactly once.\n",
            html_body="<p>Hello {{ email }},</p><p>This message should reach you <b>exactly once</b>.</p>",
            from_email=account.from_email,
            from_name=account.from_name,
            list_ids=[list_a, list_b],
        )
        result = await campaigns.transition(conn, aid, campaign_id, "approve")
        assert result.won
    return aid, campaign_id


async def _opt_out(url: str, account_id: int, campaign_id: int) -> str | None:
    """Suppress one recipient whose delivery is still queued, holding its row so no claim takes it first."""
    async with await connect(url) as conn, conn.transaction():
        cursor = await conn.execute(
            "SELECT email FROM sendonce.deliveries WHERE account_id = %s AND campaign_id = %s AND status = 'queued' "
            "ORDER BY delivery_id DESC LIMIT 1 FOR UPDATE SKIP LOCKED",
            (account_id, campaign_id),
        )
        row = await cursor.fetchone()
        if row is None:
            return None
        email = str(row["email"])
        await suppressions.add_suppression(conn, account_id, parse_address(email), SuppressionReason.UNSUBSCRIBE)
    return email


async def _status(url: str, account_id: int, campaign_id: int) -> tuple[str, campaigns.CampaignCounts]:
    async with await connect(url) as conn:
        campaign = await campaigns.get_campaign(conn, account_id, campaign_id)
        assert campaign is not None
        return campaign.status.value, await campaigns.campaign_counts(conn, account_id, campaign_id)


async def _ledger(url: str, account_id: int, campaign_id: int) -> set[str]:
    async with await connect(url) as conn:
        rows = await campaigns.list_possible_duplicates(conn, account_id, campaign_id, limit=100_000)
    return {str(r["job_id"]) for r in rows}


def check_worker_settings(settings: Settings, url: str | None = None) -> None:
    """Raise ``ConfigurationError`` for a setting the demo's workers would die of at start (they read
    the same environment): the rates and feedback limits; with ``url``, the demo's database the workers
    are pointed at, the secret too (without SENDONCE_SECRET they share the one kept in that database)."""
    send_rates(settings)
    feedback_policy(settings)
    if url is not None:
        keyring(settings.model_copy(update={"database_url": url}))


def _spawn_worker(url: str, transport_url: str, concurrency: int, log: Path) -> subprocess.Popen[bytes]:
    """A ``sendonce worker`` process; its stderr goes to ``log``, to be shown if it dies."""
    env = {
        **os.environ,
        "SENDONCE_DATABASE_URL": url,
        "SENDONCE_TRANSPORT_URL": transport_url,
    }
    with log.open("wb") as stderr:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sendonce.cli",
                "--log-level",
                "warning",
                "worker",
                "--concurrency",
                str(concurrency),
                "--batch-size",
                "20",
                "--lease",
                "4",
                "--tick",
                "1",
                "--no-upgrade",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text("utf-8", errors="replace").splitlines()[-lines:])


def run_demo(
    settings: Settings, *, subscribers: int = 10_000, workers: int = 3, console: Console | None = None
) -> bool:
    console = console or Console()
    started = time.monotonic()
    check_worker_settings(settings)  # before anything is created
    logs = settings.home / "demo"
    logs.mkdir(parents=True, exist_ok=True)
    where = (
        "the server of SENDONCE_DATABASE_URL"
        if settings.database_url
        else f"embedded PostgreSQL in {settings.home}/pgdata"
    )
    console.print(f"[bold]sendonce demo[/bold]: {where}, database {DEMO_DATABASE!r}")
    url, started_server, lock = _demo_database(settings)
    try:
        check_worker_settings(settings, url)
        return _run(console, url, subscribers, workers, started, logs)
    finally:
        lock.close()
        if started_server is not None:
            started_server.stop()


def _run(console: Console, url: str, subscribers: int, workers: int, started: float, logs: Path) -> bool:
    upgrade(url)
    plan = plan_subscribers(subscribers)
    with Inbox() as inbox:
        console.print(f"• SMTP inbox (aiosmtpd) on {inbox.host}:{inbox.port}")
        account_id, campaign_id = asyncio.run(_setup(url, plan))
        console.print(
            f"• {plan.unique:,} subscribers in two overlapping lists ({len(plan.list_a):,} + {len(plan.list_b):,}; "
            f"{plan.case_variants} addresses typed in another case), campaign {campaign_id} approved"
        )
        log_files = [logs / f"worker-{n}.log" for n in range(workers)]
        procs = [_spawn_worker(url, inbox.url, 4, log) for log in log_files]
        console.print(f"• {workers} worker processes started (pids {', '.join(str(p.pid) for p in procs)})")
        killed_at = None
        opted_out: str | None = None
        rng = random.Random()
        kill_threshold = int(plan.unique * rng.uniform(0.25, 0.4))
        opt_out_threshold = int(plan.unique * 0.5)
        final_status = "sending"
        counts = None
        died: str | None = None
        try:
            with Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("inbox {task.fields[inbox]:,}"),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as progress:
                task = progress.add_task("sending", total=plan.unique, inbox=0)
                while time.monotonic() - started < TIME_LIMIT:
                    # A worker exits only when stopped: one that exited by itself died of an error.
                    for proc, log in zip(procs, log_files, strict=True):
                        if proc.poll() is not None:
                            died = f"worker pid {proc.pid} exited with code {proc.returncode} (log: {log})"
                            progress.console.print(f"[red]✖ {died}[/red]")
                            progress.console.print(_tail(log), markup=False, highlight=False, soft_wrap=True)
                            break
                    if died is not None:
                        break
                    final_status, counts = asyncio.run(_status(url, account_id, campaign_id))
                    done = counts.sent + counts.suppressed + counts.failed
                    progress.update(task, completed=done, total=max(counts.total, 1), inbox=len(inbox.messages))
                    if killed_at is None and counts.sent >= kill_threshold:
                        victim = procs[0]
                        os.kill(victim.pid, signal.SIGKILL)
                        victim.wait()
                        killed_at = counts.sent
                        progress.console.print(
                            f"[red]✖ worker pid {victim.pid} killed with SIGKILL[/red] "
                            f"at {killed_at:,} sent; restarting it"
                        )
                        procs[0] = _spawn_worker(url, inbox.url, 4, log_files[0])
                    if opted_out is None and counts.sent >= opt_out_threshold:
                        opted_out = asyncio.run(_opt_out(url, account_id, campaign_id))
                        progress.console.print(f"[yellow]• opt-out mid-send:[/yellow] {opted_out} unsubscribed")
                    if final_status == "sent":
                        break
                    time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        ledger = asyncio.run(_ledger(url, account_id, campaign_id))
        final_status, counts = asyncio.run(_status(url, account_id, campaign_id))
        received = inbox.messages
    if died is not None:
        console.print(f"[red bold]✘ stopped: {died}[/red bold]")
        return False
    return _report(
        console,
        plan,
        received,
        opted_out,
        ledger,
        final_status,
        counts,
        time.monotonic() - started,
        killed_at,
    )


def _report(
    console: Console,
    plan: Plan,
    received: list,  # type: ignore[type-arg]
    opted_out: str | None,
    ledger: set[str],
    status: str,
    counts: campaigns.CampaignCounts,
    elapsed: float,
    killed_at: int | None,
) -> bool:
    intended = {parse_address(e).key for e in plan.list_a + plan.list_b}
    opted_key = parse_address(opted_out).key if opted_out else None
    expected = intended - {opted_key}
    per_address: Counter[str] = Counter()
    jobs_of: dict[str, set[str | None]] = defaultdict(set)
    per_job: Counter[str | None] = Counter()
    for message in received:
        for rcpt in message.rcpt_to:
            key = parse_address(rcpt).key
            per_address[key] += 1
            jobs_of[key].add(message.job_id)
        per_job[message.job_id] += 1
    missing = expected - set(per_address)
    strangers = set(per_address) - intended
    once = sum(1 for key in expected if per_address[key] == 1)
    duplicates = sum(n - 1 for n in per_address.values() if n > 1)
    # Every extra copy an address got must be a re-send of its one job, in the ledger: two jobs for one
    # person (the list's two spellings of an address, say) is a duplicate nothing records.
    duplicate_jobs = {job for job, n in per_job.items() if n > 1}
    unrecorded = {job for job in duplicate_jobs if job not in ledger} | {
        f"{key}: {len(jobs)} jobs" for key, jobs in jobs_of.items() if per_address[key] > 1 and len(jobs) > 1
    }
    opted_received = per_address[opted_key] if opted_key else 0

    table = Table(title="what the inbox received", show_header=False)
    table.add_row("messages in the inbox", f"{len(received):,}")
    table.add_row("intended recipients (distinct addresses)", f"{len(expected):,}")
    table.add_row("received exactly once", f"{once:,}")
    table.add_row("missing", f"{len(missing):,}")
    table.add_row("received by anyone not on the lists", f"{len(strangers):,}")
    table.add_row("opted-out address received it", "no" if opted_received == 0 else f"YES ({opted_received})")
    table.add_row("duplicate copies", f"{duplicates:,}")
    table.add_row("  of which not re-sends in the possible_duplicate ledger", f"{len(unrecorded):,}")
    table.add_row(
        "campaign status / counts",
        f"{status}: sent {counts.sent:,}, suppressed {counts.suppressed:,}, failed {counts.failed:,}",
    )
    table.add_row("worker killed (SIGKILL) at", f"{killed_at:,} sent" if killed_at is not None else "not reached")
    table.add_row("elapsed", f"{elapsed:.1f}s")
    console.print(table)
    ok = not missing and not strangers and opted_received == 0 and not unrecorded and status == "sent"
    if ok and duplicates == 0:
        console.print("[green bold]✔ every address exactly once; the opted-out address not at all.[/green bold]")
    elif ok:
        console.print(
            f"[green bold]✔ every address received it; the opted-out address not at all.[/green bold] "
            f"{duplicates} duplicate cop{'y' if duplicates == 1 else 'ies'}: the message(s) in flight on the killed "
            "worker's SMTP connections, re-sent and recorded in the ledger (plain SMTP has no idempotency key; "
            "with an idempotent transport such as the Resend API there are none)."
        )
    else:
        console.print("[red bold]✘ the guarantee did not hold: see the table above.[/red bold]")
    return ok
