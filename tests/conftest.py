"""Real PostgreSQL for every test that touches data: embedded by default, or SENDONCE_TEST_DATABASE_URL.

The schema is applied once to a template database; each test gets its own copy (CREATE DATABASE ...
TEMPLATE), so tests are isolated and can run against a shared server.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from sendonce.store.embedded import EmbeddedPostgres
from sendonce.store.migrations import upgrade
from sendonce.testing.inbox import Inbox


def _db_url(base: str, dbname: str) -> str:
    return make_conninfo(base, dbname=dbname)


@pytest.fixture(scope="session")
def pg_admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL with the right to create databases."""
    external = os.environ.get("SENDONCE_TEST_DATABASE_URL")
    if external:
        yield external
        return
    server = EmbeddedPostgres(Path(tmp_path_factory.mktemp("embedded")) / "pgdata")
    server.start()
    url = server.admin_url()
    with psycopg.connect(url, autocommit=True) as conn:
        # Test data is disposable: trade durability for speed.
        conn.execute("ALTER SYSTEM SET fsync = off")
        conn.execute("ALTER SYSTEM SET synchronous_commit = off")
        conn.execute("ALTER SYSTEM SET full_page_writes = off")
        conn.execute("SELECT pg_reload_conf()")
    yield url
    server.stop()


@pytest.fixture(scope="session")
def template_db(pg_admin_url: str) -> Iterator[str]:
    name = f"sendonce_tpl_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    upgrade(_db_url(pg_admin_url, name))
    yield name
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _create_database(admin_url: str, template: str | None) -> str:
    name = f"sendonce_t_{secrets.token_hex(6)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if template:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
            )
        else:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return name


def _drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def database_url(pg_admin_url: str, template_db: str) -> Iterator[str]:
    """A fresh database with the current schema, for this test only."""
    name = _create_database(pg_admin_url, template_db)
    yield _db_url(pg_admin_url, name)
    _drop_database(pg_admin_url, name)


@pytest.fixture
def empty_database_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh database without the schema (migration tests)."""
    name = _create_database(pg_admin_url, None)
    yield _db_url(pg_admin_url, name)
    _drop_database(pg_admin_url, name)


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    with Inbox() as box:
        yield box


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ApiServer:
    """The real API app under uvicorn, on a loopback port, in a thread."""

    def __init__(self, database_url: str, **settings: object) -> None:
        import uvicorn

        from sendonce.api.app import create_app
        from sendonce.settings import load_settings
        from tests.helpers import TEST_SECRET

        self.settings = load_settings(**{"admin_token": "test-admin-token", "secret": TEST_SECRET, **settings})
        self.app = create_app(self.settings, database_url=database_url)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the API did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def api_server(database_url: str) -> Iterator[ApiServer]:
    with ApiServer(database_url) as server:
        yield server
