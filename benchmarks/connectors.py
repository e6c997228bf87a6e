"""Connector scan benchmarks, each comparing alternatives side by side in one run.

    .venv/bin/python benchmarks/connectors.py pushdown [--rows 200000] [--repeat 7]
    .venv/bin/python benchmarks/connectors.py kafka-tail [--repeat 30] [--big 100000] [--load]
    .venv/bin/python benchmarks/connectors.py drivers [--sf 0.1] [--repeat 5]

``pushdown`` (below), ``kafka-tail`` (see ``kafka_tail()``) and ``drivers`` (rows/s of each
SQL driver and Parquet reading option next to the fastest its ecosystem has: ``drivers()``).

Needs `scripts/services up`. Loads the same N merchants into MariaDB, PostgreSQL, MongoDB
(N/4: SecantusDB inserts slowly), S3 Parquet and a Kafka topic (noida), then times for each:
  full      scan every row (throughput),
  pushed    `city = {{session.c}} and score between 10 and 12` pushed into the source,
  naive     fetch every row and filter with pyarrow afterwards (what the fabric avoids),
and prints p50/p95 latency, rows fetched and rows fetched / rows needed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from connectors.arrow_expr import filter_table  # noqa: E402
from connectors.base import ScanRequest, Source  # noqa: E402
from dsl.ast import Between, Binary, Column, Literal, Param, and_all  # noqa: E402
from tests.servers import TopicFactory, load, s3_filesystem  # noqa: E402

CITIES = ["Paris", "Berlin", "Köln", "São Paulo", "lyon", "Rome", "Oslo", "Lima"]
FILTERS = (
    Binary("=", Column("city"), Param("c")),
    Between(Column("score"), Literal(10, "int"), Literal(12, "int")),
)
PARAMS = {"c": "Oslo"}
COLS = ("id", "name", "score", "city")


def merchants(n: int) -> pa.Table:
    base = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return pa.table(
        {
            "id": pa.array(range(1, n + 1), pa.int64()),
            "name": [f"merchant {i}" for i in range(n)],
            "score": pa.array([(i * 13) % 100 for i in range(n)], pa.int64()),
            "created_at": pa.array(
                [base + dt.timedelta(seconds=i) for i in range(n)], pa.timestamp("us", tz="UTC")
            ),
            "city": [CITIES[(i * 7) % len(CITIES)] for i in range(n)],
        }
    )


def load_sql(url: str, t: pa.Table) -> Any:
    import sqlalchemy as sa

    from connectors.sql import SqlConnection

    engine = sa.create_engine(url)
    md = sa.MetaData()
    tab = sa.Table(
        "bench_merchants",
        md,
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("name", sa.String(40)),
        sa.Column("score", sa.BigInteger),
        sa.Column("created_at", sa.DateTime(timezone=True)),
        sa.Column("city", sa.String(20)),
        sa.Index("bench_city_score", "city", "score"),
    )
    md.drop_all(engine)
    md.create_all(engine)
    rows = t.to_pylist()
    if engine.dialect.name == "mysql":
        rows = [{**r, "created_at": r["created_at"].replace(tzinfo=None)} for r in rows]
    with engine.begin() as c:
        for i in range(0, len(rows), 20_000):
            c.execute(tab.insert(), rows[i : i + 20_000])
    engine.dispose()
    return SqlConnection("bench", {"kind": "sql", "url": url}).source("bench_merchants")


def load_mongo(url: str, t: pa.Table) -> Any:
    import pymongo

    from connectors.mongo import MongoConnection

    client: Any = pymongo.MongoClient(url)
    try:
        db = client["fabric_bench"]
        db.merchants.drop()
        db.merchants.insert_many(t.to_pylist(), ordered=False)
        db.merchants.create_index([("city", 1), ("score", 1)])
    finally:
        client.close()
    return MongoConnection("bench", {"url": url, "database": "fabric_bench"}).source("merchants")


def load_s3(srv: Any, t: pa.Table) -> Any:
    from connectors.s3 import S3Connection

    fs = s3_filesystem(srv)
    bucket = "fabric-bench"
    with contextlib.suppress(OSError):
        fs.create_dir(bucket)
    t = t.sort_by([("city", "ascending"), ("score", "ascending")])  # clustered: row groups prune
    with fs.open_output_stream(f"{bucket}/merchants/part-0.parquet") as f:
        pq.write_table(t, f, row_group_size=10_000)
    return S3Connection(
        "bench",
        {
            "kind": "s3",
            "endpoint": srv.s3_endpoint,
            "bucket": bucket,
            "access_key": srv.s3_access_key,
            "secret_key": srv.s3_secret_key,
        },
    ).source("merchants/")


def load_kafka(bootstrap: str, t: pa.Table) -> tuple[Any, TopicFactory]:
    from confluent_kafka import Producer

    from connectors.kafka import KafkaConnection

    topics = TopicFactory(bootstrap, "bench" + uuid.uuid4().hex[:6])
    topic = topics(partitions=4, prefix="bench")
    p = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "queue.buffering.max.messages": 1_000_000}
    )
    for r in t.to_pylist():
        r["created_at"] = r["created_at"].isoformat()
        p.produce(topic, key=str(r["id"]).encode(), value=json.dumps(r).encode())
        p.poll(0)
    p.flush(60)
    decl = {"id": "int", "name": "str", "score": "int", "created_at": "timestamp", "city": "str"}
    return KafkaConnection("bench", {"bootstrap": bootstrap, "schemas": {topic: decl}}).source(
        topic
    ), topics


def _pct(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))]


def timed(fn: Callable[[], int], repeat: int) -> tuple[float, float, int]:
    times, rows = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return (*_pct(times), rows)


def scan_rows(src: Source, req: ScanRequest) -> int:
    return sum(b.num_rows for b in src.scan(req))


def measure(name: str, src: Source, n: int, need: int, repeat: int) -> None:
    full = timed(lambda: scan_rows(src, ScanRequest(columns=COLS)), max(2, repeat // 3))
    pushed = timed(
        lambda: scan_rows(src, ScanRequest(columns=COLS, filters=FILTERS, params=PARAMS)), repeat
    )

    def naive() -> int:
        raw = pa.Table.from_batches(list(src.scan(ScanRequest(columns=COLS))))
        assert filter_table(raw, and_all(list(FILTERS)), PARAMS).num_rows == need
        return raw.num_rows

    nv = timed(naive, max(2, repeat // 3))
    assert pushed[2] == need, f"{name}: pushed scan returned {pushed[2]} rows, want {need}"

    def ratio(r: int) -> str:
        return f"{r / max(need, 1):.1f}"

    print(
        f"{name:<12} {n:>7} | {full[0]:>11.1f} {n / full[0] * 1000:>9.0f} | {pushed[0]:>10.1f} {pushed[1]:>7.1f}"
        f" {pushed[2]:>8} {ratio(pushed[2]):>7} | {nv[0]:>9.1f} {nv[1]:>7.1f} {nv[2]:>8} {ratio(nv[2]):>7}",
        flush=True,
    )


def pushdown(a: argparse.Namespace) -> None:
    srv = load()
    t = merchants(a.rows)
    needed = filter_table(t, and_all(list(FILTERS)), PARAMS).num_rows
    print(
        f"loading {a.rows} merchants (Mongo {a.rows // 4}); the filter needs {needed} rows ...",
        flush=True,
    )
    sources: list[tuple[str, Any, int]] = [
        ("MariaDB", load_sql(srv.mariadb_url, t), a.rows),
        ("PostgreSQL", load_sql(srv.pg_url, t), a.rows),
        ("MongoDB", load_mongo(srv.mongo_url, t.slice(0, a.rows // 4)), a.rows // 4),
        ("S3 Parquet", load_s3(srv, t), a.rows),
    ]
    ksrc, topics = load_kafka(srv.kafka_bootstrap, t)
    sources.append(("Kafka", ksrc, a.rows))
    print(
        f"{'source':<12} {'rows':>7} | {'full p50 ms':>11} {'rows/s':>9} | {'pushed p50':>10} {'p95':>7} {'fetched':>8} {'x need':>7}"
        f" | {'naive p50':>9} {'p95':>7} {'fetched':>8} {'x need':>7}"
    )
    for name, src, n in sources:
        need = filter_table(t.slice(0, n), and_all(list(FILTERS)), PARAMS).num_rows
        measure(name, src, n, need, a.repeat)
    topics.cleanup()


# ------------------------------------------------------------------------------ kafka-tail
# Repeated `latest_by` + equality scans of one topic (the shape of `nearby_offers`'
# `kafka://bus/location_stream` binding), three ways side by side:
#   before      connectors/kafka.py as of --before-rev (a new consumer per scan, each
#               consume() waiting its whole 0.5 s timeout), loaded from git
#   stream      today's uncached scan (`cache: false`): a new consumer per scan
#   tail cache  the default: decoded Arrow kept per topic, caught up at each scan
# on a 150-message and a --big-message topic (noida, 4 partitions); "+10 new" produces
# 10 messages before every timed scan (the catch-up cost); then fab.query("nearby_offers",
# session={"user_id": 3}) end to end on examples/seed with each connector.

BEFORE_REV = "8883aab"  # the last commit before the tail cache


def load_before(rev: str) -> Any:
    """connectors/kafka.py at ``rev`` as the module ``connectors._kafka_before``."""
    import importlib.util
    import subprocess

    code = subprocess.run(
        ["git", "show", f"{rev}:connectors/kafka.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = "connectors._kafka_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    exec(compile(code, f"{rev}:connectors/kafka.py", "exec"), mod.__dict__)
    return mod


def location_rows(n: int, users: int) -> list[bytes]:
    return [
        json.dumps(
            {"user_id": i % users, "lat": 48.0 + (i % 97) / 100, "lon": 2.0 + (i % 89) / 100}
        ).encode()
        for i in range(n)
    ]


def produce_values(bootstrap: str, topic: str, values: list[bytes]) -> None:
    from confluent_kafka import Producer

    p = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "queue.buffering.max.messages": 1_000_000}
    )
    for v in values:
        p.produce(topic, value=v)
        p.poll(0)
    assert p.flush(60) == 0


def latest_for(src: Source, user: int) -> list[dict[str, Any]]:
    req = ScanRequest(
        filters=(Binary("=", Column("user_id"), Param("u")),),
        params={"u": user},
        latest_by=("user_id",),
    )
    return pa.Table.from_batches(list(src.scan(req)), schema=src.schema()).to_pylist()


def kafka_tail(a: argparse.Namespace) -> None:
    from connectors.kafka import KafkaConnection

    before = load_before(a.before_rev)
    srv = load()
    bs = srv.kafka_bootstrap
    topics = TopicFactory(bs, "tailbench" + uuid.uuid4().hex[:6])
    schema = {"user_id": "int", "lat": "float", "lon": "float"}
    modes = {
        "before": lambda t: before.KafkaConnection(
            "bus", {"bootstrap": bs, "schemas": {t: schema}}
        ),
        "stream": lambda t: KafkaConnection(
            "bus", {"bootstrap": bs, "schemas": {t: schema}, "cache": False}
        ),
        "tail cache": lambda t: KafkaConnection("bus", {"bootstrap": bs, "schemas": {t: schema}}),
    }
    print(
        f"latest_by user_id + user_id = {{{{session.u}}}}, p50 / p95 ms over {a.repeat} scans "
        f"(before = connectors/kafka.py at {a.before_rev})"
    )
    print(f"{'topic':<22} | " + " | ".join(f"{m:>17}" for m in modes) + " | before / cache")
    try:
        for n in (150, a.big):
            users = min(50, n)
            topic = topics(partitions=4, prefix="tail")
            produce_values(bs, topic, location_rows(n, users))
            for grow in (False, True):
                cells, p50 = [], {}
                answers = {}
                for mode, make in modes.items():
                    conn = make(topic)
                    src = conn.source(topic)
                    t0 = time.perf_counter()
                    latest_for(src, 3)  # first scan (cold cache)
                    cold = (time.perf_counter() - t0) * 1000
                    times = []
                    reps = a.repeat if n <= 1000 or mode == "tail cache" else max(3, a.repeat // 6)
                    for r in range(reps):
                        if grow:
                            produce_values(bs, topic, location_rows(10, users))
                        t0 = time.perf_counter()
                        latest_for(src, r % users)
                        times.append((time.perf_counter() - t0) * 1000)
                    answers[mode] = latest_for(src, 3)
                    conn.close()
                    p50[mode], p95 = _pct(times)
                    cells.append(f"{p50[mode]:>7.1f} / {p95:>7.1f}")
                    if mode == "tail cache":
                        cells[-1] += f" (cold {cold:.0f})"
                # every way gives the same answer (new messages repeat the same values)
                assert answers["before"] == answers["stream"] == answers["tail cache"], answers
                label = f"{n} msgs" + (" +10 new" if grow else "")
                ratio = p50["before"] / max(p50["tail cache"], 1e-9)
                print(
                    f"{label:<22} | " + " | ".join(f"{c:>17}" for c in cells) + f" | {ratio:.0f}x"
                )
    finally:
        topics.cleanup()
    nearby_offers(a, before)


def nearby_offers(a: argparse.Namespace, before: Any) -> None:
    """``fab.query("nearby_offers", session={"user_id": 3})`` with each Kafka connector."""
    import os
    import tempfile

    import examples.seed.load as seed
    import fabric
    from connectors.kafka import KafkaConnection
    from crypto import KeyRing
    from fabric.config import load_config

    env = seed.environment()
    if a.load:
        from examples.seed.data import generate

        print("loading examples/seed ...", seed.load_all(env, generate()), flush=True)
    work = Path(tempfile.mkdtemp(prefix="fabric-bench-"))
    (work / "agent.pub").write_bytes(KeyRing.generate().public_context())
    env["FABRIC_AGENT_PUBLIC_CONTEXT"] = str(work / "agent.pub")
    env.setdefault("FABRIC_STATE_DIR", str(work / "state"))
    os.environ.update(env)
    path = ROOT / "examples/seed/fabric.yaml"
    opts = dict(load_config(path).connections["bus"].options)
    kinds = {
        "before": lambda: before.KafkaConnection("bus", opts),
        "stream": lambda: KafkaConnection("bus", {**opts, "cache": False}),
        "tail cache": lambda: KafkaConnection("bus", opts),
    }
    cells, p50, answers = [], {}, {}
    for mode, make in kinds.items():
        fab = fabric.open(path, ingest=False, connections={"bus": make()})
        try:
            fab.query("nearby_offers", session={"user_id": 3})  # warm: plan, connections
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                res = fab.query("nearby_offers", session={"user_id": 3})
                times.append((time.perf_counter() - t0) * 1000)
            answers[mode] = res.table.to_pylist()
        finally:
            fab.close()
        p50[mode], p95 = _pct(times)
        cells.append(f"{p50[mode]:>7.1f} / {p95:>7.1f}")
    assert answers["before"] == answers["stream"] == answers["tail cache"], answers
    ratio = p50["before"] / max(p50["tail cache"], 1e-9)
    label = f"nearby_offers ({len(answers['tail cache'])} rows)"
    print(f"{label:<22} | " + " | ".join(f"{c:>17}" for c in cells) + f" | {ratio:.0f}x")


# ------------------------------------------------------------------------------ drivers
# Rows/s of each source's scan through the fabric's connector with each driver it can use,
# next to the fastest way its ecosystem offers (which may not keep types exact or bind
# parameters: said in the "note" column), on TPC-H SF --sf tables as benchmarks/tpch
# loads them: MariaDB orders, PostgreSQL partsupp, S3 Parquet lineitem (Q1's 7 columns).

ORDERS = (
    "o_orderkey",
    "o_custkey",
    "o_orderstatus",
    "o_totalprice",
    "o_orderdate",
    "o_orderpriority",
)
PARTSUPP = ("ps_partkey", "ps_suppkey", "ps_availqty", "ps_supplycost", "ps_comment")
LINEITEM = (
    "l_returnflag",
    "l_linestatus",
    "l_quantity",
    "l_extendedprice",
    "l_discount",
    "l_tax",
    "l_shipdate",
)


def _median_ms(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    fn()  # warm: connections, footers, plans
    times, rows = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), rows


def _connector(conn: Any, obj: str, cols: tuple[str, ...]) -> Callable[[], int]:
    src = conn.source(obj)
    return lambda: (
        pa.Table.from_batches(
            list(src.scan(ScanRequest(columns=cols))),
            schema=pa.schema([src.schema().field(c) for c in cols]),
        ).num_rows
    )


def _mysql_ways(url: str) -> list[tuple[str, Callable[[], int], str]]:
    import importlib.util

    from sqlalchemy.engine import make_url

    from connectors.sql import SqlConnection
    from connectors.sql_drivers import MYSQL_DRIVERS

    ways: list[tuple[str, Callable[[], int], str]] = []
    for driver, module in (*MYSQL_DRIVERS, ("mysqldb", "MySQLdb")):
        if importlib.util.find_spec(module) is None:
            continue
        conn = SqlConnection("b", {"kind": "mysql", "url": url, "driver": driver})
        ways.append(
            (f"connector, {driver}", _connector(conn, "orders", ORDERS), "Arrow, exact types")
        )
    u = make_url(url)
    sql = f"SELECT {', '.join(ORDERS)} FROM orders WHERE o_orderkey > ?"
    if importlib.util.find_spec("mariadb"):
        import mariadb

        def raw_mariadb() -> int:
            c = mariadb.connect(
                user=u.username, password=u.password, host=u.host, port=u.port, database=u.database
            )
            try:
                cur = c.cursor(binary=True, buffered=True)
                cur.execute(sql, (0,))
                return len(cur.fetchall())
            finally:
                c.close()

        ways.append(("mariadb cursor only", raw_mariadb, "tuples, no Arrow (driver floor)"))
    if importlib.util.find_spec("connectorx"):
        import connectorx

        def cx() -> int:
            q = sql.replace("?", "0")  # text only: connectorx cannot bind parameters
            return int(
                connectorx.read_sql(str(u.set(drivername="mysql")), q, return_type="arrow").num_rows
            )

        ways.append(("connectorx", cx, "Arrow; no bound parameters: not usable"))
    return ways


def _pg_ways(url: str) -> list[tuple[str, Callable[[], int], str]]:
    import importlib.util

    from sqlalchemy.engine import make_url

    from connectors.sql import SqlConnection

    conn = SqlConnection("b", {"kind": "postgres", "url": url})
    ways = [("connector, psycopg", _connector(conn, "partsupp", PARTSUPP), "Arrow, exact types")]
    u = make_url(url)
    dsn = u.set(drivername="postgresql").render_as_string(hide_password=False)
    sql = f"SELECT {', '.join(PARTSUPP)} FROM partsupp WHERE ps_partkey > $1"
    import psycopg

    def raw_psycopg() -> int:
        with psycopg.connect(dsn) as c:
            cur = c.cursor(binary=True)
            cur.execute(sql.replace("$1", "%s"), (0,))
            return len(cur.fetchall())

    ways.append(("psycopg binary cursor only", raw_psycopg, "tuples, no Arrow (driver floor)"))
    if importlib.util.find_spec("adbc_driver_postgresql"):
        import adbc_driver_postgresql.dbapi as adbc

        def raw_adbc() -> int:
            with adbc.connect(dsn) as c, c.cursor() as cur:
                cur.execute(sql, (0,))
                return int(cur.fetch_arrow_table().num_rows)

        ways.append(("ADBC postgresql", raw_adbc, "Arrow; NUMERIC as text (needs a cast)"))
    return ways


def _s3_ways(data: Any) -> list[tuple[str, Callable[[], int], str]]:
    import pyarrow.dataset as ds

    from connectors.s3 import S3Connection

    conn = S3Connection(
        "lake",
        {
            "kind": "s3",
            "endpoint": data.s3_endpoint,
            "bucket": "tpch",
            "prefix": data.s3_prefix,
            "access_key": data.s3_access_key,
            "secret_key": data.s3_secret_key,
        },
    )
    ways = [("connector", _connector(conn, "lineitem/", LINEITEM), "Arrow, exact types")]
    fs = conn.fs
    paths = [f"tpch/{data.s3_prefix}lineitem/part-{i}.parquet" for i in range(4)]
    for label, fmt in (
        ("pyarrow dataset, pre_buffer", ds.ParquetFileFormat()),
        (
            "pyarrow dataset, no pre_buffer",
            ds.ParquetFileFormat(
                default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False)
            ),
        ),
    ):
        dataset = ds.dataset(paths, filesystem=fs, format=fmt)
        ways.append((label, lambda d=dataset: d.to_table(columns=list(LINEITEM)).num_rows, "Arrow"))
    import duckdb

    con = duckdb.connect()
    con.register("lineitem", ds.dataset(paths, filesystem=fs, format="parquet"))

    def duck() -> int:
        return int(
            con.execute(
                "SELECT count(l_returnflag), count(l_linestatus), sum(l_quantity), "
                "sum(l_extendedprice), sum(l_discount), sum(l_tax), max(l_shipdate), count(*) "
                "FROM lineitem"
            ).fetchone()[0]
        )  # type: ignore[index]

    ways.append(("DuckDB over the dataset", duck, "aggregates every column (no Arrow out)"))
    return ways


def drivers(a: argparse.Namespace) -> None:
    from benchmarks.tpch import load as tpch_load

    data = tpch_load.prepare(a.sf)
    print(f"TPC-H SF {a.sf:g}: p50 of {a.repeat} full scans after one warm-up", flush=True)
    print(
        f"{'source':<22} {'way':<32} {'p50 ms':>8} {'rows':>8} {'rows/s':>10} {'x best':>7}  note"
    )
    for name, ways in (
        (f"MariaDB orders x{len(ORDERS)}", _mysql_ways(data.mariadb_url)),
        (f"PostgreSQL partsupp x{len(PARTSUPP)}", _pg_ways(data.pg_url)),
        (f"S3 lineitem x{len(LINEITEM)}", _s3_ways(data)),
    ):
        results = [(label, *_median_ms(fn, a.repeat), note) for label, fn, note in ways]
        best = min(r[1] for r in results)
        for label, ms, rows, note in results:
            print(
                f"{name:<22} {label:<32} {ms:>8.0f} {rows:>8} {rows / ms * 1000:>10.0f} {ms / best:>6.1f}x  {note}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "which", choices=["pushdown", "kafka-tail", "drivers"], nargs="?", default="kafka-tail"
    )
    ap.add_argument("--sf", type=float, default=0.1, help="drivers: TPC-H scale factor")
    ap.add_argument("--rows", type=int, default=200_000, help="pushdown: rows per source")
    ap.add_argument(
        "--repeat", type=int, default=None, help="timed runs (7 pushdown, 30 kafka-tail)"
    )
    ap.add_argument(
        "--big", type=int, default=100_000, help="kafka-tail: messages of the big topic"
    )
    ap.add_argument("--load", action="store_true", help="kafka-tail: load examples/seed first")
    ap.add_argument("--before-rev", default=BEFORE_REV, help="kafka-tail: git revision of 'before'")
    a = ap.parse_args()
    if a.which == "pushdown":
        a.repeat = a.repeat or 7
        pushdown(a)
    elif a.which == "drivers":
        a.repeat = a.repeat or 5
        drivers(a)
    else:
        a.repeat = a.repeat or 30
        kafka_tail(a)


if __name__ == "__main__":
    main()
