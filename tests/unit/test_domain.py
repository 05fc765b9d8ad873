from __future__ import annotations

from datetime import timedelta

import pytest

from sendonce.domain.durations import parse_duration
from sendonce.domain.jobs import campaign_job_id, message_id, transactional_job_id


def test_campaign_job_id_is_deterministic() -> None:
    assert campaign_job_id(42, 7) == "campaign:42:7"
    assert campaign_job_id(42, 7) == campaign_job_id(42, 7)


def test_message_id_is_a_valid_dot_atom_derived_from_the_job() -> None:
    assert message_id("campaign:42:7", "sender.test") == "<campaign.42.7@sender.test>"
    with pytest.raises(ValueError, match="not a valid job id"):
        message_id("not a job id", "x.test")


def test_transactional_job_ids_are_checked() -> None:
    assert transactional_job_id("signup", "abc123") == "signup:abc123"
    with pytest.raises(ValueError, match="not a valid job id"):
        transactional_job_id("signup", "has space")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("15m", 900),
        ("1h", 3600),
        ("90d", 90 * 86400),
        ("1h30m", 5400),
        ("45", 45),
        ("250ms", 0.25),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "bad", ["", "soon", "10x", "1h tomorrow", "m", "1e20", "inf", "nan", "99999999999999d", "-86400", "-1"]
)
def test_parse_duration_refuses_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)
