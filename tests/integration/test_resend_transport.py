"""The Resend-compatible channel's reading of failures: certain only when nothing can have reached
the provider. It matters beyond the ledger: a signup window re-queues a mail that certainly failed
(open_window in queries.sql), so a failure wrongly called certain could send a second mail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct

import pytest

from sendonce.domain.message import OutgoingMessage
from sendonce.testing.resend_server import ResendFaults, ResendServer
from sendonce.transports.base import Accepted, Outcome, Permanent, Retry
from sendonce.transports.registry import transport_from_url
from tests.conftest import free_port


def _message() -> OutgoingMessage:
    return OutgoingMessage(
        job_id="signup:1:1",
        envelope_from="hello@acme.test",
        recipient="ann@example.test",
        smtputf8=False,
        from_header="hello@acme.test",
        to_header="ann@example.test",
        subject="Confirm",
        text="Please confirm",
        html=None,
        message_id="<signup.1.1@acme.test>",
        date="Mon, 30 Nov 2026 06:00:00 +0000",
        headers=[("Sendonce-Job-Id", "signup:1:1")],
    )


async def _send_to(port: int) -> Retry:
    transport = transport_from_url(f"resend+http://re_test@127.0.0.1:{port}?timeout=5")
    await transport.start()
    channel = transport.channel()
    try:
        outcome = await channel.send(_message(), timeout=5)
    finally:
        await channel.close()
        await transport.close()
    assert isinstance(outcome, Retry), outcome
    return outcome


async def test_a_reset_after_the_whole_request_went_out_is_uncertain() -> None:
    """The provider read the request (it may have accepted the message), then the connection was
    reset before any answer: httpx's ReadError. It was taken for a clean failure."""
    received = asyncio.Event()

    async def take_then_reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        received.set()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        writer.transport.abort()

    server = await asyncio.start_server(take_then_reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        outcome = await _send_to(port)
    assert received.is_set()
    assert outcome.uncertain, outcome


async def test_no_connection_at_all_is_a_certain_failure() -> None:
    outcome = await _send_to(free_port())  # nobody listens there
    assert not outcome.uncertain and outcome.transport_wide, outcome


async def _send(url: str, message: OutgoingMessage) -> Outcome:
    transport = transport_from_url(url)
    await transport.start()
    channel = transport.channel()
    try:
        return await channel.send(message, timeout=5)
    finally:
        await channel.close()
        await transport.close()


@pytest.mark.parametrize("key_maybe_used", [False, True])
async def test_a_key_another_sender_used_is_not_taken_for_our_message_sent(key_maybe_used: bool) -> None:
    """Another installation (same API key, its own database, so the same job ids) sent its
    ``signup:1:1`` first. Our first attempt's 409 is not "already sent": that would record a
    message sent that was never delivered. After an uncertain attempt of ours it is."""
    ours = _message()
    theirs = dataclasses.replace(ours, recipient="someone-else@example.test", text="Their message")
    with ResendServer() as provider:
        assert isinstance(await _send(provider.url, theirs), Accepted)
        outcome = await _send(provider.url, dataclasses.replace(ours, key_maybe_used=key_maybe_used))
        delivered = provider.by_job()
    assert delivered == {"signup:1:1": 1}  # theirs; the provider delivered nothing for our request
    if key_maybe_used:
        assert isinstance(outcome, Accepted)
    else:
        assert isinstance(outcome, Permanent), outcome
        assert "already used by another sender" in outcome.error


async def test_refused_credentials_are_retried_not_failed() -> None:
    """A revoked or rotated API key is the account's problem, not the message's: the row is retried
    (certain: nothing was delivered), not failed for good."""
    with ResendServer(api_key="re_live_key") as provider:
        outcome = await _send(provider.url.replace("re_live_key", "re_revoked_key"), _message())
        assert provider.by_job() == {}
    assert isinstance(outcome, Retry) and not outcome.uncertain and outcome.transport_wide, outcome
    assert outcome.error.startswith("403 invalid_api_key")  # Resend's answer to a key it does not know


async def test_a_rate_limit_is_transport_wide_and_keeps_its_retry_after() -> None:
    with ResendServer(faults=ResendFaults(rate_limited=1.0)) as provider:
        outcome = await _send(provider.url, _message())
        assert provider.by_job() == {}
    assert isinstance(outcome, Retry) and outcome.transport_wide and not outcome.uncertain, outcome
    assert outcome.error.startswith("429") and outcome.retry_after is not None


async def test_a_retry_while_the_first_request_is_in_flight_waits_for_its_answer() -> None:
    """The provider still handles the first request with the key (we gave up waiting for it): the
    retry gets ``409 concurrent_idempotent_requests``, which says nothing about whether the message
    was taken (uncertain), and the next retry, once the first is answered, gets its answer replayed."""
    faults = ResendFaults(answer_late=1.0, stall_seconds=1.5)
    with ResendServer(faults=faults) as provider:
        transport = transport_from_url(provider.url + "?timeout=0.3")
        await transport.start()
        channel = transport.channel()
        try:
            first = await channel.send(_message(), timeout=5)
            faults.answer_late = 0.0
            during = await channel.send(_message(), timeout=5)
            while provider._keys["signup:1:1"][1] is None:  # until the first request's answer is stored
                await asyncio.sleep(0.05)
            after = await channel.send(_message(), timeout=5)
        finally:
            await channel.close()
            await transport.close()
    assert isinstance(first, Retry) and first.uncertain, first
    assert isinstance(during, Retry) and during.uncertain and not during.transport_wide, during
    assert "concurrent_idempotent_requests" in during.error and during.retry_after == 1.0
    assert isinstance(after, Accepted), after
    assert provider.by_job() == {"signup:1:1": 1}
    assert (faults.counts["409_concurrent"], faults.counts["replayed"]) == (1, 1)
    assert after.message_id == provider.accepted[0].id


async def test_a_server_error_is_about_the_message_and_uncertain() -> None:
    with ResendServer(faults=ResendFaults(server_error=1.0)) as provider:
        outcome = await _send(provider.url, _message())
    assert isinstance(outcome, Retry) and outcome.uncertain and not outcome.transport_wide, outcome


def _named(name: str) -> bytes:
    return json.dumps({"name": name, "message": "no"}).encode()


@pytest.mark.parametrize(
    ("status", "body", "uncertain", "transport_wide", "sender_wide"),
    [
        (503, _named("service_unavailable"), True, True, False),  # the provider is down: it may have taken it, even so
        (502, _named("bad_gateway"), True, True, False),
        (403, _named("validation_error"), False, False, True),  # the account's domain, not every account's
        (403, _named("invalid_api_key"), False, True, False),  # Resend's answer to a revoked key
        (401, _named("missing_api_key"), False, True, False),
        # a 2xx that is not the provider's answer (a captive proxy, a base URL naming something else):
        # recorded sent, the message would never be delivered; a body parsed wrongly crashed the worker
        (200, b"<html><body>Please log in to the hotel Wi-Fi</body></html>", True, True, False),
        (200, b'["queued"]', True, True, False),
        (200, b'{"id": null}', True, True, False),
        (200, b"[" * 100_000, True, True, False),
        # a 409 that is not the provider's word on the key is not "already sent"
        (409, b"<html>Conflict</html>", True, False, False),
        # the endpoint, not the message: every message would meet it, none fails for it
        (307, b"", False, True, False),
        (404, _named("not_found"), False, True, False),
        (405, _named("method_not_allowed"), False, True, False),
        (408, b"", False, False, False),
    ],
    ids=[
        "503",
        "502",
        "403-domain",
        "403-invalid-key",
        "401-missing-key",
        "200-html",
        "200-list",
        "200-null-id",
        "200-deep-json",
        "409-proxy",
        "307",
        "404",
        "405",
        "408",
    ],
)
async def test_how_a_provider_answer_is_read(
    status: int, body: bytes, uncertain: bool, transport_wide: bool, sender_wide: bool
) -> None:
    """The answers the test provider does not make, from a real HTTP server that answers them."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        kind = "application/json" if body[:1] in (b"{", b"[") else "text/html"
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n"
            "location: https://api.example.test/emails\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        outcome = await _send_to(port)  # asserts a Retry: neither recorded sent nor failed for good
    assert (outcome.uncertain, outcome.transport_wide, outcome.sender_wide) == (uncertain, transport_wide, sender_wide)
    assert str(status) in outcome.error


async def test_an_answer_that_trickles_in_ends_within_the_send_timeout() -> None:
    """httpx's timeout bounds each read on its own: an answer that never ends, a byte a second, held
    the lane past the worker's budget, which must end before the claim's lease does."""
    trickling, ended = asyncio.Event(), asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{")
            while not reader.at_eof():  # until the client gives up
                await writer.drain()
                trickling.set()
                await asyncio.sleep(0.2)
                writer.write(b" ")
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            ended.set()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = transport_from_url(f"resend+http://re_test@127.0.0.1:{port}?timeout=30")
    await transport.start()
    channel = transport.channel()
    try:
        async with server:
            outcome = await asyncio.wait_for(channel.send(_message(), timeout=1.0), 60)
    finally:
        await channel.close()
        await transport.close()
    await asyncio.wait_for(ended.wait(), 10)
    assert trickling.is_set()
    assert isinstance(outcome, Retry) and outcome.uncertain and outcome.error.startswith("timeout"), outcome


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("7", 7.0), ("-3", 0.0), ("inf", None), ("nan", None), ("soon", None), ("Fri, 31 Dec 9999 23:59:59 GMT", 2.5e11)],
    ids=["seconds", "negative", "inf", "nan", "not-a-number", "a-date-in-9999"],
)
async def test_a_retry_after_is_read_as_a_number_of_seconds_or_not_at_all(header: str, seconds: float | None) -> None:
    """RFC 9110: a number of seconds or an HTTP-date. "inf" and "nan" are neither, though float()
    takes them; how far ahead a valid one may reach is the worker's to limit (its backoff cap)."""
    with ResendServer(faults=ResendFaults(server_error=1.0, server_error_retry_after=header)) as provider:
        outcome = await _send(provider.url, _message())
    assert isinstance(outcome, Retry), outcome
    if seconds is None or seconds < 1e10:
        assert outcome.retry_after == seconds
    else:
        assert outcome.retry_after is not None and outcome.retry_after > seconds
