"""Accounts (admin only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from sendonce.api.deps import Db, require_admin
from sendonce.api.idempotency import idempotent
from sendonce.api.models import AccountIn, AccountOut
from sendonce.api.problems import Problem
from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.store import accounts as store

router = APIRouter(tags=["accounts"])


@router.post("/v1/accounts", status_code=201, response_model=AccountOut)
async def create_account(
    body: AccountIn, request: Request, conn: Db, _: Annotated[None, Depends(require_admin)]
) -> Response:
    """Create an account (admin token). The API key is in this answer only; only its hash is stored."""
    try:
        sender = parse_address(body.from_email)
    except InvalidAddress as exc:
        raise Problem(422, f"from_email: {exc}") from None

    async def run() -> Response:
        account, api_key = await store.create_account(
            conn, name=body.name, from_email=sender.normalized, from_name=body.from_name
        )
        out = AccountOut(id=account.account_id, name=account.name, from_email=account.from_email, api_key=api_key)
        return JSONResponse(out.model_dump(), status_code=201)

    # Admin requests share scope 0: no account exists yet to scope them to.
    return await idempotent(request, conn, 0, run)
