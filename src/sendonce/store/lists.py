"""Lists."""

from __future__ import annotations

from collections.abc import Iterable

from sendonce.store.database import Conn
from sendonce.store.queries import query


async def create_list(conn: Conn, account_id: int, name: str, opt_in: str = "single") -> int:
    row = await (
        await conn.execute(query("create_list"), {"account_id": account_id, "name": name, "opt_in": opt_in})
    ).fetchone()
    assert row is not None
    return int(row["list_id"])


async def existing_lists(conn: Conn, account_id: int, list_ids: Iterable[int]) -> set[int]:
    ids = sorted(set(list_ids))
    if not ids:
        return set()
    cursor = await conn.execute(query("existing_lists"), {"account_id": account_id, "list_ids": ids})
    return {int(row["list_id"]) for row in await cursor.fetchall()}
