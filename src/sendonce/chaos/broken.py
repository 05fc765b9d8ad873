"""Deliberately broken builds of the worker, to prove that the chaos suite catches what they break.

Only the chaos suite turns them on: it starts workers as

    python -m sendonce.chaos.broken <build> --log-level info worker ...

which patches this one process and then runs the normal ``sendonce`` CLI. Nothing in sendonce reads
a switch for them; the code under test is untouched.

Builds:

``no-fencing``
    ``record_sent``, ``record_retry`` and ``record_failed`` lose their ``AND d.attempt = u.attempt``:
    a worker presumed dead completes rows that another worker re-claimed (zombie completions). The
    partition scenario must catch it.

``mark-sent-first``
    The seed's ordering: each row is recorded ``sent`` (and committed) *before* the transport is
    called, and the outcome of the call is ignored. A kill between the two loses the message
    silently. The kills scenario must report losses.

``no-record-wait``
    The SMTP channel is called without its gate: a connection sends its next content without waiting
    until its previous accepted message is recorded (nor re-checking the claim's deadline there), so
    a kill can leave several messages per connection sent and unrecorded. The kills scenario must
    find a kill with more than one per connection in flight.

``lost-record``
    ``record_sent`` leaves out one accepted message in every 25 it is given and says it recorded them
    all. The worker forgets the row; its lease runs out; another claim sends it again (ledgered, as
    an uncertain row is). No fault touched that message: the kills scenario must find a duplicate
    that no fault on its own job explains, even where the total stays within the in-flight bound.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from sendonce.delivery.compose import ComposeError
from sendonce.delivery.worker import Worker, _Lane, _Result
from sendonce.domain.message import OutgoingMessage
from sendonce.store import outbox
from sendonce.store.database import Conn
from sendonce.store.outbox import Key, SentRecord
from sendonce.store.queries import QUERIES
from sendonce.transports.base import Channel, Follow, Gate, Outcome, Permanent

BUILDS = ("no-fencing", "mark-sent-first", "no-record-wait", "lost-record")
FENCE = "AND d.attempt = u.attempt"


def remove_fencing() -> None:
    for name in ("record_sent", "record_retry", "record_failed"):
        if FENCE not in QUERIES[name]:
            raise RuntimeError(f"query {name} has no {FENCE!r} any more: update sendonce.chaos.broken")
        QUERIES[name] = QUERIES[name].replace(FENCE, "")


async def _sender_marking_sent_first(self: Worker, channel: Channel) -> None:
    """The worker's sender with the seed's order: mark sent, commit, then send (and never look back)."""
    loop = asyncio.get_running_loop()
    lane = _Lane(self.url)
    try:
        while True:
            held = await self._ready.get()
            self._space.set()
            if held is None:
                return
            if held.revoked:
                self._held.pop(held.delivery.key, None)
                continue
            if self._stopping or held.release or loop.time() >= held.lease_end - self.config.margin:
                self._push(_Result(held, None))
                continue
            try:
                message = self.composer.compose(held.delivery)
            except ComposeError as exc:
                held.started = True
                self._push(_Result(held, Permanent(f"cannot compose: {exc}")))
                continue
            d = held.delivery
            record = SentRecord(d.account_id, d.delivery_id, d.attempt, None, datetime.now(UTC))
            held.started = True
            await outbox.record_sent(await lane.get(), [record])  # committed: the row is 'sent' now
            self._held.pop(d.key, None)
            self.stats.sent += 1
            self.faults.hit("before_send")
            await channel.send(message, timeout=self.config.send_timeout)
    finally:
        await lane.reset()


def mark_sent_first() -> None:
    Worker._sender = _sender_marking_sent_first  # type: ignore[method-assign]


def no_record_wait() -> None:
    from sendonce.transports.smtp import SmtpChannel

    send = SmtpChannel.send

    async def send_without_gate(
        self: SmtpChannel,
        message: OutgoingMessage,
        *,
        timeout: float,
        gate: Gate | None = None,
        follow: Follow | None = None,
    ) -> Outcome:
        return await send(self, message, timeout=timeout, gate=None, follow=follow)

    SmtpChannel.send = send_without_gate  # type: ignore[method-assign]


def lose_records(every: int = 25) -> None:
    record_sent = outbox.record_sent
    counter = itertools.count(1)

    async def record_sent_losing_some(conn: Conn, items: Sequence[SentRecord]) -> set[Key]:
        written = [item for item in items if next(counter) % every]
        await record_sent(conn, written)
        return {(item.account_id, item.delivery_id) for item in items}  # all of them, it says

    outbox.record_sent = record_sent_losing_some


def apply(build: str) -> None:
    if build == "no-fencing":
        remove_fencing()
    elif build == "mark-sent-first":
        mark_sent_first()
    elif build == "no-record-wait":
        no_record_wait()
    elif build == "lost-record":
        lose_records()
    else:
        raise SystemExit(f"unknown broken build {build!r}; known: {', '.join(BUILDS)}")


def main(argv: list[str] | None = None) -> None:
    """``<build> <sendonce CLI arguments...>``: patch this process, then run the normal CLI."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit(f"usage: python -m sendonce.chaos.broken {{{','.join(BUILDS)}}} <sendonce arguments>")
    apply(args[0])
    from sendonce.cli import main as cli_main

    sys.argv = ["sendonce", *args[1:]]
    cli_main()


if __name__ == "__main__":
    main()
