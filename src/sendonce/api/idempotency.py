"""Client ``Idempotency-Key`` (IETF httpapi draft, Stripe's practice), for every POST that writes.

The key is reserved in the request's own transaction, together with everything the request writes,
and the answer is stored in that same transaction. So the stored answer exists if and only if the
request's effects were committed: a process that dies mid-request leaves nothing, and the retry
runs the request afresh.

* same key, same request: the stored status and body come back, with ``Idempotent-Replayed: true``;
* same key, different request: 422;
* same key while the first request is still running: 409 (it waits ``IN_FLIGHT_WAIT`` first);
* stored answers expire after 24 hours; after that the key is new again.

Only successful (2xx) answers are stored: an error rolls the whole transaction back, reservation
included, so the client may retry with the same key after fixing the request.

A route may say when its stored answer no longer holds (``still_holds``): a signup's "queued" for a mail
that then certainly reached nobody. The request is then run again under the same key, and its new
answer replaces the old; replaying would tell a client that retries as told "queued" for ever, and
send nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from fastapi import Request
from fastapi.responses import Response

from sendonce.api.problems import Problem
from sendonce.domain.keys import InvalidToken
from sendonce.store.database import Conn
from sendonce.store.queries import query

HEADER = "Idempotency-Key"
TTL = "24 hours"
IN_FLIGHT_WAIT = "200ms"


class _NotStored(Exception):
    """A non-2xx answer: leave the transaction, so the reservation is rolled back."""

    def __init__(self, response: Response) -> None:
        self.response = response


def _request_hash(request: Request, body: bytes) -> str:
    try:
        canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        canonical = body
    digest = hashlib.sha256()
    for part in (request.method.encode(), request.url.path.encode(), request.url.query.encode(), canonical):
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()


def _validate(key: str) -> str:
    if not 1 <= len(key) <= 255 or not key.isascii() or not key.isprintable():
        raise Problem(422, f"{HEADER} must be 1 to 255 printable ASCII characters")
    return key


async def idempotent(
    request: Request,
    conn: Conn,
    scope: int,
    handler: Callable[[], Awaitable[Response]],
    *,
    on_replay: Callable[[], None] | None = None,
    seal: Callable[[bytes], str] | None = None,
    unseal: Callable[[str], bytes] | None = None,
    still_holds: Callable[[bytes], Awaitable[bool]] | None = None,
) -> Response:
    """Run ``handler`` once per (scope, Idempotency-Key); without the header, just run it."""
    keys = request.headers.getlist(HEADER)
    if not keys:
        return await handler()
    if len(keys) > 1:
        # which one the client meant cannot be told; taking the first would replay another request
        raise Problem(422, f"give one {HEADER} header, not {len(keys)}")
    raw_key = keys[0]
    key = _validate(raw_key.strip())
    request_hash = _request_hash(request, await request.body())
    params: dict[str, Any] = {
        "account_id": scope,
        "key": key,
        "request_hash": request_hash,
        "method": request.method,
        "path": request.url.path,
        "ttl": TTL,
    }
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{IN_FLIGHT_WAIT}'")
            reserved = await (await conn.execute(query("insert_idempotency_key"), params)).fetchone()
            if reserved is None:
                stored = await (await conn.execute(query("get_idempotency_key"), params)).fetchone()
                assert stored is not None  # live, and locked by this transaction: no prune can take it
                if stored["request_hash"] != request_hash:
                    raise Problem(
                        422,
                        f"this {HEADER} was used with a different request "
                        f"({stored['method']} {stored['path']}); use a new key",
                        kind="idempotency-key-reused",
                        title="Idempotency-Key reused",
                    )
                body = stored["response_body"]
                if unseal is not None:
                    try:
                        body = unseal(body)
                    except InvalidToken:
                        raise Problem(
                            409,
                            f"this {HEADER}'s request was carried out, but its answer was sealed under "
                            "a secret that is neither SENDONCE_SECRET nor SENDONCE_SECRET_PREVIOUS any "
                            "more: it cannot be replayed",
                            kind="idempotency-answer-unreadable",
                            title="Stored answer unreadable",
                        ) from None
                raw = body if isinstance(body, bytes) else body.encode()
                if still_holds is None or await still_holds(raw):
                    if on_replay is not None:
                        on_replay()
                    return Response(
                        raw,
                        status_code=stored["response_status"],
                        media_type="application/json",
                        headers={"Idempotent-Replayed": "true"},
                    )
                # the stored answer is out of date: the request runs again, and its answer is stored
                # over the old one (the key's row stays locked by this transaction meanwhile)
            await conn.execute("SET LOCAL lock_timeout = 0")
            response = await handler()
            if not 200 <= response.status_code < 300:
                raise _NotStored(response)
            await conn.execute(
                query("store_idempotent_response"),
                {
                    "account_id": scope,
                    "key": key,
                    "status": response.status_code,
                    "body": seal(bytes(response.body)) if seal is not None else bytes(response.body).decode("utf-8"),
                },
            )
            return response
    except psycopg.errors.LockNotAvailable:
        raise Problem(
            409,
            f"a request with this {HEADER} is still in flight; retry when it has finished",
            kind="idempotency-key-in-flight",
            title="Request in flight",
            headers={"Retry-After": "1"},
        ) from None
    except _NotStored as exc:
        return exc.response
