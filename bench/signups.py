"""Signup API latency under open-loop load: ``POST /v1/signups`` of real ``sendonce api`` processes.

    python bench/signups.py [--quick] [--api-processes 1] [--rates 100,200,…] [--duration 10]
                            [--database-url URL]

For NEW requests (a distinct address each: a signup, an idempotency window and an outbox row are
written) and for REPEATED ones (one address again and again, answered from the idempotency window),
it offers increasing request rates from a separate load process (sobench.loadgen: requests scheduled
by the clock, latency measured from the scheduled time) and reports throughput, p50 and p99 per
offered rate, and the highest rate served with p99 under 50 ms. Results: bench/out/signups[-TAG].md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import psycopg
from sobench import BENCH_DIR, CACHE_DIR, OUT_DIR
from sobench.pg import MARK, external_server, recreate_database, start_scratch_server
from sobench.procs import CHILDREN, OtherLoad, cpu_seconds, free_port, install_cleanup, peak_rss_mib, wait_port
from sobench.report import fmt, header, machine_facts

RATE_PER_ACCOUNT = "100000/s burst 100000"
DEFAULT_RATES = "50,100,150,200,250,300,400,500,600,800,1000,1500,2000,3000"
P99_TARGET_MS = 50.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 s per rate, rates 100,400,1000")
    parser.add_argument("--api-processes", type=int, default=1, help="sendonce api processes (default 1)")
    parser.add_argument("--rates", help=f"offered rates, requests/s (default {DEFAULT_RATES})")
    parser.add_argument("--duration", type=float, help="seconds per rate (default 10; --quick 3)")
    parser.add_argument("--database-url", help="PostgreSQL to use (default: a scratch server under bench/.cache)")
    parser.add_argument("--tag", help="suffix of the output file (default: none; --quick: quick)")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in (args.rates or ("100,400,1000" if args.quick else DEFAULT_RATES)).split(",")]
    args.duration = args.duration or (3.0 if args.quick else 10.0)
    if args.tag is None and args.quick:
        args.tag = "quick"
    return args


def start_apis(url: str, count: int, log_dir: Path) -> tuple[list[subprocess.Popen[Any]], list[int], dict[str, str]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p),
        "SENDONCE_DATABASE_URL": url,
        "SENDONCE_ADMIN_TOKEN": secrets.token_urlsafe(24),
        "SENDONCE_SECRET": secrets.token_urlsafe(48),
        "SENDONCE_HOME": str(CACHE_DIR / "home-signups"),
        "SENDONCE_SIGNUP_RATE_PER_ACCOUNT": RATE_PER_ACCOUNT,
        "SENDONCE_ABUSE_DETECTOR": "false",
        "SENDONCE_LOG_LEVEL": "warning",
    }
    procs, ports = [], []
    for i in range(count):
        port = free_port()
        proc = CHILDREN.spawn(
            [sys.executable, "-m", "sendonce.cli", "api", "--host", "127.0.0.1", "--port", str(port), "--no-upgrade"],
            env=env,
            log=log_dir / f"api-{i}.log",
        )
        wait_port(port, timeout=60, proc=proc)
        procs.append(proc)
        ports.append(port)
    return procs, ports, env


def step(ports: list[int], key: str, kind: str, rate: float, duration: float, tag: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "sobench.loadgen", "--ports", ",".join(map(str, ports)), "--key", key,
         "--kind", kind, "--rate", str(rate), "--duration", str(duration), "--tag", tag],
        env={**os.environ, "PYTHONPATH": str(BENCH_DIR)}, capture_output=True, text=True, check=True,
        timeout=duration + 120,
    )  # fmt: skip
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    expected = "201" if kind == "new" else "200"
    good = report["statuses"].get(expected, 0)
    report["ok"] = good
    report["errors"] = report["requests"] - good
    report["throughput"] = good / report["elapsed"] if report["elapsed"] else 0.0
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_cleanup()
    command = shlex.join(["python", "bench/signups.py", *(sys.argv[1:] if argv is None else argv)])
    suffix = f"-{args.tag}" if args.tag else ""
    out_path = OUT_DIR / f"signups{suffix}.md"
    log_dir = CACHE_DIR / "logs" / f"signups-{time.strftime('%Y%m%d-%H%M%S')}"

    print("starting PostgreSQL …", file=sys.stderr)
    server = external_server(args.database_url) if args.database_url else start_scratch_server(CACHE_DIR, pgss=False)
    url = recreate_database(server, "sobench_signups")
    from sendonce.store.migrations import upgrade

    upgrade(url)
    procs, ports, env = start_apis(url, args.api_processes, log_dir)
    base = f"http://127.0.0.1:{ports[0]}"
    answer = httpx.post(
        f"{base}/v1/accounts",
        headers={"Authorization": f"Bearer {env['SENDONCE_ADMIN_TOKEN']}"},
        json={"name": "bench", "from_email": "hello@sender.test"},
        timeout=30,
    )
    answer.raise_for_status()
    key = str(answer.json()["api_key"])
    # Warm up every process (imports, connection pools, prepared statements) outside the measurement.
    step(ports, key, "new", 50, 2, "warmup")
    step(ports, key, "repeat", 50, 2, "warmup")

    results: dict[str, list[dict[str, Any]]] = {"new": [], "repeat": []}
    for kind in ("new", "repeat"):
        print(f"{kind} requests", file=sys.stderr)
        for i, rate in enumerate(args.rates):
            cpu0 = sum(cpu_seconds(p.pid) for p in procs)
            pg0 = server.cpu_seconds()
            load = OtherLoad()
            report = step(ports, key, kind, rate, args.duration, f"{kind}{i}")
            api = sum(cpu_seconds(p.pid) for p in procs) - cpu0
            report["api_cpu"] = api / report["elapsed"]
            pg1 = server.cpu_seconds()
            pg = pg1 - pg0 if pg0 is not None and pg1 is not None else None
            report["pg_cpu"] = pg / report["elapsed"] if pg is not None else None
            # The load process's own CPU (including its start-up) is ours too.
            report["other_cores"] = load.stop(api + (pg or 0.0) + report["cpu_s"])
            results[kind].append(report)
            print(
                f"  offered {rate:,.0f}/s: {report['throughput']:,.0f}/s ok, p50 {fmt(report['p50_ms'], '.1f')} ms, "
                f"p99 {fmt(report['p99_ms'], '.1f')} ms, errors {report['errors']} {report['statuses']}",
                file=sys.stderr,
            )
            saturated = report["throughput"] < 0.8 * rate or (report["p99_ms"] or 0) > 2000
            if saturated or report["errors"] > 0.05 * report["requests"]:
                break
            time.sleep(1)

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT {MARK} kind, count(*) FROM sendonce.deliveries GROUP BY kind ORDER BY kind"
        ).fetchall()
        signups = conn.execute(f"SELECT {MARK} count(*) FROM sendonce.signups").fetchone()
    outbox = {str(k): int(c) for k, c in rows}
    rss = [peak_rss_mib(p.pid) for p in procs]
    issues = [
        line for i in range(len(procs))
        for line in (log_dir / f"api-{i}.log").read_text(errors="replace").splitlines()
        if "ERROR" in line or "Traceback" in line
    ]  # fmt: skip
    CHILDREN.stop_all(procs)

    new_created = sum(r["statuses"].get("201", 0) for r in results["new"]) + 100  # + the warm-up's
    text = render(args, command, server.description, results, outbox, signups, new_created, rss, issues)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    print(text)
    print(f"\nwritten: {out_path}; logs in {log_dir}", file=sys.stderr)
    return 0


def best_under(reports: list[dict[str, Any]], target_ms: float) -> dict[str, Any] | None:
    """The highest offered rate served in full (≥ 95 % of it, no errors) with p99 under the target."""
    good = [
        r for r in reports
        if r["p99_ms"] is not None and r["p99_ms"] < target_ms and r["errors"] == 0
        and r["throughput"] >= 0.95 * r["offered"]
    ]  # fmt: skip
    return max(good, key=lambda r: r["offered"]) if good else None


def _outbox_check(rows: int, answered: int, new_steps: list[dict[str, Any]]) -> str:
    unanswered = sum(r["requests"] - r["statuses"].get("201", 0) for r in new_steps)
    if rows == answered:
        return "every outbox row has its 201"
    if answered < rows <= answered + unanswered:
        return (
            f"{rows - answered:,} rows without a 201, within the {unanswered:,} NEW requests left unanswered "
            "(timed out at the client: the server finished them after it gave up)"
        )
    return f"**MISMATCH: {rows:,} outbox rows for {answered:,} answers and {unanswered:,} unanswered requests**"


def render(
    args: argparse.Namespace,
    command: str,
    pg: str,
    results: dict[str, list[dict[str, Any]]],
    outbox: dict[str, int],
    signups: Any,
    new_created: int,
    rss: list[float | None],
    issues: list[str],
) -> str:
    facts = machine_facts()
    lines = header(
        "sendonce signup API benchmark",
        facts,
        command,
        pg,
        [
            f"offered rates (requests/s): {', '.join(f'{r:g}' for r in args.rates)}; a kind stops climbing once "
            "saturated (served < 80 % of offered, p99 > 2 s, or > 5 % errors)",
            f"API: {args.api_processes} `sendonce api` process(es) (uvicorn) on 127.0.0.1; load from a separate "
            "process (open loop, requests scheduled by the clock, latency from the scheduled time, "
            f"keep-alive connections), {args.duration:g} s per offered rate",
            f'settings for the run: SENDONCE_SIGNUP_RATE_PER_ACCOUNT="{RATE_PER_ACCOUNT}" (the account limit '
            "out of the way), SENDONCE_ABUSE_DETECTOR=false; per-address limit and idempotency window at their "
            "defaults",
            "NEW: a distinct address per request (201: signup + idempotency window + outbox row, one transaction); "
            "REPEATED: the same address every time (200: the first answer, from the idempotency window)",
        ],
    )
    for kind, title in (("new", "NEW requests (distinct addresses)"), ("repeat", "REPEATED requests (one address)")):
        best = best_under(results[kind], P99_TARGET_MS)
        lines += [
            f"## {title}",
            "",
            f"**Requests per second at p99 under {P99_TARGET_MS:.0f} ms: "
            + (f"{best['throughput']:,.0f}** (offered {best['offered']:,.0f}/s)" if best else "none of the rates**"),
            "",
            "| offered /s | served /s | p50 ms | p90 ms | p99 ms | max ms | answers | API CPU (cores) "
            "| PostgreSQL CPU (cores) | other load (cores) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for r in results[kind]:
            lines.append(
                f"| {r['offered']:,.0f} | {r['throughput']:,.0f} | {fmt(r['p50_ms'], '.1f')} "
                f"| {fmt(r['p90_ms'], '.1f')} | {fmt(r['p99_ms'], '.1f')} | {fmt(r['max_ms'], '.0f')} "
                f"| {', '.join(f'{k}: {v:,}' for k, v in sorted(r['statuses'].items()))} "
                f"| {r['api_cpu']:.2f} | {fmt(r['pg_cpu'], '.2f')} "
                f"| {r['other_cores']:.2f}{' ⚠' if r['other_cores'] > 0.2 else ''} |"
            )
        lines.append("")
    lines += [
        "## Checks",
        "",
        f"- outbox rows by kind: {outbox or 'none'}; signups: {signups[0] if signups else '?'}; 201 answers "
        f"(warm-up included): {new_created:,}, plus 1 for the repeated address's first request: "
        + _outbox_check(sum(outbox.values()), new_created + 1, results["new"]),
        f"- peak RSS per API process: {', '.join(f'{x:.0f} MiB' for x in rss if x is not None)}",
        f"- errors in the API logs: {len(issues)}" + (f", e.g. {issues[0][:300]}" if issues else ""),
        "- the load process, the API process(es) and PostgreSQL share the machine's cores; *other load* is the "
        "CPU used meanwhile by processes this run did not start (from /proc/stat, in cores): ⚠ above 0.2, "
        "someone else's work skewed that step",
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
