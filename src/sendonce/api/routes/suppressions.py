"""Suppressions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import SuppressionIn, SuppressionOut
from sendonce.api.problems import Problem
from sendonce.domain.addresses import InvalidAddress, parse_address
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


@router.delete("/v1/suppressions/{email}", status_code=204)
async def delete(email: Annotated[str, Path(max_length=320)], account: CurrentAccount, conn: Db) -> Response:
    try:
        address = parse_address(email)
    except InvalidAddress as exc:
        raise Problem(422, str(exc)) from None
    if not await store.delete_suppression(conn, account.account_id, address):
        raise Problem(404, f"{address.given} is not suppressed")
    return Response(status_code=204)
