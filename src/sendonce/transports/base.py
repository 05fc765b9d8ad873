"""The transport interface and the outcomes a send can have.

A transport says whether it honours idempotency keys. That one capability decides what a re-send
after a crash means: harmless (the transport drops the second copy of a job id), or a possible
duplicate that the pipeline writes to the ledger before sending.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sendonce.domain.message import OutgoingMessage


@dataclass(frozen=True, slots=True)
class Capabilities:
    name: str
    idempotent: bool
    """The transport drops a second message with the same job id (idempotency key)."""
    key_life: float | None = None
    """Seconds the provider remembers a key (None: for ever). A re-send after an uncertain attempt
    older than that (less a margin) may be delivered twice, and goes to the possible-duplicate ledger."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """The transport took responsibility for the message."""

    message_id: str | None
    note: str | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """A transient failure: try again later.

    ``uncertain`` means the transport may have accepted the message anyway (the connection dropped
    after the data was sent, a timeout waiting for the answer): a later re-send may duplicate it.
    ``transport_wide`` failures are certain (nothing of the message went out).
    """

    error: str
    uncertain: bool = False
    retry_after: float | None = None
    transport_wide: bool = False
    """The failure says nothing about this message: the transport is unreachable, refuses us (a
    login, a revoked API key) or asks us to slow down. It does not count against the message's
    failures, and the worker's lanes pause before their next try (the outage's backoff)."""
    sender_wide: bool = False
    """The failure is the sender's, not this message's nor its recipient's: the relay refuses the
    envelope's sender (a 5xx to MAIL FROM), the provider refuses the account's domain, the worker
    cannot read the account's DKIM key (the worker's own Retry, before any send). Every message
    of that sender would fail alike: a campaign's row pauses its campaign (the operator fixes the
    sender and resumes it) and goes back, counted as one of its tries (a refusal read wrongly as the
    sender's fails that row after its tries instead of pausing the campaign at each resume); any
    other row is retried, counted."""


@dataclass(frozen=True, slots=True)
class Permanent:
    """The message will never be accepted: fail it now. ``hard_bounce`` suppresses the address."""

    error: str
    hard_bounce: bool = False


@dataclass(frozen=True, slots=True)
class Withheld:
    """The message was not sent: the caller's gate said no before the point of no return."""

    reason: str


Outcome = Accepted | Retry | Permanent | Withheld

Gate = Callable[[], Awaitable[float | None]]
"""Awaited right before the message's content goes out (SMTP: the content after DATA's 354). Returns
the seconds left for the rest of the send, or None to withhold the message."""

Follow = Callable[[], OutgoingMessage | None]
"""Called at most once per send, before the message's gate (the gate often waits): the lane's next
message, if one is ready. A pipelining SMTP channel writes that message's envelope (MAIL, RCPT, DATA:
it delivers nothing) in the same write as the content (RFC 2920), and the lane's next ``send`` should
then be for it; a send of any other message closes the connection first."""


class Channel(ABC):
    """One sending lane (an SMTP connection, an HTTP client slot). Used by one task at a time."""

    @abstractmethod
    async def send(
        self, message: OutgoingMessage, *, timeout: float, gate: Gate | None = None, follow: Follow | None = None
    ) -> Outcome:
        """Send one message; never raises for a transport failure, returns the outcome instead.

        ``gate``, if given, is awaited as late as possible before the content goes out, so a caller can
        prepare the next message while it finishes with the previous one. ``follow``, if given, may be
        called for the lane's next message (see :data:`Follow`); a channel that does not pipeline
        ignores it."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the lane's resources."""

    @property
    def connection(self) -> tuple[int, int, float] | None:
        """The lane's open connection, if it keeps one: (local port, server port, wall-clock time
        just before it was opened). For the fault hook's death note: the chaos suite tells this
        lane's messages in the inbox by it."""
        return None


class Transport(ABC):
    capabilities: Capabilities
    rate_bucket: str = "transport"
    """Name of the shared token bucket of this transport's rate limit (same server, same bucket)."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open shared resources."""

    @abstractmethod
    def channel(self) -> Channel:
        """A new lane; the worker opens ``--concurrency`` of them."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close shared resources."""
