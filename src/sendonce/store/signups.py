"""The signup transaction: pending user, idempotency window and outbox event, atomically.

Everything a request does happens in one transaction. If the process dies before the commit,
nothing happened and the client's retry does the work; after it, the outbox row is durable and a
worker sends it. A repeat within the window gets the first request's answer and queues nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from psycopg.types.json import Jsonb

from sendonce.domain.addresses import Address
from sendonce.domain.keys import SIGNUP_EVENT, KeyRing
from sendonce.errors import InvalidInput, SendonceError
from sendonce.store import rate_limits
from sendonce.store.accounts import Account, get_account
from sendonce.store.database import Conn
from sendonce.store.queries import query
from sendonce.store.rate_limits import Rate

ORIGINS = ("web", "app", "api")
VERIFY_PURPOSE = "verify"


class AddressSuppressed(InvalidInput):
    """This address is suppressed for the account: no verification mail can be sent to it."""


class RateLimited(SendonceError):
    """Too many signup requests; try again later."""

    def __init__(self, retry_after: float, scope: str) -> None:
        super().__init__(f"too many signup requests for this {scope}; retry in {retry_after:.0f}s")
        self.retry_after = retry_after
        self.scope = scope


@dataclass(frozen=True, slots=True)
class SignupOutcome:
    new: bool
    """True: this request opened a window and queued a mail (201). False: a repeat (200)."""
    body: dict[str, Any]


ACCOUNT_BUCKET_SHARDS = 8


@dataclass(frozen=True, slots=True)
class SignupLimits:
    per_address: Rate
    per_account: Rate

    @property
    def account_shards(self) -> int:
        """How many parts the account's bucket is split into: ACCOUNT_BUCKET_SHARDS, fewer when its
        burst is smaller (each part must hold at least one whole token, or its addresses could never
        sign up)."""
        return max(1, min(ACCOUNT_BUCKET_SHARDS, math.floor(self.per_account.capacity)))

    @property
    def per_account_shard(self) -> Rate:
        """One of ``account_shards`` equal parts of the account's rate (and burst)."""
        shards = self.account_shards
        return Rate(self.per_account.count / shards, self.per_account.seconds, self.per_account.capacity / shards)


def _answer(stored: dict[str, Any] | None, fallback: dict[str, Any]) -> dict[str, Any]:
    """The stored answer in a fixed key order (jsonb does not keep it), so repeats are byte-identical."""
    source = stored or fallback
    return {key: source[key] for key in ("signup_id", "status", "verification")}


def _pending(signup_id: int) -> dict[str, Any]:
    return {"signup_id": signup_id, "status": "pending", "verification": "queued"}


def _verified(signup_id: int) -> dict[str, Any]:
    return {"signup_id": signup_id, "status": "verified", "verification": "not_needed"}


async def _one(conn: Conn, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
    return await (await conn.execute(query(name), params)).fetchone()


async def answer_outdated(conn: Conn, account_id: int, answer: bytes) -> bool:
    """Whether a stored answer to a signup request no longer holds: it said "queued", and the mail it
    queued has since certainly reached nobody, so a retry must queue another (see signup_mail_dead)."""
    try:
        stored = json.loads(answer)
        signup_id = int(stored["signup_id"])
    except (ValueError, TypeError, KeyError):
        return False  # not an answer of this route's shape: replayed as it is
    if stored.get("verification") != "queued":
        return False
    row = await _one(conn, "signup_mail_dead", {"account_id": account_id, "signup_id": signup_id})
    return bool(row and row["dead"])


async def request_signup(
    conn: Conn,
    *,
    account: Account,
    address: Address,
    origin: str,
    name: str | None,
    locale: str | None,
    redirect_url: str | None,
    keys: KeyRing,
    window: timedelta,
    limits: SignupLimits,
    verify_url: Callable[[str], str],
) -> SignupOutcome:
    aid = account.account_id
    current = keys.operation_key(aid, SIGNUP_EVENT, address.key, origin)
    seen = await _one(
        conn,
        "peek_repeat",
        {
            "account_id": aid,
            "email_key": address.key,
            "origin": origin,
            "name": name,
            "locale": locale,
            "redirect_url": redirect_url,
            "operation_key": current,
            "window": window,
        },
    )
    assert seen is not None
    if seen["suppressed"]:
        raise AddressSuppressed
    # An open window under the current key answers here. None (a window under another secret, say
    # before a rotation, or none at all): the locking way, which finds the signup's latest window.
    if seen["signup_id"] is not None:
        signup_id = int(seen["signup_id"])
        if seen["status"] == "verified":
            return SignupOutcome(False, _verified(signup_id))
        if seen["open"] and seen["answer"] is not None:
            return SignupOutcome(False, _answer(seen["answer"], _pending(signup_id)))
    async with conn.transaction():
        signup = await _one(
            conn,
            "upsert_signup",
            {
                "account_id": aid,
                "email": address.given,
                "email_key": address.key,
                "origin": origin,
                "name": name,
                "locale": locale,
                "redirect_url": redirect_url,
            },
        )
        assert signup is not None
        signup_id = int(signup["signup_id"])
        if signup["status"] == "verified":
            return SignupOutcome(False, _verified(signup_id))
        pending = _pending(signup_id)
        # A window opened under another secret (the previous one, or one already retired) is still
        # this signup's window: a rotation neither re-opens it nor lets two windows run at once.
        latest = await _one(conn, "lock_latest_window", {"account_id": aid, "signup_id": signup_id, "window": window})
        if latest is not None and latest["operation_key"] != current and latest["open"]:
            return SignupOutcome(False, _answer(latest["answer"], pending))
        opened = await _one(
            conn,
            "open_window",
            {
                "account_id": aid,
                "operation_key": current,
                "signup_id": signup_id,
                "window": window,
                "answer": Jsonb(pending),
            },
        )
        if opened is None:
            answer = await _one(conn, "lock_window", {"account_id": aid, "operation_key": current, "window": window})
            return SignupOutcome(False, _answer((answer or {}).get("answer"), pending))

        window_id, generation = int(opened["window_id"]), int(opened["generation"])
        token = keys.sign(VERIFY_PURPOSE, {"a": aid, "s": signup_id, "w": window_id, "g": generation})
        payload = {
            "signup_id": signup_id,
            "email": address.given,
            "name": name,
            "locale": locale,
            "origin": origin,
            "verify_url": verify_url(token),
        }
        delivery = await _one(
            conn,
            "insert_operation",
            {
                "account_id": aid,
                "job_id": f"signup:{window_id}:{generation}",
                "kind": SIGNUP_EVENT,
                "email": address.given,
                "email_key": address.key,
                "payload": Jsonb(payload),
                "operation_key": f"{current}:{generation}",
            },
        )
        if delivery is None:  # the event of this window exists already: a repeat
            return SignupOutcome(False, pending)

        # Only a request that queues a mail spends tokens; a refusal rolls the whole transaction back.
        wait = await rate_limits.take(conn, aid, f"signup:address:{address.key}", limits.per_address)
        if wait is not None:
            raise RateLimited(wait, "address")
        # The account's bucket is split in shards, by address: each request locks one shard row until
        # its commit, so one account's signups are not serialized on a single row.
        shard = int(hashlib.sha256(address.key.encode()).hexdigest()[:8], 16) % limits.account_shards
        wait = await rate_limits.take(conn, aid, f"signup:account:{shard}", limits.per_account_shard)
        if wait is not None:
            raise RateLimited(wait, "account")
        return SignupOutcome(True, pending)


@dataclass(frozen=True, slots=True)
class VerifyOutcome:
    signup_id: int
    already: bool
    redirect_url: str | None


class UnknownSignup(InvalidInput):
    """The link does not match any signup."""


async def verified_already(conn: Conn, payload: dict[str, Any]) -> VerifyOutcome | None:
    """The signup a genuine but expired link names, if it is verified already (verifying twice answers
    the same, however old the link); None otherwise. Changes nothing."""
    try:
        aid, signup_id = int(payload["a"]), int(payload["s"])
    except (KeyError, TypeError, ValueError):
        return None
    current = await _one(conn, "get_signup", {"account_id": aid, "signup_id": signup_id})
    if current is None or current["status"] != "verified":
        return None
    return VerifyOutcome(signup_id, True, current["redirect_url"])


async def verify_signup(conn: Conn, payload: dict[str, Any]) -> VerifyOutcome:
    """Mark the signup verified and make the person a confirmed subscriber, atomically, idempotently."""
    try:
        aid, signup_id = int(payload["a"]), int(payload["s"])
    except (KeyError, TypeError, ValueError):
        raise UnknownSignup from None
    async with conn.transaction():
        row = await _one(conn, "verify_signup", {"account_id": aid, "signup_id": signup_id})
        if row is None:
            current = await _one(conn, "get_signup", {"account_id": aid, "signup_id": signup_id})
            if current is None:
                raise UnknownSignup
            return VerifyOutcome(signup_id, True, current["redirect_url"])
        account = await get_account(conn, aid)
        assert account is not None
        asked_at = None
        window_id, generation = payload.get("w"), payload.get("g")
        if all(isinstance(n, int) and not isinstance(n, bool) for n in (window_id, generation)):
            window = await _one(
                conn,
                "window_asked_at",
                {"account_id": aid, "window_id": window_id, "signup_id": signup_id, "generation": generation},
            )
            asked_at = window["opened_at"] if window is not None else None
        subscriber = await _one(
            conn,
            "confirm_subscriber",
            {
                "account_id": aid,
                "email": row["email"],
                "email_key": row["email_key"],
                "name": row["name"],
                "asked_at": asked_at,
            },
        )
        assert subscriber is not None
        if account.signup_list_id is not None:
            await conn.execute(
                query("confirm_membership"),
                {
                    "account_id": aid,
                    "list_id": account.signup_list_id,
                    "subscriber_id": subscriber["subscriber_id"],
                    "email_key": row["email_key"],
                    "asked_at": asked_at,
                },
            )
        return VerifyOutcome(signup_id, False, row["redirect_url"])
