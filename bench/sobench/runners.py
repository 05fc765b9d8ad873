"""The contenders, each measured the same way: a fresh sink, N recipients, every message counted.

* ``run_bare``: the physical limit (K processes of ``sobench.bare`` x C connections), plain or pipelined;
* ``run_lean``: a lean claim-send-record loop over one table, pre-rendered bytes (``sobench.lean``);
* ``run_procrastinate``: one procrastinate job per recipient, K worker processes x concurrency C;
* ``run_sendonce``: a campaign approved in the database and sent by K ``sendonce worker`` processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from sobench import BENCH_DIR
from sobench.content import FROM_EMAIL, FROM_NAME, HTML, SUBJECT, TEXT
from sobench.pg import MARK, Server, Statement, pgss_read, pgss_reset
from sobench.procs import CHILDREN, OtherLoad, cpu_seconds, peak_rss_mib
from sobench.sink import Sink, SinkBinary


@dataclass
class Context:
    server: Server
    cache: Path
    sink_binary: SinkBinary | None
    batch_size: int
    sendonce_url: str = ""
    worker_args: list[str] = field(default_factory=list)
    """Extra `sendonce worker` options (e.g. --fast-records)."""
    account_id: int = 0
    list_id: int = 0
    pq_url: str = ""
    log_dir: Path = field(default_factory=Path)
    profile: tuple[RunResult, Path] | None = None
    """The py-spy run and its raw profile, when one was made."""

    def env(self, **extra: str) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass
class RunResult:
    kind: str
    """'bare', 'bare-pipelined', 'lean', 'lean-wait', 'procrastinate' or 'sendonce'."""
    workers: int
    concurrency: int
    recipients: int
    seconds: float
    """End to end: first send (bare), first defer (procrastinate) or approval (sendonce) to the last delivery."""
    delivered: int
    """Counted at the sink."""
    sink: str
    problems: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.recipients / self.seconds if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and self.delivered == self.recipients


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _poll(what: str, done: Any, *, timeout: float, procs: list[subprocess.Popen[Any]], sink: Sink, total: int) -> None:
    """Call ``done()`` every 0.25 s until it is true; report progress from the sink's counter."""
    start = last = time.monotonic()
    while not done():
        now = time.monotonic()
        if now - start > timeout:
            raise TimeoutError(f"{what}: not finished after {timeout:.0f}s ({sink.delivered()}/{total} at the sink)")
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: a process exited early with code {dead[0].returncode}: {dead[0].args}")
        if now - last >= 5:
            last = now
            _say(f"    … {sink.delivered():,}/{total:,} delivered after {now - start:.0f}s")
        time.sleep(0.25)


def _scan_log(path: Path) -> tuple[Counter[str], list[str]]:
    """Counts of WARNING/ERROR/CRITICAL lines and tracebacks in a log, and a few examples."""
    counts: Counter[str] = Counter()
    examples: list[str] = []
    if not path.exists():
        return counts, examples
    for line in path.read_text(errors="replace").splitlines():
        for level in ("WARNING", "ERROR", "CRITICAL", "Traceback"):
            if level in line:
                counts[level] += 1
                if len(examples) < 5:
                    examples.append(line.strip()[:300])
                break
    return counts, examples


def _read_line(proc: subprocess.Popen[Any], timeout: float) -> str:
    """The child's next line of output, or an error after ``timeout`` seconds (a child that hangs)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no output after {timeout:.0f}s from {proc.args}")
    return str(proc.stdout.readline().decode().strip())


def _await_ready(procs: list[subprocess.Popen[Any]], what: str) -> None:
    """Each loop process prints ``ready`` once its connections are open."""
    for proc in procs:
        line = _read_line(proc, 60.0)
        if line != "ready":
            raise RuntimeError(f"{what} did not start: {line!r}")


def _tell(procs: list[subprocess.Popen[Any]], word: str) -> None:
    for proc in procs:
        proc.stdin.write(word.encode() + b"\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]


def _reports(procs: list[subprocess.Popen[Any]], timeout: float, what: str) -> list[dict[str, Any]]:
    """Each loop process's JSON report, the line it prints when it is done."""
    reports = []
    for proc in procs:
        line = _read_line(proc, timeout)
        if not line.startswith("{"):
            raise RuntimeError(f"{what} failed: {line!r}")
        reports.append(json.loads(line))
    return reports


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def _timeout(n: int) -> float:
    return 300 + n / 40


# -- the bare loop -----------------------------------------------------------------------------------


def run_bare(ctx: Context, workers: int, concurrency: int, n: int, *, pipelined: bool = False) -> RunResult:
    kind = "bare-pipelined" if pipelined else "bare"
    name = f"{kind}-{workers}x{concurrency}"
    sink = Sink(ctx.log_dir, ctx.sink_binary, name)
    shares = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
    procs = []
    first = 1
    for i, share in enumerate(shares):
        procs.append(
            CHILDREN.spawn(
                [sys.executable, "-m", "sobench.bare", str(sink.port), str(concurrency), str(share), str(first)]
                + (["pipelined"] if pipelined else []),
                env=ctx.env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                log=ctx.log_dir / f"{name}-{i}.log",
            )
        )
        first += share
    what = f"bare loop (see {ctx.log_dir / name}-*.log)"
    try:
        _await_ready(procs, what)
        sink_cpu0 = cpu_seconds(sink.proc.pid)
        load = OtherLoad()
        _tell(procs, "go")
        reports = _reports(procs, _timeout(n), what)
        for proc in procs:
            proc.wait(30)
        sink_cpu = cpu_seconds(sink.proc.pid) - sink_cpu0
        other = load.stop(sink_cpu + sum(r["cpu"] for r in reports))
    finally:
        CHILDREN.stop_all(procs)
    delivered = sink.wait_for(n, 5)
    delivered = max(delivered, sink.stop())
    seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    errors = sum(r["errors"] for r in reports)
    problems = [f"{errors} send errors"] if errors else []
    if delivered != n:
        problems.append(f"the sink counted {delivered} messages, expected {n}")
    return RunResult(
        kind, workers, concurrency, n, seconds, delivered, sink.kind, problems,
        {"size": reports[0]["size"], "client_cpu_ms": 1000 * sum(r["cpu"] for r in reports) / n,
         "sink_cpu_ms": 1000 * sink_cpu / n, "other_cores": other},
    )  # fmt: skip


# -- the lean claim-send-record loop ----------------------------------------------------------------


def run_lean(ctx: Context, url: str, workers: int, concurrency: int, n: int, *, wait: bool = False) -> RunResult:
    """K processes of ``sobench.lean`` x C pipelined connections over one table of ``n`` rows; ``wait``: a
    connection sends no content while its previous accepted message is unrecorded."""
    from sobench.lean import fill

    kind = "lean-wait" if wait else "lean"
    name = f"{kind}-{workers}x{concurrency}"
    fill(url, n)
    sink = Sink(ctx.log_dir, ctx.sink_binary, name)
    procs = [
        CHILDREN.spawn(
            [sys.executable, "-m", "sobench.lean", url, str(sink.port), str(concurrency), str(1 + i * 100_000)]
            + (["wait"] if wait else []),
            env=ctx.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            log=ctx.log_dir / f"{name}-{i}.log",
        )
        for i in range(workers)
    ]
    what = f"lean loop (see {ctx.log_dir / name}-*.log)"
    try:
        _await_ready(procs, what)
        sink_cpu0, pg0 = cpu_seconds(sink.proc.pid), ctx.server.cpu_seconds()
        load = OtherLoad()
        _tell(procs, "go")
        reports = _reports(procs, _timeout(n), what)
        # read while the loops' backends are alive: an exiting backend's CPU can be missed
        sink_cpu = cpu_seconds(sink.proc.pid) - sink_cpu0
        pg1 = ctx.server.cpu_seconds()
        pg_cpu = pg1 - pg0 if pg0 is not None and pg1 is not None else None
        other = load.stop(sink_cpu + sum(r["cpu"] for r in reports) + (pg_cpu or 0.0))
        _tell(procs, "exit")
        codes = [proc.wait(30) for proc in procs]
    finally:
        CHILDREN.stop_all(procs)
    delivered = sink.wait_for(n, 5)
    delivered = max(delivered, sink.stop())
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FILTER (WHERE status = 2), count(*) FROM lean_jobs").fetchone()
    assert row is not None
    recorded, rows = int(row[0]), int(row[1])
    seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    errors = sum(r["errors"] for r in reports)
    problems = [f"{errors} send errors"] if errors else []
    if delivered != n:
        problems.append(f"the sink counted {delivered} messages, expected {n}")
    if recorded != rows:
        problems.append(f"{rows - recorded} of {rows} rows not recorded as sent")
    if (sent := sum(r["sent"] for r in reports)) != n or sum(r["recorded"] for r in reports) != n:
        problems.append(f"the loops sent {sent} and recorded {sum(r['recorded'] for r in reports)}, expected {n}")
    if any(codes):
        problems.append(f"exit codes {codes}")
    claims, records = sum(r["claims"] for r in reports), sum(r["records"] for r in reports)
    return RunResult(
        kind, workers, concurrency, n, seconds, delivered, sink.kind, problems,
        {"size": reports[0]["size"], "client_cpu_ms": 1000 * sum(r["cpu"] for r in reports) / n,
         "sink_cpu_ms": 1000 * sink_cpu / n, "pg_cpu_ms": None if pg_cpu is None else 1000 * pg_cpu / n,
         "other_cores": other, "rows_per_record": n / records if records else None, "claims": claims},
    )  # fmt: skip


# -- procrastinate -----------------------------------------------------------------------------------


def setup_procrastinate(ctx: Context, url: str) -> None:
    ctx.pq_url = url
    os.environ["SOBENCH_PQ_URL"] = url
    result = subprocess.run(
        [str(Path(sys.executable).parent / "procrastinate"), "--app", "sobench.baseline.app", "schema", "--apply"],
        env=ctx.env(SOBENCH_PQ_URL=url), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"procrastinate schema --apply failed: {result.stderr[-2000:]}")


async def _enqueue(n: int) -> float:
    from sobench.baseline import app, send_campaign_email
    from sobench.content import recipient

    started = time.monotonic()
    async with app.open_async():
        for low in range(1, n + 1, 1000):
            jobs = []
            for i in range(low, min(low + 1000, n + 1)):
                email, name = recipient(i)
                jobs.append({"campaign_id": 1, "subscriber_id": i, "email": email, "name": name})
            await send_campaign_email.batch_defer_async(*jobs)
    return time.monotonic() - started


def _wait_listeners(url: str, like: str, count: int, procs: list[subprocess.Popen[Any]], what: str) -> None:
    deadline = time.monotonic() + 90
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                f"SELECT {MARK} count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s",
                (like,),
            ).fetchone()
            if row and row[0] >= count:
                return
            dead = [p for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start (exit code {dead[0].returncode if dead else 'none'})")
            time.sleep(0.1)


def run_procrastinate(ctx: Context, workers: int, concurrency: int, n: int) -> RunResult:
    name = f"procrastinate-{workers}x{concurrency}"
    with psycopg.connect(ctx.pq_url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {MARK} procrastinate_events, procrastinate_jobs, procrastinate_workers CASCADE")
    if ctx.server.pgss:
        pgss_reset(ctx.pq_url)
    sink = Sink(ctx.log_dir, ctx.sink_binary, name)
    command = str(Path(sys.executable).parent / "procrastinate")
    env = ctx.env(SOBENCH_PQ_URL=ctx.pq_url, SOBENCH_SMTP_PORT=str(sink.port))
    logs = [ctx.log_dir / f"{name}-{i}.log" for i in range(workers)]
    args = [
        command,
        "--app",
        "sobench.baseline.app",
        "worker",
        "--concurrency",
        str(concurrency),
        "--queues",
        "campaign",
    ]
    procs = [CHILDREN.spawn([*args, "--name", f"bench-{i}"], env=env, log=logs[i]) for i in range(workers)]
    problems: list[str] = []
    try:
        _wait_listeners(ctx.pq_url, "LISTEN%", workers, procs, "procrastinate workers")
        pids = [p.pid for p in procs]
        cpu0, pg0, sink0 = _cpu(pids), ctx.server.cpu_seconds(), cpu_seconds(sink.proc.pid)
        load = OtherLoad()
        enqueue_seconds = asyncio.run(_enqueue(n))

        conn = psycopg.connect(ctx.pq_url, autocommit=True)
        statuses: dict[str, int] = {}

        def done() -> bool:
            nonlocal statuses
            rows = conn.execute(f"SELECT {MARK} status::text, count(*) FROM procrastinate_jobs GROUP BY 1").fetchall()
            statuses = {str(s): int(c) for s, c in rows}
            return statuses.get("succeeded", 0) + statuses.get("failed", 0) >= n

        with conn:
            _poll(name, done, timeout=_timeout(n), procs=procs, sink=sink, total=n)
            rss = [peak_rss_mib(pid) or 0.0 for pid in pids]
            cpu = _cpu(pids) - cpu0
            pg_cpu = (ctx.server.cpu_seconds() or 0.0) - (pg0 or 0.0) if pg0 is not None else None
            sink_cpu = cpu_seconds(sink.proc.pid) - sink0
            other = load.stop(cpu + (pg_cpu or 0.0) + sink_cpu)
            first, last = conn.execute(
                f"""SELECT {MARK} min(at) FILTER (WHERE type = 'deferred'),
                                  max(at) FILTER (WHERE type IN ('succeeded', 'failed'))
                             FROM procrastinate_events"""
            ).fetchone()  # type: ignore[misc]
        statements = pgss_read(ctx.pq_url) if ctx.server.pgss else []
    finally:
        CHILDREN.stop_all(procs)
    delivered = sink.wait_for(n, 5)
    delivered = max(delivered, sink.stop())
    if statuses.get("failed"):
        problems.append(f"{statuses['failed']} jobs failed")
    if delivered != n:
        problems.append(f"the sink counted {delivered} messages, expected {n}")
    seconds = (last - first).total_seconds()
    extra = {
        "enqueue_s": enqueue_seconds,
        "jobs": statuses,
        "rss_mib": rss,
        "worker_cpu_ms": 1000 * cpu / n,
        "pg_cpu_ms": 1000 * pg_cpu / n if pg_cpu is not None else None,
        "sink_cpu_ms": 1000 * sink_cpu / n,
        "pg_exec_ms": sum(s.total_ms for s in statements) / n if statements else None,
        "statements": statements,
        "log_issues": _collect_logs(logs),
        "other_cores": other,
    }
    return RunResult("procrastinate", workers, concurrency, n, seconds, delivered, sink.kind, problems, extra)


def _collect_logs(logs: list[Path]) -> dict[str, Any]:
    total: Counter[str] = Counter()
    examples: list[str] = []
    for log in logs:
        counts, found = _scan_log(log)
        total.update(counts)
        examples += found[: 5 - len(examples)]
    return {"counts": dict(total), "examples": examples, "files": [str(p) for p in logs]}


# -- sendonce ----------------------------------------------------------------------------------------


def setup_sendonce(ctx: Context, url: str, n: int) -> float:
    """Schema, one account, one list of ``n`` confirmed subscribers (bulk SQL). Returns seconds taken."""
    started = time.monotonic()
    ctx.sendonce_url = url
    ctx.account_id, ctx.list_id = fill_sendonce(url, n)
    return time.monotonic() - started


def fill_sendonce(url: str, n: int) -> tuple[int, int]:
    """sendonce's migrations (of the sendonce on the path), one account and one list of ``n`` confirmed
    subscribers, by bulk SQL. Returns (account_id, list_id)."""
    from sendonce.store.migrations import upgrade

    upgrade(url)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"""INSERT {MARK} INTO sendonce.accounts (name, api_key_hash, from_email, from_name)
                VALUES ('bench', %s, %s, %s) RETURNING account_id""",
            (os.urandom(32), FROM_EMAIL, FROM_NAME),
        ).fetchone()
        assert row is not None
        account_id = int(row[0])
        row = conn.execute(
            f"INSERT {MARK} INTO sendonce.lists (account_id, name) VALUES (%s, 'everyone') RETURNING list_id",
            (account_id,),
        ).fetchone()
        assert row is not None
        list_id = int(row[0])
        conn.execute(
            f"""INSERT {MARK} INTO sendonce.subscribers (account_id, email, email_key, name)
                SELECT %(a)s, e, e, 'User ' || i
                  FROM generate_series(1, %(n)s) AS i,
                       LATERAL (SELECT 'user' || lpad(i::text, 7, '0') || '@example.test' AS e) AS x
                 ORDER BY i""",
            {"a": account_id, "n": n},
        )
        conn.execute(
            f"""INSERT {MARK} INTO sendonce.list_members (account_id, list_id, subscriber_id)
                SELECT account_id, %s, subscriber_id FROM sendonce.subscribers WHERE account_id = %s""",
            (list_id, account_id),
        )
        conn.execute(f"{MARK} VACUUM ANALYZE")
    return account_id, list_id


def new_campaign(url: str, account_id: int, list_id: int) -> int:
    """The benchmark's campaign to the list, in draft (the outbox emptied of earlier runs' rows)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"""TRUNCATE {MARK} sendonce.possible_duplicates, sendonce.deliveries, sendonce.campaign_lists,
                                sendonce.campaigns"""
        )
        row = conn.execute(
            f"""INSERT {MARK} INTO sendonce.campaigns (account_id, name, subject, text_body, html_body,
                                                      from_email, from_name)
                VALUES (%s, 'November news', %s, %s, %s, %s, %s) RETURNING campaign_id""",
            (account_id, SUBJECT, TEXT, HTML, FROM_EMAIL, FROM_NAME),
        ).fetchone()
        assert row is not None
        campaign_id = int(row[0])
        conn.execute(
            f"INSERT {MARK} INTO sendonce.campaign_lists (account_id, campaign_id, list_id) VALUES (%s, %s, %s)",
            (account_id, campaign_id, list_id),
        )
    return campaign_id


async def approve(url: str, account_id: int, campaign_id: int) -> None:
    from sendonce.store import campaigns
    from sendonce.store.database import connect

    async with await connect(url) as conn:
        result = await campaigns.transition(conn, account_id, campaign_id, "approve")
    if not result.won:
        raise RuntimeError(f"could not approve campaign {campaign_id}: {result.status}")


_FINAL = re.compile(r"final: WorkerStats\((.*)\)")
_TIMINGS = ("claims", "claim_seconds", "record_groups", "record_seconds", "record_wait_seconds", "lane_waits")
"""The workers' own counters of where their time goes (summed over the K processes)."""


def run_sendonce(
    ctx: Context, workers: int, concurrency: int, n: int, *, profile: Path | None = None, profile_rate: int = 100
) -> RunResult:
    name = f"sendonce-{workers}x{concurrency}" + ("-profiled" if profile else "")
    campaign_id = new_campaign(ctx.sendonce_url, ctx.account_id, ctx.list_id)
    sink = Sink(ctx.log_dir, ctx.sink_binary, name)
    env = ctx.env(
        SENDONCE_DATABASE_URL=ctx.sendonce_url,
        SENDONCE_TRANSPORT_URL=sink.url,
        SENDONCE_HOME=str(ctx.cache / "home"),
        SENDONCE_LOG_LEVEL="info",
    )
    logs = [ctx.log_dir / f"{name}-{i}.log" for i in range(workers)]
    for log in logs:
        log.unlink(missing_ok=True)
    args = [sys.executable, "-m", "sendonce.cli", "worker", "--concurrency", str(concurrency)]
    args += ["--batch-size", str(ctx.batch_size), "--no-upgrade", *ctx.worker_args]
    procs = [CHILDREN.spawn(args, env=env, log=log) for log in logs]
    spy: subprocess.Popen[Any] | None = None
    try:
        _wait_listeners(ctx.sendonce_url, "LISTEN sendonce_work", workers, procs, "sendonce workers")
        pids = [p.pid for p in procs]
        if profile is not None:
            spy = CHILDREN.spawn(
                [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pids[0]), "--rate",
                 str(profile_rate), "--nolineno", "--format", "raw", "--output", str(profile)],
                log=ctx.log_dir / f"{name}-py-spy.log",
            )  # fmt: skip
            time.sleep(1.0)
        if ctx.server.pgss:
            pgss_reset(ctx.sendonce_url)
        cpu0, pg0, sink0 = _cpu(pids), ctx.server.cpu_seconds(), cpu_seconds(sink.proc.pid)
        spy_cpu0 = cpu_seconds(spy.pid) if spy is not None else 0.0
        load = OtherLoad()
        asyncio.run(approve(ctx.sendonce_url, ctx.account_id, campaign_id))

        conn = psycopg.connect(ctx.sendonce_url, autocommit=True)

        def done() -> bool:
            row = conn.execute(
                f"SELECT {MARK} status::text FROM sendonce.campaigns WHERE campaign_id = %s", (campaign_id,)
            ).fetchone()
            return bool(row and row[0] in ("sent", "cancelled"))

        with conn:
            _poll(name, done, timeout=_timeout(n), procs=procs, sink=sink, total=n)
            rss = [peak_rss_mib(pid) or 0.0 for pid in pids]
            cpu = _cpu(pids) - cpu0
            pg_cpu = (ctx.server.cpu_seconds() or 0.0) - pg0 if pg0 is not None else None
            sink_cpu = cpu_seconds(sink.proc.pid) - sink0
            spy_cpu = cpu_seconds(spy.pid) - spy_cpu0 if spy is not None else 0.0
            other = load.stop(cpu + (pg_cpu or 0.0) + sink_cpu + spy_cpu)
            statements = pgss_read(ctx.sendonce_url) if ctx.server.pgss else []
            times = conn.execute(
                f"""SELECT {MARK} status::text, scheduled_for, started_at, built_at, finished_at,
                                  (SELECT max(sent_at) FROM sendonce.deliveries WHERE campaign_id = c.campaign_id)
                             FROM sendonce.campaigns c WHERE campaign_id = %s""",
                (campaign_id,),
            ).fetchone()
            assert times is not None
            counts = dict(
                conn.execute(
                    f"""SELECT {MARK} status::text, count(*) FROM sendonce.deliveries
                                WHERE campaign_id = %s GROUP BY 1""",
                    (campaign_id,),
                ).fetchall()
            )
            duplicates = conn.execute(f"SELECT {MARK} count(*) FROM sendonce.possible_duplicates").fetchone()
    finally:
        if spy is not None:
            CHILDREN.stop(spy, sig=2, timeout=60)  # SIGINT: py-spy writes its output and exits
        CHILDREN.stop_all(procs, timeout=30)
    delivered = sink.wait_for(n, 5)
    delivered = max(delivered, sink.stop())
    status, approved, started, built, finished, last_sent = times
    problems = []
    if status != "sent":
        problems.append(f"campaign ended {status}")
    if counts.get("sent", 0) != n:
        problems.append(f"deliveries by status: {counts} (expected {n} sent)")
    if duplicates and duplicates[0]:
        problems.append(f"{duplicates[0]} possible duplicates in the ledger")
    if delivered != n:
        problems.append(f"the sink counted {delivered} messages, expected {n}")
    exit_codes = [p.returncode for p in procs]
    if any(code not in (0, None) for code in exit_codes):
        problems.append(f"worker exit codes {exit_codes}")
    issues = _collect_logs(logs)
    worker_sent = 0
    timings = dict.fromkeys(_TIMINGS, 0.0)
    for log in logs:
        match = _FINAL.search(log.read_text(errors="replace")) if log.exists() else None
        if match:
            fields = dict(part.split("=") for part in match.group(1).split(", "))
            worker_sent += int(fields.get("sent", 0))
            for name in _TIMINGS:
                timings[name] += float(fields.get(name, 0))
    extra = {
        "build_s": (built - started).total_seconds() if built and started else None,
        "approval_to_built_s": (built - approved).total_seconds() if built and approved else None,
        "approval_to_start_s": (started - approved).total_seconds() if started and approved else None,
        "last_sent_s": (last_sent - approved).total_seconds() if last_sent else None,
        "rss_mib": rss,
        "worker_cpu_ms": 1000 * cpu / n,
        "pg_cpu_ms": 1000 * pg_cpu / n if pg_cpu is not None else None,
        "sink_cpu_ms": 1000 * sink_cpu / n,
        "pg_exec_ms": sum(s.total_ms for s in statements) / n if statements else None,
        "statements": statements,
        "counts": counts,
        "worker_sent": worker_sent,
        "timings": timings,
        "log_issues": issues,
        "other_cores": other,
    }
    seconds = (finished - approved).total_seconds()
    return RunResult("sendonce", workers, concurrency, n, seconds, delivered, sink.kind, problems, extra)


def statement_table(statements: list[Statement], n: int) -> list[str]:
    lines = [
        "| statement | calls | rows | total ms | µs per message | WAL bytes per message "
        "| full-page images per 1,000 messages |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in statements[:8]:
        text = s.query if len(s.query) <= 110 else s.query[:107] + "…"
        text = text.replace("|", "\\|")
        lines.append(
            f"| `{text}` | {s.calls:,} | {s.rows:,} | {s.total_ms:,.0f} | {1000 * s.total_ms / n:.1f} "
            f"| {s.wal_bytes / n:,.0f} | {1000 * s.wal_fpi / n:,.0f} |"
        )
    total_ms = sum(s.total_ms for s in statements)
    lines.append(
        f"| all {len(statements)} statements | {sum(s.calls for s in statements):,} | | {total_ms:,.0f} "
        f"| {1000 * total_ms / n:.1f} | {sum(s.wal_bytes for s in statements) / n:,.0f} "
        f"| {1000 * sum(s.wal_fpi for s in statements) / n:,.0f} |"
    )
    return lines
