"""Campaigns: create, approve, pause, resume, cancel, read counts, read the duplicate ledger."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import BIGINT_MAX, ApproveIn, CampaignIn, CampaignOut, Counts
from sendonce.api.problems import Problem
from sendonce.api.routes.templates import check_content
from sendonce.delivery.compose import campaign_context, compile_campaign
from sendonce.delivery.render import TemplateError, attribute_keys
from sendonce.domain.states import CAMPAIGN_TRANSITIONS, CampaignStatus
from sendonce.store import campaigns as store
from sendonce.store import lists as list_store
from sendonce.store import templates as template_store

router = APIRouter(tags=["campaigns"])

CampaignId = Annotated[int, Path(ge=1, le=BIGINT_MAX)]


@router.post("/v1/campaigns", status_code=201, response_model=CampaignOut)
async def create_campaign(body: CampaignIn, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """Create a draft: inline ``subject``/``text``/``html``, or ``template_id`` (its content is copied;
    fields given here override it). A missing text part is generated from the HTML."""
    subject, text, html = body.subject, body.text, body.html
    if body.template_id is not None:
        template = await template_store.get_template(conn, account.account_id, body.template_id)
        if template is None:
            raise Problem(422, f"unknown template id: {body.template_id}")
        subject = subject or template["subject"]
        if text is None and html is None:
            text, html = template["text_body"], template["html_body"]
    if subject is None:
        raise Problem(422, "subject is required (or a template_id)")
    if "\x00" in body.name:
        raise Problem(422, "name must not contain NUL characters")
    body_text, body_html = await asyncio.to_thread(check_content, subject, text, html)  # off the loop: user code
    unknown = sorted(set(body.lists) - await list_store.existing_lists(conn, account.account_id, body.lists))
    if unknown:
        raise Problem(
            422,
            f"unknown list id(s): {unknown}",
            errors=[{"field": "lists", "message": f"unknown: {unknown}"}],
        )

    async def run() -> Response:
        campaign_id = await store.create_campaign(
            conn,
            account_id=account.account_id,
            name=body.name,
            subject=subject,
            text_body=body_text,
            html_body=body_html,
            from_email=account.from_email,
            from_name=account.from_name,
            list_ids=body.lists,
            template_id=body.template_id,
            max_bounce_rate=body.max_bounce_rate,
            max_complaint_rate=body.max_complaint_rate,
        )
        out = CampaignOut(id=campaign_id, name=body.name, status=CampaignStatus.DRAFT, lists=sorted(set(body.lists)))
        return JSONResponse(out.model_dump(mode="json"), status_code=201)

    return await idempotent(request, conn, account.account_id, run)


@router.get("/v1/campaigns/{campaign_id}", response_model=CampaignOut)
async def get_campaign(campaign_id: CampaignId, account: CurrentAccount, conn: Db) -> CampaignOut:
    campaign = await store.get_campaign(conn, account.account_id, campaign_id)
    if campaign is None:
        raise Problem(404, f"no campaign {campaign_id} in this account")
    counts = await store.campaign_counts(conn, account.account_id, campaign_id)
    return CampaignOut(
        id=campaign.campaign_id,
        name=campaign.name,
        status=campaign.status,
        scheduled_for=campaign.scheduled_for,
        lists=campaign.list_ids,
        counts=Counts(**dataclasses.asdict(counts)),
        paused_reason=campaign.paused_reason if campaign.status is CampaignStatus.PAUSED else None,
    )


async def _transition(
    request: Request, conn: Db, account_id: int, campaign_id: int, action: str, body: ApproveIn | None = None
) -> Response:
    async def run() -> Response:
        out = await _cas(conn, account_id, campaign_id, action, body)
        return JSONResponse(out.model_dump(mode="json"))

    return await idempotent(request, conn, account_id, run)


async def _check_recipients_can_be_rendered(conn: Db, account_id: int, campaign_id: int) -> None:
    """A template variable missing for some recipients is an error now, not a blank in a sent mail."""
    campaign = await store.get_campaign(conn, account_id, campaign_id)
    if campaign is None or campaign.status.value != "draft":
        return  # the CAS reports it
    # parsed off the event loop, as everything of a template (a large one takes a tenth of a second)
    keys = sorted(await asyncio.to_thread(attribute_keys, campaign.subject, campaign.text_body, campaign.html_body))
    # Recipients lacking an attribute the templates read, and a few others: rendering for them now
    # finds a missing variable or a template that cannot finish before anything is sent.
    lacking = await store.recipients_missing_attributes(conn, account_id, campaign_id, keys) if keys else []
    sample = await store.recipients_missing_attributes(conn, account_id, campaign_id, [], limit=3)

    def render_all() -> list[tuple[str, str]]:
        """Run off the event loop: a template is an account's code, each render up to its limits."""
        subject, text, html = compile_campaign(
            subject=campaign.subject, text=campaign.text_body, html=campaign.html_body
        )
        failures: list[tuple[str, str]] = []
        for row in [*lacking[:50], *sample]:
            context = campaign_context(
                email=row["email"],
                name=row["name"],
                attributes=row["attributes"],
                subscriber_id=row["subscriber_id"],
                campaign_id=campaign_id,
                campaign_name=campaign.name,
                unsubscribe_url="https://example.com/u/check",
            )
            try:
                for template in (subject, text, html):
                    if template is not None:
                        template.render(context)
            except TemplateError as exc:
                failures.append((row["email"], str(exc)))
        return failures

    failures = await asyncio.to_thread(render_all)
    if failures:
        if not lacking:
            raise Problem(
                422,
                f"the templates cannot be rendered (e.g. for {failures[0][0]}): {failures[0][1]}",
                kind="template-error",
                title="Template error",
            )
        count = f"{len(lacking)}{'+' if len(lacking) >= 1000 else ''}"
        examples = ", ".join(email for email, _ in failures[:3])
        raise Problem(
            422,
            f"the templates cannot be rendered for {count} recipient(s) lacking attribute(s) {', '.join(keys)} "
            f"(e.g. {examples}): {failures[0][1]}. Add the attribute to them, or guard it in the template "
            "(e.g. {% if attributes.x is defined %} or {{ attributes.x | default('') }})",
            kind="template-variable-missing",
            title="Template variable missing",
        )


async def _cas(conn: Db, account_id: int, campaign_id: int, action: str, body: ApproveIn | None) -> CampaignOut:
    if action == "approve":
        await _check_recipients_can_be_rendered(conn, account_id, campaign_id)
    scheduled_for = None
    if body is not None and body.scheduled_for is not None:
        scheduled_for = body.scheduled_for
        if scheduled_for.tzinfo is None:
            scheduled_for = scheduled_for.replace(tzinfo=UTC)
        try:
            # Stored and read back in UTC: a time at either end of the calendar may not exist there.
            scheduled_for = scheduled_for.astimezone(UTC)
        except OverflowError:
            raise Problem(422, "scheduled_for must fall within the years 1 to 9999 in UTC") from None
    result = await store.transition(conn, account_id, campaign_id, action, scheduled_for=scheduled_for)
    if result.won:
        assert result.status is not None
        campaign = await store.get_campaign(conn, account_id, campaign_id)
        assert campaign is not None
        return CampaignOut(
            id=campaign_id,
            name=campaign.name,
            # what this transition made it, from its UPDATE's RETURNING: read again, a concurrent
            # transition committed in between showed here (a won pause answered "sending", and an
            # Idempotency-Key kept that answer)
            status=result.status,
            scheduled_for=result.scheduled_for,
            lists=campaign.list_ids,
        )
    if result.status is None:
        raise Problem(404, f"no campaign {campaign_id} in this account")
    allowed = CAMPAIGN_TRANSITIONS[action][0]
    sources = ", ".join(sorted(s.value for s in allowed))
    # Read after the lost compare-and-set: a transition committed in between may have made it one the
    # action is allowed from; the answer says so rather than contradict itself.
    why = "it changed concurrently and is now" if result.status in allowed else "it is"
    raise Problem(
        409,
        f"cannot {action} campaign {campaign_id}: {why} {result.status.value} (allowed from: {sources})",
        kind="invalid-transition",
        title="Invalid state transition",
        current_status=result.status.value,
    )


@router.post("/v1/campaigns/{campaign_id}/approve", response_model=CampaignOut)
async def approve(
    campaign_id: CampaignId,
    account: CurrentAccount,
    conn: Db,
    request: Request,
    body: Annotated[ApproveIn | None, Body()] = None,
) -> Response:
    """CAS draft -> approved, to start at ``scheduled_for`` (default: now). Twice: 409."""
    return await _transition(request, conn, account.account_id, campaign_id, "approve", body)


@router.post("/v1/campaigns/{campaign_id}/pause", response_model=CampaignOut)
async def pause(campaign_id: CampaignId, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """CAS approved|sending -> paused: workers stop claiming its rows and give back what they hold."""
    return await _transition(request, conn, account.account_id, campaign_id, "pause")


@router.post("/v1/campaigns/{campaign_id}/resume", response_model=CampaignOut)
async def resume(campaign_id: CampaignId, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """CAS paused -> sending (or -> approved if it had not started)."""
    return await _transition(request, conn, account.account_id, campaign_id, "resume")


@router.post("/v1/campaigns/{campaign_id}/cancel", response_model=CampaignOut)
async def cancel(campaign_id: CampaignId, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """CAS -> cancelled: its queued rows are never sent."""
    return await _transition(request, conn, account.account_id, campaign_id, "cancel")


@router.get("/v1/campaigns/{campaign_id}/duplicates")
async def possible_duplicates(
    campaign_id: CampaignId,
    account: CurrentAccount,
    conn: Db,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """The possible-duplicate ledger of a campaign: re-sends of attempts that may have arrived."""
    if await store.get_campaign(conn, account.account_id, campaign_id) is None:
        raise Problem(404, f"no campaign {campaign_id} in this account")
    rows = await store.list_possible_duplicates(conn, account.account_id, campaign_id, limit)
    return {"campaign_id": campaign_id, "entries": rows}
