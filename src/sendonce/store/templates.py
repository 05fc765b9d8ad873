"""Stored templates: subject, text and HTML, per account."""

from __future__ import annotations

from typing import Any

from sendonce.store.database import Conn
from sendonce.store.queries import query


async def create_template(
    conn: Conn, account_id: int, *, name: str, subject: str, text_body: str | None, html_body: str | None
) -> dict[str, Any]:
    params = {
        "account_id": account_id,
        "name": name,
        "subject": subject,
        "text_body": text_body,
        "html_body": html_body,
    }
    row = await (await conn.execute(query("create_template"), params)).fetchone()
    assert row is not None
    return dict(row)


async def get_template(conn: Conn, account_id: int, template_id: int) -> dict[str, Any] | None:
    params = {"account_id": account_id, "template_id": template_id}
    row = await (await conn.execute(query("get_template"), params)).fetchone()
    return dict(row) if row else None


async def update_template(
    conn: Conn,
    account_id: int,
    template_id: int,
    *,
    name: str,
    subject: str,
    text_body: str | None,
    html_body: str | None,
) -> dict[str, Any] | None:
    params = {
        "account_id": account_id,
        "template_id": template_id,
        "name": name,
        "subject": subject,
        "text_body": text_body,
        "html_body": html_body,
    }
    row = await (await conn.execute(query("update_template"), params)).fetchone()
    return dict(row) if row else None


async def get_subscriber(
    conn: Conn, account_id: int, *, subscriber_id: int | None = None, email_key: str | None = None
) -> dict[str, Any] | None:
    params = {"account_id": account_id, "subscriber_id": subscriber_id, "email_key": email_key}
    row = await (await conn.execute(query("get_subscriber"), params)).fetchone()
    return dict(row) if row else None
