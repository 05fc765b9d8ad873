"""A lean claim-send-record loop: what an outbox in PostgreSQL costs with nothing else around it.

One process of it: ``python -m sobench.lean URL PORT CONNECTIONS FIRST [wait]``. It renders a pool of
messages (sendonce's own composer code, the bytes sendonce sends), opens CONNECTIONS pipelined SMTP
connections (the exchange of ``sobench.bare``'s pipelined loop) and three database connections (one
claimer, two recorders, as a sendonce worker has), prints ``ready``, waits for a line on stdin, then
until the table is empty:

* claims 20 rows at a time (``UPDATE … WHERE id IN (SELECT … ORDER BY id LIMIT 20 FOR UPDATE SKIP
  LOCKED)``, autocommit, durable);
* sends one pre-rendered message per row;
* records what was accepted in groups (one ``UPDATE … WHERE id = ANY(…)`` per group, durable): outcomes
  gather for 2 ms unless a connection waits for one of them, and while one recorder's commit is being
  flushed the next group goes through the other, as in sendonce.

It prints one JSON line (start: the go; end: the last record committed; sent, errors, CPU seconds,
claims, records, recorded), then waits for another line on stdin before it closes its database
connections, so that the harness can read PostgreSQL's CPU while its backends are still alive.

With ``wait``, a connection sends no DATA content while its previous accepted message is unrecorded
(sendonce's rule over SMTP, which bounds a crash to one duplicate per connection), so that one rule
can be priced on its own.

What it leaves out, on purpose, is everything else sendonce does per message: composing the
personalized message (template, unsubscribe link, headers, MIME), leases and fencing tokens, the
opt-out and campaign re-check, per-row outcomes (message id, attempt), timeouts around each reply, and
the recipient list build (its table is filled and vacuumed before the run). Its table is narrow (three
columns, two indexes): sendonce's outbox carries what an audit needs, and its indexes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import psycopg

from sobench import run
from sobench.bare import _reply, open_lanes, pipelined_wire
from sobench.content import sendonce_message

_POOL = 2000
BATCH = 20
RECORDERS = 2

SCHEMA = """
DROP TABLE IF EXISTS lean_jobs;
CREATE TABLE lean_jobs (id bigint PRIMARY KEY, status smallint NOT NULL DEFAULT 0, sent_at timestamptz);
"""
CLAIM = """UPDATE lean_jobs SET status = 1
            WHERE id IN (SELECT id FROM lean_jobs WHERE status = 0 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
        RETURNING id"""
RECORD = "UPDATE lean_jobs SET status = 2, sent_at = now() WHERE id = ANY(%s) AND status = 1"


def fill(url: str, n: int) -> None:
    """The queue: ``n`` rows, and the partial index a claim walks."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO lean_jobs (id) SELECT generate_series(1, %s)", (n,))
        conn.execute("CREATE INDEX lean_jobs_queued ON lean_jobs (id) WHERE status = 0")
        conn.execute("VACUUM ANALYZE lean_jobs")


async def main(url: str, port: int, connections: int, first: int, wait: bool) -> None:
    messages = [sendonce_message(first + i) for i in range(_POOL)]
    wire = pipelined_wire(messages)
    claimer = await psycopg.AsyncConnection.connect(url, autocommit=True)
    recorders = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(RECORDERS)]
    lanes = await open_lanes(port, connections)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)

    ready: asyncio.Queue[int | None] = asyncio.Queue()
    space = asyncio.Event()
    accepted: list[tuple[int, asyncio.Event | None]] = []
    wanted = asyncio.Event()
    counts = {"sent": 0, "errors": 0, "claims": 0, "records": 0, "recorded": 0}
    lanes_done = False

    async def claim() -> None:
        while True:
            if ready.qsize() >= connections:
                space.clear()
                await space.wait()
                continue
            rows = await (await claimer.execute(CLAIM, (BATCH,))).fetchall()
            counts["claims"] += 1
            if not rows:
                for _ in lanes:
                    ready.put_nowait(None)
                return
            for (job,) in rows:
                ready.put_nowait(job)

    async def lane(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        previous: asyncio.Event | None = None
        while True:
            job = await ready.get()
            space.set()
            if job is None:
                return
            envelope, content = wire[job % len(wire)]
            writer.write(envelope)
            codes = [await _reply(reader) for _ in range(3)]
            if codes != [250, 250, 354]:
                # the sink never refuses; if it did, this connection's state would be unknown
                raise RuntimeError(f"unexpected replies {codes} for job {job}")
            if previous is not None:
                await previous.wait()
            writer.write(content)
            if await _reply(reader) == 250:
                counts["sent"] += 1
                previous = asyncio.Event() if wait else None
                accepted.append((job, previous))
                wanted.set()
            else:
                counts["errors"] += 1

    async def record(conn: psycopg.AsyncConnection[tuple[int]]) -> None:
        while True:
            if not accepted:
                if lanes_done:
                    return
                wanted.clear()
                await wanted.wait()
                continue
            if not any(event is not None for _, event in accepted):
                await asyncio.sleep(0.002)  # let outcomes gather: one UPDATE for many, as sendonce does
                if not accepted:  # the other recorder took them meanwhile
                    continue
            group = accepted[:]
            del accepted[:]
            cursor = await conn.execute(RECORD, ([job for job, _ in group],))
            counts["records"] += 1
            counts["recorded"] += cursor.rowcount
            for _, event in group:
                if event is not None:
                    event.set()

    start, cpu = time.time(), time.process_time()
    recording = asyncio.gather(*(record(conn) for conn in recorders))
    sending = asyncio.gather(claim(), *(lane(r, w) for r, w in lanes))
    await asyncio.wait([recording, sending], return_when=asyncio.FIRST_COMPLETED)
    if recording.done():  # the recorders stop before the lanes only when one of them failed
        sending.cancel()
        recording.result()
    await sending
    lanes_done = True
    wanted.set()
    await recording
    end, cpu = time.time(), time.process_time() - cpu
    for _, writer in lanes:
        writer.close()
    report = {"start": start, "end": end, "cpu": cpu, "size": len(messages[0].data), **counts}
    print(json.dumps(report), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await claimer.close()
    for conn in recorders:
        await conn.close()


if __name__ == "__main__":
    url = sys.argv[1]
    port, connections, first = (int(a) for a in sys.argv[2:5])
    run(main(url, port, connections, first, sys.argv[5:6] == ["wait"]))
