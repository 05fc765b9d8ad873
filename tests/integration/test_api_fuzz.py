"""The whole HTTP API, fuzzed from its own OpenAPI schema (schemathesis), against the real app under
uvicorn and real PostgreSQL. The rule it checks: bad input gets a 4xx problem details answer (RFC 9457)
and writes nothing; no input gets a 500, and the only 5xx is a 503 (an unavailable dependency).

Every operation gets valid requests as generated, the same made to look like real use (existing ids,
real addresses, templates, signed tokens, CSV files, Idempotency-Keys), and invalid requests. Ids of
objects that exist are mixed in with made-up ones, so routes are reached past their 404s. The webhook
operation is fuzzed as documented (any provider, any body, signature headers as generated: refused),
then once per provider: the body narrowed to that provider's format, each request signed (for SES, the
SNS message signed inside the body with a test certificate the route holds), so its parser meets valid
and invalid payloads and ingestion runs.
Derandomized: CI sends the same requests every time. SENDONCE_FUZZ_EXAMPLES=500 searches longer.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import httpx
import psycopg
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from psycopg import sql
from schemathesis import Case, GenerationMode, Response
from schemathesis.core.result import Ok

from sendonce.api.routes import webhooks as webhook_routes
from sendonce.delivery.compose import Links
from sendonce.domain.jobs import JOB_ID_HEADER
from sendonce.domain.keys import KeyRing
from sendonce.store.signups import VERIFY_PURPOSE
from sendonce.store.subscribers import OPTIN_PURPOSE
from tests.conftest import ApiServer
from tests.helpers import (
    CERT_URL,
    GENERIC_SECRET,
    POSTMARK_TOKEN,
    PUBLIC_URL,
    SENDGRID_PUBLIC,
    SNS_KEY,
    SVIX_SECRET,
    TEST_SECRET,
    TOPIC,
    generic_headers,
    sendgrid_headers,
    sns_certificate,
    sns_sign,
    svix_headers,
)

ADMIN = {"Authorization": "Bearer test-admin-token"}
EXAMPLES = int(os.environ.get("SENDONCE_FUZZ_EXAMPLES", "20"))
"""Per operation and mode: about 2,250 requests in all by default."""

SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    # Each example is an HTTP request to a real server, and the realistic strategies are nested
    # flatmaps: Hypothesis's speed and data-size health checks are made for in-memory tests.
    suppress_health_check=list(HealthCheck),
)


class Ledger:
    """Which tables requests wrote, read from row versions: a row created or updated carries the id of
    its transaction (``xmin``), and the rows of a transaction that rolled back are never visible.
    (Deletions leave nothing to read; no route deletes anything on the way to an error.)"""

    def __init__(self, database_url: str) -> None:
        self.conn = psycopg.connect(database_url, autocommit=True)
        tables = [
            name for (name,) in self.conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'sendonce'")
        ]
        # age(xmin) counts the transactions started since the row's: rows written by a transaction that
        # started after `since` (a full transaction id, so this holds across wraparound too).
        self.query = sql.SQL(" UNION ALL ").join(
            sql.SQL(
                "SELECT {name}, count(*) FROM sendonce.{table}"
                " WHERE age(xmin) <= pg_snapshot_xmax(pg_current_snapshot())::text::bigint - %(since)s"
            ).format(name=sql.Literal(name), table=sql.Identifier(name))
            for name in tables
        )
        self.since = self._next_xid()

    def _next_xid(self) -> int:
        row = self.conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
        assert row is not None
        return int(row[0])

    def written(self) -> list[str]:
        """The tables written since the last call."""
        rows = self.conn.execute(self.query, {"since": self.since}).fetchall()
        self.since = self._next_xid()
        return [name for name, n in rows if n]

    def close(self) -> None:
        self.conn.close()


def test_the_ledger_sees_committed_writes_only(database_url: str) -> None:
    insert = "INSERT INTO sendonce.accounts (name, from_email, api_key_hash) VALUES ('a', 'a@acme.test', '')"
    with closing(Ledger(database_url)) as ledger, psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(insert)
        assert ledger.written() == ["accounts"]
        with conn.transaction(force_rollback=True):
            conn.execute(insert)
            conn.execute("UPDATE sendonce.accounts SET name = 'b'")
        assert ledger.written() == []
        conn.execute("UPDATE sendonce.accounts SET name = 'b'")
        assert ledger.written() == ["accounts"]


def _media_type(response: Response) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0].split(";")[0].strip().lower()


def _is_page(case: Case[Any]) -> bool:
    """Routes that answer people with HTML (links in mail): their errors are pages, not JSON."""
    documented = case.operation.definition.raw.get("responses", {}).get("200", {}).get("content", {})
    return "text/html" in documented


def check(case: Case[Any], response: Response, written: list[str], *, signed: bool = False) -> None:
    status = response.status_code
    problem = (
        f"{case.method} {case.formatted_path} query={case.query!r} body={str(case.body)[:300]!r} "
        f"answered {status}: {response.content[:600]!r}"
    )
    assert not (signed and status == 401), f"{problem}, though the test signed it"
    # The database is up all along: the one 503 that may come is SNS's, whose signing certificate
    # lives on the internet this test does not reach (that of the requests the test signs is at hand).
    assert status < 500 or (status == 503 and not signed and case.formatted_path.endswith("/ses")), problem
    if status < 400:
        return
    assert not written, f"{problem}, and wrote to {written}"
    if _is_page(case) and _media_type(response) == "text/html":
        return
    assert _media_type(response) == "application/problem+json", problem
    body = json.loads(response.content)
    assert isinstance(body.get("detail"), str) and body["detail"], problem
    assert body.get("status") == status, problem


@pytest.fixture
def api(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServer]:
    # The certificate of the test's SNS key, valid today, where the route keeps the ones it fetched:
    # the SES requests the test signs are verified with it, and nothing is fetched from the internet.
    now = datetime.now(UTC)
    certificate = sns_certificate(SNS_KEY, not_before=now - timedelta(days=1), not_after=now + timedelta(days=1))
    monkeypatch.setitem(webhook_routes._CERTIFICATES, CERT_URL, certificate)
    with ApiServer(
        database_url,
        webhook_secret=GENERIC_SECRET,
        resend_webhook_secret=SVIX_SECRET,
        postmark_webhook_token=POSTMARK_TOKEN,
        sendgrid_webhook_key=SENDGRID_PUBLIC,
        sns_topic_arns=TOPIC,
    ) as server:
        yield server


@dataclass
class Existing:
    """An account with one of each object, so generated requests can name things that exist."""

    auth: dict[str, str]
    path: dict[str, list[Any]]
    """Values of path parameters that name something."""
    fields: dict[str, st.SearchStrategy[Any]]
    """Realistic values of body fields and query parameters, by name."""
    new_draft: Callable[[], int]
    """Create a draft campaign: approving one is the first step of everything a campaign does."""


EARLIEST, LATEST = timezone(timedelta(hours=23, minutes=59)), timezone(-timedelta(hours=23, minutes=59))
MOMENTS = st.sampled_from(
    [datetime.min, datetime.max, datetime.min.replace(tzinfo=EARLIEST), datetime.max.replace(tzinfo=LATEST)]
).map(datetime.isoformat) | st.tuples(
    st.datetimes(), st.none() | st.integers(-1439, 1439).map(lambda minutes: timezone(timedelta(minutes=minutes)))
).map(lambda parts: parts[0].replace(tzinfo=parts[1]).isoformat())
"""ISO 8601 times in any zone or none, the first and last ones Python can hold among them."""


def _ses_messages(emails: st.SearchStrategy[str], job_ids: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """The ``Message`` of an SNS notification: an SES record as JSON text, of each kind the parser tells
    apart and of others, in either shape (``notificationType``, ``eventType``), naming ``emails`` and
    ``job_ids`` where SES echoes them (our header, a message tag)."""
    text = st.text(max_size=20)
    times = st.datetimes(datetime(2020, 1, 1), datetime(2100, 1, 1), timezones=st.just(UTC)).map(datetime.isoformat)
    times |= MOMENTS
    header = st.fixed_dictionaries({"name": st.sampled_from([JOB_ID_HEADER, JOB_ID_HEADER.lower()]), "value": job_ids})
    other_header = st.fixed_dictionaries({"name": st.sampled_from(["From", "Message-ID"]), "value": text})
    mail = st.fixed_dictionaries(
        {
            "messageId": text,
            "destination": st.lists(emails, max_size=3),
            "headers": st.lists(header | other_header, max_size=3),
        },
        optional={
            "timestamp": times,
            "tags": st.fixed_dictionaries({"sendonce-job-id": st.lists(job_ids, max_size=1)}),
        },
    )
    recipients = st.lists(
        st.fixed_dictionaries({"emailAddress": emails}, optional={"status": text, "diagnosticCode": text}),
        min_size=1,
        max_size=3,
    )
    members: dict[str, dict[str, st.SearchStrategy[Any]]] = {
        "Bounce": {
            "bounce": st.fixed_dictionaries(
                {
                    "bounceType": st.sampled_from(["Permanent", "Transient", "Undetermined"]) | text,
                    "bouncedRecipients": recipients,
                },
                optional={"bounceSubType": text, "timestamp": times},
            )
        },
        "Complaint": {
            "complaint": st.fixed_dictionaries(
                {"complainedRecipients": recipients}, optional={"complaintFeedbackType": text, "timestamp": times}
            )
        },
        "Delivery": {
            "delivery": st.fixed_dictionaries(
                {"recipients": st.lists(emails, min_size=1, max_size=3)},
                optional={"smtpResponse": text, "timestamp": times},
            )
        },
    }

    def record(parts: tuple[str, str]) -> st.SearchStrategy[dict[str, Any]]:
        shape, kind = parts
        return st.fixed_dictionaries({shape: st.just(kind), "mail": mail, **members.get(kind, {})})

    kinds = st.sampled_from([*members, "Open", "Send"]) | st.text(min_size=1, max_size=20)
    return st.tuples(st.sampled_from(["notificationType", "eventType"]), kinds).flatmap(record).map(json.dumps)


NEW_DRAFT = 7_777_777_777_777
"""A ``campaign_id`` replaced, just before the request, by a draft made for it."""


def _existing(api: ApiServer, database_url: str) -> Existing:
    with httpx.Client(base_url=api.url, timeout=30) as c:
        account = c.post("/v1/accounts", json={"name": "a", "from_email": "news@acme.test"}, headers=ADMIN).json()
        auth = {"Authorization": f"Bearer {account['api_key']}"}

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            response = c.post(path, json=body, headers=auth)
            assert response.status_code in (200, 201), response.text
            answer: dict[str, Any] = response.json()
            return answer

        lists = [
            post("/v1/lists", {"name": "weekly"})["id"],
            post("/v1/lists", {"name": "news", "opt_in": "double"})["id"],
        ]
        subscriber = {"email": "ann@example.test", "lists": lists, "attributes": {"city": "Lyon"}}
        subscriber_id = post("/v1/subscribers", {"subscribers": [subscriber]})["results"][0]["id"]
        template_id = post("/v1/templates", {"name": "t", "subject": "Hi {{ name }}", "text": "{{ attributes.city }}"})[
            "id"
        ]
        # Its template reads an attribute that most subscribers will lack: approving it is refused.
        campaign_id = post("/v1/campaigns", {"name": "c", "template_id": template_id, "lists": lists})["id"]
        approved_id = post("/v1/campaigns", {"name": "a", "subject": "s", "text": "x", "lists": lists})["id"]
        post(f"/v1/campaigns/{approved_id}/approve", {"scheduled_for": "2100-01-01T00:00:00Z"})
        post("/v1/suppressions", {"email": "gone@example.test"})
        signup_id = post("/v1/signups", {"email": "sam@example.test", "origin": "web"})["signup_id"]
    keys = KeyRing(TEST_SECRET.encode())
    with psycopg.connect(database_url) as conn:  # the signup's mail, the double opt-in's confirmation
        job_ids = [job_id for (job_id,) in conn.execute("SELECT job_id FROM sendonce.deliveries")]
    # The job ids providers echo back: of deliveries that exist, and of one that does not.
    job_id = st.sampled_from([*job_ids, f"campaign:{approved_id}:{subscriber_id}"])

    def new_draft() -> int:
        body = {"name": "draft", "subject": "Hi {{ name }}", "text": "x", "lists": lists}
        response = httpx.post(f"{api.url}/v1/campaigns", json=body, headers=auth, timeout=30)
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    emails = st.emails() | st.sampled_from(
        ["ann@example.test", "Ann@EXAMPLE.test", "gone@example.test", "zoë@bücher.example", "a@xn--bcher-kva.example"]
    )
    list_ids = st.sampled_from(lists)
    attributes = st.dictionaries(
        st.sampled_from(["city", "x", "first_name"]), st.none() | st.integers() | st.text(max_size=20), max_size=3
    )
    template = st.sampled_from(
        [
            "Hi {{ name }}",
            "{{ attributes.city }}",
            "{% if attributes.x is defined %}{{ attributes.x }}{% endif %} {{ email | upper }}",
            "<style>p { color: red }</style><p>{{ unsubscribe_url }}</p>",
        ]
    ) | st.text(min_size=1, max_size=40)
    return Existing(
        auth=auth,
        new_draft=new_draft,
        path={
            "account_id": [account["id"]],
            "campaign_id": [NEW_DRAFT, campaign_id, approved_id],
            "template_id": [template_id],
            "email": ["gone@example.test", "Ann@example.test"],
            "token": [Links(keys, PUBLIC_URL).unsubscribe_token(account["id"], subscriber_id, campaign_id)],
            "provider": ["generic", "resend", "postmark", "sendgrid", "ses"],
        },
        fields={
            "email": emails,
            "from_email": emails,
            "lists": st.lists(list_ids, min_size=1, max_size=3),
            "list": list_ids,
            "signup_list_id": list_ids,
            "template_id": st.just(template_id),
            "subscriber_id": st.just(subscriber_id),
            "origin": st.sampled_from(["web", "App", " ios ", "backend"]),
            "status": st.sampled_from(["pending", "confirmed", "unsubscribed", "bounced"]),
            "attributes": attributes,
            "signup_window": st.just("default")
            | st.from_regex(r"(\d{1,20}(\.\d{1,3})? ?(ms|s|m|h|d|w)?){1,2}", fullmatch=True),
            "scheduled_for": MOMENTS,
            "since": MOMENTS,
            "subject": template,
            "text": template,
            "html": template,
            "subscribers": st.lists(
                st.fixed_dictionaries(
                    {"email": emails},
                    optional={
                        "name": st.text(max_size=30),
                        "lists": st.lists(list_ids, max_size=2),
                        "status": st.sampled_from(["pending", "confirmed", "unsubscribed"]),
                        "attributes": attributes,
                    },
                ),
                min_size=1,
                max_size=5,
            ),
            # Webhook events: what links them to a delivery or an account, when and to whom.
            "job_id": job_id,
            "sendonce_job_id": job_id,  # sendgrid custom argument
            "sendonce-job-id": job_id,  # postmark metadata, resend tags
            JOB_ID_HEADER: job_id,  # resend headers
            "account_id": st.just(account["id"]),
            "to": emails,
            "Email": emails,
            "Recipient": emails,
            "occurred_at": MOMENTS,
            "created_at": MOMENTS,
            "TopicArn": st.just(TOPIC),
            "Message": _ses_messages(emails, job_id),  # of an SNS notification
            # Signed links: a signup's verification, a double opt-in confirmation.
            "token": st.sampled_from(
                [
                    keys.sign(VERIFY_PURPOSE, {"a": account["id"], "s": signup_id, "w": 1, "g": 1}),
                    keys.sign(OPTIN_PURPOSE, {"a": account["id"], "l": lists[1], "s": subscriber_id}),
                ]
            ),
        },
    )


def _csv(emails: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """CSV files with an email column first, a few other columns, and cells of any text."""
    header = st.sampled_from([["email"], ["Email", "name", "status"], ["email", "reason"], ["email", "city", ""]])

    def write(rows: list[list[str]]) -> str:
        out = io.StringIO()
        csv.writer(out).writerows(rows)
        return out.getvalue()

    def rows(columns: list[str]) -> st.SearchStrategy[str]:
        row = st.tuples(emails | st.text(max_size=20), *[st.text(max_size=20)] * (len(columns) - 1)).map(list)
        return st.lists(row, min_size=1, max_size=5).map(lambda rows: write([columns, *rows]))

    return header.flatmap(rows)


def _realistic(value: Any, fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """``value`` with the members named in ``fields`` (at any depth) replaced by realistic values."""
    if isinstance(value, dict):
        return st.fixed_dictionaries({k: fields[k] if k in fields else _realistic(v, fields) for k, v in value.items()})
    if isinstance(value, list):
        return st.tuples(*(_realistic(v, fields) for v in value)).map(list)
    return st.just(value)


def _documented_members(case: Case[Any]) -> set[str]:
    """The members the operation's JSON body may have."""
    content = case.operation.definition.raw.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        schema = case.operation.schema.raw_schema["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return set(schema.get("properties", {}))


def _body(case: Case[Any], existing: Existing) -> st.SearchStrategy[Any]:
    if case.media_type == "text/csv":
        return _csv(existing.fields["email"])
    realistic = _realistic(case.body, existing.fields)
    if not isinstance(case.body, dict):
        return realistic
    # Optional members the generator left out, with realistic values (a campaign with a subject...).
    missing = {k: existing.fields[k] for k in _documented_members(case) - set(case.body) if k in existing.fields}
    return st.tuples(realistic, st.fixed_dictionaries(missing)).map(lambda parts: {**parts[1], **parts[0]})


IDEMPOTENCY_KEYS = st.none() | st.text(
    # Printable ASCII and a non-ASCII letter: what a client can put in a header. Control characters
    # (DEL) are refused by the HTTP parser before the app sees the request.
    st.characters(min_codepoint=0x21, max_codepoint=0x7E) | st.just("é"),
    min_size=1,
    max_size=300,
)


def _with_realistic_data(case: Case[Any], existing: Existing) -> st.SearchStrategy[Case[Any]]:
    def build(parts: tuple[Any, Any, str | None]) -> Case[Any]:
        case.body, case.query, key = parts
        if key is not None:
            case.headers["Idempotency-Key"] = key
        return case

    return st.tuples(
        _body(case, existing),
        _realistic(case.query, existing.fields),
        IDEMPOTENCY_KEYS if case.method == "POST" else st.none(),
    ).map(build)


MODES = ("positive", "realistic", "negative")
"""Valid requests as the schema allows them; the same with ids, addresses, templates, times and CSV
files made to look like real use; invalid requests (a wrong type, a value out of range...)."""


def _strategy(
    operation: Any, mode: str, existing: Existing, provider: str | None = None
) -> st.SearchStrategy[Case[Any]]:
    """Cases as generated, and with path parameters that name something that exists (for a webhook
    ``provider``: the path names it, always)."""
    generation = GenerationMode.NEGATIVE if mode == "negative" else GenerationMode.POSITIVE
    names = [p.name for p in operation.path_parameters]
    paths: list[dict[str, Any] | None] = [None]  # as generated
    if provider is not None:
        paths = [{"provider": provider}]
    elif names and all(name in existing.path for name in names):
        paths += [{name: value} for name in names for value in existing.path[name]]
    cases = st.one_of([operation.as_strategy(generation_mode=generation, path_parameters=path) for path in paths])
    if mode == "realistic":
        if provider in PROVIDER_FIELDS:
            existing = replace(existing, fields={**existing.fields, **PROVIDER_FIELDS[provider]})
        return cases.flatmap(lambda case: _with_realistic_data(case, existing))
    return cases


def _mutable(operation: Any) -> bool:
    """Whether the operation has any input that negative generation can make invalid."""
    return any(len(part) for part in (operation.path_parameters, operation.query, operation.headers)) or bool(
        list(operation.body)
    )


WEBHOOK = "POST /v1/webhooks/{provider}"
UNREACHABLE = {WEBHOOK}
"""Operations no generated request gets a 2xx from: webhooks need the provider's signature, which the
test adds only to the requests of the operation narrowed to one provider (labelled with its name)."""


def _now() -> str:
    return str(int(time.time()))


SIGNATURES: dict[str, Callable[[bytes], dict[str, str]]] = {
    "generic": lambda body: generic_headers(body, ts=_now()),
    # svix-id is the event id, which Svix keeps when it sends a message again: the same body, the same id.
    "resend": lambda body: svix_headers(body, msg_id=f"msg_{hashlib.sha256(body).hexdigest()[:24]}", ts=_now()),
    "postmark": lambda body: {"X-Sendonce-Webhook-Token": POSTMARK_TOKEN},
    "sendgrid": lambda body: sendgrid_headers(body, ts=_now()),
}
"""The headers that sign a request's body, per provider the test app holds the secret of. (SES signs
inside the body: see ``_sns_signed``.)"""

SNS_TYPES = ("Notification", "SubscriptionConfirmation", "UnsubscribeConfirmation")
SIGNED = (*SIGNATURES, "ses")
"""The providers whose requests the test signs."""

PROVIDER_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    # Mostly notifications, whose realistic Message is an SES record (the other types carry none).
    "ses": {"Type": st.just("Notification") | st.sampled_from(SNS_TYPES)},
}
"""Realistic values of the members of one provider's format (the webhook operation narrowed to it)."""


def _sns_signed(body: Any) -> tuple[Any, dict[str, str]]:
    """``body`` as SNS would post it from our topic, and its headers: signed with the test's SNS key, whose
    certificate the route holds (api fixture). A body that is no SNS message (not an object, no known
    ``Type``) is left as generated: the parser refuses it before it looks for a signature."""
    if not isinstance(body, dict) or body.get("Type") not in SNS_TYPES:
        return body, {}
    version = body.get("SignatureVersion")
    envelope = {
        **body,
        "TopicArn": TOPIC,
        "SigningCertURL": CERT_URL,
        "SignatureVersion": version if version in ("1", "2") else "2",
    }
    sns_sign(envelope)
    return envelope, {"x-amz-sns-message-type": envelope["Type"]}


def _label(operation: Any, provider: str | None) -> str:
    label: str = operation.label
    return label if provider is None else label.replace("{provider}", provider)


def _for_provider(raw_schema: dict[str, Any], provider: str) -> Any:
    """The webhook operation as ``provider`` calls it: its JSON body narrowed to that provider's format,
    and no headers to generate (the test sets the ones that sign)."""
    raw = copy.deepcopy(raw_schema)
    post = raw["paths"]["/v1/webhooks/{provider}"]["post"]
    post["parameters"] = [parameter for parameter in post["parameters"] if parameter["in"] != "header"]
    json_body = post["requestBody"]["content"]["application/json"]
    formats = {schema["title"]: schema for schema in json_body["schema"]["anyOf"]}
    json_body["schema"] = formats[provider]
    operation = schemathesis.openapi.from_dict(raw, config=schemathesis.Config()).find_operation_by_label(WEBHOOK)
    assert operation is not None
    return operation


def _sent_body(case: Case[Any], base_url: str) -> bytes:
    """The body exactly as ``case.call`` will send it: the bytes a signature covers."""
    body = requests.Request(**case.as_transport_kwargs(base_url=base_url)).prepare().body
    assert body is None or isinstance(body, bytes), body  # JSON and text are serialized to bytes
    return body or b""


@dataclass
class Fuzzer:
    """Sends the generated requests of one operation to the API, and checks every answer."""

    base_url: str
    session: requests.Session
    ledger: Ledger
    existing: Existing
    succeeded: set[str]
    """Operations that answered at least one request with a 2xx: the fuzzing got past validation. (The
    webhook operation narrowed to one provider is labelled with the provider's name.)"""

    def run(self, operation: Any, mode: str, provider: str | None = None) -> None:
        """Fuzz ``operation``; with a ``provider``, the webhook operation as it calls it, each request signed."""
        headers = ADMIN if operation.path.startswith("/v1/accounts") else self.existing.auth
        label = _label(operation, provider)

        @SETTINGS
        @given(case=_strategy(operation, mode, self.existing, provider))
        def fuzz(case: Case[Any]) -> None:
            if case.path_parameters and case.path_parameters.get("campaign_id") == NEW_DRAFT:
                case.path_parameters = {**case.path_parameters, "campaign_id": self.existing.new_draft()}
                self.ledger.written()  # the draft is not the request's doing
            if provider == "ses":
                case.body, signature = _sns_signed(case.body)
                case.headers.update(signature)
            elif provider is not None:
                case.headers.update(SIGNATURES[provider](_sent_body(case, self.base_url)))
            response = case.call(
                base_url=self.base_url, session=self.session, headers=headers, timeout=30, allow_redirects=False
            )
            check(case, response, self.ledger.written(), signed=provider is not None)
            if 200 <= response.status_code < 300:
                self.succeeded.add(label)

        fuzz()


@pytest.mark.timeout(900)  # about 2,250 requests: 40 s on 2 cores, longer with SENDONCE_FUZZ_EXAMPLES
def test_no_generated_request_gets_a_500_a_bare_error_or_a_partial_write(api: ApiServer, database_url: str) -> None:
    existing = _existing(api, database_url)
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json", config=schemathesis.Config())
    operations: list[tuple[Any, str | None]] = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operations.append((result.ok(), None))
    operations += [(_for_provider(schema.raw_schema, provider), provider) for provider in SIGNED]
    failures: dict[str, str] = {}
    with closing(Ledger(database_url)) as ledger, requests.Session() as session:
        fuzzer = Fuzzer(api.url, session, ledger, existing, succeeded=set())
        for operation, provider in operations:
            for mode in MODES:
                if mode == "negative" and not _mutable(operation):
                    continue
                try:
                    fuzzer.run(operation, mode, provider)
                except Exception as exc:  # every operation is fuzzed; the failures are reported together
                    failures[f"{_label(operation, provider)} ({mode})"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    assert not failures, "\n".join(f"{label}: {message}" for label, message in failures.items())
    assert {_label(operation, provider) for operation, provider in operations} - fuzzer.succeeded == UNREACHABLE
    # Signed requests of each provider got past the signature, their parser and ingestion (a 2xx).
    assert {WEBHOOK.replace("{provider}", p) for p in SIGNED} <= fuzzer.succeeded
