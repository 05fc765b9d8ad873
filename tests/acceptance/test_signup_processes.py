"""Signup verification across real ``sendonce api`` and ``sendonce worker`` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from sendonce.testing.inbox import Inbox
from sendonce.testing.resend_server import ResendServer
from tests.conftest import free_port

SECRET = "acceptance-secret-0123456789abcdef"
ADMIN = "acceptance-admin"


def _env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SENDONCE_")}
    env.update(
        SENDONCE_DATABASE_URL=url,
        SENDONCE_SECRET=SECRET,
        SENDONCE_ADMIN_TOKEN=ADMIN,
        SENDONCE_PUBLIC_URL="https://app.acme.test",
        **extra,
    )
    return env


def spawn_api(url: str, **extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sendonce.cli", "--log-level", "warning", "api", "--port", str(port), "--no-upgrade"],
        env=_env(url, **extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "the API process exited"
        time.sleep(0.1)
    raise AssertionError("the API did not start")


def drain(url: str, transport_url: str, **extra: str) -> int:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sendonce.cli",
            "--log-level",
            "warning",
            "worker",
            "--no-upgrade",
            "--drain",
            "--lease",
            "2",
            "--tick",
            "0.5",
        ],
        env=_env(url, SENDONCE_TRANSPORT_URL=transport_url, **extra),
        capture_output=True,
        timeout=120,
        check=False,
    )
    return proc.returncode


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _account(base: str) -> dict[str, str]:
    response = httpx.post(
        f"{base}/v1/accounts",
        json={"name": "acme", "from_email": "hello@acme.test"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['api_key']}"}


@pytest.mark.timeout(180)
async def test_fifty_identical_requests_across_four_api_processes_send_one_mail(
    database_url: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    bases = []
    for _ in range(4):
        proc, base = spawn_api(database_url)
        processes.append(proc)
        bases.append(base)
    auth = _account(bases[0])
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(
            *[
                client.post(
                    f"{bases[i % 4]}/v1/signups", json={"email": "ann@example.test", "origin": "web"}, headers=auth
                )
                for i in range(50)
            ]
        )
    assert sorted(r.status_code for r in responses) == [200] * 49 + [201]
    assert len({r.content for r in responses}) == 1
    with Inbox() as inbox:
        assert await asyncio.to_thread(drain, database_url, inbox.url) == 0
        assert inbox.by_recipient() == {"ann@example.test": 1}


@pytest.mark.timeout(180)
async def test_an_api_killed_between_commit_and_answer(
    database_url: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    doomed, doomed_base = spawn_api(database_url, SENDONCE_FAULTS="api_after_commit=1")
    processes.append(doomed)
    healthy, healthy_base = spawn_api(database_url)
    processes.append(healthy)
    auth = _account(healthy_base)
    body = {"email": "ann@example.test", "origin": "app"}
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"{doomed_base}/v1/signups", json=body, headers=auth, timeout=30)
    doomed.wait(timeout=10)
    assert doomed.returncode == -signal.SIGKILL
    retry = httpx.post(f"{healthy_base}/v1/signups", json=body, headers=auth, timeout=30)
    # the first request's transaction committed: the retry is its repeat, with the original answer
    assert retry.status_code == 200
    assert retry.json()["verification"] == "queued"
    with Inbox() as inbox:
        assert await asyncio.to_thread(drain, database_url, inbox.url) == 0
        assert inbox.by_recipient() == {"ann@example.test": 1}


@pytest.mark.timeout(180)
async def test_a_worker_killed_after_the_provider_accepted_sends_once(
    database_url: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    api, base = spawn_api(database_url)
    processes.append(api)
    auth = _account(base)
    assert (
        httpx.post(f"{base}/v1/signups", json={"email": "ann@example.test", "origin": "web"}, headers=auth).status_code
        == 201
    )
    with ResendServer() as server:
        # dies between "the provider accepted" and "recorded"
        assert (
            await asyncio.to_thread(drain, database_url, server.url, SENDONCE_FAULTS="after_accept=1")
            == -signal.SIGKILL
        )
        assert len(server.accepted) == 1
        assert await asyncio.to_thread(drain, database_url, server.url) == 0
        assert server.requests == 2  # sent again with the same key...
        assert server.by_recipient() == {"ann@example.test": 1}  # ...and delivered once
