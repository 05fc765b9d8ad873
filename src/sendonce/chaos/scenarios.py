"""The scenarios: one function each, reading as the story of the faults it injects.

Every scenario runs a real campaign (two overlapping lists, some addresses typed in another case)
and real signup traffic through real API processes, and ends with the same verdict (see
:mod:`sendonce.chaos.invariants`); what differs is what goes wrong meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from sendonce.chaos.database import RestartNotAllowed, proxy_target, through_proxy
from sendonce.chaos.harness import Context, Harness, RestartWindow, Result, held_by_all, in_flight_bound
from sendonce.chaos.invariants import Check
from sendonce.chaos.processes import Proc
from sendonce.chaos.sinks import ResendSink, SmtpSink, address_key
from sendonce.chaos.traffic import being_sent, opt_out_before_claim, opt_out_racing, racing_transition
from sendonce.store.migrations import available_migrations
from sendonce.testing.inbox import InboxFaults
from sendonce.testing.resend_server import ResendFaults
from sendonce.testing.tcp_proxy import TcpProxy

Event = tuple[float, Callable[[], object]]
"""Something to do once the campaign has reached a fraction of its recipients."""


def hook_faults(recipients: int, kills: int) -> str:
    """SENDONCE_FAULTS for the fleet: about half as many self-inflicted SIGKILLs as external ones,
    at the exact points of the pipeline (most of them between "accepted" and "recorded")."""
    p = min(0.02, max(0.0005, kills / (4.0 * max(recipients, 1))))
    return (
        f"after_accept={p:.5f},before_send={p / 2:.5f},after_claim={p * 5:.5f},after_record={p * 2:.5f},mid_build=0.2"
    )


def _moments(h: Harness, n: int, low: float = 0.03, high: float = 0.95) -> list[float]:
    """``n`` random moments of the campaign, as fractions of its recipients."""
    return sorted(h.rng.uniform(low, high) for _ in range(n))


def _at_progress(h: Harness, events: list[Event]) -> int:
    """Run each event once the campaign has reached its fraction; returns how many ran in time.

    A run that could not inject everything it planned (the campaign stalled, or the machine is too
    slow for ``--timeout``) does not pass: its numbers would not be the ones asked for.
    """
    done = missed = 0
    stalled = ""
    watch = _Stall(h, stall_after=max(10.0, 5 * h.worker_options.lease))
    for fraction, action in sorted(events, key=lambda e: e[0]):
        reached = h.wait_until(lambda f=fraction: watch.reached(f) or watch.stalled(), h.deadline())  # type: ignore[misc]
        if not reached or watch.why:
            stalled = watch.why or f"time ran out (--timeout {h.options.chaos_timeout:.0f}s)"
            h.say(f"  {h.name}: {stalled}, after {done} of {len(events)} events")
            break
        if action() is False:  # it found nothing to act on (late in a small campaign): said below
            missed += 1
        done += 1
        watch.moved()
    h.extra_checks.append(
        Check(
            "every planned fault was injected before the time limit",
            done == len(events),
            f"{done} of {len(events)}"
            + (f", {missed} found nothing to act on" if missed else "")
            + (f": {stalled}" if stalled else ""),
        )
    )
    return done


class _Stall:
    """Notices a campaign that stopped reaching anyone (a stuck build, or a lossy one)."""

    def __init__(self, h: Harness, stall_after: float) -> None:
        self.h = h
        self.stall_after = stall_after
        self.last = -1.0
        self.since = time.monotonic()
        self.why = ""

    def moved(self) -> None:
        self.since = time.monotonic()

    def reached(self, fraction: float) -> bool:
        progress = self.h.progress()
        if progress > self.last:
            self.last, self.since = progress, time.monotonic()
        return progress >= fraction

    def stalled(self) -> bool:
        if time.monotonic() - self.since > self.stall_after:
            self.why = f"nothing new arrived for {self.stall_after:.0f}s, stuck at {self.last:.0%}"
        return bool(self.why)


def _opt_out_events(h: Harness, n: int, *, racing: bool) -> list[Event]:
    """``n`` opt-outs at random moments: held-row ones by SQL and by the API, and (if ``racing``) free ones."""
    assert h.setup is not None and h.expect is not None and h.api is not None
    setup, expect, api = h.setup, h.expect, h.api
    kinds = ["sql", "api", "racing"] if racing else ["sql", "api"]
    events: list[Event] = []

    def held(via_api: bool) -> bool:
        for depth in (h.rng.randrange(0, 20), h.rng.randrange(0, 5), 0):  # a row still queued, if any
            arrived = sorted({str(a.job_id) for a in h.sink.arrivals() if a.job_id})
            email = opt_out_before_claim(
                h.url, setup.account_id, setup.campaign_id, depth, arrived, via_api=api if via_api else None
            )
            if email is not None:
                expect.opted_out_before_claim.add(address_key(email))
                h.faults_injected["opt-out before claim"] = h.faults_injected.get("opt-out before claim", 0) + 1
                return True
        # nothing left queued: not injected, and the run says so
        with psycopg.connect(h.url) as conn:
            rows = conn.execute(
                "SELECT status, uncertain, count(*) FROM sendonce.deliveries WHERE campaign_id = %s GROUP BY 1, 2",
                (setup.campaign_id,),
            ).fetchall()
        h.result.notes.append(
            f"an opt-out before claim found no row to take at {h.progress():.0%}: "
            + ", ".join(f"{st}{' uncertain' if u else ''} {n}" for st, u, n in rows)
        )
        return False

    def race() -> None:
        # Half of them hit a message being sent right now: the literal "opt-out during the send".
        email = being_sent(h.url, setup.account_id, setup.campaign_id) if h.rng.random() < 0.5 else None
        taken = expect.opted_out_before_claim | expect.opted_out_racing
        if email is None or address_key(email) in taken:
            email = h.rng.choice(sorted(expect.intended - taken))
        email = address_key(email)
        opt_out_racing(api, email)
        expect.opted_out_racing.add(email)
        h.faults_injected["opt-out racing"] = h.faults_injected.get("opt-out racing", 0) + 1

    # Not too late: near the end of a small campaign no row may be left that nobody has claimed yet.
    for i, moment in enumerate(_moments(h, n, 0.1, 0.6)):
        kind = kinds[i % len(kinds)]
        if kind != "racing":
            h.opt_outs_planned += 1
        if kind == "racing":
            events.append((moment, race))
        else:
            events.append((moment, functools.partial(held, kind == "api")))
    return events


def _start(h: Harness, *, worker_faults: str | None, api_faults: str | None = None, upgrades: int = 1) -> list[int]:
    codes = h.upgrade(upgrades)
    if any(code != 0 for code in codes):
        codes += h.upgrade(1)  # record the failure, carry on with a schema
    h.start_apis(api_faults)
    h.set_up_campaign()
    h.start_workers(worker_faults)
    h.go()
    return codes


def _end(h: Harness, *, extra_bound: int = 0) -> Result:
    h.finish()
    h.verdict(duplicate_bound=in_flight_bound(h, extra=extra_bound))
    return h.result


# -- kills --------------------------------------------------------------------------------------


def kills(ctx: Context, transport: str) -> Result:
    """SIGKILL workers at random moments, many times; the fault hook kills them at exact points too
    (between "the transport accepted" and "recorded" above all); API processes die after committing
    a signup and before answering. Strict opt-outs land meanwhile."""
    o = ctx.options
    n_kills = o.kills if o.kills is not None else 10
    sink = SmtpSink() if transport == "smtp" else ResendSink()
    with Harness("kills", transport, ctx, sink) as h:
        _start(h, worker_faults=o.faults or hook_faults(o.recipients, n_kills), api_faults="api_after_commit=0.03")
        events: list[Event] = [(m, h.kill_random_worker) for m in _moments(h, n_kills)]
        events += _opt_out_events(h, o.opt_outs // 2, racing=False)
        _at_progress(h, events)
        return _end(h)


# -- database restart -----------------------------------------------------------------------------


def restart(ctx: Context, transport: str) -> Result:
    """Restart PostgreSQL mid-campaign, several times: after an outage longer than the lease, in
    place, and after a ``--down`` outage. Signups keep coming (503 while it is down, retried)."""
    o = ctx.options
    sink = SmtpSink() if transport == "smtp" else ResendSink()
    allowed, why = ctx.server.can_restart()
    if not allowed:
        sink.stop()
        return Result("restart", transport, ctx.server.kind, o.recipients, skipped=why)
    with Harness("restart", transport, ctx, sink) as h:
        _start(h, worker_faults=o.faults)
        # Longer than the lease first (leases run out while nobody can renew), then in place, then --down.
        outages = [h.worker_options.lease + 1.0, 0.0, o.down]
        events: list[Event] = []

        def restart_once(i: int) -> None:
            down = outages[i % len(outages)] if ctx.server.embedded is not None else 0.0
            began = time.time()
            held = held_by_all(h.url)
            try:
                took = ctx.server.restart(down)
            except RestartNotAllowed as exc:
                h.result.notes.append(str(exc))
                return
            h.restart_windows.append(RestartWindow(held, began, time.time()))
            h.result.restarts += 1
            h.result.notes.append(f"restart {i + 1}: PostgreSQL away {took:.1f}s")

        for i in range(o.restarts):
            moment = (i + 1) / (o.restarts + 1) * 0.9
            events.append((moment, functools.partial(restart_once, i)))
        if o.kills:
            events += [(m, h.kill_random_worker) for m in _moments(h, o.kills)]
        _at_progress(h, events)
        h.faults_injected["DB restart"] = h.result.restarts
        return _end(h)


# -- SMTP faults ----------------------------------------------------------------------------------

SMTP_TIMEOUT = 1.0
SLOW_SECONDS = 3.0


def smtp_faults(ctx: Context, transport: str) -> Result:
    """The inbox misbehaves: it drops the connection after DATA and before answering 250, answers
    451 or 421, answers more slowly than the client's ``?timeout=``, or answers the content with a
    line that is not a reply. The lease is long enough here that only the client timeout can cut a
    slow answer short. A drop, a slow answer and a garbled one each follow a message the inbox has."""
    o = ctx.options
    faults = InboxFaults(
        drop_after_data=0.03, temp_fail=0.04, slow=0.03, garbled_reply=0.03, slow_seconds=SLOW_SECONDS, seed=o.seed
    )
    sink = SmtpSink(faults, timeout=SMTP_TIMEOUT)
    with Harness("smtp-faults", "smtp", ctx, sink, lease=max(o.lease, SLOW_SECONDS * 2)) as h:
        _start(h, worker_faults=o.faults)
        if o.kills:
            _at_progress(h, [(m, h.kill_random_worker) for m in _moments(h, o.kills)])
        result = _end(h)
        slow = sink.fault_counts()["slow"]
        # aiosmtplib names them SMTPTimeoutError, SMTPReadTimeoutError, SMTPConnectTimeoutError
        timeouts = sum(len(re.findall(r"SMTP\w*TimeoutError", p.log_text())) for p in h.procs.procs if p.role != "api")
        result.numbers["client_timeouts"] = timeouts
        result.checks.append(
            Check(
                f"SMTP: an answer slower than ?timeout={SMTP_TIMEOUT:g} makes the send time out",
                slow == 0 or timeouts >= slow,
                f"{slow} answer(s) delayed {SLOW_SECONDS:g}s, {timeouts} client timeout(s) logged",
            )
        )
        return result


# -- HTTP provider faults -------------------------------------------------------------------------


def http_faults(ctx: Context, transport: str) -> Result:
    """The provider answers 429 and 500, accepts and then stalls past the client's timeout, and
    answers 409 for a key it has already seen; workers die between "accepted" and "recorded", so
    keys come back."""
    o = ctx.options
    faults = ResendFaults(
        rate_limited=0.05,
        server_error=0.05,
        accept_then_stall=0.03,
        stall_seconds=3.0,
        replay_conflict=0.5,
        seed=o.seed,
    )
    sink = ResendSink(faults)
    n_kills = o.kills if o.kills is not None else 3
    with Harness("http-faults", "resend", ctx, sink) as h:
        _start(h, worker_faults=o.faults or f"after_accept={min(0.02, max(0.002, 4.0 / o.recipients)):.4f}")
        _at_progress(h, [(m, h.kill_random_worker) for m in _moments(h, n_kills)])
        return _end(h)


# -- races --------------------------------------------------------------------------------------


@dataclass
class _Pause:
    acknowledged: float
    resumed: float


RACES_PACE = 0.03
"""Seconds each message of the races scenario waits for its 250: a dozen connections then send a few
hundred a second, so each pause finds the campaign still sending."""


def races(ctx: Context, transport: str) -> Result:
    """Two ``sendonce db upgrade`` at once on an empty database; opt-outs during the send (held rows
    by SQL and through the API, and free races); the campaign paused and resumed during the send,
    each time by two API processes at once."""
    o = ctx.options
    # Paced (every answer waits RACES_PACE): an unpaced campaign of a few hundred recipients can
    # finish between the progress check and the second pause, which then has nothing to pause.
    sink = SmtpSink(InboxFaults(pace=RACES_PACE)) if transport == "smtp" else ResendSink()
    with Harness("races", transport, ctx, sink) as h:
        codes = _start(h, worker_faults=o.faults, upgrades=o.upgrades)
        with psycopg.connect(h.url) as conn:
            row = conn.execute(
                "SELECT count(*), count(DISTINCT version) FROM sendonce_meta.schema_migrations"
            ).fetchone()
        expected = len(available_migrations())
        h.extra_checks.append(
            Check(
                f"{o.upgrades} concurrent `sendonce db upgrade`: all succeed, each migration applied once",
                codes[: o.upgrades] == [0] * o.upgrades and row is not None and tuple(row) == (expected, expected),
                f"exit codes {codes[: o.upgrades]}, {row[0] if row else '?'} migration rows for {expected} migrations",
            )
        )
        assert h.api is not None and h.setup is not None
        api, campaign_id = h.api, h.setup.campaign_id
        pauses: list[_Pause] = []
        contests: list[str] = []

        def pause_and_resume() -> None:
            bases = [p.base_url for p in h.procs.live("api")][:2]
            if len(bases) < 2:
                bases = bases * 2
            paused = racing_transition(api, bases, campaign_id, "pause")
            acknowledged = time.time()
            hold = h.worker_options.lease + 2.0
            h.wait_until(lambda: False, time.monotonic() + hold, step=0.05)
            resumed_at = time.time()
            resumed = racing_transition(api, bases, campaign_id, "resume")
            pauses.append(_Pause(acknowledged, resumed_at))
            contests.extend([f"pause {paused}", f"resume {resumed}"])

        events = _opt_out_events(h, o.opt_outs, racing=True)
        events += [((i + 1) / (o.pauses + 1) * 0.9, pause_and_resume) for i in range(o.pauses)]
        if o.kills:
            events += [(m, h.kill_random_worker) for m in _moments(h, o.kills)]
        _at_progress(h, events)
        h.faults_injected["pause/resume"] = len(pauses)
        h.extra_checks.append(
            Check(
                "two concurrent pauses (resumes): exactly one wins, the other gets 409",
                all(c.endswith("[200, 409]") for c in contests),
                "; ".join(contests) or "no pause reached",
            )
        )
        grace = h.worker_options.lease + 1.0
        prefix = h.campaign_prefix
        while_paused = []
        for pause in pauses:
            window = (pause.acknowledged + grace, pause.resumed)
            while_paused += [
                a for a in sink.arrivals() if (a.job_id or "").startswith(prefix) and window[0] < a.at < window[1]
            ]
        h.extra_checks.append(
            Check(
                f"a paused campaign goes quiet within a lease ({grace:g}s)",
                not while_paused,
                f"{len(while_paused)} message(s) arrived while paused"
                if while_paused
                else f"{len(pauses)} pause(s) held {h.worker_options.lease + 2.0:g}s",
            )
        )
        return _end(h)


# -- network partition ------------------------------------------------------------------------------


def _held_by(url: str, pid: int) -> list[str]:
    """Job ids of the rows worker ``pid`` holds (claimed, not recorded)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT job_id FROM sendonce.deliveries WHERE status = 'sending' AND claimed_by LIKE %s",
            (f"%:{pid}:%",),
        ).fetchall()
    return [str(r[0]) for r in rows]


def _still_theirs(url: str, pid: int, job_ids: list[str]) -> int:
    """Rows of ``job_ids`` nobody else has claimed yet (still leased by ``pid``, or requeued under it)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM sendonce.deliveries WHERE job_id = ANY(%s) "
            "AND status IN ('sending', 'queued') AND claimed_by LIKE %s",
            (job_ids, f"%:{pid}:%"),
        ).fetchone()
    return int(row[0]) if row else 0


def partition(ctx: Context, transport: str) -> Result:
    """One worker reaches PostgreSQL through a TCP proxy that is paused (packets dropped) or cut
    (connections reset) for longer than the lease. The others take its rows over; when it comes
    back, its late outcomes must be refused (fencing), and while cut off it must go quiet by its
    lease's end. It sends to an inbox of its own, so what it sent, and when, can be told apart."""
    sink = SmtpSink()
    # Its own inbox answers each message after 0.4s (within the client's timeout: late, not
    # ambiguous): at the cut its lanes are mid-send, so it comes back holding accepted messages whose
    # outcome it could not record (what fencing is about).
    sink.add_box("isolated", InboxFaults(late=1.0, late_seconds=0.4))
    with Harness("partition", "smtp", ctx, sink) as h:
        proxy = TcpProxy(**proxy_target(h.url)).start()  # type: ignore[arg-type]
        try:
            return _partition(h, proxy)
        finally:
            with contextlib.suppress(Exception):
                proxy.stop()


def _partition(h: Harness, proxy: TcpProxy) -> Result:
    o = h.options
    sink = h.sink
    assert isinstance(sink, SmtpSink)
    lease = h.worker_options.lease
    h.upgrade(1)
    h.start_apis()
    h.set_up_campaign()
    h.start_workers(o.faults, count=max(1, o.workers - 1))
    isolated: Proc = h.procs.spawn_worker(
        sink.url("isolated"), role="isolated", db_url=through_proxy(h.url, proxy.port)
    )
    h.go()
    modes = ["pause", "cut"] if o.partition_mode == "both" else [o.partition_mode]
    # "both" with one partition: the seed picks which (it was always "pause", so "cut" never ran)
    modes = modes[o.seed % len(modes) :] + modes[: o.seed % len(modes)]
    windows: list[tuple[float, float]] = []

    def isolate(i: int) -> None:
        mode = modes[i % len(modes)]
        # Cut it off while messages wait for their answer at its inbox (every message there is
        # slow): they will be accepted after the cut, and their outcomes cannot be recorded. At most 10s.
        box = sink.boxes["isolated"]
        end = time.monotonic() + 10
        while time.monotonic() < end and box.slow_waiting < 2:
            h.babysit()
            time.sleep(0.005)
        held = _held_by(h.url, isolated.pid)
        started, started_wall = time.monotonic(), time.time()
        if mode == "pause":
            proxy.pause()
        else:
            proxy.cut()
        # and read again once it is cut off (it may have claimed more in between; now it cannot)
        h.held_at_partitions.append(sorted(set(held) | set(_held_by(h.url, isolated.pid))))
        # While it is away, the others answer slowly: the rows they take over stay 'sending' for a
        # while, so its late outcomes arrive while someone else holds those rows (the zombie case).
        sink.main.faults.late, sink.main.faults.late_seconds = 1.0, min(1.0, lease / 2)

        def sent_while_cut_off() -> list[str]:
            """What it held at the cut and its inbox has: sent, and impossible to record now."""
            return [str(m.job_id) for m in box.messages if m.job_id in held_set]

        def taken_over() -> bool:
            """It comes back as soon as others re-claimed what it sent while away (they are still sending
            those rows, slowly: its late outcomes for them arrive while someone else holds them). Had it
            sent nothing, as soon as others re-claimed everything it held."""
            if time.monotonic() - started <= lease + 0.2:
                return False
            watched = sent_while_cut_off() or held
            return not watched or _still_theirs(h.url, isolated.pid, watched) == 0

        held_set = set(held)
        h.wait_until(taken_over, started + 4 * lease, step=0.02)
        proxy.heal()
        healed = time.time()
        away = time.monotonic() - started
        windows.append((started_wall + lease + 0.25, healed))
        h.partitions += 1
        h.result.notes.append(f"partition {i + 1} ({mode}): {away:.1f}s, {len(held)} row(s) held at the cut")
        h.wait_until(lambda: False, time.monotonic() + 1.0)
        sink.main.faults.late = 0.0

    events: list[Event] = [
        # Early enough that the queue still holds work for the isolated worker when it is cut off.
        ((i + 1) / (o.partitions + 1) * 0.5, functools.partial(isolate, i))
        for i in range(o.partitions)
    ]
    if o.kills:
        events += [(m, h.kill_random_worker) for m in _moments(h, o.kills)]
    _at_progress(h, events)
    h.faults_injected["partition"] = h.partitions
    result = _end(h)
    refused, stats = h.refused_by(isolated)
    late = [a for a in sink.arrivals() if a.box == "isolated" and any(lo < a.at < hi for lo, hi in windows)]
    result.numbers["refused"] = refused
    result.numbers["isolated_stats"] = stats or {}
    result.checks.append(
        Check(
            "the isolated worker sent nothing after its lease ran out",
            not late,
            f"{len(late)} message(s) sent while cut off past the lease" if late else f"{len(windows)} partition(s)",
        )
    )
    zombie_check = result.check("fencing: no worker completed a row it no longer owned")
    zombies_found = zombie_check is not None and not zombie_check.ok
    result.checks.append(
        Check(
            "fencing was exercised: the isolated worker's late outcomes were refused",
            refused > 0 or zombies_found,
            f"{refused} outcome(s) refused (log), final stats fenced_out={(stats or {}).get('fenced_out', '?')}",
        )
    )
    return result


SCENARIOS: dict[str, Callable[[Context, str], Result]] = {
    "kills": kills,
    "restart": restart,
    "smtp-faults": smtp_faults,
    "http-faults": http_faults,
    "races": races,
    "partition": partition,
}

TRANSPORTS: dict[str, tuple[str, ...]] = {
    "kills": ("smtp", "resend"),
    "restart": ("smtp",),
    "smtp-faults": ("smtp",),
    "http-faults": ("resend",),
    "races": ("smtp",),
    "partition": ("smtp",),
}
"""Default transports; ``--transport`` overrides where the scenario can use either."""

FIXED_TRANSPORT = {"smtp-faults": "smtp", "http-faults": "resend", "partition": "smtp"}
