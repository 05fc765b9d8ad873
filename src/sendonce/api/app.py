"""The app factory. Its lifespan owns the connection pool; routes receive connections from it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sendonce import __version__
from sendonce.api import problems
from sendonce.api.abuse import AbuseDetector
from sendonce.api.metrics import ApiMetrics
from sendonce.api.middleware import BodyLimitMiddleware, DeadlineMiddleware
from sendonce.api.routes import (
    account,
    accounts,
    campaigns,
    lists,
    optin,
    outbox,
    signups,
    subscribers,
    suppressions,
    templates,
    unsubscribe,
    webhooks,
)
from sendonce.api.services import Services
from sendonce.errors import ConfigurationError
from sendonce.faults import Faults
from sendonce.runtime import feedback_policy, keyring, webhook_config
from sendonce.settings import Settings, load_settings
from sendonce.store.database import create_pool, resolve_database_url
from sendonce.store.migrations import behind, schema_version
from sendonce.store.rate_limits import Rate
from sendonce.store.signups import SignupLimits

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, database_url: str | None = None) -> FastAPI:
    settings = settings or load_settings()

    def deadline_for(path: str) -> float:
        seconds = settings.request_timeout.total_seconds()
        return seconds * 10 if path.endswith("/import") else seconds

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = database_url or resolve_database_url(settings.database_url, settings.home)
        # A request's transaction is idle only while its process works between statements (an
        # import under an Idempotency-Key parses its whole file in the key's transaction): one idle
        # past twice the longest deadline belongs to a process that lost its way to the server.
        idle = 2 * deadline_for("/import")
        pool = create_pool(url, min_size=1, max_size=20, name="sendonce-api", idle_in_transaction_timeout=idle)
        # Open without waiting: the API starts (and answers 503) even while PostgreSQL is down.
        await pool.open(wait=False)
        app.state.pool = pool
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(
        title="sendonce",
        version=__version__,
        description="Email delivered exactly once, on PostgreSQL.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    try:
        limits = SignupLimits(
            Rate.parse(settings.signup_rate_per_address), Rate.parse(settings.signup_rate_per_account)
        )
    except ValueError as exc:
        raise ConfigurationError(f"signup rate: {exc}") from None
    try:
        faults = Faults.from_env()
    except ValueError as exc:
        raise ConfigurationError(f"SENDONCE_FAULTS: {exc}") from None
    metrics = ApiMetrics()
    app.state.services = Services(
        settings=settings,
        keys=keyring(settings),
        limits=limits,
        metrics=metrics,
        detector=AbuseDetector(
            bucket_seconds=settings.abuse_window.total_seconds(),
            min_count=settings.abuse_min_repeats,
            sources_threshold=settings.abuse_sources,
        )
        if settings.abuse_detector
        else None,
        faults=faults,
        feedback=feedback_policy(settings),
        webhook_config=webhook_config(settings),
    )
    problems.install(app)

    def limit_for(path: str) -> int:
        return settings.max_import_bytes if path.endswith("/import") else settings.max_body_bytes

    app.add_middleware(BodyLimitMiddleware, limit_for=limit_for)

    app.add_middleware(DeadlineMiddleware, seconds_for=deadline_for)
    for module in (
        accounts,
        account,
        optin,
        lists,
        subscribers,
        campaigns,
        suppressions,
        templates,
        signups,
        outbox,
        unsubscribe,
        webhooks,
    ):
        app.include_router(module.router)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", tags=["health"])
    async def health(request: Request) -> Any:
        try:
            async with request.app.state.pool.connection(timeout=2.0) as conn:
                version = await schema_version(conn)
        except Exception as exc:
            logger.warning("health: database unavailable: %s", exc)
            return JSONResponse(
                {"status": "unavailable", "database": "unreachable"}, status_code=503, headers={"Retry-After": "2"}
            )
        # Reachable is not enough: on a schema older than the code (started with --no-upgrade before
        # `sendonce db upgrade` ran) every request would fail with a 500.
        reason = behind(version)
        if reason is not None:
            logger.warning("health: %s", reason)
            return JSONResponse(
                {"status": "unavailable", "database": "schema behind", "detail": reason},
                status_code=503,
                headers={"Retry-After": "30"},
            )
        return {"status": "ok", "database": "ok"}

    return app
