"""Suppressions."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import SuppressionIn, SuppressionOut
from sendonce.api.problems import Problem
from sendonce.domain.addresses import Address, InvalidAddress, parse_address
from sendonce.domain.states import SuppressionReason
from sendonce.store import suppressions as store

router = APIRouter(tags=["suppressions"])


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
        try:
            reader = csv.DictReader(io.StringIO((await request.body()).decode("utf-8-sig")))
            fields = [f.strip().lower() for f in reader.fieldnames or []]
            reader.fieldnames = fields
            rows = list(reader)
        except UnicodeDecodeError:
            raise Problem(422, "the file is not UTF-8; nothing was written") from None
        except csv.Error as exc:
            raise Problem(422, f"the CSV is malformed: {exc}; nothing was written") from None
        if "email" not in fields:
            raise Problem(422, "the CSV has no 'email' column")
        good: list[tuple[Address, SuppressionReason]] = []
        errors: list[dict[str, Any]] = []
        for line, row in enumerate(rows, start=2):
            try:
                row_reason = SuppressionReason((row.get("reason") or reason.value).strip().lower())
            except ValueError:
                errors.append({"line": line, "email": row.get("email"), "error": "unknown reason"})
                continue
            try:
                good.append((parse_address(row.get("email") or ""), row_reason))
            except InvalidAddress as exc:
                errors.append({"line": line, "email": row.get("email"), "error": str(exc)})
        if not good:
            raise Problem(
                422, "no valid row in the file; nothing was written", errors=len(errors), error_rows=errors[:1000]
            )
        added = 0
        for start in range(0, len(good), 5000):
            added += await store.import_suppressions(conn, account.account_id, good[start : start + 5000])
        body = {"added": added, "existing": len(good) - added, "errors": len(errors), "error_rows": errors[:1000]}
        return JSONResponse(body)

    return await idempotent(request, conn, account.account_id, run)


@router.get("/v1/suppressions/export", response_class=StreamingResponse)
async def export_csv(request: Request, account: CurrentAccount) -> StreamingResponse:
    """Every suppression of the account as CSV: email, email_key, reason, created_at."""
    pool = request.app.state.pool

    async def lines() -> AsyncIterator[str]:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["email", "email_key", "reason", "created_at"])
        async with pool.connection() as conn:
            async for row in store.export_suppressions(conn, account.account_id):
                writer.writerow([row["email"], row["email_key"], row["reason"], row["created_at"].isoformat()])
                if buffer.tell() > 65536:
                    yield buffer.getvalue()
                    buffer.seek(0)
                    buffer.truncate()
        yield buffer.getvalue()

    headers = {"Content-Disposition": 'attachment; filename="suppressions.csv"'}
    return StreamingResponse(lines(), media_type="text/csv; charset=utf-8", headers=headers)


@router.delete("/v1/suppressions/{email}", status_code=204)
async def delete(email: Annotated[str, Path(max_length=320)], account: CurrentAccount, conn: Db) -> Response:
    try:
        address = parse_address(email)
    except InvalidAddress as exc:
        raise Problem(422, str(exc)) from None
    if not await store.delete_suppression(conn, account.account_id, address):
        raise Problem(404, f"{address.given} is not suppressed")
    return Response(status_code=204)
