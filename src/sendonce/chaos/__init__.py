"""The fault-injection suite: real parts, real faults, a verdict counted from what arrived.

One command runs a scenario end to end and prints a table::

    python -m sendonce.chaos                                   # every scenario, small
    python -m sendonce.chaos --scenario kills --recipients 50000 --kills 200   # the full run
    python -m sendonce.chaos --scenario partition --broken no-fencing          # must fail
    python -m sendonce.chaos --scenario kills --broken mark-sent-first         # must fail

Real parts: PostgreSQL (the embedded server, or ``SENDONCE_DATABASE_URL``), ``sendonce worker`` and
``sendonce api`` processes, an aiosmtpd inbox and a Resend-compatible API (:mod:`sendonce.testing`).
Scenarios (:mod:`sendonce.chaos.scenarios`): ``kills``, ``restart``, ``smtp-faults``,
``http-faults``, ``races``, ``partition``. The exit code is non-zero when an invariant breaks
(:mod:`sendonce.chaos.invariants`).
"""

from __future__ import annotations

__all__ = ["run"]


def run(argv: list[str]) -> int:
    """Run the scenarios ``argv`` selects (see ``python -m sendonce.chaos --help``); the exit code."""
    # Imported here, so that ``python -m sendonce.chaos.broken`` does not import itself twice.
    from sendonce.chaos.command import run as run_command

    return run_command(argv)
