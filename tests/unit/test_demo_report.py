"""The demo's verdict on made-up inboxes: it says "exactly once" only when the inbox shows it."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from sendonce.demo import _report, plan_subscribers
from sendonce.domain.addresses import parse_address
from sendonce.store.campaigns import CampaignCounts

PLAN = plan_subscribers(10)
PEOPLE = sorted({parse_address(a).key: a for a in PLAN.list_a + PLAN.list_b}.values())
COUNTS = CampaignCounts(total=10, queued=0, sending=0, sent=10, suppressed=0, failed=0, possible_duplicate=0)


def message(address: str, job: str) -> SimpleNamespace:
    return SimpleNamespace(rcpt_to=(address,), job_id=job)


def everyone() -> list[SimpleNamespace]:
    return [message(a, f"campaign:1:{i}") for i, a in enumerate(PEOPLE)]


def report(received: list[SimpleNamespace], ledger: set[str] | None = None) -> tuple[bool, str]:
    console = Console(record=True, width=200)
    ok = _report(console, PLAN, received, None, ledger or set(), "sent", COUNTS, 1.0, None)
    return ok, console.export_text()


def test_everyone_once_is_exactly_once() -> None:
    ok, text = report(everyone())
    assert ok and "every address exactly once" in text


def test_a_ledgered_re_send_of_one_job_passes_as_a_duplicate() -> None:
    ok, text = report([*everyone(), message(PEOPLE[0], "campaign:1:0")], ledger={"campaign:1:0"})
    assert ok and "1 duplicate copy" in text and "every address exactly once" not in text


def test_a_second_job_for_one_person_fails_even_when_each_job_came_once() -> None:
    # the list's other spelling of the address made a second job: nothing records that duplicate
    ok, text = report([*everyone(), message(PEOPLE[0].upper(), "campaign:1:99")], ledger={"campaign:1:99"})
    assert not ok and "did not hold" in text


def test_mail_to_someone_on_no_list_fails() -> None:
    ok, text = report([*everyone(), message("stranger@evil.test", "campaign:1:98")])
    assert not ok and "did not hold" in text
