"""A TCP proxy on loopback that a test can pause or cut: a network partition without root.

It forwards to a TCP address or to a Unix socket (the embedded PostgreSQL listens on one).

* ``pause()``: stop moving bytes in both directions; connections stay open and hang, like a
  partition where packets are dropped;
* ``cut()``: close every connection and refuse new ones, like a partition with resets;
* ``heal()``: forward again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any


class TcpProxy:
    def __init__(
        self,
        *,
        target_host: str | None = None,
        target_port: int | None = None,
        target_unix: str | None = None,
    ) -> None:
        if (target_unix is None) == (target_host is None):
            raise ValueError("give a TCP target or a Unix socket, not both")
        self.target_host = target_host
        self.target_port = target_port
        self.target_unix = target_unix
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._flowing = threading.Event()
        self._flowing.set()
        self._refusing = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = threading.Event()
        self.connections = 0
        """Connections forwarded."""
        self.refused = 0
        """Connections refused (reset at once) while cut."""

    # -- control (from any thread) ---------------------------------------------------------------

    def pause(self) -> None:
        self._flowing.clear()

    def cut(self) -> None:
        self._refusing = True
        self._flowing.set()
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(timeout=5)

    def heal(self) -> None:
        self._refusing = False
        self._flowing.set()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            loop = self._loop
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=5)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._refusing = True
        self._flowing.set()  # paused pipes wake up, see the proxy is closing, and end
        await self._close_all()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2)

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self._refusing:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            if self.target_unix is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self.target_unix)
            else:
                up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update({writer, up_writer})
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            while not self._flowing.is_set():  # noqa: ASYNC110 - the flag is set from another thread
                await asyncio.sleep(0.01)
            if self._refusing:
                break
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.transport.abort()
