"""Lists."""

from __future__ import annotations

from fastapi import APIRouter

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.models import ListIn, ListOut
from sendonce.store import lists as store

router = APIRouter(tags=["lists"])


@router.post("/v1/lists", status_code=201, response_model=ListOut)
async def create_list(body: ListIn, account: CurrentAccount, conn: Db) -> ListOut:
    list_id = await store.create_list(conn, account.account_id, body.name)
    return ListOut(id=list_id, name=body.name)
