"""RFC 9457 problem details: every error the API returns, with a stable ``type`` per kind."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import psycopg_pool
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sendonce.errors import Conflict, DatabaseUnavailable, InvalidInput, NotFound
from sendonce.store.database import is_unavailable

logger = logging.getLogger(__name__)

PROBLEM_BASE = "https://sendonce.dev/problems/"
PROBLEM_JSON = "application/problem+json"

_TITLES = {
    400: ("bad-request", "Bad request"),
    401: ("unauthorized", "Authentication required"),
    403: ("forbidden", "Forbidden"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    409: ("conflict", "Conflict"),
    413: ("payload-too-large", "Request body too large"),
    415: ("unsupported-media-type", "Unsupported media type"),
    422: ("validation-error", "Invalid input"),
    429: ("rate-limited", "Too many requests"),
    500: ("internal-error", "Internal error"),
    503: ("service-unavailable", "Service unavailable"),
}


class Problem(Exception):
    """An error answer. ``kind`` becomes the problem ``type``; ``extra`` adds members."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        kind: str | None = None,
        title: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        default_kind, default_title = _TITLES.get(status, ("error", "Error"))
        self.status = status
        self.kind = kind or default_kind
        self.title = title or default_title
        self.detail = detail
        self.headers = dict(headers or {})
        self.extra = extra
        super().__init__(detail)


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_JSON

    def render(self, content: Any) -> bytes:
        # ASCII-escaped: a detail quoting bad input (a lone surrogate...) can always be encoded.
        return json.dumps(content, ensure_ascii=True, separators=(",", ":"), default=str).encode("ascii")


def problem_response(problem: Problem, instance: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + problem.kind,
        "title": problem.title,
        "status": problem.status,
        "detail": problem.detail,
    }
    if instance:
        body["instance"] = instance
    body.update(problem.extra)
    return ProblemResponse(body, status_code=problem.status, headers=problem.headers)


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def validation_errors(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    out = []
    for error in errors:
        message = str(error.get("msg", "invalid"))
        field = _field(error.get("loc", ()))
        if error.get("type") == "json_invalid":
            # its location is the character where parsing stopped, not a field: the body is
            loc = [p for p in error.get("loc", ()) if p != "body"]
            where = f" (at character {loc[0]})" if loc and isinstance(loc[0], int) else ""
            message = "the body is not valid JSON" + where + ": " + str(error.get("ctx", {}).get("error", message))
            field = "body"
        out.append({"field": field, "message": message})
    return out


def unavailable(why: str = "the database is unavailable right now") -> Problem:
    return Problem(
        503,
        # Not "nothing was written": the connection can drop during COMMIT, after PostgreSQL committed.
        f"{why}; the request may or may not have been written: retry later "
        "(a POST with the same Idempotency-Key, so that the retry cannot do it twice)",
        headers={"Retry-After": "2"},
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return problem_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = validation_errors(exc.errors())
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
        return problem_response(Problem(422, detail, errors=errors), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return problem_response(Problem(exc.status_code, detail, headers=exc.headers), request.url.path)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
        return problem_response(Problem(404, str(exc)), request.url.path)

    @app.exception_handler(Conflict)
    async def _conflict(request: Request, exc: Conflict) -> JSONResponse:
        return problem_response(Problem(409, str(exc)), request.url.path)

    @app.exception_handler(InvalidInput)
    async def _invalid(request: Request, exc: InvalidInput) -> JSONResponse:
        return problem_response(Problem(422, str(exc)), request.url.path)

    @app.exception_handler(DatabaseUnavailable)
    async def _db_down(request: Request, exc: DatabaseUnavailable) -> JSONResponse:
        return problem_response(unavailable(), request.url.path)

    @app.exception_handler(psycopg.Error)
    async def _psycopg(request: Request, exc: psycopg.Error) -> JSONResponse:
        if isinstance(exc, psycopg.errors.DataError):
            # A value PostgreSQL cannot store (a NUL character, a number out of range): bad input.
            # The statement failed, so its transaction wrote nothing.
            return problem_response(
                Problem(422, f"a value cannot be stored: {exc.diag.message_primary or exc}"), request.url.path
            )
        if isinstance(exc, psycopg.errors.ProgramLimitExceeded):
            # a value too large for PostgreSQL's limits (an index entry holds about 2.7 kB): bad input
            return problem_response(
                Problem(422, f"a value is too large to store: {exc.diag.message_primary or exc}"), request.url.path
            )
        if is_unavailable(exc):
            logger.warning("database unavailable: %s", exc)
            return problem_response(unavailable(), request.url.path)
        logger.exception("database error")
        return problem_response(Problem(500, "an internal error occurred"), request.url.path)

    @app.exception_handler(psycopg.errors.TransactionRollback)
    async def _conflict_in_db(request: Request, exc: psycopg.errors.TransactionRollback) -> JSONResponse:
        # A deadlock or serialization failure with a concurrent request: this one was rolled back.
        return problem_response(
            Problem(
                409,
                "a concurrent request touched the same data; nothing was written, retry",
                kind="concurrent-update",
                title="Concurrent update",
                headers={"Retry-After": "1"},
            ),
            request.url.path,
        )

    @app.exception_handler(UnicodeEncodeError)
    async def _unicode(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # Raised before a value reaches PostgreSQL (a lone surrogate in a JSON string): bad input,
        # and the transaction it was in rolled back.
        return problem_response(Problem(422, "a text value is not valid Unicode (a lone surrogate?)"), request.url.path)

    @app.exception_handler(psycopg_pool.PoolTimeout)
    async def _pool(request: Request, exc: psycopg_pool.PoolTimeout) -> JSONResponse:
        return problem_response(unavailable(), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return problem_response(Problem(500, "an internal error occurred"), request.url.path)
