"""Database outages as a worker lives them, per operation (claim, record, maintenance, ...).

A worker never gives up on an unavailable database: an outage ends, and a worker that had exited
would need someone to start it again. It retries instead, and makes the outage visible:

* one warning when an operation starts failing, a reminder every ``remind_every`` seconds while it
  goes on (with how long and how many failures), and one line when it works again. Before this, each
  retry logged a warning of its own: thousands a day during a long outage, and no sign of its end;
* how long each operation has been failing, for ``/metrics``
  (``sendonce_worker_database_outage_seconds``): a standby promoted late, or a database left
  read-only, shows as a claim that fails for minutes while reads still work.

Operations are counted apart because they can fail apart: a read-only server answers reads and
refuses every write (claims, records, renewals). One operation's state is shared by the lanes that run
it (two recorders, say): a lane whose calls keep failing while another's work is logged as outages
that end and start again, not as one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("sendonce.delivery.worker")


@dataclass(slots=True)
class _Outage:
    since: float
    failures: int
    reminded_at: float
    failed_at: float


class Outages:
    def __init__(
        self, *, remind_every: float = 60.0, quiet: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.remind_every = remind_every
        self.quiet = quiet
        """An operation that has not failed for this long, while another one works, is no longer
        failing: some operations are called only now and then (the look for the next due row runs
        only when a claim finds nothing), and their outage must not outlive the database's."""
        self._clock = clock
        self._open: dict[str, _Outage] = {}
        self._seen: set[str] = set()
        self.failures = 0
        """Database calls that failed because the database was unavailable, since the start."""

    def failed(self, operation: str, error: str) -> None:
        now = self._clock()
        self.failures += 1
        self._seen.add(operation)
        outage = self._open.get(operation)
        if outage is None:
            self._open[operation] = _Outage(since=now, failures=1, reminded_at=now, failed_at=now)
            logger.warning(
                "%s: database unavailable (%s); retrying until it answers",
                operation,
                error,
                extra={"action": "db_unavailable", "operation": operation},
            )
            return
        outage.failures += 1
        outage.failed_at = now
        if now - outage.reminded_at >= self.remind_every:
            outage.reminded_at = now
            logger.warning(
                "%s: database still unavailable after %.0f s and %d failures (%s); retrying",
                operation,
                now - outage.since,
                outage.failures,
                error,
                extra={"action": "db_unavailable", "operation": operation},
            )

    def succeeded(self, operation: str) -> None:
        if not self._open:  # the common case: one dict test per database call
            return
        now = self._clock()
        for name, outage in list(self._open.items()):
            if name == operation or now - outage.failed_at >= self.quiet:
                del self._open[name]
                logger.warning(
                    "%s: database available again after %.1f s and %d failures",
                    name,
                    (now if name == operation else outage.failed_at) - outage.since,
                    outage.failures,
                    extra={"action": "db_available", "operation": name},
                )

    def seconds(self) -> dict[str, float]:
        """How long each operation that ever failed has been failing now (0: it works again)."""
        now = self._clock()
        open_now = dict(self._open)  # may be read from another thread (the metrics server)
        return {op: (now - open_now[op].since if op in open_now else 0.0) for op in list(self._seen)}
