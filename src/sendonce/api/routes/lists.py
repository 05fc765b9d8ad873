"""Lists."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import ListIn, ListOut
from sendonce.store import lists as store

router = APIRouter(tags=["lists"])


@router.post("/v1/lists", status_code=201, response_model=ListOut)
async def create_list(body: ListIn, request: Request, account: CurrentAccount, conn: Db) -> Response:
    async def run() -> Response:
        list_id = await store.create_list(conn, account.account_id, body.name, body.opt_in)
        return JSONResponse(ListOut(id=list_id, name=body.name, opt_in=body.opt_in).model_dump(), status_code=201)

    return await idempotent(request, conn, account.account_id, run)
