"""Machine facts, the Markdown report, the chart and the profile summary."""

from __future__ import annotations

import os
import platform
import subprocess
from collections import Counter
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from sobench import REPO_DIR


def machine_facts() -> dict[str, str]:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "ram": f"{total_kib / 1024 / 1024:.1f} GiB",
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "sendonce": f"commit {commit or '?'}",
        "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "packages": ", ".join(
            f"{name} {_version(name)}" for name in ("aiosmtplib", "psycopg", "procrastinate", "uvicorn", "fastapi")
        ),
    }


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "(not installed)"


def header(title: str, facts: dict[str, str], command: str, pg: str, extra: list[str]) -> list[str]:
    return [
        f"# {title}",
        "",
        f"- date: {facts['date']}",
        f"- machine: {facts['nproc']} cores ({facts['cpu']}), {facts['ram']} RAM, Linux {facts['kernel']}; "
        f"load average when the report was written: {facts['loadavg']}",
        f"- Python {facts['python']}; {facts['packages']}",
        f"- sendonce: {facts['sendonce']}",
        f"- PostgreSQL: {pg}",
        *[f"- {line}" for line in extra],
        f"- command: `{command}`",
        "",
    ]


def fmt(value: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


# -- the chart ---------------------------------------------------------------------------------------


def chart(
    path: Path,
    settings: list[tuple[int, int]],
    series: dict[str, dict[tuple[int, int], float]],
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{w}×{c}" for w, c in settings]
    xs = list(range(len(settings)))
    styles = {
        "bare aiosmtplib loop (limit)": {"linestyle": "--", "marker": "s", "color": "#777777"},
        "bare loop, pipelined (RFC 2920)": {"linestyle": ":", "marker": "D", "color": "#444444"},
        "lean claim-send-record loop": {"linestyle": "--", "marker": "v", "color": "#15803d"},
        "lean loop, waits for each record": {"linestyle": "-.", "marker": "v", "color": "#65a30d"},
        "sendonce": {"linestyle": "-", "marker": "o", "color": "#0a58ca", "linewidth": 2.5},
        "sendonce, approval → last delivery": {"linestyle": "-.", "marker": "o", "color": "#7aa7e8"},
        "procrastinate baseline": {"linestyle": ":", "marker": "^", "color": "#c2410c"},
    }
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    lowest = min((v for values in series.values() for v in values.values() if v > 0), default=1.0)
    for name, values in series.items():
        points = [(x, values[s]) for x, s in zip(xs, settings, strict=True) if s in values]
        if not points:
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **styles.get(name, {}))  # type: ignore[arg-type]
        # sendonce's under its points (the "last delivery" line is never below it); the waiting lean loop's to
        # the right of its points (it runs close to the bare loop, whose figures are above)
        beside = name == "lean loop, waits for each record"
        below = name == "sendonce"
        for x, y in points:
            ax.annotate(
                f"{y:,.0f}",
                (x, y),
                textcoords="offset points",
                xytext=(6, -3) if beside else (0, -11 if below else 6),
                ha="left" if beside else "center",
                fontsize=7,
            )
    ax.set_xticks(xs, labels)
    ax.set_xlabel("worker processes × concurrency per worker")
    ax.set_ylabel("messages per second (log scale)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(bottom=lowest / 3)
    ax.legend(fontsize=8, loc="lower center", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# -- py-spy ------------------------------------------------------------------------------------------


_IDLE_LEAVES = ("_worker (concurrent/futures/thread.py)", "wait (threading.py)")


def profile_summary(raw: Path, top: int = 25) -> tuple[list[str], int]:
    """Top functions of a py-spy raw (collapsed) profile, by own and by inclusive samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames or frames[-1].startswith(_IDLE_LEAVES):
            continue  # an idle executor thread (py-spy does not always see it idle)
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return ["(no samples)"], 0
    lines = ["| function (file) | own % | inclusive % |", "| --- | ---: | ---: |"]
    for frame, count in own.most_common(top):
        lines.append(f"| `{frame}` | {100 * count / total:.1f} | {100 * inclusive[frame] / total:.1f} |")
    lines += ["", "By inclusive time (where the time goes, callers included):", ""]
    lines += ["| function (file) | inclusive % | own % |", "| --- | ---: | ---: |"]
    shown = [(f, c) for f, c in inclusive.most_common() if c < total][: top + 10]  # the root chain says nothing
    for frame, count in shown:
        lines.append(f"| `{frame}` | {100 * count / total:.1f} | {100 * own[frame] / total:.1f} |")
    return lines, total
