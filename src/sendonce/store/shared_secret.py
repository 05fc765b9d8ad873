"""The server secret that processes sharing a database make for themselves, kept in that database.

Without ``SENDONCE_SECRET``, a process used to make a random secret in ``$SENDONCE_HOME/secret``,
and ``SENDONCE_HOME`` is relative to the working directory. Two processes on one external database
started from two directories (or in two containers) then had two secrets: the worker signed
unsubscribe links that the API refused (the person kept receiving campaigns), and each API process
keyed signups its own way. The first process now offers its secret to the database and every process
takes the one stored there. It is readable by whoever can read the database; ``SENDONCE_SECRET``
keeps it out of it.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from sendonce.store.database import DURABLE_TRANSACTION, is_unavailable
from sendonce.store.migrations import ADVISORY_LOCK_KEY

_READ = "SELECT secret FROM sendonce_meta.generated_secret"


def shared_secret(conninfo: str, offered: bytes, *, wait: float = 30.0) -> bytes:
    """The secret stored in the database, storing ``offered`` first if there is none yet.

    The table is made on first use, under the migrations' advisory lock (so neither two processes
    nor a concurrent ``db upgrade`` race to create the schema), since the secret is needed before
    the migrations of a process that starts with ``--no-upgrade`` or validates its settings first.
    A database that cannot be reached is tried again for ``wait`` seconds (a worker or an API that
    starts while PostgreSQL does), then its error is raised."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return _shared_secret(conninfo, offered)
        except psycopg.Error as exc:
            if not is_unavailable(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(1.0)


def _shared_secret(conninfo: str, offered: bytes) -> bytes:
    with psycopg.connect(conninfo, autocommit=False, connect_timeout=10) as conn:
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        with conn.transaction():
            # flushed at its commit whatever the database's synchronous_commit: a secret a crash
            # forgot after links were signed with it would be replaced, and those links all refused
            conn.execute(DURABLE_TRANSACTION)
            if _exists(conn):
                row = conn.execute(_READ).fetchone()
                if row is not None:
                    return str(row[0]).encode()
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_KEY,))
            if not _exists(conn):
                # a database not yet upgraded (migration 0013 makes the same table): made here only
                # then, since a role that may not create (a least-privilege one) need not
                conn.execute("CREATE SCHEMA IF NOT EXISTS sendonce_meta")
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS sendonce_meta.generated_secret ("
                    " only_one boolean PRIMARY KEY DEFAULT true CHECK (only_one),"
                    " secret text NOT NULL,"
                    " created_at timestamptz NOT NULL DEFAULT now())"
                )
            conn.execute(
                "INSERT INTO sendonce_meta.generated_secret (secret) VALUES (%s) ON CONFLICT DO NOTHING",
                (offered.decode(),),
            )
            row = conn.execute(_READ).fetchone()
            assert row is not None
            return str(row[0]).encode()


def _exists(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regclass('sendonce_meta.generated_secret') IS NOT NULL").fetchone()
    return bool(row and row[0])
