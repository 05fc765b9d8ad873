"""Where the mail goes, and the one place the verdict is read from: what actually arrived.

Two kinds of sink, both real servers on loopback from :mod:`sendonce.testing`:

* SMTP: one or more aiosmtpd inboxes (a worker cut off from PostgreSQL gets an inbox of its own,
  so what it sent while isolated can be told apart; a recipient's view is the union of all of them);
* the Resend-compatible HTTP API, which honours ``Idempotency-Key``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.testing.inbox import Inbox, InboxFaults
from sendonce.testing.resend_server import ResendFaults, ResendServer


@dataclass(frozen=True, slots=True)
class Arrival:
    """One message that reached a recipient's mailbox (SMTP) or was accepted by the provider (HTTP)."""

    job_id: str | None
    recipient: str
    """The recipient's address key (see :func:`sendonce.domain.addresses.parse_address`)."""
    at: float
    """Wall-clock time of arrival."""
    box: str
    """Which inbox received it: ``main`` or the name of a side inbox."""
    peer_port: int | None = None
    """SMTP: the sender's TCP port (with ``greeted_at``, which connection of which worker it came by)."""
    greeted_at: float | None = None
    """SMTP: when that connection said EHLO."""
    server_port: int | None = None
    """SMTP: the port of the inbox that received it."""


def address_key(text: str) -> str:
    try:
        return parse_address(text).key
    except InvalidAddress:
        return text


class _Tally:
    """Arrivals under one job-id prefix, counted incrementally: the sinks only ever grow."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.seen = 0
        self.matched = 0

    def update(self, new_job_ids: list[str | None]) -> int:
        self.seen += len(new_job_ids)
        self.matched += sum(1 for job_id in new_job_ids if job_id is not None and job_id.startswith(self.prefix))
        return self.matched


class Sink(Protocol):
    name: str
    idempotent: bool

    def url(self, box: str = "main") -> str: ...

    def arrivals(self) -> list[Arrival]: ...

    def fault_counts(self) -> Counter[str]: ...

    def ambiguous(self) -> Counter[str]: ...

    def planned_faults(self, messages: int) -> dict[str, float]:
        """Per fault counter: about how many a run of ``messages`` messages should see (0: not set)."""
        ...

    def count(self, prefix: str) -> int:
        """Arrivals whose job id starts with ``prefix`` (cheap: used to pace the chaos)."""
        ...

    def stop(self) -> None: ...


class SmtpSink:
    """Real SMTP inboxes. ``timeout`` goes into the transport URL (``?timeout=`` seconds)."""

    name = "smtp"
    idempotent = False

    def __init__(self, faults: InboxFaults | None = None, *, timeout: float | None = None) -> None:
        self.timeout = timeout
        self.boxes: dict[str, Inbox] = {"main": Inbox(faults=faults).start()}
        self._tallies: dict[tuple[str, str], _Tally] = {}

    def add_box(self, box: str, faults: InboxFaults | None = None) -> Inbox:
        inbox = Inbox(faults=faults).start()
        self.boxes[box] = inbox
        return inbox

    @property
    def main(self) -> Inbox:
        return self.boxes["main"]

    def url(self, box: str = "main") -> str:
        base = self.boxes[box].url
        return f"{base}?timeout={self.timeout:g}" if self.timeout is not None else base

    def arrivals(self) -> list[Arrival]:
        return [arrival for box, inbox in self.boxes.items() for arrival in self.arrivals_of(inbox, box)]

    @staticmethod
    def arrivals_of(inbox: Inbox, box: str) -> list[Arrival]:
        port = inbox.port if inbox.running else None
        return [
            Arrival(
                message.job_id,
                address_key(rcpt),
                message.received_at,
                box,
                message.peer_port,
                message.greeted_at,
                port,
            )
            for message in inbox.messages
            for rcpt in message.rcpt_to
        ]

    def count(self, prefix: str) -> int:
        total = 0
        for box, inbox in self.boxes.items():
            tally = self._tallies.setdefault((box, prefix), _Tally(prefix))
            total += tally.update([m.job_id for m in inbox.messages[tally.seen :]])
        return total

    def fault_counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for inbox in self.boxes.values():
            total.update(inbox.faults.counts)
        return total

    def ambiguous(self) -> Counter[str]:
        """Per job id: answers after which the client could not know that its message had arrived."""
        total: Counter[str] = Counter()
        for inbox in self.boxes.values():
            total.update(inbox.faults.ambiguous)
        return total

    def planned_faults(self, messages: int) -> dict[str, float]:
        # Only the main inbox's: a box of its own (the partition's) sees an unknown share of the mail.
        # Each fault is rolled once per message, after the ones before it missed.
        faults = self.main.faults
        planned: dict[str, float] = {}
        left = float(messages)
        for counter, probability in (
            ("temp_fail", faults.temp_fail),
            ("slow", faults.slow),
            ("dropped_after_data", faults.drop_after_data),
            ("garbled_reply", faults.garbled_reply),
        ):
            planned[counter] = left * probability
            left -= planned[counter]
        return planned

    def stop(self) -> None:
        for inbox in self.boxes.values():
            inbox.stop()


class ResendSink:
    """The Resend-compatible HTTP API: a repeat of a key is replayed, never delivered twice."""

    name = "resend"
    idempotent = True

    def __init__(self, faults: ResendFaults | None = None) -> None:
        self.server = ResendServer(faults=faults).start()
        self._tallies: dict[str, _Tally] = {}

    def url(self, box: str = "main") -> str:
        return self.server.url

    def arrivals(self) -> list[Arrival]:
        return [
            Arrival(email.job_id, address_key(to), email.received_at, "main")
            for email in list(self.server.accepted)
            for to in email.to
        ]

    def count(self, prefix: str) -> int:
        tally = self._tallies.setdefault(prefix, _Tally(prefix))
        return tally.update([e.job_id for e in self.server.accepted[tally.seen :]])

    def fault_counts(self) -> Counter[str]:
        return Counter(self.server.faults.counts)

    def ambiguous(self) -> Counter[str]:
        return Counter()  # a re-send is harmless here: the key makes the provider replay its answer

    def planned_faults(self, messages: int) -> dict[str, float]:
        faults = self.server.faults
        counts = faults.counts
        # A 409 for a seen key can only answer a repeat: about its share of the repeats that came.
        repeats = counts["replayed"] + counts["409_replay_conflict"]
        return {
            "429": messages * faults.rate_limited,
            "500": messages * faults.server_error,
            "accept_then_stall": messages * faults.accept_then_stall,
            "409_replay_conflict": repeats * faults.replay_conflict,
        }

    def stop(self) -> None:
        self.server.stop()


def describe_faults(counts: Counter[str] | dict[str, Any]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()) if n) or "none"
