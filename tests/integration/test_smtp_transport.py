"""The SMTP channel against a real aiosmtpd server, with and without RFC 2920 pipelining.

What matters for exactly-once: the content goes out only after a positive envelope and the caller's
gate; only a failure after the content went out is *uncertain*; and a channel stays usable (its
replies in step with its commands) after every kind of refusal.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sendonce.domain.message import OutgoingMessage, wire_content
from sendonce.testing.inbox import Inbox, InboxFaults
from sendonce.transports.base import Accepted, Outcome, Permanent, Retry, Withheld
from sendonce.transports.smtp import SmtpChannel, SmtpSettings
from tests.conftest import free_port
from tests.helpers import self_signed_pem

MODES = pytest.mark.parametrize("pipelining", [True, False], ids=["pipelined", "one-command-per-round-trip"])


def _message(n: int, text: str = "Hello\n.a line that starts with a dot\n..and two\n.\nbye\n") -> OutgoingMessage:
    return OutgoingMessage(
        job_id=f"job-{n}",
        envelope_from="news@example.com",
        recipient=f"reader{n}@example.org",
        smtputf8=False,
        from_header="News <news@example.com>",
        to_header=f"reader{n}@example.org",
        subject=f"Issue {n}",
        text=text,
        html="<p>.hello</p>\n.<p>dots</p>",
        message_id=f"<{n}@example.com>",
        date="Mon, 30 Nov 2026 06:00:00 +0000",
        headers=[("Sendonce-Job-Id", f"job-{n}")],
    )


def _channel(inbox: Inbox, *, pipelining: bool = True, timeout: float = 5.0) -> SmtpChannel:
    return SmtpChannel(SmtpSettings("127.0.0.1", inbox.port, timeout=timeout, pipelining=pipelining))


@MODES
async def test_messages_arrive_byte_for_byte(pipelining: bool) -> None:
    with Inbox(pipelining=True) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            messages = [_message(n) for n in range(5)]
            for message in messages:
                assert isinstance(await channel.send(message, timeout=5), Accepted)
            assert channel.pipelined is pipelining
        finally:
            await channel.close()
    assert [m.data for m in inbox.messages] == [m.as_bytes() for m in messages]
    assert [m.rcpt_to for m in inbox.messages] == [(m.recipient,) for m in messages]
    # the body went as it is (7bit): its dots were stuffed on the wire and unstuffed by the server
    assert all(b"Content-Transfer-Encoding: 7bit" in m.data and b"\r\n.\r\n" in m.data for m in inbox.messages)
    # pipelined: each envelope (MAIL, RCPT, DATA) went out in one write
    assert inbox.pipelined_envelopes == (5 if pipelining else 0)


def _pipelined_under_uvloop(settings: SmtpSettings, messages: list[OutgoingMessage]) -> bool:
    """Send ``messages`` through one channel on uvloop; whether the channel pipelined."""
    uvloop = pytest.importorskip("uvloop")

    async def send_all() -> bool:
        channel = SmtpChannel(settings)
        try:
            for message in messages:
                assert isinstance(await channel.send(message, timeout=5), Accepted)
            return channel.pipelined
        finally:
            await channel.close()

    return bool(uvloop.run(send_all()))


def test_pipelining_under_uvloop() -> None:
    """A worker may run on uvloop (``--loop uvloop``), whose transports are not ``asyncio.Transport``
    subclasses: the channel takes the connection over all the same (an isinstance check once turned
    pipelining off there, silently: every message then took four round trips)."""
    messages = [_message(n) for n in range(3)]
    with Inbox(pipelining=True) as inbox:
        assert _pipelined_under_uvloop(_channel(inbox).settings, messages)
    assert [m.data for m in inbox.messages] == [m.as_bytes() for m in messages]
    assert inbox.pipelined_envelopes == 3


@MODES
async def test_a_lane_names_the_connection_its_messages_arrive_by(pipelining: bool) -> None:
    """The chaos suite tells a killed worker's messages in the inbox by its connections."""
    with Inbox() as inbox:
        port = inbox.port
        channel = _channel(inbox, pipelining=pipelining)
        try:
            assert channel.connection is None  # nothing open yet
            assert isinstance(await channel.send(_message(1), timeout=5), Accepted)
            first = channel.connection
            await channel.close()
            closed = channel.connection
            assert isinstance(await channel.send(_message(2), timeout=5), Accepted)
            second = channel.connection
        finally:
            await channel.close()
    assert closed is None and first is not None and second is not None
    assert first[0] != second[0] and first[1] == second[1] == port
    assert [(m.peer_port, m.greeted_at is not None) for m in inbox.messages] == [(first[0], True), (second[0], True)]
    one, two = (m.greeted_at for m in inbox.messages)
    assert one is not None and two is not None
    assert first[2] <= one < second[2] <= two <= inbox.messages[1].received_at


async def test_a_server_without_pipelining_gets_one_command_at_a_time() -> None:
    with Inbox(pipelining=False) as inbox:
        channel = _channel(inbox)
        try:
            assert isinstance(await channel.send(_message(1), timeout=5), Accepted)
            assert not channel.pipelined
        finally:
            await channel.close()
    assert inbox.pipelined_envelopes == 0
    assert len(inbox.messages) == 1


@MODES
async def test_a_rejected_recipient_is_a_hard_bounce_and_the_channel_goes_on(pipelining: bool) -> None:
    faults = InboxFaults(reject=lambda address: "550 5.1.1 no such user" if address.startswith("reader1@") else None)
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            assert isinstance(outcome, Permanent) and outcome.hard_bounce and "550" in outcome.error
            # the refused envelope's replies were all read: the next message's replies are its own
            for n in (2, 3):
                assert isinstance(await channel.send(_message(n), timeout=5), Accepted)
        finally:
            await channel.close()
    assert [m.job_id for m in inbox.messages] == ["job-2", "job-3"]


@MODES
async def test_a_temporary_refusal_of_the_content_is_a_certain_retry(pipelining: bool) -> None:
    faults = InboxFaults(temp_fail=1.0, seed=3)
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcomes = [await channel.send(_message(n), timeout=5) for n in range(6)]
            assert all(isinstance(o, Retry) and not o.uncertain for o in outcomes), outcomes
            assert faults.counts["421"] and faults.counts["temp_fail"] > faults.counts["421"]
            faults.temp_fail = 0.0
            assert isinstance(await channel.send(_message(9), timeout=5), Accepted)
        finally:
            await channel.close()
    assert [m.job_id for m in inbox.messages] == ["job-9"]


@MODES
@pytest.mark.parametrize(
    "fault",
    [
        "drop_after_data",  # the connection is lost before the answer to the content
        "garbled_reply",  # the answer to the content is a line without a reply code
    ],
)
async def test_an_unclear_end_after_the_content_is_uncertain(pipelining: bool, fault: str) -> None:
    faults = InboxFaults(**{fault: 1.0})
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            assert isinstance(outcome, Retry) and outcome.uncertain, outcome
            setattr(faults, fault, 0.0)
            assert isinstance(await channel.send(_message(2), timeout=5), Accepted)
        finally:
            await channel.close()
    # the uncertain one did arrive: that is why a re-send of it goes to the possible-duplicate ledger
    assert [m.job_id for m in inbox.messages] == ["job-1", "job-2"]


async def test_an_answer_to_the_content_whose_lines_disagree_is_uncertain() -> None:
    # RFC 5321 4.2.1: every line of a reply has the same code. One that does not ("550-" then "250 ")
    # was read by its last line, as accepted; which line the server meant cannot be told, and the
    # message may have been taken: an uncertain retry, on a new connection (a review found it).
    # Pipelined only: without pipelining aiosmtplib reads the replies, and keeps the last line's code
    # alone (the README says so).
    pipelining = True
    faults = InboxFaults(refuse_content=lambda _: "550-5.7.1 rejected as spam\r\n250 2.0.0 queued")
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            assert isinstance(outcome, Retry) and outcome.uncertain, outcome
            faults.refuse_content = None
            assert isinstance(await channel.send(_message(2), timeout=5), Accepted)
        finally:
            await channel.close()
    assert [m.job_id for m in inbox.messages] == ["job-2"]


@MODES
async def test_no_answer_in_time_after_the_content_is_uncertain(pipelining: bool) -> None:
    faults = InboxFaults(slow=1.0, slow_seconds=1.0)
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining, timeout=0.3)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            assert isinstance(outcome, Retry) and outcome.uncertain, outcome
            assert "SMTPReadTimeoutError" in outcome.error  # what operators (and the chaos suite) look for
        finally:
            await channel.close()


@MODES
async def test_a_send_cancelled_at_its_gate_leaves_no_transaction_open(pipelining: bool) -> None:
    # Cancelled while the server waited for the content (after the 354), the channel stayed
    # connected: the next envelope was written into that content, and the next message met a
    # timeout, counted against it (a review found it). The connection is closed instead.
    async def cancelled() -> float | None:
        raise asyncio.CancelledError

    with Inbox() as inbox:
        channel = _channel(inbox, pipelining=pipelining, timeout=2.0)
        try:
            with pytest.raises(asyncio.CancelledError):
                await channel.send(_message(1), timeout=2, gate=cancelled)
            assert channel.connection is None  # closed, not left in the middle of a transaction
            assert isinstance(await channel.send(_message(2), timeout=2), Accepted)
        finally:
            await channel.close()
    assert [m.job_id for m in inbox.messages] == ["job-2"]


@MODES
async def test_a_gate_that_withholds_delivers_nothing_and_the_channel_recovers(pipelining: bool) -> None:
    seen: list[int] = []

    async def withhold() -> float | None:
        seen.append(len(inbox.messages))
        return None

    async def allow() -> float | None:
        return 5.0

    with Inbox() as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            assert isinstance(await channel.send(_message(0), timeout=5, gate=allow), Accepted)
            outcome = await channel.send(_message(1), timeout=5, gate=withhold)
            assert isinstance(outcome, Withheld)
            assert isinstance(await channel.send(_message(2), timeout=5, gate=allow), Accepted)
        finally:
            await channel.close()
    assert seen == [1]
    assert [m.job_id for m in inbox.messages] == ["job-0", "job-2"]


@MODES
async def test_a_connection_lost_while_the_gate_holds_the_message_is_a_certain_retry(pipelining: bool) -> None:
    # Nothing of the content went out: the re-send is not a possible duplicate.
    inbox = Inbox(pipelining=pipelining).start()
    channel = _channel(inbox, pipelining=pipelining)

    def connected() -> bool:
        if pipelining:
            return channel._pipe is not None and channel._pipe.is_connected
        return channel._smtp is not None and channel._smtp.is_connected

    async def server_goes_away() -> float | None:
        assert connected()
        inbox.stop()
        for _ in range(200):  # until this side has seen the connection end
            if not connected():
                break
            await asyncio.sleep(0.01)
        assert not connected()
        return 5.0

    try:
        outcome = await channel.send(_message(1), timeout=5, gate=server_goes_away)
    finally:
        await channel.close()
        inbox.stop()
    assert isinstance(outcome, Retry) and not outcome.uncertain, outcome
    assert inbox.messages == []


def _follower(messages: list[OutgoingMessage]) -> Callable[[], OutgoingMessage | None]:
    """A lane's queue, as the worker hands it to the channel: the next message, or None."""
    queue = list(messages)
    return lambda: queue.pop(0) if queue else None


async def _send_following(channel: SmtpChannel, messages: list[OutgoingMessage]) -> None:
    """Send ``messages`` through ``channel`` as a lane does, each next one at hand; then close it."""
    follow = _follower(messages[1:])
    try:
        for message in messages:
            assert isinstance(await channel.send(message, timeout=5, follow=follow), Accepted)
    finally:
        await channel.close()


async def test_the_next_envelope_goes_out_with_the_content_and_each_message_arrives_once() -> None:
    messages = [_message(n) for n in range(5)]
    with Inbox() as inbox:
        await _send_following(_channel(inbox), messages)
    assert [m.data for m in inbox.messages] == [m.as_bytes() for m in messages]
    assert [m.rcpt_to for m in inbox.messages] == [(m.recipient,) for m in messages]
    # one write per message after the first: its content, then the next envelope
    assert inbox.envelopes_behind_content == 4
    assert inbox.pipelined_envelopes == 5


@pytest.mark.parametrize(
    ("relay", "header"),
    [
        ("postmark", b"X-PM-Metadata-sendonce-job-id: JOB\r\n"),
        ("sendgrid", b'X-SMTPAPI: {"unique_args":{"sendonce_job_id":"JOB"}}\r\n'),
    ],
)
@MODES
async def test_a_relay_gets_the_job_id_in_its_own_header(relay: str, header: bytes, pipelining: bool) -> None:
    """Postmark's and SendGrid's webhooks echo neither our headers nor an id a record keeps over SMTP:
    their bounces linked to no delivery and suppressed nobody. Each message names its job in the
    relay's metadata header (which the relay takes out), in every way the channel sends."""
    messages = [_message(n) for n in range(3)]
    with Inbox(pipelining=True) as inbox:
        settings = SmtpSettings("127.0.0.1", inbox.port, timeout=5, pipelining=pipelining, relay=relay)
        await _send_following(SmtpChannel(settings), messages)
    expected = [header.replace(b"JOB", m.job_id.encode()) + m.as_bytes() for m in messages]
    assert [m.data for m in inbox.messages] == expected
    assert inbox.envelopes_behind_content == (2 if pipelining else 0)


async def test_without_pipelining_the_next_message_is_not_sent_ahead() -> None:
    messages = [_message(n) for n in range(3)]
    asked: list[int] = []

    def follow() -> OutgoingMessage | None:
        asked.append(1)
        return None

    with Inbox(pipelining=False) as inbox:
        channel = _channel(inbox)
        try:
            for message in messages:
                assert isinstance(await channel.send(message, timeout=5, follow=follow), Accepted)
        finally:
            await channel.close()
    assert asked == [] and inbox.envelopes_behind_content == 0
    assert [m.job_id for m in inbox.messages] == ["job-0", "job-1", "job-2"]


async def test_a_connection_lost_after_the_content_takes_the_envelope_sent_ahead_with_it() -> None:
    faults = InboxFaults(drop_after_data=1.0)
    first, second = _message(1), _message(2)
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox)
        try:
            outcome = await channel.send(first, timeout=5, follow=_follower([second]))
            assert isinstance(outcome, Retry) and outcome.uncertain, outcome
            faults.drop_after_data = 0.0
            # its envelope went to a connection that is gone: sent again, on a new one, and only once
            assert isinstance(await channel.send(second, timeout=5), Accepted)
        finally:
            await channel.close()
    assert [m.job_id for m in inbox.messages] == ["job-1", "job-2"]


async def test_a_refused_content_leaves_the_envelope_sent_ahead_in_step() -> None:
    faults = InboxFaults(temp_fail=1.0, seed=5)
    messages = [_message(n) for n in range(8)]
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox)
        follow = _follower(messages[1:])
        outcomes = []
        try:
            for n, message in enumerate(messages):
                if n == 4:
                    faults.temp_fail = 0.0
                outcomes.append(await channel.send(message, timeout=5, follow=follow))
        finally:
            await channel.close()
    # 451 ends the transaction and the connection goes on (the envelope ahead is answered next);
    # 421 closes it (the envelope ahead is sent again on a new one)
    assert faults.counts["421"] and faults.counts["temp_fail"] > faults.counts["421"], faults.counts
    assert all(isinstance(o, Retry) and not o.uncertain for o in outcomes[:4]), outcomes
    assert all(isinstance(o, Accepted) for o in outcomes[4:]), outcomes
    assert [m.job_id for m in inbox.messages] == ["job-4", "job-5", "job-6", "job-7"]
    assert inbox.envelopes_behind_content >= 4


async def test_a_message_sent_ahead_and_then_withheld_delivers_nothing() -> None:
    async def withhold() -> float | None:
        return None

    first, second, third = _message(1), _message(2), _message(3)
    with Inbox() as inbox:
        channel = _channel(inbox)
        try:
            assert isinstance(await channel.send(first, timeout=5, follow=_follower([second])), Accepted)
            assert isinstance(await channel.send(second, timeout=5, gate=withhold), Withheld)
            assert isinstance(await channel.send(third, timeout=5), Accepted)
        finally:
            await channel.close()
    assert inbox.envelopes_behind_content == 1
    assert [m.job_id for m in inbox.messages] == ["job-1", "job-3"]


async def test_a_send_of_another_message_than_the_one_ahead_ends_that_transaction_first() -> None:
    first, ahead, other = _message(1), _message(2), _message(3)
    with Inbox() as inbox:
        channel = _channel(inbox)
        try:
            assert isinstance(await channel.send(first, timeout=5, follow=_follower([ahead])), Accepted)
            # the lane sends something else: the open transaction (waiting for content) must not get it
            assert isinstance(await channel.send(other, timeout=5), Accepted)
        finally:
            await channel.close()
    assert [m.job_id for m in inbox.messages] == ["job-1", "job-3"]
    assert [m.rcpt_to for m in inbox.messages] == [("reader1@example.org",), ("reader3@example.org",)]


def test_wire_content_makes_canonical_dot_stuffed_data() -> None:
    assert wire_content(b"a\r\n.b\r\nc") == b"a\r\n..b\r\nc\r\n.\r\n"
    assert wire_content(b".x\n..y\rz\r\n") == b"..x\r\n...y\r\nz\r\n.\r\n"
    assert wire_content(b"") == b"\r\n.\r\n"
    # as many CRs as LFs, but not in pairs; CRs alone
    assert wire_content(b"a\n\rb") == b"a\r\n\r\nb\r\n.\r\n"
    assert wire_content(b"a\rb\r") == b"a\r\nb\r\n.\r\n"


def _server_tls(tmp_path: Path) -> ssl.SSLContext:
    """A self-signed certificate for 127.0.0.1, made here (the client is told not to verify it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(
        self_signed_pem(
            key,
            "inbox.sendonce.test",
            not_before=now - timedelta(days=1),
            not_after=now + timedelta(days=1),
            ip_address="127.0.0.1",
        )
    )
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


@pytest.mark.parametrize("implicit", [False, True], ids=["starttls", "smtps"])
def test_pipelining_over_tls_under_uvloop(tmp_path: Path, implicit: bool) -> None:
    # uvloop's TLS transport is its own class too (not asyncio's): taken over and pipelined all the same
    context = _server_tls(tmp_path)
    tls = {"implicit_tls": context} if implicit else {"starttls": context}
    messages = [_message(n) for n in range(3)]
    with Inbox(login=("mailer", "s3cret"), **tls) as inbox:  # type: ignore[arg-type]
        settings = SmtpSettings("127.0.0.1", inbox.port, use_tls=implicit, start_tls=not implicit,
                                username="mailer", password="s3cret", validate_certs=False, timeout=5)  # fmt: skip
        assert _pipelined_under_uvloop(settings, messages)
    assert [m.data for m in inbox.messages] == [m.as_bytes() for m in messages]
    assert inbox.pipelined_envelopes == 3


@pytest.mark.parametrize("implicit", [False, True], ids=["starttls", "smtps"])
async def test_pipelining_over_tls_with_a_login(tmp_path: Path, implicit: bool) -> None:
    # The connection aiosmtplib secured and logged in is the one the channel then pipelines on.
    context = _server_tls(tmp_path)
    tls = {"implicit_tls": context} if implicit else {"starttls": context}
    with Inbox(login=("mailer", "s3cret"), **tls) as inbox:  # type: ignore[arg-type]
        channel = SmtpChannel(
            SmtpSettings(
                "127.0.0.1",
                inbox.port,
                use_tls=implicit,
                start_tls=not implicit,
                username="mailer",
                password="s3cret",
                validate_certs=False,
                timeout=5,
            )
        )
        try:
            messages = [_message(n) for n in range(3)]
            for message in messages:
                assert isinstance(await channel.send(message, timeout=5), Accepted)
            assert channel.pipelined
        finally:
            await channel.close()
        wrong = SmtpChannel(
            SmtpSettings("127.0.0.1", inbox.port, use_tls=implicit, start_tls=not implicit,
                         username="mailer", password="wrong", validate_certs=False, timeout=5)
        )  # fmt: skip
        outcome = await wrong.send(_message(9), timeout=5)
        await wrong.close()
    # a refused login is the server's settings, not this message's fault: retried, never failed for good
    assert isinstance(outcome, Retry) and not outcome.uncertain and "535" in outcome.error, outcome
    assert outcome.transport_wide  # not counted against the message; the worker's lanes pause
    assert [m.data for m in inbox.messages] == [m.as_bytes() for m in messages]
    assert all(m.tls for m in inbox.messages)
    assert inbox.pipelined_envelopes == 3


class _SlowServer:
    """A server without PIPELINING that answers DATA with a 354 after ``before_354`` seconds, then
    reads nothing for ``stall`` seconds, then reads the content and answers it ``before_250`` later.
    ``dot`` is set when the content's final dot arrived (the message would be delivered)."""

    def __init__(self, *, before_354: float = 0.0, stall: float = 0.0, before_250: float = 0.0) -> None:
        self.before_354, self.stall, self.before_250 = before_354, stall, before_250
        self.dot = asyncio.Event()
        self.ended = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(b"220 slow ESMTP\r\n")
            while line := await reader.readline():
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    writer.write(b"250-slow\r\n250 8BITMIME\r\n")
                elif verb == b"DATA":
                    await asyncio.sleep(self.before_354)
                    writer.write(b"354 go on\r\n")
                    await writer.drain()
                    await asyncio.sleep(self.stall)
                    tail = b""
                    while not tail.endswith(b"\r\n.\r\n"):
                        chunk = await reader.read(1 << 16)
                        if not chunk:
                            return
                        tail = (tail + chunk)[-5:]
                    self.dot.set()
                    await asyncio.sleep(self.before_250)
                    writer.write(b"250 queued\r\n")
                else:
                    writer.write(b"250 ok\r\n")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.ended.set()
            writer.close()


async def _send_slowly(server: _SlowServer, message: OutgoingMessage, timeout: float) -> Retry:
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    channel = SmtpChannel(SmtpSettings("127.0.0.1", port, timeout=30, pipelining=False))
    try:
        outcome = await channel.send(message, timeout=timeout)
        await channel.close()
        await asyncio.wait_for(server.ended.wait(), 10)
    finally:
        listener.close()
    assert isinstance(outcome, Retry), outcome
    return outcome


async def test_without_pipelining_the_whole_data_exchange_ends_within_the_budget() -> None:
    """aiosmtplib's timeout is per reply: a 354 and a final reply each just inside it took twice the
    budget, which the worker keeps inside the lease. The whole exchange is bounded: an uncertain retry."""
    server = _SlowServer(before_354=0.6, before_250=0.6)
    outcome = await _send_slowly(server, _message(1), timeout=1.0)
    assert outcome.uncertain and "SMTPReadTimeoutError" in outcome.error


async def test_without_pipelining_a_content_buffered_at_a_timeout_never_goes_out() -> None:
    """The server takes the DATA, then reads nothing until well after the client gave up. A close
    that flushes would still deliver the whole message then (a duplicate made likelier); the channel
    aborts the connection and drops what is still buffered."""
    server = _SlowServer(stall=1.5)
    big = _message(1, text=("x" * 76 + "\n") * 200_000)  # ~15 MB: more than the sockets buffer
    outcome = await _send_slowly(server, big, timeout=0.5)
    assert outcome.uncertain
    assert not server.dot.is_set()


async def test_no_relay_at_all_is_a_transport_wide_failure() -> None:
    """Nothing listens: not this message's failure (it is not counted against it), certain."""
    channel = SmtpChannel(SmtpSettings("127.0.0.1", free_port(), timeout=5))
    try:
        outcome = await channel.send(_message(1), timeout=5)
    finally:
        await channel.close()
    assert isinstance(outcome, Retry) and outcome.transport_wide and not outcome.uncertain, outcome


@MODES
@pytest.mark.parametrize(
    ("faults", "uncertain"),
    [
        (InboxFaults(reject=lambda _: "451 4.7.1 greylisted, try again"), False),
        (InboxFaults(drop_after_data=1.0), True),
    ],
    ids=["451-to-rcpt", "lost-after-the-content"],
)
async def test_a_refusal_of_one_message_is_not_transport_wide(
    pipelining: bool, faults: InboxFaults, uncertain: bool
) -> None:
    """A 451 to the recipient, or a connection lost after the content, is about this message: counted."""
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
        finally:
            await channel.close()
    assert isinstance(outcome, Retry) and outcome.uncertain == uncertain and not outcome.transport_wide, outcome


@MODES
async def test_a_421_to_the_envelope_is_transport_wide(pipelining: bool) -> None:
    """421: the service is not available (RFC 5321), before the message was read: the server's state."""
    with Inbox(faults=InboxFaults(reject=lambda _: "421 4.3.2 too busy, closing")) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
        finally:
            await channel.close()
    assert isinstance(outcome, Retry) and outcome.transport_wide and not outcome.uncertain, outcome
    assert outcome.error.startswith("rcpt: 421")


@MODES
async def test_a_421_to_the_content_counts_against_the_message(pipelining: bool) -> None:
    """The server read the message and closed on it: this message's try (counted, certain), not an
    outage; uncounted, a message answered so every time was tried for ever. The channel is usable again."""
    faults = InboxFaults(refuse_content=lambda _: "421 4.7.0 Try again later, closing connection")
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            faults.refuse_content = None
            assert isinstance(await channel.send(_message(2), timeout=5), Accepted)
        finally:
            await channel.close()
    assert isinstance(outcome, Retry), outcome
    assert not outcome.transport_wide and not outcome.uncertain, outcome
    assert outcome.error.startswith("data: 421")
    assert [m.job_id for m in inbox.messages] == ["job-2"]


def _assert_refusal(outcome: Outcome, expected: str) -> None:
    """``expected``: "permanent" (failed, suppressing nobody), "hard_bounce", or a certain Retry:
    "transport_wide", "sender_wide" or "counted" (this message's try)."""
    if expected in ("permanent", "hard_bounce"):
        assert isinstance(outcome, Permanent) and outcome.hard_bounce == (expected == "hard_bounce"), outcome
        return
    assert isinstance(outcome, Retry) and not outcome.uncertain, outcome
    assert (outcome.transport_wide, outcome.sender_wide) == (expected == "transport_wide", expected == "sender_wide")


@MODES
@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("530 5.7.0 Authentication required", "transport_wide"),
        ("553 5.7.1 Sender address rejected: not owned by user", "sender_wide"),
        ("550 5.7.1 Client host rejected: access denied", "sender_wide"),
        ("552 5.3.4 Message size exceeds fixed limit", "permanent"),
        ("503 5.5.1 Error: nested MAIL command", "counted"),
        ("500 5.5.2 Error: bad syntax", "counted"),
        ("502 5.5.1 Error: command not implemented", "counted"),
        ("503 5.7.0 Error: authentication required", "transport_wide"),
        ("504 5.5.4 Unrecognized parameter", "permanent"),
        ("555 5.5.4 Unsupported option: SMTPUTF8", "permanent"),
    ],
    ids=[
        "530-login-required",
        "553-sender-rejected",
        "550-client-rejected",
        "552-this-message",
        "503-out-of-step",
        "500-out-of-step",
        "502-out-of-step",
        "503-asks-for-login",
        "504-this-message",
        "555-this-message",
    ],
)
async def test_a_refused_sender_is_not_the_recipients_bounce(pipelining: bool, reply: str, expected: str) -> None:
    """A 5xx to MAIL FROM refuses the sender, the login or this client, never the recipient: it was a
    permanent failure of each message in turn, which ended a whole campaign failed on a relay's
    setting. Only a reply about this message itself (its size, its parameters) fails it; one about
    the command (500, 502, 503: the session out of step) is this try's failure, on a new connection."""
    faults = InboxFaults(refuse_sender=lambda _: None if faults.counts["sender_refused"] else reply)  # once
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            # the refused envelope's replies were all read: the next messages' replies are their own
            for n in (2, 3):
                assert isinstance(await channel.send(_message(n), timeout=5), Accepted)
        finally:
            await channel.close()
        assert [m.job_id for m in inbox.messages] == ["job-2", "job-3"]
    assert outcome.error.startswith(f"mail: {reply[:3]}"), outcome
    _assert_refusal(outcome, expected)


@MODES
@pytest.mark.parametrize(
    ("step", "reply", "expected"),
    [
        (b"MAIL", "550 5.7.1 Client host rejected: access denied", "sender_wide"),
        (b"MAIL", "421 4.7.0 Too busy, closing", "transport_wide"),
        (b"RCPT", "554 5.7.1 <reader@example.org>: Relay access denied", "sender_wide"),
        (b"RCPT", "550 5.1.1 <reader@example.org>: Recipient address rejected: User unknown", "hard_bounce"),
    ],
    ids=["550-mail-then-close", "421-mail-then-close", "554-rcpt-relay-then-close", "550-rcpt-unknown-then-close"],
)
async def test_a_refusal_followed_by_a_close_is_read_as_the_refusal(
    pipelining: bool, step: bytes, reply: str, expected: str
) -> None:
    """A relay that refuses MAIL FROM or RCPT TO and then closes (RFC 5321 after a 421; Exim's
    ``drop``): with the envelope pipelined, the close came while the next replies were awaited, and
    the refusal read before it was dropped for a "connection lost", counted against the message."""

    ended = asyncio.Event()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(b"220 relay ESMTP\r\n")
            closed = False
            while line := await reader.readline():
                command = line[:4].upper()
                if closed:
                    continue  # what the client sent after the refusal is read and dropped
                if command == b"EHLO":
                    writer.write(b"250-relay\r\n250-PIPELINING\r\n250 8BITMIME\r\n")
                elif command == step:
                    writer.write(reply.encode() + b"\r\n")
                    writer.write_eof()  # a clean close of our side (no reset: nothing of the reply is lost)
                    closed = True
                else:
                    writer.write(b"250 OK\r\n")
                await writer.drain()
        finally:
            writer.close()
            ended.set()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        channel = SmtpChannel(SmtpSettings("127.0.0.1", port, timeout=5, pipelining=pipelining))
        try:
            outcome = await channel.send(_message(1), timeout=5)
        finally:
            await channel.close()
        await asyncio.wait_for(ended.wait(), 5)
    assert outcome.error.startswith(f"{step.decode().lower()}: {reply[:3]}"), outcome
    _assert_refusal(outcome, expected)


@MODES
@pytest.mark.parametrize(
    ("step", "reply", "expected"),
    [
        ("rcpt", "550 5.1.1 <reader1@example.org>: Recipient address rejected: User unknown", "address"),
        ("rcpt", "550 no such user here", "address"),  # no enhanced status: RFC 5321's mailbox unavailable
        ("rcpt", "550 5.2.1 mailbox disabled", "address"),
        ("rcpt", "552 5.2.2 mailbox full", "message"),
        ("rcpt", "550 5.7.1 Recipient address rejected: Access denied", "message"),
        ("rcpt", "554 5.7.1 <reader1@example.org>: Relay access denied", "sender"),
        ("rcpt", "550 relay not permitted", "sender"),
        ("rcpt", "553 5.1.8 <news@example.com>: Sender address rejected: Domain not found", "sender"),
        # Postfix checks the sender at RCPT: an X.1.x about the sender is not the recipient's bounce
        ("rcpt", "550 5.1.0 <news@example.com>: Sender address rejected: User unknown in virtual mailbox", "sender"),
        ("rcpt", "550-Verification failed for <news@example.com>\n550 Sender verify failed", "sender"),
        ("rcpt", "554 5.7.1 Service unavailable; Client host [192.0.2.1] blocked using zen.spamhaus.org", "sender"),
        # words in an address the reply echoes are not the reply's
        ("rcpt", "550 <reader1@relay-not-permitted.example>... User unknown", "address"),
        ("rcpt", "554 5.7.1 <reader1@example.org>: Recipient address rejected: relay@ mailbox closed", "message"),
        ("data", "550 5.1.1 user unknown", "address"),
        ("data", "554 5.7.1 Message rejected as spam", "message"),
        ("data", "554 Message rejected: Email address is not verified.", "message"),
        # a next server's reply, quoted: the recipient's relay could not verify it (Postfix)
        (
            "rcpt",
            "550 5.1.1 <reader1@example.org>: Recipient address rejected: undeliverable address: host"
            " mx.example.org[192.0.2.9] said: 554 5.7.1 <reader1@example.org>: Relay access denied (in reply"
            " to RCPT TO command)",
            "address",
        ),
        ("rcpt", "550-Callout verification failed:\n550 550 relay not permitted", "message"),  # Exim's
        (
            "rcpt",
            "550-Verification failed for <news@example.com>\n550-Called:   192.0.2.1\n550-Sent:     RCPT"
            " TO:<news@example.com>\n550-Response: 550 relay not permitted\n550 Sender verify failed",
            "sender",
        ),
        # no enhanced status (Exim): a 550 is the address's only when its words say so
        ("rcpt", "550 Unrouteable address", "address"),
        ("rcpt", "550 Administrative prohibition", "message"),
        ("rcpt", "550 Domain example.com has exceeded the max emails per hour (100/100 (100%)) allowed.", "sender"),
        ("rcpt", "550 192.0.2.1 is listed at zen.spamhaus.org", "sender"),
        ("rcpt", "550 5.7.606 Access denied, banned sending IP [192.0.2.1]", "sender"),  # Microsoft
        # our sending quota, spent
        ("data", "550 5.4.5 Daily user sending limit exceeded.", "sender"),  # Gmail
        ("data", "554 5.2.0 STOREDRV.Submission.Exception:SendAsDeniedException.MapiExceptionSendAsDenied", "sender"),
        ("data", "552 5.2.2 The email account that you tried to reach is over quota", "message"),
        # a recipient's own limits and lists are not ours: one such mailbox must not pause the campaign
        ("rcpt", "550 5.7.1 Recipient rate limit exceeded", "message"),
        ("rcpt", "550 5.7.1 This mailbox has reached its receive rate limit", "message"),
        (
            "rcpt",
            "550 Requested action not taken: mailbox unavailable. Recipient has exceeded its rate limit",
            "message",
        ),
        ("rcpt", "550 Recipient not listed in our directory", "message"),
        ("rcpt", "550 5.7.0 Local policy violation: recipient is listed in our do-not-email list", "message"),
        ("rcpt", "550 Requested action not taken: mailbox unavailable", "address"),  # RFC 5321's own words
        ("rcpt", "554 delivery error: dd This user doesn't have a yahoo.com account (reader1@yahoo.com)", "address"),
        ("rcpt", "550 5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address lookup", "address"),
        # our sender, our blocklisted address or domain, our quota, in the words of Postfix, Exim, Microsoft
        ("rcpt", "554 5.7.1 Service unavailable; Sender address [example.com] blocked using dbl.example", "sender"),
        ("rcpt", "550 rejected because 192.0.2.1 is in a black list at zen.spamhaus.org", "sender"),
        ("rcpt", "550 5.7.1 Part of their network is on our block list (S3140).", "sender"),
        ("rcpt", "550 Sender domain does not exist", "sender"),  # not the recipient's hard bounce
        ("rcpt", "550 Unrouteable sender address", "sender"),
        ("rcpt", "550 5.1.90 You've reached your daily limit for message recipients", "sender"),
    ],
)
async def test_only_a_reply_that_says_the_address_is_bad_is_a_hard_bounce(
    pipelining: bool, step: str, reply: str, expected: str
) -> None:
    """Every 5xx to RCPT or DATA was a hard bounce, which suppresses the address for good: a relay
    that does not relay for us ("Relay access denied", at RCPT, for every recipient) or a content
    refused as spam would have suppressed each subscriber it met. Only an addressing status (X.1.x,
    X.2.1; without one, a 550, 551 or 553 to RCPT) is; a relay refusing us is a refused sender."""
    refuse: Callable[[str], str | None] = lambda address: reply if address.startswith("reader1@") else None  # noqa: E731
    faults = InboxFaults(reject=refuse) if step == "rcpt" else InboxFaults(refuse_content=refuse)
    with Inbox(faults=faults) as inbox:
        channel = _channel(inbox, pipelining=pipelining)
        try:
            outcome = await channel.send(_message(1), timeout=5)
            assert isinstance(await channel.send(_message(2), timeout=5), Accepted)  # in step
        finally:
            await channel.close()
        assert [m.job_id for m in inbox.messages] == ["job-2"]
    assert outcome.error.startswith(f"{step}: {reply[:3]}"), outcome
    if expected == "sender":
        assert isinstance(outcome, Retry) and outcome.sender_wide and not outcome.uncertain, outcome
    else:
        assert isinstance(outcome, Permanent) and outcome.hard_bounce == (expected == "address"), outcome
