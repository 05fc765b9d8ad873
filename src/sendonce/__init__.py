"""sendonce: email delivered exactly once, on PostgreSQL."""

__version__ = "0.1.0"
