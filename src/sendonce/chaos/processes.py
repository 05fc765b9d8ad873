"""Real ``sendonce worker`` and ``sendonce api`` processes: start, SIGKILL, restart, stop, read their logs.

Every process gets exactly the environment it needs (no inherited ``SENDONCE_*``), its own log file,
and its own ``PGAPPNAME`` (``chaos-<n>``), which the audit trigger records with each outcome. On
Linux each child also dies with the chaos process (``PR_SET_PDEATHSIG``), so a chaos run that is
itself killed leaves nothing behind.

A *broken build* (see :mod:`sendonce.chaos.broken`) runs the same CLI through a launcher that patches
the worker first; it exists only here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple

import httpx

from sendonce.chaos.database import clean_env
from sendonce.faults import DEATH_NOTE

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that makes the child receive SIGKILL when the chaos process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


_PREEXEC = _die_with_parent()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before by this process. The kernel may offer the same
    free port twice in a row (the first process it was meant for has not bound it yet): two API
    processes then raced for one port and the loser exited (seen once in a chaos run)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    concurrency: int = 4
    batch_size: int = 10
    lease: float = 2.0
    tick: float = 0.5


@dataclass
class Proc:
    """One child process and what the suite knows about it."""

    seq: int
    role: str
    """``worker``, ``drain``, ``isolated`` or ``api``."""
    popen: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    app_name: str
    killed_by_us: bool = False
    stopped_by_us: bool = False
    base_url: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            self.log.flush()
        try:
            return self.log_path.read_text("utf-8", "replace")
        except OSError:
            return ""


LONG_RUNNING = frozenset({"worker", "isolated", "api", "drain"})
"""Roles that run until stopped (or, for drain, until nothing is left); others are one-shot commands."""

_FINAL = re.compile(r"final: WorkerStats\((?P<fields>[^)]*)\)")


def worker_stats(text: str) -> dict[str, int] | None:
    """The counters of a worker's last ``final: WorkerStats(...)`` line (written on a graceful stop)."""
    matches = list(_FINAL.finditer(text))
    if not matches:
        return None
    stats = {}
    for item in matches[-1].group("fields").split(","):
        name, _, value = item.strip().partition("=")
        with contextlib.suppress(ValueError):
            stats[name] = int(value)
    return stats


def refused_outcomes(text: str) -> int:
    """How many 'outcome refused' (fenced_out) warnings a worker logged."""
    return text.count("outcome refused")


class HeldRow(NamedTuple):
    """A row a worker held when it died: claimed, its outcome not recorded."""

    job: str
    claimed: float
    """Wall-clock time just before the claim (a hook victim's), or the claim's time (the database's)."""
    until: float | None = None
    """Wall-clock time by which its lease had ended at the latest (None: not known)."""
    given_back: bool = False
    """Its outcome gave it back (released, or to be retried): another worker may have claimed it as
    soon as that was recorded, lease or not."""


class Witness(NamedTuple):
    """What a worker held when it died: from its death note (a hook kill), or from the database
    right after the suite killed it."""

    at: float
    """Wall-clock time of death."""
    held: list[HeldRow] | None
    """None if unknown."""
    connections: frozenset[tuple[int, int, float]] = frozenset()
    """Its open SMTP connections, as (local port, server port, opened at), where its note says."""


def death_note(log: str) -> tuple[str, Witness | None] | None:
    """The last note the fault hook left in a process's log: (point, what the worker held, or None
    if the note does not say); None if there is no note."""
    notes = re.findall(re.escape(DEATH_NOTE) + r"(\w+)(?: (\{.*\}))?$", log, re.MULTILINE)
    if not notes:
        return None
    point, witness = notes[-1]
    try:
        note = json.loads(witness)
        held = [
            HeldRow(str(row[0]), float(row[1]), float(row[2]) if len(row) > 2 else None, bool(row[3:4] and row[3]))
            for row in note["held"]
        ]
        connections = frozenset((int(c[0]), int(c[1]), float(c[2])) for c in note.get("connections", ()))
        return point, Witness(float(note["at"]), held, connections)
    except (ValueError, KeyError, TypeError, IndexError):
        return point, None


@dataclass
class Fleet:
    """All the processes of one scenario."""

    run_dir: Path
    db_url: str
    options: WorkerOptions
    broken: str | None = None
    fault_seed: int = 0
    procs: list[Proc] = field(default_factory=list)
    external_kills: int = 0
    hook_kills: Counter[str] = field(default_factory=Counter)
    """Processes that died of SIGKILL the suite did not send (the fault hook), by role."""
    hook_points: Counter[str] = field(default_factory=Counter)
    """Deaths by the fault hook, by the point where it fired (from the note each one leaves)."""
    held_at_hook_kills: list[Witness | None] = field(default_factory=list)
    """Per worker killed by the fault hook: what it held, from its note; None where the note says
    nothing of that."""
    crashes: list[str] = field(default_factory=list)
    _seq: int = 0

    # -- spawning --------------------------------------------------------------------------------

    def _spawn(self, role: str, args: list[str], env: dict[str, str]) -> Proc:
        self._seq += 1
        seq = self._seq
        app_name = f"chaos-{seq}"
        log_path = self.run_dir / f"{seq:04d}-{role}.log"
        log = log_path.open("wb")  # not appended to: a log dir used again must not lend an old death note
        full_env = {**clean_env(), **env, "PGAPPNAME": app_name}
        popen = subprocess.Popen(
            args,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_PREEXEC,  # only prctl: safe between fork and exec
        )
        proc = Proc(seq, role, popen, log_path, log, app_name)
        self.procs.append(proc)
        return proc

    def spawn_worker(
        self,
        transport_url: str,
        *,
        role: str = "worker",
        faults: str | None = None,
        drain: bool = False,
        db_url: str | None = None,
        broken: bool = True,
    ) -> Proc:
        """A ``sendonce worker`` process (through the broken-build launcher when one is selected)."""
        o = self.options
        if self.broken and broken:
            launcher = [sys.executable, "-m", "sendonce.chaos.broken", self.broken]
        else:
            launcher = [sys.executable, "-m", "sendonce.cli"]
        args = [
            *launcher,
            "--log-level",
            "info",
            "worker",
            "--no-upgrade",
            "--concurrency",
            str(o.concurrency),
            "--batch-size",
            str(o.batch_size),
            "--lease",
            f"{o.lease:g}",
            "--tick",
            f"{o.tick:g}",
        ]
        if drain:
            args.append("--drain")
        env = {"SENDONCE_DATABASE_URL": db_url or self.db_url, "SENDONCE_TRANSPORT_URL": transport_url}
        if faults:
            env["SENDONCE_FAULTS"] = faults
            env["SENDONCE_FAULTS_SEED"] = str(self.fault_seed + self._seq + 1)
        return self._spawn(role, args, env)

    def spawn_api(self, env: dict[str, str], *, port: int | None = None, faults: str | None = None) -> Proc:
        port = port or free_port()
        full = {"SENDONCE_DATABASE_URL": self.db_url, **env}
        if faults:
            full["SENDONCE_FAULTS"] = faults
            full["SENDONCE_FAULTS_SEED"] = str(self.fault_seed + self._seq + 1)
        args = [sys.executable, "-m", "sendonce.cli", "--log-level", "warning", "api", "--no-upgrade"]
        args += ["--host", "127.0.0.1", "--port", str(port)]
        proc = self._spawn("api", args, full)
        proc.base_url = f"http://127.0.0.1:{port}"
        return proc

    def run_cli(self, role: str, cli_args: list[str], env: dict[str, str]) -> Proc:
        """Any other ``sendonce`` command (``db upgrade``), as a process of its own."""
        return self._spawn(role, [sys.executable, "-m", "sendonce.cli", *cli_args], env)

    # -- control ---------------------------------------------------------------------------------

    def kill(self, proc: Proc) -> bool:
        """SIGKILL, as an operator's ``kill -9`` or the OOM killer would. False: it was dead already,
        or the fault hook got there first (it left its note: the next :meth:`reap` counts that death,
        with what the note says it held)."""
        if not proc.alive():
            return False
        proc.killed_by_us = True
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=10)
        if proc.role in ("worker", "isolated") and death_note(proc.log_text()) is not None:
            proc.killed_by_us = False
            return False
        if proc.role != "api":
            self.external_kills += 1
        return True

    def terminate(self, procs: list[Proc], timeout: float = 30.0) -> None:
        """SIGTERM (graceful), then SIGKILL whatever did not stop in time; and account for every
        process that died on its own since it was last looked at (a worker the fault hook killed
        just before, which is not among ``procs``: what it held still counts)."""
        for proc in procs:
            # each is accounted for below, dead already or not: reap() must not count it again
            proc.stopped_by_us = True
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                code = proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.crashes.append(f"{proc.role} pid {proc.pid} did not stop within {timeout:.0f}s of SIGTERM")
                proc.killed_by_us = True
                proc.popen.kill()
                proc.popen.wait(timeout=10)
                continue
            # -SIGTERM: it died of the signal before it had set up its handler (still starting up,
            # nothing claimed); a worker that had started stops gracefully and exits 0.
            if proc.role in ("worker", "isolated") and code not in (0, -signal.SIGTERM):
                if code == -signal.SIGKILL and self._hook_death(proc):
                    self.hook_kills[proc.role] += 1  # the fault hook fired while it wound down
                else:
                    self.crashes.append(
                        f"{proc.role} pid {proc.pid} exited with {code} after SIGTERM: see {proc.log_path}"
                    )
        for proc in self.procs:
            self.reap(proc)  # not replaced: the fleet is stopping

    def reap(self, proc: Proc) -> bool:
        """If ``proc`` died on its own, account for it; True when it has to be replaced."""
        code = proc.popen.poll()
        if code is None or proc.killed_by_us or proc.stopped_by_us or proc.role not in LONG_RUNNING:
            return False
        if code == -signal.SIGKILL:
            proc.killed_by_us = True  # accounted for
            if self._hook_death(proc):
                self.hook_kills[proc.role] += 1
            else:  # not the fault hook (it writes its note first): the OOM killer, say, or another hand
                self.crashes.append(f"{proc.role} pid {proc.pid} was SIGKILLed without the fault hook's note")
            return True
        if code == 0 and proc.role == "drain":
            return False
        self.crashes.append(f"{proc.role} pid {proc.pid} exited with {code}: see {proc.log_path}")
        proc.stopped_by_us = True
        return True

    def _hook_death(self, proc: Proc) -> bool:
        """Count where the fault hook killed ``proc`` and what it held (the note it left); False if it
        left none."""
        note = death_note(proc.log_text())
        self.hook_points[note[0] if note else "unknown"] += 1
        if note and proc.role in ("worker", "isolated"):
            self.held_at_hook_kills.append(note[1])
        return note is not None

    def live(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role and p.alive()]

    def close(self) -> None:
        """Kill whatever still runs (after a failure); close the log files."""
        for proc in self.procs:
            if proc.alive():
                proc.killed_by_us = True
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=10)
            with contextlib.suppress(OSError):
                proc.log.close()


def wait_healthy(proc: Proc, timeout: float = 60.0) -> bool:
    """Wait until an API process answers ``/health`` (200, or 503 while PostgreSQL is away)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        try:
            if httpx.get(f"{proc.base_url}/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False
