from __future__ import annotations

import pytest

from sendonce.store.rate_limits import Rate
from sendonce.store.signups import ACCOUNT_BUCKET_SHARDS, SignupLimits


def test_rates_parse() -> None:
    assert Rate.parse("14/s") == Rate(14, 1)
    assert Rate.parse("50/min burst 10") == Rate(50, 60, 10)
    assert Rate.parse("100/10s").per_second == 10
    assert Rate.parse("0.5/s").capacity == 1.0  # a bucket holds at least one whole token


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1/0s", "positive"),  # was a division by zero on the first request: a 500
        ("0/s", "positive"),
        ("5/s burst 0.5", "at least 1"),  # a bucket that never holds a token refuses everything
        ("5/s burst 0", "at least 1"),
        ("5/s burst lots", "not a burst"),
        ("5/s burst 1e999", "finite"),  # was accepted, then every signup raised OverflowError: a 500
        ("5/s burst inf", "finite"),
        ("5/s burst nan", "at least 1"),
        ("1" + "0" * 400 + "/s", "finite"),
        ("fast", "not a rate"),
    ],
)
def test_rates_that_could_never_admit_anything_are_refused_at_start(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Rate.parse(text)


@pytest.mark.parametrize(("account", "shards"), [("200/s burst 2000", 8), ("5/s", 5), ("1/min", 1), ("8/h", 8)])
def test_the_account_bucket_has_no_part_smaller_than_one_token(account: str, shards: int) -> None:
    limits = SignupLimits(Rate.parse("5/h"), Rate.parse(account))
    assert limits.account_shards == shards <= ACCOUNT_BUCKET_SHARDS
    part = limits.per_account_shard
    assert part.capacity >= 1
    assert part.per_second * shards == pytest.approx(limits.per_account.per_second)
