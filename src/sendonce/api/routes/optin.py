"""Double opt-in: the link in the confirmation mail confirms one list membership."""

from __future__ import annotations

from html import escape
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, StringConstraints

from sendonce.api.deps import connection
from sendonce.api.models import json_or_form_body
from sendonce.api.problems import Problem
from sendonce.api.services import services_of
from sendonce.domain.keys import ExpiredToken, InvalidToken
from sendonce.store.subscribers import OPTIN_PURPOSE, confirm_membership

router = APIRouter(tags=["lists"])


class ConfirmIn(BaseModel):
    token: Annotated[str, StringConstraints(min_length=1, max_length=4000)]


def _payload(request: Request, token: str) -> tuple[int, int, int]:
    services = services_of(request)
    try:
        payload = services.keys.verify(OPTIN_PURPOSE, token, max_age=services.settings.optin_ttl.total_seconds())
        return int(payload["a"]), int(payload["l"]), int(payload["s"])
    except ExpiredToken:
        raise Problem(400, "this confirmation link has expired", kind="token-expired", title="Expired link") from None
    except (InvalidToken, KeyError, TypeError, ValueError):
        raise Problem(400, "this confirmation link is not valid", kind="token-invalid", title="Invalid link") from None


def _page(title: str, message: str, extra: str = "", status: int = 200) -> HTMLResponse:
    return HTMLResponse(
        '<!doctype html><html><head><meta charset="utf-8"><meta name="robots" content="noindex">'
        f'<title>{escape(title)}</title></head><body style="font-family:sans-serif;max-width:32em;margin:3em auto">'
        f"<h1>{escape(title)}</h1><p>{escape(message)}</p>{extra}</body></html>",
        status_code=status,
    )


@router.get("/v1/lists/confirm", response_class=HTMLResponse)
async def confirm_page(request: Request, token: Annotated[str, Query(max_length=4000)] = "") -> HTMLResponse:
    """The page the confirmation link opens: one click (a POST) confirms, a link scanner's GET does not."""
    try:
        _payload(request, token)
    except Problem as exc:
        return _page("Link not valid", exc.detail, status=400)
    form = (
        '<form method="post" action="confirm">'
        f'<input type="hidden" name="token" value="{escape(token, quote=True)}">'
        '<button type="submit">Yes, subscribe me</button></form>'
    )
    return _page("Confirm your subscription", "One click to confirm:", form)


@router.post(
    "/v1/lists/confirm",
    openapi_extra=json_or_form_body(ConfirmIn),  # the route reads its body itself: documented for clients
)
async def confirm(request: Request) -> Response:
    """Confirm a double opt-in membership: JSON ``{token}`` or the page's form. Idempotent."""
    human = request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/x-www-form-urlencoded"
    if human:
        token = str((await request.form()).get("token") or "")
    else:
        try:
            token = ConfirmIn.model_validate_json(await request.body()).token
        except ValueError:
            raise Problem(422, 'send a JSON body {"token": "..."}') from None
    account_id, list_id, subscriber_id = _payload(request, token)  # a forged token: 400, database or not
    async with connection(request) as conn:
        result = await confirm_membership(conn, account_id, list_id, subscriber_id)
    if result is None:
        raise Problem(400, "this confirmation link is not valid", kind="token-invalid", title="Invalid link")
    changed, list_name, status = result
    if status == "unsubscribed":
        raise Problem(409, f"you left {list_name}; this old link does not subscribe you again", kind="unsubscribed")
    if human:
        return _page("Subscription confirmed", f"You are subscribed to {list_name}.")
    return JSONResponse({"list_id": list_id, "status": status, "already_confirmed": not changed})
