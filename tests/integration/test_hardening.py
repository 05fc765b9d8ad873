"""Defects an adversarial review reproduced, each pinned by a test: poison data, unbounded templates,
SSRF through stylesheets, partial writes, secrets at rest, consent that could be bypassed."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from sendonce.delivery.compose import Links
from sendonce.delivery.worker import WorkerConfig
from sendonce.domain.keys import KeyRing
from sendonce.store import campaigns
from sendonce.store.database import connect
from sendonce.testing.inbox import Inbox
from sendonce.transports.registry import transport_from_url
from tests.conftest import ApiServer
from tests.helpers import PUBLIC_URL, TEST_SECRET, run_to_drain

ADMIN = {"Authorization": "Bearer test-admin-token"}
DRAIN = WorkerConfig(tick=0.2, lease=5, drain=True, backoff_base=0.05, max_failures=2)


@pytest.fixture
def api(database_url: str) -> Iterator[ApiServer]:
    with ApiServer(database_url, webhook_secret="hook-secret") as server:
        yield server


@pytest.fixture
def client(api: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=30) as c:
        yield c


def _account(client: httpx.Client, from_email: str = "news@acme.test") -> tuple[dict[str, Any], dict[str, str]]:
    body = client.post("/v1/accounts", json={"name": "a", "from_email": from_email}, headers=ADMIN).json()
    return body, {"Authorization": f"Bearer {body['api_key']}"}


def _one(url: str, sql: str, *params: Any) -> Any:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchone()  # type: ignore[arg-type]


class Listener:
    """An HTTP server that records every request: nothing should ever call it."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                listener.hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "text/css")
                self.end_headers()
                self.wfile.write(b"p { color: red }")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_stylesheets_are_never_fetched(client: httpx.Client) -> None:
    _, auth = _account(client)
    listener = Listener()
    try:
        html = (
            f'<html><head><link rel="stylesheet" href="{listener.url}/internal.css"></head><body><p>x</p></body></html>'
        )
        response = client.post("/v1/templates", json={"name": "t", "subject": "s", "html": html}, headers=auth)
        assert response.status_code == 201, response.text
        unreachable = html.replace(listener.url, "http://127.0.0.1:9")
        assert (
            client.post(
                "/v1/templates", json={"name": "t", "subject": "s", "html": unreachable}, headers=auth
            ).status_code
            == 201
        )
    finally:
        listener.close()
    assert listener.hits == []


@pytest.mark.parametrize(
    ("template", "stopped_by"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops too much"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{{ email }}{% endfor %}{% endfor %}", "loops too much"),
        ("{{ 'x' * 10000000000 }}", "builds a value longer than"),
        ("{{ 9 ** 999999 }}", "power too large"),
    ],
)
def test_templates_cannot_make_the_server_work_forever(client: httpx.Client, template: str, stopped_by: str) -> None:
    # Each is stopped by the sandbox's own limit, which its answer names (a runaway template would
    # instead hold the request until the client's timeout and fail the test there).
    _, auth = _account(client)
    response = client.post("/v1/templates", json={"name": "t", "subject": "s", "text": template}, headers=auth)
    if response.status_code == 201:  # per-recipient templates are stopped when rendered
        response = client.post(f"/v1/templates/{response.json()['id']}/preview", json={}, headers=auth)
    assert response.status_code == 422, response.text
    assert stopped_by in response.text
    assert client.get("/health").status_code == 200


async def test_one_accounts_bad_campaign_does_not_stop_the_worker(
    database_url: str, client: httpx.Client, inbox: Inbox
) -> None:
    """A template that cannot finish is refused at approval; and if one got through anyway, its
    messages fail with the reason while the worker keeps sending everyone else's mail."""
    body, auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    client.post("/v1/subscribers", json={"subscribers": [{"email": "a@example.test", "lists": [lst]}]}, headers=auth)
    bad = "{% for i in range(99999) %}{% for j in range(99999) %}{{ email }}{% endfor %}{% endfor %}"
    cid = client.post("/v1/campaigns", json={"name": "n", "subject": "s", "text": bad, "lists": [lst]}, headers=auth)
    assert cid.status_code == 201, cid.text
    refused = client.post(f"/v1/campaigns/{cid.json()['id']}/approve", headers=auth)
    assert refused.status_code == 422 and "loops too much" in refused.json()["detail"]
    async with await connect(database_url) as conn:  # as if the check had missed it
        assert (await campaigns.transition(conn, body["id"], cid.json()["id"], "approve")).won
    good = client.post("/v1/campaigns", json={"name": "g", "subject": "s", "text": "hi", "lists": [lst]}, headers=auth)
    client.post(f"/v1/campaigns/{good.json()['id']}/approve", headers=auth)
    _, other = _account(client)
    client.post("/v1/signups", json={"email": "b@example.test", "origin": "web"}, headers=other)
    await run_to_drain(database_url, transport_from_url(inbox.url), DRAIN)
    assert sorted(m.rcpt_to[0] for m in inbox.messages) == ["a@example.test", "b@example.test"]
    status, error = _one(
        database_url, "SELECT status, last_error FROM sendonce.deliveries WHERE campaign_id = %s", cid.json()["id"]
    )
    assert status == "failed" and "loops too much" in error


def test_a_sender_address_must_be_ascii_before_the_at(client: httpx.Client) -> None:
    response = client.post("/v1/accounts", json={"name": "a", "from_email": "ä@acme.test"}, headers=ADMIN)
    assert response.status_code == 422 and "ASCII" in response.json()["detail"]


def test_odd_values_in_subscriber_rows_are_row_errors_not_500s(client: httpx.Client, database_url: str) -> None:
    _, auth = _account(client)
    rows = [
        {"email": "a@example.test", "status": []},
        {"email": "b@example.test", "status": {}},
        {"email": "c@example.test", "name": "\ud800"},
        {"email": "\ud800@example.test"},
    ]
    # json.dumps escapes the lone surrogates as \\ud800, which JSON allows and Python decodes back
    raw = {**auth, "Content-Type": "application/json"}
    response = client.post("/v1/subscribers", content=json.dumps({"subscribers": rows}), headers=raw)
    assert response.status_code == 422, response.text
    assert response.json()["errors"] == 4
    # a lone surrogate anywhere else is a 422 too, never a 500
    assert client.post("/v1/lists", content=json.dumps({"name": "\ud800"}), headers=raw).status_code == 422
    assert _one(database_url, "SELECT count(*) FROM sendonce.subscribers") == (0,)


@pytest.mark.parametrize("key", [None, "k-1"])
def test_a_bad_address_quoted_back_beside_a_good_row_is_escaped(
    client: httpx.Client, database_url: str, key: str | None
) -> None:
    # The row error quoted the address as given: the answer could not be encoded, and came back a
    # 422 saying nothing was written, after the good row had been (without an Idempotency-Key).
    _, auth = _account(client)
    rows = [{"email": "good@example.test"}, {"email": "\ud800@example.test"}, {"email": "nul\x00@example.test"}]
    headers = {**auth, "Content-Type": "application/json"} | ({"Idempotency-Key": key} if key else {})
    answers = [client.post("/v1/subscribers", content=json.dumps({"subscribers": rows}), headers=headers)]
    if key:
        answers.append(client.post("/v1/subscribers", content=json.dumps({"subscribers": rows}), headers=headers))
    for response in answers:
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["created"], body["errors"]) == (1, 2)
        assert [r["email"] for r in body["results"]] == [
            "good@example.test",
            "\\ud800@example.test",
            "nul\\x00@example.test",
        ]
    assert _one(database_url, "SELECT count(*) FROM sendonce.subscribers") == (1,)


def test_attributes_jsonb_cannot_hold_are_row_errors(client: httpx.Client, database_url: str) -> None:
    _, auth = _account(client)
    rows = [
        {"email": "a@example.test", "attributes": {"city": "Lyon"}},
        {"email": "b@example.test", "attributes": {"score": float("nan")}},
        {"email": "c@example.test", "attributes": {"score": float("inf")}},
        {"email": "d@example.test", "attributes": {"city": "\ud800"}},
    ]
    # Python's json writes NaN and Infinity, and escapes the lone surrogate: all are read back as sent
    raw = {**auth, "Content-Type": "application/json"}
    response = client.post("/v1/subscribers", content=json.dumps({"subscribers": rows}), headers=raw)
    assert response.status_code == 200, response.text
    assert (response.json()["created"], response.json()["errors"]) == (1, 3)
    assert _one(database_url, "SELECT count(*) FROM sendonce.subscribers") == (1,)


def test_attributes_nested_near_the_parsers_limit_are_row_errors_and_a_backslash_u_text_is_kept(
    client: httpx.Client, database_url: str
) -> None:
    _, auth = _account(client)
    raw = {**auth, "Content-Type": "application/json"}
    # Somewhere in this range the body parses (near the top of the stack) and the attributes' checks,
    # called deeper, pass the recursion limit: each depth is a 4xx or a row error, never a 500.
    for depth in range(900, 1000, 4):
        attributes = '{"deep": ' + "[" * depth + "]" * depth + "}"
        body = '{"subscribers": [{"email": "deep@example.test", "attributes": ' + attributes + "}]}"
        response = client.post("/v1/subscribers", content=body, headers=raw)
        assert response.status_code < 500, (depth, response.text)
    # the text \u0000 (a backslash, then u0000) is not a NUL character
    text = {"email": "path@example.test", "attributes": {"path": "C:\\u0000dir"}}
    response = client.post("/v1/subscribers", json={"subscribers": [text]}, headers=auth)
    assert (response.status_code, response.json()["created"]) == (200, 1), response.text
    stored = _one(database_url, "SELECT attributes->>'path' FROM sendonce.subscribers WHERE email = %s", text["email"])
    assert stored == ("C:\\u0000dir",)


def _generic(client: httpx.Client, events: list[dict[str, Any]]) -> httpx.Response:
    body = json.dumps({"events": events}).encode()
    ts = str(int(time.time()))
    mac = hmac.new(b"hook-secret", f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    headers = {"Sendonce-Timestamp": ts, "Sendonce-Signature": f"sha256={mac}"}
    return client.post("/v1/webhooks/generic", content=body, headers=headers)


def test_a_webhook_batch_is_all_or_nothing(client: httpx.Client, database_url: str) -> None:
    body, _ = _account(client)
    good = {"id": "e1", "type": "hard_bounce", "email": "a@example.test", "account_id": body["id"]}
    poisoned = {"id": "e2", "type": "hard_bounce", "email": "b@example.test", "account_id": body["id"]}
    # A value PostgreSQL refuses, once the first event is written. No input does that any more (text
    # it cannot store is stored replaced, since 2026-12-04): a trigger stands in for what might.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION refuse_event_e2() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.event_id = 'e2' THEN RAISE EXCEPTION 'refused' USING ERRCODE = 'character_not_in_repertoire'; "
            "END IF; RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON sendonce.feedback_events "
            "FOR EACH ROW EXECUTE FUNCTION refuse_event_e2()"
        )
    response = _generic(client, [good, poisoned])
    assert response.status_code == 422, response.text
    assert _one(database_url, "SELECT count(*) FROM sendonce.suppressions") == (0,)
    assert _one(database_url, "SELECT count(*) FROM sendonce.feedback_events") == (0,)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TRIGGER refuse ON sendonce.feedback_events")
    late = {"id": "e3", "type": "soft_bounce", "email": "c@example.test", "occurred_at": "9999-12-31T23:59:59-14:00"}
    assert _generic(client, [late]).status_code == 400
    assert _generic(client, [good]).json()["new"] == 1


def test_the_api_key_is_never_stored_in_clear(client: httpx.Client, database_url: str) -> None:
    headers = {**ADMIN, "Idempotency-Key": "create-acme"}
    first = client.post("/v1/accounts", json={"name": "acme", "from_email": "a@acme.test"}, headers=headers)
    replay = client.post("/v1/accounts", json={"name": "acme", "from_email": "a@acme.test"}, headers=headers)
    assert first.status_code == 201 and replay.status_code == 201
    assert replay.json()["api_key"] == first.json()["api_key"]  # the retry gets the same key...
    assert replay.headers["Idempotent-Replayed"] == "true"
    stored = _one(database_url, "SELECT response_body FROM sendonce.idempotency_keys")[0]
    assert first.json()["api_key"] not in stored  # ...which is kept encrypted, not in clear
    assert client.get("/v1/account", headers={"Authorization": f"Bearer {first.json()['api_key']}"}).status_code == 200


async def test_unsubscribing_and_resubscribing_never_confirms_a_pending_membership(
    database_url: str, client: httpx.Client
) -> None:
    body, auth = _account(client)
    single = client.post("/v1/lists", json={"name": "news"}, headers=auth).json()["id"]
    double = client.post("/v1/lists", json={"name": "digest", "opt_in": "double"}, headers=auth).json()["id"]
    client.post(
        "/v1/subscribers", json={"subscribers": [{"email": "a@example.test", "lists": [single, double]}]}, headers=auth
    )
    cid = client.post(
        "/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [single, double]}, headers=auth
    ).json()["id"]
    sid = _one(database_url, "SELECT subscriber_id FROM sendonce.subscribers")[0]
    token = Links(KeyRing(TEST_SECRET.encode()), PUBLIC_URL).unsubscribe_token(body["id"], sid, cid)
    client.post(f"/u/{token}")
    client.post(f"/u/{token}/resubscribe")
    with psycopg.connect(database_url) as conn:
        statuses = dict(conn.execute("SELECT list_id, status::text FROM sendonce.list_members").fetchall())
    assert statuses == {single: "confirmed", double: "pending"}
    # consent vouched for later confirms the pending membership (and queues no confirmation mail)
    client.post(
        "/v1/subscribers",
        json={"subscribers": [{"email": "a@example.test", "lists": [double]}], "preconfirm": True},
        headers=auth,
    )
    assert _one(database_url, "SELECT status::text FROM sendonce.list_members WHERE list_id = %s", double) == (
        "confirmed",
    )
    assert _one(
        database_url, "SELECT count(*) FROM sendonce.deliveries WHERE kind = 'list_confirmation_requested'"
    ) == (1,)


def _refused(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.parametrize("window", ["100000000000000", "1e20", "inf", "99999999999999d"])
def test_a_signup_window_too_long_for_a_duration_is_a_422(client: httpx.Client, window: str) -> None:
    _, auth = _account(client)
    problem = _refused(client.patch("/v1/account", json={"signup_window": window}, headers=auth))
    assert "signup_window" in problem["detail"]
    assert client.get("/v1/account", headers=auth).json()["signup_window"] is None


@pytest.mark.parametrize("when", ["9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00"])
@pytest.mark.parametrize("idempotency_key", [None, "approve-1"])
def test_a_schedule_outside_the_calendar_is_refused_and_the_campaign_stays_a_draft(
    client: httpx.Client, when: str, idempotency_key: str | None
) -> None:
    _, auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    cid = client.post("/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [lst]}, headers=auth)
    headers = {**auth, "Idempotency-Key": idempotency_key} if idempotency_key else auth
    approve = client.post(f"/v1/campaigns/{cid.json()['id']}/approve", json={"scheduled_for": when}, headers=headers)
    assert "scheduled_for" in _refused(approve)["detail"]
    campaign = client.get(f"/v1/campaigns/{cid.json()['id']}", headers=auth)
    assert campaign.status_code == 200, campaign.text
    assert campaign.json()["status"] == "draft"


@pytest.mark.parametrize(
    ("zone", "when"), [("Asia/Tokyo", "9999-12-31T20:00:00Z"), ("America/Los_Angeles", "0001-01-01T02:00:00Z")]
)
def test_a_schedule_at_the_end_of_the_calendar_reads_back_whatever_the_servers_time_zone(
    database_url: str, zone: str, when: str
) -> None:
    # Read back in Tokyo, 9999-12-31 20:00 UTC is in year 10000: stored, then unreadable (every read of
    # the campaign a 422). sendonce's sessions read times in UTC, whatever the server's zone says.
    with psycopg.connect(database_url, autocommit=True) as conn:
        name = sql.Identifier(conn.info.dbname)
        conn.execute(sql.SQL("ALTER DATABASE {} SET timezone = {}").format(name, sql.Literal(zone)))
    with ApiServer(database_url) as api, httpx.Client(base_url=api.url, timeout=30) as client:
        _, auth = _account(client)
        lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
        cid = client.post(
            "/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [lst]}, headers=auth
        ).json()["id"]
        approve = client.post(f"/v1/campaigns/{cid}/approve", json={"scheduled_for": when}, headers=auth)
        assert approve.status_code == 200, approve.text
        campaign = client.get(f"/v1/campaigns/{cid}", headers=auth)
        assert campaign.status_code == 200, campaign.text
        assert campaign.json()["status"] == "approved"


@pytest.mark.parametrize(
    "template",
    [
        "{{ " + "(" * 200 + "name" + ")" * 200 + " }}",
        "{{ name" + " | upper" * 1000 + " }}",
        "{% if name %}" * 100 + "x" + "{% endif %}" * 100,
    ],
)
def test_templates_nested_too_deeply_are_a_422(client: httpx.Client, database_url: str, template: str) -> None:
    _, auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    stored = client.post("/v1/templates", json={"name": "t", "subject": "s", "text": "x"}, headers=auth).json()["id"]
    for method, path, body in [
        ("POST", "/v1/templates", {"name": "t", "subject": "s", "text": template}),
        ("PUT", f"/v1/templates/{stored}", {"name": "t", "subject": "s", "html": template}),
        ("POST", "/v1/campaigns", {"name": "n", "subject": "s", "text": template, "lists": [lst]}),
    ]:
        assert "nested" in _refused(client.request(method, path, json=body, headers=auth))["detail"]
    assert _one(database_url, "SELECT count(*), max(text_body) FROM sendonce.templates") == (1, "x")
    assert _one(database_url, "SELECT count(*) FROM sendonce.campaigns") == (0,)


@pytest.mark.parametrize("path", ["/v1/campaigns/{cid}/pause", "/v1/suppressions/import"])
def test_a_deeply_nested_body_with_an_idempotency_key_is_not_a_500(client: httpx.Client, path: str) -> None:
    _, auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    cid = client.post("/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [lst]}, headers=auth)
    headers = {**auth, "Idempotency-Key": "k1", "Content-Type": "text/csv"}
    response = client.post(path.format(cid=cid.json()["id"]), content="[" * 100_000, headers=headers)
    assert response.status_code < 500, response.text
