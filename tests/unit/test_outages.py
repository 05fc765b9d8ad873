"""A database outage is logged when it starts, reminded while it lasts and logged when it ends."""

from __future__ import annotations

import logging

import pytest

from sendonce.delivery.health import Outages


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sendonce.delivery.worker"]


def test_one_line_at_the_start_a_reminder_a_minute_and_one_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    outages = Outages(remind_every=60, clock=clock)
    outages.succeeded("claim")  # nothing open: nothing said
    for _ in range(50):  # a retry every 2.5 s for 125 s: one start line, two reminders
        outages.failed("claim", "cannot execute UPDATE in a read-only transaction")
        clock.now += 2.5
    assert outages.seconds() == {"claim": 125.0}
    assert outages.failures == 50
    outages.succeeded("claim")
    lines = _lines(caplog)
    assert len(lines) == 4, lines
    assert lines[0].startswith("claim: database unavailable (cannot execute UPDATE")
    assert lines[1].startswith("claim: database still unavailable after 60 s and 25 failures")
    assert lines[2].startswith("claim: database still unavailable after 120 s and 49 failures")
    assert lines[3] == "claim: database available again after 125.0 s and 50 failures"
    assert outages.seconds() == {"claim": 0.0}


def test_operations_fail_and_recover_apart(caplog: pytest.LogCaptureFixture) -> None:
    # a read-only server: reads work, claims do not
    clock = Clock()
    outages = Outages(clock=clock)
    outages.failed("claim", "read-only")
    outages.succeeded("next wakeup")
    clock.now += 30
    outages.failed("claim", "read-only")
    outages.succeeded("next wakeup")
    assert outages.seconds() == {"claim": 30.0}
    outages.failed("record", "connection refused")
    clock.now += 5
    outages.succeeded("claim")
    assert outages.seconds() == {"claim": 0.0, "record": 5.0}


def test_an_operation_not_called_again_stops_counting_once_others_work(caplog: pytest.LogCaptureFixture) -> None:
    # The look for the next due row failed during a restart; then the claims find work for hours
    # and it is not called: its outage must end with the database's, not climb for ever.
    clock = Clock()
    outages = Outages(quiet=30, clock=clock)
    outages.failed("next wakeup", "connection refused")
    clock.now += 10
    outages.succeeded("claim")  # 10 s since its last failure: it may still be failing
    assert outages.seconds() == {"next wakeup": 10.0}
    clock.now += 25
    outages.succeeded("claim")
    assert outages.seconds() == {"next wakeup": 0.0}
    assert _lines(caplog)[-1] == "next wakeup: database available again after 0.0 s and 1 failures"
