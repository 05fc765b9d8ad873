"""ASGI middleware: a body-size limit that holds for chunked bodies too."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sendonce.api.problems import PROBLEM_BASE, PROBLEM_JSON


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
