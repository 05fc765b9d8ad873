"""Signup verification: request (idempotent, windowed, rate-limited) and verify (signed link)."""

from __future__ import annotations

from html import escape
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from sendonce.api.deps import CurrentAccount, Db, connection
from sendonce.api.idempotency import idempotent
from sendonce.api.models import json_or_form_body
from sendonce.api.problems import Problem
from sendonce.api.services import services_of
from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.domain.keys import ExpiredToken, InvalidToken
from sendonce.store.signups import (
    VERIFY_PURPOSE,
    AddressSuppressed,
    RateLimited,
    UnknownSignup,
    VerifyOutcome,
    answer_outdated,
    request_signup,
    verified_already,
    verify_signup,
)

router = APIRouter(tags=["signups"])

# What clients send as origin, normalized to the three we keep.
ORIGIN_ALIASES = {
    "web": "web", "website": "web", "browser": "web", "www": "web",
    "app": "app", "mobile": "app", "ios": "app", "android": "app",
    "api": "api", "server": "api", "backend": "api",
}  # fmt: skip


class SignupIn(BaseModel):
    email: Annotated[str, StringConstraints(max_length=320)]
    origin: Annotated[str, StringConstraints(max_length=50)]
    name: Annotated[str, StringConstraints(strip_whitespace=True, max_length=200)] | None = None
    locale: (
        Annotated[
            str,
            StringConstraints(strip_whitespace=True, max_length=35, pattern=r"^[A-Za-z]{2,8}([-_][A-Za-z0-9]{1,8})*$"),
        ]
        | None
    ) = None
    redirect_url: Annotated[str, StringConstraints(max_length=2000, pattern=r"^https?://[^\s]+$")] | None = None


class SignupOut(BaseModel):
    signup_id: int
    status: str
    verification: str


class VerifyIn(BaseModel):
    token: Annotated[str, StringConstraints(min_length=1, max_length=4000)]


def _disposable(domain: str) -> bool:
    from disposable_email_domains import blocklist

    parts = domain.split(".")
    return any(".".join(parts[i:]) in blocklist for i in range(len(parts) - 1))


@router.post(
    "/v1/signups",
    status_code=201,
    response_model=SignupOut,
    responses={200: {"model": SignupOut, "description": "a repeat within the window: the same body, no new mail"}},
)
async def create_signup(body: SignupIn, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """Ask for a verification mail. 201: queued. 200: a repeat within the window, nothing queued."""
    services = services_of(request)
    client = services.client_address(request)
    origin = ORIGIN_ALIASES.get(body.origin.strip().lower())
    if origin is None:
        raise Problem(422, f"origin must be one of web, app, api (got {body.origin!r})")
    try:
        address = parse_address(body.email)
    except InvalidAddress as exc:
        raise Problem(422, str(exc)) from None
    if services.settings.block_disposable and _disposable(address.ascii_domain):
        services.metrics.signups.labels("rejected").inc()
        raise Problem(
            422,
            f"addresses at {address.ascii_domain} (a disposable-address service) are not accepted",
            kind="disposable-address",
            title="Disposable address",
        )
    for field, value in (("name", body.name), ("locale", body.locale), ("redirect_url", body.redirect_url)):
        if value is not None and "\x00" in value:
            raise Problem(422, f"{field} must not contain NUL characters")

    async def run() -> Response:
        try:
            outcome = await request_signup(
                conn,
                account=account,
                address=address,
                origin=origin,
                name=body.name or None,
                locale=body.locale,
                redirect_url=body.redirect_url,
                keys=services.keys,
                # never longer than the link its mail carries: a repeat inside the window queues
                # nothing, so a window that outlived its link would leave the person no way to verify
                window=min(account.signup_window or services.settings.signup_window, services.settings.verify_ttl),
                limits=services.limits,
                verify_url=services.verify_url,
            )
        except AddressSuppressed:
            services.metrics.signups.labels("rejected").inc()
            raise Problem(
                422,
                "this address cannot receive mail from this account (it is suppressed: it bounced, complained "
                "or was blocked); no mail was queued",
                kind="address-suppressed",
                title="Address suppressed",
            ) from None
        except RateLimited as exc:
            services.metrics.signups.labels("rate_limited").inc()
            raise Problem(
                429, f"{exc}; nothing was queued", headers={"Retry-After": str(max(1, round(exc.retry_after)))}
            ) from None
        services.metrics.signups.labels("new" if outcome.new else "repeat").inc()
        if not outcome.new:
            services.metrics.repeat(account.account_id, client, "window")
        return JSONResponse(outcome.body, status_code=201 if outcome.new else 200)

    def replayed() -> None:
        services.metrics.signups.labels("repeat").inc()
        services.metrics.repeat(account.account_id, client, "idempotency_key")

    async def still_holds(answer: bytes) -> bool:
        # a stored "queued" whose mail then certainly failed is not replayed: the retry queues another,
        # as one without the key would, instead of being told "queued" for a mail that is dead
        return not await answer_outdated(conn, account.account_id, answer)

    response = await idempotent(request, conn, account.account_id, run, on_replay=replayed, still_holds=still_holds)
    services.faults.hit("api_after_commit")
    if services.detector is not None:
        flags = services.detector.observe_signup(account.account_id, address.key, client)
        if response.status_code == 200 or response.headers.get("Idempotent-Replayed"):
            flags += services.detector.observe_repeat(account.account_id, client)
        if flags:
            await services.record_flags(conn, flags)
    return response


def _verify_payload(request: Request, token: str) -> dict[str, object]:
    services = services_of(request)
    try:
        return services.keys.verify(VERIFY_PURPOSE, token, max_age=services.settings.verify_ttl.total_seconds())
    except ExpiredToken:
        raise Problem(
            400, "this verification link has expired; ask for a new one", kind="token-expired", title="Expired link"
        ) from None
    except InvalidToken:
        raise Problem(400, "this verification link is not valid", kind="token-invalid", title="Invalid link") from None


@router.post(
    "/v1/signups/verify",
    # the route reads its body itself: documented for clients; the form (the page's button) is
    # answered with a page, its errors too
    openapi_extra={
        **json_or_form_body(VerifyIn),
        "responses": {"200": {"content": {"text/html": {"schema": {"type": "string"}}}}},
    },
)
async def verify(request: Request) -> Response:
    """Verify a signup with the token of its link: JSON ``{token}``, or the form of the GET page.

    Idempotent: verifying twice answers 200 again, even once the link has expired. A forged token is
    a 400; so is an expired one whose signup is not verified.
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    human = content_type == "application/x-www-form-urlencoded"
    if not human:
        return await _verify(request, human=False)
    try:
        return await _verify(request, human=True)
    except Problem as exc:
        # Someone pressed the page's button: a page, not a problem document, says what went wrong
        return HTMLResponse(_page(exc.title, exc.detail), status_code=exc.status, headers=exc.headers)
    except StarletteHTTPException as exc:  # a form that cannot be read
        return HTMLResponse(_page("Request not valid", str(exc.detail)), status_code=exc.status_code)


async def _verify(request: Request, *, human: bool) -> Response:
    if human:
        form = await request.form()
        token = str(form.get("token") or "")
    else:
        try:
            token = VerifyIn.model_validate_json(await request.body()).token
        except ValueError:
            raise Problem(422, 'send a JSON body {"token": "..."}') from None
    try:
        payload = _verify_payload(request, token)  # before a connection: a forged token is a 400, database or not
    except Problem as exc:
        if exc.kind != "token-expired":
            raise
        # genuine, only old: someone verified already who clicks it again is told so, as on any repeat
        already = await _verified_already(request, token)
        if already is None:
            raise
        outcome = already
    else:
        try:
            async with connection(request) as conn:
                outcome = await verify_signup(conn, payload)
        except UnknownSignup:
            raise Problem(
                400, "this verification link is not valid", kind="token-invalid", title="Invalid link"
            ) from None
    if human:
        if outcome.redirect_url:
            return RedirectResponse(outcome.redirect_url, status_code=303)
        return HTMLResponse(_page("Address confirmed", "Thank you: your email address is confirmed."))
    return JSONResponse({"signup_id": outcome.signup_id, "status": "verified", "already_verified": outcome.already})


@router.get("/v1/signups/verify", response_class=HTMLResponse)
async def verify_page(request: Request, token: Annotated[str, Query(max_length=4000)] = "") -> HTMLResponse:
    """The page the link opens. It asks for a click (a POST), so mail scanners that fetch links
    do not verify anyone by themselves."""
    try:
        _verify_payload(request, token)
    except Problem as exc:
        # genuine, only old: someone verified already is told so
        if exc.kind == "token-expired" and await _verified_already(request, token) is not None:
            return HTMLResponse(_page("Address confirmed", "Your email address is already confirmed."))
        return HTMLResponse(_page("Link not valid", exc.detail), status_code=400)
    form = (
        '<form method="post" action="verify">'
        f'<input type="hidden" name="token" value="{escape(token, quote=True)}">'
        '<button type="submit">Confirm my email address</button></form>'
    )
    return HTMLResponse(_page("Confirm your email address", "One click to confirm:", form))


async def _verified_already(request: Request, token: str) -> VerifyOutcome | None:
    """For a genuine link that has only expired: its signup, if verified already (else None)."""
    try:
        payload = services_of(request).keys.verify(VERIFY_PURPOSE, token)  # no age limit: it was genuine
    except InvalidToken:
        return None
    async with connection(request) as conn:
        return await verified_already(conn, payload)


def _page(title: str, message: str, extra: str = "") -> str:
    return (
        '<!doctype html><html><head><meta charset="utf-8"><meta name="viewport" '
        'content="width=device-width"><meta name="robots" content="noindex">'
        f'<title>{escape(title)}</title></head><body style="font-family:sans-serif;max-width:32em;margin:3em auto">'
        f"<h1>{escape(title)}</h1><p>{escape(message)}</p>{extra}</body></html>"
    )
