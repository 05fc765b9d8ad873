"""An SMTP inbox that records every message it accepts, with optional faults.

The inbox is where exactly-once is checked: from what arrived, not from our own tables.
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import random
import ssl
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session

JOB_HEADER = b"sendonce-job-id:"


@dataclass(frozen=True, slots=True)
class Received:
    mail_from: str
    rcpt_to: tuple[str, ...]
    data: bytes
    received_at: float
    job_id: str | None
    tls: bool = False
    """It came over TLS (STARTTLS or implicit)."""
    peer_port: int | None = None
    """The client's TCP port: with ``greeted_at``, which of the client's connections it came by."""
    greeted_at: float | None = None
    """Wall-clock time of that connection's EHLO (None: the client said HELO, or nothing)."""

    def parsed(self) -> EmailMessage:
        message = email.message_from_bytes(self.data, policy=email.policy.default)
        assert isinstance(message, EmailMessage)
        return message


def _job_id(data: bytes) -> str | None:
    # Fast header scan: the inbox may take thousands of messages a second.
    head = data.split(b"\r\n\r\n", 1)[0]
    for line in head.split(b"\r\n"):
        if line[: len(JOB_HEADER)].lower() == JOB_HEADER:
            return line[len(JOB_HEADER) :].strip().decode("utf-8", "replace")
    return None


@dataclass
class InboxFaults:
    """Misbehaviour on demand, each with a probability per message."""

    drop_after_data: float = 0.0
    """Receive the whole message, record it, then drop the connection before answering 250: the
    client cannot know the message arrived (the ambiguous case)."""
    garbled_reply: float = 0.0
    """Receive and record the whole message, then answer with a line that is not an SMTP reply (no
    code): the client cannot tell whether the message was taken (the ambiguous case)."""
    temp_fail: float = 0.0
    """Answer 451 (or 421 and close, half the time) instead of accepting."""
    slow: float = 0.0
    """Receive and record the message, then wait ``slow_seconds`` before answering 250 (past the
    client's timeout: the client cannot know it arrived)."""
    slow_seconds: float = 5.0
    late: float = 0.0
    """Like ``slow``, but the client is meant to wait (``late_seconds`` under its timeout): not
    ambiguous, it gets its 250, so not a fault that can explain a re-send. Counted as "late"; one
    whose client gave up before the answer all the same (its own deadline came first: the
    connection closed) is ambiguous after all, counted as "late_given_up"."""
    late_seconds: float = 0.5
    pace: float = 0.0
    """Seconds every answer to DATA waits (not a fault, not counted): slows a campaign down so that a
    scenario can still act while it is sending."""
    reject: Callable[[str], str | None] | None = None
    """Called with each RCPT address; a returned SMTP reply (``"550 ..."``) rejects it."""
    refuse_sender: Callable[[str], str | None] | None = None
    """Called with each MAIL FROM address; a returned SMTP reply (``"553 ..."``) refuses it."""
    refuse_content: Callable[[str], str | None] | None = None
    """Called with each message's first recipient once its content is in; a returned SMTP reply
    (``"554 ..."``) refuses the message (it is not recorded)."""
    seed: int | None = None
    counts: Counter[str] = field(default_factory=Counter)
    ambiguous: Counter[str] = field(default_factory=Counter)
    """Per job id: the answers that left the client unable to know whether its message arrived (a drop
    after DATA, a slow or garbled answer). Each can explain one re-sent copy of that job, no other."""

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def roll(self, probability: float) -> bool:
        return probability > 0 and self._random.random() < probability


class _Handler:
    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self.greeted: weakref.WeakKeyDictionary[Session, float] = weakref.WeakKeyDictionary()
        """When each open connection said EHLO."""

    async def handle_EHLO(
        self, server: SMTP, session: Session, envelope: Envelope, hostname: str, responses: list[str]
    ) -> list[str]:
        session.host_name = hostname
        self.greeted[session] = time.time()
        if self.inbox.pipelining:
            responses.insert(-1, "250-PIPELINING")
        return responses

    def _refusal(self, refuse: Callable[[str], str | None] | None, counter: str, address: str) -> str | None:
        """The reply a fault gives this address, if any, counted under ``counter``."""
        reply = refuse(address) if refuse is not None else None
        if reply:
            self.inbox.faults.counts[counter] += 1
        return reply

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, mail_options: list[str]
    ) -> str:
        # aiosmtpd reads one command at a time: RCPT already waiting behind MAIL means the client
        # sent its envelope in one write (RFC 2920 pipelining).
        pending = getattr(server._reader, "_buffer", b"")  # a test inbox may peek at its reader
        if bytes(pending[:5]).upper() == b"RCPT ":
            self.inbox.pipelined_envelopes += 1
        reply = self._refusal(self.inbox.faults.refuse_sender, "sender_refused", address)
        if reply:
            return reply
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, rcpt_options: list[str]
    ) -> str:
        reply = self._refusal(self.inbox.faults.reject, "rejected", address)
        if reply:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.inbox.data_started += 1
        # the content is read; MAIL already waiting behind its final dot: the next envelope came with it
        pending = getattr(server._reader, "_buffer", b"")
        if bytes(pending[:5]).upper() == b"MAIL ":
            self.inbox.envelopes_behind_content += 1
        faults = self.inbox.faults
        data = envelope.original_content or b""
        if faults.refuse_content is not None and envelope.rcpt_tos:
            reply = faults.refuse_content(envelope.rcpt_tos[0])
            if reply:
                faults.counts["content_refused"] += 1
                return reply
        if faults.roll(faults.temp_fail):
            faults.counts["temp_fail"] += 1
            if faults.roll(0.5):
                faults.counts["421"] += 1
                return "421 4.3.2 Service shutting down"
            return "451 4.3.0 Try again later"
        slow = faults.roll(faults.slow)
        late = not slow and faults.roll(faults.late)
        if not slow and not late and faults.pace > 0:
            await asyncio.sleep(faults.pace)
        job_id = _job_id(data)
        doubted = False

        def doubt() -> None:
            # once per message, however many of the faults below hit it: it can be re-sent once
            nonlocal doubted
            if not doubted:
                doubted = True
                faults.ambiguous[str(job_id)] += 1

        self.inbox.record(
            Received(
                mail_from=str(envelope.mail_from),
                rcpt_to=tuple(envelope.rcpt_tos),
                data=data,
                received_at=time.time(),
                job_id=job_id,
                # session.ssl is set by STARTTLS only; an implicit-TLS transport says so itself
                tls=session.ssl is not None
                or (server.transport is not None and server.transport.get_extra_info("sslcontext") is not None),
                peer_port=_port(session.peer),
                greeted_at=self.greeted.get(session),
            )
        )
        if slow or late:
            # The server has the message and answers late. Slow: past the client's timeout, the client
            # cannot know it arrived (the ambiguous case, like a drop); a client that gives up closes
            # the connection, which cancels this wait: the message stays received all the same.
            faults.counts["slow" if slow else "late"] += 1
            if slow:
                doubt()
            self.inbox.slow_waiting += 1
            try:
                await asyncio.sleep(faults.slow_seconds if slow else faults.late_seconds)
            except asyncio.CancelledError:
                if late:  # it was meant to wait, and gave up (its deadline came first): ambiguous after all
                    faults.counts["late_given_up"] += 1
                    doubt()
                raise
            finally:
                self.inbox.slow_waiting -= 1
            if late and (server.transport is None or server.transport.is_closing()):
                faults.counts["late_given_up"] += 1
                doubt()
        if faults.roll(faults.drop_after_data):
            faults.counts["dropped_after_data"] += 1
            doubt()
            if isinstance(server.transport, asyncio.Transport):
                server.transport.abort()
        self.inbox.accepted_total += 1
        if faults.roll(faults.garbled_reply):
            faults.counts["garbled_reply"] += 1
            doubt()
            return f"Ok: queued as {self.inbox.accepted_total}"
        return f"250 2.0.0 Ok: queued as {self.inbox.accepted_total}"


class Inbox:
    """A real SMTP server on 127.0.0.1 that keeps what it receives. Use as a context manager."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        faults: InboxFaults | None = None,
        smtputf8: bool = True,
        pipelining: bool = True,
        starttls: ssl.SSLContext | None = None,
        implicit_tls: ssl.SSLContext | None = None,
        login: tuple[str, str] | None = None,
    ) -> None:
        """``starttls``: offer STARTTLS with this server context; ``implicit_tls``: TLS from the first
        byte (smtps); ``login``: require AUTH with this user name and password (over TLS)."""
        self.starttls = starttls
        self.implicit_tls = implicit_tls
        self.login = login
        self.host = host
        self.smtputf8 = smtputf8
        self.pipelining = pipelining
        """Offer PIPELINING (RFC 2920) in the EHLO reply, as Postfix, Exim and the big providers do."""
        self.pipelined_envelopes = 0
        """Envelopes whose MAIL FROM and RCPT TO arrived together (sent pipelined)."""
        self.envelopes_behind_content = 0
        """Envelopes that arrived right behind the previous message's content (in the same write)."""
        self._requested_port = port
        self.faults = faults or InboxFaults()
        self._lock = threading.Lock()
        self._messages: list[Received] = []
        self.accepted_total = 0
        self.data_started = 0
        """Messages whose whole content arrived (before any fault or answer)."""
        self.slow_waiting = 0
        """Messages received whose (slow or late) answer has not been given yet."""
        self._controller: Controller | None = None

    def start(self) -> Inbox:
        port = self._requested_port or _free_port(self.host)
        self._controller = Controller(
            _Handler(self),
            hostname=self.host,
            port=port,
            enable_SMTPUTF8=self.smtputf8,
            decode_data=False,
            data_size_limit=10 * 1024 * 1024,
            server_hostname="inbox.sendonce.test",
            tls_context=self.starttls,
            ssl_context=self.implicit_tls,
            # aiosmtpd knows only STARTTLS as TLS: over implicit TLS it neither requires TLS for AUTH
            # (the connection is TLS all the same) nor requires AUTH (it would warn); a client that
            # logs in is still checked.
            auth_required=self.login is not None and self.implicit_tls is None,
            auth_require_tls=self.implicit_tls is None,
            authenticator=self._authenticate if self.login is not None else None,
            auth_exclude_mechanism=["LOGIN"],  # PLAIN is enough, and is what a refused login is tested with
        )
        self._controller.start()
        return self

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any
    ) -> AuthResult:
        ok = isinstance(data, LoginPassword) and (data.login.decode(), data.password.decode()) == self.login
        return AuthResult(success=ok, handled=False)  # not handled: aiosmtpd answers 535 itself

    def stop(self) -> None:
        if self._controller is not None:
            self._controller.stop()
            self._controller = None

    def __enter__(self) -> Inbox:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._controller is not None

    @property
    def port(self) -> int:
        assert self._controller is not None, "the inbox is not started"
        return int(self._controller.port)

    @property
    def url(self) -> str:
        return f"smtp://{self.host}:{self.port}"

    def record(self, received: Received) -> None:
        with self._lock:
            self._messages.append(received)

    @property
    def messages(self) -> list[Received]:
        with self._lock:
            return list(self._messages)

    def clear(self) -> None:
        with self._lock:
            self._messages.clear()

    def by_recipient(self) -> Counter[str]:
        counter: Counter[str] = Counter()
        for message in self.messages:
            for rcpt in message.rcpt_to:
                counter[rcpt.lower() if rcpt.isascii() else rcpt] += 1
        return counter

    def by_job(self) -> Counter[str | None]:
        return Counter(message.job_id for message in self.messages)

    def wait_for(self, count: int, timeout: float = 30.0) -> bool:
        """Wait until at least ``count`` messages arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self._messages) >= count:
                return True
            time.sleep(0.02)
        return len(self._messages) >= count


def _port(peer: Any) -> int | None:
    """The port of aiosmtpd's ``session.peer`` ((host, port, ...) over TCP)."""
    return int(peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else None


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
