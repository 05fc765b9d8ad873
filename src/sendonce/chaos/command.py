"""``python -m sendonce.chaos`` (and ``sendonce chaos``): run scenarios, print the table, exit non-zero
if any invariant broke."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table
from starlette.requests import ClientDisconnect

from sendonce.chaos.broken import BUILDS
from sendonce.chaos.database import DEFAULT_RESTART_COMMAND, ChaosServer
from sendonce.chaos.harness import Context, Options, Result
from sendonce.chaos.scenarios import FIXED_TRANSPORT, SCENARIOS, TRANSPORTS
from sendonce.faults import Faults

EXIT_OK, EXIT_BROKEN, EXIT_USAGE, EXIT_SKIPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(
        prog="python -m sendonce.chaos",
        description="Fault-injection runs against real parts: PostgreSQL, sendonce worker and api processes, "
        "a real SMTP inbox and a Resend-compatible API. Exit code 1 if any invariant breaks, "
        "3 if a scenario asked for could not run here.",
        epilog="Full run: python -m sendonce.chaos --scenario kills --recipients 50000 --kills 200",
    )
    add = p.add_argument
    add("--scenario", action="append", help=f"{', '.join(SCENARIOS)} or all (repeatable, comma-separated)")
    add("--recipients", type=int, default=d.recipients, help="campaign recipients (default %(default)s)")
    add("--kills", type=int, help="external SIGKILLs per scenario (default: kills 10, http-faults 3, others 0)")
    add("--workers", type=int, default=d.workers, help="sendonce worker processes (default %(default)s)")
    add("--concurrency", type=int, default=d.concurrency, help="lanes per worker (default %(default)s)")
    add("--batch-size", type=int, default=d.batch_size, help="rows per claim (default %(default)s)")
    add("--lease", type=float, default=d.lease, help="worker lease, seconds (default %(default)s)")
    add("--apis", type=int, default=d.apis, help="sendonce api processes (default %(default)s)")
    add("--signups", type=int, default=d.signups, help="signup addresses (default %(default)s)")
    add("--transport", choices=("smtp", "resend"), help="only this transport where a scenario can use either")
    add("--restarts", type=int, default=d.restarts, help="database restarts (default %(default)s)")
    add("--down", type=float, default=d.down, help="seconds the embedded server stays down (default %(default)s)")
    add("--partitions", type=int, default=d.partitions, help="partitions of one worker (default %(default)s)")
    add(
        "--partition-mode",
        choices=("pause", "cut", "both"),
        default=d.partition_mode,
        help="drop the isolated worker's packets (pause) or reset its connections (cut); both: they "
        "alternate, the seed says which comes first (default %(default)s)",
    )
    add("--pauses", type=int, default=d.pauses, help="campaign pause/resume cycles (default %(default)s)")
    add("--opt-outs", type=int, default=d.opt_outs, help="opt-outs during the send (default %(default)s)")
    add("--upgrades", type=int, default=d.upgrades, help="concurrent `db upgrade` processes (default %(default)s)")
    add("--faults", help="SENDONCE_FAULTS for the workers (default: chosen per scenario)")
    add("--broken", choices=BUILDS, help="run a deliberately broken worker build (the run must fail)")
    add("--seed", type=int, help="random seed (default: from the clock; printed)")
    add("--timeout", type=float, help="longest chaos phase per scenario, seconds")
    add(
        "--database-url",
        default=os.environ.get("SENDONCE_DATABASE_URL"),
        help="external PostgreSQL (default SENDONCE_DATABASE_URL; unset: the embedded server)",
    )
    add("--home", default=os.environ.get("SENDONCE_HOME", ".sendonce"), help="SENDONCE_HOME of the embedded server")
    add("--allow-pg-restart", action="store_true", help="allow restarting an external server")
    add("--pg-restart-command", default=DEFAULT_RESTART_COMMAND)
    add("--log-dir", help="where process logs go (default $SENDONCE_HOME/chaos/<time>)")
    add("--json", help="also write the results to this JSON file")
    add("--keep-db", action="store_true", help="keep each scenario's database for inspection")
    return p


def _scenarios(values: list[str] | None) -> list[str]:
    names: list[str] = []
    for value in values or ["all"]:
        for name in value.split(","):
            name = name.strip()
            if name == "all":
                names += [n for n in SCENARIOS if n not in names]
            elif name in SCENARIOS:
                if name not in names:
                    names.append(name)
            else:
                raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}, all")
    return names


def _plan(names: list[str], transport: str | None) -> list[tuple[str, str]]:
    plan = []
    for name in names:
        if transport is None or name in FIXED_TRANSPORT:
            plan += [(name, t) for t in TRANSPORTS[name]]
        else:
            plan.append((name, transport))
    return plan


@contextmanager
def _terminate_gracefully() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does: through every ``finally``, so no process is left behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(argv: list[str]) -> int:
    """Run the selected scenarios; 0 when every invariant held, 1 when one broke, 2 on a usage error,
    3 when none broke but a scenario asked for could not run here (a restart the server does not allow),
    130 when interrupted (SIGINT or SIGTERM: every process the run started is stopped first)."""
    try:
        args = _parser().parse_args(argv)
        names = _scenarios(args.scenario)
    except SystemExit as exc:
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    console = Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False, highlight=False)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    options = Options(
        recipients=args.recipients,
        kills=args.kills,
        workers=args.workers,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        lease=args.lease,
        apis=args.apis,
        signups=args.signups,
        transport=args.transport,
        restarts=args.restarts,
        down=args.down,
        partitions=args.partitions,
        partition_mode=args.partition_mode,
        pauses=args.pauses,
        opt_outs=args.opt_outs,
        upgrades=args.upgrades,
        faults=args.faults,
        broken=args.broken,
        seed=seed,
        timeout=args.timeout,
        keep_db=args.keep_db,
    )
    if options.recipients < 20 or options.workers < 1 or options.apis < 1:
        console.print("[red]error:[/red] need at least 20 recipients, one worker and one API process")
        return EXIT_USAGE
    try:
        Faults(options.faults)  # what every worker would refuse at start-up, refused here once
    except ValueError as exc:
        console.print(f"[red]error:[/red] --faults: {exc}")
        return EXIT_USAGE
    home = Path(args.home).resolve()
    run_dir = Path(args.log_dir) if args.log_dir else home / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("sendonce").setLevel(logging.WARNING)
    # A worker killed mid-request makes the local provider log a ClientDisconnect: expected here.
    # (A filter, not a level: uvicorn re-applies its logging configuration whenever a server starts.)
    logging.getLogger("uvicorn.error").addFilter(_not_a_client_disconnect)

    results: list[Result] = []
    try:
        with _terminate_gracefully():
            _run_all(console, args, names, options, run_dir, results)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process this run started was stopped[/yellow]")
        return EXIT_INTERRUPTED
    if args.json:
        report = [{**dataclasses.asdict(r), "verdict": r.verdict, "ok": r.ok} for r in results]
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    broken = [r for r in results if not r.ok]
    if broken:
        console.print(f"[red bold]✘ {len(broken)} scenario(s) broke an invariant[/red bold] (seed {seed})")
        return EXIT_BROKEN
    skipped = [r for r in results if r.skipped is not None]
    if skipped:
        # Not a pass: what was asked for was not tested.
        ran = len(results) - len(skipped)
        console.print(
            f"[yellow bold]✘ {len(skipped)} scenario(s) did not run[/yellow bold] "
            f"({', '.join(r.scenario for r in skipped)}); every invariant held in the {ran} that did (seed {seed})"
        )
        return EXIT_SKIPPED
    console.print(f"[green bold]✔ every invariant held[/green bold] (seed {seed})")
    return EXIT_OK


def _not_a_client_disconnect(record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], ClientDisconnect))


def _run_all(
    console: Console,
    args: argparse.Namespace,
    names: list[str],
    options: Options,
    run_dir: Path,
    results: list[Result],
) -> None:
    seed = options.seed
    server = ChaosServer.open(
        database_url=args.database_url,
        home=Path(args.home).resolve(),
        allow_restart=args.allow_pg_restart,
        restart_command=args.pg_restart_command,
    )
    try:
        build = f", [bold red]broken build: {args.broken}[/bold red]" if args.broken else ""
        console.print(f"[bold]sendonce chaos[/bold]: {server.describe()}; seed {seed}{build}")
        console.print(f"logs: {run_dir}")
        ctx = Context(options, server, run_dir, say=lambda text: console.print(text))
        for name, transport in _plan(names, args.transport):
            console.print(f"• {name} ({transport}) …")
            started = time.monotonic()
            try:
                result = SCENARIOS[name](ctx, transport)
            except KeyboardInterrupt:
                raise
            except Exception as exc:
                result = Result(name, transport, server.kind, options.recipients, seed=seed)
                result.error = f"{type(exc).__name__}: {exc}"
                result.duration = time.monotonic() - started
                (run_dir / f"{name}-{transport}-error.txt").write_text(traceback.format_exc())
            results.append(result)
            _print_result(console, result)
    finally:
        server.close()
    console.print(_table(results, server.kind, args.broken))


def _print_result(console: Console, r: Result) -> None:
    if r.skipped is not None:
        console.print(f"  [yellow]skipped[/yellow]: {r.skipped}")
        return
    if r.error is not None:
        console.print(f"  [red]✘ error[/red]: {r.error} (see {r.log_dir})")
    for check in r.checks:
        mark = "[green]✔[/green]" if check.ok else "[red]✘[/red]"
        console.print(f"  {mark} {check.name}" + (f" — {check.detail}" if check.detail else ""))
    for note in r.notes:
        console.print(f"  · {note}")
    phases = r.numbers.get("phases")
    if phases:
        console.print("  · timeline: " + ", ".join(f"{name} at {t:g}s" for name, t in phases.items()))


def _table(results: list[Result], postgres: str, broken: str | None) -> Table:
    title = f"sendonce chaos ({postgres} PostgreSQL" + (f", broken build {broken})" if broken else ")")
    table = Table(title=title)
    for column in (
        "scenario",
        "transport",
        "recipients",
        "kills",
        "restarts",
        "faults injected",
        "delivered (campaign + signups)",
        "duplicates (recorded / unrecorded)",
        "lost",
        "duration",
        "verdict",
    ):
        table.add_column(column, overflow="fold")
    for r in results:
        kills = f"{r.kills}" + (f" + {r.hook_kills} hook" if r.hook_kills else "")
        signups = int(r.numbers.get("delivered_signups", 0))
        verdict = {"pass": "[green]pass[/green]", "FAIL": "[red]FAIL[/red]"}.get(r.verdict, "[yellow]skipped[/yellow]")
        table.add_row(
            r.scenario,
            r.transport,
            f"{r.recipients:,}",
            kills,
            str(r.restarts),
            r.skipped or r.error or r.faults,
            f"{r.delivered - signups:,} + {signups}",
            f"{r.duplicates} ({r.recorded} / {r.unrecorded})",
            str(r.lost),
            f"{r.duration:.1f}s",
            verdict,
        )
    return table
