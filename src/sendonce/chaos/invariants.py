"""The verdict: what must hold after a scenario, read from what arrived, not from sendonce's tables.

Mail that arrived is counted per recipient and per job id from the sinks. sendonce's own view is
read only to be compared with it: the campaign's counts (through ``GET /v1/campaigns/{id}``), the
``possible_duplicate`` ledger (a duplicate that is not in it is a silent one), and the audit of
recorded outcomes (see :mod:`sendonce.chaos.database`) for fencing.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import psycopg

from sendonce.chaos.database import clock_offset
from sendonce.chaos.sinks import Arrival


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Expectation:
    """Who must get what."""

    campaign_id: int
    intended: set[str]
    """Address keys the campaign is for."""
    opted_out_before_claim: set[str] = field(default_factory=set)
    """Suppressed while their row was held queued: must get nothing."""
    opted_out_racing: set[str] = field(default_factory=set)
    """Suppressed at any moment: nothing or one message, never lost (their row ends sent or suppressed)."""
    signups: set[str] = field(default_factory=set)
    """Addresses whose signup was acknowledged: exactly one verification mail each."""
    duplicate_bound: int = 0
    """SMTP: most copies the faults can explain (messages in flight at kills, dropped answers, ...)."""
    explained: Counter[str] | None = None
    """SMTP, per job id: re-sent copies that faults which hit that job can explain (see
    :func:`sendonce.chaos.harness.explained_copies`); None: not checked job by job."""
    unpinned: int = 0
    """SMTP: copies of any job that faults which cannot be pinned to jobs can explain."""


@dataclass
class DatabaseView:
    """sendonce's own account of the campaign, read at the end (through the API where it can be)."""

    status: str
    counts: dict[str, int]
    ledger: set[str]
    """Job ids in the possible_duplicate ledger (campaign and transactional)."""
    api_ledger: set[str]
    """Job ids ``GET /v1/campaigns/{id}/duplicates`` lists (its first 1000 entries; one per re-sent attempt)."""
    suppressed_rows: set[str]
    """Address keys whose campaign row ended 'suppressed'."""
    zombies: list[dict[str, Any]]
    """Outcomes recorded by a worker on a row another worker held (the audit trigger)."""
    outcomes_audited: int
    ledger_attempts: Counter[str] = field(default_factory=Counter)
    """Ledger rows per job id: one per re-sent attempt."""
    ledger_times: dict[str, list[float]] = field(default_factory=dict)
    """Per job id: when each of its ledger rows was written (epoch seconds, the claim's time)."""
    uncertain_suppressed: set[str] = field(default_factory=set)
    """Among the suppressed rows, those an earlier attempt of which may have reached the recipient
    (counted in ``possibly_delivered``): a delivery there is expected, not a mismatch."""
    addressee: dict[str, str] | None = None
    """Whom each job is for (its address key), by :func:`person_of` of its job id: a campaign's job
    names its subscriber, a signup's its signup window. Read from the subscribers and signups the
    run created, not from the deliveries that sent the mail; None: not checked."""


@dataclass
class Verdict:
    delivered: int = 0
    """Intended campaign recipients and acknowledged signups that received their message."""
    delivered_signups: int = 0
    duplicates: int = 0
    recorded: int = 0
    unrecorded: int = 0
    lost: int = 0
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, ok, detail))

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def read_database(
    url: str,
    account_id: int,
    campaign_id: int,
    api_view: dict[str, Any],
    api_ledger: set[str],
    clock: Callable[[], float] = time.time,
) -> DatabaseView:
    """What the database says of the run; the ledger's times on ``clock``, the inbox's (they are
    compared with its arrival times)."""
    with psycopg.connect(url) as conn:
        offset = clock_offset(conn, clock)
        ledger_times: dict[str, list[float]] = defaultdict(list)
        for job_id, at in conn.execute(
            "SELECT job_id, extract(epoch FROM recorded_at)::float8 FROM sendonce.possible_duplicates"
        ).fetchall():
            ledger_times[str(job_id)].append(float(at) - offset)
        ledger_attempts = Counter({job: len(times) for job, times in ledger_times.items()})
        ledger = set(ledger_attempts)
        suppressed = {
            str(r[0])
            for r in conn.execute(
                "SELECT email_key FROM sendonce.deliveries WHERE account_id = %s AND campaign_id = %s "
                "AND status = 'suppressed'",
                (account_id, campaign_id),
            ).fetchall()
        }
        uncertain_suppressed = {
            str(r[0])
            for r in conn.execute(
                "SELECT email_key FROM sendonce.deliveries WHERE account_id = %s AND campaign_id = %s "
                "AND status = 'suppressed' AND uncertain",
                (account_id, campaign_id),
            ).fetchall()
        }
        zombies = [
            dict(zip(("job_id", "attempt", "claimed_by", "recorder", "old_status", "new_status"), r, strict=True))
            for r in conn.execute(
                "SELECT job_id, attempt, claimed_by, recorder, old_status, new_status FROM chaos.outcomes "
                "ORDER BY recorded_at"
            ).fetchall()
        ]
        audited = conn.execute("SELECT count(*) FROM chaos.outcomes").fetchone()
        addressee = {
            str(job): str(key)
            for job, key in conn.execute(
                "SELECT 'campaign:' || %s::bigint || ':' || subscriber_id, email_key FROM sendonce.subscribers "
                "WHERE account_id = %s UNION ALL "
                "SELECT 'signup:' || w.window_id, s.email_key FROM sendonce.signup_windows w "
                "JOIN sendonce.signups s USING (account_id, signup_id) WHERE w.account_id = %s",
                (campaign_id, account_id, account_id),
            ).fetchall()
        }
    return DatabaseView(
        status=str(api_view["status"]),
        counts={k: int(v) for k, v in (api_view.get("counts") or {}).items()},
        ledger=ledger,
        ledger_attempts=ledger_attempts,
        ledger_times=dict(ledger_times),
        api_ledger=api_ledger,
        suppressed_rows=suppressed,
        uncertain_suppressed=uncertain_suppressed,
        zombies=zombies,
        outcomes_audited=int(audited[0]) if audited else 0,
        addressee=addressee,
    )


def person_of(job_id: str) -> str:
    """The part of a job id that names whom it is for: all of a campaign's (campaign and subscriber),
    a signup's window without its generation (each new generation of a window is the same person's)."""
    if job_id.startswith("signup:"):
        return ":".join(job_id.split(":")[:2])
    return job_id


def zombie_completions(outcomes: list[dict[str, Any]], pids: dict[str, int]) -> list[dict[str, Any]]:
    """Outcomes recorded by a process other than the one that held the row's claim.

    ``pids`` maps each process's ``application_name`` to its pid; a worker's name (``claimed_by``) is
    ``host:pid:suffix``. A legitimate outcome always comes from the claimant (its attempt matches,
    so nobody re-claimed the row since); anything else completed a row it no longer owned.
    """
    found = []
    for row in outcomes:
        recorder_pid = pids.get(str(row["recorder"]))
        claimed_by = str(row["claimed_by"] or "")
        parts = claimed_by.split(":")
        claimant_pid = int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None
        if recorder_pid is None or claimant_pid is None:
            continue
        if recorder_pid != claimant_pid:
            found.append(row)
    return found


def _scope(job_id: str | None) -> str:
    if job_id is None:
        return "unknown"
    if job_id.startswith("campaign:"):
        return "campaign:" + job_id.split(":")[1]
    return job_id.split(":")[0]


def judge(
    arrivals: list[Arrival],
    expect: Expectation,
    view: DatabaseView,
    *,
    idempotent: bool,
    zombies: list[dict[str, Any]],
) -> Verdict:
    verdict = Verdict()
    campaign_scope = f"campaign:{expect.campaign_id}"
    per_address: dict[str, Counter[str]] = defaultdict(Counter)  # scope -> address -> copies
    jobs_of: dict[tuple[str, str], set[str]] = defaultdict(set)
    arrived_at: dict[str, list[float]] = defaultdict(list)  # job id -> when each copy arrived
    strangers: list[Arrival] = []
    for arrival in arrivals:
        scope = _scope(arrival.job_id)
        if scope not in (campaign_scope, "signup"):
            strangers.append(arrival)
            continue
        per_address[scope][arrival.recipient] += 1
        jobs_of[(scope, arrival.recipient)].add(str(arrival.job_id))
        arrived_at[str(arrival.job_id)].append(arrival.at)

    campaign = per_address[campaign_scope]
    signups = per_address["signup"]

    # -- nobody lost -----------------------------------------------------------------------------
    must_receive = expect.intended - expect.opted_out_before_claim - expect.opted_out_racing
    lost = sorted(a for a in must_receive if campaign[a] == 0)
    racing_lost = sorted(a for a in expect.opted_out_racing if campaign[a] == 0 and a not in view.suppressed_rows)
    signup_lost = sorted(a for a in expect.signups if signups[a] == 0)
    verdict.lost = len(lost) + len(racing_lost) + len(signup_lost)
    verdict.delivered_signups = sum(1 for a in expect.signups if signups[a] > 0)
    verdict.delivered = sum(1 for a in expect.intended if campaign[a] > 0) + verdict.delivered_signups
    verdict.add(
        "every intended recipient received the campaign",
        not lost and not racing_lost,
        _sample("missing", lost + racing_lost),
    )
    verdict.add(
        "every acknowledged signup received its verification mail",
        not signup_lost,
        _join(f"{len(expect.signups)} acknowledged", _sample("missing", signup_lost)),
    )

    # -- opt-outs --------------------------------------------------------------------------------
    leaked = sorted(a for a in expect.opted_out_before_claim if campaign[a] > 0)
    if expect.opted_out_before_claim or expect.opted_out_racing:
        verdict.add(
            "opt-outs that landed before the claim were honoured",
            not leaked,
            _join(
                f"{len(expect.opted_out_before_claim)} before claim, {len(expect.opted_out_racing)} racing",
                _sample("received anyway", leaked),
            ),
        )

    # -- nothing that was not intended -----------------------------------------------------------
    unintended = sorted({a for a in campaign if a not in expect.intended})
    unasked = sorted({a for a in signups if a not in expect.signups})
    verdict.add(
        "no mail to anyone who was not meant to get it",
        not unintended and not unasked and not strangers,
        "; ".join(
            part
            for part in (
                _sample("campaign to", unintended),
                _sample("verification to", unasked),
                _sample("unknown job", sorted({str(s.job_id) for s in strangers})),
            )
            if part
        ),
    )

    # -- each message reached the person it was made for -----------------------------------------
    if view.addressee is not None:
        addressee = view.addressee
        astray = sorted(
            {
                f"{a.job_id} (for {addressee.get(person_of(str(a.job_id)), 'nobody')}) to {a.recipient}"
                for a in arrivals
                if _scope(a.job_id) in (campaign_scope, "signup")
                and addressee.get(person_of(str(a.job_id))) != a.recipient
            }
        )
        verdict.add("every message reached the person its job is for", not astray, _sample("astray", astray))

    # -- duplicates ------------------------------------------------------------------------------
    recorded = unrecorded = 0
    silent: list[str] = []
    for scope, counter in ((campaign_scope, campaign), ("signup", signups)):
        for address, copies in counter.items():
            if copies < 2:
                continue
            extra = copies - 1
            jobs = jobs_of[(scope, address)]
            # Each re-send is a new attempt, and each re-send after an attempt that may have arrived
            # is one ledger row, written by the claim that re-sends it: every extra copy needs a ledger
            # row of its own, written after the copy before it arrived and before it did. (A row
            # written for a re-send that never went out does not cover a later, silent one.)
            job = next(iter(jobs))
            covered = _covered(sorted(arrived_at[job]), view.ledger_times.get(job, [])) if len(jobs) == 1 else 0
            recorded += min(extra, covered)
            if extra > covered:
                unrecorded += extra - covered
                silent.append(f"{address} x{copies} ({', '.join(sorted(jobs))}; {covered} in the ledger)")
    verdict.duplicates, verdict.recorded, verdict.unrecorded = recorded + unrecorded, recorded, unrecorded
    if idempotent:
        verdict.add(
            "idempotent transport: no duplicate",
            verdict.duplicates == 0,
            _sample("received more than once", silent) if silent else "",
        )
    else:
        verdict.add(
            "SMTP: every duplicate is in the possible_duplicate ledger",
            unrecorded == 0,
            _sample("not in the ledger", silent),
        )
        verdict.add(
            "SMTP: duplicates within the in-flight bound",
            verdict.duplicates <= expect.duplicate_bound,
            f"{verdict.duplicates} duplicate(s), bound {expect.duplicate_bound}",
        )
        if expect.explained is not None:
            explained = expect.explained
            beyond: list[str] = []
            unexplained = 0
            for job, times in arrived_at.items():
                over = len(times) - 1 - explained[job]
                if over > 0:
                    unexplained += over
                    beyond.append(f"{job} x{len(times)} ({explained[job]} explained)")
            verdict.add(
                "SMTP: every duplicate follows a fault that hit its own job",
                unexplained <= expect.unpinned,
                _join(
                    f"{unexplained} copy(ies) not explained by a fault on their job, "
                    f"{expect.unpinned} explainable by faults not pinned to a job",
                    _sample("beyond", sorted(beyond)),
                ),
            )

    # -- sendonce's counts match the inbox -------------------------------------------------------
    counts = view.counts
    # A row suppressed after an attempt that may have delivered it (its worker died after the
    # transport took the message, then the address opted out) is counted in possibly_delivered.
    delivered_campaign = sum(1 for a in expect.intended if campaign[a] > 0 and a not in view.uncertain_suppressed)
    possibly = sum(1 for a in view.uncertain_suppressed if campaign[a] > 0)
    suppressed_expected = len(expect.opted_out_before_claim) + len(
        (expect.opted_out_racing & view.suppressed_rows) - (set(campaign) - view.uncertain_suppressed)
    )
    mismatches = []
    if counts.get("sent") != delivered_campaign:
        mismatches.append(f"sent {counts.get('sent')} but the inbox holds {delivered_campaign} recipients")
    if counts.get("possibly_delivered", 0) < possibly:
        mismatches.append(
            f"possibly_delivered {counts.get('possibly_delivered')} < {possibly} delivered then suppressed"
        )
    if counts.get("suppressed") != suppressed_expected:
        mismatches.append(f"suppressed {counts.get('suppressed')}, expected {suppressed_expected}")
    if counts.get("total") != len(expect.intended):
        mismatches.append(f"total {counts.get('total')} for {len(expect.intended)} people")
    for open_state in ("queued", "sending", "failed"):
        if counts.get(open_state):
            mismatches.append(f"{open_state} {counts[open_state]}")
    delivered_but_suppressed = sorted(
        a for a in view.suppressed_rows if campaign[a] > 0 and a not in view.uncertain_suppressed
    )
    if delivered_but_suppressed:
        mismatches.append(_sample("row 'suppressed' but delivered", delivered_but_suppressed))
    verdict.add("campaign counts equal the inbox counts", not mismatches, "; ".join(mismatches) or _counts(counts))
    if not idempotent:
        campaign_ledger = {j for j in view.ledger if j.startswith(campaign_scope + ":")}
        # /duplicates lists one entry per re-sent attempt, newest first, at most 1000 of them.
        listed_ok = (
            view.api_ledger == campaign_ledger if len(campaign_ledger) < 500 else view.api_ledger <= campaign_ledger
        )
        verdict.add(
            "the API shows the campaign's ledger",
            counts.get("possible_duplicate") == len(campaign_ledger) and listed_ok,
            f"counts.possible_duplicate {counts.get('possible_duplicate')}, /duplicates names "
            f"{len(view.api_ledger)} job(s), ledger {len(campaign_ledger)} job(s)",
        )

    # -- no stuck campaign, no zombie completion -------------------------------------------------
    verdict.add("the campaign finished (not stuck in sending)", view.status == "sent", f"status {view.status}")
    verdict.add(
        "fencing: no worker completed a row it no longer owned",
        not zombies,
        f"{len(zombies)} zombie completion(s) of {view.outcomes_audited} recorded outcomes"
        + (": " + ", ".join(f"{z['job_id']} by {z['recorder']}" for z in zombies[:5]) if zombies else ""),
    )
    return verdict


EXPECTED_ENOUGH = 10.0
"""A fault expected about this often or more must have fired at least once: the chance that it
fires never, if it works, is e^-10 (under 1 in 20,000)."""


def faults_fired(planned: dict[str, float], fired: Counter[str] | dict[str, int]) -> Check:
    """Every fault the run was set to inject that it should have seen about ``EXPECTED_ENOUGH`` times
    or more fired at least once: a fault that never fired tested nothing, and its run is not a pass.

    ``planned``: per fault, about how many times it should have fired (probability times the events
    it is rolled on); ``fired``: how many times it did."""
    due = {name: expected for name, expected in planned.items() if expected >= EXPECTED_ENOUGH}
    silent = sorted(name for name in due if fired.get(name, 0) == 0)
    rare = sorted(name for name, expected in planned.items() if 0 < expected < EXPECTED_ENOUGH)
    return Check(
        f"every fault expected {EXPECTED_ENOUGH:g} times or more fired",
        not silent,
        _join(
            ", ".join(f"{name} {fired.get(name, 0)} (~{due[name]:.0f} expected)" for name in sorted(due))
            or "none expected that often",
            _sample("never fired", silent),
            _sample("too rare to require", rare),
        ),
    )


_CLOCKS = 0.005
"""Seconds of leeway between the inbox's clock and PostgreSQL's, once its offset is taken off (see
:func:`~sendonce.chaos.database.clock_offset`)."""


def _covered(copies: list[float], written: list[float]) -> int:
    """Of the extra copies (arrival times, sorted), how many have a ledger row of their own written
    between the arrival of the copy before them and their own."""
    rows = sorted(written)
    i = covered = 0
    for before, this in pairwise(copies):
        while i < len(rows) and rows[i] < before - _CLOCKS:
            i += 1
        if i < len(rows) and rows[i] <= this + _CLOCKS:
            covered += 1
            i += 1
    return covered


def _sample(label: str, items: list[str], limit: int = 8) -> str:
    if not items:
        return ""
    shown = ", ".join(items[:limit])
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return f"{label}: {shown}{more}"


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())
