"""PostgreSQL's own cost of a campaign row's claim and record, for one or more versions of sendonce.

    python bench/outbox_cost.py [--database-url URL] [--recipients N] [--claim 20] [--record 10]
                                [--segment 500] [--lean] [--tag TAG] [NAME=SRC ...]

Each NAME=SRC is a sendonce source folder (the folder that holds the ``sendonce`` package, e.g. the
``src`` of a git worktree); with none, this checkout's. Each gets a database of its own on one server
(a scratch PostgreSQL 18, or URL's, which must run on this machine), its own migrations, a campaign of
N recipients built by its own builder, and a process (``sobench/outbox_cost.py``) that claims and
records with its own statements, serially, on a claimer's and a recorder's connection: no SMTP, no
worker around them.

The processes take turns, SEGMENT recorded rows each, until every queue is empty, so that the
machine's drift (this kind of machine wanders by ±20% over minutes) falls on every version alike.
It prints, per version, the database backends' CPU per message for claim + record (the claimer's
and the recorder's connection, each with a worker's session settings), the WAL written per message,
and the list build's backend CPU per row, and writes the same table to
bench/out/outbox-cost[-TAG].md. CPU is the backend's alone (not the WAL writer's, not the client's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sobench import BENCH_DIR, CACHE_DIR, OUT_DIR, REPO_DIR
from sobench.pg import external_server, recreate_database, start_scratch_server
from sobench.procs import CHILDREN, install_cleanup
from sobench.report import header, machine_facts


@dataclass
class Variant:
    name: str
    src: Path
    kind: str = "sendonce"
    """'sendonce', or 'lean': the lean loop's statements and table (sobench/lean.py)."""
    proc: subprocess.Popen[Any] | None = None
    log: Path | None = None
    build_cpu: float | None = 0.0
    inserted: int = 0
    claim: float = 0.0
    record: float = 0.0
    wal: float = 0.0
    recorded: int = 0
    segments: list[float] = field(default_factory=list)
    """Backend µs per message of each segment."""
    empty: bool = False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", metavar="NAME=SRC", help="sendonce source folders (default: this checkout)")
    p.add_argument("--database-url", help="a local server (default: a scratch PostgreSQL 18)")
    p.add_argument("--recipients", type=int, default=30_000)
    p.add_argument("--claim", type=int, default=20, help="rows per claim (the worker's default batch)")
    p.add_argument("--record", type=int, default=10, help="rows per record statement")
    p.add_argument("--segment", type=int, default=500, help="rows each version records before the next one's turn")
    p.add_argument("--lean", action="store_true", help="add the lean loop's claim and record, for comparison")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    for name in ("recipients", "claim", "record", "segment"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    for text in args.variants:
        name, sep, src = text.partition("=")
        if not sep or not name or not (Path(src) / "sendonce" / "__init__.py").is_file():
            p.error(f"{text!r}: expected NAME=SRC, SRC a folder holding the sendonce package")
    return args


def _line(v: Variant) -> dict[str, Any]:
    assert v.proc is not None and v.proc.stdout is not None
    text = v.proc.stdout.readline()
    if not text:
        raise RuntimeError(f"{v.name}: its process ended (exit {v.proc.wait()}); see {v.log}")
    return dict(json.loads(text))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_cleanup()
    command = shlex.join(["python", "bench/outbox_cost.py", *(sys.argv[1:] if argv is None else argv)])
    given = (t.partition("=") for t in args.variants)
    variants = [Variant(name, Path(src).resolve()) for name, _, src in given] or [
        Variant("this checkout", REPO_DIR / "src")
    ]
    if args.lean:
        variants.append(Variant("lean loop", REPO_DIR / "src", "lean"))
    server = external_server(args.database_url) if args.database_url else start_scratch_server(CACHE_DIR, pgss=False)
    log_dir = CACHE_DIR / "logs" / time.strftime("outbox-cost-%Y%m%d-%H%M%S")
    for i, v in enumerate(variants):
        url = recreate_database(server, f"outbox_cost_{i}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(v.src), str(BENCH_DIR)))}
        print(f"{v.name}: its table, {args.recipients:,} rows …", file=sys.stderr)
        sizes = (str(n) for n in (args.recipients, args.claim, args.record))
        v.log = log_dir / f"{i}.log"
        v.proc = CHILDREN.spawn(
            [sys.executable, "-m", "sobench.outbox_cost", url, *sizes, v.kind],
            env=env, log=v.log, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=BENCH_DIR,
        )  # fmt: skip
        built = _line(v)
        v.build_cpu, v.inserted = built["build_cpu"], built["inserted"]
        _line(v)  # ready
    print("claim and record, in turns …", file=sys.stderr)
    while not all(v.empty for v in variants):
        for v in variants:
            if v.empty:
                continue
            assert v.proc is not None and v.proc.stdin is not None
            v.proc.stdin.write(f"go {args.segment}\n".encode())
            v.proc.stdin.flush()
            seg = _line(v)
            v.claim += seg["claim"]
            v.record += seg["record"]
            v.wal += seg["wal"]
            v.recorded += seg["recorded"]
            v.empty = seg["empty"]
            if seg["recorded"]:
                v.segments.append(1e6 * (seg["claim"] + seg["record"]) / seg["recorded"])
    for v in variants:
        assert v.proc is not None and v.proc.stdin is not None
        v.proc.stdin.close()
        if v.proc.wait(timeout=30) != 0 or v.recorded != args.recipients:
            raise RuntimeError(f"{v.name}: recorded {v.recorded:,} of {args.recipients:,} (exit {v.proc.returncode})")
    text = "\n".join(render(args, command, server.description, variants)) + "\n"
    out = OUT_DIR / f"outbox-cost{'-' + args.tag if args.tag else ''}.md"
    out.write_text(text)
    print(text)
    print(f"written to {out.relative_to(REPO_DIR)}", file=sys.stderr)
    return 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def render(args: argparse.Namespace, command: str, pg: str, variants: list[Variant]) -> list[str]:
    first = variants[0]
    lines = header(
        "PostgreSQL's cost of a claim and a record",
        machine_facts(),
        command,
        pg,
        [
            f"{args.recipients:,} recipients per version; claims of {args.claim}, records of {args.record} rows, "
            f"serially (a claimer's and a recorder's connection, a worker's session settings), durable commits; "
            f"turns of {args.segment} rows",
            "each version's sendonce is the source named in its row; the commit above is the harness's checkout",
        ],
    )
    lines += [
        "| version | source | claim + record: backend µs per message | median of its turns | ÷ first | claim µs | "
        "record µs | WAL bytes per message | list build: backend µs per row |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = 1e6 * (first.claim + first.record) / first.recorded
    for v in variants:
        claim, record = 1e6 * v.claim / v.recorded, 1e6 * v.record / v.recorded
        build = "–" if v.build_cpu is None else f"{1e6 * v.build_cpu / v.inserted:.1f}"
        source = "`bench/sobench/lean.py`" if v.kind == "lean" else f"`{v.src}`"
        lines.append(
            f"| {v.name} | {source} | {claim + record:.1f} | {_median(v.segments):.1f} | "
            f"{(claim + record) / base:.3f} | {claim:.1f} | {record:.1f} | {v.wal / v.recorded:,.0f} | {build} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
