"""The worker: claim, send and record, with leases that fence the send as well as the record.

One asyncio process runs these tasks, each with its own database connection:

* the **claimer** keeps a small local queue of claimed rows (``FOR UPDATE SKIP LOCKED``, one
  statement per batch); when there is nothing to claim it does the housekeeping and sleeps until
  NOTIFY, the next due time, or the tick;
* ``--concurrency`` **senders**, each with its own transport lane (an SMTP connection), compose and
  send; a sender never starts a send after its claim's deadline (claim time + lease - margin, by
  this process's clock), and caps the send's own timeout at the lease's end; while one message waits
  to go out, its sender takes and composes the next queued row, whose envelope a pipelining SMTP lane
  then sends with the current content (its own content still waits for its own gate);
* the **recorders** (two connections: one group starts while the previous one is written) write
  outcomes in groups every few milliseconds (one ``UPDATE ... FROM unnest`` per kind of outcome),
  fenced by the attempt each row was claimed with;
* the **housekeeper** renews the leases still held, drops rows it no longer owns (so they are not
  sent), releases rows of paused campaigns that were not started, puts expired leases back in the
  queue, starts due campaigns and finishes completed ones;
* the **builder** builds recipient lists chunk by chunk; the **listener** turns NOTIFY into wake-ups.

A worker that cannot reach PostgreSQL cannot renew, so its deadlines pass and it stops sending
before anyone else may take its rows: it goes quiet before a second copy could exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg

from sendonce.delivery.compose import ComposeError, ComposeLater, Composer, wire_address
from sendonce.delivery.health import Outages
from sendonce.domain.message import OutgoingMessage
from sendonce.faults import NO_FAULTS, Faults
from sendonce.notify import post_alert
from sendonce.store import feedback, outbox, rate_limits
from sendonce.store.database import Conn, abandon, connect, is_unavailable
from sendonce.store.feedback import FeedbackPolicy
from sendonce.store.outbox import ClaimedDelivery, FailedRecord, Fenced, Key, RetryRecord, SentRecord
from sendonce.store.rate_limits import Rate
from sendonce.transports.base import Accepted, Channel, Outcome, Permanent, Retry, Transport, Withheld

logger = logging.getLogger(__name__)

T = TypeVar("T")

_OUTAGE_PROBE_EVERY = 60.0
"""While the transport is down, the lanes try again at least this often (seconds)."""
_LISTENER_CHECK_EVERY = 30.0
"""The listener's connection, silent this long, is asked whether it still answers (seconds): one whose
packets are dropped (a partition, a NAT that forgot it) would wait for notifications for ever."""
_RETRY_AFTER_CAP = 300.0
"""A provider's Retry-After pauses the lanes for at most this long (seconds): rows held meanwhile
(a campaign paused, a stop) wait for the pause's end to be given back."""
_CANNOT_COMPOSE = "cannot compose yet"
"""How the error of a message that waits for its sender (its DKIM key) begins: it is the pause's reason."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    concurrency: int = 10
    """Parallel transport lanes (SMTP connections) in this process."""
    batch_size: int = 20
    """Rows per claim."""
    tick: float = 60.0
    """Longest sleep between two looks at the database when nothing wakes the worker."""
    lease: float = 30.0
    """Seconds a claim is valid for; renewed while the worker holds the rows."""
    drain: bool = False
    """Exit once nothing is left that this worker could send."""
    max_failures: int = 8
    """Transient failures of one message before it is failed for good."""
    backoff_base: float = 2.0
    backoff_cap: float = 900.0
    """Longest wait between two tries of one message (before jitter), a provider's Retry-After included."""
    build_chunk: int = 1000
    """Subscribers examined per recipient-list build transaction."""
    record_interval: float = 0.002
    """How long outcomes gather before one grouped, fenced UPDATE records them (group commit)."""
    recorders: int = 2
    """Recorder connections. While one group is being written (and flushed to disk), the next one
    starts on another: a lane waiting for its previous message's record waits for one group, not two."""
    send_timeout: float = 30.0
    db_timeout: float = 0.0
    """Longest wait for one database call before the connection is abandoned (0: max(lease, 5s))."""
    durable_records: bool = True
    """Wait for each grouped record to be flushed to disk before going on (synchronous_commit).
    False ("fast records"): the recorder's commits return before the disk flush. Claims stay durable.
    Only a crash of PostgreSQL itself (not of a worker) can then lose the last moment's records; their
    rows come back as expired leases and are re-sent, through SMTP written to the ledger first."""
    transport_rate: Rate | None = None
    """At most this many messages through the transport, across every worker (a bucket in PostgreSQL)."""
    domain_rates: dict[str, Rate] = field(default_factory=dict)
    """At most this many messages to each of these recipient domains, across every worker."""
    feedback: FeedbackPolicy = field(default_factory=FeedbackPolicy)
    """Campaign bounce and complaint limits."""
    alert_webhook_url: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.batch_size < 1 or self.recorders < 1:
            raise ValueError("concurrency, batch size and recorders must be at least 1")
        if self.lease < 1.0:
            raise ValueError("the lease must be at least one second")
        if self.tick <= 0:
            raise ValueError("the tick must be positive")
        if self.db_timeout <= 0:
            object.__setattr__(self, "db_timeout", max(self.lease, 5.0))

    @property
    def margin(self) -> float:
        """No send starts later than this before the lease ends."""
        return self.lease * 0.25

    @property
    def renew_every(self) -> float:
        return self.lease / 3.0


@dataclass(slots=True)
class Held:
    """A claimed row this process holds, until its outcome is recorded."""

    delivery: ClaimedDelivery
    lease_end: float
    """This process's (conservative) view of when the lease ends, on the monotonic clock."""
    revoked: bool = False
    """A renewal found the row is no longer ours: it must not be sent."""
    release: bool = False
    """Its campaign was paused or cancelled, or its recipient left: give it back unless its content
    is going out already (before its send began, or at the gate before its content)."""
    started: bool = False
    content: bool = False
    """Past the gate: its content is going out (SMTP). Until then, a release still withholds it, though
    its envelope went out (a lane waits there for its previous message's record)."""
    done: bool = False
    """Its outcome is with the recorder: a renewal that no longer finds it is not a lost lease."""
    claimed_at: float = 0.0
    """Wall-clock time (epoch seconds) just before its claim, for the fault hook's death note."""
    given_back: bool = False
    """Its outcome gives it back (released, or to be retried): once that is recorded, another worker
    may claim it before the lease would have ended."""

    @property
    def fenced(self) -> Fenced:
        d = self.delivery
        return Fenced(d.account_id, d.delivery_id, d.attempt)


@dataclass(slots=True)
class WorkerStats:
    claimed: int = 0
    sent: int = 0
    retried: int = 0
    failed: int = 0
    suppressed: int = 0
    released: int = 0
    fenced_out: int = 0
    """Outcomes the database refused because the row had been re-claimed (zombie completions)."""
    dropped_past_deadline: int = 0
    lost_leases: int = 0
    deferred: int = 0
    """Rows put back by a per-domain rate limit (not failures)."""
    transport_failures: int = 0
    """Failures of the transport itself (see Retry.transport_wide): not counted against messages."""
    # Where the time goes, summed (cheap: a few per claim and per group, two clock reads per wait):
    claims: int = 0
    """Claims answered (with rows or without)."""
    claim_seconds: float = 0.0
    """Their time, from the start of each to its rows queued for the connections."""
    record_groups: int = 0
    """Grouped records written (one commit each)."""
    record_seconds: float = 0.0
    record_wait_seconds: float = 0.0
    """Time the connections held a message's content back until their previous accepted message was
    recorded: the rule that keeps a crash's duplicates to one per connection (non-idempotent
    transports only). Over a busy stretch, its rate divided by the concurrency is the share of the
    connections' time spent waiting on the database."""
    record_waits: int = 0
    """Times a connection's next content found its previous accepted message not recorded yet, and
    was held back for it (the waits that ``record_wait_seconds`` adds up)."""
    lane_waits: int = 0
    """Times a connection found no claimed row to send, and waited for one."""


@dataclass(slots=True)
class _Result:
    held: Held
    outcome: Outcome | None
    """None: release the row (never started)."""
    sent_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    recorded: asyncio.Future[None] | None = None
    """Done once the outcome is durable; a lane of a non-idempotent transport waits for it."""


class _Lane:
    """One database connection for one task, reconnected after a failure."""

    def __init__(self, url: str, *, setup: str | None = None) -> None:
        self.url = url
        self.setup = setup
        self.conn: Conn | None = None

    async def get(self) -> Conn:
        if self.conn is None or self.conn.closed or self.conn.broken:
            await self.reset()
            conn = await connect(self.url, stable_plans=True)
            if self.setup:
                try:
                    await conn.execute(self.setup.encode())
                except BaseException:  # a connection that never became the lane's: not left open
                    with contextlib.suppress(Exception):
                        await conn.close()
                    raise
            self.conn = conn
        return self.conn

    async def reset(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def _bounded(call: Awaitable[T], timeout: float) -> T:
    """Await a database call for at most ``timeout`` seconds, then abandon its connection at once
    (see :func:`~sendonce.store.database.abandon`): a worker cut off from PostgreSQL must give up on
    a call promptly, not ten seconds late. The call's own error then is an outage, reported as a
    timeout, not a crash."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        await abandon(task)
        raise
    if task in done:
        return task.result()
    await abandon(task)
    raise TimeoutError(f"no answer within {timeout:.0f}s")


def _settle(recorded: asyncio.Future[None] | None) -> None:
    """Let the lane that waits for this outcome go on (it may have stopped waiting: cancelled)."""
    if recorded is not None and not recorded.done():
        recorded.set_result(None)


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{random.randrange(16**4):04x}"


class Worker:
    def __init__(
        self,
        database_url: str,
        transport: Transport,
        config: WorkerConfig | None = None,
        *,
        composer: Composer,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.url = database_url
        self.transport = transport
        self.config = config or WorkerConfig()
        self.name = self.config.name or default_worker_name()
        self.composer = composer
        self.faults = faults
        self.stats = WorkerStats()
        # an operation still failing fails again within a retry (5 s at most) or a renewal (lease / 3)
        self.outages = Outages(quiet=max(10.0, self.config.lease))
        """Database outages per operation: logged at their start, every minute and at their end."""
        self._running_loop: asyncio.AbstractEventLoop | None = None
        """The loop :meth:`run` runs on (asked once: in Python 3.11 each asking costs a system call)."""
        self._held: dict[Key, Held] = {}
        self._ready: asyncio.Queue[Held | None] = asyncio.Queue()
        self._results: list[_Result] = []
        self._stopping = False
        self._wake = asyncio.Event()
        self._build_wanted = asyncio.Event()
        self._space = asyncio.Event()
        self._record_wanted = asyncio.Event()
        self._stopped = asyncio.Event()
        self._wake_lanes = asyncio.Event()
        """Set when stopping: lanes paused by a transport outage stop waiting."""
        self._idempotent = transport.capabilities.idempotent
        self._crash: BaseException | None = None
        self._recorders: list[asyncio.Task[None]] = []
        self._channels: list[Channel] = []
        self._dirty_campaigns: set[tuple[int, int]] = set()
        self._last_check: dict[tuple[int, int], float] = {}
        self._check_interval = 0.2
        self._background: set[asyncio.Task[None]] = set()
        self._cursor: outbox.Cursor = {}
        """Where this worker's last claim of each campaign ended; emptied whenever it finds nothing to do."""
        self._cursor_resets = 0
        """Times the cursor was emptied (a claim in flight meanwhile must not move it on again)."""
        self._claims = 0
        """Claims made: the turn by which accounts take turns to be claimed from first."""
        self._outage_until = 0.0
        """While the transport is down (a transport-wide failure), no lane starts a send before this
        time (loop clock): the relay is probed by one try per lane and pause, not by every queued row."""
        self._outage_streak = 0
        """Transport-wide failures in a row, each after its pause: the next pause is twice as long."""
        self._outage_since: float | None = None
        """When the current transport outage began (time.monotonic(): read from the metrics thread too);
        None: the transport works."""
        if faults.active:
            faults.witness = self._witness

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._running_loop or asyncio.get_running_loop()

    @property
    def transport_outage_seconds(self) -> float:
        """How long the transport has been failing as a whole (0: it works, as far as this worker knows)."""
        since = self._outage_since  # read once: the metrics thread reads it while the loop writes it
        return 0.0 if since is None else time.monotonic() - since

    @property
    def held_count(self) -> int:
        """Rows this worker holds now (claimed, not yet recorded or given back)."""
        return len(self._held)

    # -- control -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful stop: finish what is in flight, give back what was claimed but not started."""
        if not self._stopping:
            logger.info("worker %s stopping", self.name, extra={"action": "stop"})
        self._stopping = True
        self._wake.set()
        self._space.set()
        self._build_wanted.set()
        self._wake_lanes.set()

    def _warn_of_short_sends(self) -> None:
        """A send must end before its lease does, so the lease, not the transport's timeout, may be what
        bounds a slow server's answer: say so when it cuts that timeout by more than half."""
        config = self.config
        settings = getattr(self.transport, "settings", None)
        timeout = getattr(settings, "timeout", None)
        # a send starts with at least two thirds of the lease left when renewals keep up
        longest = min(config.send_timeout, config.lease * 2 / 3 - config.margin * 0.2)
        if isinstance(timeout, int | float) and longest < min(timeout, config.send_timeout) / 2:
            logger.warning(
                "a %.0fs lease cuts each send to about %.1fs (the transport's timeout is %gs): a slower answer "
                "is given up, and over SMTP the message may be sent again (in the ledger); use --lease %.0f or more",
                config.lease,
                longest,
                timeout,
                math.ceil(min(timeout, config.send_timeout) / (2 / 3 - 0.05)),
                extra={"action": "short_sends"},
            )

    async def run(self) -> WorkerStats:
        self._running_loop = asyncio.get_running_loop()
        logger.info(
            "worker %s started (transport %s, concurrency %d, batch %d, lease %.0fs)",
            self.name,
            self.transport.capabilities.name,
            self.config.concurrency,
            self.config.batch_size,
            self.config.lease,
            extra={"action": "start"},
        )
        self._warn_of_short_sends()
        await self.transport.start()
        channels = [self.transport.channel() for _ in range(self.config.concurrency)]
        self._channels = channels
        senders = [asyncio.create_task(self._sender(channel), name=f"sender-{i}") for i, channel in enumerate(channels)]
        recorders = [asyncio.create_task(self._recorder(), name=f"recorder-{i}") for i in range(self.config.recorders)]
        self._recorders = recorders
        background = [
            asyncio.create_task(self._listener(), name="listener"),
            asyncio.create_task(self._housekeeper(), name="housekeeper"),
            asyncio.create_task(self._builder(), name="builder"),
        ]
        for task in [*background, *recorders, *senders]:
            task.add_done_callback(self._task_done)
        claimer = asyncio.create_task(self._claimer(), name="claimer")
        self._build_wanted.set()
        try:
            await claimer
        finally:
            self._stopping = True
            self._wake_lanes.set()
            for _ in senders:
                self._ready.put_nowait(None)
            await asyncio.gather(*senders, return_exceptions=True)
            self._stopped.set()
            self._record_wanted.set()
            await asyncio.gather(*recorders, return_exceptions=True)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            for channel in channels:
                with contextlib.suppress(Exception):
                    await channel.close()
            with contextlib.suppress(Exception):
                await self.transport.close()
        logger.info("worker %s stopped: %s", self.name, self.stats, extra={"action": "stopped"})
        if self._crash is not None:
            raise self._crash
        return self.stats

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug, not an outage (outages are retried inside the tasks): stop rather than limp on.
        self._crash = task.exception()
        logger.critical("worker task %s crashed", task.get_name(), exc_info=self._crash)
        self.stop()
        if task in self._recorders and all(recorder.done() for recorder in self._recorders):
            self._abandon_records()

    def _abandon_records(self) -> None:
        """No recorder is left: the outcomes still waiting will not be recorded by this process. Their
        rows stay 'sending' until their leases run out, then go out again (over SMTP, in the ledger:
        the claim saw them uncertain). The lanes that wait for one of them are let go: stopping, their
        gates send nothing more, and the worker ends instead of hanging with its leases renewed."""
        for result in self._results:
            _settle(result.recorded)

    # -- helpers -------------------------------------------------------------------------------

    async def _with_db(self, lane: _Lane, what: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T | None:
        """Run ``fn(conn, *args)`` on the lane's connection; on a connection failure, log, reset, return None.

        A statement that hangs (a partition that drops packets rather than resetting) is abandoned
        after ``db_timeout``: the connection is thrown away and the caller retries on a new one.
        """
        try:
            result = await _bounded(self._db_call(lane, fn, *args), self.config.db_timeout)
        except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure) as exc:
            # Two transactions met on the same rows in different orders; PostgreSQL rolled this one
            # back whole. Nothing was written: the caller tries again.
            logger.warning("%s: %s; will retry", what, type(exc).__name__, extra={"action": "db_conflict"})
            return None
        except (psycopg.Error, OSError, TimeoutError) as exc:
            if not isinstance(exc, TimeoutError) and not is_unavailable(exc):
                raise
            self.outages.failed(what, (str(exc) or type(exc).__name__).strip())
            await lane.reset()
            return None
        self.outages.succeeded(what)
        return result

    async def _db_call(self, lane: _Lane, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return await fn(await lane.get(), *args)

    async def _sleep(self, event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(timeout, 0.0))

    async def _maintain(self, conn: Conn) -> bool:
        """Start due campaigns, recover expired leases, finish completed campaigns. True: new work."""
        started = await outbox.start_due_campaigns(conn)
        for account_id, campaign_id in started:
            logger.info(
                "campaign %s started sending",
                campaign_id,
                extra={"action": "campaign_sending", "account_id": account_id},
            )
        if started:
            self._build_wanted.set()
        if self._dirty_campaigns:
            await self._check_campaigns(conn, force=True)
        expired = await outbox.requeue_expired(conn)
        for row in expired:
            logger.info(
                "lease expired on %s (attempt %s by %s): back to the queue",
                row["job_id"],
                row["attempt"],
                row["claimed_by"],
                extra={"action": "lease_expired", "job_id": row["job_id"]},
            )
        # Rows requeued here (or given back anywhere: the listener hears of those) are behind the claim
        # cursors; every housekeeping round starts the next claim from the front again, so no row waits
        # behind a cursor for longer than a round even if a notification was missed.
        self._reset_cursor()
        for account_id, campaign_id in await outbox.finish_campaigns(conn):
            logger.info("campaign %s sent", campaign_id, extra={"action": "campaign_sent", "account_id": account_id})
        return bool(started or expired)

    def _reset_cursor(self) -> None:
        """The next claim of every campaign starts from the front of its queue."""
        self._cursor_resets += 1
        self._cursor.clear()

    # -- claimer -------------------------------------------------------------------------------

    async def _claimer(self) -> None:
        lane = _Lane(self.url)
        loop = asyncio.get_running_loop()
        config = self.config
        failures = 0
        try:
            while not self._stopping:
                if self._ready.qsize() >= config.concurrency:
                    self._space.clear()
                    await self._sleep(self._space, config.tick)
                    continue
                self._wake.clear()
                started = loop.time()
                claimed_at = time.time()

                async def claim(conn: Conn, started: float, claimed_at: float) -> list[ClaimedDelivery] | float:
                    limit = config.batch_size
                    rate = config.transport_rate
                    if rate is not None:
                        # Tokens first, then only as many rows as tokens: the limit holds across workers.
                        limit, left = await rate_limits.take_up_to(conn, self.transport.rate_bucket, rate, limit)
                        if limit == 0:
                            return (1.0 - left) / rate.per_second
                    resets = self._cursor_resets
                    batch = await outbox.claim_batch(
                        conn,
                        limit=limit,
                        lease_seconds=config.lease,
                        worker=self.name,
                        transport_idempotent=self._idempotent,
                        key_life=self.transport.capabilities.key_life,
                        after=self._cursor,
                        turn=self._claims,
                    )
                    self._claims += 1
                    if self._cursor_resets != resets:  # reset during this claim: it stays reset
                        self._cursor.clear()
                    claimed = batch
                    try:
                        if rate is not None:
                            await rate_limits.refund(conn, self.transport.rate_bucket, rate, limit - len(batch))
                        if config.domain_rates:
                            batch = await self._domain_gate(conn, batch)
                            if rate is not None:  # the transport did not carry the rows put back
                                await rate_limits.refund(
                                    conn, self.transport.rate_bucket, rate, len(claimed) - len(batch)
                                )
                        if batch:
                            await self.composer.prepare(conn, batch)
                    except BaseException:
                        # The claim committed, but what follows it failed (the connection lost, a
                        # timeout, a message that cannot be composed now): hold the rows only to give
                        # them back at once, rather than leave them to their lease, which would bring
                        # them back as doubtful. Not those the domain gate deferred, once it returned;
                        # if it failed instead, a deferral it may have committed is no longer
                        # 'sending', and the release (fenced) leaves that row as it is.
                        self._take(batch, started + config.lease, claimed_at, release=True)
                        raise
                    self._take(batch, started + config.lease, claimed_at)
                    return batch

                batch = await self._with_db(lane, "claim", claim, started, claimed_at)
                if batch is None:
                    failures += 1
                    await asyncio.sleep(min(0.2 * 2**failures, 5.0))
                    continue
                failures = 0
                if isinstance(batch, float):  # rate-limited: wait for the next token
                    await self._sleep(self._wake, min(batch, config.tick))
                    continue
                self.stats.claims += 1
                self.stats.claim_seconds += loop.time() - started
                if batch:
                    self.faults.hit("after_claim")
                    continue
                # Nothing to claim: housekeeping, then sleep until something may be due. The next
                # claim starts from the front of every queue again (nothing is left ahead of a cursor).
                self._reset_cursor()
                new_work = await self._with_db(lane, "maintenance", self._maintain)
                if new_work:
                    continue
                if config.drain and not self._held:
                    is_open = await self._with_db(lane, "drain check", outbox.open_work)
                    if is_open is False:
                        logger.info("drained: no work left", extra={"action": "drained"})
                        self.stop()
                        break
                wait = await self._with_db(lane, "next wakeup", outbox.next_wakeup)
                timeout = config.tick if wait is None else min(config.tick, max(wait, 0.1))
                await self._sleep(self._wake, timeout)
        finally:
            await lane.reset()

    async def _domain_gate(self, conn: Conn, batch: list[ClaimedDelivery]) -> list[ClaimedDelivery]:
        """Keep the rows a per-domain rate allows now; put the others back, each at its turn."""
        by_domain: dict[str, list[ClaimedDelivery]] = {}
        for delivery in batch:
            if not delivery.blocked:
                # the A-label form: a domain typed in Unicode is the same domain, and the same limit
                domain = wire_address(delivery.email)[0].rpartition("@")[2].lower()
                if domain in self.config.domain_rates:
                    by_domain.setdefault(domain, []).append(delivery)
        deferred: list[tuple[Fenced, float]] = []
        held_back: set[Key] = set()
        for domain, rows in by_domain.items():
            rate = self.config.domain_rates[domain]
            granted, left = await rate_limits.take_up_to(conn, f"domain:{domain}", rate, len(rows))
            for index, delivery in enumerate(rows[granted:]):
                # spread the rest over the coming tokens, so they do not all come back at once
                delay = (index + 1 - left) / rate.per_second
                deferred.append((Fenced(delivery.account_id, delivery.delivery_id, delivery.attempt), delay))
                held_back.add(delivery.key)
        if deferred:
            await outbox.defer_claims(conn, deferred)
            self.stats.deferred += len(deferred)
        return [d for d in batch if d.key not in held_back]

    def _take(
        self, batch: list[ClaimedDelivery], lease_end: float, claimed_at: float, *, release: bool = False
    ) -> None:
        for delivery in batch:
            self.stats.claimed += 1
            if delivery.blocked:
                self.stats.suppressed += 1
                logger.debug(
                    "%s suppressed at claim",
                    delivery.job_id,
                    extra={"action": "suppressed", "job_id": delivery.job_id},
                )
                continue
            held = Held(delivery, lease_end, release=release, claimed_at=claimed_at)
            self._held[delivery.key] = held
            self._ready.put_nowait(held)

    def _witness(self) -> dict[str, Any]:
        """For the fault hook's death note: the rows held, as [job id, claimed at, lease end (both
        wall-clock), given back], and the lanes' open connections as [local port, server port,
        opened at]. The chaos suite counts those rows whose message reached the inbox after the
        claim, by one of those connections or before the lease ended: sent, and never recorded."""
        now, loop_now = time.time(), self._loop.time()
        held = [
            [h.delivery.job_id, h.claimed_at, now + (h.lease_end - loop_now), h.given_back] for h in self._held.values()
        ]
        connections = [list(c) for c in (channel.connection for channel in self._channels) if c is not None]
        return {"held": held, "connections": connections}

    def _forget(self, held: Held) -> None:
        """Stop holding this claim. Not by key alone: after its lease ran out, this worker may have
        claimed the row again (a new attempt), and that claim is still held and must stay renewed."""
        key = held.delivery.key
        if self._held.get(key) is held:
            del self._held[key]

    # -- senders -------------------------------------------------------------------------------

    def _settled_unsent(self, held: Held) -> bool:
        """True when a row a lane took must not be sent now; its outcome is then settled here."""
        if held.revoked:
            self._forget(held)
            return True
        if self._stopping or held.release:
            self._push(_Result(held, None))
            return True
        if self._loop.time() >= held.lease_end - self.config.margin:
            self._past_deadline(held)
            return True
        return False

    def _prepare(self, held: Held) -> OutgoingMessage | None:
        """The message of a row a lane took, or None (its outcome is settled here: not sent). The row
        is not marked started: until its send begins, a pause still gives it back."""
        if self._settled_unsent(held):
            return None
        try:
            return self.composer.compose(held.delivery)
        except ComposeLater as exc:
            # The account's DKIM key cannot be read: every message of its sender would wait alike. A
            # campaign's row pauses its campaign (see Retry.sender_wide), rather than each row failing
            # after its tries and the campaign ending "sent" with nothing delivered.
            held.started = True
            self._hold_back_campaign(held.delivery)
            self._push(_Result(held, Retry(f"{_CANNOT_COMPOSE}: {exc}", sender_wide=True)))
        except ComposeError as exc:
            held.started = True
            self._push(_Result(held, Permanent(f"cannot compose: {exc}")))
        return None

    async def _sender(self, channel: Channel) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        # Without idempotency keys, an accepted message that is not recorded yet is the one a crash
        # would duplicate. A lane never sends a message's content (SMTP: DATA) while its previous
        # accepted message is unrecorded, so at any instant each connection has at most one such
        # message. It may prepare the next one meanwhile (MAIL FROM, RCPT TO, DATA up to its 354): those
        # deliver nothing.
        unrecorded: asyncio.Future[None] | None = None
        # the lane's next row, taken while its previous message waited to go out (its envelope may
        # have gone out with that message's content)
        following: tuple[Held, OutgoingMessage] | None = None

        def follow() -> OutgoingMessage | None:
            # Called by the channel before a content goes out: the next row, if one is queued.
            nonlocal following
            while True:
                try:
                    held = self._ready.get_nowait()
                except asyncio.QueueEmpty:
                    return None
                self._space.set()
                if held is None:  # stopping: this lane ends after its current message
                    self._ready.put_nowait(None)
                    return None
                try:
                    message = self._prepare(held)
                except Exception as exc:  # the row is out of the queue: settle it, never drop it
                    logger.exception("preparing %s failed", held.delivery.job_id)
                    held.started = True
                    self._push(_Result(held, Retry(f"cannot prepare: {type(exc).__name__}: {exc}"[:500])))
                    continue
                if message is not None:
                    following = (held, message)
                    return message

        while True:
            if following is not None:
                # taken by follow() and composed then; checked again now (a pause, a lost lease or a
                # stop may have come meanwhile: its envelope, if it went ahead, delivers nothing, and
                # the channel closes that transaction before its next send)
                (held, message), following = following, None
                if self._settled_unsent(held):
                    continue
            else:
                if self._ready.empty():
                    self.stats.lane_waits += 1
                next_held = await self._ready.get()
                self._space.set()
                if next_held is None:
                    return
                held = next_held
                prepared = self._prepare(held)
                if prepared is None:
                    continue
                message = prepared
            if self._outage_until > loop.time():
                # the transport is down: wait for the probe time, then look at the row again (a pause,
                # a stop or a lost lease may have come meanwhile)
                await self._outage_pause()
                if self._settled_unsent(held):
                    continue
            self.faults.hit("before_send")
            held.started = True

            async def gate(held: Held = held, previous: asyncio.Future[None] | None = unrecorded) -> float | None:
                if previous is not None:
                    if not previous.done():
                        self.stats.record_waits += 1
                    waited = loop.time()
                    await previous
                    self.stats.record_wait_seconds += loop.time() - waited
                # Re-checked at the last moment: never send after the claim's deadline, a lost lease,
                # a pause, or a graceful stop (what has not gone out yet is given back).
                left = held.lease_end - loop.time()
                if left <= config.margin or held.revoked or held.release or self._stopping:
                    return None
                held.content = True
                # and the send itself must end before the lease does, whatever the transport's timeout
                return min(config.send_timeout, left - config.margin * 0.2)

            budget = min(config.send_timeout, held.lease_end - loop.time() - config.margin * 0.2)
            outcome = await channel.send(
                message, timeout=max(budget, 0.1), gate=None if self._idempotent else gate, follow=follow
            )
            self._note_transport(outcome)
            if isinstance(outcome, Retry) and outcome.sender_wide:
                self._hold_back_campaign(held.delivery)
            if isinstance(outcome, Withheld):
                if loop.time() >= held.lease_end - config.margin:
                    self._past_deadline(held, count_only=True)
                self._push(_Result(held, None))
                continue
            if isinstance(outcome, Accepted):
                self.faults.hit("after_accept")
            may_have_arrived = isinstance(outcome, Accepted) or (isinstance(outcome, Retry) and outcome.uncertain)
            if self._idempotent or not may_have_arrived:
                self._push(_Result(held, outcome))
                continue
            # accepted, or lost in the middle of DATA: the next DATA waits until this is recorded
            result = _Result(held, outcome, recorded=loop.create_future())
            self._push(result)
            unrecorded = result.recorded

    def _hold_back_campaign(self, delivery: ClaimedDelivery) -> None:
        """Its sender was refused: what this worker holds of its campaign and has not started goes
        back (the recorder pauses the campaign), rather than each row meeting the refusal in turn."""
        if delivery.campaign_id is None:
            return
        for h in self._held.values():
            d = h.delivery
            if d.campaign_id == delivery.campaign_id and d.account_id == delivery.account_id and not h.content:
                h.release = True

    def _past_deadline(self, held: Held, *, count_only: bool = False) -> None:
        """Past this claim's deadline: the lease may be gone. Never start a send now; give it back."""
        self.stats.dropped_past_deadline += 1
        logger.warning(
            "%s: claim deadline passed before sending; giving it back",
            held.delivery.job_id,
            extra={"action": "deadline_passed", "job_id": held.delivery.job_id},
        )
        if not count_only:
            self._push(_Result(held, None))

    def _note_transport(self, outcome: Outcome) -> None:
        """A transport-wide failure starts (or, after its pause, lengthens) an outage; the transport
        answering about a message ends it."""
        if isinstance(outcome, Retry) and outcome.transport_wide:
            loop = self._loop
            self.stats.transport_failures += 1
            if self._outage_since is None:
                self._outage_since = time.monotonic()
            if loop.time() < self._outage_until:
                return  # a lane that started before the pause began: the same outage, the same pause
            pause = min(self._backoff(min(self._outage_streak, 16), None), _OUTAGE_PROBE_EVERY)
            if outcome.retry_after is not None:
                pause = max(pause, min(outcome.retry_after, _RETRY_AFTER_CAP))
            self._outage_streak += 1
            self._outage_until = loop.time() + pause
            logger.warning(
                "transport unavailable (%s); lanes pause %.1fs",
                outcome.error,
                pause,
                extra={"action": "transport_outage"},
            )
        elif isinstance(outcome, Accepted | Permanent):
            if self._outage_since is not None:
                logger.info(
                    "transport available again after %.0fs",
                    time.monotonic() - self._outage_since,
                    extra={"action": "transport_back"},
                )
            self._outage_streak = 0
            self._outage_since = None

    async def _outage_pause(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping and (left := self._outage_until - loop.time()) > 0:
            await self._sleep(self._wake_lanes, left)

    def _push(self, result: _Result) -> None:
        result.held.done = True
        result.held.given_back = result.outcome is None or isinstance(result.outcome, Retry)
        self._results.append(result)
        self._record_wanted.set()

    # -- recorder ------------------------------------------------------------------------------

    def _backoff(self, failures: int, retry_after: float | None) -> float:
        """Seconds before a message's next try: ``backoff_cap`` at most, before the jitter (x0.5-1.5),
        however long a provider's Retry-After asks for (a date years ahead would park the row, and its
        campaign, that long)."""
        cap = self.config.backoff_cap
        delay = min(cap, self.config.backoff_base * 2.0 ** max(failures, 0)) * random.uniform(0.5, 1.5)
        if retry_after is not None:
            delay = max(delay, min(retry_after, cap))
        return delay

    def _recorder_lane(self) -> _Lane:
        # A group's statements join a handful of rows to the outbox by primary key. PostgreSQL planned
        # them again at every run: a custom plan fits the arrays given, so the generic plan looked
        # dearer and was never chosen, although it is the same nested loop. Planned once instead:
        # PostgreSQL's CPU per message -15% at 4 workers x 5 connections (bench/out/steps/README.md).
        setup = "SET plan_cache_mode = force_generic_plan"
        if not self.config.durable_records:
            setup += "; SET synchronous_commit = off"
        return _Lane(self.url, setup=setup)

    async def _recorder(self) -> None:
        lane = self._recorder_lane()
        loop = asyncio.get_running_loop()
        failures = 0
        try:
            while True:
                if not self._results:
                    if self._stopped.is_set():
                        return
                    self._record_wanted.clear()
                    await self._sleep(self._record_wanted, 1.0)
                    continue
                if not any(r.recorded is not None for r in self._results):
                    # Nobody waits: let outcomes gather for a moment, one grouped UPDATE for many.
                    # When a lane waits, flush at once; outcomes arriving meanwhile form the next group.
                    await asyncio.sleep(self.config.record_interval)
                    if not self._results:  # another recorder took them meanwhile
                        continue
                results, self._results = self._results, []
                started = loop.time()
                try:
                    ok = await self._with_db(lane, "record", self._record, results)
                except BaseException:
                    # A bug, not an outage: this recorder ends and the worker stops. The group goes
                    # back, for another recorder or, if none is left, to let its waiting lanes go.
                    self._results[:0] = results
                    self._record_wanted.set()
                    raise
                if ok is None:
                    self._results[:0] = results  # keep them, in order, for the next try
                    failures += 1
                    if self._stopping and failures > 10:
                        # Shutting down without a database: these rows stay 'sending' until their
                        # lease expires, then are re-sent (and, over SMTP, written to the ledger).
                        logger.error("stopping with %d outcomes unrecorded: database unavailable", len(self._results))
                        for result in self._results:
                            _settle(result.recorded)
                        self._results.clear()
                        return
                    await asyncio.sleep(min(0.2 * 2**failures, 5.0))
                    continue
                for result in results:
                    _settle(result.recorded)
                self.stats.record_groups += 1
                self.stats.record_seconds += loop.time() - started
                failures = 0
                if self._dirty_campaigns:
                    # After the group is settled, in a call of its own: a check that fails or outlasts
                    # db_timeout used to fail the whole record, which ran again (and checked again)
                    # while the lanes waiting for it sent nothing.
                    await self._with_db(lane, "campaign check", self._check_campaigns)
                if not self._held:
                    # Everything this worker held is recorded: an idle claimer looks again now (a
                    # campaign may be complete), rather than at its next tick.
                    self._wake.set()
        finally:
            await lane.reset()

    async def _record(self, conn: Conn, results: list[_Result]) -> bool:
        sent: list[SentRecord] = []
        retry: list[RetryRecord] = []
        failed: list[FailedRecord] = []
        release: list[Fenced] = []
        # A group can hold two outcomes of one row: an old attempt's (its lease ran out meanwhile) and
        # that of this worker's new claim of it. The statements fence by attempt, so at most the
        # latest attempt's outcome is the one a returned row stands for.
        latest: dict[Key, int] = {}
        refusals: list[tuple[int, int, Key, int, str]] = []  # a campaign's sender refused, for a row's attempt
        for result in results:
            d = result.held.delivery
            latest[d.key] = max(latest.get(d.key, 0), d.attempt)
            outcome = result.outcome
            if outcome is None or isinstance(outcome, Withheld):
                release.append(result.held.fenced)
            elif isinstance(outcome, Accepted):
                sent.append(SentRecord(d.account_id, d.delivery_id, d.attempt, outcome.message_id, result.sent_at))
            elif isinstance(outcome, Retry) and outcome.transport_wide:
                # not this message's failure: back to the queue, uncounted, until the outage's probe time
                delay = max(self._outage_until - self._loop.time(), 0.0)
                retry.append(
                    RetryRecord(
                        d.account_id, d.delivery_id, d.attempt, delay, outcome.error, outcome.uncertain, counted=False
                    )
                )
            elif (
                isinstance(outcome, Retry)
                and outcome.sender_wide
                and d.campaign_id is not None
                and d.failures + 1 < self.config.max_failures
            ):
                # Every row of this campaign would fail alike, each after its tries: the campaign
                # pauses (in this transaction) and the row goes back for its resume. Counted all the
                # same: a refusal that was this row's after all (a reply read wrongly as the sender's)
                # fails it after its tries, across resumes, instead of pausing the campaign at each.
                reason = (
                    outcome.error
                    if outcome.error.startswith(_CANNOT_COMPOSE)
                    else f"the transport refuses the campaign's sender: {outcome.error}"
                )
                refusals.append((d.account_id, d.campaign_id, d.key, d.attempt, reason))
                retry.append(RetryRecord(d.account_id, d.delivery_id, d.attempt, 0.0, outcome.error, outcome.uncertain))
            elif isinstance(outcome, Retry):
                if d.failures + 1 >= self.config.max_failures:
                    failed.append(
                        FailedRecord(
                            d.account_id,
                            d.delivery_id,
                            d.attempt,
                            f"gave up after {d.failures + 1} failures: {outcome.error}",
                            uncertain=outcome.uncertain,
                        )
                    )
                else:
                    delay = self._backoff(d.failures, outcome.retry_after)
                    retry.append(
                        RetryRecord(d.account_id, d.delivery_id, d.attempt, delay, outcome.error, outcome.uncertain)
                    )
            else:
                failed.append(FailedRecord(d.account_id, d.delivery_id, d.attempt, outcome.error, outcome.hard_bounce))

        # One transaction: a group is recorded whole or not at all, so a group retried after a failure
        # (an outage, a deadlock between recorders) never counts a failure twice. Most groups are all
        # "sent": one statement, atomic by itself, without the round trips of BEGIN and COMMIT.
        kinds = sum(1 for part in (sent, retry, failed, release, refusals) if part)
        paused: list[tuple[int, dict[str, Any]]] = []
        async with conn.transaction() if kinds > 1 else contextlib.nullcontext():
            recorded_sent = await outbox.record_sent(conn, sent)
            recorded_retry = await outbox.record_retry(conn, retry)
            failed_outcome = await outbox.record_failed(conn, failed)
            recorded_failed = failed_outcome.recorded
            released = await outbox.release_claims(conn, release)
            # Only a refusal the row still stands for: a stale attempt's (the row re-claimed since,
            # perhaps after the sender was fixed and the campaign resumed) pauses nothing.
            refused = {
                (account_id, campaign_id): reason
                for account_id, campaign_id, key, attempt, reason in refusals
                if key in recorded_retry and attempt == latest[key]
            }
            for (account_id, campaign_id), reason in sorted(refused.items()):
                alert = await feedback.pause_for_refused_sender(conn, account_id, campaign_id, reason)
                if alert is not None:
                    paused.append((account_id, alert))
        for account_id, alert in paused:
            self._paused_campaign(account_id, alert)
        self._dirty_campaigns |= failed_outcome.bounced_campaigns
        # and every hard bounce of the group, recorded by this run or not: a group run again after a
        # commit whose answer was lost finds its rows recorded already, and its campaign's bounce
        # rate would not be checked (a review found it; a check too many only reads the campaign)
        self._dirty_campaigns |= {
            (r.held.delivery.account_id, r.held.delivery.campaign_id)
            for r in results
            if isinstance(r.outcome, Permanent) and r.outcome.hard_bounce and r.held.delivery.campaign_id is not None
        }

        self.stats.released += released
        recorded = recorded_sent | recorded_retry | recorded_failed
        debug = logger.isEnabledFor(logging.DEBUG)  # asked once a group: most outcomes log at debug level
        for result in results:
            self._forget(result.held)
            d = result.held.delivery
            key = d.key
            outcome = result.outcome
            if outcome is None:
                if debug:
                    extra = {"action": "released", "job_id": d.job_id, "attempt": d.attempt}
                    logger.debug("%s released", d.job_id, extra=extra)
                continue
            if key in recorded_sent and d.attempt == latest[key]:
                self.stats.sent += 1
                if debug:
                    logger.debug(
                        "%s sent", d.job_id, extra={"action": "sent", "job_id": d.job_id, "attempt": d.attempt}
                    )
                continue
            extra = {"job_id": d.job_id, "attempt": d.attempt}
            if key not in recorded or d.attempt != latest[key]:
                self.stats.fenced_out += 1
                logger.warning(
                    "%s: outcome refused, the row was re-claimed by another worker (attempt %d is stale)",
                    d.job_id,
                    d.attempt,
                    extra={"action": "fenced_out", **extra},
                )
            elif key in recorded_retry:
                self.stats.retried += 1
                logger.info(
                    "%s retry: %s",
                    d.job_id,
                    getattr(outcome, "error", ""),
                    extra={"action": "retry", **extra},
                )
            else:
                self.stats.failed += 1
                logger.info(
                    "%s failed: %s",
                    d.job_id,
                    getattr(outcome, "error", ""),
                    extra={"action": "failed", **extra},
                )
        # after the rows are forgotten: a death here leaves nothing of this group held (its note says so)
        self.faults.hit("after_record")
        return True

    async def _check_campaigns(self, conn: Conn, *, force: bool = False) -> None:
        """Pause campaigns whose bounce rate went over their limit.

        Only campaigns that had hard bounces since their last check are checked, and not more often
        than ten times the duration of the last check (the count reads the whole campaign); ``force``
        (when the worker is idle, before campaigns are finished) checks every pending one.
        """
        now = time.monotonic()
        for key in list(self._dirty_campaigns):
            if not force and now - self._last_check.get(key, -1e9) < self._check_interval:
                continue
            # Taken out before the check: a bounce another recorder commits meanwhile marks it again.
            # Put back if the check fails, so that it is made again.
            self._dirty_campaigns.discard(key)
            self._last_check[key] = started = time.monotonic()
            try:
                alert = await feedback.check_campaign(conn, key[0], key[1], self.config.feedback)
            except BaseException:
                self._dirty_campaigns.add(key)
                raise
            self._check_interval = max(0.2, 10 * (time.monotonic() - started))
            if alert is not None:
                self._paused_campaign(key[0], alert)

    def _paused_campaign(self, account_id: int, alert: dict[str, Any]) -> None:
        """Say that this worker paused a campaign (an alert, already stored), and post the alert."""
        logger.warning(
            "campaign %s paused: %s",
            alert["detail"]["campaign_id"],
            alert["detail"]["reason"],
            extra={"action": "campaign_paused", "account_id": account_id},
        )
        if self.config.alert_webhook_url:
            task = asyncio.create_task(post_alert(self.config.alert_webhook_url, account_id, alert))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- housekeeper ---------------------------------------------------------------------------

    async def _housekeeper(self) -> None:
        lane = _Lane(self.url)
        loop = asyncio.get_running_loop()
        config = self.config
        try:
            while True:
                await asyncio.sleep(min(config.renew_every, config.tick))
                held = [h for h in self._held.values() if not h.revoked]
                if held:
                    started = loop.time()
                    renewal = await self._with_db(
                        lane, "renew", outbox.renew_leases, [h.fenced for h in held], config.lease
                    )
                    if renewal is not None:
                        self._apply_renewal(held, renewal, started + config.lease)
                await self._with_db(lane, "maintenance", self._maintain)
        finally:
            await lane.reset()

    def _apply_renewal(self, held: list[Held], renewal: outbox.Renewal, lease_end: float) -> None:
        owned = renewal.renewed
        for h in held:
            key = h.delivery.key
            if key in renewal.busy:
                # still ours, locked for a moment by someone else: it keeps the deadline it has
                if not renewal.busy[key] and not h.content:
                    h.release = True
                continue
            if key not in owned:
                if h.done:
                    continue  # recorded (or being recorded) meanwhile: not ours to renew any more, rightly
                if not h.revoked:
                    self.stats.lost_leases += 1
                    logger.warning(
                        "%s: lease lost (re-claimed or requeued); not sending it",
                        h.delivery.job_id,
                        extra={"action": "lease_lost", "job_id": h.delivery.job_id},
                    )
                h.revoked = True
                continue
            h.lease_end = lease_end
            if not owned[key] and not h.content:
                # Until its content goes out: a row whose lane waits at the gate (its envelope sent,
                # its previous message's record slow to come) was sent all the same.
                h.release = True

    # -- builder and listener --------------------------------------------------------------------

    async def _builder(self) -> None:
        lane = _Lane(self.url)
        retry: float | None = None
        try:
            while not self._stopping:
                await self._sleep(self._build_wanted, retry if retry is not None else self.config.tick)
                self._build_wanted.clear()
                retry = None
                while not self._stopping:
                    progress = await self._with_db(lane, "build", outbox.build_next_chunk, self.config.build_chunk)
                    if progress is None:  # the database failed: try again soon, not at the next tick
                        retry = 1.0
                        break
                    if progress == outbox.BUILD_BUSY:
                        # Another builder holds the list, or a statement held the row for an instant;
                        # if it is a passing lock, nobody else may wake us: look again shortly.
                        retry = 0.5
                        break
                    if isinstance(progress, str):
                        break
                    self._wake.set()
                    if progress.done:
                        logger.info(
                            "campaign %s: recipient list built",
                            progress.campaign_id,
                            extra={"action": "campaign_built", "account_id": progress.account_id},
                        )
                    self.faults.hit("mid_build")
                    await asyncio.sleep(0)
        finally:
            await lane.reset()

    async def _listener(self) -> None:
        timeout = self.config.db_timeout
        while True:
            try:
                conn = await _bounded(psycopg.AsyncConnection.connect(self.url, autocommit=True), timeout)
                async with conn:
                    await _bounded(conn.execute("LISTEN sendonce_work"), timeout)
                    self._wake.set()  # anything that happened while we were not listening
                    while True:
                        async for notify in conn.notifies(timeout=_LISTENER_CHECK_EVERY):
                            if notify.payload in ("requeued", "released"):
                                self._reset_cursor()  # rows went back to the queue behind the cursor
                            self._wake.set()
                            self._build_wanted.set()
                        # silent for a while: still connected? (no answer: a new connection)
                        await _bounded(conn.execute("SELECT 1"), timeout)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                logger.debug("listener: %s; reconnecting", exc)
                await asyncio.sleep(1.0)


async def run_until_signalled(worker: Worker) -> WorkerStats:
    """Run ``worker``; SIGTERM and SIGINT stop it gracefully."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        return await worker.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
