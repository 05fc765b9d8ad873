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
from sendonce.settings import check_signup_window
from sendonce.store import accounts as store
from sendonce.store import lists as list_store

router = APIRouter(tags=["account"])


class AccountSettingsIn(BaseModel):
    signup_window: Annotated[str, StringConstraints(max_length=20)] | None = Field(
        default=None, description="idempotency window of signups, such as 90s, 15m, 1h; 'default' for the server's"
    )
    signup_list_id: Annotated[int, Field(ge=1, le=BIGINT_MAX)] | None = None
    from_name: Annotated[str, StringConstraints(max_length=200)] | None = None


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
        try:
            check_signup_window(window)
        except ValueError as exc:
            raise Problem(422, f"signup_window {exc}") from None
    if body.signup_list_id is not None and not await list_store.existing_lists(
        conn, account.account_id, [body.signup_list_id]
    ):
        raise Problem(422, f"unknown list id: {body.signup_list_id}")
    updated = await store.update_settings(
        conn,
        account.account_id,
        signup_window=window,
        clear_window=clear,
        signup_list_id=body.signup_list_id,
        from_name=body.from_name,
    )
    return _out(updated)
