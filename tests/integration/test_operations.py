"""What an operator sees when something is wrong around sendonce: a one-line error and an exit code
from the CLI (never a traceback), a /health that says why, a first start of the embedded server by
two processes at once, a demo whose workers cannot start."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import psycopg.conninfo
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sendonce.store.embedded import EmbeddedPostgres, embedded_for_home
from sendonce.store.migrations import required_version, upgrade
from tests.conftest import ApiServer


def sendonce(
    *args: str, url: str | None, home: Path, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "SENDONCE_HOME": str(home), **env}
    full.pop("SENDONCE_DATABASE_URL", None)
    if url is not None:
        full["SENDONCE_DATABASE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "sendonce.cli", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The error line of a command that failed as it should: exit ``code``, one ``error:`` line, no traceback."""
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


COMMANDS = [
    pytest.param(["db", "upgrade"], id="db-upgrade"),
    pytest.param(["worker", "--drain"], id="worker"),
    pytest.param(["api", "--port", "0"], id="api"),
    pytest.param(["duplicates", "--account", "1"], id="duplicates"),
    pytest.param(["outbox", "prune", "--older-than", "90d"], id="outbox-prune"),
]


@pytest.mark.parametrize("args", COMMANDS)
def test_a_malformed_database_url_is_a_configuration_error(args: list[str], tmp_path: Path) -> None:
    done = sendonce(*args, url="garbage", home=tmp_path, SENDONCE_TRANSPORT_URL="smtp://127.0.0.1:1")
    line = one_line_error(done, 2)
    assert line.startswith("error: SENDONCE_DATABASE_URL:") and "garbage" in line


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["worker", "--no-upgrade", "--drain"], id="worker"),
        pytest.param(["api", "--no-upgrade", "--port", "0"], id="api"),
        pytest.param(["duplicates", "--account", "1"], id="duplicates"),
        pytest.param(["outbox", "prune", "--older-than", "90d"], id="outbox-prune"),
    ],
)
def test_a_database_without_the_schema_is_refused_at_start(
    args: list[str], empty_database_url: str, tmp_path: Path
) -> None:
    done = sendonce(*args, url=empty_database_url, home=tmp_path, SENDONCE_TRANSPORT_URL="smtp://127.0.0.1:1")
    line = one_line_error(done, 2)
    assert f"the database schema is at 0, this sendonce needs {required_version()}" in line
    assert "sendonce db upgrade" in line


def test_a_database_one_migration_behind_is_refused_too(database_url: str, tmp_path: Path) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM sendonce_meta.schema_migrations WHERE version = %s", (required_version(),))
    done = sendonce("duplicates", "--account", "1", url=database_url, home=tmp_path)
    assert f"schema is at {required_version() - 1}," in one_line_error(done, 2)


def test_a_current_schema_passes_the_check(database_url: str, tmp_path: Path) -> None:
    done = sendonce("duplicates", "--account", "1", url=database_url, home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "0 entries" in done.stdout


def test_a_database_that_does_not_exist_is_one_line(pg_admin_url: str, tmp_path: Path) -> None:
    missing = make_conninfo(pg_admin_url, dbname=f"sendonce_missing_{secrets.token_hex(4)}")
    done = sendonce("duplicates", "--account", "1", url=missing, home=tmp_path)
    line = one_line_error(done, 1)
    assert line.startswith("error: PostgreSQL:") and "does not exist" in line


@pytest.fixture
def role_without_create(pg_admin_url: str) -> Iterator[str]:
    """A role that may connect but not create a schema in the database (PostgreSQL 15's defaults)."""
    role = f"sendonce_r_{secrets.token_hex(4)}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    yield role
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_an_upgrade_without_the_right_to_create_is_one_line(
    empty_database_url: str, role_without_create: str, tmp_path: Path
) -> None:
    url = make_conninfo(empty_database_url, user=role_without_create, password="")
    done = sendonce("db", "upgrade", url=url, home=tmp_path)
    line = one_line_error(done, 1)
    assert line.startswith("error: PostgreSQL: permission denied"), line


def test_an_archive_that_cannot_be_written_stops_the_prune_before_it_deletes(database_url: str, tmp_path: Path) -> None:
    archive = tmp_path / "no" / "such" / "folder" / "archive.jsonl"
    done = sendonce(
        "outbox", "prune", "--older-than", "90d", "--archive", str(archive), url=database_url, home=tmp_path
    )
    line = one_line_error(done, 1)
    assert "No such file or directory" in line and str(archive) in line


@pytest.mark.parametrize(
    ("option", "value"),
    # 1e300: "timestamp out of range" from PostgreSQL after the list build; 1e9: a killed worker's
    # rows held for 31 years (a review found both)
    [("--lease", "inf"), ("--tick", "inf"), ("--lease", "1e300"), ("--lease", "1e9"), ("--tick", "1e300")],
)
def test_worker_durations_must_be_finite_and_bounded(
    option: str, value: str, database_url: str, tmp_path: Path
) -> None:
    done = sendonce(
        "worker",
        "--no-upgrade",
        "--drain",
        f"{option}={value}",
        url=database_url,
        home=tmp_path,
        SENDONCE_TRANSPORT_URL="smtp://127.0.0.1:1",
    )
    assert done.returncode == 2, done.stderr
    assert f"Invalid value for '{option}'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args", [["--account", "99999999999999999999"], ["--account", "1", "--limit", "99999999999999999999"]]
)
def test_duplicates_refuses_numbers_out_of_range_as_bad_flags(
    args: list[str], database_url: str, tmp_path: Path
) -> None:
    done = sendonce("duplicates", *args, url=database_url, home=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Invalid value for '--" in done.stderr and "Traceback" not in done.stderr


def test_health_is_503_while_the_schema_is_behind(empty_database_url: str) -> None:
    with ApiServer(empty_database_url) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        behind = client.get("/health")
        assert behind.status_code == 503
        body = behind.json()
        assert body["status"] == "unavailable" and body["database"] == "schema behind"
        assert f"at 0, this sendonce needs {required_version()}" in body["detail"]
        assert "sendonce db upgrade" in body["detail"]
        upgrade(empty_database_url)
        assert client.get("/health").json() == {"status": "ok", "database": "ok"}


class _ServerHandle:
    """Stands for the embedded server's handle: the URLs of a real server the test already has."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url

    def get_uri(self, database: str) -> str:
        return make_conninfo(self.admin_url, dbname=database)


def _first_starts(admin_url: str, data_dir: Path, name: str, parties: int) -> list[BaseException]:
    """``parties`` threads released at once by a barrier, each ensuring database ``name``; what they raised."""
    barrier = threading.Barrier(parties)
    failures: list[BaseException] = []

    def start() -> None:
        server = EmbeddedPostgres(data_dir)
        server._server = _ServerHandle(admin_url)
        try:
            barrier.wait(timeout=30)
            assert conninfo_to_dict(server.ensure_database(name))["dbname"] == name
        except BaseException as exc:  # reported by the test, with the others
            failures.append(exc)

    threads = [threading.Thread(target=start) for _ in range(parties)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return failures


def test_two_first_starts_at_once_both_get_the_database(pg_admin_url: str, tmp_path: Path) -> None:
    # The race is in ensure_database: both look, find no database, and both create it; the one that
    # loses waited on pg_database's name index and gets a UniqueViolation. A few rounds, each on a
    # fresh name, so that at least one has both CREATEs in flight at once.
    for _ in range(5):
        name = f"sendonce_race_{secrets.token_hex(4)}"
        try:
            failures = _first_starts(pg_admin_url, tmp_path / "pgdata", name, parties=4)
        finally:
            with psycopg.connect(pg_admin_url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        assert failures == []


@pytest.fixture
def demo_home(tmp_path: Path) -> Iterator[Path]:
    """A SENDONCE_HOME for the demo; its embedded server is stopped after, even if the demo was not."""
    home = tmp_path / "home"
    yield home
    server = embedded_for_home(home)
    if (home / "pgdata").exists() and server.running():
        server.stop()


def test_the_demo_refuses_a_setting_its_workers_would_die_of(demo_home: Path) -> None:
    # refused before any worker starts: no worker log is written
    done = sendonce(
        "demo", "--subscribers", "10", "--workers", "1", url=None, home=demo_home, timeout=30, SENDONCE_RATE_LIMIT="abc"
    )
    line = one_line_error(done, 2)
    assert "rate" in line and "abc" in line
    assert not (demo_home / "demo" / "worker-0.log").exists()


def test_the_demo_shows_why_a_worker_died(demo_home: Path) -> None:
    # Not a setting the demo checks: the worker dies of it at start, and the demo says so at once
    # (rather than wait for a campaign that will never be sent: the call's timeout would end it).
    done = sendonce(
        "demo",
        "--subscribers",
        "10",
        "--workers",
        "1",
        url=None,
        home=demo_home,
        timeout=50,
        SENDONCE_FAULTS_SEED="not-a-number",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "exited with code 2" in done.stdout
    assert "not-a-number" in done.stdout  # the worker's own error, from its log
    assert (demo_home / "demo" / "worker-0.log").exists()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # 20 x 30h of idle-session limit is past PostgreSQL's integer range: every request was a 503
        ({"SENDONCE_REQUEST_TIMEOUT": "30h"}, "SENDONCE_REQUEST_TIMEOUT: Value error, must be at most 3600s"),
        # "now() - period" out of range at every soft bounce
        (
            {"SENDONCE_SOFT_BOUNCE_PERIOD": "3000000d"},
            "SENDONCE_SOFT_BOUNCE_PERIOD: Value error, must be at most 3650d",
        ),
        ({"SENDONCE_VERIFY_TTL": "400d"}, "SENDONCE_VERIFY_TTL: Value error, must be at most 365d"),
        # these were tracebacks of the API (the worker refused them cleanly)
        ({"SENDONCE_FAULTS": "bogus"}, "unknown fault point 'bogus'"),
        ({"SENDONCE_FAULTS_SEED": "abc"}, "SENDONCE_FAULTS_SEED must be an integer"),
        ({"SENDONCE_LOG_LEVEL": "basic_format"}, "must be one of debug, info, warning, warn, error, critical"),
    ],
    ids=["request-timeout", "soft-bounce-period", "verify-ttl", "faults", "faults-seed", "log-level"],
)
def test_the_api_refuses_a_setting_out_of_range_at_start(
    env: dict[str, str], expected: str, database_url: str, tmp_path: Path
) -> None:
    done = sendonce("api", "--port", "0", "--no-upgrade", url=database_url, home=tmp_path, **env)
    assert expected in one_line_error(done, 2)


def test_a_home_whose_path_has_a_space_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # The embedded server's tools take the folder unquoted: initdb ran, then the server never started
    # ("invalid argument"), and the half-made data folder stayed (a review found it).
    home = tmp_path / "My Projects" / "sendonce"
    done = sendonce("db", "url", url=None, home=home)
    line = one_line_error(done, 2)
    assert "path with spaces" in line and "SENDONCE_HOME" in line
    assert not (home / "pgdata").exists()


def test_a_second_demo_on_the_same_server_is_refused_while_the_first_runs(database_url: str, tmp_path: Path) -> None:
    # Two at once dropped each other's database and sent each other's campaign. The first one here is
    # stood for by its lock, held by a session of this test on the maintenance database.
    from psycopg.conninfo import make_conninfo

    from sendonce.demo import _DEMO_LOCK

    with psycopg.connect(make_conninfo(database_url, dbname="postgres"), autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_DEMO_LOCK,))
        # the second demo is given another database of the same server: the lock is the server's
        done = sendonce("demo", "--subscribers", "10", url=database_url, home=tmp_path)
    assert "another sendonce demo is running" in one_line_error(done, 2)


def test_a_worker_with_a_bogus_transport_says_so_before_touching_the_database(
    empty_database_url: str, tmp_path: Path
) -> None:
    # it migrated first (or waited 30 s for a database that was down), then refused the setting
    done = sendonce("worker", url=empty_database_url, home=tmp_path, timeout=20, SENDONCE_TRANSPORT_URL="bogus://x")
    assert "unsupported transport 'bogus'" in one_line_error(done, 2)
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT to_regclass('sendonce_meta.schema_migrations')").fetchone() == (None,)
    down = sendonce(
        "worker", url="postgresql://root@127.0.0.1:1/x", home=tmp_path, timeout=20, SENDONCE_TRANSPORT_URL="bogus://x"
    )
    assert "unsupported transport 'bogus'" in one_line_error(down, 2)


@pytest.mark.parametrize(
    "command", [["db", "upgrade"], ["worker"], ["api", "--port", "0"]], ids=["upgrade", "worker", "api"]
)
def test_a_database_that_is_not_there_is_a_setting_to_fix_not_an_outage_to_wait_out(
    command: list[str], database_url: str, tmp_path: Path
) -> None:
    # it was retried for 30 s like a server that is down, then exited 1 (a failure while running)
    missing = psycopg.conninfo.make_conninfo(database_url, dbname="sendonce_no_such_database")
    env = {"SENDONCE_TRANSPORT_URL": "smtp://127.0.0.1:1025", "SENDONCE_SECRET": "s3cret-for-tests-0123456789abcdef"}
    done = sendonce(*command, url=missing, home=tmp_path, timeout=60, **env)
    line = one_line_error(done, 2)
    assert "PostgreSQL refuses the connection" in line and "does not exist" in line, line


def test_an_api_that_cannot_listen_says_so_before_migrating(empty_database_url: str, tmp_path: Path) -> None:
    # uvicorn found out after the migration, and exited 3 with a line of its own
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = sendonce("api", "--port", str(port), url=empty_database_url, home=tmp_path, timeout=30)
    assert f"cannot listen on 127.0.0.1:{port}" in one_line_error(done, 2)
    with psycopg.connect(empty_database_url) as conn:
        assert conn.execute("SELECT to_regclass('sendonce_meta.schema_migrations')").fetchone() == (None,)
    unknown = sendonce("api", "--host", "no-such-host.invalid", url=empty_database_url, home=tmp_path, timeout=30)
    assert "cannot listen on no-such-host.invalid:8000" in one_line_error(unknown, 2)


def test_a_release_started_on_a_schema_a_later_one_migrated_runs_on(empty_database_url: str, tmp_path: Path) -> None:
    # During a rolling upgrade the next release migrates while this one's processes still run and
    # restart: a worker (or an API process) that restarted then refused to start (exit 2, api exit 1)
    upgrade(empty_database_url)
    with psycopg.connect(empty_database_url) as conn:
        conn.execute(
            "INSERT INTO sendonce_meta.schema_migrations (version, name, checksum) VALUES (9999, 'later', 'x')"
        )
    env = {"SENDONCE_TRANSPORT_URL": "smtp://127.0.0.1:1025"}
    worker = sendonce("worker", "--drain", url=empty_database_url, home=tmp_path, timeout=60, **env)
    assert worker.returncode == 0, worker.stderr
    assert "does not know (a later release migrated it): running on" in worker.stderr
    refused = sendonce("db", "upgrade", url=empty_database_url, home=tmp_path, timeout=60)
    assert "that this version of sendonce does not know" in one_line_error(refused, 1)
    # an unknown migration among the known ones is another branch's schema, not a later release's
    with psycopg.connect(empty_database_url) as conn:
        conn.execute("INSERT INTO sendonce_meta.schema_migrations (version, name, checksum) VALUES (0, 'other', 'x')")
    other = sendonce("worker", "--drain", url=empty_database_url, home=tmp_path, timeout=60, **env)
    assert "that this version of sendonce does not know" in one_line_error(other, 2)


def test_the_apis_address_probe_binds_as_asyncio_does() -> None:
    from sendonce.cli import _cannot_listen

    assert _cannot_listen("", 8000) is None  # every interface: not probed (asyncio's '' means all)
    assert _cannot_listen("127.0.0.1", 0) is None
    assert _cannot_listen("no-such-host.invalid", 8000) is not None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _cannot_listen("127.0.0.1", port) is not None
        assert _cannot_listen("localhost4.invalid", port) is not None  # not an address: said, not raised
