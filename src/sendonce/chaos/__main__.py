"""``python -m sendonce.chaos``."""

from __future__ import annotations

import sys

from sendonce.chaos import run

raise SystemExit(run(sys.argv[1:]))
