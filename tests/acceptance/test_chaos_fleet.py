"""The chaos suite's bookkeeping of deaths: every death by the fault hook is counted as one, with
what the victim's note says it held, however it races with the suite's own moves.

A death the suite misses leaves the copies its victim had in flight unexplained: the job-by-job
check then fails a run whose worker did nothing wrong (seen in a full run on a starved machine: a
worker the hook killed as the fleet was being stopped was never looked at).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from sendonce.chaos.processes import Fleet, Proc, WorkerOptions

pytestmark = pytest.mark.timeout(60)

DIES_AT_THE_HOOK = (
    "from sendonce.faults import Faults\n"
    "f = Faults('after_accept=1')\n"
    "f.witness = lambda: {'held': [['campaign:1:9', 1700000000.5, 1700000002.5, False]],"
    " 'connections': [[40001, 25, 1699999999.0]]}\n"
    "f.hit('after_accept')\n"
)
NOTED_THEN_KILLED = (
    # the hook's note is out, and its own SIGKILL has not landed yet when the suite's arrives
    "import os, time\n"
    "os.write(2, b'sendonce fault hook: SIGKILL at after_accept "
    '{"at":1700000001.0,"held":[["campaign:1:9",1700000000.5,1700000002.5,false]],"connections":[]}\\n\')\n'
    "time.sleep(60)\n"
)
STOPS_ON_SIGTERM = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(60)\n"


def _fleet(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path, "postgresql://unused", WorkerOptions())


def _worker(fleet: Fleet, script: str) -> Proc:
    return fleet._spawn("worker", [sys.executable, "-c", script], {})


def test_a_hook_death_nobody_looked_at_before_the_fleet_stopped_is_counted(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    try:
        dead = _worker(fleet, DIES_AT_THE_HOOK)
        assert dead.popen.wait(timeout=30) == -signal.SIGKILL
        _worker(fleet, STOPS_ON_SIGTERM)
        fleet.terminate(fleet.live("worker"))  # the dead one is not live: it is not among them
    finally:
        fleet.close()
    assert not fleet.crashes
    assert fleet.hook_kills["worker"] == 1 and fleet.hook_points["after_accept"] == 1
    [witness] = fleet.held_at_hook_kills
    assert witness is not None and witness.held == [("campaign:1:9", 1700000000.5, 1700000002.5, False)]
    assert witness.connections == {(40001, 25, 1699999999.0)}


def test_a_hook_death_among_the_workers_being_stopped_is_counted_once(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    try:
        dead = _worker(fleet, DIES_AT_THE_HOOK)
        assert dead.popen.wait(timeout=30) == -signal.SIGKILL
        fleet.terminate([dead])  # it was live when the list was made, and died before its SIGTERM
    finally:
        fleet.close()
    assert not fleet.crashes
    assert fleet.hook_kills["worker"] == 1 and len(fleet.held_at_hook_kills) == 1


def test_a_kill_that_finds_the_hook_got_there_first_counts_the_hooks_death(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    try:
        proc = _worker(fleet, NOTED_THEN_KILLED)
        deadline = time.monotonic() + 30
        while b"SIGKILL at" not in proc.log_path.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.alive()
        assert not fleet.kill(proc)  # not the suite's kill: the hook's
        assert fleet.external_kills == 0
        assert fleet.reap(proc)  # a death to count, and a worker to replace
    finally:
        fleet.close()
    assert fleet.hook_kills["worker"] == 1
    [witness] = fleet.held_at_hook_kills
    assert witness is not None and witness.at == 1700000001.0
    assert witness.held == [("campaign:1:9", 1700000000.5, 1700000002.5, False)]


def test_a_sigkill_the_fault_hook_did_not_make_is_a_crash(tmp_path: Path) -> None:
    # the OOM killer, say: no note, so no hook kill; the copies it left have nothing to explain them
    fleet = _fleet(tmp_path)
    try:
        proc = _worker(fleet, STOPS_ON_SIGTERM)
        proc.popen.send_signal(signal.SIGKILL)  # not through the suite: it is not killed_by_us
        assert proc.popen.wait(timeout=30) == -signal.SIGKILL
        assert fleet.reap(proc)  # replaced, as any death is
    finally:
        fleet.close()
    assert fleet.hook_kills["worker"] == 0
    assert fleet.crashes and "without the fault hook's note" in fleet.crashes[0]
