"""ASGI middleware: a body-size limit that holds for chunked bodies too, and a deadline for every
answer."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sendonce.api.problems import PROBLEM_BASE, PROBLEM_JSON, problem_response, unavailable
from sendonce.store.database import abandon

logger = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse bodies larger than the limit with 413, before the route reads them.

    ``limit_for(path)`` picks the limit: CSV imports may be larger than JSON calls.
    """

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope.get("path", ""))
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await self._refuse(send, limit, scope.get("path", ""))
                    return
        received = 0
        response_started = False
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if not response_started and not refused:
                        # Answered here: FastAPI turns any error while it reads a body into a 400
                        # ("There was an error parsing the body"), so BodyTooLarge may never reach us.
                        refused = True
                        await self._refuse(send, limit, scope.get("path", ""))
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if refused:
                return  # the 413 was the answer: what the app makes of the aborted read goes nowhere
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started and not refused:
                await self._refuse(send, limit, scope.get("path", ""))

    async def _refuse(self, send: Send, limit: int, path: str) -> None:
        body = json.dumps(
            {
                "type": PROBLEM_BASE + "payload-too-large",
                "title": "Request body too large",
                "status": 413,
                "detail": f"the request body is larger than {limit} bytes; nothing was written",
                "instance": path,
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM_JSON.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class DeadlineMiddleware:
    """Answer 503 (with Retry-After) to a request that has no answer after ``seconds_for(path)``.

    A database that stops answering rather than refusing (a partition that drops packets, a paused
    host) leaves a statement waiting with no error: TCP keepalives take hours to notice. So does a
    request waiting on a row lock held by another API process's transaction that stalled the same
    way. Without a deadline such a request never ends, and each retry of it holds one more pooled
    connection until none is left for anyone. Past the deadline the client gets the same 503 as for a
    database that is down; the request's task is cancelled (twice if need be: psycopg's first
    cancellation tries to cancel the statement on the server over the same silent path, the second
    closes the connection), and the pool replaces that connection. A response already under way is
    left to finish.
    """

    def __init__(self, app: ASGIApp, seconds_for: Callable[[str], float]) -> None:
        self.app = app
        self.seconds_for = seconds_for
        self._abandoned: set[asyncio.Task[Any]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = answered = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # the 503 was the answer: what the abandoned request makes goes nowhere
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, guarded_send))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.seconds_for(scope.get("path", "")))
        except asyncio.CancelledError:  # the server is stopping, or the client went away
            task.cancel()
            raise
        if task in done or started:
            await task  # its answer, or its error for the handlers outside
            return
        answered = True
        seconds = self.seconds_for(scope.get("path", ""))
        what = f"{scope.get('method')} {scope.get('path')}"
        logger.warning("%s: no answer within %gs; 503", what, seconds, extra={"action": "request_deadline"})
        # Cancelled first, whatever becomes of the 503 (a client gone, a server stopping): it must not
        # keep its pooled connection, nor go on working.
        giving_up = asyncio.ensure_future(self._abandon(task, what))
        self._abandoned.add(giving_up)
        giving_up.add_done_callback(self._abandoned.discard)
        problem = unavailable(f"no answer within {seconds:g}s (the database may not be answering)")
        await problem_response(problem, scope.get("path"))(scope, receive, send)

    @staticmethod
    async def _abandon(task: asyncio.Task[Any], what: str) -> None:
        await abandon(task, step=0.25)
        if not task.done():
            logger.error("%s: still running 10s after its 503, cancelled 40 times", what)
        elif not task.cancelled() and (exc := task.exception()) is not None:
            # answered with the 503 already; its own error is still worth knowing
            logger.warning("%s: after its 503 it failed: %r", what, exc, extra={"action": "request_deadline"})
