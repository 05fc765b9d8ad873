"""Request and response bodies. Limits are explicit so bad input fails validation, not the database."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from sendonce.domain.states import CampaignStatus, SubscriberStatus, SuppressionReason

BIGINT_MAX = 2**63 - 1

Id = Annotated[int, Field(ge=1, le=BIGINT_MAX)]
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
EmailText = Annotated[str, StringConstraints(max_length=320)]


def json_or_form_body(model: type[BaseModel]) -> dict[str, object]:
    """``openapi_extra`` for a route that reads its body itself, as JSON or as a page's form."""
    schema = {"schema": model.model_json_schema()}
    media_types = ("application/json", "application/x-www-form-urlencoded")
    return {"requestBody": {"content": dict.fromkeys(media_types, schema), "required": True}}


class AccountIn(BaseModel):
    name: Name
    from_email: EmailText
    from_name: Annotated[str, StringConstraints(max_length=200)] | None = None


class AccountOut(BaseModel):
    id: int
    name: str
    from_email: str
    api_key: str = Field(description="Shown once: only its hash is stored.")


class ListIn(BaseModel):
    name: Name
    opt_in: Literal["single", "double"] = "single"


class ListOut(BaseModel):
    id: int
    name: str
    opt_in: str = "single"


class SubscriberIn(BaseModel):
    # Each row is validated by the route, so one bad row does not reject the others.
    model_config = ConfigDict(extra="ignore")
    email: object = None
    name: object = None
    status: object = None
    lists: object = None
    attributes: object = None


class SubscribersIn(BaseModel):
    subscribers: Annotated[list[SubscriberIn], Field(min_length=1, max_length=10_000)]
    preconfirm: bool = Field(
        default=False,
        description="the people consented elsewhere: double opt-in memberships start confirmed, no confirmation mail",
    )
    resubscribe: bool = Field(
        default=False,
        description="a status confirmed or pending is applied to subscribers who unsubscribed or bounced too "
        "(they gave their consent again); without it such a status is not applied and the row says so",
    )


class SubscriberResult(BaseModel):
    index: int
    email: str | None
    result: str = Field(description="created, updated or error")
    id: int | None = None
    error: str | None = None
    note: str | None = None
    """Set when the row was written differently from what it asked (a status an opt-out keeps)."""


class SubscribersOut(BaseModel):
    created: int
    updated: int
    errors: int
    results: list[SubscriberResult]


class CampaignIn(BaseModel):
    name: Name
    subject: Annotated[str, StringConstraints(min_length=1, max_length=998)] | None = None
    text: Annotated[str, StringConstraints(min_length=1, max_length=1_000_000)] | None = None
    html: Annotated[str, StringConstraints(max_length=2_000_000)] | None = None
    template_id: Id | None = Field(default=None, description="copy subject, text and html from a stored template")
    lists: Annotated[list[Id], Field(min_length=1, max_length=100)]
    max_bounce_rate: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="pause the campaign when its hard-bounce rate passes this (default: the server's)"
    )
    max_complaint_rate: Annotated[float, Field(ge=0, le=1)] | None = None


class ApproveIn(BaseModel):
    # a misspelled field (scheduled_at) was dropped, and the campaign approved to send at once
    model_config = ConfigDict(extra="forbid")

    scheduled_for: datetime | None = None


class Counts(BaseModel):
    total: int
    queued: int
    sending: int
    sent: int
    suppressed: int
    failed: int
    possible_duplicate: int
    possibly_delivered: int = Field(
        default=0,
        description="among suppressed and failed: rows an earlier attempt of which may have reached the recipient "
        "(its worker died after the transport took it, then the address opted out or retries ran out)",
    )


class CampaignOut(BaseModel):
    id: int
    name: str
    status: CampaignStatus
    scheduled_for: datetime | None = None
    lists: list[int] = []
    counts: Counts | None = None
    paused_reason: str | None = None
    """Why sendonce paused it (a bounce or complaint rate over its limit); None when paused by hand."""


class SuppressionIn(BaseModel):
    email: EmailText
    reason: SuppressionReason = SuppressionReason.MANUAL


class SuppressionOut(BaseModel):
    email: str
    email_key: str
    reason: SuppressionReason
    created: bool


SUBSCRIBER_STATUSES = {s.value for s in SubscriberStatus}
