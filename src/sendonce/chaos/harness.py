"""Shared orchestration: one scenario's database, sink, API and worker processes, and its verdict.

A scenario function (see :mod:`sendonce.chaos.scenarios`) reads as the story of its faults; the
harness does everything else the same way every time:

1. a fresh database, its schema applied by real ``sendonce db upgrade`` processes, the audit trigger;
2. the sink (SMTP inboxes or the Resend-compatible API), ``--apis`` ``sendonce api`` processes and
   the campaign set up through them; ``--workers`` ``sendonce worker`` processes;
3. the campaign approved and signup traffic started; the scenario injects its faults, while the
   harness replaces processes that died by the fault hook;
4. the end: signup traffic answered, the fleet stopped (SIGTERM), ``sendonce worker --drain``
   processes finish what is left and must exit by themselves;
5. the verdict, from the sink (see :mod:`sendonce.chaos.invariants`).

Every wait has a deadline and every process is killed on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from sendonce.chaos.database import ChaosDatabase, ChaosServer, clock_offset
from sendonce.chaos.invariants import (
    Check,
    Expectation,
    Verdict,
    faults_fired,
    judge,
    read_database,
    zombie_completions,
)
from sendonce.chaos.processes import Fleet, HeldRow, Proc, Witness, WorkerOptions, wait_healthy, worker_stats
from sendonce.chaos.sinks import Arrival, Sink, describe_faults
from sendonce.chaos.traffic import Api, ApiUnavailable, CampaignSetup, SignupTraffic, approve, setup_campaign
from sendonce.delivery.worker import WorkerConfig
from sendonce.faults import Faults

logger = logging.getLogger(__name__)

# Throw-away credentials of the scratch API processes (loopback only).
ADMIN_TOKEN = "chaos-admin-token"  # noqa: S105
SECRET = "chaos-secret-0123456789abcdef0123456789"  # noqa: S105


@dataclass
class Options:
    """Everything a scenario may be told (the command line, or a test)."""

    recipients: int = 400
    kills: int | None = None
    """External SIGKILLs of workers; None: the scenario's default."""
    workers: int = 3
    concurrency: int = 4
    batch_size: int = 10
    lease: float = 2.0
    tick: float = 0.5
    apis: int = 2
    signups: int = 30
    transport: str | None = None
    """smtp or resend; None: the scenario's default (kills runs both)."""
    restarts: int = 3
    down: float = 1.0
    partitions: int = 1
    partition_mode: str = "both"
    pauses: int = 2
    opt_outs: int = 6
    upgrades: int = 2
    faults: str | None = None
    """SENDONCE_FAULTS for the workers; None: the scenario's default."""
    broken: str | None = None
    seed: int = 0
    timeout: float | None = None
    """Longest chaos phase, in seconds; None: from the size of the campaign."""
    keep_db: bool = False

    @property
    def chaos_timeout(self) -> float:
        # Generous: a shared 2-core machine may send fewer than 50 messages a second under chaos.
        return self.timeout if self.timeout is not None else 120.0 + self.recipients / 40.0

    @property
    def drain_timeout(self) -> float:
        return 60.0 + self.recipients / 250.0

    def worker_options(self) -> WorkerOptions:
        return WorkerOptions(self.concurrency, self.batch_size, self.lease, self.tick)


@dataclass
class Result:
    """One row of the table, with the checks behind it."""

    scenario: str
    transport: str
    postgres: str
    recipients: int
    kills: int = 0
    hook_kills: int = 0
    api_kills: int = 0
    restarts: int = 0
    faults: str = ""
    delivered: int = 0
    duplicates: int = 0
    recorded: int = 0
    unrecorded: int = 0
    lost: int = 0
    duration: float = 0.0
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    log_dir: str = ""
    seed: int = 0
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.skipped is not None or (self.error is None and all(c.ok for c in self.checks))

    @property
    def verdict(self) -> str:
        if self.skipped is not None:
            return "skipped"
        return "pass" if self.ok else "FAIL"

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)


@dataclass
class Context:
    """What every scenario of one run shares."""

    options: Options
    server: ChaosServer
    run_dir: Path
    say: Callable[[str], None] = print


class Harness:
    """One scenario's world. Use as a context manager; everything is torn down on the way out."""

    def __init__(self, name: str, transport: str, ctx: Context, sink: Sink, *, lease: float | None = None) -> None:
        self.name = name
        self.options = ctx.options
        self.server = ctx.server
        self.sink = sink
        self.say = ctx.say
        options = ctx.options
        self.worker_options = options.worker_options()
        if lease is not None:
            self.worker_options = dataclasses.replace(self.worker_options, lease=lease)
        self.run_dir = ctx.run_dir / f"{name}-{transport}"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(options.seed)
        self.result = Result(
            scenario=name,
            transport=transport,
            postgres=ctx.server.kind,
            recipients=options.recipients,
            log_dir=str(self.run_dir),
            seed=options.seed,
        )
        self.db: ChaosDatabase | None = None
        self.fleet: Fleet | None = None
        self.api: Api | None = None
        self.setup: CampaignSetup | None = None
        self.signups: SignupTraffic | None = None
        self.expect: Expectation | None = None
        self.faults_injected: dict[str, int] = {}
        self.partitions = 0
        self.held_at_partitions: list[list[str]] = []
        """Per partition: the job ids the isolated worker held at the cut (whatever it had sent of
        them it could not record)."""
        self.restart_windows: list[RestartWindow] = []
        """Per database restart: what the workers held just before it, and when it began and ended."""
        self.sent_by_fleet = 0
        """Campaign messages the faulted fleet had delivered when it was stopped (not the drains')."""
        self.opt_outs_planned = 0
        """Opt-outs of rows held unclaimed that the scenario planned (each may find no row left)."""
        self.held_at_kills: list[Witness] = []
        """Per external kill: when, and the rows its victim still held right after it died, as (job id,
        when it claimed the row) (None: the database could not be asked)."""
        self.extra_checks: list[Check] = []
        self.worker_faults: str | None = None
        self.api_faults: str | None = None
        self.started = time.monotonic()
        self.approved_at = 0.0
        self._reported = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Harness:
        db_name = f"sendonce_chaos_{self.name.replace('-', '_')}_{self.result.transport}_{os.getpid()}"
        try:
            self.db = self.server.create(db_name)
        except BaseException:
            self.sink.stop()
            raise
        self.fleet = Fleet(
            self.run_dir,
            self.db.url,
            self.worker_options,
            broken=self.options.broken,
            fault_seed=self.options.seed * 1000,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.signups is not None:
            self.signups.wait(0)
            self.signups.api.close()
        if self.fleet is not None:
            self.fleet.close()
        if self.api is not None:
            self.api.close()
        with contextlib.suppress(Exception):
            self.sink.stop()
        if self.db is not None and not self.options.keep_db:
            with contextlib.suppress(Exception):
                self.db.drop()

    # -- parts -----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.db is not None
        return self.db.url

    @property
    def procs(self) -> Fleet:
        assert self.fleet is not None
        return self.fleet

    def upgrade(self, concurrent: int = 1) -> list[int]:
        """Apply the schema with ``concurrent`` ``sendonce db upgrade`` processes started at once."""
        env = {"SENDONCE_DATABASE_URL": self.url}
        procs = [
            self.procs.run_cli("upgrade", ["--log-level", "info", "db", "upgrade"], env) for _ in range(concurrent)
        ]
        codes = []
        for proc in procs:
            try:
                codes.append(proc.popen.wait(timeout=60))
            except Exception:
                self.procs.kill(proc)
                codes.append(-1)
        assert self.db is not None
        if 0 in codes:  # the schema is there (migrations apply in one transaction, or not at all)
            self.db.install_audit()
        return codes

    def api_env(self) -> dict[str, str]:
        return {
            "SENDONCE_ADMIN_TOKEN": ADMIN_TOKEN,
            "SENDONCE_SECRET": SECRET,
            "SENDONCE_PUBLIC_URL": "https://app.chaos.test",
        }

    def start_apis(self, faults: str | None = None) -> list[Proc]:
        self.api_faults = faults
        procs = [self.procs.spawn_api(self.api_env(), faults=faults) for _ in range(self.options.apis)]
        for proc in procs:
            if not wait_healthy(proc):
                raise RuntimeError(f"the API process did not start: see {proc.log_path}")
        # used from the harness's own thread only, which also respawns the API processes (babysit)
        self.api = Api(lambda: [p.base_url for p in self.procs.live("api")], self.rng, revive=self.babysit)
        return procs

    def set_up_campaign(self) -> CampaignSetup:
        assert self.api is not None
        self.setup = setup_campaign(self.api, ADMIN_TOKEN, self.options.recipients)
        self.expect = Expectation(self.setup.campaign_id, set(self.setup.intended))
        return self.setup

    def start_workers(self, faults: str | None, count: int | None = None) -> list[Proc]:
        self.worker_faults = faults
        n = self.options.workers if count is None else count
        return [self.procs.spawn_worker(self.sink.url(), faults=faults) for _ in range(n)]

    def go(self) -> None:
        """Approve the campaign, once every worker started so far is up, and start the signup traffic.

        Workers that are still starting would find a small campaign already sent by the first one up:
        a scenario that needs a given worker to hold rows (the partition) could then find it idle."""
        assert self.api is not None and self.setup is not None
        self.phase("set up")
        workers = [p for p in self.procs.procs if p.role in ("worker", "isolated")]
        self.wait_until(
            lambda: all(" started (transport " in p.log_text() or not p.alive() for p in workers),
            time.monotonic() + 30,
        )
        approve(self.api, self.setup.campaign_id)
        self.approved_at = time.monotonic()
        estimate = max(3.0, self.options.recipients / 600.0)
        threads = 4
        pace = estimate * threads / max(self.options.signups * 1.75, 1)
        signup_api = Api(self.api.bases, random.Random(self.options.seed + 1), self.setup.api_key)
        self.signups = SignupTraffic(
            signup_api, self.options.signups, random.Random(self.options.seed + 2), pace, threads
        ).start()

    # -- watching --------------------------------------------------------------------------------

    @property
    def campaign_prefix(self) -> str:
        assert self.setup is not None
        return f"campaign:{self.setup.campaign_id}:"

    def progress(self) -> float:
        """Fraction of the campaign's recipients that received something (from the sink)."""
        assert self.setup is not None
        return self.sink.count(self.campaign_prefix) / max(len(self.setup.intended), 1)

    def babysit(self) -> None:
        """Replace processes that died by the fault hook (or crashed: that is recorded)."""
        fleet = self.procs
        for proc in list(fleet.procs):
            if not fleet.reap(proc):
                continue
            if proc.role == "api":
                # Not waited for: clients retry on the live ones meanwhile, and the chaos goes on.
                port = int(proc.base_url.rsplit(":", 1)[1])
                fleet.spawn_api(self.api_env(), port=port, faults=self.api_faults)
            elif proc.role == "worker":
                fleet.spawn_worker(self.sink.url(), faults=self.worker_faults)

    def wait_until(self, condition: Callable[[], bool], deadline: float, step: float = 0.02) -> bool:
        while time.monotonic() < deadline:
            self.babysit()
            self._report_progress()
            if condition():
                return True
            time.sleep(step)
        return condition()

    def _report_progress(self) -> None:
        """A line per tenth of a large campaign, so a long run shows it is alive."""
        if self.setup is None or self.options.recipients < 5000:
            return
        tenth = int(self.progress() * 10)
        if tenth > self._reported:
            self._reported = tenth
            fleet = self.procs
            hook = fleet.hook_kills["worker"] + fleet.hook_kills["isolated"]
            self.say(
                f"  {self.name}: {tenth * 10}% of recipients reached, {fleet.external_kills} kills + {hook} by the "
                f"fault hook, {time.monotonic() - self.approved_at:.0f}s"
            )

    def deadline(self) -> float:
        return self.started + self.options.chaos_timeout

    def kill_random_worker(self, role: str = "worker") -> Proc | None:
        """SIGKILL one worker that holds claimed rows (waiting up to 1s for one: a replacement still
        starting holds nothing, and killing it would test nothing), or any live one after that."""
        deadline = time.monotonic() + 1.0
        while True:
            victim = self._pick_victim(role, deadline)
            if victim is None:
                return None
            if self.procs.kill(victim):
                break
            self.babysit()  # it died meanwhile (the fault hook): replace it, and pick again
        # Dead now: what it held cannot change until its leases expire (seconds away). Those of them
        # the inbox has (it sent them, and could not record them) were in flight: see in_flight_bound.
        self.held_at_kills.append(Witness(time.time(), held_jobs(self.url, victim.pid)))
        if role == "worker":
            self.procs.spawn_worker(self.sink.url(), faults=self.worker_faults)
        return victim

    def _pick_victim(self, role: str, deadline: float) -> Proc | None:
        while True:
            live = self.procs.live(role)
            if not live:
                return None
            holders = self._holders()
            if holders is None:  # the database is away (a restart): any live one
                return self.rng.choice(live)
            holding = [p for p in live if holders.get(p.pid, 0) > 0]
            if holding:
                return self.rng.choice(holding)
            if time.monotonic() >= deadline:
                return self.rng.choice(live)
            self.babysit()
            time.sleep(0.01)

    def in_flight_at_kills(self, *, hook: bool = False) -> list[int | None]:
        """Per external kill (``hook``: per death by the fault hook): how many messages were in
        flight (see :meth:`in_flight_jobs_at_kills`); None if unknown."""
        return [None if jobs is None else len(jobs) for jobs in self.in_flight_jobs_at_kills(hook=hook)]

    def in_flight_jobs_at_kills(self, *, hook: bool = False) -> list[list[str] | None]:
        """Per external kill (``hook``: per death by the fault hook): the rows its victim held whose
        message the inbox received from it (see :func:`by_victims_connection` and
        :func:`within_victims_lease`): sent, and never recorded; None if unknown. What an external
        victim held is read from the database at the kill; a hook victim wrote it in its death note.
        See :func:`credit_copies`."""
        external, by_hook = credit_copies(self.sink.arrivals(), self.held_at_kills, self.procs.held_at_hook_kills)
        return by_hook if hook else external

    def _holders(self) -> dict[int, int] | None:
        """Claimed, unrecorded rows per worker pid; None if the database cannot be asked."""
        try:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                rows = conn.execute(
                    "SELECT split_part(claimed_by, ':', -2), count(*) FROM sendonce.deliveries "
                    "WHERE status = 'sending' GROUP BY 1"
                ).fetchall()
        except psycopg.Error:
            return None
        return {int(pid): int(n) for pid, n in rows if str(pid).isdigit()}

    # -- the end ---------------------------------------------------------------------------------

    def phase(self, name: str) -> None:
        """Note how long the scenario has run when ``name`` ends (seconds since the harness started)."""
        self.result.numbers.setdefault("phases", {})[name] = round(time.monotonic() - self.started, 1)

    def finish(self) -> None:
        """Signups answered, fleet stopped, drain workers finish the rest and must exit by themselves."""
        self.phase("chaos")
        fleet = self.procs
        if self.signups is not None:
            signups = self.signups
            # API processes that die meanwhile are still replaced: clients keep retrying on them.
            answered = self.wait_until(
                signups.done, time.monotonic() + max(30.0, self.options.drain_timeout / 2), step=0.05
            )
            signups.wait(0 if answered else 1.0)
        self.phase("signups answered")
        self.babysit()
        # What the fleet's own workers sent (the isolated worker and the drains run without faults):
        # the events the fault hook was rolled on, at least.
        prefix = self.campaign_prefix
        self.sent_by_fleet = sum(
            1 for a in self.sink.arrivals() if a.box != "isolated" and (a.job_id or "").startswith(prefix)
        )
        fleet.terminate(fleet.live("worker") + fleet.live("isolated"))
        self.phase("fleet stopped")
        drains = [fleet.spawn_worker(self.sink.url(), role="drain", drain=True) for _ in range(2)]
        deadline = time.monotonic() + self.options.drain_timeout
        stuck = []
        for proc in drains:
            try:
                code = proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                code = None
            if code != 0:
                stuck.append(f"pid {proc.pid}: {'still running' if code is None else f'exit {code}'}")
        if stuck:
            for proc in drains:
                fleet.kill(proc)
        self.phase("drained")
        self.extra_checks.append(
            Check(
                "sendonce worker --drain exited by itself (nothing left)",
                not stuck,
                f"within {self.options.drain_timeout:.0f}s" if not stuck else "; ".join(stuck),
            )
        )
        self.result.duration = time.monotonic() - self.approved_at

    def verdict(self, *, duplicate_bound: int) -> Verdict:
        assert self.setup is not None and self.expect is not None and self.api is not None
        self.expect.duplicate_bound = duplicate_bound
        self.expect.explained, self.expect.unpinned = explained_copies(self)
        if self.signups is not None:
            self.expect.signups = self.signups.acknowledged()
            refused = self.signups.refused()
            unanswered = dict(self.signups.unanswered)
            self.extra_checks.append(
                Check(
                    "every signup request was answered (201, or 200 for a repeat)",
                    not refused and not unanswered and self.signups.requests == self.signups.planned,
                    f"{self.signups.requests} of {self.signups.planned} requests answered for "
                    f"{self.options.signups} addresses, "
                    f"{self.signups.created()} created"
                    + (f"; refused: {dict(list(refused.items())[:5])}" if refused else "")
                    + (f"; unanswered: {dict(list(unanswered.items())[:3])}" if unanswered else ""),
                )
            )
            twice = self.signups.created_twice()
            self.extra_checks.append(
                Check(
                    "never two 201s for one signup address (every other answer is a repeat)",
                    not twice,
                    f"{self.signups.created()} created for {len(self.expect.signups)} addresses"
                    + (f"; created twice: {twice[:5]}" if twice else "")
                    + " (a 201 lost with a killed API process comes back as 200)",
                )
            )
        cid = self.setup.campaign_id
        try:
            view_api = self.api.read(f"/v1/campaigns/{cid}", within=60)
            ledger_api = self.api.read(f"/v1/campaigns/{cid}/duplicates?limit=1000", within=60)
        except ApiUnavailable as exc:
            self.result.error = f"the API did not answer at the end: {exc}"
            raise
        listed = {str(entry["job_id"]) for entry in ledger_api.get("entries", [])}
        view = read_database(self.url, self.setup.account_id, cid, view_api, listed)
        pids = {p.app_name: p.pid for p in self.procs.procs}
        zombies = zombie_completions(view.zombies, pids)
        verdict = judge(self.sink.arrivals(), self.expect, view, idempotent=self.sink.idempotent, zombies=zombies)
        crashes = list(self.procs.crashes)
        verdict.add("no process crashed", not crashes, "; ".join(crashes[:5]))
        in_flight = [n for n in self.in_flight_at_kills() + self.in_flight_at_kills(hook=True) if n is not None]
        if in_flight and not self.sink.idempotent:
            # The rule that bounds SMTP duplicates, seen directly: a connection sends no content while
            # its previous accepted message is unrecorded, so a kill finds at most one per connection.
            c = self.worker_options.concurrency
            verdict.add(
                "SMTP: no kill found more than one unrecorded message per connection",
                max(in_flight) <= c,
                f"at most {max(in_flight)} at one kill of {len(in_flight)}, {c} connections per worker",
            )
        if self.opt_outs_planned:
            landed = len(self.expect.opted_out_before_claim)
            verdict.add(
                "opt-outs before the claim were injected",
                landed > 0,
                f"{landed} of {self.opt_outs_planned} found a row nobody had claimed yet",
            )
        # The kill that matters most, between "the transport accepted" and "recorded": where the
        # hook makes about ten or more of them likely, at least one must have happened.
        expected = Faults(self.worker_faults).probabilities.get("after_accept", 0.0) * self.sent_by_fleet
        if expected >= 10:
            n = self.procs.hook_points["after_accept"]
            verdict.add(
                "the fault hook killed workers between accepted and recorded",
                n > 0,
                f"{n} such kill(s), about {expected:.0f} expected",
            )
        verdict.checks.append(faults_fired(*self._planned_faults()))
        verdict.checks.extend(self.extra_checks)
        self._fill(verdict)
        self._write_copies()
        return verdict

    def _write_copies(self) -> None:
        """Every job that arrived more than once, with each copy (when, by which connection) and each
        death that held it, to ``copies.json`` in the scenario's log directory: what a failed check
        on duplicates is read from afterwards."""
        copies: dict[str, list[Arrival]] = {}
        for arrival in self.sink.arrivals():
            if arrival.job_id is not None:
                copies.setdefault(arrival.job_id, []).append(arrival)
        deaths: dict[str, list[dict[str, Any]]] = {}
        for kind, kills in (("kill", self.held_at_kills), ("hook", self.procs.held_at_hook_kills)):
            for kill in kills:
                for row in (kill.held if kill is not None else None) or ():
                    if len(copies.get(row.job, ())) > 1:
                        assert kill is not None
                        deaths.setdefault(row.job, []).append(
                            {
                                "by": kind,
                                "died": kill.at,
                                "claimed": row.claimed,
                                "until": row.until,
                                "given_back": row.given_back,
                                "connections": sorted(kill.connections),
                            }
                        )
        explained = self.expect.explained if self.expect is not None else None
        report = {
            job: {
                "copies": [
                    {"at": a.at, "box": a.box, "port": a.peer_port, "server": a.server_port, "greeted": a.greeted_at}
                    for a in sorted(arrivals, key=lambda a: a.at)
                ],
                "deaths": deaths.get(job, []),
                "explained": explained[job] if explained is not None else None,
            }
            for job, arrivals in sorted(copies.items())
            if len(arrivals) > 1
        }
        (self.run_dir / "copies.json").write_text(json.dumps(report, indent=1))

    def _planned_faults(self) -> tuple[dict[str, float], Counter[str]]:
        """About how often each fault the run was set to inject should have fired (a lower bound:
        the events each is rolled on, as few as the campaign can need), and how often it did."""
        o, w = self.options, self.worker_options
        planned = self.sink.planned_faults(o.recipients)
        fired = Counter(self.sink.fault_counts())
        sent = self.sent_by_fleet  # each of them went through before_send and after_accept
        per_event = {
            "before_send": sent,
            "after_accept": sent,
            "after_claim": sent / w.batch_size,  # claims of at most batch_size rows
            # a group holds outcomes of rows the worker holds: at most its claim ahead, a full ready
            # queue and one per connection (over HTTP lanes do not wait for their records)
            "after_record": sent / (2 * w.concurrency + w.batch_size),
            "mid_build": o.recipients / WorkerConfig().build_chunk,  # chunks of the list build
        }
        for point, probability in Faults(self.worker_faults).probabilities.items():
            if point in per_event:
                planned[f"hook {point}"] = probability * per_event[point]
                fired[f"hook {point}"] = self.procs.hook_points[point]
        api = Faults(self.api_faults).probabilities.get("api_after_commit", 0.0)
        if api and self.signups is not None:
            # each acknowledged signup committed once (a repeat after a lost answer need not)
            planned["hook api_after_commit"] = api * len(self.signups.acknowledged())
            fired["hook api_after_commit"] = self.procs.hook_points["api_after_commit"]
        return planned, fired

    def _fill(self, verdict: Verdict) -> None:
        r = self.result
        fleet = self.procs
        r.kills = fleet.external_kills
        r.hook_kills = fleet.hook_kills["worker"] + fleet.hook_kills["isolated"]
        r.api_kills = fleet.hook_kills["api"]
        r.delivered = verdict.delivered
        r.numbers["delivered_signups"] = verdict.delivered_signups
        r.duplicates, r.recorded, r.unrecorded, r.lost = (
            verdict.duplicates,
            verdict.recorded,
            verdict.unrecorded,
            verdict.lost,
        )
        r.checks = verdict.checks
        injected = dict(self.faults_injected)
        if r.hook_kills:
            injected["SIGKILL by fault hook"] = r.hook_kills
        if r.api_kills:
            injected["API killed after commit"] = r.api_kills
        for name, n in self.sink.fault_counts().items():
            if name not in ("replayed", "late"):
                injected[name] = n
        if late := self.sink.fault_counts()["late"]:
            r.notes.append(f"answers delayed within the client's timeout (not faults): {late}")
        r.faults = describe_faults(injected)
        if fleet.hook_points:
            r.notes.append("fault hook kills by point: " + describe_faults(fleet.hook_points))
        if self.held_at_kills:
            holding = [len(kill.held) for kill in self.held_at_kills if kill.held]
            in_flight = [n for n in self.in_flight_at_kills() if n is not None]
            r.notes.append(
                f"external kills: {len(holding)} of {len(self.held_at_kills)} victims held claimed rows "
                f"({sum(holding)} rows in all, {sum(in_flight)} of them sent and not recorded; at most "
                f"{max(in_flight, default=0)} at one kill)"
            )
        if fleet.held_at_hook_kills:
            known = [kill for kill in fleet.held_at_hook_kills if kill is not None]
            in_flight = [n for n in self.in_flight_at_kills(hook=True) if n is not None]
            r.notes.append(
                f"fault hook kills: {len(known)} of {len(fleet.held_at_hook_kills)} noted what they held "
                f"({sum(len(kill.held or ()) for kill in known)} rows in all, {sum(in_flight)} of them sent and not "
                f"recorded; at most {max(in_flight, default=0)} at one kill)"
            )
        r.numbers.update(
            {
                "signups": len(self.expect.signups) if self.expect else 0,
                "worker_faults": self.worker_faults or "",
                "api_faults": self.api_faults or "",
                "sink_counts": dict(self.sink.fault_counts()),
            }
        )

    def refused_by(self, proc: Proc) -> tuple[int, dict[str, int] | None]:
        """A worker's refused outcomes (its warnings) and its final stats line, if it stopped gracefully."""
        text = proc.log_text()
        return text.count("outcome refused"), worker_stats(text)


def credit_copies(
    arrivals: list[Arrival], external: list[Witness], by_hook: list[Witness | None]
) -> tuple[list[list[str] | None], list[list[str] | None]]:
    """Per death (the external kills', then the hook's): the rows of what its victim held that a copy
    in ``arrivals`` shows it had sent (see :func:`by_victims_connection` and
    :func:`within_victims_lease`); None where what it held is unknown.

    Each copy is credited to one death at most, and each row of a death to one copy at most: a copy
    both rules could give to two deaths (an earlier holder's, read late) goes to the death whose
    connection it came by."""
    arrived: dict[str, list[tuple[int, Arrival]]] = {}
    for n, arrival in enumerate(arrivals):
        if arrival.job_id is not None:
            arrived.setdefault(arrival.job_id, []).append((n, arrival))
    deaths: list[Witness | None] = [*external, *by_hook]
    found: list[list[str] | None] = [None if k is None or k.held is None else [] for k in deaths]
    used: set[int] = set()
    credited: set[tuple[int, int]] = set()
    for rule in (by_victims_connection, within_victims_lease):
        for d, (kill, jobs) in enumerate(zip(deaths, found, strict=True)):
            if kill is None or kill.held is None or jobs is None:
                continue
            for r, row in enumerate(kill.held):
                if (d, r) in credited:
                    continue
                for n, arrival in arrived.get(row.job, []):
                    if n not in used and rule(kill, row, arrival):
                        used.add(n)
                        credited.add((d, r))
                        jobs.append(row.job)
                        break
    return found[: len(external)], found[len(external) :]


def held_jobs(url: str, pid: int, clock: Callable[[], float] = time.time) -> list[HeldRow] | None:
    """The rows worker ``pid`` holds (claimed, not recorded), with their claim's time (a claim sets
    updated_at, a renewal does not) and their lease's end; None if the database cannot be asked.
    Both times are the database's, moved onto ``clock``, the inbox's (:func:`clock_offset`)."""
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            offset = clock_offset(conn, clock)
            rows = conn.execute(
                "SELECT job_id, extract(epoch FROM updated_at)::float8, "
                "extract(epoch FROM lease_expires_at)::float8 FROM sendonce.deliveries "
                "WHERE status = 'sending' AND claimed_by LIKE %s",
                (f"%:{pid}:%",),
            ).fetchall()
    except psycopg.Error:
        return None
    return [
        HeldRow(str(job), float(at) - offset, None if until is None else float(until) - offset)
        for job, at, until in rows
    ]


def by_victims_connection(kill: Witness, row: HeldRow, arrival: Arrival) -> bool:
    """``arrival``, a copy of ``row``, came after the victim's claim by a connection the victim had
    open when it died (the same local and server ports, greeted after the victim opened it and
    before its death): the victim's own copy, however late the inbox (a thread of the suite's busy
    process) got to read it. Only a hook victim's note names its connections."""
    greeted = arrival.greeted_at
    if arrival.at < row.claimed or greeted is None:
        return False
    return any(
        local == arrival.peer_port and server == arrival.server_port and opened <= greeted <= kill.at
        for local, server, opened in kill.connections
    )


def within_victims_lease(kill: Witness, row: HeldRow, arrival: Arrival) -> bool:
    """``arrival``, a copy of ``row``, came after the victim's claim and before its lease had ended,
    so before anyone else could claim the row: the victim's copy (or an earlier holder's, read late).
    Not for a row the victim had given back (released, or a retry): once that was recorded, another
    worker could claim it at once."""
    if row.given_back or row.until is None:
        return False
    return row.claimed <= arrival.at <= row.until


@dataclass(frozen=True, slots=True)
class RestartWindow:
    """One database restart as the verdict sees it: ``held``, the rows every worker held (claimed,
    unrecorded) just before the server was stopped (None if it could not be asked); ``began`` (before
    that question) and ``ended`` (the server answering again), on the inbox's clock."""

    held: frozenset[str] | None
    began: float
    ended: float


def held_by_all(url: str) -> frozenset[str] | None:
    """Job ids of every row a worker holds (claimed, not recorded); None if the database cannot be asked."""
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            rows = conn.execute("SELECT job_id FROM sendonce.deliveries WHERE status = 'sending'").fetchall()
    except psycopg.Error:
        return None
    return frozenset(str(r[0]) for r in rows)


def restart_jobs(window: RestartWindow, arrivals: list[Arrival]) -> set[str] | None:
    """Jobs a database restart can have left sent and unrecorded: those held just before it, and those
    whose copy arrived while it went on (claimed after the question, sent before their record could be
    made). A re-send of any other job is not the restart's doing. None if what was held is unknown."""
    if window.held is None:
        return None
    during = {a.job_id for a in arrivals if a.job_id is not None and window.began <= a.at <= window.ended}
    return set(window.held) | during


def explained_copies(h: Harness) -> tuple[Counter[str], int]:
    """SMTP, job by job: how many re-sent copies of each job the faults injected can explain; and how
    many copies of any job the faults that cannot be pinned to jobs can (a kill whose victim's holdings
    are not known: one per connection; a database restart whose workers' holdings are not known: one
    per connection of every worker).

    A copy is explained by a fault that hit that very job: it was in flight (sent, not recorded) at a
    kill of its holder, it was held by the isolated worker at a partition's cut, or the inbox left
    its sender unable to know that it had arrived (a drop after DATA, a slow or garbled answer). A
    re-send of any other job is one the guarantee does not allow, whatever the total."""
    fleet = h.procs
    c = h.worker_options.concurrency
    explained: Counter[str] = Counter()
    unpinned = 0
    for hook in (False, True):
        for jobs in h.in_flight_jobs_at_kills(hook=hook):
            if jobs is None:
                unpinned += c
            else:
                explained.update(jobs)
    unpinned += c * (fleet.external_kills - len(h.held_at_kills))
    unpinned += c * (fleet.hook_kills["worker"] + fleet.hook_kills["isolated"] - len(fleet.held_at_hook_kills))
    for held in h.held_at_partitions:
        explained.update(held)
    arrivals = h.sink.arrivals()
    for window in h.restart_windows:
        caught = restart_jobs(window, arrivals)
        if caught is None:
            unpinned += c * h.options.workers
        else:
            explained.update(caught)
    explained.update(h.sink.ambiguous())
    return explained, unpinned


def in_flight_bound(h: Harness, *, extra: int = 0) -> int:
    """SMTP: copies the injected faults can explain; each is at most one message per connection."""
    fleet = h.procs
    c = h.worker_options.concurrency
    # A kill: its victim's messages in flight (sent, not recorded: counted from the inbox), which the
    # rule caps at one per connection; c where what it held is not known.
    external = sum(c if n is None else min(c, n) for n in h.in_flight_at_kills())
    external += c * (fleet.external_kills - len(h.held_at_kills))  # kills made other ways, if any
    hook = sum(c if n is None else min(c, n) for n in h.in_flight_at_kills(hook=True))
    hook += c * (fleet.hook_kills["worker"] + fleet.hook_kills["isolated"] - len(fleet.held_at_hook_kills))
    # A restart: at most one message per connection of every worker, and no more than it can explain.
    arrivals = h.sink.arrivals()
    restarts = 0
    for window in h.restart_windows:
        jobs = restart_jobs(window, arrivals)
        restarts += c * h.options.workers if jobs is None else min(c * h.options.workers, len(jobs))
    sink = h.sink.fault_counts()
    return (
        external
        + hook
        + c * h.partitions
        + restarts
        + sink["dropped_after_data"]
        + sink["slow"]  # past the client's timeout (a delay it waits out is "late": no re-send)
        + sink["late_given_up"]  # meant to be waited out, but the client's deadline came first
        + sink["garbled_reply"]
        + extra
    )
