"""Accounts (admin only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from sendonce.api.deps import Db, require_admin
from sendonce.api.models import AccountIn, AccountOut
from sendonce.api.problems import Problem
from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.store import accounts as store

router = APIRouter(tags=["accounts"])


@router.post("/v1/accounts", status_code=201, response_model=AccountOut)
async def create_account(body: AccountIn, conn: Db, _: Annotated[None, Depends(require_admin)]) -> AccountOut:
    try:
        sender = parse_address(body.from_email)
    except InvalidAddress as exc:
        raise Problem(422, f"from_email: {exc}") from None
    account, api_key = await store.create_account(
        conn, name=body.name, from_email=sender.normalized, from_name=body.from_name
    )
    return AccountOut(id=account.account_id, name=account.name, from_email=account.from_email, api_key=api_key)
