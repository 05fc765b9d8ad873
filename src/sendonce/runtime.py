"""The one place that wires settings to parts: database, transport, composer, worker."""

from __future__ import annotations

from sendonce.delivery.compose import Composer
from sendonce.delivery.worker import Worker, WorkerConfig
from sendonce.errors import ConfigurationError
from sendonce.faults import Faults
from sendonce.settings import Settings
from sendonce.store.database import resolve_database_url
from sendonce.transports.base import Transport
from sendonce.transports.registry import transport_from_url


def database_url(settings: Settings) -> str:
    return resolve_database_url(settings.database_url, settings.home)


def build_transport(settings: Settings, *, concurrency: int = 10) -> Transport:
    if not settings.transport_url:
        raise ConfigurationError(
            "SENDONCE_TRANSPORT_URL is not set: say where mail goes, e.g. smtp://127.0.0.1:1025 "
            "or resend://API_KEY@api.resend.com"
        )
    return transport_from_url(settings.transport_url, concurrency=concurrency)


def build_composer(settings: Settings) -> Composer:
    return Composer()


def build_worker(
    settings: Settings, config: WorkerConfig, *, url: str | None = None, faults: Faults | None = None
) -> Worker:
    transport = build_transport(settings, concurrency=config.concurrency)
    return Worker(
        url or database_url(settings),
        transport,
        config,
        composer=build_composer(settings),
        faults=faults if faults is not None else Faults.from_env(),
    )
