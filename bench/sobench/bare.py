"""The physical limit: a bare aiosmtplib loop, no database, pre-rendered bytes, persistent connections.

One process of it: ``python -m sobench.bare PORT CONNECTIONS COUNT FIRST``. It renders its messages
(sendonce's own composer code, so the same bytes sendonce sends), opens CONNECTIONS connections,
prints ``ready``, waits for a line on stdin, then sends COUNT messages (MAIL, RCPT, DATA each, as
sendonce does) and prints one JSON line: start and end (wall clock), sent, errors.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiosmtplib

from sobench.content import Prerendered, sendonce_message

_POOL = 2000
"""Distinct pre-rendered messages, cycled (the bytes per message are what matters to the wire)."""


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
    asyncio.run(main(port, connections, count, first))
