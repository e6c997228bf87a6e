"""Connector scan benchmark: pushdown vs fetch-everything, per connector, in one run.

    PYTHONPATH=. .venv/bin/python tests/connectors/bench_connectors.py [--rows 200000] [--repeat 7]

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
import time
import uuid
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.arrow_expr import filter_table
from connectors.base import ScanRequest, Source
from dsl.ast import Between, Binary, Column, Literal, Param, and_all
from tests.servers import TopicFactory, load, s3_filesystem

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

    client = pymongo.MongoClient(url)
    db = client["fabric_bench"]
    db.merchants.drop()
    db.merchants.insert_many(t.to_pylist(), ordered=False)
    db.merchants.create_index([("city", 1), ("score", 1)])
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


def timed(fn: Callable[[], int], repeat: int) -> tuple[float, float, int]:
    times, rows = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))], rows


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()
