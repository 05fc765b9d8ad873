"""Campaign throughput, side by side, in one run on one machine.

    python bench/campaign.py [--quick] [--recipients N] [--workers 1,2,4] [--concurrency 5,10,20]
                             [--batch-size B] [--database-url URL] [--profile [WxC]] [--loop uvloop|asyncio]

For each setting (K worker processes x C connections per worker) it measures:

1. the physical limit: a bare aiosmtplib loop sending pre-rendered sendonce messages, no database;
   and the same with the pipelined exchange (RFC 2920) sendonce uses where the server offers it;
   and a lean claim-send-record loop: that pipelined loop over a table in PostgreSQL (claim 20 rows
   with SKIP LOCKED, send, record in groups), nothing else;
2. the baseline most teams build: one procrastinate job per recipient, K procrastinate workers x C;
3. sendonce: a campaign of N recipients approved in the database, K ``sendonce worker`` processes.

Every run sends to a fresh Postfix smtp-sink on 127.0.0.1 and is checked message by message at the
sink (and, for sendonce, in the database). sendonce's workers and the bare and lean loops run on the
same event loop (``--loop``, default asyncio: sendonce's own default). Results: bench/out/results[-TAG].md and
bench/out/throughput[-TAG].png. See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sobench import CACHE_DIR, OUT_DIR
from sobench.pg import external_server, recreate_database, start_scratch_server
from sobench.procs import CHILDREN, install_cleanup
from sobench.report import chart, fmt, header, machine_facts, profile_summary
from sobench.runners import (
    Context,
    RunResult,
    run_bare,
    run_lean,
    run_procrastinate,
    run_sendonce,
    setup_procrastinate,
    setup_sendonce,
    statement_table,
)
from sobench.sink import fetch_smtp_sink

KINDS = ("bare", "bare-pipelined", "lean", "lean-wait", "sendonce", "procrastinate")


def _ints(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 5,000 recipients, workers 1,2, concurrency 10")
    parser.add_argument("--recipients", type=int, help="campaign size (default 50,000; --quick 5,000)")
    parser.add_argument("--workers", type=_ints, help="worker processes to try (default 1,2,4; --quick 1,2)")
    parser.add_argument("--concurrency", type=_ints, help="connections per worker to try (default 5,10,20; --quick 10)")
    parser.add_argument("--batch-size", type=int, default=20, help="sendonce --batch-size (default 20)")
    parser.add_argument("--worker-args", default="", help="extra sendonce worker options, e.g. '--fast-records'")
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="asyncio",
        help="event loop of sendonce's workers and of the bare and lean loops alike (default asyncio, "
        "sendonce's default; procrastinate runs on its own, asyncio)",
    )
    parser.add_argument(
        "--database-url", help="PostgreSQL to use (default: a scratch server of its own under bench/.cache)"
    )
    parser.add_argument(
        "--baseline-recipients",
        type=int,
        help="jobs per procrastinate run (default: min(recipients, 10,000): it is slow; its rate is per job)",
    )
    parser.add_argument(
        "--pg-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra postgresql.conf line for the scratch server (repeatable), e.g. synchronous_commit=off",
    )
    parser.add_argument("--only", default=",".join(KINDS), help=f"contenders to run (default {','.join(KINDS)})")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="auto",
        help="also run sendonce once under py-spy (setting WxC, default 1x<max concurrency>) and report hot spots",
    )
    parser.add_argument("--tag", help="suffix of the output files (default: none; --quick: quick)")
    args = parser.parse_args(argv)
    args.recipients = args.recipients or (5_000 if args.quick else 50_000)
    args.workers = args.workers or ([1, 2] if args.quick else [1, 2, 4])
    args.concurrency = args.concurrency or ([10] if args.quick else [5, 10, 20])
    args.baseline_recipients = args.baseline_recipients or min(args.recipients, 10_000)
    args.only = [k.strip() for k in args.only.split(",") if k.strip()]
    if unknown := set(args.only) - set(KINDS):
        parser.error(f"--only: unknown {sorted(unknown)}")
    if args.tag is None and args.quick:
        args.tag = "quick"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_cleanup()
    command = shlex.join(["python", "bench/campaign.py", *(sys.argv[1:] if argv is None else argv)])
    suffix = f"-{args.tag}" if args.tag else ""
    results_path = OUT_DIR / f"results{suffix}.md"
    chart_path = OUT_DIR / f"throughput{suffix}.png"
    run_stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = CACHE_DIR / "logs" / run_stamp

    sink_binary = fetch_smtp_sink(CACHE_DIR)
    notes: list[str] = []
    if isinstance(sink_binary, str):
        notes.append(f"**SINK FALLBACK**: {sink_binary}; every figure below used aiosmtpd, which is far slower")
        print(f"\n!!! {notes[-1]}\n", file=sys.stderr)
        sink_binary = None

    print("starting PostgreSQL …", file=sys.stderr)
    server = (
        external_server(args.database_url)
        if args.database_url
        else start_scratch_server(CACHE_DIR, extra=dict(item.split("=", 1) for item in args.pg_setting))
    )
    ctx = Context(server, CACHE_DIR, sink_binary, args.batch_size, log_dir=log_dir)
    ctx.worker_args = ["--loop", args.loop, *shlex.split(args.worker_args)]
    os.environ["SOBENCH_LOOP"] = args.loop  # the bare and lean loops, started by ctx.env()
    settings = [(w, c) for w in args.workers for c in args.concurrency]
    results: list[RunResult] = []
    failures: list[str] = []
    setup_seconds = 0.0

    def report() -> str:
        text = render(args, command, server.description, notes, settings, results, failures, setup_seconds, ctx)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(text)
        draw(chart_path, settings, results, args)
        return text

    def attempt(label: str, fn: object, *fn_args: object, **kwargs: object) -> RunResult | None:
        print(f"  {label} …", file=sys.stderr, flush=True)
        try:
            result: RunResult = fn(*fn_args, **kwargs)  # type: ignore[operator]
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            failures.append(f"{label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None
        state = "ok" if result.ok else "PROBLEMS: " + "; ".join(result.problems)
        print(f"  {label}: {result.rate:,.0f} msg/s in {result.seconds:.2f}s, {state}", file=sys.stderr, flush=True)
        results.append(result)
        return result

    if "bare" in args.only:
        print(f"bare aiosmtplib loop, {args.recipients:,} messages per setting", file=sys.stderr)
        for w, c in settings:
            attempt(f"bare {w}x{c}", run_bare, ctx, w, c, args.recipients)
        report()
    if "bare-pipelined" in args.only:
        print(f"bare pipelined loop, {args.recipients:,} messages per setting", file=sys.stderr)
        for w, c in settings:
            attempt(f"bare pipelined {w}x{c}", run_bare, ctx, w, c, args.recipients, pipelined=True)
        report()
    if "lean" in args.only:
        print(f"lean claim-send-record loop, {args.recipients:,} rows per setting", file=sys.stderr)
        lean_url = recreate_database(server, "sobench_lean")
        for w, c in settings:
            attempt(f"lean {w}x{c}", run_lean, ctx, lean_url, w, c, args.recipients)
        report()
    if "lean-wait" in args.only:
        print(f"lean loop, waiting for each record before the next DATA, {args.recipients:,} rows", file=sys.stderr)
        lean_url = recreate_database(server, "sobench_lean")
        for w, c in settings:
            attempt(f"lean-wait {w}x{c}", run_lean, ctx, lean_url, w, c, args.recipients, wait=True)
        report()

    if "sendonce" in args.only or args.profile:
        print(f"sendonce: setting up {args.recipients:,} subscribers …", file=sys.stderr)
        setup_seconds = setup_sendonce(ctx, recreate_database(server, "sobench_sendonce"), args.recipients)
        print(f"  done in {setup_seconds:.1f}s", file=sys.stderr)
    if "sendonce" in args.only:
        for w, c in settings:
            attempt(f"sendonce {w}x{c}", run_sendonce, ctx, w, c, args.recipients)
        report()

    if "procrastinate" in args.only:
        print(f"procrastinate baseline, {args.baseline_recipients:,} jobs per setting", file=sys.stderr)
        setup_procrastinate(ctx, recreate_database(server, "sobench_procrastinate"))
        for w, c in settings:
            attempt(f"procrastinate {w}x{c}", run_procrastinate, ctx, w, c, args.baseline_recipients)
        report()

    if args.profile:
        w, c = (1, max(args.concurrency)) if args.profile == "auto" else _ints(args.profile.replace("x", ","))[:2]
        raw = log_dir / f"profile-{w}x{c}.txt"
        profiled = attempt(f"sendonce {w}x{c} under py-spy", run_sendonce, ctx, w, c, args.recipients, profile=raw)
        if profiled is not None:
            results.remove(profiled)  # sampling slows it: not a figure of the table
            ctx.profile = (profiled, raw)

    text = report()
    print(text)
    print(f"\nwritten: {results_path}, {chart_path}; logs in {log_dir}", file=sys.stderr)
    bad = failures or [r for r in results if not r.ok]
    return 1 if bad else 0


def _time_table(settings: list[tuple[int, int]], so: dict[tuple[int, int], RunResult]) -> list[str]:
    """Where the connections' time went, from the workers' own counters (their final WorkerStats)."""
    lines = [
        "### Where the connections' time went (the workers' own counters)",
        "",
        "Summed over the K workers. *Waiting for a record*: the time the K × C connections held a "
        "message's content until their previous accepted message was recorded (sendonce's rule over SMTP), "
        "as a share of K × C × (approval → sent). *Lane waits*: times a connection found no claimed row.",
        "",
        "| workers × conc. | claims | ms per claim | record groups | outcomes per group | ms per group "
        "| connections' time waiting for a record | lane waits |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in settings:
        r = so.get(key)
        t = r.extra.get("timings") if r is not None else None
        if r is None or not t or not t["claims"] or not t["record_groups"]:
            continue
        share = t["record_wait_seconds"] / (r.workers * r.concurrency * r.seconds)
        lines.append(
            f"| {key[0]} × {key[1]} | {t['claims']:,.0f} | {1000 * t['claim_seconds'] / t['claims']:.2f} "
            f"| {t['record_groups']:,.0f} | {r.recipients / t['record_groups']:.1f} "
            f"| {1000 * t['record_seconds'] / t['record_groups']:.2f} | {100 * share:.0f}% | {t['lane_waits']:,.0f} |"
        )
    return [*lines, ""]


def _by(results: list[RunResult], kind: str) -> dict[tuple[int, int], RunResult]:
    return {(r.workers, r.concurrency): r for r in results if r.kind == kind}


def draw(path: Path, settings: list[tuple[int, int]], results: list[RunResult], args: argparse.Namespace) -> None:
    series = {
        "bare aiosmtplib loop (limit)": {k: r.rate for k, r in _by(results, "bare").items()},
        "bare loop, pipelined (RFC 2920)": {k: r.rate for k, r in _by(results, "bare-pipelined").items()},
        "lean claim-send-record loop": {k: r.rate for k, r in _by(results, "lean").items()},
        "lean loop, waits for each record": {k: r.rate for k, r in _by(results, "lean-wait").items()},
        "sendonce": {k: r.rate for k, r in _by(results, "sendonce").items()},
        "sendonce, approval → last delivery": {
            k: rate for k, r in _by(results, "sendonce").items() if (rate := _to_last(r)) is not None
        },
        "procrastinate baseline": {k: r.rate for k, r in _by(results, "procrastinate").items()},
    }
    sinks = sorted({r.sink.split(" (")[0] for r in results}) or ["?"]
    title = (
        f"Campaign of {args.recipients:,} recipients (procrastinate: {args.baseline_recipients:,} jobs), "
        f"end to end, sink: {', '.join(sinks)}"
    )
    if results:
        chart(path, settings, series, title)


def _ratio(a: RunResult | None, b: RunResult | None) -> str:
    if a is None or b is None or not b.rate:
        return "–"
    return f"{a.rate / b.rate:.2f}"


OTHER_LOAD_WARNING = 0.2


def _other(r: RunResult | None) -> str:
    value = r.extra.get("other_cores") if r is not None else None
    if value is None:
        return "–"
    return f"{value:.2f}" + (" ⚠" if value > OTHER_LOAD_WARNING else "")


def _to_last(r: RunResult | None) -> float | None:
    last = r.extra.get("last_sent_s") if r is not None else None
    return r.recipients / last if r is not None and last else None


def _delivered(r: RunResult | None) -> str:
    if r is None:
        return "–"
    return ("✓ " if r.ok else "✗ ") + f"{r.delivered:,}/{r.recipients:,}"


def _loop_description(loop: str) -> str:
    if loop == "uvloop":
        from importlib.metadata import version

        return f"uvloop {version('uvloop')}"
    return "asyncio (Python's own)"


def render(
    args: argparse.Namespace,
    command: str,
    pg: str,
    notes: list[str],
    settings: list[tuple[int, int]],
    results: list[RunResult],
    failures: list[str],
    setup_seconds: float,
    ctx: Context,
) -> str:
    facts = machine_facts()
    sinks = sorted({r.sink for r in results})
    lines = header(
        "sendonce campaign benchmark",
        facts,
        command,
        pg,
        [
            f"sink: {'; '.join(sinks) or '(none yet)'}, on 127.0.0.1, one fresh sink per run; "
            "every figure counts its messages at the sink",
            f"campaign: {args.recipients:,} recipients, one text + HTML message each "
            f"(sendonce --batch-size {args.batch_size}{' ' + args.worker_args if args.worker_args else ''}); "
            f"procrastinate runs: {args.baseline_recipients:,} jobs",
            f"event loop: {_loop_description(args.loop)} for sendonce's workers and the bare and lean loops; "
            "procrastinate's workers run on asyncio (its own choice)",
            *notes,
        ],
    )
    bare, so, pq = _by(results, "bare"), _by(results, "sendonce"), _by(results, "procrastinate")
    piped, lean, lean_wait = _by(results, "bare-pipelined"), _by(results, "lean"), _by(results, "lean-wait")

    lines += [
        "## Throughput, end to end (messages per second)",
        "",
        "sendonce: approval → campaign `sent` (the recipient list is built meanwhile); procrastinate: first job "
        "deferred → last job finished (enqueued while the workers run); bare loop: first send → last send. "
        "Ratios use sendonce's approval → `sent`; 'to its last delivery' is approval → the last row's `sent_at` "
        "(the campaign is marked `sent` by a worker's next housekeeping round after that). "
        "sendonce pipelines (RFC 2920: MAIL, RCPT, DATA in one write) where the server offers it, as smtp-sink "
        "does; the limit named by the brief does not, so the pipelined bare loop is given too. The lean loop "
        "is that pipelined loop over a table in PostgreSQL (claim, send, record; nothing else): see its section, "
        "with the variant that waits for each record.",
        "",
        "| workers × concurrency | connections | bare loop (limit) | bare loop, pipelined | lean loop "
        "| procrastinate | sendonce "
        "| sendonce ÷ limit | sendonce ÷ pipelined loop | sendonce ÷ lean loop | sendonce ÷ procrastinate "
        "| sendonce to its last delivery "
        "| delivered (sink): bare / pipelined / lean / procrastinate / sendonce "
        "| other load, cores: bare / pipelined / lean / procr. / sendonce |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for key in settings:
        b, bp, ln, p, s = bare.get(key), piped.get(key), lean.get(key), pq.get(key), so.get(key)
        lines.append(
            f"| {key[0]} × {key[1]} | {key[0] * key[1]} | {fmt(b.rate if b else None)} "
            f"| {fmt(bp.rate if bp else None)} | {fmt(ln.rate if ln else None)} | {fmt(p.rate if p else None)} "
            f"| **{fmt(s.rate if s else None)}** | {_ratio(s, b)} | {_ratio(s, bp)} | {_ratio(s, ln)} "
            f"| {_ratio(s, p)} | {fmt(_to_last(s))} "
            f"| {_delivered(b)} / {_delivered(bp)} / {_delivered(ln)} / {_delivered(p)} / {_delivered(s)} "
            f"| {_other(b)} / {_other(bp)} / {_other(ln)} / {_other(p)} / {_other(s)} |"
        )
    lines += [
        "",
        "*Other load*: CPU used during the run by processes the run did not start or measure (from /proc/stat, "
        f"in cores out of {facts['nproc']}); ⚠ above {OTHER_LOAD_WARNING} core: the figure is skewed by someone "
        "else's work on the machine.",
        "",
    ]

    if so:
        lines += [
            "## sendonce, run by run",
            "",
            "List build = `built_at − started_at` (the last delivery row inserted; workers send meanwhile). "
            "CPU figures are milliseconds of CPU per message (workers: all K processes; PostgreSQL: the "
            "postmaster and all its processes, WAL writer and checkpointer included). PG exec = "
            "pg_stat_statements total execution time of sendonce's statements ÷ messages. CPU busy = all "
            f"measured CPU ÷ (wall time × {facts['nproc']} cores).",
            "",
            "| workers × conc. | msg/s | approval → sent s | approval → last delivery s | approval → start s "
            "| list build s "
            "| peak RSS per worker MiB | worker CPU ms/msg | PG exec ms/msg | PG CPU ms/msg | sink CPU ms/msg "
            "| CPU busy | log warnings/errors | DB counts |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for key in settings:
            r = so.get(key)
            if r is None:
                continue
            e = r.extra
            busy = sum(v for v in (e["worker_cpu_ms"], e["pg_cpu_ms"], e["sink_cpu_ms"]) if v) * r.recipients / 1000
            issues = e["log_issues"]["counts"]
            lines.append(
                f"| {key[0]} × {key[1]} | {r.rate:,.0f} | {r.seconds:.2f} | {fmt(e['last_sent_s'], '.2f')} "
                f"| {fmt(e['approval_to_start_s'], '.2f')} "
                f"| {fmt(e['build_s'], '.2f')} | {', '.join(f'{x:.0f}' for x in e['rss_mib'])} "
                f"| {e['worker_cpu_ms']:.3f} | {fmt(e['pg_exec_ms'], '.3f')} | {fmt(e['pg_cpu_ms'], '.3f')} "
                f"| {e['sink_cpu_ms']:.3f} | {100 * busy / (r.seconds * int(facts['nproc'])):.0f}% "
                f"| {', '.join(f'{k}: {v}' for k, v in issues.items()) or 'none'} "
                f"| {', '.join(f'{k} {v:,}' for k, v in sorted(e['counts'].items()))} |"
            )
        lines += ["", f"Setup (schema, {args.recipients:,} subscribers by bulk SQL): {setup_seconds:.1f}s.", ""]
        lines += _time_table(settings, so)
        widest = max(so.values(), key=lambda r: (r.workers * r.concurrency, r.rate))
        if widest.extra["statements"]:
            lines += [
                f"### sendonce's costliest statements ({widest.workers} × {widest.concurrency}, pg_stat_statements)",
                "",
                *statement_table(widest.extra["statements"], widest.recipients),
                "",
            ]

    if pq:
        lines += [
            "## procrastinate baseline, run by run",
            "",
            "| workers × conc. | jobs | msg/s | enqueue s (batch_defer, 1,000 a batch) | peak RSS per worker MiB "
            "| worker CPU ms/msg | PG exec ms/msg | PG CPU ms/msg | job statuses | log warnings/errors |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |",
        ]
        for key in settings:
            r = pq.get(key)
            if r is None:
                continue
            e = r.extra
            issues = e["log_issues"]["counts"]
            lines.append(
                f"| {key[0]} × {key[1]} | {r.recipients:,} | {r.rate:,.0f} | {e['enqueue_s']:.1f} "
                f"| {', '.join(f'{x:.0f}' for x in e['rss_mib'])} | {e['worker_cpu_ms']:.3f} "
                f"| {fmt(e['pg_exec_ms'], '.3f')} | {fmt(e['pg_cpu_ms'], '.3f')} "
                f"| {', '.join(f'{k} {v:,}' for k, v in sorted(e['jobs'].items()))} "
                f"| {', '.join(f'{k}: {v}' for k, v in issues.items()) or 'none'} |"
            )
        lines.append("")
        widest = max(pq.values(), key=lambda r: (r.workers * r.concurrency, r.rate))
        if widest.extra["statements"]:
            lines += [
                f"### procrastinate's costliest statements ({widest.workers} × {widest.concurrency})",
                "",
                *statement_table(widest.extra["statements"], widest.recipients),
                "",
            ]

    for title, loops in (("Bare loop", bare), ("Bare loop, pipelined", piped)):
        if not loops:
            continue
        any_bare = next(iter(loops.values()))
        lines += [
            f"## {title}",
            "",
            f"Message size on the wire: {any_bare.extra['size']:,} bytes (sendonce's composer, pre-rendered). "
            "Client CPU per message: "
            + ", ".join(f"{w}×{c}: {r.extra['client_cpu_ms']:.3f} ms" for (w, c), r in sorted(loops.items()))
            + "; sink CPU per message: "
            + ", ".join(f"{w}×{c}: {r.extra['sink_cpu_ms']:.3f} ms" for (w, c), r in sorted(loops.items()))
            + ".",
            "",
        ]

    if lean or lean_wait:
        lines += [
            "## Lean claim-send-record loop",
            "",
            "K processes (`bench/sobench/lean.py`), each with C pipelined connections (the bare pipelined loop's "
            "exchange and bytes), a claimer and two recorder connections: claims of 20 rows (`UPDATE … WHERE id IN "
            "(SELECT … ORDER BY id LIMIT 20 FOR UPDATE SKIP LOCKED)`), one pre-rendered message per row, accepted "
            "rows recorded in groups (`UPDATE … WHERE id = ANY(…)`), every commit durable; time from the go to the "
            "last record. 'waits': a connection sends no content while its previous accepted message is "
            "unrecorded (sendonce's rule over SMTP). Left out: composing each message, leases, fencing tokens, the "
            "opt-out and campaign re-check, per-row outcomes, timeouts around each reply, and the recipient list "
            "build (the loop's table, three columns and two indexes, is filled and vacuumed before the run).",
            "",
            "| loop | workers × conc. | msg/s | ÷ limit | ÷ pipelined loop | sendonce ÷ it | client CPU ms/msg "
            "| PG CPU ms/msg | sink CPU ms/msg | rows per record | delivered (sink) | other load, cores |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for label, loops in (("lean", lean), ("lean, waits", lean_wait)):
            for key in settings:
                r = loops.get(key)
                if r is None:
                    continue
                e = r.extra
                lines.append(
                    f"| {label} | {key[0]} × {key[1]} | {r.rate:,.0f} | {_ratio(r, bare.get(key))} "
                    f"| {_ratio(r, piped.get(key))} | {_ratio(so.get(key), r)} "
                    f"| {e['client_cpu_ms']:.3f} | {fmt(e['pg_cpu_ms'], '.3f')} "
                    f"| {e['sink_cpu_ms']:.3f} | {fmt(e['rows_per_record'], '.1f')} | {_delivered(r)} | {_other(r)} |"
                )
        lines.append("")

    if ctx.profile is not None:
        profiled, raw = ctx.profile
        table, samples = profile_summary(raw)
        lines += [
            f"## Where a sendonce worker's time goes ({profiled.workers} × {profiled.concurrency}, py-spy)",
            "",
            f"py-spy record --rate 100 (blocking: whole stacks) on worker 0 while it sent its share of a campaign "
            f"of {profiled.recipients:,} ({profiled.rate:,.0f} msg/s under sampling, approval → sent "
            f"{profiled.seconds:.1f}s; {samples:,} samples on CPU (idle waits on sockets are not sampled, "
            "idle executor threads are left out). Own % = time in that function itself; % of the on-CPU samples.",
            "",
            *table,
            "",
        ]

    problems = [f"- {r.kind} {r.workers}×{r.concurrency}: {'; '.join(r.problems)}" for r in results if r.problems]
    problems += [f"- {f}" for f in failures]
    for r in results:
        examples = r.extra.get("log_issues", {}).get("examples") if isinstance(r.extra, dict) else None
        if examples:
            problems.append(f"- {r.kind} {r.workers}×{r.concurrency} log lines, e.g.: " + " ⏎ ".join(examples[:3]))
    lines += ["## Problems seen", "", *(problems or ["none: every message of every run was counted at the sink"]), ""]
    lines += [
        "## Method",
        "",
        "- Each contender runs alone (one after the other) on the same machine, against a fresh sink; "
        "the sink, PostgreSQL, the workers and the harness share the cores.",
        "- Bare loop: K processes × C persistent aiosmtplib connections, MAIL, RCPT, DATA one round trip each, "
        "bytes rendered beforehand by sendonce's own composer code.",
        "- Bare loop, pipelined: the same bytes over plain asyncio streams with the exchange sendonce's SMTP "
        "channel uses when the server offers PIPELINING: MAIL, RCPT and DATA in one write, then the content.",
        "- Lean loops: see their section; a table of N rows made afresh for each run, in a database of its own.",
        "- procrastinate: one job per recipient with everything in its arguments (no database read in the job), "
        "Jinja2 templates compiled once per process, `EmailMessage` per job, a pool of persistent SMTP connections "
        "per worker process (a generous version of the pattern); jobs deferred with `batch_defer_async` while "
        "the workers run, in a database of its own on the same server.",
        "- sendonce: subscribers created by bulk SQL; a campaign created and approved (sendonce's CAS, which "
        "NOTIFYs the workers) once K `sendonce worker --no-upgrade` processes are listening; the time is "
        "`finished_at − scheduled_for` (both set by PostgreSQL). The deliveries table is emptied between runs.",
        "- Peak RSS: VmHWM of each worker process, read just before it is stopped.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        CHILDREN.cleanup()
        sys.exit(130)
