"""Suppressions."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import SuppressionIn, SuppressionOut
from sendonce.api.problems import Problem
from sendonce.api.routes.subscribers import MAX_IMPORT_ROWS
from sendonce.domain.addresses import Address, InvalidAddress, parse_address
from sendonce.domain.states import SuppressionReason
from sendonce.store import suppressions as store

logger = logging.getLogger(__name__)

router = APIRouter(tags=["suppressions"])

_EXPORT_PAGE = 5000
"""Suppressions per page of an export."""


@router.post("/v1/suppressions", status_code=201, response_model=SuppressionOut)
async def add(body: SuppressionIn, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """Suppress an address: 201 when new, 200 when it was suppressed already."""
    try:
        address = parse_address(body.email)
    except InvalidAddress as exc:
        raise Problem(422, str(exc)) from None

    async def run() -> Response:
        created = await store.add_suppression(conn, account.account_id, address, body.reason)
        out = SuppressionOut(email=address.given, email_key=address.key, reason=body.reason, created=created)
        return JSONResponse(out.model_dump(mode="json"), status_code=201 if created else 200)

    return await idempotent(request, conn, account.account_id, run)


@router.post(
    "/v1/suppressions/import",
    openapi_extra={"requestBody": {"content": {"text/csv": {"schema": {"type": "string"}}}, "required": True}},
)
async def import_csv(
    request: Request,
    account: CurrentAccount,
    conn: Db,
    reason: SuppressionReason = SuppressionReason.MANUAL,
) -> Response:
    """Import suppressions from a CSV with an ``email`` column and an optional ``reason`` column
    (``reason`` in the query is the default). Bad rows are reported; 422 when no row is good."""

    async def run() -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() not in ("text/csv", "text/plain"):
            raise Problem(415, "send the file as text/csv")
        raw = await request.body()
        # Parsed on a thread: up to SENDONCE_MAX_IMPORT_BYTES of CSV held every other request of this
        # process for as long as it took (300,000 rows: /health waited 7 s), as the subscriber import did.
        good, errors, error_count = await asyncio.to_thread(_parse_csv, raw, reason)
        if not good:
            raise Problem(422, "no valid row in the file; nothing was written", errors=error_count, error_rows=errors)
        added = 0
        async with conn.transaction():  # all or nothing: a failure leaves no half import behind
            for start in range(0, len(good), 5000):
                added += await store.import_suppressions(conn, account.account_id, good[start : start + 5000])
        body = {"added": added, "existing": len(good) - added, "errors": error_count, "error_rows": errors}
        return JSONResponse(body)

    return await idempotent(request, conn, account.account_id, run)


def _parse_csv(
    raw: bytes, reason: SuppressionReason
) -> tuple[list[tuple[Address, SuppressionReason]], list[dict[str, Any]], int]:
    """The file's good rows, its first 1,000 bad ones, and how many were bad; a Problem if the file
    cannot be read, has no email column, or has more than MAX_IMPORT_ROWS rows."""
    try:
        reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
        fields = [f.strip().lower() for f in reader.fieldnames or []]
        reader.fieldnames = fields
        if "email" not in fields:
            raise Problem(422, "the CSV has no 'email' column")
        good: list[tuple[Address, SuppressionReason]] = []
        errors: list[dict[str, Any]] = []
        bad = 0

        def refuse(line: int, row: dict[str, Any], error: str) -> None:
            nonlocal bad
            bad += 1
            if len(errors) < 1000:
                errors.append({"line": line, "email": row.get("email"), "error": error})

        for line, row in enumerate(reader, start=2):
            if line - 1 > MAX_IMPORT_ROWS:
                raise Problem(413, f"the file has more than {MAX_IMPORT_ROWS:,} rows; split it; nothing was written")
            try:
                row_reason = SuppressionReason((row.get("reason") or reason.value).strip().lower())
            except ValueError:
                refuse(line, row, "unknown reason")
                continue
            try:
                good.append((parse_address(row.get("email") or ""), row_reason))
            except InvalidAddress as exc:
                refuse(line, row, str(exc))
    except UnicodeDecodeError:
        raise Problem(422, "the file is not UTF-8; nothing was written") from None
    except csv.Error as exc:
        raise Problem(422, f"the CSV is malformed: {exc}; nothing was written") from None
    return good, errors, bad


@router.get("/v1/suppressions/export", response_class=StreamingResponse)
async def export_csv(request: Request, account: CurrentAccount) -> StreamingResponse:
    """Every suppression of the account as CSV (email, email_key, reason, created_at), in email_key
    order. Read page by page, each page in its own short transaction: no connection is held while the
    client reads, and a suppression added or removed during a long export may or may not be in it.
    The first page is read before the answer starts, so a database that cannot be reached is a 503;
    one lost later cuts the stream short (the client sees an incomplete body, not a complete file)."""
    pool = request.app.state.pool
    account_id = account.account_id
    async with pool.connection() as conn:
        first = await store.export_suppressions(conn, account_id, limit=_EXPORT_PAGE)

    def csv_text(rows: list[dict[str, Any]], *, header: bool = False) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        if header:
            writer.writerow(["email", "email_key", "reason", "created_at"])
        for row in rows:
            writer.writerow([row["email"], row["email_key"], row["reason"], row["created_at"].isoformat()])
        return buffer.getvalue()

    async def pages() -> AsyncIterator[str]:
        rows = first
        yield csv_text(rows, header=True)
        while len(rows) == _EXPORT_PAGE:
            try:
                async with pool.connection() as conn:
                    rows = await store.export_suppressions(
                        conn, account_id, after=rows[-1]["email_key"], limit=_EXPORT_PAGE
                    )
            except Exception:
                logger.exception("suppression export of account %s cut short", account_id)
                raise
            yield csv_text(rows)

    headers = {"Content-Disposition": 'attachment; filename="suppressions.csv"'}
    return StreamingResponse(pages(), media_type="text/csv; charset=utf-8", headers=headers)


@router.delete("/v1/suppressions/{email:path}", status_code=204)  # an address may hold a "/"
async def delete(email: Annotated[str, Path(max_length=320)], account: CurrentAccount, conn: Db) -> Response:
    try:
        address = parse_address(email)
    except InvalidAddress as exc:
        raise Problem(422, str(exc)) from None
    if not await store.delete_suppression(conn, account.account_id, address):
        raise Problem(404, f"{address.given} is not suppressed")
    return Response(status_code=204)
