"""Named queries, read once from ``sql/queries.sql``.

The file is a sequence of blocks::

    -- name --
    -- what it does (one or more comment lines)
    SELECT ...;

so a reviewer reads the SQL as SQL, and the code refers to a query by name. What reaches the server
is the statement without its comment lines, blank lines and indentation: the longest statements then
stay under psycopg's limit for caching a statement's parsed form (4 KiB), which it otherwise parses
again on every execution (the claim ran its 4.2 KiB through that parser for every batch).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString

_HEADER = re.compile(r"^-- ([a-z_][a-z0-9_]*) --\s*$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """Split a queries file into ``{name: statement}``; comments inside a block are kept."""
    queries: dict[str, str] = {}
    matches = list(_HEADER.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        # No string literal in our SQL spans lines, so stripping each line changes no value.
        lines = (line.strip() for line in body.splitlines())
        statement = "\n".join(line for line in lines if line and not line.startswith("--"))
        statement = statement.strip().rstrip(";").strip()
        name = match.group(1)
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        if not statement:
            raise ValueError(f"query {name!r} has no statement")
        queries[name] = statement
    return queries


def _load() -> dict[str, str]:
    return parse_queries(resources.files("sendonce.store").joinpath("sql/queries.sql").read_text("utf-8"))


QUERIES = _load()


def query(name: str) -> LiteralString:
    """The statement called ``name``. The text comes from our own package file, never from input."""
    return QUERIES[name]
