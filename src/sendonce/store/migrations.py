"""Numbered SQL migrations shipped inside the package, applied under an advisory lock.

``upgrade`` takes a transaction-scoped advisory lock first, so two processes running it at once
apply each migration once: the second waits, then finds nothing left to do. All pending migrations
apply in one transaction: a failure leaves the schema as it was. A migration that was applied and
then edited is refused (checksum), rather than leaving databases with different schemas under
the same version number.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from sendonce.errors import MigrationError

logger = logging.getLogger(__name__)

# Any constant works; this is "sendonce" in ASCII, as a bigint.
ADVISORY_LOCK_KEY = 0x73656E646F6E6365
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def available_migrations() -> list[Migration]:
    folder = resources.files("sendonce.store").joinpath("sql/migrations")
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return found


_BOOKKEEPING = """
CREATE SCHEMA IF NOT EXISTS sendonce_meta;
CREATE TABLE IF NOT EXISTS sendonce_meta.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


LOCK_TIMEOUT = 5.0
"""Seconds a migration's statement waits for a table's lock (after the upgrade's own advisory lock)
before it gives up. A waiting ALTER queues every later query on its table behind it, so an upgrade
run beside a long transaction would stop the API and the workers while it waits; it fails instead,
leaving the schema as it was, and is retried."""


def upgrade(conninfo: str, *, lock_timeout: float = LOCK_TIMEOUT, newer_ok: bool = False) -> list[Migration]:
    """Bring the schema up to date; returns the migrations applied (empty when it was current).

    ``newer_ok``: a schema a later release migrated (every migration this one knows applied, and more)
    is taken with a warning instead of refused: a process of this release that starts or restarts
    during a rolling upgrade runs on. ``db upgrade`` itself refuses it."""
    migrations = available_migrations()
    with psycopg.connect(conninfo, autocommit=False) as conn:
        # READ COMMITTED whatever the database's default: the statement that waits for the lock takes
        # the first snapshot, and in REPEATABLE READ the rest would read it too, blind to what the
        # upgrade before this one applied while this one waited (it would apply it again).
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        return _upgrade(conn, migrations, lock_timeout=lock_timeout, newer_ok=newer_ok)


def _upgrade(
    conn: psycopg.Connection[tuple[Any, ...]],
    migrations: list[Migration],
    *,
    lock_timeout: float | None = None,
    newer_ok: bool = False,
) -> list[Migration]:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_KEY,))
        if lock_timeout is not None:  # set after the advisory lock: waiting for another upgrade is fine
            conn.execute(f"SET LOCAL lock_timeout = {max(int(lock_timeout * 1000), 1)}")
        exists = conn.execute("SELECT to_regclass('sendonce_meta.schema_migrations') IS NOT NULL").fetchone()
        applied: dict[int, str] = {}
        if exists and exists[0]:
            rows = conn.execute("SELECT version, checksum FROM sendonce_meta.schema_migrations").fetchall()
            applied = dict(rows)
        for migration in migrations:
            if migration.version in applied and applied[migration.version] != migration.checksum:
                raise MigrationError(
                    f"migration {migration.version:04d}_{migration.name} was changed after it was "
                    "applied; ship a new migration instead"
                )
        pending = [m for m in migrations if m.version not in applied]
        unknown = sorted(set(applied) - {m.version for m in migrations})
        if unknown and newer_ok and not pending and min(unknown) > max(m.version for m in migrations):
            logger.warning(
                "the database has migrations %s that this version of sendonce does not know (a later release "
                "migrated it): running on; upgrade sendonce",
                unknown,
            )
            return []
        if unknown:
            raise MigrationError(
                f"the database has migrations {unknown} that this version of sendonce does not know; upgrade sendonce"
            )
        if not pending:
            return []
        conn.execute(_BOOKKEEPING)
        for migration in pending:
            logger.info("applying migration %04d_%s", migration.version, migration.name)
            conn.execute(migration.sql.encode())
            conn.execute(
                "INSERT INTO sendonce_meta.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                (migration.version, migration.name, migration.checksum),
            )
        return pending


_HAS_BOOKKEEPING = "SELECT to_regclass('sendonce_meta.schema_migrations') IS NOT NULL"
_LATEST = "SELECT coalesce(max(version), 0) FROM sendonce_meta.schema_migrations"


@functools.cache
def required_version() -> int:
    """The schema version this sendonce's code is written for: the number of its latest migration."""
    return available_migrations()[-1].version


def current_version(conninfo: str) -> int:
    """The version of the schema in the database (0: no migration applied)."""
    with psycopg.connect(conninfo) as conn, conn.cursor(row_factory=tuple_row) as cursor:
        row = cursor.execute(_HAS_BOOKKEEPING).fetchone()
        if not row or not row[0]:
            return 0
        version = cursor.execute(_LATEST).fetchone()
        return int(version[0]) if version else 0


async def schema_version(conn: psycopg.AsyncConnection[Any]) -> int:
    """``current_version`` on an open connection (the API's pool), whatever its row factory."""
    async with conn.cursor(row_factory=tuple_row) as cursor:
        await cursor.execute(_HAS_BOOKKEEPING)
        row = await cursor.fetchone()
        if not row or not row[0]:
            return 0
        await cursor.execute(_LATEST)
        version = await cursor.fetchone()
        return int(version[0]) if version else 0


def behind(version: int) -> str | None:
    """What to tell the operator when a schema at ``version`` is older than this sendonce's code; None
    when it is not. A newer schema is not refused here: during a rolling upgrade the next release
    migrates while processes of this one still run and restart (``upgrade`` is what refuses it)."""
    required = required_version()
    if version >= required:
        return None
    return f"the database schema is at {version}, this sendonce needs {required}: run `sendonce db upgrade`"


def check_current(conninfo: str) -> None:
    """Raise ``MigrationError`` when the database's schema is older than this sendonce's code, before
    a process that does not migrate starts work that would fail on its first query."""
    message = behind(current_version(conninfo))
    if message is not None:
        raise MigrationError(message)
