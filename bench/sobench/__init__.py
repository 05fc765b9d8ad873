"""Helpers of sendonce's benchmark harness (bench/campaign.py, bench/signups.py). Not part of sendonce."""

import asyncio
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

BENCH_DIR = Path(__file__).resolve().parent.parent
"""The bench/ folder."""
REPO_DIR = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
"""Downloads, scratch servers and logs (gitignored)."""
OUT_DIR = BENCH_DIR / "out"
"""Results that are committed."""


def event_loop() -> str:
    """The event loop of the bench's own loops (bare, lean): $SOBENCH_LOOP, set by campaign.py to the
    one sendonce's workers run on, so that the limit and sendonce are measured on the same loop."""
    return os.environ.get("SOBENCH_LOOP", "asyncio")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``main`` on :func:`event_loop`."""
    if event_loop() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
