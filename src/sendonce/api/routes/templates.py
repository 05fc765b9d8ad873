"""Stored templates and their preview."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StringConstraints

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import BIGINT_MAX, Name
from sendonce.api.problems import Problem
from sendonce.delivery.compose import campaign_context, compile_campaign
from sendonce.delivery.render import TemplateError, html_to_text
from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.store import templates as store

router = APIRouter(tags=["templates"])

TemplateId = Annotated[int, Path(ge=1, le=BIGINT_MAX)]


class TemplateIn(BaseModel):
    name: Name
    subject: Annotated[str, StringConstraints(min_length=1, max_length=998)]
    text: Annotated[str, StringConstraints(min_length=1, max_length=1_000_000)] | None = None
    html: Annotated[str, StringConstraints(min_length=1, max_length=2_000_000)] | None = None


class PreviewIn(BaseModel):
    subscriber_id: Annotated[int, Field(ge=1, le=BIGINT_MAX)] | None = None
    email: Annotated[str, StringConstraints(max_length=320)] | None = None
    name: Annotated[str, StringConstraints(max_length=200)] | None = None
    attributes: dict[str, Any] | None = None


def check_content(subject: str, text: str | None, html: str | None) -> tuple[str, str | None]:
    """Validate template content; returns (text, html) with a text part generated when missing."""
    if text is None and html is None:
        raise Problem(422, "give text, html, or both")
    for field, value in (("subject", subject), ("text", text), ("html", html)):
        if value is not None and "\x00" in value:
            raise Problem(422, f"{field} must not contain NUL characters")
    body_text = text if text is not None else html_to_text(html or "")
    try:
        compile_campaign(subject=subject, text=body_text, html=html)
    except TemplateError as exc:
        raise Problem(422, str(exc)) from None
    return body_text, html


def _out(template_id: int, body: TemplateIn, row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": template_id,
        "name": body.name,
        "subject": body.subject,
        "text": body.text,
        "html": body.html,
        "created_at": row["created_at"].isoformat(),
        "updated_at": row["updated_at"].isoformat(),
    }


@router.post("/v1/templates", status_code=201)
async def create(body: TemplateIn, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """Store a template (sandboxed Jinja2: ``email``, ``name``, ``attributes``, ``subscriber``, ``campaign``,
    ``unsubscribe_url``). A missing text part is generated from the HTML when mail is sent."""
    await asyncio.to_thread(check_content, body.subject, body.text, body.html)  # off the loop: user code

    async def run() -> Response:
        row = await store.create_template(
            conn, account.account_id, name=body.name, subject=body.subject, text_body=body.text, html_body=body.html
        )
        return JSONResponse(_out(int(row["template_id"]), body, row), status_code=201)

    return await idempotent(request, conn, account.account_id, run)


@router.get("/v1/templates/{template_id}")
async def read(template_id: TemplateId, account: CurrentAccount, conn: Db) -> dict[str, Any]:
    row = await store.get_template(conn, account.account_id, template_id)
    if row is None:
        raise Problem(404, f"no template {template_id} in this account")
    return {
        "id": row["template_id"],
        "name": row["name"],
        "subject": row["subject"],
        "text": row["text_body"],
        "html": row["html_body"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
    }


@router.put("/v1/templates/{template_id}")
async def replace(template_id: TemplateId, body: TemplateIn, account: CurrentAccount, conn: Db) -> dict[str, Any]:
    """Replace a template. Campaigns already created from it keep the content they copied."""
    await asyncio.to_thread(check_content, body.subject, body.text, body.html)  # off the loop: user code
    row = await store.update_template(
        conn,
        account.account_id,
        template_id,
        name=body.name,
        subject=body.subject,
        text_body=body.text,
        html_body=body.html,
    )
    if row is None:
        raise Problem(404, f"no template {template_id} in this account")
    return _out(template_id, body, row)


@router.post("/v1/templates/{template_id}/preview")
async def preview(template_id: TemplateId, body: PreviewIn, account: CurrentAccount, conn: Db) -> dict[str, Any]:
    """Render a template for one subscriber (by id or address), or for the data given."""
    row = await store.get_template(conn, account.account_id, template_id)
    if row is None:
        raise Problem(404, f"no template {template_id} in this account")
    subscriber: dict[str, Any] | None = None
    if body.subscriber_id is not None or body.email is not None:
        key = None
        if body.email is not None:
            try:
                key = parse_address(body.email).key
            except InvalidAddress as exc:
                raise Problem(422, str(exc)) from None
        subscriber = await store.get_subscriber(
            conn, account.account_id, subscriber_id=body.subscriber_id, email_key=key
        )
        if subscriber is None and body.subscriber_id is not None:
            raise Problem(404, f"no subscriber {body.subscriber_id} in this account")
    email = subscriber["email"] if subscriber else (body.email or "someone@example.com")
    context = campaign_context(
        email=email,
        name=subscriber["name"] if subscriber else body.name,
        attributes={**((subscriber or {}).get("attributes") or {}), **(body.attributes or {})},
        subscriber_id=subscriber["subscriber_id"] if subscriber else None,
        campaign_id=None,
        campaign_name="(preview)",
        unsubscribe_url="https://example.com/u/preview",
    )

    def render() -> dict[str, Any]:  # off the event loop: a template is an account's code
        # the text part made from the HTML too (seconds for the largest HTML the API takes)
        text = row["text_body"] if row["text_body"] is not None else html_to_text(row["html_body"])
        subject, text_t, html_t = compile_campaign(subject=row["subject"], text=text, html=row["html_body"])
        return {
            "subject": subject.render(context),
            "text": text_t.render(context),
            "html": html_t.render(context) if html_t is not None else None,
        }

    try:
        return await asyncio.to_thread(render)
    except TemplateError as exc:
        raise Problem(422, f"the template cannot be rendered for {email}: {exc}") from None
