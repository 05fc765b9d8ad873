"""The physical limit: a bare aiosmtplib loop, no database, pre-rendered bytes, persistent connections.

One process of it: ``python -m sobench.bare PORT CONNECTIONS COUNT FIRST [pipelined]``. It renders its
messages (sendonce's own composer code, so the same bytes sendonce sends), opens CONNECTIONS
connections, prints ``ready``, waits for a line on stdin, then sends COUNT messages and prints one
JSON line: start and end (wall clock), sent, errors.

Two loops:

* default: aiosmtplib, MAIL, RCPT, DATA one round trip each (the limit the benchmark's brief names);
* ``pipelined``: the exchange sendonce's SMTP channel uses with a server that offers PIPELINING
  (RFC 2920): MAIL, RCPT and DATA in one write, then the content. Plain asyncio streams, pre-stuffed
  content, no checks beyond the reply codes: the limit of *that* exchange in Python on this machine.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiosmtplib

from sobench import run
from sobench.content import Prerendered, sendonce_message

_POOL = 2000
"""Distinct pre-rendered messages, cycled (the bytes per message are what matters to the wire)."""


def pipelined_wire(messages: list[Prerendered]) -> list[tuple[bytes, bytes]]:
    """(MAIL + RCPT + DATA in one write, the dot-stuffed content) for each message."""
    from sendonce.domain.message import wire_content

    return [
        (f"MAIL FROM:<{m.envelope_from}>\r\nRCPT TO:<{m.recipient}>\r\nDATA\r\n".encode(), wire_content(m.data))
        for m in messages
    ]


async def open_lanes(port: int, connections: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``connections`` plain connections to the sink, greeted and past EHLO."""
    lanes = []
    for _ in range(connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await _reply(reader)
        writer.write(b"EHLO bench.test\r\n")
        assert (await _reply(reader)) == 250
        lanes.append((reader, writer))
    return lanes


async def pipelined(port: int, connections: int, count: int, first: int) -> None:
    messages = [sendonce_message(first + i) for i in range(min(count, _POOL))]
    wire = pipelined_wire(messages)
    lanes = await open_lanes(port, connections)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    position = 0
    sent = errors = 0

    async def lane(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal position, sent, errors
        while position < count:
            envelope, content = wire[position % len(wire)]
            position += 1
            writer.write(envelope)
            codes = [await _reply(reader) for _ in range(3)]
            if codes != [250, 250, 354]:
                errors += 1
                continue
            writer.write(content)
            if await _reply(reader) == 250:
                sent += 1
            else:
                errors += 1

    start, cpu = time.time(), time.process_time()
    await asyncio.gather(*(lane(r, w) for r, w in lanes))
    end, cpu = time.time(), time.process_time() - cpu
    for _, writer in lanes:
        writer.close()
    report = {"start": start, "end": end, "sent": sent, "errors": errors, "cpu": cpu, "size": len(messages[0].data)}
    print(json.dumps(report))


async def _reply(reader: asyncio.StreamReader) -> int:
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("the sink closed the connection")
        if line[3:4] != b"-":
            return int(line[:3])


async def main(port: int, connections: int, count: int, first: int) -> None:
    messages: list[Prerendered] = [sendonce_message(first + i) for i in range(min(count, _POOL))]
    lanes = []
    for _ in range(connections):
        smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=30)
        await smtp.connect()
        await smtp.ehlo()
        lanes.append(smtp)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    position = 0
    sent = errors = 0

    async def lane(smtp: aiosmtplib.SMTP) -> None:
        nonlocal position, sent, errors
        while position < count:
            message = messages[position % len(messages)]
            position += 1
            try:
                await smtp.mail(message.envelope_from)
                await smtp.rcpt(message.recipient)
                await smtp.data(message.data)
            except (aiosmtplib.SMTPException, OSError):
                errors += 1
                continue
            sent += 1

    start, cpu = time.time(), time.process_time()
    await asyncio.gather(*(lane(smtp) for smtp in lanes))
    end, cpu = time.time(), time.process_time() - cpu
    for smtp in lanes:
        smtp.close()
    report = {"start": start, "end": end, "sent": sent, "errors": errors, "cpu": cpu, "size": len(messages[0].data)}
    print(json.dumps(report))


if __name__ == "__main__":
    port, connections, count, first = (int(a) for a in sys.argv[1:5])
    loop = pipelined if sys.argv[5:6] == ["pipelined"] else main
    run(loop(port, connections, count, first))
