"""Fault injection for the crash tests and ``sendonce chaos``. Inert unless SENDONCE_FAULTS is set.

``SENDONCE_FAULTS="after_accept=0.02,after_claim=0.05"`` makes the process SIGKILL itself at those
named points with those probabilities: the same death as ``kill -9`` from outside, but at an exact
place in the pipeline, such as between "the transport accepted" and "recorded".

Points: ``after_claim`` (rows claimed, nothing sent), ``before_send``, ``after_accept`` (the
transport accepted a message that is not recorded yet), ``after_record``, ``mid_build`` (between
two chunks of a recipient-list build), and in the API ``api_after_commit`` (a request's transaction
committed, its answer not sent yet).

A worker also puts in its note what it held when it died (:attr:`Faults.witness`): the chaos suite
counts from it, and from the inbox, how many messages that death left sent and unrecorded.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

DEATH_NOTE = "sendonce fault hook: SIGKILL at "
"""Written to stderr, followed by the point's name (and, if the process has a witness, a space and a
JSON object: ``at``, the time of death, and what the witness said), just before the hook kills the
process."""

POINTS = frozenset({"after_claim", "before_send", "after_accept", "after_record", "mid_build", "api_after_commit"})


class Faults:
    def __init__(self, spec: str | None = None, *, seed: int | None = None) -> None:
        self.probabilities: dict[str, float] = {}
        if spec:
            for item in spec.split(","):
                item = item.strip()
                if not item:
                    continue
                name, _, value = item.partition("=")
                name = name.strip()
                if name not in POINTS:
                    raise ValueError(f"unknown fault point {name!r}; known: {', '.join(sorted(POINTS))}")
                try:
                    probability = float(value) if value else 1.0
                except ValueError:
                    raise ValueError(f"fault {name!r} needs a probability, got {value!r}") from None
                if not 0.0 <= probability <= 1.0:
                    raise ValueError(f"fault {name!r}: probability must be within [0, 1]")
                self.probabilities[name] = probability
        self._random = random.Random(seed)
        self.witness: Callable[[], dict[str, Any]] | None = None
        """What the process holds, for its death note; set by a worker whose faults are active."""

    @classmethod
    def from_env(cls) -> Faults:
        seed = os.environ.get("SENDONCE_FAULTS_SEED")
        try:
            number = int(seed) if seed else None
        except ValueError:
            raise ValueError(f"SENDONCE_FAULTS_SEED must be an integer, got {seed!r}") from None
        return cls(os.environ.get("SENDONCE_FAULTS"), seed=number)

    @property
    def active(self) -> bool:
        return bool(self.probabilities)

    def hit(self, point: str) -> None:
        """Die here, with the configured probability. A dictionary miss when inert."""
        probability = self.probabilities.get(point)
        if probability and self._random.random() < probability:
            # one unbuffered line first, so whoever watches the process can tell where it died
            note = f"{DEATH_NOTE}{point}"
            if self.witness is not None:
                note += " " + json.dumps({"at": time.time(), **self.witness()}, separators=(",", ":"))
            os.write(2, f"{note}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)


NO_FAULTS = Faults()
