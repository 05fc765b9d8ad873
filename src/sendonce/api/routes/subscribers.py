"""Subscribers: JSON batch upsert and CSV import, with per-row results."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from sendonce.api.deps import CurrentAccount, Db
from sendonce.api.idempotency import idempotent
from sendonce.api.models import (
    BIGINT_MAX,
    SUBSCRIBER_STATUSES,
    SubscriberResult,
    SubscribersIn,
    SubscribersOut,
)
from sendonce.api.problems import Problem
from sendonce.api.services import services_of
from sendonce.domain.addresses import InvalidAddress, parse_address
from sendonce.domain.states import SubscriberStatus
from sendonce.store import lists as list_store
from sendonce.store.database import Conn
from sendonce.store.subscribers import OPTIN_PURPOSE, SubscriberInput, UpsertResult, upsert_subscribers

router = APIRouter(tags=["subscribers"])

IMPORT_CHUNK = 5000


class RowError(ValueError):
    pass


def _list_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError("lists must be an array of list ids")
    ids = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= BIGINT_MAX:
            raise RowError(f"lists: {item!r} is not a list id")
        ids.append(item)
    return ids


MAX_ATTRIBUTES_BYTES = 8192
MAX_ATTRIBUTES_DEPTH = 32
# NUL escaped by JSON (jsonb refuses it), not the text \u0000 (its backslash is escaped: \\u0000)
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` levels deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _attributes(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RowError("attributes must be an object")
    if not all(isinstance(k, str) and k.isidentifier() and len(k) <= 64 for k in value):
        raise RowError("attribute names must be identifiers (letters, digits, _) of at most 64 characters")
    if _deeper_than(value, MAX_ATTRIBUTES_DEPTH):
        # Every later step that walks the value (our checks, psycopg's JSON dumps) recurses, each from
        # deeper in the stack: a value the body parser just took could fail any of them.
        raise RowError(f"attributes must not be nested more than {MAX_ATTRIBUTES_DEPTH} levels deep")
    try:
        encoded = json.dumps(value, allow_nan=False)
        json.dumps(value, ensure_ascii=False).encode()  # a lone surrogate: jsonb cannot hold it
    except (TypeError, ValueError):
        raise RowError("attributes must be JSON values (no NaN or Infinity, valid Unicode)") from None
    if len(encoded) > MAX_ATTRIBUTES_BYTES or _ESCAPED_NUL.search(encoded):
        raise RowError(f"attributes must be at most {MAX_ATTRIBUTES_BYTES} bytes of JSON, without NUL characters")
    return value


def _encodable(value: Any) -> bool:
    """False for strings PostgreSQL cannot store: lone surrogates, NUL."""
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def _echo(text: str) -> str:
    """Input quoted back in an answer: as given, or escaped where it cannot be encoded (a lone
    surrogate, a NUL). Quoted raw, it made the answer fail after the good rows had been written."""
    if _encodable(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def parse_row(email: Any, name: Any, status: Any, lists: Any, attributes: Any = None) -> SubscriberInput:
    if not isinstance(email, str):
        raise RowError("email is required and must be a string")
    if not _encodable(email) or not _encodable(name):
        raise RowError("text must be valid Unicode without NUL characters")
    try:
        address = parse_address(email)
    except InvalidAddress as exc:
        raise RowError(str(exc)) from None
    if name is not None and (not isinstance(name, str) or len(name) > 200):
        raise RowError("name must be a string of at most 200 characters")
    if isinstance(name, str) and "\x00" in name:
        raise RowError("name must not contain NUL characters")
    if status is not None and (not isinstance(status, str) or status not in SUBSCRIBER_STATUSES):
        raise RowError(f"status must be one of {', '.join(sorted(SUBSCRIBER_STATUSES))}")
    return SubscriberInput(
        address=address,
        name=name.strip() or None if isinstance(name, str) else None,
        status=SubscriberStatus(status) if status is not None else None,
        list_ids=_list_ids(lists),
        attributes=_attributes(attributes),
    )


def confirm_url_maker(request: Request, account_id: int) -> Callable[[int, int], str]:
    """Signed links that confirm a double opt-in membership."""
    services = services_of(request)

    def make(list_id: int, subscriber_id: int) -> str:
        token = services.keys.sign(OPTIN_PURPOSE, {"a": account_id, "l": list_id, "s": subscriber_id})
        return f"{services.settings.public_url.rstrip('/')}/v1/lists/confirm?token={token}"

    return make


async def _apply(
    conn: Conn,
    account_id: int,
    parsed: list[tuple[int, SubscriberInput]],
    *,
    preconfirm: bool,
    confirm_url: Callable[[int, int], str],
    optin_ttl: timedelta,
    resubscribe: bool = False,
) -> list[tuple[int, SubscriberInput, UpsertResult]]:
    results = await upsert_subscribers(
        conn,
        account_id,
        [row for _, row in parsed],
        preconfirm=preconfirm,
        resubscribe=resubscribe,
        confirm_url=confirm_url,
        optin_ttl=optin_ttl,
    )
    return [(index, row, r) for (index, row), r in zip(parsed, results, strict=True)]


@router.post("/v1/subscribers", response_model=SubscribersOut)
async def upsert(body: SubscribersIn, request: Request, account: CurrentAccount, conn: Db) -> Response:
    """Upsert subscribers by address. Bad rows are reported, good rows kept.

    200 when at least one row was written (check ``errors``), 422 when every row was bad (nothing written).
    """
    return await idempotent(request, conn, account.account_id, lambda: _upsert(body, account.account_id, conn, request))


async def _upsert(body: SubscribersIn, account_id: int, conn: Conn, request: Request) -> Response:
    results: list[SubscriberResult | None] = [None] * len(body.subscribers)
    parsed: list[tuple[int, SubscriberInput]] = []
    for index, row in enumerate(body.subscribers):
        try:
            parsed.append((index, parse_row(row.email, row.name, row.status, row.lists, row.attributes)))
        except RowError as exc:
            email = _echo(row.email) if isinstance(row.email, str) else None
            results[index] = SubscriberResult(index=index, email=email, result="error", error=str(exc))
    known = await list_store.existing_lists(conn, account_id, [i for _, r in parsed for i in r.list_ids])
    good: list[tuple[int, SubscriberInput]] = []
    for index, sub in parsed:
        unknown = sorted(set(sub.list_ids) - known)
        if unknown:
            results[index] = SubscriberResult(
                index=index, email=sub.address.given, result="error", error=f"unknown list id(s): {unknown}"
            )
        else:
            good.append((index, sub))
    applied = (
        await _apply(
            conn,
            account_id,
            good,
            preconfirm=body.preconfirm,
            resubscribe=body.resubscribe,
            confirm_url=confirm_url_maker(request, account_id),
            optin_ttl=services_of(request).settings.optin_ttl,
        )
        if good
        else []
    )
    for index, sub, result in applied:
        note = None
        if result.kept_status is not None:
            note = f"status kept {result.kept_status}: send resubscribe=true if they gave their consent again"
        results[index] = SubscriberResult(
            index=index,
            email=sub.address.given,
            result="created" if result.created else "updated",
            id=result.subscriber_id,
            note=note,
        )
    final = [r for r in results if r is not None]
    created_ids = {r.id for r in final if r.result == "created"}
    out = SubscribersOut(
        created=len(created_ids),
        updated=len({r.id for r in final if r.result == "updated"} - created_ids),
        errors=sum(r.result == "error" for r in final),
        results=final,
    )
    if not good:
        raise Problem(422, "no valid subscriber in the request; nothing was written", **out.model_dump())
    return JSONResponse(out.model_dump())


@router.post(
    "/v1/subscribers/import",
    openapi_extra={"requestBody": {"content": {"text/csv": {"schema": {"type": "string"}}}, "required": True}},
)
async def import_csv(
    request: Request,
    account: CurrentAccount,
    conn: Db,
    list_id: Annotated[int, Query(alias="list", ge=1, le=BIGINT_MAX)],
    preconfirm: bool = False,
    resubscribe: bool = False,
) -> Response:
    """Import a CSV with an ``email`` column into a list; ``name`` and ``status`` columns are read too,
    and every other column becomes a subscriber attribute (a string).

    Good rows are kept, bad rows reported by line; 422 (nothing written) when no row is good.
    """
    aid = account.account_id
    return await idempotent(request, conn, aid, lambda: _import(request, aid, conn, list_id, preconfirm, resubscribe))


_RESERVED_COLUMNS = {"email": "email", "name": "name", "status": "status"}


MAX_IMPORT_ROWS = 1_000_000
"""Rows of one CSV import: it is one transaction, parsed whole before it is written. A larger file is
refused before anything is written (split it); within the byte limit a file could hold several
million short rows, which took gigabytes and minutes."""
_ERROR_ROWS_KEPT = 1000


def _parse_csv(raw: bytes, list_id: int) -> tuple[list[tuple[int, SubscriberInput]], list[dict[str, Any]], int]:
    """(good rows by line, the first bad rows, how many were bad). In a thread: a large file's parsing
    held the API's event loop, and every other request with it, for seconds."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise Problem(422, f"the file is not UTF-8 (byte {exc.start}); nothing was written") from None
    # newline="": the csv module reads the line ends itself (a file saved with bare CRs, by old Mac
    # software, was "new-line character seen in unquoted field")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
    except csv.Error as exc:
        raise Problem(422, f"not a CSV file: {exc}") from None
    # email, name and status in any case; every other column is an attribute, named as written
    # (a template reads attributes.firstName, not attributes.firstname)
    fields = [_RESERVED_COLUMNS.get(f.strip().lower(), f.strip()) for f in header or []]
    if "email" not in fields:
        raise Problem(422, "the CSV has no 'email' column (the first line must name the columns)")
    # Checked once, up front: a column whose name cannot be an attribute failed only the rows where
    # it had a value, and the file was half imported.
    for name in fields:
        if name and name not in _RESERVED_COLUMNS and not (name.isidentifier() and len(name) <= 64):
            raise Problem(
                422,
                f"column {name[:80]!r} cannot be an attribute name (letters, digits and _, at most 64 "
                "characters); nothing was written",
            )
    duplicated = sorted({f for f in fields if f and fields.count(f) > 1})
    if duplicated:
        raise Problem(422, f"the CSV names column(s) {duplicated} more than once; nothing was written")
    errors: list[dict[str, Any]] = []
    bad = 0
    pending: list[tuple[int, SubscriberInput]] = []
    line = 1
    try:
        for line, values in enumerate(reader, start=2):
            if line - 1 > MAX_IMPORT_ROWS:
                raise Problem(413, f"the file has more than {MAX_IMPORT_ROWS:,} rows; split it; nothing was written")
            if not values:
                continue  # a blank line
            if len(values) > len(fields):
                bad += 1
                if len(errors) < _ERROR_ROWS_KEPT:
                    errors.append(
                        {
                            "line": line,
                            "email": values[fields.index("email")],  # more values than fields: it is there
                            "error": f"the row has {len(values)} fields, the header {len(fields)}",
                        }
                    )
                continue
            row = dict(zip(fields, values, strict=False))
            unnamed = [v for f, v in zip(fields, values, strict=False) if not f and v.strip()]
            try:
                if unnamed:  # columns without a name (a trailing comma) may only be empty
                    raise RowError(f"a value under a column with no name: {unnamed[0][:80]!r}")
                pending.append(
                    (
                        line,
                        parse_row(
                            (row.get("email") or "").strip(),
                            row.get("name") or None,
                            row.get("status") or None,
                            [list_id],
                            {k: v for k, v in row.items() if k and k not in _RESERVED_COLUMNS and v} or None,
                        ),
                    )
                )
            except RowError as exc:
                bad += 1
                if len(errors) < _ERROR_ROWS_KEPT:
                    errors.append({"line": line, "email": row.get("email"), "error": str(exc)})
    except csv.Error as exc:
        raise Problem(422, f"the CSV is malformed at line {line + 1}: {exc}; nothing was written") from None
    return pending, errors, bad


async def _import(
    request: Request, account_id: int, conn: Conn, list_id: int, preconfirm: bool, resubscribe: bool
) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ("text/csv", "application/csv", "text/plain"):
        raise Problem(415, "send the file as text/csv")
    if not await list_store.existing_lists(conn, account_id, [list_id]):
        raise Problem(422, f"unknown list id: {list_id}")
    raw = await request.body()
    pending, errors, bad = await asyncio.to_thread(_parse_csv, raw, list_id)
    del raw
    created_ids: set[int] = set()
    updated_ids: set[int] = set()
    kept: dict[int, str] = {}
    async with conn.transaction():  # all or nothing: a failure leaves no half import behind
        for start in range(0, len(pending), IMPORT_CHUNK):
            chunk = pending[start : start + IMPORT_CHUNK]
            applied = await _apply(
                conn,
                account_id,
                chunk,
                preconfirm=preconfirm,
                confirm_url=confirm_url_maker(request, account_id),
                optin_ttl=services_of(request).settings.optin_ttl,
                resubscribe=resubscribe,
            )
            for _, _, result in applied:
                (created_ids if result.created else updated_ids).add(result.subscriber_id)
                if result.kept_status is not None:
                    kept[result.subscriber_id] = result.kept_status
    created, updated = len(created_ids), len(updated_ids - created_ids)
    if not pending:
        raise Problem(
            422,
            "no valid row in the file; nothing was written",
            created=0,
            updated=0,
            errors=bad,
            error_rows=errors,
        )
    return JSONResponse(
        {
            "created": created,
            "updated": updated,
            "errors": bad,
            "error_rows": errors,
            # asked to be confirmed again and not applied (no resubscribe): they had opted out or bounced
            "kept_unsubscribed": sum(status == "unsubscribed" for status in kept.values()),
            "kept_bounced": sum(status == "bounced" for status in kept.values()),
        }
    )
