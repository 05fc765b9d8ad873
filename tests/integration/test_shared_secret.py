"""Without SENDONCE_SECRET, processes on one external database share the secret kept in it."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import psycopg.sql

from sendonce.domain.keys import KeyRing
from sendonce.runtime import keyring
from sendonce.settings import load_settings


def _ring(url: str, home: Path) -> KeyRing:
    return keyring(load_settings(database_url=url, home=home, secret=None))


def test_processes_of_two_homes_on_one_database_share_one_secret(database_url: str, tmp_path: Path) -> None:
    # A worker started from one directory signs the unsubscribe links that an API started from
    # another verifies: with a secret per SENDONCE_HOME the one-click unsubscribe was refused.
    made_before = tmp_path / "old" / "secret"  # a home whose secret an earlier version made
    made_before.parent.mkdir()
    made_before.write_text("made-by-an-earlier-version-0123456789")
    worker = _ring(database_url, made_before.parent)
    api = _ring(database_url, tmp_path / "api")
    assert worker.current == api.current == b"made-by-an-earlier-version-0123456789"  # offered first, kept
    token = worker.sign_stable("unsubscribe", {"a": 1, "s": 2, "c": 3})
    assert api.verify_stable("unsubscribe", token) == {"a": 1, "s": 2, "c": 3}
    assert not (tmp_path / "api" / "secret").exists()  # nothing made per home
    other = tmp_path / "other" / "secret"  # a home with another secret: the database's wins, its own verifies
    other.parent.mkdir()
    other.write_text("another-home-made-this-0123456789")
    joined = _ring(database_url, other.parent)
    assert (joined.current, joined.previous) == (api.current, b"another-home-made-this-0123456789")
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sendonce_meta.generated_secret").fetchone() == (1,)


def test_processes_that_start_at_once_on_a_new_database_agree(empty_database_url: str, tmp_path: Path) -> None:
    barrier = threading.Barrier(6)
    found: list[bytes] = []

    def start(i: int) -> None:
        barrier.wait()
        found.append(_ring(empty_database_url, tmp_path / f"home{i}").current)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 6 and len(set(found)) == 1 and len(found[0]) >= 16


def test_the_secret_is_written_with_a_flushed_commit_whatever_the_database_default(
    database_url: str, tmp_path: Path
) -> None:
    # With the database's synchronous_commit off, a crash of PostgreSQL could forget the secret after
    # processes had signed links with it; the next start would make another, and refuse those links.
    name = str(psycopg.conninfo.conninfo_to_dict(database_url)["dbname"])
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(psycopg.sql.Identifier(name))
        )
        conn.execute("CREATE TABLE public.seen (setting text)")
        conn.execute(
            """CREATE FUNCTION public.note_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN INSERT INTO public.seen VALUES (current_setting('synchronous_commit')); RETURN NEW; END $$"""
        )
        conn.execute(
            "CREATE TRIGGER note BEFORE INSERT ON sendonce_meta.generated_secret"
            " FOR EACH ROW EXECUTE FUNCTION public.note_commit_mode()"
        )
    _ring(database_url, tmp_path / "home")
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT setting FROM public.seen").fetchall() == [("on",)]
