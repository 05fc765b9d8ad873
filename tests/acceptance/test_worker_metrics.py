"""``sendonce worker --metrics-port``: a real worker process serves its Prometheus metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from sendonce.testing.inbox import Inbox
from tests.conftest import free_port
from tests.helpers import campaign_setup, emails


def _worker(url: str, inbox: Inbox, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SENDONCE_DATABASE_URL": url, "SENDONCE_TRANSPORT_URL": inbox.url}
    env.pop("SENDONCE_FAULTS", None)
    args = [sys.executable, "-m", "sendonce.cli", "--log-level", "warning", "worker", "--no-upgrade", "--tick", "0.2"]
    return subprocess.Popen(
        [*args, *extra], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


async def test_the_worker_process_serves_what_it_did_at_metrics(database_url: str, inbox: Inbox) -> None:
    await campaign_setup(database_url, emails(5))
    port = free_port()
    proc = _worker(database_url, inbox, "--metrics-port", str(port))
    try:
        assert inbox.wait_for(5)
        deadline = time.monotonic() + 30
        while True:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.TransportError:
                text = ""
            if 'sendonce_worker_outcomes_total{outcome="sent"} 5.0' in text:
                break
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        assert "sendonce_worker_claimed_total 5.0" in text
        assert "sendonce_worker_database_failures_total 0.0" in text
        assert 'sendonce_worker_info{name="' in text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err


def test_a_metrics_port_in_use_is_a_clear_error_at_start(database_url: str, inbox: Inbox) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = _worker(database_url, inbox, "--metrics-port", str(busy.getsockname()[1]))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "cannot serve metrics on 127.0.0.1:" in err
