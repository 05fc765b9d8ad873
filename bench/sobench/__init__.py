"""Helpers of sendonce's benchmark harness (bench/campaign.py, bench/signups.py). Not part of sendonce."""

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent
"""The bench/ folder."""
REPO_DIR = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
"""Downloads, scratch servers and logs (gitignored)."""
OUT_DIR = BENCH_DIR / "out"
"""Results that are committed."""
