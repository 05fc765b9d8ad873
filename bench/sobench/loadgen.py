"""Open-loop HTTP load on ``POST /v1/signups``, from a process of its own.

    python -m sobench.loadgen --ports 8001,8002 --key sk_… --kind new|repeat --rate R --duration D --tag T

Requests are scheduled by the clock (request i at t0 + i/R), whatever the answers do: a slow
server does not slow the offered load, and each latency is measured from the request's *scheduled*
time, so time spent queued behind a slow answer (in this client or in the server) counts (no
coordinated omission). A minimal HTTP/1.1 client on asyncio streams with keep-alive connections
keeps the client's own cost low; requests beyond ``--max-connections`` in flight wait for a free
connection, and that wait is part of their latency. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter


class Client:
    def __init__(self, ports: list[int], key: str, max_connections: int) -> None:
        self.ports = ports
        self.key = key
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.open = 0
        self.max = max_connections
        self.freed = asyncio.Condition()
        self.turn = 0

    async def _acquire(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while True:
            if self.idle:
                return self.idle.pop()
            if self.open < self.max:
                self.open += 1
                port = self.ports[self.turn % len(self.ports)]
                self.turn += 1
                try:
                    return await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    self.open -= 1
                    raise
            async with self.freed:
                await self.freed.wait()

    async def _release(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
        if conn is None:
            self.open -= 1
        else:
            self.idle.append(conn)
        async with self.freed:
            self.freed.notify()

    async def post(self, path: str, body: bytes) -> int:
        while True:
            status = await self._post_once(path, body)
            if status:
                return status

    async def _post_once(self, path: str, body: bytes) -> int:
        """The status; 0 when a kept-alive connection turned out closed by the server (retry: the pool is
        last-in first-out, so connections left idle past uvicorn's keep-alive timeout sit at its bottom).
        A new connection that closes without an answer is an error."""
        fresh = not self.idle
        conn = await self._acquire()
        reader, writer = conn
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self.key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            try:
                status_line = await reader.readline()
            except ConnectionResetError:
                if fresh:
                    raise
                status_line = b""
            if not status_line:
                if fresh:
                    raise ConnectionResetError("the server closed a new connection without answering")
                writer.close()  # the server closed this idle keep-alive connection: try another
                await self._release(None)
                return 0
            status = int(status_line.split()[1])
            length = 0
            close = False
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
            if length:
                await reader.readexactly(length)
        except BaseException:
            writer.close()
            await self._release(None)
            raise
        if close:
            writer.close()
            await self._release(None)
        else:
            await self._release(conn)
        return status


async def run(args: argparse.Namespace) -> dict[str, object]:
    client = Client([int(p) for p in args.ports.split(",")], args.key, args.max_connections)
    total = int(args.rate * args.duration)
    if args.kind == "new":
        bodies = [
            json.dumps({"email": f"new-{args.tag}-{i}@example.test", "origin": "web"}).encode() for i in range(total)
        ]
    else:
        bodies = [json.dumps({"email": "repeat@example.test", "origin": "web"}).encode()] * total
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    loop = asyncio.get_running_loop()

    async def one(body: bytes, scheduled: float) -> None:
        try:
            status = await asyncio.wait_for(client.post("/v1/signups", body), args.timeout)
        except TimeoutError:
            statuses["timeout"] += 1
            return
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
            statuses[type(exc).__name__] += 1
            return
        latencies.append(loop.time() - scheduled)
        statuses[str(status)] += 1

    tasks = []
    start = loop.time() + 0.05
    for i, body in enumerate(bodies):
        scheduled = start + i / args.rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(body, scheduled)))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - start
    latencies.sort()

    def pct(q: float) -> float | None:
        return 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    return {
        "kind": args.kind,
        "offered": args.rate,
        "requests": total,
        "elapsed": elapsed,
        "statuses": dict(statuses),
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": 1000 * latencies[-1] if latencies else None,
        "connections": client.open,
        "cpu_s": time.process_time(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--kind", choices=("new", "repeat"), required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--tag", default="0")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--max-connections", type=int, default=512)
    args = parser.parse_args()
    try:
        import uvloop  # comes with uvicorn[standard]: a cheaper client loop
    except ImportError:
        result = asyncio.run(run(args))
    else:
        result = uvloop.run(run(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
