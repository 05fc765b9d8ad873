"""The PostgreSQL a chaos run uses: a scratch database on the embedded server or on an external one.

Each scenario gets its own database (``sendonce_chaos_<scenario>_<pid>``), created empty, so the
schema is applied by real ``sendonce db upgrade`` processes (two at once in the races scenario).

A restart mid-campaign is a real one: the embedded server is stopped (fast shutdown, every
connection dropped) and started again by a separate ``sendonce db url`` process; an external
server is restarted with ``pg_ctlcluster 15 main restart``, only when the run is told it may.

The audit trigger
-----------------
Fencing is a property of the database, not of the inbox, so the chaos database gets one piece of
instrumentation of its own (schema ``chaos``, never in a sendonce database): a trigger that writes
down every outcome recorded on a delivery (sent, failed, retry), with the ``application_name`` of
the connection that recorded it and the worker that held the claim at that moment. Each worker
process the suite starts gets its own ``PGAPPNAME``, so an outcome recorded by a worker on a row that
another worker had re-claimed (a zombie completion) is visible, whatever the worker says about it.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sendonce.store.embedded import EmbeddedPostgres, embedded_for_home

logger = logging.getLogger(__name__)

DEFAULT_RESTART_COMMAND = "pg_ctlcluster 15 main restart"

AUDIT_SQL = """
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE TABLE IF NOT EXISTS chaos.outcomes (
    delivery_id  bigint NOT NULL,
    job_id       text NOT NULL,
    old_status   text NOT NULL,
    new_status   text NOT NULL,
    attempt      integer NOT NULL,
    claimed_by   text,
    recorder     text NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION chaos.audit_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.outcomes (delivery_id, job_id, old_status, new_status, attempt, claimed_by, recorder)
    VALUES (NEW.delivery_id, NEW.job_id, OLD.status::text, NEW.status::text, OLD.attempt, OLD.claimed_by,
            coalesce(current_setting('application_name', true), ''));
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS chaos_audit_outcome ON sendonce.deliveries;
-- An outcome: a row that was queued or being sent becomes sent or failed, or goes back to the queue
-- with one more failure (a transient error). Claims, renewals and lease recovery are not outcomes.
CREATE TRIGGER chaos_audit_outcome AFTER UPDATE ON sendonce.deliveries FOR EACH ROW
    WHEN ((OLD.status IN ('queued', 'sending') AND NEW.status IN ('sent', 'failed'))
          OR NEW.failures > OLD.failures)
    EXECUTE FUNCTION chaos.audit_outcome();
"""


def clock_offset(conn: psycopg.Connection[Any], clock: Callable[[], float] = time.time) -> float:
    """Seconds by which the database's clock is ahead of ``clock`` (the inbox's, ``time.time()``): a
    timestamp the database wrote, less this, is on the inbox's clock.

    Each of five readings of ``clock_timestamp()``, taken between two readings of ``clock``, bounds
    the offset to an interval as wide as its round trip; the offset is in all of them. On one host
    (one clock) zero always is, and zero is returned: exact, however slow the round trips. Otherwise
    the middle of their common part (or, if clock steps left none, of the shortest round trip's)."""
    low, high = float("-inf"), float("inf")
    best: tuple[float, float, float] | None = None
    for _ in range(5):
        before = clock()
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        after = clock()
        assert row is not None
        at = float(row[0])
        low, high = max(low, at - after), min(high, at - before)
        if best is None or after - before < best[0]:
            best = (after - before, at - after, at - before)
    assert best is not None
    if low > high:
        low, high = best[1], best[2]
    if low <= 0.0 <= high:
        return 0.0
    return (low + high) / 2


class RestartNotAllowed(Exception):
    """This run may not restart the database server."""


@dataclass
class ChaosServer:
    """The server a run uses; started here (and stopped at the end) if it was not running."""

    admin_url: str
    embedded: EmbeddedPostgres | None
    home: Path
    allow_restart: bool = False
    restart_command: str = DEFAULT_RESTART_COMMAND
    started_here: bool = False

    @classmethod
    def open(
        cls,
        *,
        database_url: str | None,
        home: Path,
        allow_restart: bool = False,
        restart_command: str = DEFAULT_RESTART_COMMAND,
    ) -> ChaosServer:
        if database_url:
            return cls(database_url, None, home, allow_restart, restart_command)
        embedded = embedded_for_home(home)
        started_here = not embedded.running()
        embedded.start()
        return cls(embedded.admin_url(), embedded, home, allow_restart, restart_command, started_here)

    @property
    def kind(self) -> str:
        return "embedded" if self.embedded is not None else "external"

    def describe(self) -> str:
        if self.embedded is not None:
            return f"embedded PostgreSQL in {self.embedded.data_dir}"
        params = conninfo_to_dict(self.admin_url)
        return f"external PostgreSQL at {params.get('host') or 'localhost'}:{params.get('port') or 5432}"

    def create(self, name: str) -> ChaosDatabase:
        """A new, empty database ``name`` (dropped first if a previous run left it)."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return ChaosDatabase(self, name, make_conninfo(self.admin_url, dbname=name))

    # -- restart ---------------------------------------------------------------------------------

    def can_restart(self) -> tuple[bool, str]:
        if self.embedded is not None:
            return True, ""
        if not self.allow_restart:
            return False, (
                "restarting an external PostgreSQL is not allowed: pass --allow-pg-restart "
                f"(it runs {self.restart_command!r}) to run the restart scenario against it"
            )
        return True, ""

    def restart(self, down: float = 0.0) -> float:
        """Restart the server (fast shutdown: every connection is dropped); returns the outage in seconds.

        Embedded: ``down`` > 0 stops the server, waits, and starts it from a separate
        ``sendonce db url`` process; 0 is an in-place ``pg_ctl restart``. External: the restart command.
        """
        allowed, why = self.can_restart()
        if not allowed:
            raise RestartNotAllowed(why)
        started = time.monotonic()
        if self.embedded is not None:
            if down <= 0:
                self.embedded.restart()
            else:
                self.embedded.stop()
                time.sleep(down)
                subprocess.run(
                    [sys.executable, "-m", "sendonce.cli", "--log-level", "warning", "db", "url"],
                    env={**clean_env(), "SENDONCE_HOME": str(self.home)},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=60,
                    check=True,
                )
        else:
            subprocess.run(shlex.split(self.restart_command), timeout=120, check=True, capture_output=True)
        self._wait_ready(60)
        return time.monotonic() - started

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.admin_url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def close(self) -> None:
        if self.started_here and self.embedded is not None and self.embedded.running():
            self.embedded.stop()


@dataclass
class ChaosDatabase:
    server: ChaosServer
    name: str
    url: str

    def install_audit(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(AUDIT_SQL.encode())

    def drop(self) -> None:
        with psycopg.connect(self.server.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name)))


def clean_env() -> dict[str, str]:
    """This process's environment without any SENDONCE_ setting (each child gets exactly its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SENDONCE_") and k != "PGAPPNAME"}


def proxy_target(url: str) -> dict[str, str | int]:
    """Where a libpq URL points, as :class:`TcpProxy` arguments (a Unix socket for the embedded server)."""
    params = conninfo_to_dict(url)
    host = str(params.get("host") or "localhost")
    port = int(params.get("port") or 5432)
    if host.startswith("/"):
        return {"target_unix": f"{host}/.s.PGSQL.{port}"}
    return {"target_host": host, "target_port": port}


def through_proxy(url: str, port: int) -> str:
    return make_conninfo(url, host="127.0.0.1", port=port)
