"""A local HTTP server with the Resend API's idempotency semantics, recording what it accepted.

``POST /emails`` with ``Authorization: Bearer <key>`` and ``Idempotency-Key``:

* a new key: the email is accepted (recorded once) and ``{"id": ...}`` returned;
* the same key and the same body again: the first answer is replayed, nothing new is recorded;
* the same key with a different body: ``409 invalid_idempotent_request``;
* the same key while the first request is still being handled: ``409 concurrent_idempotent_requests``.

Faults, each a probability per request: 429, 500, "accept then stall" (the email is recorded,
then the answer is delayed past the client's timeout: the ambiguous case), "answer late" (the same,
but the key stays in flight until the answer is made: a retry meanwhile gets the
``concurrent_idempotent_requests`` 409), and "replay conflict" (a
repeat of a key already answered gets ``409 invalid_idempotent_request`` instead of the replay, as a
provider that forgot the body but remembers the key would answer).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


@dataclass(frozen=True, slots=True)
class AcceptedEmail:
    id: str
    idempotency_key: str | None
    body: dict[str, Any]
    received_at: float

    @property
    def to(self) -> list[str]:
        value = self.body.get("to", [])
        return [value] if isinstance(value, str) else list(value)

    @property
    def job_id(self) -> str | None:
        headers = self.body.get("headers") or {}
        value = headers.get("Sendonce-Job-Id") if isinstance(headers, dict) else None
        return value if isinstance(value, str) else None


@dataclass
class ResendFaults:
    rate_limited: float = 0.0
    server_error: float = 0.0
    server_error_retry_after: str | None = None
    """The Retry-After header of a 500 answer (none if None)."""
    accept_then_stall: float = 0.0
    stall_seconds: float = 5.0
    answer_late: float = 0.0
    """The email is recorded, and its key stays in flight for ``stall_seconds`` before the answer is
    made and stored: a request with the key meanwhile gets ``409 concurrent_idempotent_requests``."""
    delay_seconds: float = 0.0
    """Every request waits this long before it is handled (a slow provider)."""
    replay_conflict: float = 0.0
    """A repeat of a key that was already answered gets a 409 instead of the stored answer."""
    id_length: int = 32
    """Characters of the email ids it answers (a provider's, or a proxy's, may be far longer)."""
    seed: int | None = None
    counts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def roll(self, probability: float) -> bool:
        return probability > 0 and self._random.random() < probability


class ResendServer:
    def __init__(self, api_key: str = "re_test_key", *, faults: ResendFaults | None = None) -> None:
        self.api_key = api_key
        self.faults = faults or ResendFaults()
        self._lock = threading.Lock()
        self.accepted: list[AcceptedEmail] = []
        self.requests = 0
        self.request_log: list[tuple[float, str | None]] = []
        """(arrival time, idempotency key) of every request, accepted or not."""
        self._keys: dict[str, tuple[str, dict[str, Any] | None]] = {}  # key -> (body hash, answer or None: in flight)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.app = Starlette(routes=[Route("/emails", self._emails, methods=["POST"])])

    async def _emails(self, request: Request) -> JSONResponse:
        with self._lock:
            self.requests += 1
            self.request_log.append((time.time(), request.headers.get("idempotency-key")))
        if self.faults.delay_seconds:
            await asyncio.sleep(self.faults.delay_seconds)
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            if not request.headers.get("authorization"):
                return JSONResponse({"name": "missing_api_key", "message": "Missing API key"}, status_code=401)
            return JSONResponse({"name": "invalid_api_key", "message": "API key is invalid"}, status_code=403)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"name": "validation_error", "message": "invalid JSON"}, status_code=422)
        if not isinstance(body, dict) or not body.get("to") or not body.get("from"):
            return JSONResponse({"name": "validation_error", "message": "from and to are required"}, status_code=422)
        faults = self.faults
        if faults.roll(faults.rate_limited):
            faults.counts["429"] += 1
            return JSONResponse(
                {"name": "rate_limit_exceeded", "message": "Too many requests"},
                status_code=429,
                headers={"Retry-After": "1"},
            )
        if faults.roll(faults.server_error):
            faults.counts["500"] += 1
            retry_after = faults.server_error_retry_after
            return JSONResponse(
                {"name": "internal_server_error", "message": "oops"},
                status_code=500,
                headers={"Retry-After": retry_after} if retry_after is not None else None,
            )
        key = request.headers.get("idempotency-key")
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key is not None and key in self._keys:
                seen_digest, answer = self._keys[key]
                if answer is None:
                    faults.counts["409_concurrent"] += 1
                    return JSONResponse(
                        {
                            "name": "concurrent_idempotent_requests",
                            "message": "a request with this key is in progress",
                        },
                        status_code=409,
                    )
                if seen_digest != digest:
                    faults.counts["409_payload"] += 1
                    return JSONResponse(
                        {
                            "name": "invalid_idempotent_request",
                            "message": "key already used with another payload",
                        },
                        status_code=409,
                    )
                if faults.roll(faults.replay_conflict):
                    faults.counts["409_replay_conflict"] += 1
                    return JSONResponse(
                        {
                            "name": "invalid_idempotent_request",
                            "message": "this idempotency key was already used",
                        },
                        status_code=409,
                    )
                faults.counts["replayed"] += 1
                return JSONResponse(answer, status_code=200)
            if key is not None:
                self._keys[key] = (digest, None)
            seed = f"{key}:{time.time_ns()}:{len(self.accepted)}".encode()
            email_id = hashlib.shake_256(seed).hexdigest((faults.id_length + 1) // 2)[: faults.id_length]
            self.accepted.append(AcceptedEmail(email_id, key, body, time.time()))
        answer = {"id": email_id}
        if faults.roll(faults.answer_late):
            faults.counts["answer_late"] += 1
            await asyncio.sleep(faults.stall_seconds)  # the key in flight all along
            with self._lock:
                if key is not None:
                    self._keys[key] = (digest, answer)
            return JSONResponse(answer, status_code=200)
        stall = faults.roll(faults.accept_then_stall)
        if stall:
            faults.counts["accept_then_stall"] += 1
        with self._lock:
            if key is not None:
                self._keys[key] = (digest, answer)
        if stall:
            await asyncio.sleep(faults.stall_seconds)
        return JSONResponse(answer, status_code=200)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> ResendServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="resend-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the local Resend server did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None
        self._thread = None

    def __enter__(self) -> ResendServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"resend+http://{self.api_key}@127.0.0.1:{self.port}"

    def forget_keys(self) -> None:
        """The provider's key window has passed: every idempotency key seen so far is new again."""
        with self._lock:
            self._keys.clear()

    def by_recipient(self) -> Counter[str]:
        with self._lock:
            return Counter(to for email in self.accepted for to in email.to)

    def by_job(self) -> Counter[str | None]:
        """Accepted emails per job: the message's own header, or else the key it came with (another
        sender's message, say). The chaos verdict reads the header alone (:attr:`AcceptedEmail.job_id`)."""
        with self._lock:
            return Counter(email.job_id or email.idempotency_key for email in self.accepted)
