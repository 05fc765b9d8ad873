"""The chaos suite's verdict on made-up arrivals: each kind of broken guarantee is flagged."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from sendonce.chaos.broken import FENCE, remove_fencing
from sendonce.chaos.harness import (
    RestartWindow,
    by_victims_connection,
    credit_copies,
    restart_jobs,
    within_victims_lease,
)
from sendonce.chaos.invariants import DatabaseView, Expectation, Verdict, faults_fired, judge, zombie_completions
from sendonce.chaos.processes import HeldRow, Witness, worker_stats
from sendonce.chaos.sinks import Arrival, SmtpSink
from sendonce.chaos.traffic import plan_addresses
from sendonce.store.queries import QUERIES
from sendonce.testing.inbox import InboxFaults
from sendonce.testing.resend_server import AcceptedEmail

PEOPLE = {"a@x.test", "b@x.test", "c@x.test"}


def arrivals(*pairs: tuple[str, str]) -> list[Arrival]:
    return [Arrival(job, rcpt, float(i), "main") for i, (job, rcpt) in enumerate(pairs)]


def view(**overrides: Any) -> DatabaseView:
    base: dict[str, Any] = {
        "status": "sent",
        "counts": {"total": 3, "queued": 0, "sending": 0, "sent": 3, "suppressed": 0, "failed": 0},
        "ledger": set(),
        "api_ledger": set(),
        "suppressed_rows": set(),
        "zombies": [],
        "outcomes_audited": 3,
        "addressee": {"campaign:7:1": "a@x.test", "campaign:7:2": "b@x.test", "campaign:7:3": "c@x.test"}
        | {"signup:1": "s@x.test", "signup:2": "t@x.test"},
    }
    base["counts"]["possible_duplicate"] = len(overrides.get("ledger", set()))
    # One re-sent attempt per job unless told, its ledger row written at 2.5: after the first copies
    # arrive (``arrivals`` numbers them 0, 1, 2...), before any re-sent copy that follows them.
    times = overrides.pop("ledger_times", None) or {job: [2.5] for job in overrides.get("ledger", set())}
    base["ledger_times"] = times
    base["ledger_attempts"] = Counter({job: len(at) for job, at in times.items()})
    return DatabaseView(**{**base, **overrides})


def verdict(
    got: list[Arrival],
    *,
    idempotent: bool = False,
    bound: int = 4,
    explained: Counter[str] | None = None,
    unpinned: int = 0,
    **kw: Any,
) -> Verdict:
    expect = Expectation(7, set(PEOPLE), duplicate_bound=bound, explained=explained, unpinned=unpinned)
    return judge(got, expect, kw.pop("db", view()), idempotent=idempotent, zombies=kw.pop("zombies", []))


def broken(v: Verdict) -> list[str]:
    return [c.name for c in v.checks if not c.ok]


EVERYONE = [("campaign:7:1", "a@x.test"), ("campaign:7:2", "b@x.test"), ("campaign:7:3", "c@x.test")]


def test_everyone_once_passes() -> None:
    v = verdict(arrivals(*EVERYONE))
    assert broken(v) == [] and (v.delivered, v.lost, v.duplicates) == (3, 0, 0)


def test_a_missing_recipient_is_a_loss() -> None:
    v = verdict(arrivals(*EVERYONE[:2]), db=view(counts={**view().counts, "sent": 2}))
    assert v.lost == 1
    assert broken(v) == ["every intended recipient received the campaign"]


def test_a_smtp_duplicate_must_be_in_the_ledger_and_within_the_bound() -> None:
    twice = arrivals(*EVERYONE, EVERYONE[0])
    silent = verdict(twice)
    assert (silent.recorded, silent.unrecorded) == (0, 1)
    assert "SMTP: every duplicate is in the possible_duplicate ledger" in broken(silent)
    ledgered = verdict(twice, db=view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"}))
    assert broken(ledgered) == [] and (ledgered.recorded, ledgered.unrecorded) == (1, 0)
    too_many = verdict(twice, bound=0, db=view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"}))
    assert broken(too_many) == ["SMTP: duplicates within the in-flight bound"]


def test_each_extra_smtp_copy_needs_a_ledger_row_of_its_own() -> None:
    # three copies of one job: two re-sent attempts that may have arrived, so two ledger rows
    thrice = arrivals(*EVERYONE, EVERYONE[0], EVERYONE[0])
    once = view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"})
    short = verdict(thrice, db=once)
    assert (short.recorded, short.unrecorded) == (1, 1)
    assert "SMTP: every duplicate is in the possible_duplicate ledger" in broken(short)
    twice = view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"}, ledger_times={"campaign:7:1": [2.5, 3.5]})
    assert broken(verdict(thrice, db=twice)) == []


def test_a_ledger_row_covers_only_a_copy_that_arrived_after_it_was_written() -> None:
    # copies of campaign:7:1 at 0 and 3. A re-send's ledger row is written by the claim that re-sends
    # it: after the copy before it arrived, before the re-sent one does.
    twice = arrivals(*EVERYONE, EVERYONE[0])
    ledger = {"ledger": {"campaign:7:1"}, "api_ledger": {"campaign:7:1"}}
    assert broken(verdict(twice, db=view(**ledger, ledger_times={"campaign:7:1": [1.0]}))) == []
    for written in (-1.0, 3.5):  # before the first copy; after the re-sent one
        v = verdict(twice, db=view(**ledger, ledger_times={"campaign:7:1": [written]}))
        assert (v.recorded, v.unrecorded) == (0, 1), written
        assert "SMTP: every duplicate is in the possible_duplicate ledger" in broken(v)


def test_two_ledger_rows_before_one_re_send_cover_it_and_no_later_one() -> None:
    # copies at 0, 3 and 4; both rows written before the second copy (an attempt that sent nothing,
    # then the one that re-sent): the third copy is silent, though the job has two ledger rows
    thrice = arrivals(*EVERYONE, EVERYONE[0], EVERYONE[0])
    db = view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"}, ledger_times={"campaign:7:1": [1.0, 2.0]})
    v = verdict(thrice, db=db)
    assert (v.recorded, v.unrecorded) == (1, 1)
    assert "SMTP: every duplicate is in the possible_duplicate ledger" in broken(v)


def test_a_smtp_duplicate_must_follow_a_fault_on_its_own_job() -> None:
    twice = arrivals(*EVERYONE, EVERYONE[0])
    db = view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"})
    name = "SMTP: every duplicate follows a fault that hit its own job"
    # in flight at a kill of its holder (or any fault on that job): explained
    assert broken(verdict(twice, db=db, explained=Counter({"campaign:7:1": 1}))) == []
    # within the total bound, in the ledger, but nothing happened to this job: flagged
    assert broken(verdict(twice, db=db, explained=Counter({"campaign:7:2": 1}))) == [name]
    assert broken(verdict(twice, db=db, explained=Counter())) == [name]
    # unless a fault that cannot be pinned to a job (a kill whose victim's rows are unknown) may explain it
    assert broken(verdict(twice, db=db, explained=Counter(), unpinned=1)) == []
    # one fault explains one copy, not two
    thrice = arrivals(*EVERYONE, EVERYONE[0], EVERYONE[0])
    db2 = view(ledger={"campaign:7:1"}, api_ledger={"campaign:7:1"}, ledger_times={"campaign:7:1": [2.5, 3.5]})
    assert broken(verdict(thrice, db=db2, explained=Counter({"campaign:7:1": 1}))) == [name]


def test_an_idempotent_transport_allows_no_duplicate_at_all() -> None:
    v = verdict(arrivals(*EVERYONE, EVERYONE[2]), idempotent=True, db=view(ledger={"campaign:7:3"}))
    assert broken(v) == ["idempotent transport: no duplicate"]


def test_two_job_ids_for_one_person_is_a_silent_duplicate() -> None:
    v = verdict(arrivals(*EVERYONE, ("campaign:7:9", "A@x.test".lower())), db=view(ledger={"campaign:7:1"}))
    assert "SMTP: every duplicate is in the possible_duplicate ledger" in broken(v)


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_message_that_reached_someone_else_is_astray(idempotent: bool) -> None:
    """Counted per address, a swap (a gets b's message, b gets a's) and a fan-out (a's message to b as
    well, b's own never sent) look like everyone once: only whom each job is for tells."""
    a, b, c = EVERYONE
    swapped = arrivals((a[0], b[1]), (b[0], a[1]), c)
    assert broken(verdict(swapped, idempotent=idempotent)) == ["every message reached the person its job is for"]
    fanned = arrivals(a, (a[0], b[1]), c)
    assert "every message reached the person its job is for" in broken(
        verdict(fanned, idempotent=idempotent, explained=Counter({a[0]: 1}), unpinned=24)
    )
    # A signup's window is one person's whatever its generation; another window's mail is not theirs.
    expect = Expectation(7, set(PEOPLE), signups={"s@x.test", "t@x.test"}, duplicate_bound=4)
    ok = arrivals(*EVERYONE, ("signup:1:3", "s@x.test"), ("signup:2:1", "t@x.test"))
    assert broken(judge(ok, expect, view(), idempotent=idempotent, zombies=[])) == []
    crossed = arrivals(*EVERYONE, ("signup:2:1", "s@x.test"), ("signup:1:3", "t@x.test"))
    assert broken(judge(crossed, expect, view(), idempotent=idempotent, zombies=[])) == [
        "every message reached the person its job is for"
    ]


def test_an_opt_out_before_the_claim_must_get_nothing() -> None:
    expect = Expectation(7, set(PEOPLE), opted_out_before_claim={"c@x.test"})
    counts = {**view().counts, "sent": 3, "suppressed": 0}
    v = judge(arrivals(*EVERYONE), expect, view(counts=counts), idempotent=False, zombies=[])
    assert "opt-outs that landed before the claim were honoured" in broken(v)


def test_a_racing_opt_out_may_go_either_way_but_is_never_lost() -> None:
    expect = Expectation(7, set(PEOPLE), opted_out_racing={"c@x.test"})
    suppressed = view(counts={**view().counts, "sent": 2, "suppressed": 1}, suppressed_rows={"c@x.test"})
    assert broken(judge(arrivals(*EVERYONE[:2]), expect, suppressed, idempotent=False, zombies=[])) == []
    vanished = view(counts={**view().counts, "sent": 2})
    v = judge(arrivals(*EVERYONE[:2]), expect, vanished, idempotent=False, zombies=[])
    assert "every intended recipient received the campaign" in broken(v)


def test_counts_that_disagree_with_the_inbox_are_flagged() -> None:
    v = verdict(arrivals(*EVERYONE), db=view(counts={**view().counts, "sent": 2, "failed": 1}))
    assert broken(v) == ["campaign counts equal the inbox counts"]


def test_a_campaign_left_sending_is_stuck() -> None:
    v = verdict(arrivals(*EVERYONE), db=view(status="sending"))
    assert broken(v) == ["the campaign finished (not stuck in sending)"]


def test_mail_nobody_asked_for_is_flagged() -> None:
    v = verdict(arrivals(*EVERYONE, ("signup:1:1", "stranger@x.test")))
    assert "no mail to anyone who was not meant to get it" in broken(v)


def test_a_signup_gets_exactly_one_verification_mail() -> None:
    expect = Expectation(7, set(PEOPLE), signups={"s@x.test"}, duplicate_bound=4)
    v = judge(arrivals(*EVERYONE), expect, view(), idempotent=True, zombies=[])
    assert broken(v) == ["every acknowledged signup received its verification mail"]
    twice = arrivals(*EVERYONE, ("signup:1:1", "s@x.test"), ("signup:1:1", "s@x.test"))
    assert broken(judge(twice, expect, view(), idempotent=True, zombies=[])) == ["idempotent transport: no duplicate"]


def test_zombie_completions_are_outcomes_recorded_by_anyone_but_the_claimant() -> None:
    outcomes = [
        {"job_id": "campaign:7:1", "claimed_by": "host:100:ab12", "recorder": "chaos-1"},  # its own row
        {"job_id": "campaign:7:2", "claimed_by": "host:200:cd34", "recorder": "chaos-1"},  # someone else's
        {"job_id": "campaign:7:3", "claimed_by": "host:200:cd34", "recorder": "psql"},  # not ours to judge
    ]
    found = zombie_completions(outcomes, {"chaos-1": 100, "chaos-2": 200})
    assert [z["job_id"] for z in found] == ["campaign:7:2"]
    v = verdict(arrivals(*EVERYONE), zombies=found)
    assert broken(v) == ["fencing: no worker completed a row it no longer owned"]


def test_worker_stats_are_read_from_the_final_line() -> None:
    text = "x\n... INFO sendonce [1] final: WorkerStats(claimed=9, sent=5, fenced_out=4, lost_leases=2)\n"
    assert worker_stats(text) == {"claimed": 9, "sent": 5, "fenced_out": 4, "lost_leases": 2}
    assert worker_stats("killed before it could say anything") is None


def test_the_two_lists_overlap_and_some_addresses_differ_only_in_case() -> None:
    list_a, list_b = plan_addresses(1000)
    keys = {a.lower() for a in list_a + list_b}
    assert len(keys) == 1000 and len(list_a) + len(list_b) == 1400
    assert any(a != a.lower() for a in list_b)


def test_the_no_fencing_build_removes_exactly_the_attempt_check(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(QUERIES):
        monkeypatch.setitem(QUERIES, name, QUERIES[name])  # restored after the test
    remove_fencing()
    for name in ("record_sent", "record_retry", "record_failed"):
        assert FENCE not in QUERIES[name]
    assert FENCE in QUERIES["renew_leases"] and FENCE in QUERIES["release_claims"]


def test_a_fault_that_should_have_fired_and_did_not_fails_the_run() -> None:
    planned = {"slow": 12.0, "dropped_after_data": 30.0, "garbled_reply": 2.0}
    ok = faults_fired(planned, Counter({"slow": 3, "dropped_after_data": 1}))
    assert ok.ok and "too rare to require: garbled_reply" in ok.detail
    # the inbox was set to drop connections, and never did: what that run tested is not what it says
    silent = faults_fired(planned, Counter({"slow": 3}))
    assert not silent.ok and "never fired: dropped_after_data" in silent.detail
    assert faults_fired({}, Counter()).ok


def test_the_sinks_plan_only_the_faults_they_were_set_to_inject() -> None:
    sink = SmtpSink(InboxFaults(temp_fail=0.04, drop_after_data=0.03))
    try:
        planned = sink.planned_faults(1000)
    finally:
        sink.stop()
    assert planned["temp_fail"] == pytest.approx(40) and planned["slow"] == 0
    assert planned["dropped_after_data"] == pytest.approx(960 * 0.03) and planned["garbled_reply"] == 0


def test_a_victims_copies_are_told_by_its_connections_however_late_they_are_read() -> None:
    """A copy is the dead worker's if it came after its claim and by a connection it had open when
    it died, or before its lease had ended (nobody else could claim the row until then)."""
    row = HeldRow("campaign:1:7", claimed=100.0, until=102.0)
    died = Witness(at=100.5, held=[row], connections=frozenset({(40001, 2525, 90.0)}))

    def copy(at: float, port: int | None = None, greeted: float | None = None, server: int = 2525) -> Arrival:
        return Arrival("campaign:1:7", "a@x.test", at, "main", port, greeted, server)

    assert within_victims_lease(died, row, copy(101.9))
    assert not within_victims_lease(died, row, copy(102.1))  # the lease had ended: maybe another's
    assert not within_victims_lease(died, row, copy(99.9))  # before the claim: an earlier holder's
    # read 5 seconds after the death (a starved inbox), by one of the victim's own connections
    assert by_victims_connection(died, row, copy(105.5, 40001, 95.0))
    # as late, by another connection, to another server, by one opened before the victim's or after
    # its death (a port used again): not the victim's
    assert not by_victims_connection(died, row, copy(105.5, 40002, 95.0))
    assert not by_victims_connection(died, row, copy(105.5, 40001, 95.0, server=2526))
    assert not by_victims_connection(died, row, copy(105.5, 40001, 89.0))
    assert not by_victims_connection(died, row, copy(105.5, 40001, 103.0))
    assert not by_victims_connection(died, row, copy(99.9, 40001, 95.0))  # before the claim
    # a row the victim gave back (released, or a retry): another worker may have claimed it at once
    back = row._replace(given_back=True)
    assert not within_victims_lease(died, back, copy(101.0))
    assert by_victims_connection(died, back, copy(101.0, 40001, 95.0))


def test_one_copy_is_credited_to_one_death_at_most() -> None:
    """A copy an earlier holder sent and the inbox read late, inside the next holder's lease, would
    fit both deaths: it goes to the one whose connection it came by, and explains one copy, not two."""
    job = "campaign:1:7"
    first = Witness(100.5, [HeldRow(job, 100.0, 102.0)], frozenset({(40001, 2525, 90.0)}))
    second = Witness(103.5, [HeldRow(job, 103.0, 105.0)])
    late = Arrival(job, "a@x.test", 103.2, "main", 40001, 95.0, 2525)

    assert credit_copies([late], [second], [first]) == ([[]], [[job]])
    # each death's row explains one copy: two deaths need two copies
    assert credit_copies([late], [second], [first, first]) == ([[]], [[job], []])


def test_a_restart_explains_only_the_jobs_it_caught_in_flight() -> None:
    """Held just before the stop, or arriving while the server was away: those a restart can have left
    sent and unrecorded. A re-send of a job recorded long before it is not the restart's doing."""
    window = RestartWindow(frozenset({"campaign:7:1"}), began=10.0, ended=12.0)
    got = [
        Arrival("campaign:7:1", "a@x.test", 9.0, "main"),  # held at the stop: its record never came
        Arrival("campaign:7:2", "b@x.test", 11.0, "main"),  # claimed after the question, sent meanwhile
        Arrival("campaign:7:3", "c@x.test", 5.0, "main"),  # long recorded
        Arrival("campaign:7:3", "c@x.test", 13.0, "main"),
    ]
    assert restart_jobs(window, got) == {"campaign:7:1", "campaign:7:2"}
    assert restart_jobs(RestartWindow(None, 10.0, 12.0), got) is None
    v = verdict(
        arrivals(*EVERYONE, EVERYONE[2]),
        db=view(ledger={"campaign:7:3"}, api_ledger={"campaign:7:3"}),
        explained=Counter(restart_jobs(window, got) or ()),
    )
    assert broken(v) == ["SMTP: every duplicate follows a fault that hit its own job"]


def test_an_http_message_without_its_job_id_header_is_nobodys() -> None:
    """The provider's record names a job only by the message's own header, not by the key it came
    with: a message that lost its header is a stranger to the verdict, as over SMTP."""
    body = {"to": ["a@x.test"], "headers": {"Sendonce-Job-Id": "campaign:7:1"}}
    assert AcceptedEmail("e1", "campaign:7:1", body, 0.0).job_id == "campaign:7:1"
    bare = AcceptedEmail("e2", "campaign:7:1", {"to": ["a@x.test"]}, 0.0)
    assert bare.job_id is None
    v = verdict([*arrivals(*EVERYONE[1:]), Arrival(bare.job_id, "a@x.test", 9.0, "main")], idempotent=True)
    assert "no mail to anyone who was not meant to get it" in broken(v)
