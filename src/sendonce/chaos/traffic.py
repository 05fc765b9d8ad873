"""What clients do, through the real ``sendonce api`` processes: set up, sign up, opt out, pause, resume.

Clients behave as real ones do under chaos: an API process that dies, or a database that is
restarting (503), is answered by retrying, on another API process if there is one. Writes that are
retried carry an ``Idempotency-Key``, so a retry after a lost answer is safe. Signups deliberately
do not: their own idempotency (one verification mail per address and origin within the window) is
part of what is under test.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg

from sendonce.chaos.sinks import address_key

RETRY_STATUSES = frozenset({502, 503, 504})


class ApiUnavailable(Exception):
    """No API process gave a usable answer before the deadline."""


class Api:
    """A client of the API processes whose base URLs ``bases()`` returns (it changes as they die)."""

    def __init__(
        self,
        bases: Callable[[], list[str]],
        rng: random.Random,
        token: str | None = None,
        *,
        revive: Callable[[], None] | None = None,
    ) -> None:
        self.bases = bases
        self.token = token
        self.revive = revive
        """Called while no API process is alive: the harness's thread that respawns them may be the
        one waiting here (an opt-out made from the chaos timeline, whose API process killed itself)."""
        self._rng = rng
        self._lock = threading.Lock()
        self.client = httpx.Client(timeout=15.0)

    def close(self) -> None:
        self.client.close()

    def _pick(self) -> str | None:
        bases = self.bases()
        if not bases:
            return None
        with self._lock:
            return self._rng.choice(bases)

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        idempotency_key: str | None = None,
        within: float = 60.0,
        base: str | None = None,
    ) -> httpx.Response:
        """One request, retried through dead processes and 503s until ``within`` seconds have passed."""
        sent_headers = {**(headers or {})}
        bearer = token or self.token
        if bearer:
            sent_headers["Authorization"] = f"Bearer {bearer}"
        if idempotency_key:
            sent_headers["Idempotency-Key"] = idempotency_key
        deadline = time.monotonic() + within
        last = "no API process"
        while time.monotonic() < deadline:
            target = base or self._pick()
            if target is None:
                if self.revive is not None:
                    self.revive()
                time.sleep(0.1)
                continue
            try:
                response = self.client.request(
                    method, f"{target}{path}", json=json, content=content, headers=sent_headers
                )
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.05)
                continue
            in_flight = response.status_code == 409 and idempotency_key is not None and "in progress" in response.text
            if response.status_code in RETRY_STATUSES or in_flight:
                last = f"{response.status_code} {response.text[:200]}"
                time.sleep(0.2)
                continue
            return response
        raise ApiUnavailable(f"{method} {path}: {last}")

    def write(self, path: str, json: Any = None, **kwargs: Any) -> dict[str, Any]:
        """A POST that must succeed (2xx), made safe to retry with an Idempotency-Key."""
        kwargs.setdefault("idempotency_key", f"chaos-{uuid.uuid4().hex}")
        response = self.request("POST", path, json=json, **kwargs)
        if response.status_code >= 300:
            raise ApiUnavailable(f"POST {path}: {response.status_code} {response.text[:500]}")
        body = response.json()
        assert isinstance(body, dict)
        return body

    def read(self, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self.request("GET", path, **kwargs)
        if response.status_code != 200:
            raise ApiUnavailable(f"GET {path}: {response.status_code} {response.text[:500]}")
        body = response.json()
        assert isinstance(body, dict)
        return body


# -- set-up -------------------------------------------------------------------------------------


@dataclass
class CampaignSetup:
    account_id: int
    api_key: str
    campaign_id: int
    list_ids: list[int]
    intended: set[str]
    """Address keys of everyone the campaign is for (one per person, however often they are listed)."""
    listed: int
    """Rows imported (an address may be in two lists, typed in another case)."""


def plan_addresses(recipients: int) -> tuple[list[str], list[str]]:
    """Two overlapping lists covering ``recipients`` people; part of the overlap is typed in another case."""
    addresses = [f"r{i:06d}@chaos.test" for i in range(recipients)]
    list_a = addresses[: int(recipients * 0.7)]
    list_b = addresses[int(recipients * 0.3) :]
    overlap = len(list_a) - int(recipients * 0.3)
    for i in range(min(50, max(overlap, 0))):
        local, _, domain = list_b[i].partition("@")
        list_b[i] = f"{local.upper()}@{domain.upper()}"
    return list_a, list_b


def setup_campaign(api: Api, admin_token: str, recipients: int) -> CampaignSetup:
    """An account, two overlapping lists, their subscribers and a draft campaign, through the API."""
    account = api.write("/v1/accounts", {"name": "Chaos Weekly", "from_email": "news@sender.test"}, token=admin_token)
    api.token = str(account["api_key"])
    list_a, list_b = plan_addresses(recipients)
    list_ids = []
    for name, members in (("weekly", list_a), ("announcements", list_b)):
        list_id = int(api.write("/v1/lists", {"name": name})["id"])
        list_ids.append(list_id)
        csv = ("email\n" + "\n".join(members) + "\n").encode()
        imported = api.write(
            f"/v1/subscribers/import?list={list_id}",
            content=csv,
            headers={"Content-Type": "text/csv"},
            within=180.0,
        )
        if imported.get("errors"):
            raise ApiUnavailable(f"import into list {list_id} reported errors: {imported}")
    campaign = api.write(
        "/v1/campaigns",
        {
            "name": "Chaos issue",
            "subject": "Chaos issue for {{ email }}",
            "text": "Hello {{ email }},\n\nthis message must reach you exactly once.\n",
            "lists": list_ids,
        },
    )
    intended = {address_key(a) for a in list_a + list_b}
    return CampaignSetup(
        int(account["id"]), str(account["api_key"]), int(campaign["id"]), list_ids, intended, len(list_a + list_b)
    )


def approve(api: Api, campaign_id: int) -> None:
    api.write(f"/v1/campaigns/{campaign_id}/approve", {})


# -- signup traffic -----------------------------------------------------------------------------


@dataclass
class SignupTraffic:
    """Signups (origin ``web``) from several client threads, each address asked for 1 to 3 times:
    now and then twice at the same instant on two API processes, or again after an answer was lost."""

    api: Api
    count: int
    rng: random.Random
    pace: float
    """Seconds each thread waits between two requests (spreads the signups over the campaign)."""
    threads: int = 4
    within: float = 120.0
    answers: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    unanswered: dict[str, str] = field(default_factory=dict)
    requests: int = 0
    """Requests that got an answer."""
    planned: int = 0
    _jobs: queue.Queue[str | None] = field(default_factory=queue.Queue)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def emails(self) -> list[str]:
        return [f"s{i:05d}@signup.test" for i in range(self.count)]

    def start(self) -> SignupTraffic:
        plan: list[list[str]] = []
        for email in self.emails:
            copies = self.rng.choice((1, 1, 2, 3))
            plan.append([email] * copies)
        self.rng.shuffle(plan)
        self.planned = sum(len(group) for group in plan)
        for group in plan:  # copies of one address side by side: two threads take them at once
            for email in group:
                self._jobs.put(email)
        for _ in range(self.threads):
            self._jobs.put(None)
        for i in range(self.threads):
            thread = threading.Thread(target=self._run, name=f"chaos-signups-{i}", daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            email = self._jobs.get()
            if email is None:
                return
            try:
                response = self.api.request(
                    "POST", "/v1/signups", json={"email": email, "origin": "web"}, within=self.within
                )
                with self._lock:
                    self.requests += 1
                    self.answers[email].append(response.status_code)
            except ApiUnavailable as exc:
                with self._lock:
                    self.unanswered[email] = str(exc)
            if self.pace > 0:
                self._stop.wait(self.pace * self.rng.uniform(0.5, 1.5))

    def done(self) -> bool:
        return not any(t.is_alive() for t in self._workers)

    def wait(self, timeout: float) -> bool:
        """Wait for every planned request to be answered; False if the time ran out."""
        deadline = time.monotonic() + timeout
        for thread in self._workers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        done = not any(t.is_alive() for t in self._workers)
        if not done:
            self._stop.set()
        return done

    def acknowledged(self) -> set[str]:
        """Address keys whose signup was accepted (201 new, or 200 a repeat of one)."""
        with self._lock:
            return {address_key(e) for e, codes in self.answers.items() if any(c in (200, 201) for c in codes)}

    def refused(self) -> dict[str, list[int]]:
        with self._lock:
            return {e: codes for e, codes in self.answers.items() if not any(c in (200, 201) for c in codes)}

    def created_twice(self) -> list[str]:
        with self._lock:
            return sorted(e for e, codes in self.answers.items() if codes.count(201) > 1)

    def created(self) -> int:
        with self._lock:
            return sum(codes.count(201) for codes in self.answers.values())


# -- opt-outs -------------------------------------------------------------------------------------


def _lock_queued_row(
    conn: psycopg.Connection[Any], account_id: int, campaign_id: int, skip: int, arrived: list[str]
) -> str | None:
    row = conn.execute(
        # No earlier attempt can have reached the recipient: never claimed, given back unsent, or
        # refused cleanly (NOT uncertain); or re-queued after its worker died without its message in
        # the inbox (a dead worker sends nothing more, and its row is re-queued only after its lease,
        # long after anything it had written reached the inbox).
        "SELECT d.email FROM sendonce.deliveries d WHERE d.account_id = %s AND d.campaign_id = %s "
        "AND d.status = 'queued' AND (NOT d.uncertain OR d.job_id <> ALL(%s)) AND NOT EXISTS ("
        "SELECT 1 FROM sendonce.suppressions x WHERE x.account_id = d.account_id AND x.email_key = d.email_key) "
        "ORDER BY d.delivery_id DESC OFFSET %s LIMIT 1 FOR UPDATE OF d SKIP LOCKED",
        (account_id, campaign_id, arrived, skip),
    ).fetchone()
    return str(row[0]) if row else None


def opt_out_before_claim(
    db_url: str, account_id: int, campaign_id: int, depth: int, arrived: list[str], *, via_api: Api | None
) -> str | None:
    """Suppress a recipient whose row is still queued (``depth`` rows from the back of the queue) and
    whose message is not among ``arrived`` (job ids the sink has), holding that row so no claim can
    take it first.

    The suppression commits (by SQL in the same transaction, or through ``POST /v1/suppressions``
    while the row is held) before the row can be claimed: the recipient must get nothing.
    """
    with psycopg.connect(db_url) as conn, conn.transaction():
        email = _lock_queued_row(conn, account_id, campaign_id, depth, arrived)
        if email is None:
            return None
        if via_api is None:
            conn.execute(
                "INSERT INTO sendonce.suppressions (account_id, email_key, email, reason) "
                "VALUES (%s, %s, %s, 'unsubscribe') ON CONFLICT DO NOTHING",
                (account_id, address_key(email), email),
            )
        else:
            via_api.write("/v1/suppressions", {"email": email, "reason": "unsubscribe"}, within=30.0)
    return email


def being_sent(db_url: str, account_id: int, campaign_id: int) -> str | None:
    """A recipient whose message is in flight right now (claimed, not recorded), if any."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT email FROM sendonce.deliveries WHERE account_id = %s AND campaign_id = %s AND status = 'sending' "
            "ORDER BY random() LIMIT 1",
            (account_id, campaign_id),
        ).fetchone()
    return str(row[0]) if row else None


def opt_out_racing(api: Api, email: str) -> None:
    """Suppress an address whose row may be anywhere (queued, being sent, sent): a real race."""
    api.write("/v1/suppressions", {"email": email, "reason": "unsubscribe"}, within=30.0)


# -- pause and resume -----------------------------------------------------------------------------


def racing_transition(api: Api, bases: list[str], campaign_id: int, action: str) -> list[int]:
    """The same transition sent at the same instant to two API processes; returns the statuses."""
    with ThreadPoolExecutor(max_workers=len(bases)) as pool:
        futures = [
            pool.submit(api.request, "POST", f"/v1/campaigns/{campaign_id}/{action}", json=None, base=b, within=30.0)
            for b in bases
        ]
        statuses = []
        for future in futures:
            with contextlib.suppress(ApiUnavailable):
                statuses.append(future.result().status_code)
    return sorted(statuses)
