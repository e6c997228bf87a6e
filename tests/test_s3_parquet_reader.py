"""Parquet in S3 decoded by DuckDB (connectors/s3_duckdb.py) gives what pyarrow gives.

The same objects, the same filters, two connections that differ only in
``parquet_reader``: the rows (in order) must be equal, every filter kind, every type, with
NULLs, NaN, long IN lists (a semi-join in DuckDB) and NOT over NULL-holding lists. A
rewritten object is read as it is now (the footer cache is keyed by size and mtime).
"""

from __future__ import annotations

import datetime as dt
import decimal
import random
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.base import ScanRequest
from connectors.s3 import S3Connection
from dsl import ast as A
from dsl.parser import parse_expr

D = decimal.Decimal
N = 900
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("q", pa.decimal128(15, 2)),
        ("f", pa.float64()),
        ("day", pa.date32()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("s", pa.string()),
        ("b", pa.bool_()),
        ("n", pa.int32()),
    ]
)


def _rows() -> list[dict[str, Any]]:
    rnd = random.Random(5)
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return [
        {
            "id": i,
            "q": None if i % 9 == 0 else D(rnd.randint(-500, 5000)) / 100,
            "f": float("nan") if i % 17 == 0 else None if i % 10 == 0 else rnd.random() * 10,
            "day": None if i % 11 == 0 else dt.date(1994, 1, 1) + dt.timedelta(days=i % 400),
            "ts": None if i % 12 == 0 else t0 + dt.timedelta(minutes=37 * i),
            "s": None if i % 8 == 0 else rnd.choice(["Brand#13", "Brand#1", "abc", "", "ß"]),
            "b": None if i % 7 == 0 else i % 3 == 0,
            "n": rnd.randint(0, 50),
        }
        for i in range(N)
    ]


PARAMS: dict[str, Any] = {
    "day": dt.date(1994, 6, 1),
    "disc": D("0.06"),
    "qty": 24,
    "keys": list(range(0, N, 3)),  # 300 keys: above the 256 bound, a semi-join in DuckDB
    "few": [5, 17, 400],
    "t": dt.datetime(2024, 1, 5, tzinfo=dt.UTC),
    "brand": "Brand#13",
}
FILTERS = [
    "day >= {{session.day}} and day < {{session.day}} + interval '1 year'",
    "q between {{session.disc}} - 0.01 and {{session.disc}} + 40",
    "q < {{session.qty}}",
    "id in {{session.keys}}",
    "id in {{session.few}} or s = 'abc'",
    "not (id in {{session.keys}})",
    "n in (1, 2, null)",
    "not (n in (1, 2, null))",
    "not (q in (0.05, null))",
    "s = {{session.brand}}",
    "s != 'abc'",
    "s >= 'B' and s < 'C'",
    "s like 'Brand#1%'",  # left to pyarrow
    "f > 5",  # floats (NaN) left to pyarrow
    "f < 5 or b",
    "b",
    "not b",
    "b is null",
    "ts >= {{session.t}}",
    "ts is not null and day is null",
    "q * 2 > 10",  # arithmetic over a column: pyarrow
    "id > 100 and id <= 700 and (s = 'abc' or q is null)",
    "id = 1000000",
]


@pytest.fixture(scope="module")
def lake(s3: Any) -> dict[str, Any]:
    rows = _rows()
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    for i in range(3):  # three files, several row groups each
        part = table.slice(i * 300, 300)
        pq.write_table(part, f"{s3.bucket}/t/part-{i}.parquet", filesystem=s3.fs, row_group_size=70)
    opts = {
        "kind": "s3",
        "endpoint": s3.endpoint,
        "bucket": s3.bucket,
        "access_key": s3.access_key,
        "secret_key": s3.secret_key,
    }
    return {
        "s3": s3,
        "duckdb": S3Connection("lake", opts),
        "pyarrow": S3Connection("lake", {**opts, "parquet_reader": "pyarrow"}),
    }


def _scan(conn: S3Connection, text: str | None, columns: list[str] | None = None, **kw: Any):
    src = conn.source("t/")
    filters = () if text is None else (A.unqualify(parse_expr(text)),)
    cols = tuple(columns) if columns else None
    req = ScanRequest(columns=cols, filters=filters, params=PARAMS, **kw)
    table = pa.Table.from_batches(list(src.scan(req)), schema=_schema(src, columns))
    return table, req.metrics.extra["reader"]  # the scan's own report of who read it


def _schema(src: Any, columns: list[str] | None) -> pa.Schema:
    s = src.schema()
    return s if columns is None else pa.schema([s.field(c) for c in columns])


@pytest.mark.parametrize("text", FILTERS)
def test_duckdb_reader_gives_the_rows_pyarrow_gives(lake: dict[str, Any], text: str) -> None:
    got, reader = _scan(lake["duckdb"], text)
    want, ref = _scan(lake["pyarrow"], text)
    assert reader == "duckdb" and ref == "pyarrow"
    assert got.schema == want.schema
    assert got.to_pylist() == want.to_pylist() or _nan_equal(got, want), text


def _nan_equal(a: pa.Table, b: pa.Table) -> bool:
    def norm(rows: list[dict[str, Any]]) -> list[Any]:
        return [
            {k: "nan" if isinstance(v, float) and v != v else v for k, v in r.items()} for r in rows
        ]

    return norm(a.to_pylist()) == norm(b.to_pylist())


def test_projection_limit_and_no_columns(lake: dict[str, Any]) -> None:
    text = "q < {{session.qty}}"
    for columns, limit in ((["id", "s"], None), (["s"], 7), (["id"], 0)):
        got, _ = _scan(lake["duckdb"], text, columns, limit=limit)
        want, _ = _scan(lake["pyarrow"], text, columns, limit=limit)
        assert got.to_pylist() == want.to_pylist()
    # count(*): no column read, the rows still counted
    src = lake["duckdb"].source("t/")
    req = ScanRequest(columns=(), filters=(A.unqualify(parse_expr("n < 10")),), params=PARAMS)
    rows = sum(b.num_rows for b in src.scan(req))
    assert (
        rows == sum(1 for r in _rows() if r["n"] < 10) and req.metrics.extra["reader"] == "duckdb"
    )


def test_a_rewritten_object_is_read_as_it_is_now(lake: dict[str, Any]) -> None:
    s3 = lake["s3"]
    path = f"{s3.bucket}/w/x.parquet"
    conn = lake["duckdb"]
    for n in (10, 25):  # a different size: a new footer, new rows
        pq.write_table(pa.table({"id": pa.array(range(n), pa.int64())}), path, filesystem=s3.fs)
        src = conn.source("w/x.parquet")
        req = ScanRequest(filters=(A.unqualify(parse_expr("id >= 3")),))
        out = pa.Table.from_batches(list(src.scan(req)))
        assert out.column("id").to_pylist() == list(range(3, n))
        assert req.metrics.extra["reader"] == "duckdb"


def test_the_byte_cache_is_off_by_default_and_validated_by_the_listing(lake: dict[str, Any]):
    """``cache_mb`` keeps the ranges DuckDB read; the next scan lists the objects first,
    and one rewritten since (same size, later mtime) is read from the store again."""
    import time

    s3 = lake["s3"]
    assert lake["duckdb"].duck_files().cache_bytes == 0
    cached = S3Connection("lake", {**lake["duckdb"].options, "cache_mb": 64})
    path = f"{s3.bucket}/c/x.parquet"
    plain = {"compression": "none", "use_dictionary": False, "write_statistics": False}

    def write(values: list[int]) -> int:
        pq.write_table(
            pa.table({"v": pa.array(values, pa.int64())}), path, filesystem=s3.fs, **plain
        )
        return s3.fs.get_file_info(path).size

    def scan() -> list[int]:
        src = cached.source("c/x.parquet")
        req = ScanRequest(filters=(A.unqualify(parse_expr("v >= 0")),))
        out = pa.Table.from_batches(list(src.scan(req)))
        assert req.metrics.extra["reader"] == "duckdb"
        return out.column("v").to_pylist()

    n = 20_000  # 160 KB: more than the footer cache's 64 KiB
    size = write(list(range(n)))
    assert scan() == list(range(n))
    files = cached.duck_files()
    before = dict(files.counts)
    assert scan() == list(range(n))  # from the cache: no read of the store
    assert files.counts["store_reads"] == before["store_reads"]
    assert files.counts["cache_hits"] > before["cache_hits"]
    time.sleep(1.1)  # a later mtime (S3 keeps seconds)
    assert write(list(range(n, 2 * n))) == size  # the same size: only the mtime tells
    assert scan() == list(range(n, 2 * n))


def test_a_cached_object_is_read_by_duckdb_from_a_local_copy(lake: dict[str, Any]):
    """With ``cache_mb`` an object that fits is copied whole to a local file on first use
    and DuckDB reads that file (no Python call per read); a rewritten object (a later
    mtime in the listing) is copied again, and one past the budget is read through the
    file system with its ranges kept in memory, as before."""
    import time

    s3 = lake["s3"]
    small = S3Connection("lake", {**lake["duckdb"].options, "cache_mb": 1})
    path = f"{s3.bucket}/copy/x.parquet"
    plain = {"compression": "none", "use_dictionary": False}

    def write(values: list[int]) -> None:
        pq.write_table(
            pa.table({"v": pa.array(values, pa.int64())}), path, filesystem=s3.fs, **plain
        )

    def scan(conn: S3Connection) -> list[int]:
        req = ScanRequest(filters=(A.unqualify(parse_expr("v >= 10")),))
        out = pa.Table.from_batches(list(conn.source("copy/x.parquet").scan(req)))
        return out.column("v").to_pylist()

    write(list(range(100)))
    assert scan(small) == list(range(10, 100))
    files = small.duck_files()
    [local] = list(files._copies.values())
    assert local.startswith("/") and files.url(path).startswith("/")
    reads = files.counts["store_reads"]
    assert scan(small) == list(range(10, 100))
    assert files.counts["store_reads"] == reads  # the copy, not the store
    time.sleep(1.1)
    write(list(range(100, 300)))
    assert scan(small) == list(range(100, 300))  # re-copied after the listing changed
    assert list(files._copies.values()) != [local]
    write(list(range(200_000)))  # 1.6 MB: past the 1 MB budget
    assert scan(small) == list(range(10, 200_000))
    assert files.url(path).startswith(files.protocol + "://")
    small.close()
