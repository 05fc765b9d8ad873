"""Accounts (tenants) and their API keys."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sendonce.store.database import Conn
from sendonce.store.queries import query

_KEY_PREFIX = "sk_"


@dataclass(frozen=True, slots=True)
class DkimSettings:
    """Where an account's DKIM key is: a file or an environment variable of the worker (never the key)."""

    domain: str
    selector: str
    key_file: str | None
    key_env: str | None


@dataclass(frozen=True, slots=True)
class Account:
    account_id: int
    name: str
    from_email: str
    from_name: str | None
    signup_window: timedelta | None = None
    signup_list_id: int | None = None
    dkim: DkimSettings | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Account:
        return cls(
            row["account_id"],
            row["name"],
            row["from_email"],
            row["from_name"],
            row.get("signup_window"),
            row.get("signup_list_id"),
            DkimSettings(row["dkim_domain"], row["dkim_selector"], row["dkim_key_file"], row["dkim_key_env"])
            if row.get("dkim_domain")
            else None,
        )


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def split_api_key(api_key: str) -> tuple[int, str] | None:
    """``sk_<account_id>_<secret>`` -> (account_id, secret); None when it is not of that shape.

    The key names its account, so authentication is a primary-key lookup and a constant-time
    comparison: no global index on key hashes, which keeps every unique index tenant-first.
    """
    if not api_key.startswith(_KEY_PREFIX):
        return None
    account_part, sep, secret = api_key[len(_KEY_PREFIX) :].partition("_")
    # isdigit() alone takes '²' (a header's byte 0xB2, read as Latin-1), which int() refuses
    if not sep or not (account_part.isascii() and account_part.isdigit()) or len(account_part) > 18 or len(secret) < 20:
        return None
    return int(account_part), secret


async def create_account(conn: Conn, *, name: str, from_email: str, from_name: str | None) -> tuple[Account, str]:
    """Create an account; returns it and its API key, which is shown this once and never stored."""
    secret = secrets.token_urlsafe(32)
    row = await (
        await conn.execute(
            query("create_account"),
            {"name": name, "api_key_hash": _hash(secret), "from_email": from_email, "from_name": from_name},
        )
    ).fetchone()
    assert row is not None
    account_id = int(row["account_id"])
    return Account(account_id, name, from_email, from_name), f"{_KEY_PREFIX}{account_id}_{secret}"


async def authenticate(conn: Conn, api_key: str) -> Account | None:
    parts = split_api_key(api_key)
    if parts is None:
        return None
    account_id, secret = parts
    row = await (await conn.execute(query("get_account"), {"account_id": account_id})).fetchone()
    if row is None or not hmac.compare_digest(bytes(row["api_key_hash"]), _hash(secret)):
        return None
    return Account.from_row(row)


async def get_account(conn: Conn, account_id: int) -> Account | None:
    row = await (await conn.execute(query("get_account"), {"account_id": account_id})).fetchone()
    if row is None:
        return None
    return Account.from_row(row)


async def update_settings(
    conn: Conn,
    account_id: int,
    *,
    signup_window: timedelta | None = None,
    clear_window: bool = False,
    signup_list_id: int | None = None,
    from_name: str | None = None,
    dkim: DkimSettings | None = None,
    set_dkim: bool = False,
) -> Account:
    cursor = await conn.execute(
        query("update_account_settings"),
        {
            "account_id": account_id,
            "signup_window": signup_window,
            "clear_window": clear_window,
            "signup_list_id": signup_list_id,
            "from_name": from_name,
            "set_dkim": set_dkim,
            "dkim_domain": dkim.domain if dkim else None,
            "dkim_selector": dkim.selector if dkim else None,
            "dkim_key_file": dkim.key_file if dkim else None,
            "dkim_key_env": dkim.key_env if dkim else None,
        },
    )
    row = await cursor.fetchone()
    assert row is not None
    return Account.from_row(row)
