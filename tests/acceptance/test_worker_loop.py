"""``sendonce worker --loop``: the worker process runs on Python's own loop (the default) or on
uvloop, and sends alike on both, pipelined."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sendonce.testing.inbox import Inbox
from tests.helpers import campaign_setup, emails


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` to its end, its output kept."""
    return subprocess.run(
        [sys.executable, *argv], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", None], ids=["asyncio", "uvloop", "default"])
async def test_the_worker_sends_a_campaign_on_either_loop(database_url: str, loop: str | None) -> None:
    pytest.importorskip("uvloop")
    await campaign_setup(database_url, emails(6))
    with Inbox(pipelining=True) as inbox:
        env = {**os.environ, "SENDONCE_DATABASE_URL": database_url, "SENDONCE_TRANSPORT_URL": inbox.url}
        env.pop("SENDONCE_FAULTS", None)
        args = ["--log-level", "info", "worker", "--no-upgrade", "--drain", "--tick", "0.2"]
        args += [] if loop is None else ["--loop", loop]
        proc = _run(["-m", "sendonce.cli", *args], env)
        assert proc.returncode == 0, proc.stderr
        assert sorted(m.rcpt_to[0] for m in inbox.messages) == sorted(emails(6))
        # each envelope went out in one write (RFC 2920), on uvloop as on asyncio
        assert inbox.pipelined_envelopes == 6
    assert f"event loop: {loop or 'asyncio'}" in proc.stderr


def test_a_loop_that_is_not_installed_is_refused_before_anything_is_done() -> None:
    # uvloop hidden from the import system; the database is unreachable: the worker must say what is
    # wrong with its options (exit 2) before it tries to migrate, connect or listen to anything.
    script = "import sys; sys.modules['uvloop'] = None; from sendonce.cli import main; main()"
    env = {**os.environ, "SENDONCE_DATABASE_URL": "postgresql://sendonce@127.0.0.1:9/nothing"}
    proc = _run(["-c", script, "worker", "--loop", "uvloop", "--metrics-port", "0"], env)
    assert proc.returncode == 2, proc.stderr
    assert "--loop uvloop: uvloop is not installed" in proc.stderr
