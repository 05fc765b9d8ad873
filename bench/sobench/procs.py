"""Child processes: each started in its own session, all of them ended on exit (also on Ctrl-C).

Only processes this benchmark started are ever signalled, each by its own id.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


class Children:
    """The processes and clean-up steps of one benchmark run, undone in reverse order."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[Any]] = []
        self._cleanups: list[Callable[[], None]] = []
        self._handles: list[IO[Any]] = []

    def spawn(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        stdin: int | None = None,
        stdout: int | IO[Any] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[Any]:
        handle: IO[Any] | None = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            handle = log.open("ab")
            self._handles.append(handle)
        proc = subprocess.Popen(
            list(args),
            env=env,
            cwd=cwd,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=stdout if stdout is not None else (handle or subprocess.DEVNULL),
            stderr=handle or subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the harness only; it ends the children in order
        )
        self._procs.append(proc)
        return proc

    def stop(
        self, proc: subprocess.Popen[Any], *, sig: int | None = signal.SIGTERM, timeout: float = 15.0
    ) -> int | None:
        """Signal one child (its own process group, which it leads), wait, SIGKILL if it lingers.

        ``sig=None``: it was signalled already; only wait (a second SIGTERM could land after the
        child's graceful handler is gone and kill it mid-exit).
        """
        if proc.poll() is None:
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if proc in self._procs:
            self._procs.remove(proc)
        return proc.returncode

    def stop_all(self, procs: Sequence[subprocess.Popen[Any]], *, timeout: float = 15.0) -> None:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            self.stop(proc, sig=None, timeout=max(deadline - time.monotonic(), 0.1))

    def on_exit(self, fn: Callable[[], None]) -> None:
        self._cleanups.append(fn)

    def cleanup(self) -> None:
        self.stop_all(list(self._procs), timeout=10)
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception as exc:  # clean-up goes on whatever one step does
                print(f"clean-up step failed: {exc}", file=sys.stderr)
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.close()
        self._handles.clear()


CHILDREN = Children()


def install_cleanup() -> None:
    """End every child on normal exit, on Ctrl-C (KeyboardInterrupt) and on SIGTERM/SIGHUP."""
    atexit.register(CHILDREN.cleanup)

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


# -- /proc readings ----------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU of a process (and of its waited-for children), in seconds; 0 when gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # fields[0] is the state (field 3 of stat); utime is field 14, stime 15, cutime 16, cstime 17.
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def child_pids(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def tree_cpu_seconds(root: int) -> float:
    """CPU of a server process and all its children, living or exited (exited ones count in cutime)."""
    return cpu_seconds(root, children=True) + sum(cpu_seconds(pid) for pid in child_pids(root))


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent in processes since boot (user, nice, system), from /proc/stat.

    Interrupt and softirq time (where the kernel may process our own loopback traffic) and steal are
    left out, so that what is not ours is not overstated.
    """
    user, nice, system = (int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:4])
    return (user + nice + system) / CLK_TCK


class OtherLoad:
    """CPU used on this machine by processes the benchmark does not measure, over a window.

    ``stop(ours)`` takes the CPU seconds of everything the run measured (its processes, PostgreSQL, the
    sink); the harness's own CPU is added here. The rest is someone else's load, which skews the figures.
    """

    def __init__(self) -> None:
        self.busy = machine_busy_seconds()
        self.own = time.process_time()
        self.started = time.monotonic()

    def stop(self, ours: float) -> float:
        """Cores' worth of CPU used by other processes during the window."""
        wall = time.monotonic() - self.started
        other = machine_busy_seconds() - self.busy - ours - (time.process_time() - self.own)
        return max(other, 0.0) / wall if wall > 0 else 0.0


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set size) of a living process, in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
