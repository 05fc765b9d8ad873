"""The state names of every state machine, in one place.

The database enums are created from these names (migration 0001), and a test checks that the two agree.
"""

from __future__ import annotations

from enum import StrEnum


class CampaignStatus(StrEnum):
    DRAFT = "draft"
    APPROVED = "approved"
    SENDING = "sending"
    PAUSED = "paused"
    SENT = "sent"
    CANCELLED = "cancelled"


class DeliveryStatus(StrEnum):
    """One row of the outbox. ``queued`` and ``sending`` are open; the other three are final."""

    QUEUED = "queued"
    SENDING = "sending"
    SENT = "sent"
    SUPPRESSED = "suppressed"
    FAILED = "failed"


class SubscriberStatus(StrEnum):
    PENDING = "pending"
    CONFIRMED = "confirmed"
    UNSUBSCRIBED = "unsubscribed"
    BOUNCED = "bounced"


class SuppressionReason(StrEnum):
    MANUAL = "manual"
    BOUNCE = "bounce"
    COMPLAINT = "complaint"
    UNSUBSCRIBE = "unsubscribe"


# The transitions an operator can ask for, as (allowed sources, target). Each one is a single
# compare-and-set UPDATE in the store; this table is what the API reports when a CAS loses.
CAMPAIGN_TRANSITIONS: dict[str, tuple[frozenset[CampaignStatus], CampaignStatus]] = {
    "approve": (frozenset({CampaignStatus.DRAFT}), CampaignStatus.APPROVED),
    "pause": (frozenset({CampaignStatus.APPROVED, CampaignStatus.SENDING}), CampaignStatus.PAUSED),
    # resume goes back to ``approved`` when the campaign never started, else to ``sending``.
    "resume": (frozenset({CampaignStatus.PAUSED}), CampaignStatus.SENDING),
    "cancel": (
        frozenset({CampaignStatus.DRAFT, CampaignStatus.APPROVED, CampaignStatus.SENDING, CampaignStatus.PAUSED}),
        CampaignStatus.CANCELLED,
    ),
}
