"""The SMTP sink every figure sends to, and its delivered-message counter.

Postfix's ``smtp-sink`` (C, event-driven) is taken from Debian's ``postfix`` package without
installing the MTA: ``apt-get download postfix`` and ``dpkg-deb -x`` into ``bench/.cache/postfix``,
with its private libraries on ``LD_LIBRARY_PATH`` (and any missing system library extracted the same
way). Run with ``-c`` it prints running counters (``sess=… quit=… mesg=N``), which the harness reads
to check that every message arrived. If it cannot run, the fallback is aiosmtpd (sendonce's test
inbox) in a process of its own, which is much slower: every figure says which sink it used.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sobench.procs import CHILDREN, free_port, wait_port

# Libraries smtp-sink links that a slim system may lack, and the Debian package of each.
_LIBRARY_PACKAGES = {
    "libdb-5.3.so": "libdb5.3",
    "libnsl.so.2": "libnsl2",
    "libtirpc.so.3": "libtirpc3",
    "libicuuc.so.72": "libicu72",
    "libicudata.so.72": "libicu72",
    "libicui18n.so.72": "libicu72",
    "libgssapi_krb5.so.2": "libgssapi-krb5-2",
    "libkrb5.so.3": "libkrb5-3",
    "libk5crypto.so.3": "libk5crypto3",
    "libkrb5support.so.0": "libkrb5support0",
    "libkeyutils.so.1": "libkeyutils1",
    "libcom_err.so.2": "libcom-err2",
}

_COUNTER = re.compile(rb"mesg=(\d+)")


@dataclass(frozen=True)
class SinkBinary:
    path: Path
    env: dict[str, str]
    version: str


def _missing_libraries(binary: Path, env: dict[str, str]) -> list[str]:
    out = subprocess.run(["ldd", str(binary)], env=env, capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def _extract(package: str, dest: Path, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob(f"{package}_*.deb"):
        old.unlink()
    subprocess.run(["apt-get", "download", package], cwd=work, check=True, capture_output=True)
    (deb,) = work.glob(f"{package}_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)


def fetch_smtp_sink(cache: Path) -> SinkBinary | str:
    """smtp-sink ready to run, or the reason it cannot be had."""
    root = cache / "postfix"
    binary = root / "root" / "usr" / "sbin" / "smtp-sink"
    try:
        if not binary.exists():
            _extract("postfix", root / "root", root / "debs")
        lib_dirs = [root / "root" / "usr" / "lib" / "postfix"]
        lib_dirs += [p for p in (root / "root" / "usr" / "lib").glob("*-linux-gnu") if p.is_dir()]
        lib_dirs += [p for p in (root / "root" / "lib").glob("*-linux-gnu") if p.is_dir()]
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(str(p) for p in lib_dirs)}
        missing = _missing_libraries(binary, env)
        for package in sorted({_LIBRARY_PACKAGES.get(lib, "") for lib in missing} - {""}):
            _extract(package, root / "root", root / "debs")
        if missing:
            lib_dirs += [p for p in (root / "root" / "usr" / "lib").glob("*-linux-gnu") if p not in lib_dirs]
            env["LD_LIBRARY_PATH"] = ":".join(str(p) for p in lib_dirs)
            still = _missing_libraries(binary, env)
            if still:
                return f"smtp-sink needs libraries that could not be found: {', '.join(still)}"
    except (subprocess.CalledProcessError, OSError, ValueError) as exc:
        return f"could not get smtp-sink from Debian's postfix package: {exc}"
    debs = sorted((root / "debs").glob("postfix_*.deb"))
    version = debs[-1].name.split("_")[1] if debs else "?"
    return SinkBinary(binary, env, version)


class Sink:
    """One sink process on 127.0.0.1 for one measured run; ``delivered()`` reads its counter."""

    def __init__(self, log_dir: Path, binary: SinkBinary | None, name: str) -> None:
        self.port = free_port()
        self.log = log_dir / f"sink-{name}.out"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_bytes(b"")
        self._out = self.log.open("wb")
        if binary is not None:
            self.kind = f"smtp-sink (Postfix {binary.version})"
            args = [str(binary.path), "-c", "-m", "2000"]
            if os.geteuid() == 0:
                args += ["-u", "nobody"]
            args += [f"127.0.0.1:{self.port}", "1000"]
            env = binary.env
        else:
            self.kind = "aiosmtpd (sendonce.testing.inbox.Inbox), FALLBACK: slower than smtp-sink"
            args = [sys.executable, "-m", "sobench.inbox_sink", str(self.port)]
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.proc: subprocess.Popen[Any] = CHILDREN.spawn(args, env=env, stdout=self._out)
        wait_port(self.port, proc=self.proc)
        self.url = f"smtp://127.0.0.1:{self.port}"

    def delivered(self) -> int:
        found = _COUNTER.findall(self.log.read_bytes())
        return int(found[-1]) if found else 0

    def wait_for(self, count: int, timeout: float = 10.0) -> int:
        """The counter once it reaches ``count`` (or whatever it is after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.delivered() < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.delivered()

    def stop(self) -> int:
        count = self.delivered()
        CHILDREN.stop(self.proc)
        self._out.close()
        return max(count, self.delivered())
