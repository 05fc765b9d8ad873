"""The HTTP API over real HTTP (uvicorn on loopback) against real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import psycopg.conninfo
import psycopg.sql
import pytest

from sendonce.store.database import create_pool
from sendonce.testing.tcp_proxy import TcpProxy
from tests.conftest import ApiServer
from tests.helpers import proxy_target, through_proxy

ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def client(api_server: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.url, timeout=10) as c:
        yield c


def _problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status
    assert body["type"].startswith("https://sendonce.dev/problems/")
    assert body["title"] and body["detail"]
    return body


def _account(client: httpx.Client, name: str = "acme") -> dict[str, str]:
    response = client.post("/v1/accounts", json={"name": name, "from_email": "news@acme.test"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["api_key"].startswith("sk_")
    return {"Authorization": f"Bearer {body['api_key']}"}


def _count(database_url: str, sql: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(sql).fetchone()  # type: ignore[arg-type]
        assert row is not None
        return int(row[0])


def test_openapi_and_health(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in (
        "/v1/accounts",
        "/v1/lists",
        "/v1/subscribers",
        "/v1/subscribers/import",
        "/v1/campaigns",
        "/v1/campaigns/{campaign_id}/approve",
        "/v1/suppressions",
        "/v1/suppressions/{email}",
    ):
        assert path in spec["paths"], path
    assert client.get("/health").json() == {"status": "ok", "database": "ok"}


def test_admin_routes_need_the_admin_token(client: httpx.Client) -> None:
    body = {"name": "x", "from_email": "a@b.test"}
    _problem(client.post("/v1/accounts", json=body), 401)
    _problem(client.post("/v1/accounts", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    _problem(client.post("/v1/accounts", json={"name": "x", "from_email": "nope"}, headers=ADMIN), 422)


def test_a_full_campaign_lifecycle(client: httpx.Client, database_url: str) -> None:
    auth = _account(client)
    list_a = client.post("/v1/lists", json={"name": "weekly"}, headers=auth).json()["id"]
    list_b = client.post("/v1/lists", json={"name": "monthly"}, headers=auth).json()["id"]
    response = client.post(
        "/v1/subscribers",
        json={
            "subscribers": [
                {"email": "ann@example.test", "name": "Ann", "lists": [list_a]},
                {"email": "ANN@Example.TEST", "lists": [list_b]},
                {"email": "not an address", "lists": [list_a]},
                {"email": "bob@example.test", "lists": [999_999]},
                {"email": "carl@example.test", "status": "nope"},
                {"email": "dora@example.test", "lists": [list_b], "status": "confirmed"},
            ]
        },
        headers=auth,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["created"], body["updated"], body["errors"]) == (2, 0, 3)
    results = body["results"]
    assert results[0]["id"] == results[1]["id"]  # same person, typed twice
    assert [r["result"] for r in results] == ["created", "updated", "error", "error", "error", "created"]
    assert "not a valid email address" in results[2]["error"]
    assert "unknown list" in results[3]["error"]
    assert "status must be one of" in results[4]["error"]
    assert _count(database_url, "SELECT count(*) FROM sendonce.subscribers") == 2
    assert _count(database_url, "SELECT count(*) FROM sendonce.list_members") == 3

    created = client.post(
        "/v1/campaigns",
        json={
            "name": "Issue 1",
            "subject": "Hi {{ name }}",
            "text": "Hello {{ email }}",
            "lists": [list_a, list_b],
        },
        headers=auth,
    )
    assert created.status_code == 201, created.text
    campaign = created.json()
    assert campaign["status"] == "draft"
    cid = campaign["id"]
    approved = client.post(f"/v1/campaigns/{cid}/approve", headers=auth)
    assert approved.status_code == 200, approved.text
    assert approved.json()["status"] == "approved"
    twice = _problem(client.post(f"/v1/campaigns/{cid}/approve", json={}, headers=auth), 409)
    assert twice["current_status"] == "approved"
    assert twice["type"].endswith("invalid-transition")
    state = client.get(f"/v1/campaigns/{cid}", headers=auth).json()
    assert state["status"] == "approved"
    assert state["counts"] == {
        "total": 0,
        "queued": 0,
        "sending": 0,
        "sent": 0,
        "suppressed": 0,
        "failed": 0,
        "possible_duplicate": 0,
        "possibly_delivered": 0,
    }
    assert client.post(f"/v1/campaigns/{cid}/pause", headers=auth).json()["status"] == "paused"
    assert client.post(f"/v1/campaigns/{cid}/resume", headers=auth).json()["status"] == "approved"
    assert client.post(f"/v1/campaigns/{cid}/cancel", headers=auth).json()["status"] == "cancelled"
    _problem(client.post(f"/v1/campaigns/{cid}/resume", headers=auth), 409)
    assert client.get(f"/v1/campaigns/{cid}/duplicates", headers=auth).json() == {
        "campaign_id": cid,
        "entries": [],
    }


def test_scheduled_approval(client: httpx.Client) -> None:
    auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    cid = client.post(
        "/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [lst]}, headers=auth
    ).json()["id"]
    # a misspelled field was dropped, and the campaign approved to send at once
    typo = _problem(client.post(f"/v1/campaigns/{cid}/approve", json={"scheduled_at": "2030-01-01"}, headers=auth), 422)
    assert "scheduled_at" in str(typo), typo
    assert client.get(f"/v1/campaigns/{cid}", headers=auth).json()["status"] == "draft"
    response = client.post(f"/v1/campaigns/{cid}/approve", json={"scheduled_for": "2030-01-01T09:00:00Z"}, headers=auth)
    assert response.status_code == 200
    assert response.json()["scheduled_for"].startswith("2030-01-01T09:00:00")
    _problem(client.post(f"/v1/campaigns/{cid}/approve", json={"scheduled_for": "next tuesday"}, headers=auth), 422)


def test_an_account_never_sees_another_accounts_data(client: httpx.Client) -> None:
    alice = _account(client, "alice")
    mallory = _account(client, "mallory")
    lst = client.post("/v1/lists", json={"name": "l"}, headers=alice).json()["id"]
    cid = client.post(
        "/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [lst]}, headers=alice
    ).json()["id"]
    _problem(client.get(f"/v1/campaigns/{cid}", headers=mallory), 404)
    _problem(client.post(f"/v1/campaigns/{cid}/approve", headers=mallory), 404)
    _problem(client.get(f"/v1/campaigns/{cid}/duplicates", headers=mallory), 404)
    # a list of another account is an unknown list
    bad = _problem(
        client.post("/v1/campaigns", json={"name": "n", "subject": "s", "text": "t", "lists": [lst]}, headers=mallory),
        422,
    )
    assert "unknown list" in bad["detail"]
    assert client.get(f"/v1/campaigns/{cid}", headers=alice).status_code == 200


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer",
        "Basic abc",
        "Bearer sk_1_short",
        "Bearer sk_999999_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "Bearer garbage",
    ],
)
def test_missing_or_wrong_keys_get_401(client: httpx.Client, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    body = _problem(client.post("/v1/lists", json={"name": "x"}, headers=headers), 401)
    assert body["detail"]


def test_a_forged_key_for_a_real_account_gets_401(client: httpx.Client) -> None:
    auth = _account(client)
    real = auth["Authorization"]
    forged = real[:-4] + ("AAAA" if not real.endswith("AAAA") else "BBBB")
    _problem(client.post("/v1/lists", json={"name": "x"}, headers={"Authorization": forged}), 401)


def test_bad_campaign_input_gets_clear_422s_and_writes_nothing(client: httpx.Client, database_url: str) -> None:
    auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"name": "n", "subject": "s", "text": "t", "lists": [lst, 424242]}, "unknown list"),
        ({"name": "n", "subject": "s", "text": "t", "lists": []}, "lists"),
        ({"name": "n", "subject": "s", "text": "t", "lists": [2**70]}, "lists"),
        ({"name": "n", "subject": "{{ oops", "text": "t", "lists": [lst]}, "syntax error"),
        ({"name": "n", "subject": "s", "text": "{{ secret }}", "lists": [lst]}, "unknown template variable"),
        ({"name": "n", "subject": "s", "text": "a\x00b", "lists": [lst]}, "NUL"),
        ({"subject": "s", "text": "t", "lists": [lst]}, "name"),
        ({"name": "", "subject": "s", "text": "t", "lists": [lst]}, "name"),
    ]
    for body, expected in cases:
        problem = _problem(client.post("/v1/campaigns", json=body, headers=auth), 422)
        assert expected in problem["detail"], (body, problem)
    assert _count(database_url, "SELECT count(*) FROM sendonce.campaigns") == 0


def test_malformed_json_and_wrong_types(client: httpx.Client) -> None:
    auth = _account(client)
    response = client.post("/v1/lists", content=b"{not json", headers={**auth, "Content-Type": "application/json"})
    problem = _problem(response, 422)
    # the body is named, not the character where parsing stopped ("1: the body is not valid JSON")
    assert problem["errors"][0]["field"] == "body", problem
    assert problem["detail"].startswith("body: the body is not valid JSON (at character 1): "), problem
    _problem(client.post("/v1/lists", json=["a", "list"], headers=auth), 422)
    _problem(client.post("/v1/subscribers", json={"subscribers": []}, headers=auth), 422)
    _problem(client.post("/v1/campaigns/abc/approve", headers=auth), 422)
    _problem(client.post(f"/v1/campaigns/{2**70}/approve", headers=auth), 422)


def test_all_bad_rows_get_422_and_nothing_is_written(client: httpx.Client, database_url: str) -> None:
    auth = _account(client)
    problem = _problem(
        client.post("/v1/subscribers", json={"subscribers": [{"email": "x@"}, {"email": 42}, {}]}, headers=auth),
        422,
    )
    assert problem["errors"] == 3
    assert _count(database_url, "SELECT count(*) FROM sendonce.subscribers") == 0


def test_oversized_bodies_get_413_before_being_read(client: httpx.Client, database_url: str) -> None:
    auth = _account(client)
    huge = {"subscribers": [{"email": f"user{i}@example.test", "name": "x" * 150} for i in range(8000)]}
    problem = _problem(client.post("/v1/subscribers", json=huge, headers=auth), 413)
    assert "larger than" in problem["detail"]
    assert _count(database_url, "SELECT count(*) FROM sendonce.subscribers") == 0


def test_csv_import(client: httpx.Client, database_url: str) -> None:
    auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    csv_body = (
        "Email,Name,firstName\nann@example.test,Ann,Annie\nnot-an-address,X,\nBOB@example.test,,\n"
        "ann@EXAMPLE.test,Ann B,Annie\n"
    )
    response = client.post(
        f"/v1/subscribers/import?list={lst}",
        content=csv_body.encode(),
        headers={**auth, "Content-Type": "text/csv"},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["created"], body["errors"]) == (2, 1)
    assert body["error_rows"][0]["line"] == 3
    assert _count(database_url, "SELECT count(*) FROM sendonce.subscribers") == 2
    assert _count(database_url, "SELECT count(*) FROM sendonce.list_members") == 2
    # other columns are attributes named as written (a template reads attributes.firstName)
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT attributes FROM sendonce.subscribers WHERE email_key = 'ann@example.test'"
        ).fetchone()
    assert row is not None and row[0] == {"firstName": "Annie"}
    csv_headers = {**auth, "Content-Type": "text/csv"}
    _problem(client.post(f"/v1/subscribers/import?list={lst}", content=b"name\nx\n", headers=csv_headers), 422)
    _problem(
        client.post(f"/v1/subscribers/import?list={lst}", content=b"email\n\xff\xfe\n", headers=csv_headers),
        422,
    )
    _problem(
        client.post("/v1/subscribers/import?list=987654", content=b"email\na@b.test\n", headers=csv_headers),
        422,
    )
    _problem(client.post(f"/v1/subscribers/import?list={lst}", content=b"email\na@b.test\n", headers=auth), 415)
    _problem(client.post(f"/v1/subscribers/import?list={lst}", content=b"email\nnope\n", headers=csv_headers), 422)


def test_an_import_never_brings_back_someone_who_opted_out(client: httpx.Client, database_url: str) -> None:
    # An export whose every row says "confirmed", imported again, re-confirmed those who had
    # unsubscribed (or bounced), and the next campaign mailed them. Only they can come back.
    auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    first = [
        {"email": "ann@example.test", "status": "unsubscribed", "lists": [lst]},
        {"email": "bob@example.test", "status": "bounced", "lists": [lst]},
        {"email": "cat@example.test", "status": "pending", "lists": [lst]},
    ]
    assert client.post("/v1/subscribers", json={"subscribers": first}, headers=auth).json()["created"] == 3
    csv_body = b"email,status\nANN@example.test,confirmed\nbob@example.test,confirmed\ncat@example.test,confirmed\n"
    response = client.post(
        f"/v1/subscribers/import?list={lst}", content=csv_body, headers={**auth, "Content-Type": "text/csv"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["updated"], body["kept_unsubscribed"], body["kept_bounced"]) == (3, 1, 1), body
    statuses = "SELECT array_agg(status::text ORDER BY email_key) FROM sendonce.subscribers"
    with psycopg.connect(database_url) as conn:
        assert conn.execute(statuses).fetchone() == (["unsubscribed", "bounced", "confirmed"],)
    again = client.post(
        "/v1/subscribers", json={"subscribers": [{"email": "ann@example.test", "status": "confirmed"}]}, headers=auth
    ).json()
    assert again["results"][0]["note"].startswith("status kept unsubscribed: send resubscribe=true"), again
    # what they ask for themselves still goes through: the API may still record an opt-out
    assert (
        client.post(
            "/v1/subscribers",
            json={"subscribers": [{"email": "cat@example.test", "status": "unsubscribed"}]},
            headers=auth,
        ).json()["results"][0]["note"]
        is None
    )
    with psycopg.connect(database_url) as conn:
        assert conn.execute(statuses).fetchone() == (["unsubscribed", "bounced", "unsubscribed"],)
    # consent given again, said so: applied
    csv_headers = {**auth, "Content-Type": "text/csv"}
    response = client.post(f"/v1/subscribers/import?list={lst}&resubscribe=true", content=csv_body, headers=csv_headers)
    assert (response.json()["kept_unsubscribed"], response.json()["kept_bounced"]) == (0, 0), response.text
    with psycopg.connect(database_url) as conn:
        assert conn.execute(statuses).fetchone() == (["confirmed", "confirmed", "confirmed"],)


def test_csv_files_as_spreadsheets_write_them(
    client: httpx.Client, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = _account(client)
    lst = client.post("/v1/lists", json={"name": "l"}, headers=auth).json()["id"]
    headers = {**auth, "Content-Type": "text/csv"}

    def post(content: bytes) -> httpx.Response:
        return client.post(f"/v1/subscribers/import?list={lst}", content=content, headers=headers)

    # bare CRs (old Mac software): "new-line character seen in unquoted field"
    assert post(b"email,name\rann@example.test,Ann\rbob@example.test,Bob\r").json()["created"] == 2
    # a column that cannot be an attribute fails the file at once, not only the rows with a value there
    problem = _problem(post(b"email,First Name\ncat@example.test,\ndan@example.test,Dan\n"), 422)
    assert "'First Name' cannot be an attribute name" in problem["detail"]
    _problem(post(b"email,city,city\ncat@example.test,a,b\n"), 422)
    # a trailing comma: a column with no name, which may only be empty
    body = post(b"email,\ncat@example.test,\ndan@example.test,oops\n").json()
    assert (body["created"], body["errors"]) == (1, 1) and "no name" in body["error_rows"][0]["error"]
    # more fields than the header names: said so
    body = post(b"email,x\neve@example.test,1,2\n").json()
    assert "the row has 3 fields, the header 2" in str(body), body
    # too many rows: refused whole, before anything is written
    from sendonce.api.routes import subscribers as routes

    monkeypatch.setattr(routes, "MAX_IMPORT_ROWS", 2)
    _problem(post(b"email\nfay@example.test\ngil@example.test\nhal@example.test\n"), 413)
    assert _count(database_url, "SELECT count(*) FROM sendonce.subscribers WHERE email_key LIKE 'fay@%'") == 0


def test_suppressions(client: httpx.Client) -> None:
    auth = _account(client)
    first = client.post("/v1/suppressions", json={"email": "Ann@Example.test", "reason": "complaint"}, headers=auth)
    assert first.status_code == 201
    assert first.json()["email_key"] == "ann@example.test"
    assert client.post("/v1/suppressions", json={"email": "ann@example.test"}, headers=auth).status_code == 200
    _problem(client.post("/v1/suppressions", json={"email": "nope"}, headers=auth), 422)
    _problem(client.post("/v1/suppressions", json={"email": "a@b.test", "reason": "whim"}, headers=auth), 422)
    assert client.delete("/v1/suppressions/ANN@example.test", headers=auth).status_code == 204
    _problem(client.delete("/v1/suppressions/ann@example.test", headers=auth), 404)
    # a "/" is allowed in an address's local part: it was a 404 from the router, undeletable
    assert client.post("/v1/suppressions", json={"email": "a/b@example.test"}, headers=auth).status_code == 201
    assert client.delete("/v1/suppressions/a%2Fb@example.test", headers=auth).status_code == 204
    _problem(client.delete("/v1/suppressions/a%2Fb@example.test", headers=auth), 404)


def test_an_unreachable_database_gets_a_503_that_can_be_retried(database_url: str) -> None:
    with (
        TcpProxy(**proxy_target(database_url)) as proxy,  # type: ignore[arg-type]
        ApiServer(through_proxy(database_url, proxy.port)) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        auth = _account(c)
        assert c.post("/v1/lists", json={"name": "before"}, headers=auth).status_code == 201
        proxy.cut()
        problem = _problem(c.post("/v1/lists", json={"name": "during"}, headers=auth), 503)
        assert c.post("/v1/lists", json={"name": "during"}, headers=auth).headers["retry-after"]
        assert "retry" in problem["detail"]
        health = c.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        _forged_links_are_refused(c)
        proxy.heal()
        assert c.post("/v1/lists", json={"name": "after"}, headers=auth).status_code == 201
    assert _count(database_url, "SELECT count(*) FROM sendonce.lists") == 2


def _forged_links_are_refused(c: httpx.Client) -> None:
    """While the database is unreachable: a signed token is checked before a connection is taken,
    so a forged link is the client's error (400, not to be retried) and takes nothing from the pool;
    so are a wrong admin token and a webhook that is not signed."""
    forged = "x" * 40
    for response in (
        c.post(f"/u/{forged}"),
        c.post(f"/u/{forged}/resubscribe"),
        c.post("/v1/signups/verify", json={"token": forged}),
        c.post("/v1/lists/confirm", json={"token": forged}),
    ):
        assert _problem(response, 400)["type"].endswith("token-invalid"), response.request.url
    assert c.get(f"/u/{forged}").status_code == 400
    assert c.post("/v1/signups/verify", data={"token": forged}).status_code == 400
    wrong = {"Authorization": "Bearer not-the-admin-token"}
    _problem(c.post("/v1/accounts", json={"name": "x", "from_email": "a@b.test"}, headers=wrong), 401)
    _problem(c.put("/v1/accounts/1/dkim", json=None, headers=wrong), 401)
    _problem(c.post("/v1/webhooks/generic", content=b'[{"type": "hard_bounce"}]'), 401)
    # no API key, or one that is not shaped like one: 401 (fix the client), not 503 (retry)
    _problem(c.post("/v1/signups", json={"email": "a@b.test", "origin": "web"}), 401)
    _problem(c.post("/v1/lists", json={"name": "x"}, headers={"Authorization": "Basic eDp5"}), 401)
    _problem(c.get("/v1/account", headers={"Authorization": "Bearer sk_1_short"}), 401)


def test_a_database_that_stops_answering_gets_a_503_within_the_deadline(database_url: str) -> None:
    """Packets dropped rather than refused: no error ever comes back, and without the deadline the
    request would hang until this client's own timeout (and fail the test there)."""
    with (
        TcpProxy(**proxy_target(database_url)) as proxy,  # type: ignore[arg-type]
        ApiServer(through_proxy(database_url, proxy.port), request_timeout="5s") as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        auth = _account(c)
        assert c.post("/v1/lists", json={"name": "before"}, headers=auth).status_code == 201
        proxy.pause()
        problem = _problem(c.post("/v1/lists", json={"name": "during"}, headers=auth), 503)
        assert "no answer within 5s" in problem["detail"] and "retry" in problem["detail"]
        assert c.post("/v1/lists", json={"name": "during"}, headers=auth).headers["retry-after"]
        proxy.heal()
        assert c.post("/v1/lists", json={"name": "after"}, headers=auth).status_code == 201
    with psycopg.connect(database_url) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sendonce.lists").fetchall()}
    assert {"before", "after"} <= names


async def test_a_pooled_session_left_idle_in_a_transaction_is_ended_by_the_server(database_url: str) -> None:
    # A process that stalled mid-transaction keeps its row locks until PostgreSQL ends its session:
    # the API's pool asks PostgreSQL to end such a session (twice the request deadline, by default).
    pool = create_pool(database_url, idle_in_transaction_timeout=0.5)
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            shown = await (await conn.execute("SHOW idle_in_transaction_session_timeout")).fetchone()
            assert shown is not None and list(shown.values()) == ["500ms"]
            await conn.execute("BEGIN")
            await conn.execute("SELECT 1")
            await asyncio.sleep(1.5)  # stalled, holding its transaction open
            with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
                await conn.execute("SELECT 1")
    finally:
        await pool.close()


def test_suppression_import_and_export(
    client: httpx.Client, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth = _account(client)
    client.post("/v1/suppressions", json={"email": "old@example.test", "reason": "complaint"}, headers=auth)
    csv_body = (
        b"Email,Reason\nann@example.test,bounce\nOLD@example.test,manual\nnot-an-address,\n"
        b"bob@example.test,\nzed@example.test,whim\n"
    )
    response = client.post(
        "/v1/suppressions/import",
        content=csv_body,
        headers={**auth, "Content-Type": "text/csv"},
        params={"reason": "manual"},
    )
    assert response.status_code == 200, response.text
    assert {k: response.json()[k] for k in ("added", "existing", "errors")} == {"added": 2, "existing": 1, "errors": 2}
    export = client.get("/v1/suppressions/export", headers=auth)
    assert export.status_code == 200 and export.headers["content-type"].startswith("text/csv")
    lines = export.text.strip().splitlines()
    assert lines[0] == "email,email_key,reason,created_at"
    assert sorted(line.split(",")[1:3] for line in lines[1:]) == [
        ["ann@example.test", "bounce"],
        ["bob@example.test", "manual"],
        ["old@example.test", "complaint"],
    ]
    other = _account(client, "other")
    assert client.get("/v1/suppressions/export", headers=other).text.strip() == "email,email_key,reason,created_at"
    _problem(
        client.post("/v1/suppressions/import", content=b"name\nx\n", headers={**auth, "Content-Type": "text/csv"}), 422
    )
    _problem(
        client.post("/v1/suppressions/import", content=b"email\nnope\n", headers={**auth, "Content-Type": "text/csv"}),
        422,
    )
    # too many rows: refused whole, as the subscriber import does (it had no cap)
    from sendonce.api.routes import suppressions as routes

    monkeypatch.setattr(routes, "MAX_IMPORT_ROWS", 2)
    many = b"email\nfay@example.test\ngil@example.test\nhal@example.test\n"
    _problem(client.post("/v1/suppressions/import", content=many, headers={**auth, "Content-Type": "text/csv"}), 413)
    assert _count(database_url, "SELECT count(*) FROM sendonce.suppressions WHERE email_key LIKE 'fay@%'") == 0


def test_a_suppression_import_is_written_whole_or_not_at_all(
    client: httpx.Client, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Written 5,000 rows a statement: the database lost at the second one must not leave the first
    # behind the 503 that tells the client to retry the whole file.
    from sendonce.store import suppressions

    auth = _account(client)
    real = suppressions.import_suppressions
    calls = 0

    async def lost_at_the_second_chunk(conn: Any, account_id: int, rows: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await real(conn, account_id, rows)

    monkeypatch.setattr(suppressions, "import_suppressions", lost_at_the_second_chunk)
    body = ("email\n" + "".join(f"user{i}@example.test\n" for i in range(5001))).encode()
    headers = {**auth, "Content-Type": "text/csv"}
    _problem(client.post("/v1/suppressions/import", content=body, headers=headers), 503)
    assert _count(database_url, "SELECT count(*) FROM sendonce.suppressions") == 0
    response = client.post("/v1/suppressions/import", content=body, headers=headers)  # the retry
    assert response.status_code == 200 and response.json()["added"] == 5001
    assert _count(database_url, "SELECT count(*) FROM sendonce.suppressions") == 5001


def test_a_suppression_export_is_read_page_by_page_and_a_lost_database_is_a_503(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sendonce.api.routes import suppressions as route
    from sendonce.store import suppressions

    auth = _account(client)
    emails = [f"{name}@example.test" for name in ("eve", "ann", "dan", "bob", "cat")]
    for email in emails:
        assert client.post("/v1/suppressions", json={"email": email}, headers=auth).status_code == 201
    monkeypatch.setattr(route, "_EXPORT_PAGE", 2)
    lines = client.get("/v1/suppressions/export", headers=auth).text.strip().splitlines()
    assert [line.split(",")[0] for line in lines[1:]] == sorted(emails)  # three pages, each row once

    real = suppressions.export_suppressions
    pages = 0

    async def lost_at_page(n: int, conn: Any, account_id: int, **kwargs: Any) -> Any:
        nonlocal pages
        pages += 1
        if pages == n:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await real(conn, account_id, **kwargs)

    # lost before the answer started: a 503 to retry, not a broken 200
    monkeypatch.setattr(suppressions, "export_suppressions", lambda *a, **k: lost_at_page(1, *a, **k))
    _problem(client.get("/v1/suppressions/export", headers=auth), 503)
    # lost in the middle: the body is cut short, never passed off as a whole file
    pages = 0
    monkeypatch.setattr(suppressions, "export_suppressions", lambda *a, **k: lost_at_page(2, *a, **k))
    with pytest.raises(httpx.RemoteProtocolError):
        client.get("/v1/suppressions/export", headers=auth)


def test_a_database_that_takes_no_writes_gets_a_503_that_can_be_retried(database_url: str) -> None:
    """A standby during a failover (or a demoted primary) refuses writes with SQLSTATE 25006: retry
    later, not a 500. The database is made read-only for new sessions, and the pool's are ended."""
    dbname = psycopg.conninfo.conninfo_to_dict(database_url)["dbname"]
    with ApiServer(database_url) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        auth = _account(c)
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                psycopg.sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(
                    psycopg.sql.Identifier(str(dbname))
                )
            )
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        try:
            for _ in range(5):  # reads still work, once the pool has replaced the connections ended
                if c.get("/v1/account", headers=auth).status_code == 200:
                    break
            response = c.post("/v1/lists", json={"name": "during"}, headers=auth)
            problem = _problem(response, 503)
            assert response.headers["retry-after"]
            assert "retry" in problem["detail"]
        finally:
            with psycopg.connect(database_url, autocommit=True) as admin:
                admin.execute("SET default_transaction_read_only = off")
                admin.execute(
                    psycopg.sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(
                        psycopg.sql.Identifier(str(dbname))
                    )
                )
        # The pool's sessions opened meanwhile are still read-only (a setting applies to new sessions,
        # as a demoted server's sessions stay on it): each one that refuses a write is dropped, so the
        # writes come back within a pool's worth of tries, not when the sessions reach their lifetime.
        for _ in range(25):
            if (after := c.post("/v1/lists", json={"name": "after"}, headers=auth)).status_code == 201:
                break
        assert after.status_code == 201, after.text
    assert _count(database_url, "SELECT count(*) FROM sendonce.lists") == 1


@pytest.mark.parametrize("account_part", ["\xb2", "1\xb9"])
def test_a_key_with_digits_that_are_not_ascii_is_a_401(client: httpx.Client, account_part: str) -> None:
    """'²' is a digit to str.isdigit() but not to int(): such a key was a 500."""
    header = f"Bearer sk_{account_part}_abcdefghijklmnopqrstuvwxyz".encode("latin-1")
    response = client.get("/v1/account", headers={"Authorization": header})  # type: ignore[dict-item]
    _problem(response, 401)
