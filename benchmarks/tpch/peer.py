"""The federated peer: DuckDB attaching the same MariaDB, PostgreSQL and S3 with its own
mysql / postgres / httpfs extensions, as a user would instead of the fabric.

Those extensions exist offline only as pip packages pinned to one DuckDB version
(``duckdb-ext-*`` for duckdb 1.4.4), while the project runs DuckDB 2.x, so the peer lives
in its own venv (``.services/tpch-peer``, made by ``ensure_venv()``) and runs as a worker
process: ``benchmarks/tpch.py`` sends it JSON lines on stdin and reads JSON lines back, so
the fabric and the peer are timed interleaved within one window.

Requests: ``{"op": "setup", ...}`` (attach; nation and region, which DuckDB has no scanner
for (MongoDB, Kafka), are given as local tables) and ``{"op": "run", "sql", "params",
"out"}`` (run once, write the answer as Arrow IPC to ``out``, reply with the time in ms).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".services" / "tpch-peer"
DUCKDB = "1.4.4"
EXT = "1.4.4.20260205"
PACKAGES = [
    f"duckdb=={DUCKDB}",
    f"duckdb-ext-mysql=={EXT}",
    f"duckdb-ext-postgres=={EXT}",
    f"duckdb-ext-httpfs=={EXT}",
    f"duckdb-ext-tpch=={EXT}",
    "pyarrow",
]


def python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv() -> Path:
    """Make the peer's venv (once; ~20 s) and return its python."""
    marker = VENV / ".installed"
    want = " ".join(PACKAGES)
    if marker.exists() and marker.read_text() == want:
        return python()
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PACKAGES],
        check=True,
    )
    marker.write_text(want)
    return python()


def encode(v: Any) -> Any:
    if isinstance(v, dt.date):
        return {"__date": v.isoformat()}
    if isinstance(v, Decimal):
        return {"__decimal": str(v)}
    if isinstance(v, list):
        return [encode(x) for x in v]
    return v


def decode(v: Any) -> Any:
    if isinstance(v, dict) and "__date" in v:
        return dt.date.fromisoformat(v["__date"])
    if isinstance(v, dict) and "__decimal" in v:
        return Decimal(v["__decimal"])
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v


class Peer:
    """The worker process, seen from the benchmark."""

    def __init__(self) -> None:
        exe = ensure_venv()
        self.proc = subprocess.Popen(
            [str(exe), __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the DuckDB peer exited ({self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"DuckDB peer: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin
            self.proc.stdin.close()
            self.proc.wait(10)


# ------------------------------------------------------------------ the worker (peer venv)


def _mysql_dsn(url: str) -> str:
    from urllib.parse import urlsplit

    u = urlsplit(url.replace("mysql+pymysql://", "mysql://"))
    return (
        f"host={u.hostname} port={u.port or 3306} user={u.username} "
        f"password={u.password} database={u.path.lstrip('/')}"
    )


def _pg_dsn(url: str) -> str:
    from urllib.parse import urlsplit

    u = urlsplit(url.replace("postgresql+psycopg://", "postgresql://"))
    return (
        f"host={u.hostname} port={u.port or 5432} user={u.username} "
        f"password={u.password} dbname={u.path.lstrip('/')}"
    )


def _setup(con, req: dict[str, Any]) -> None:
    import pyarrow.ipc as ipc

    ext = Path(__import__("duckdb").__file__).parents[1] / "duckdb_ext" / "extensions"
    con.execute(f"SET extension_directory = '{ext}'")
    for name in ("mysql_scanner", "postgres_scanner", "httpfs"):
        con.execute(f"LOAD {name}")
    con.execute(f"ATTACH '{_mysql_dsn(req['mariadb_url'])}' AS my (TYPE mysql, READ_ONLY)")
    con.execute(f"ATTACH '{_pg_dsn(req['pg_url'])}' AS pg (TYPE postgres, READ_ONLY)")
    endpoint = req["s3_endpoint"].split("://", 1)[1]
    con.execute(
        f"""CREATE SECRET tpch_s3 (TYPE s3, KEY_ID '{req["s3_access_key"]}',
        SECRET '{req["s3_secret_key"]}', ENDPOINT '{endpoint}', URL_STYLE 'path',
        USE_SSL false, REGION 'us-east-1')"""
    )
    glob = f"s3://{req['bucket']}/{req['prefix']}lineitem/*.parquet"
    con.execute(f"CREATE VIEW lineitem AS SELECT * FROM read_parquet('{glob}')")
    for t in ("orders", "customer"):
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM my.{t}")
    for t in ("part", "partsupp", "supplier"):
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM pg.{t}")
    for t in ("nation", "region"):  # no MongoDB / Kafka scanner: local tables
        with ipc.open_file(req[t]) as f:
            table = f.read_all()
        con.register(f"_{t}", table)
        con.execute(f"CREATE TABLE {t} AS SELECT * FROM _{t}")


def _serve() -> None:
    import duckdb
    import pyarrow.ipc as ipc

    con = duckdb.connect()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "setup":
                _setup(con, req)
                print(json.dumps({"ok": True, "duckdb": duckdb.__version__}), flush=True)
            elif req["op"] == "run":
                params = {k: decode(v) for k, v in req["params"].items()}
                t0 = time.perf_counter()
                table = con.execute(req["sql"], params).fetch_arrow_table()
                ms = (time.perf_counter() - t0) * 1000
                if req.get("out"):
                    with ipc.new_file(req["out"], table.schema) as w:
                        w.write_table(table)
                print(json.dumps({"ms": ms, "rows": table.num_rows}), flush=True)
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__" and "--serve" in sys.argv:
    _serve()
