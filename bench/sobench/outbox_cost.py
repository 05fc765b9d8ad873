"""One version of ``bench/outbox_cost.py``: sendonce's own claim and record, serially.

``python -m sobench.outbox_cost URL RECIPIENTS CLAIM RECORD [lean]``, with the sendonce to measure
first on ``PYTHONPATH``. It applies that sendonce's migrations to URL's database, adds one account,
one list of RECIPIENTS confirmed subscribers (bulk SQL) and one campaign, approves and starts it, builds its
recipient list with sendonce's builder (in a worker's chunks) and vacuums. It prints one JSON line (the
build's backend CPU), then, for each line ``go N`` on stdin, claims batches of CLAIM with sendonce's
``claim_batch`` on one connection and records each batch's rows as sent in groups of RECORD with
``record_sent`` on another, until N rows are recorded or none is left, and prints one JSON line: the
CPU seconds of the claimer's and of the recorder's backend for that segment (from /proc/PID/schedstat,
so the server must run on this machine), the rows recorded, the WAL written, and whether the queue is
empty.

The lease is long (no row expires), the transport is SMTP's (not idempotent), every commit durable:
the statements and their session's settings are a worker's, without the worker around them.

With ``lean``: the lean loop's table (``sobench/lean.py``: filled and vacuumed, no build) and its
claim and record statements, on plain autocommit sessions as that loop's, with the same sizes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from psycopg import AsyncConnection

from sobench import lean, runners


def backend_cpu(pid: int) -> float:
    """Seconds on CPU of one local backend (schedstat: nanoseconds, unlike /proc/PID/stat's ticks)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def _value(conn: Any, statement: str, params: tuple[Any, ...] = ()) -> Any:
    """The first column of the one row ``statement`` returns."""
    row = await (await conn.execute(statement, params)).fetchone()
    assert row is not None
    return next(iter(row.values())) if isinstance(row, dict) else row[0]  # sendonce's sessions give dicts


def fill(url: str, n: int) -> None:
    """The benchmark's list and campaign (sobench/runners.py), approved and started."""
    account_id, list_id = runners.fill_sendonce(url, n)
    campaign_id = runners.new_campaign(url, account_id, list_id)
    asyncio.run(_start(url, account_id, campaign_id))


async def _start(url: str, account_id: int, campaign_id: int) -> None:
    from sendonce.store import outbox
    from sendonce.store.database import connect

    await runners.approve(url, account_id, campaign_id)
    async with await connect(url) as conn:
        if (account_id, campaign_id) not in await outbox.start_due_campaigns(conn):
            raise RuntimeError("the campaign did not start")


async def build(url: str) -> tuple[float, int]:
    """The recipient list, by sendonce's builder: (backend CPU seconds, rows inserted)."""
    from sendonce.delivery.worker import WorkerConfig
    from sendonce.store import outbox
    from sendonce.store.database import connect

    async with await connect(url) as conn:
        pid = int(await _value(conn, "SELECT pg_backend_pid()"))
        chunk = next(f.default for f in fields(WorkerConfig) if f.name == "build_chunk")  # a worker's chunks
        assert isinstance(chunk, int)
        start, inserted = backend_cpu(pid), 0
        while True:
            progress = await outbox.build_next_chunk(conn, chunk)
            if isinstance(progress, str):
                raise RuntimeError(f"the builder found nothing to build ({progress})")
            inserted += progress.inserted
            if progress.done:
                return backend_cpu(pid) - start, inserted


Claim = Callable[[], Awaitable[list[Any]]]
Record = Callable[[list[Any]], Awaitable[int]]


async def sendonce_steps(url: str, claim: int) -> tuple[list[AsyncConnection[Any]], Claim, Record]:
    """sendonce's claim and record, on a worker's sessions: the claimer's, and a recorder's (planned
    once, as the worker's recorders are)."""
    from sendonce.store import outbox
    from sendonce.store.database import connect

    claimer, recorder = await connect(url, stable_plans=True), await connect(url, stable_plans=True)
    await recorder.execute("SET plan_cache_mode = force_generic_plan")
    await claimer.execute("VACUUM ANALYZE sendonce.deliveries")
    after: outbox.Cursor = {}

    async def take() -> list[Any]:
        batch = await outbox.claim_batch(
            claimer, limit=claim, lease_seconds=3600, worker="outbox-cost", transport_idempotent=False, after=after
        )
        if any(d.blocked for d in batch):  # none is suppressed in this campaign: recording it would be wrong
            raise RuntimeError("a claimed row was blocked")
        now = datetime.now(UTC)
        return [outbox.SentRecord(d.account_id, d.delivery_id, d.attempt, "250 2.0.0 Ok", now) for d in batch]

    async def record(items: list[Any]) -> int:
        return len(await outbox.record_sent(recorder, items))

    return [claimer, recorder], take, record


async def lean_steps(url: str, claim: int) -> tuple[list[AsyncConnection[Any]], Claim, Record]:
    """The lean loop's claim and record (sobench/lean.py), on its sessions (plain, autocommit)."""
    claimer = await AsyncConnection.connect(url, autocommit=True)
    recorder = await AsyncConnection.connect(url, autocommit=True)

    async def take() -> list[Any]:
        return [job for (job,) in await (await claimer.execute(lean.CLAIM, (claim,))).fetchall()]

    async def record(items: list[Any]) -> int:
        return (await recorder.execute(lean.RECORD, (items,))).rowcount

    return [claimer, recorder], take, record


async def serve(conns: list[AsyncConnection[Any]], take: Claim, record_rows: Record, record: int) -> None:
    pids = [int(await _value(conn, "SELECT pg_backend_pid()")) for conn in conns]
    empty = False
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while not empty:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if line[:1] != ["go"]:
            break
        wanted = int(line[1])
        lsn = await _value(conns[0], "SELECT pg_current_wal_lsn()")
        start, recorded = [backend_cpu(pid) for pid in pids], 0
        while recorded < wanted:
            items = await take()
            if not items:
                empty = True
                break
            for i in range(0, len(items), record):
                recorded += await record_rows(items[i : i + record])
        claim_cpu, record_cpu = (backend_cpu(pid) - s for pid, s in zip(pids, start, strict=True))
        wal = await _value(conns[0], "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,))
        report = {"claim": claim_cpu, "record": record_cpu, "recorded": recorded, "wal": float(wal), "empty": empty}
        print(json.dumps(report), flush=True)
    for conn in conns:
        await conn.close()


async def _run(url: str, claim: int, record: int, kind: str) -> None:
    steps = lean_steps if kind == "lean" else sendonce_steps
    await serve(*(await steps(url, claim)), record)


def main(url: str, recipients: int, claim: int, record: int, kind: str) -> None:
    if kind == "lean":
        lean.fill(url, recipients)  # its table is filled and vacuumed, as in the benchmark; no build
        print(json.dumps({"build_cpu": None, "inserted": recipients}), flush=True)
    else:
        fill(url, recipients)
        cpu, inserted = asyncio.run(build(url))
        if inserted != recipients:
            raise RuntimeError(f"the builder inserted {inserted} rows, not {recipients}")
        print(json.dumps({"build_cpu": cpu, "inserted": inserted}), flush=True)
    asyncio.run(_run(url, claim, record, kind))


if __name__ == "__main__":
    recipients, claim, record = (int(a) for a in sys.argv[2:5])
    main(sys.argv[1], recipients, claim, record, sys.argv[5] if len(sys.argv) > 5 else "sendonce")
