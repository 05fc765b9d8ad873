"""Migrations: from scratch to the expected schema, idempotent, safe when run concurrently."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import psycopg.sql
import pytest

from sendonce.domain.states import CampaignStatus, DeliveryStatus, SubscriberStatus, SuppressionReason
from sendonce.errors import MigrationError
from sendonce.store.migrations import ADVISORY_LOCK_KEY, available_migrations, upgrade

EXPECTED = Path(__file__).with_name("expected_schema.txt")


def describe_schema(url: str) -> str:
    """A stable text description of the sendonce schema: tables, columns, constraints, indexes, types, functions."""
    lines: list[str] = []
    with psycopg.connect(url) as conn:
        for table, column, data_type, nullable, default in conn.execute(
            """SELECT table_name, column_name, data_type || coalesce('(' || udt_name || ')', ''), is_nullable,
                      coalesce(column_default, '')
                 FROM information_schema.columns WHERE table_schema = 'sendonce'
                ORDER BY table_name, ordinal_position"""
        ):
            lines.append(f"column {table}.{column} {data_type} null={nullable} default={default}")
        for table, name, definition in conn.execute(
            """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
                 FROM pg_constraint WHERE connamespace = 'sendonce'::regnamespace AND contype <> 'n' ORDER BY 1, 2"""
        ):
            lines.append(f"constraint {table} {name}: {definition}")
        for name, definition in conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'sendonce' ORDER BY 1"
        ):
            lines.append(f"index {name}: {definition}")
        for name, labels in conn.execute(
            """SELECT t.typname, string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                 FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid
                WHERE t.typnamespace = 'sendonce'::regnamespace GROUP BY 1 ORDER BY 1"""
        ):
            lines.append(f"enum {name}: {labels}")
        for name, table in conn.execute(
            """SELECT tgname, tgrelid::regclass::text FROM pg_trigger
                WHERE NOT tgisinternal AND tgrelid::regclass::text LIKE 'sendonce.%' ORDER BY 1"""
        ):
            lines.append(f"trigger {name} on {table}")
        for name, arguments, result, volatility in conn.execute(
            """SELECT p.proname, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.provolatile
                 FROM pg_proc p WHERE p.pronamespace = 'sendonce'::regnamespace ORDER BY 1, 2"""
        ):
            lines.append(f"function {name}({arguments}) returns {result} volatility={volatility}")
    return "\n".join(lines) + "\n"


def test_migrations_from_scratch_give_the_expected_schema(empty_database_url: str) -> None:
    applied = upgrade(empty_database_url)
    assert [m.version for m in applied] == [m.version for m in available_migrations()]
    actual = describe_schema(empty_database_url)
    if os.environ.get("SENDONCE_UPDATE_SCHEMA_SNAPSHOT"):
        EXPECTED.write_text(actual)
        pytest.skip("snapshot written, nothing compared: review its diff, then run again without the variable")
    assert actual == EXPECTED.read_text(), "schema differs from tests/integration/expected_schema.txt"


def test_upgrading_twice_changes_nothing(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    before = describe_schema(empty_database_url)
    assert upgrade(empty_database_url) == []
    assert describe_schema(empty_database_url) == before


def test_upgrades_that_wait_for_each_other_apply_each_migration_once_under_repeatable_read(
    empty_database_url: str,
) -> None:
    # With a database default of REPEATABLE READ, an upgrade's snapshot was taken by the statement
    # that waits for the advisory lock: once it had the lock it could not see what the upgrade before
    # it had applied, and applied it again ("already exists"). Upgrades run in READ COMMITTED.
    name = str(psycopg.conninfo.conninfo_to_dict(empty_database_url)["dbname"])
    with psycopg.connect(empty_database_url, autocommit=True) as admin:
        admin.execute(
            psycopg.sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'").format(
                psycopg.sql.Identifier(name)
            )
        )
        with psycopg.connect(empty_database_url) as holder, ThreadPoolExecutor(2) as pool:
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_KEY,))
            futures = [pool.submit(upgrade, empty_database_url) for _ in range(2)]
            deadline = time.monotonic() + 30
            while True:  # both upgrades have taken their first snapshot and wait for the lock
                row = admin.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()
                if row and row[0] == 2:
                    break
                assert time.monotonic() < deadline and not any(f.done() for f in futures)
                time.sleep(0.02)
            holder.rollback()  # let them go, one after the other
            applied = sorted(len(f.result(timeout=60)) for f in futures)
    assert applied == [0, len(available_migrations())]


def test_two_upgrades_at_once_apply_each_migration_once(empty_database_url: str) -> None:
    env = {**os.environ, "SENDONCE_DATABASE_URL": empty_database_url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "sendonce.cli", "db", "upgrade"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    messages = [err.decode() for _, err in outputs]
    assert sum("applied: 0001_initial" in m for m in messages) == 1
    assert sum("the schema is current" in m for m in messages) == 2
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT version FROM sendonce_meta.schema_migrations ORDER BY version").fetchall()
    assert [r[0] for r in rows] == [m.version for m in available_migrations()]


def test_an_edited_migration_is_refused(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    with psycopg.connect(empty_database_url) as conn:
        conn.execute("UPDATE sendonce_meta.schema_migrations SET checksum = 'tampered' WHERE version = 1")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        upgrade(empty_database_url)


def test_every_table_is_tenant_first(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = 'sendonce' AND table_type = 'BASE TABLE'"
            )
        ]
        assert tables
        for table in tables:
            columns = [
                r[0]
                for r in conn.execute(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = 'sendonce' AND table_name = %s",
                    (table,),
                )
            ]
            assert "account_id" in columns, table
        # every primary key and unique index (constraint or not) starts with account_id
        rows = conn.execute(
            """SELECT i.indexrelid::regclass::text, a.attname
                 FROM pg_index i
                 JOIN pg_class c ON c.oid = i.indrelid
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                WHERE c.relnamespace = 'sendonce'::regnamespace AND (i.indisunique OR i.indisprimary)"""
        ).fetchall()
        assert rows
        for index, first_column in rows:
            assert first_column == "account_id", index


def test_database_enums_equal_python_enums(database_url: str) -> None:
    expected = {
        "campaign_status": [s.value for s in CampaignStatus],
        "delivery_status": [s.value for s in DeliveryStatus],
        "subscriber_status": [s.value for s in SubscriberStatus],
        "suppression_reason": [s.value for s in SuppressionReason],
    }
    with psycopg.connect(database_url) as conn:
        for name, values in expected.items():
            row = conn.execute("SELECT enum_range(NULL::sendonce." + name + ")::text[]").fetchone()
            assert row is not None
            assert list(row[0]) == values, name


def test_0008_marks_give_ups_of_unknown_ambiguity_as_possibly_delivered(empty_database_url: str) -> None:
    """Before 0008 a give-up after an ambiguous last attempt was not marked uncertain; a signup repeat
    now re-queues a failed mail only if it is certainly undelivered, so such rows must be marked."""
    from sendonce.store.migrations import _upgrade, available_migrations

    before = [m for m in available_migrations() if m.version < 8]
    with psycopg.connect(empty_database_url) as conn:
        _upgrade(conn, before)
        conn.execute(
            "INSERT INTO sendonce.accounts (name, api_key_hash, from_email) VALUES ('a', 'h', 'a@example.test')"
        )
        for n, (status, error) in enumerate(
            [("failed", "gave up after 8 failures: timeout"), ("failed", "550 no such user"), ("sent", None)]
        ):
            conn.execute(
                "INSERT INTO sendonce.deliveries (account_id, job_id, kind, email, email_key, status, last_error) "
                "SELECT account_id, %s, 'message', 'x@example.test', 'x@example.test', %s, %s FROM sendonce.accounts",
                (f"message:1:{n}", status, error),
            )
        conn.commit()
    upgrade(empty_database_url)
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT job_id, uncertain FROM sendonce.deliveries ORDER BY job_id").fetchall()
    assert rows == [("message:1:0", True), ("message:1:1", False), ("message:1:2", False)]


@pytest.mark.timeout(60)
def test_an_upgrade_that_cannot_lock_its_table_gives_up_instead_of_stopping_everyone(empty_database_url: str) -> None:
    # A waiting ALTER queues every later query on its table behind it: an upgrade run beside a long
    # transaction stopped the API and the workers for as long as that transaction lasted.
    from sendonce.store.migrations import Migration, _upgrade

    upgrade(empty_database_url)
    later = Migration(9999, "a_new_column", "ALTER TABLE sendonce.accounts ADD COLUMN extra integer;")
    with psycopg.connect(empty_database_url) as long_one, psycopg.connect(empty_database_url) as conn:
        long_one.execute("SELECT count(*) FROM sendonce.accounts").fetchone()  # its transaction stays open
        with pytest.raises(psycopg.errors.LockNotAvailable):
            _upgrade(conn, [*available_migrations(), later], lock_timeout=0.2)
        long_one.rollback()
    with psycopg.connect(empty_database_url) as conn:
        columns = conn.execute(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'sendonce' "
            "AND table_name = 'accounts' AND column_name = 'extra'"
        ).fetchone()
        versions = conn.execute("SELECT max(version) FROM sendonce_meta.schema_migrations").fetchone()
    assert columns == (0,) and versions is not None and versions[0] < 9999  # nothing half-applied
    assert upgrade(empty_database_url) == []  # the real migrations: current, nothing to wait for
