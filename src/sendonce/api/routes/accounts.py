"""Accounts (admin only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StringConstraints

from sendonce.api.deps import Db, require_admin
from sendonce.api.idempotency import idempotent
from sendonce.api.models import BIGINT_MAX, AccountIn, AccountOut
from sendonce.api.problems import Problem
from sendonce.api.services import services_of
from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.store import accounts as store

router = APIRouter(tags=["accounts"])


@router.post("/v1/accounts", status_code=201, response_model=AccountOut)
async def create_account(
    body: AccountIn,
    request: Request,
    _: Annotated[None, Depends(require_admin)],  # before the connection: a wrong token takes none
    conn: Db,
) -> Response:
    """Create an account (admin token). The API key is in this answer only; only its hash is stored."""
    try:
        sender = parse_address(body.from_email)
    except InvalidAddress as exc:
        raise Problem(422, f"from_email: {exc}") from None
    if sender.smtputf8:
        raise Problem(422, "from_email: the part before the @ must be ASCII (it goes on every SMTP envelope)")

    async def run() -> Response:
        account, api_key = await store.create_account(
            conn, name=body.name, from_email=sender.normalized, from_name=body.from_name
        )
        out = AccountOut(id=account.account_id, name=account.name, from_email=account.from_email, api_key=api_key)
        return JSONResponse(out.model_dump(), status_code=201)

    # Admin requests share scope 0: no account exists yet to scope them to. The answer holds the API
    # key: it is kept for replays encrypted under the server secret, never in clear.
    keys = services_of(request).keys
    return await idempotent(request, conn, 0, run, seal=keys.seal, unseal=keys.unseal)


class DkimIn(BaseModel):
    """Where the workers read an account's DKIM key. Admin only: the key's location is host-level
    configuration, which an account must not be able to point at another account's key."""

    domain: Annotated[str, StringConstraints(min_length=3, max_length=253, pattern=r"^[A-Za-z0-9.-]+$")]
    selector: Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._-]+$")]
    key_file: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = Field(
        default=None, description="path of the PEM private key, readable by the workers"
    )
    key_env: (
        Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None
    ) = Field(default=None, description="name of the workers' environment variable that holds the PEM private key")


@router.put("/v1/accounts/{account_id}/dkim")
async def set_dkim(
    account_id: Annotated[int, Path(ge=1, le=BIGINT_MAX)],
    body: DkimIn | None,
    _: Annotated[None, Depends(require_admin)],  # before the connection: a wrong token takes none
    conn: Db,
) -> dict[str, Any]:
    """Sign the account's SMTP mail with DKIM (admin token); a null body turns it off."""
    dkim: store.DkimSettings | None = None
    if body is not None:
        if (body.key_file is None) == (body.key_env is None):
            raise Problem(422, "give key_file or key_env (where the workers read the private key), not both")
        dkim = store.DkimSettings(body.domain.lower(), body.selector, body.key_file, body.key_env)
    if await store.get_account(conn, account_id) is None:
        raise Problem(404, f"no account {account_id}")
    account = await store.update_settings(conn, account_id, dkim=dkim, set_dkim=True)
    settings = account.dkim
    return {
        "account_id": account_id,
        "dkim": None
        if settings is None
        else {
            "domain": settings.domain,
            "selector": settings.selector,
            "key_file": settings.key_file,
            "key_env": settings.key_env,
        },
    }
