"""Settings that would break a guarantee are refused at start; the edges of the HTTP API hold."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sendonce.api.abuse import AbuseDetector
from sendonce.errors import ConfigurationError
from sendonce.settings import load_settings
from sendonce.testing.tcp_proxy import TcpProxy
from tests.conftest import ApiServer
from tests.helpers import proxy_target, through_proxy

ADMIN = {"Authorization": "Bearer test-admin-token"}


def _account(client: httpx.Client) -> dict[str, str]:
    response = client.post("/v1/accounts", json={"name": "acme", "from_email": "hello@acme.test"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['api_key']}"}


def _problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    return body


def _count(database_url: str, sql: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(sql).fetchone()  # type: ignore[arg-type]
        assert row is not None
        return int(row[0])


# -- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("window", ["0", "0s", "500ms", "31d", 0, -5])
def test_a_signup_window_outside_1s_to_30d_is_a_configuration_error(window: object) -> None:
    # A zero window made every repeat of a signup queue another mail.
    with pytest.raises(ConfigurationError, match=r"invalid configuration: SENDONCE_SIGNUP_WINDOW: .*1s and 30d"):
        load_settings(signup_window=window)


@pytest.mark.parametrize("window", ["1s", "30d", "15m"])
def test_a_signup_window_within_the_bounds_is_taken(window: str) -> None:
    load_settings(signup_window=window)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("abuse_window", "0"),
        ("abuse_window", "0s"),
        ("abuse_window", "100ms"),
        ("abuse_min_repeats", 0),
        ("abuse_min_repeats", -1),
        ("abuse_sources", 0),
        ("abuse_sources", 1),
        ("max_body_bytes", 0),
        ("max_body_bytes", -1),
        ("max_import_bytes", 0),
        ("verify_ttl", "0s"),
        ("optin_ttl", 0),
        ("soft_bounce_period", "0"),
        ("feedback_min_sample", 0),
        ("soft_bounce_limit", 0),
    ],
)
def test_a_setting_that_makes_no_sense_at_zero_is_a_configuration_error(name: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=rf"invalid configuration: SENDONCE_{name.upper()}: "):
        load_settings(**{name: value})


def test_the_defaults_and_the_smallest_sensible_values_are_taken() -> None:
    load_settings()
    load_settings(
        abuse_window="1s",
        abuse_min_repeats=1,
        abuse_sources=2,
        max_body_bytes=1,
        max_import_bytes=1,
        verify_ttl="1s",
        optin_ttl="1s",
        soft_bounce_period="1s",
    )


def test_the_abuse_detector_refuses_a_zero_window_itself() -> None:
    # Built from Settings it cannot get one; built otherwise it must not divide by zero after a commit.
    with pytest.raises(ValueError, match="longer than zero"):
        AbuseDetector(bucket_seconds=0)
    with pytest.raises(ValueError, match="at least 1"):
        AbuseDetector(min_count=0)


@pytest.mark.parametrize(("name", "value"), [("abuse_window", "0s"), ("signup_window", "0s")])
def test_the_api_is_not_built_with_a_setting_out_of_bounds(database_url: str, name: str, value: str) -> None:
    with pytest.raises(ConfigurationError, match=f"SENDONCE_{name.upper()}"):
        ApiServer(database_url, **{name: value})


def _cli(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SENDONCE_")}
    clean.update(SENDONCE_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none", **env)
    return subprocess.run(
        [sys.executable, "-m", "sendonce.cli", "db", "url"],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("variable", ["SENDONCE_ABUSE_WINDOW", "SENDONCE_SIGNUP_WINDOW", "SENDONCE_MAX_BODY_BYTES"])
def test_the_cli_exits_2_on_a_setting_out_of_bounds(variable: str) -> None:
    assert _cli().returncode == 0
    done = _cli(**{variable: "0"})
    assert done.returncode == 2, done
    assert "invalid configuration" in done.stdout + done.stderr
    assert variable in done.stdout + done.stderr


def test_account_windows_keep_the_same_bounds(api_server: ApiServer) -> None:
    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        auth = _account(c)
        problem = _problem(c.patch("/v1/account", json={"signup_window": "0s"}, headers=auth), 422)
        assert problem["detail"] == "signup_window must be between 1s and 30d"
        _problem(c.patch("/v1/account", json={"signup_window": "31d"}, headers=auth), 422)
        assert c.patch("/v1/account", json={"signup_window": "30d"}, headers=auth).json()["signup_window"] == "2592000s"


# -- X-Forwarded-For ------------------------------------------------------------------------------


@pytest.fixture
def behind_proxy(database_url: str) -> Iterator[httpx.Client]:
    with (
        ApiServer(database_url, trust_forwarded_for=True) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        yield c


def _repeats_by_client(client: httpx.Client) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    return {
        s.labels["client"]: s.value
        for s in families["sendonce_absorbed_repeats_by_client"].samples
        if s.name.endswith("_total")
    }


@pytest.mark.parametrize(
    "headers",
    [
        # the proxy appended the peer it saw to what the client sent
        [("X-Forwarded-For", "6.6.6.6, 203.0.113.7")],
        [("X-Forwarded-For", "6.6.6.6,1.2.3.4,203.0.113.7")],
        # the proxy added a header line of its own: one list, in order
        [("X-Forwarded-For", "6.6.6.6"), ("X-Forwarded-For", "203.0.113.7")],
    ],
)
def test_the_client_address_is_the_one_the_proxy_appended(
    behind_proxy: httpx.Client, headers: list[tuple[str, str]]
) -> None:
    auth = _account(behind_proxy)
    body = {"email": "ann@example.test", "origin": "web"}
    assert behind_proxy.post("/v1/signups", json=body, headers=auth).status_code == 201
    for _ in range(3):
        response = behind_proxy.post("/v1/signups", json=body, headers=[*auth.items(), *headers])
        assert response.status_code == 200, response.text
    assert _repeats_by_client(behind_proxy) == {"203.0.113.7": 3}


def test_without_a_forwarded_for_the_peer_is_the_client(behind_proxy: httpx.Client) -> None:
    auth = _account(behind_proxy)
    body = {"email": "ann@example.test", "origin": "web"}
    for _ in range(2):
        behind_proxy.post("/v1/signups", json=body, headers=auth)
    behind_proxy.post("/v1/signups", json=body, headers={**auth, "X-Forwarded-For": "6.6.6.6,"})
    assert _repeats_by_client(behind_proxy) == {"127.0.0.1": 2}


# -- body limit -----------------------------------------------------------------------------------


def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    # a valid JSON body of about ``total`` bytes (whitespace), sent without Content-Length (chunked)
    yield b'{"name": "ok"'
    sent = 0
    while sent < total:
        yield b" " * size
        sent += size
    yield b"}"


@pytest.mark.parametrize(("path", "total"), [("/v1/lists", 2 * 1_048_576), ("/v1/suppressions/import", 3 * 1_048_576)])
def test_a_chunked_body_over_the_limit_gets_413(database_url: str, path: str, total: int) -> None:
    with (
        ApiServer(database_url, max_import_bytes=2 * 1_048_576) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        auth = _account(c)
        content_type = "text/csv" if path.endswith("/import") else "application/json"
        response = c.post(path, content=_chunks(total), headers={**auth, "Content-Type": content_type})
        assert "content-length" not in response.request.headers
        problem = _problem(response, 413)
        assert problem["type"] == "https://sendonce.dev/problems/payload-too-large"
        assert problem["title"] == "Request body too large"
        assert "larger than" in problem["detail"]
        assert problem["instance"] == path
        # the same shape as the 413 for a declared Content-Length over the limit
        declared = _problem(
            c.post(path, content=b"x" * (total + 1), headers={**auth, "Content-Type": content_type}), 413
        )
        assert declared.keys() == problem.keys()
        assert _count(database_url, "SELECT count(*) FROM sendonce.lists") == 0
        assert _count(database_url, "SELECT count(*) FROM sendonce.suppressions") == 0
        # and the server goes on answering
        assert c.post("/v1/lists", json={"name": "small"}, headers=auth).status_code == 201


def test_a_chunked_body_within_the_limit_is_read(api_server: ApiServer) -> None:
    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        auth = _account(c)
        response = c.post("/v1/lists", content=_chunks(100_000), headers={**auth, "Content-Type": "application/json"})
        assert response.status_code == 201, response.text


# -- 503 ------------------------------------------------------------------------------------------


def test_a_503_does_not_promise_that_nothing_was_written(database_url: str) -> None:
    # The connection can drop during COMMIT, after PostgreSQL committed: only a retry with the same
    # Idempotency-Key is safe, and the answer must say so rather than "nothing was written".
    with (
        TcpProxy(**proxy_target(database_url)) as proxy,  # type: ignore[arg-type]
        ApiServer(through_proxy(database_url, proxy.port)) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        auth = _account(c)
        proxy.cut()
        problem = _problem(c.post("/v1/lists", json={"name": "during"}, headers=auth), 503)
        proxy.heal()
    assert "nothing was written" not in problem["detail"]
    assert "may or may not have been written" in problem["detail"]
    assert "retry" in problem["detail"]
    assert "Idempotency-Key" in problem["detail"]
