"""The abuse detector: abnormal retry patterns, judged against each subject's own baseline.

Two signals:

* **replay bursts**: per account, and per (account, client address), the number of absorbed repeats
  is counted in buckets of a few seconds. An exponentially weighted mean and variance of past buckets
  is the subject's baseline; a bucket is abnormal when its count passes both a floor
  (``min_count``, so quiet subjects are never flagged for a handful of retries) and
  ``max(mean + z * stddev, factor * mean)``. One burst raises one alert: the client's when one client
  makes the burst, the account's when it is spread over many clients;
* **many sources**: one address receiving signups from many client addresses within a period.

The state lives in each API process; alerts go to PostgreSQL with a uniqueness key per subject, kind
and hour, so several processes noticing the same burst still record one alert. It is bounded by what
is recent: about once a minute, addresses with no signup within the sources window and subjects with
no repeat for ``IDLE_BUCKETS`` buckets (their baseline has decayed to nothing) are forgotten, so an API
process that sees millions of addresses does not keep them all.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

IDLE_BUCKETS = 50
"""Buckets without a repeat after which a subject's baseline is gone (0.8**50 ≈ 1e-5) and it is dropped."""

SWEEP_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Flag:
    account_id: int
    kind: str
    subject: str
    detail: dict[str, object]


@dataclass(slots=True)
class _Series:
    bucket: int = -1
    count: int = 0
    mean: float = 0.0
    var: float = 0.0
    seen: int = 0
    flagged_bucket: int = -10

    def advance(self, bucket: int, alpha: float) -> None:
        if self.bucket == -1:
            self.bucket = bucket
            return
        steps = min(bucket - self.bucket, IDLE_BUCKETS)
        for _ in range(max(steps, 0)):
            # close the current bucket, then the empty ones in between
            x = float(self.count)
            if self.seen == 0:
                self.mean, self.var = x, 0.0
            else:
                delta = x - self.mean
                self.mean += alpha * delta
                self.var = (1 - alpha) * (self.var + alpha * delta * delta)
            self.seen += 1
            self.count = 0
        self.bucket = bucket


@dataclass
class AbuseDetector:
    bucket_seconds: float = 10.0
    alpha: float = 0.2
    z: float = 4.0
    factor: float = 5.0
    min_count: int = 20
    sources_threshold: int = 5
    sources_window: float = 600.0
    clock: Callable[[], float] = time.monotonic
    _series: dict[str, _Series] = field(default_factory=dict)
    _sources: dict[tuple[int, str], OrderedDict[str, float]] = field(default_factory=dict)
    """Per address: its recent clients, each with its last signup, oldest first (at most
    ``sources_threshold`` of them: enough to tell whether there are that many)."""
    _flagged_sources: dict[tuple[int, str], float] = field(default_factory=dict)
    _swept: float | None = None

    def __post_init__(self) -> None:
        # Settings refuses these already; a detector built otherwise must not fail later, after a
        # request committed (a zero bucket divides by zero), so it refuses them too.
        if not self.bucket_seconds > 0 or not self.sources_window > 0:
            raise ValueError("the abuse detector's windows must be longer than zero")
        if not 0 < self.alpha <= 1:
            raise ValueError("the abuse detector's alpha must be in (0, 1]")
        if self.min_count < 1 or self.sources_threshold < 1:
            raise ValueError("the abuse detector's min_count and sources_threshold must be at least 1")

    def _sweep(self, now: float) -> None:
        """Forget what can no longer raise or suppress a flag (at most once per SWEEP_SECONDS)."""
        if self._swept is None:
            self._swept = now
        if now - self._swept < SWEEP_SECONDS:
            return
        self._swept = now
        horizon = now - self.sources_window
        self._sources = {
            key: seen for key, seen in self._sources.items() if seen and next(reversed(seen.values())) >= horizon
        }
        self._flagged_sources = {key: at for key, at in self._flagged_sources.items() if at > horizon}
        bucket = int(now // self.bucket_seconds)
        self._series = {key: s for key, s in self._series.items() if bucket - s.bucket <= IDLE_BUCKETS}

    def _threshold(self, series: _Series) -> float:
        return max(float(self.min_count), series.mean + self.z * math.sqrt(series.var), self.factor * series.mean)

    def _observe(self, key: str, bucket: int) -> tuple[_Series, bool]:
        series = self._series.setdefault(key, _Series())
        series.advance(bucket, self.alpha)
        series.count += 1
        abnormal = series.count >= self._threshold(series)
        # an episode lasts while consecutive buckets stay abnormal: flag its first bucket only
        new_episode = abnormal and series.flagged_bucket < bucket - 1
        if abnormal and (new_episode or series.flagged_bucket == bucket - 1):
            series.flagged_bucket = bucket
        return series, abnormal and new_episode

    def observe_repeat(self, account_id: int, client: str) -> list[Flag]:
        now = self.clock()
        self._sweep(now)
        bucket = int(now // self.bucket_seconds)
        client_series, client_flag = self._observe(f"{account_id}|client|{client}", bucket)
        account_series, account_flag = self._observe(f"{account_id}|account", bucket)
        if client_flag:
            # the burst is this client's: the account's episode is covered by this one alert
            account_series.flagged_bucket = bucket
            return [
                Flag(
                    account_id,
                    "replay_burst",
                    f"client:{client}",
                    {
                        "repeats_in_window": client_series.count,
                        "window_seconds": self.bucket_seconds,
                        "baseline_per_window": round(client_series.mean, 2),
                    },
                )
            ]
        if account_flag:
            return [
                Flag(
                    account_id,
                    "replay_burst",
                    f"account:{account_id}",
                    {
                        "repeats_in_window": account_series.count,
                        "window_seconds": self.bucket_seconds,
                        "baseline_per_window": round(account_series.mean, 2),
                    },
                )
            ]
        return []

    def observe_signup(self, account_id: int, email_key: str, client: str) -> list[Flag]:
        now = self.clock()
        self._sweep(now)
        key = (account_id, email_key)
        # One entry per client, not per request: a client retrying one address all day costs the
        # same as its first request (a list of every request was rebuilt into a set at each one).
        seen = self._sources.setdefault(key, OrderedDict())
        seen[client] = now
        seen.move_to_end(client)
        horizon = now - self.sources_window
        while next(iter(seen.values())) < horizon:  # never empties: this client was seen now
            seen.popitem(last=False)
        if len(seen) > self.sources_threshold:
            seen.popitem(last=False)  # the threshold's most recent clients are all that is asked of them
        if len(seen) < self.sources_threshold:
            return []
        last = self._flagged_sources.get(key)
        if last is not None and last > now - self.sources_window:
            return []
        self._flagged_sources[key] = now
        return [
            Flag(
                account_id,
                "many_sources",
                f"address:{email_key}",
                {"distinct_clients": len(seen), "window_seconds": self.sources_window},
            )
        ]
