"""Connections: where the database is, pools, and what a driver error means for the caller."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import psycopg
import psycopg_pool
from psycopg.rows import DictRow, dict_row

from sendonce.errors import DatabaseUnavailable
from sendonce.store.embedded import DEFAULT_DATABASE, embedded_for_home

logger = logging.getLogger(__name__)

Conn = psycopg.AsyncConnection[DictRow]
"""The connection type every store function takes: async, rows as dicts."""


def resolve_database_url(database_url: str | None, home: Path) -> str:
    """The server to use: ``database_url`` if given, else the embedded one in ``home`` (started on demand)."""
    if database_url:
        return database_url
    server = embedded_for_home(home)
    server.start()
    return server.ensure_database(DEFAULT_DATABASE)


def is_unavailable(exc: BaseException) -> bool:
    """True when the error means the database could not be reached (retry later), not bad input."""
    if isinstance(exc, psycopg_pool.PoolTimeout | DatabaseUnavailable):
        return True
    if isinstance(exc, psycopg.errors.ProgramLimitExceeded):
        # an OperationalError, but about the statement (a value too large for its index entry, a
        # statement too complex): the same statement fails again, however long one waits
        return False
    if isinstance(exc, psycopg.OperationalError):
        return True
    if isinstance(exc, psycopg.errors.AdminShutdown | psycopg.errors.CannotConnectNow):
        return True
    if isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout):
        return True  # the server ended a session that stalled in a transaction (rolled back whole)
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        # a server that takes no writes now: a standby during a failover, a primary being demoted
        return True
    return isinstance(exc, psycopg.InterfaceError)


# sendonce's SQL is written for READ COMMITTED: a compare-and-set UPDATE re-checks its condition on
# the row's latest version, and the claim's opt-out check (claim_check, migration 0006) reads in a
# snapshot taken after the claim's row locks. A database's or role's default of another isolation
# level would make the first fail with serialization errors and the second blind (it refuses to run
# then), so every session of sendonce's own sets it back.
#
# And UTC: times are read back in the session's time zone, and a time the API accepted (converted to
# UTC, years 1 to 9999) may not exist in another zone: 9999-12-31 20:00 UTC is year 10000 in Tokyo, which
# PostgreSQL stores and psycopg cannot read, after the write has committed.
#
# And durable commits: a database's or role's `synchronous_commit = off` (a common speed setting) let a
# claim's commit return before its flush. A crash of PostgreSQL then forgot the claim after the relay
# had taken the message, and the row went out again as a fresh attempt, not uncertain, with no ledger
# entry (a review found it); an API answer of "queued" could name a mail that the crash then forgot.
# `off` is raised to `on`; any other value (`local`, `remote_write`, `remote_apply`) is the operator's
# and kept. The worker's `--fast-records` turns it off for its recorders' sessions alone, after this.
_DURABLE = (
    b"CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END"
)
DURABLE_TRANSACTION = b"SELECT set_config('synchronous_commit', " + _DURABLE + b", true)"
"""For a connection that is not a sendonce session (see below): this transaction's commit is flushed."""
_SESSION_SETUP = (
    b"SELECT set_config('default_transaction_isolation', 'read committed', false),"
    b" set_config('timezone', 'UTC', false),"
    b" set_config('synchronous_commit', " + _DURABLE + b", false)"
)


# The delivery pipeline's statements (claim, record, renew, release, requeue) join a batch of rows to
# the outbox by its primary key. PostgreSQL keeps the plan of a prepared statement (psycopg prepares
# a statement after its fifth run) and of a PL/pgSQL query (claim_check) for the life of the session,
# and that plan was made for the size the outbox had then. Made while a fresh outbox held the first
# thousand rows of a campaign's list, the claim hashed its batch and read the whole outbox for every
# batch, and kept doing so as the list grew: 18 ms a claim and 888 msg/s at 100,000 recipients,
# against 3,234 with the plan below (bench/out/steps/README.md). A worker's sessions therefore plan
# without sequential scans, hash joins or merge joins wherever an index will do: a nested loop over
# the batch and one index probe per row, whatever size the table had when the plan was made.
_STABLE_PLANS = (
    b", set_config('enable_seqscan', 'off', false), set_config('enable_hashjoin', 'off', false),"
    b" set_config('enable_mergejoin', 'off', false)"
)


async def configure_session(conn: psycopg.AsyncConnection[Any], *, stable_plans: bool = False) -> None:
    """Make ``conn`` a sendonce session: READ COMMITTED and UTC, whatever the server's defaults say;
    with ``stable_plans``, planned by index whatever the tables' size (the worker's sessions)."""
    await conn.execute(_SESSION_SETUP + _STABLE_PLANS if stable_plans else _SESSION_SETUP)
    if not conn.autocommit:
        await conn.commit()


async def abandon(task: asyncio.Future[Any], *, step: float = 0.05, tries: int = 40) -> None:
    """Cancel a task that is waiting on the database, until it ends (at most ``tries`` times).

    Cancelling a psycopg query makes psycopg try to cancel it on the server too, waiting up to ten
    seconds for that over the same path, which may be the dead one; cancelling it again makes it close
    the connection instead. The task's own error, if it ended with one, is retrieved (not logged by
    asyncio as never retrieved); callers that want it read ``task.exception()``."""
    for _ in range(tries):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=step)
    if task.done() and not task.cancelled():
        task.exception()


def create_pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    name: str = "sendonce",
    idle_in_transaction_timeout: float | None = None,
) -> psycopg_pool.AsyncConnectionPool:
    """An async pool that checks a connection before lending it, so a restarted server costs one retry.

    ``idle_in_transaction_timeout`` (seconds): PostgreSQL ends a session of the pool that sits idle in
    a transaction that long. Its process may have lost its way to the server without the server
    knowing (a partition that drops packets); its locks would otherwise be held, and other processes'
    requests for the same rows wait, until TCP keepalives give up, hours later."""

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await configure_session(conn)
        if idle_in_transaction_timeout is not None:
            await conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                (f"{round(idle_in_transaction_timeout * 1000)}ms",),
            )

    return psycopg_pool.AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        name=name,
        open=False,
        timeout=5.0,
        check=psycopg_pool.AsyncConnectionPool.check_connection,
        configure=configure,
        kwargs={"row_factory": dict_row, "autocommit": True},
    )


async def connect(url: str, *, autocommit: bool = True, stable_plans: bool = False) -> Conn:
    """A sendonce session (see :func:`configure_session`)."""
    conn = await psycopg.AsyncConnection.connect(url, autocommit=autocommit, row_factory=dict_row)
    try:
        await configure_session(conn, stable_plans=stable_plans)
    except BaseException:
        await conn.close()
        raise
    return conn
