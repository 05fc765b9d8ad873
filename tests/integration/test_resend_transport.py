"""The Resend-compatible channel's reading of failures: certain only when nothing can have reached
the provider. It matters beyond the ledger: a signup window re-queues a mail that certainly failed
(open_window in queries.sql), so a failure wrongly called certain could send a second mail."""

from __future__ import annotations

import asyncio
import socket
import struct

from sendonce.domain.message import OutgoingMessage
from sendonce.transports.base import Retry
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
    assert not outcome.uncertain, outcome
