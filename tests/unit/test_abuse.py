from __future__ import annotations

from sendonce.api.abuse import AbuseDetector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_replays_from_one_client_raises_exactly_one_alert() -> None:
    clock = Clock()
    detector = AbuseDetector(bucket_seconds=10, min_count=20, clock=clock)
    flags = []
    # normal traffic first: a few repeats per window, from several clients
    for _window in range(30):
        for i in range(3):
            flags += detector.observe_repeat(7, f"10.0.0.{i}")
        clock.now += 10
    assert flags == []
    # one client retries in a tight loop for a whole minute
    for _ in range(600):
        flags += detector.observe_repeat(7, "203.0.113.9")
        clock.now += 0.1
    assert [(f.kind, f.subject) for f in flags] == [("replay_burst", "client:203.0.113.9")]
    assert flags[0].detail["baseline_per_window"] < 2


def test_the_threshold_follows_the_subjects_own_baseline() -> None:
    clock = Clock()
    detector = AbuseDetector(bucket_seconds=10, min_count=20, factor=5, clock=clock)
    # a busy integration that always retries a lot: 60 repeats per window, steadily
    flags = []
    for _ in range(50):
        for _ in range(60):
            flags += detector.observe_repeat(1, "198.51.100.1")
        clock.now += 10
    # the first windows, before any baseline, are over the floor: that start is flagged once
    assert len(flags) == 1
    flags.clear()
    for _ in range(30):  # steady traffic at its usual rate raises nothing more
        for _ in range(60):
            flags += detector.observe_repeat(1, "198.51.100.1")
        clock.now += 10
    assert flags == []
    for _ in range(400):  # a jump far above its own baseline does
        flags += detector.observe_repeat(1, "198.51.100.1")
    assert len(flags) == 1


def test_a_burst_spread_over_many_clients_is_an_account_alert() -> None:
    clock = Clock()
    detector = AbuseDetector(bucket_seconds=10, min_count=20, clock=clock)
    flags = []
    for i in range(200):
        flags += detector.observe_repeat(3, f"192.0.2.{i % 50}")
    assert [(f.kind, f.subject) for f in flags] == [("replay_burst", "account:3")]


def test_one_address_signed_up_from_many_sources() -> None:
    clock = Clock()
    detector = AbuseDetector(sources_threshold=5, sources_window=600, clock=clock)
    flags = []
    for i in range(4):
        flags += detector.observe_signup(1, "victim@example.test", f"192.0.2.{i}")
        flags += detector.observe_signup(1, f"user{i}@example.test", f"192.0.2.{i}")
    assert flags == []
    for i in range(4, 12):
        flags += detector.observe_signup(1, "victim@example.test", f"192.0.2.{i}")
    assert [(f.kind, f.subject) for f in flags] == [("many_sources", "address:victim@example.test")]


def test_the_detectors_memory_is_bounded_by_what_is_recent() -> None:
    """An API process sees every address that ever signs up: what can no longer raise a flag is
    forgotten, or the process grows for ever."""
    clock = Clock()
    detector = AbuseDetector(bucket_seconds=10, sources_window=600, clock=clock)
    for i in range(2000):
        detector.observe_signup(1, f"a{i}@example.test", f"10.0.{i % 250}.{i // 250}")
        detector.observe_repeat(1, f"10.0.{i % 250}.{i // 250}")
        clock.now += 0.01
    assert len(detector._sources) == 2000
    clock.now += 601  # past the sources window and past 50 buckets without a repeat
    detector.observe_signup(1, "new@example.test", "10.1.0.1")
    assert set(detector._sources) == {(1, "new@example.test")}
    assert detector._series == {}
    # still detects, after forgetting
    flags = [f for n in range(4) for f in detector.observe_signup(1, "new@example.test", f"10.2.0.{n}")]
    assert [f.kind for f in flags] == ["many_sources"]  # its fifth client


def test_a_retried_address_keeps_one_entry_per_client_not_per_request() -> None:
    """Every request of a client retrying one address was kept for the whole window and rebuilt
    into a set at the next: a repeat's cost grew with the repeats before it (about 1 ms each after
    60,000, on the API's event loop). Per address, at most ``sources_threshold`` clients are kept."""
    clock = Clock()
    detector = AbuseDetector(sources_threshold=5, sources_window=600, clock=clock)
    for _ in range(10_000):
        assert detector.observe_signup(1, "ann@example.test", "192.0.2.1") == []
        clock.now += 0.01
    assert len(detector._sources[(1, "ann@example.test")]) == 1
    flags = []
    for n in range(10_000):
        flags += detector.observe_signup(1, "victim@example.test", f"198.51.100.{n % 250}.{n // 250}")
    assert len(detector._sources[(1, "victim@example.test")]) == 5
    assert [(f.kind, f.detail["distinct_clients"]) for f in flags] == [("many_sources", 5)]
    # a client seen again counts once, and only while within the window
    assert detector.observe_signup(1, "bob@example.test", "192.0.2.9") == []
    clock.now += 601
    for n in range(4):
        assert detector.observe_signup(1, "bob@example.test", f"192.0.2.{10 + n}") == []
    assert len(detector._sources[(1, "bob@example.test")]) == 4  # the first one's signup is past the window
