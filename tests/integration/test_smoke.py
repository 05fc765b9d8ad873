from __future__ import annotations

from sendonce.delivery.worker import WorkerConfig
from sendonce.testing.inbox import Inbox
from sendonce.transports.registry import transport_from_url
from tests.helpers import campaign_setup, campaign_status, emails, run_to_drain


async def test_campaign_reaches_every_address_once(database_url: str, inbox: Inbox) -> None:
    addresses = emails(50)
    setup = await campaign_setup(database_url, addresses)
    stats = await run_to_drain(
        database_url, transport_from_url(inbox.url), WorkerConfig(tick=0.2, lease=5, drain=True)
    )
    assert stats.sent == 50
    assert inbox.by_recipient() == dict.fromkeys(addresses, 1)
    status, counts = await campaign_status(database_url, setup.account_id, setup.campaign_id)
    assert status == "sent"
    assert counts.sent == counts.total == 50
