"""The calling account's own settings."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, StringConstraints

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.models import BIGINT_MAX
from sendonce.api.problems import Problem
from sendonce.domain.durations import parse_duration
from sendonce.store import accounts as store
from sendonce.store import lists as list_store

router = APIRouter(tags=["account"])


class DkimIn(BaseModel):
    domain: Annotated[str, StringConstraints(min_length=3, max_length=253, pattern=r"^[A-Za-z0-9.-]+$")]
    selector: Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._-]+$")]
    key_file: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = Field(
        default=None, description="path of the PEM private key, readable by the workers"
    )
    key_env: (
        Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None
    ) = Field(default=None, description="name of the workers' environment variable that holds the PEM private key")


class AccountSettingsIn(BaseModel):
    signup_window: Annotated[str, StringConstraints(max_length=20)] | None = Field(
        default=None, description="idempotency window of signups, such as 90s, 15m, 1h; 'default' for the server's"
    )
    signup_list_id: Annotated[int, Field(ge=1, le=BIGINT_MAX)] | None = None
    from_name: Annotated[str, StringConstraints(max_length=200)] | None = None
    dkim: DkimIn | None = Field(default=None, description="DKIM signing for SMTP; null turns it off")


def _out(account: store.Account) -> dict[str, Any]:
    return {
        "id": account.account_id,
        "name": account.name,
        "from_email": account.from_email,
        "from_name": account.from_name,
        "signup_window": _duration(account.signup_window),
        "signup_list_id": account.signup_list_id,
        "dkim": None
        if account.dkim is None
        else {
            "domain": account.dkim.domain,
            "selector": account.dkim.selector,
            "key_file": account.dkim.key_file,
            "key_env": account.dkim.key_env,
        },
    }


def _duration(value: timedelta | None) -> str | None:
    return None if value is None else f"{int(value.total_seconds())}s"


@router.get("/v1/account")
async def get_account(account: CurrentAccount) -> dict[str, Any]:
    return _out(account)


@router.patch("/v1/account")
async def update_account(body: AccountSettingsIn, account: CurrentAccount, conn: Db) -> dict[str, Any]:
    window: timedelta | None = None
    clear = body.signup_window is not None and body.signup_window.strip().lower() == "default"
    if body.signup_window is not None and not clear:
        try:
            window = parse_duration(body.signup_window)
        except ValueError as exc:
            raise Problem(422, f"signup_window: {exc}") from None
        if not timedelta(seconds=1) <= window <= timedelta(days=30):
            raise Problem(422, "signup_window must be between 1s and 30d")
    if body.signup_list_id is not None and not await list_store.existing_lists(
        conn, account.account_id, [body.signup_list_id]
    ):
        raise Problem(422, f"unknown list id: {body.signup_list_id}")
    dkim: store.DkimSettings | None = None
    if body.dkim is not None:
        if (body.dkim.key_file is None) == (body.dkim.key_env is None):
            raise Problem(422, "dkim: give key_file or key_env (where the workers read the private key), not both")
        dkim = store.DkimSettings(body.dkim.domain.lower(), body.dkim.selector, body.dkim.key_file, body.dkim.key_env)
    updated = await store.update_settings(
        conn,
        account.account_id,
        signup_window=window,
        clear_window=clear,
        signup_list_id=body.signup_list_id,
        from_name=body.from_name,
        dkim=dkim,
        set_dkim="dkim" in body.model_fields_set,
    )
    return _out(updated)
