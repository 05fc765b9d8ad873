from __future__ import annotations

import re
from pathlib import Path

import pytest

from sendonce.store.queries import QUERIES, parse_queries

SRC = Path(__file__).resolve().parents[2] / "src" / "sendonce"


def test_parser_splits_named_blocks_and_drops_comments() -> None:
    text = """
-- first --
-- what it does
SELECT 1;

-- second_one --
-- a comment
SELECT 2
  FROM x; -- trailing comments stay, they are SQL
"""
    assert parse_queries(text) == {
        "first": "SELECT 1",
        "second_one": "SELECT 2\nFROM x; -- trailing comments stay, they are SQL",
    }


def test_every_statement_fits_psycopgs_statement_cache() -> None:
    # psycopg parses a statement's placeholders again on every execution when it is longer than this
    # (or has more parameters): the claim, run for every batch, once did.
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH, MAX_CACHED_STATEMENT_PARAMS

    for name, statement in QUERIES.items():
        assert len(statement.encode()) <= MAX_CACHED_STATEMENT_LENGTH, name
        assert len(set(re.findall(r"%\(([a-z_]+)\)s", statement))) <= MAX_CACHED_STATEMENT_PARAMS, name


def test_parser_refuses_duplicates_and_empty_blocks() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse_queries("-- a --\nSELECT 1;\n-- a --\nSELECT 2;")
    with pytest.raises(ValueError, match="no statement"):
        parse_queries("-- a --\n-- only a comment\n")


def test_every_query_used_by_the_code_exists_and_every_query_is_used() -> None:
    called: set[str] = set()
    quoted: set[str] = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        called |= set(re.findall(r'query\("([a-z_]+)"\)', text))
        quoted |= set(re.findall(r'"([a-z_]+)"', text))
    assert called - set(QUERIES) == set()
    assert set(QUERIES) - quoted == set(), "queries nothing refers to"


def test_queries_only_use_named_parameters() -> None:
    for name, statement in QUERIES.items():
        assert "%s" not in statement, name
        assert not re.search(r"\{[A-Za-z_][A-Za-z0-9_]*\}", statement), f"{name}: looks like string formatting"


def test_the_claim_answers_with_the_fields_of_a_claimed_delivery_in_order() -> None:
    # claim_batch builds each ClaimedDelivery from its row by position (no dict per row).
    import dataclasses

    from sendonce.store.outbox import ClaimedDelivery

    last_select = QUERIES["claim_batch"].rsplit("SELECT", 1)[1].split("FROM", 1)[0]
    columns = [column.strip() for column in last_select.split(",")]
    assert columns == [field.name for field in dataclasses.fields(ClaimedDelivery)]
