"""One-click unsubscribe (RFC 8058) and the human page behind List-Unsubscribe (RFC 2369).

``POST /u/{token}`` is what mailbox providers call when someone presses "unsubscribe": no cookies,
no authentication, no redirect, idempotent, and the change is committed before the answer. The token
is signed (HMAC under the server secret) and names the account, the subscriber and the campaign, so
a forged one is refused without touching the database (a 400 even while it is down). It never
expires, so it undoes an unsubscribe ("resubscribe") at once only within a day of it; after that it
sends the address a confirmation mail: an old or forwarded mail subscribes no one by itself.
"""

from __future__ import annotations

from html import escape
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse

from sendonce.api.deps import connection
from sendonce.api.problems import Problem
from sendonce.api.routes.subscribers import confirm_url_maker
from sendonce.api.services import services_of
from sendonce.delivery.compose import UNSUBSCRIBE_PURPOSE
from sendonce.domain.keys import InvalidToken
from sendonce.store import unsubscribes
from sendonce.store.database import Conn

router = APIRouter(tags=["unsubscribe"])

Token = Annotated[str, Path(min_length=10, max_length=500)]


def _identity(request: Request, token: str) -> tuple[int, int, int]:
    try:
        payload = services_of(request).keys.verify_stable(UNSUBSCRIBE_PURPOSE, token)
        return int(payload["a"]), int(payload["s"]), int(payload["c"])
    except (InvalidToken, KeyError, TypeError, ValueError):
        raise Problem(400, "this unsubscribe link is not valid", kind="token-invalid", title="Invalid link") from None


def _page(title: str, message: str, form: str = "") -> HTMLResponse:
    html = (
        '<!doctype html><html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">'
        f'<meta name="robots" content="noindex"><title>{escape(title)}</title></head>'
        f'<body style="font-family:sans-serif;max-width:32em;margin:3em auto"><h1>{escape(title)}</h1>'
        f"<p>{escape(message)}</p>{form}</body></html>"
    )
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


def _form(action: str, label: str) -> str:
    # Actions are relative to the page (/u/{token}), so the forms work behind a path prefix in
    # SENDONCE_PUBLIC_URL (a proxy serving the API at https://example.com/mail/).
    return (
        f'<form method="post" action="{escape(action, quote=True)}">'
        f'<button type="submit">{escape(label)}</button></form>'
    )


async def _lists(conn: Conn, ids: tuple[int, int, int]) -> list[dict[str, Any]]:
    rows = await unsubscribes.state(conn, ids[0], ids[1], ids[2])
    if not rows:
        raise Problem(404, "this unsubscribe link refers to nothing that exists any more")
    return rows


@router.post("/u/{token}", response_class=HTMLResponse)
async def one_click(token: Token, request: Request) -> HTMLResponse:
    """Unsubscribe now (the RFC 8058 one-click POST, or the button of the page)."""
    ids = _identity(request, token)
    async with connection(request) as conn, conn.transaction():
        rows = await _lists(conn, ids)
        await unsubscribes.unsubscribe(conn, *ids)
    names = ", ".join(r["list_name"] for r in rows)
    return _page(
        "You are unsubscribed",
        f"You will not receive {names} from {rows[0]['account_name']} any more.",
        _form(f"{token}/resubscribe", "I unsubscribed by mistake: resubscribe me"),
    )


@router.get("/u/{token}", response_class=HTMLResponse)
async def page(token: Token, request: Request) -> HTMLResponse:
    """The page a person reaches from the link in the mail: it asks before it changes anything,
    so link scanners that fetch every URL unsubscribe nobody."""
    try:
        ids = _identity(request, token)
    except Problem as exc:
        response = _page("Link not valid", exc.detail)
        response.status_code = 400
        return response
    async with connection(request) as conn:
        rows = await _lists(conn, ids)
    names = ", ".join(r["list_name"] for r in rows)
    if all(r["status"] in (None, "unsubscribed") for r in rows):
        if any(r["undoable"] for r in rows):
            form = _form(f"{token}/resubscribe", "Resubscribe me")
        elif any(r["status"] == "unsubscribed" for r in rows):
            form = _form(f"{token}/resubscribe", "Send me a mail to subscribe again")
        else:
            form = ""
        return _page("You are unsubscribed", f"You do not receive {names} from {rows[0]['account_name']}.", form)
    return _page(
        "Unsubscribe?",
        f"Stop receiving {names} from {rows[0]['account_name']}?",
        _form(token, "Unsubscribe"),
    )


@router.post("/u/{token}/resubscribe", response_class=HTMLResponse)
async def resubscribe(token: Token, request: Request) -> HTMLResponse:
    """Undo an unsubscribe of the last day; an older one is undone by a confirmation mail to the
    address, which only its owner can use (the link is in every forwarded copy of the mail)."""
    account_id, subscriber_id, campaign_id = ids = _identity(request, token)
    async with connection(request) as conn, conn.transaction():
        rows = await _lists(conn, ids)
        joined = set(await unsubscribes.resubscribe(conn, *ids))
        asked = set(
            await unsubscribes.rejoin(
                conn, account_id, subscriber_id, campaign_id, confirm_url_maker(request, account_id)
            )
        )
    account = rows[0]["account_name"]
    if joined:
        names = ", ".join(r["list_name"] for r in rows if r["list_id"] in joined)
        return _page("Welcome back", f"You are back on {names} of {account}.")
    if asked:
        names = ", ".join(r["list_name"] for r in rows if r["list_id"] in asked)
        return _page(
            "Check your inbox",
            f"We sent a mail to confirm that you want {names} from {account} again: "
            "you are back once you press its button.",
        )
    if all(r["status"] == "confirmed" for r in rows):
        return _page("Welcome back", f"You receive {', '.join(r['list_name'] for r in rows)} from {account}.")
    return _page("Check your inbox", f"A mail to confirm your subscription to {account} is on its way or was sent.")
