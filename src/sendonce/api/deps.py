"""Request dependencies: a pooled connection, the authenticated account, the admin check."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import Annotated

import psycopg
from fastapi import Depends, Request

from sendonce.api.problems import Problem
from sendonce.settings import Settings
from sendonce.store.accounts import Account, authenticate, split_api_key
from sendonce.store.database import Conn

_BEARER = {"WWW-Authenticate": "Bearer"}


@contextlib.asynccontextmanager
async def connection(request: Request) -> AsyncIterator[Conn]:
    """A pooled connection, for a route that first checks what it can without one (a signed token:
    a forged one is a 400 whether or not the database answers, and takes no connection from the pool)."""
    async with request.app.state.pool.connection() as conn:
        try:
            yield conn
        except psycopg.errors.ReadOnlySqlTransaction:
            # This session's server takes no writes (a standby, a primary being demoted): a closed
            # connection is not lent again, and its replacement may reach the new primary.
            await conn.close()
            raise


async def db(request: Request) -> AsyncIterator[Conn]:
    async with connection(request) as conn:
        yield conn


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise Problem(401, "missing Authorization header: send 'Authorization: Bearer <api key>'", headers=_BEARER)
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Problem(401, "the Authorization header must be 'Bearer <api key>'", headers=_BEARER)
    return token.strip()


async def api_key(request: Request) -> str:
    """The request's API key, if it has the shape of one: checked before a connection is taken, so a
    client without a key (or with a malformed one) is told 401 whether or not the database answers,
    not 503 (retry), and takes no connection from the pool."""
    key = _bearer(request)
    if split_api_key(key) is None:
        raise Problem(401, "invalid API key", headers=_BEARER)
    return key


async def current_account(
    request: Request, key: Annotated[str, Depends(api_key)], conn: Annotated[Conn, Depends(db)]
) -> Account:
    account = await authenticate(conn, key)
    if account is None:
        raise Problem(401, "invalid API key", headers=_BEARER)
    request.state.account_id = account.account_id
    return account


def require_admin(request: Request) -> None:
    token = _bearer(request)
    configured = settings_of(request).admin_token
    if configured is None or not configured.get_secret_value():
        raise Problem(403, "the admin API is disabled: set SENDONCE_ADMIN_TOKEN to enable it")
    if not hmac.compare_digest(token.encode(), configured.get_secret_value().encode()):
        raise Problem(401, "invalid admin token", headers=_BEARER)


Db = Annotated[Conn, Depends(db)]
CurrentAccount = Annotated[Account, Depends(current_account)]
