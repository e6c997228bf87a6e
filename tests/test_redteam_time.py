"""Red team: timestamps with a zone other than UTC, and without a zone, at a scan.

The fabric's times are UTC: DuckDB (above joins, and the S3 Parquet reader) runs with
``TimeZone = 'UTC'``, so ``date_part('hour', ts)`` of a TIMESTAMPTZ is its UTC hour.
pyarrow reads the calendar fields of a zoned timestamp in the column's own zone.

Found here (quiet wrong answers on the old code): over a Parquet column typed
``timestamp[us, tz=America/New_York]`` (on the S3 server, and in memory),
``date_part('hour', ts) = 2`` kept the rows of 07:00 UTC (02:00 in New York) where DuckDB
keeps those of 02:00 UTC; ``date_trunc('day', ts) = {{session.d}}`` with d = 2024-03-10
00:00 UTC kept no row where DuckDB keeps the eight of that day; in Asia/Kolkata
``date_part('year', ts) = 2025`` kept 2024-12-31 23:30 UTC. ``date_trunc('hour', ts)``
over New York's repeated hour of 2024-11-03 raised pyarrow's 'Local time is ambiguous'.
A zoneless timestamp column (a memory table) compared with a zoned session value raised
'Cannot compare timestamp with timezone to timestamp without timezone'.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors import arrow_expr
from dsl.parser import parse_expr
from fabric import functions

U = dt.UTC
#: both 2024 DST changes of New York (and the UTC day and year boundaries)
TIMES = (
    [dt.datetime(2024, 3, 10, 6, 30, tzinfo=U) + dt.timedelta(minutes=30 * i) for i in range(8)]
    + [dt.datetime(2024, 11, 3, 5, 0, tzinfo=U) + dt.timedelta(minutes=30 * i) for i in range(7)]
    + [dt.datetime(2024, 12, 31, 23, 30, tzinfo=U), dt.datetime(2025, 1, 1, 0, 0, tzinfo=U)]
)
PARAMS = {
    "d": dt.datetime(2024, 3, 10, tzinfo=U),
    "d5": dt.datetime(2024, 3, 10, 5, tzinfo=U),
    "h": dt.datetime(2024, 11, 3, 6, tzinfo=U),
    "t": dt.datetime(2024, 11, 3, 1, 30, tzinfo=dt.timezone(dt.timedelta(hours=-4))),
}
FILTERS = [
    "date_part('hour', ts) = 2",
    "date_part('hour', ts) = 6",
    "date_part('day', ts) = 10",
    "date_part('year', ts) = 2025",
    "date_part('dow', ts) = 0",
    "date_part('month', ts) = 1",
    "date_trunc('day', ts) = {{session.d}}",
    "date_trunc('day', ts) = {{session.d5}}",
    "date_trunc('hour', ts) = {{session.h}}",
    "date_trunc('month', ts) > {{session.d}}",
    "date_trunc('week', ts) < {{session.d}}",
    "date_trunc('year', ts) = {{session.d}}",
    "ts > {{session.t}}",
    "ts = {{session.h}}",
]


def _table(tz: str | None, unit: str) -> pa.Table:
    ts = pa.array(TIMES, pa.timestamp("us", "UTC"))
    if tz is None:  # the same instants, written without a zone (UTC wall-clock times)
        ts = pa.array([t.replace(tzinfo=None) for t in TIMES], pa.timestamp("us"))
    ts = ts.cast(pa.timestamp(unit, tz))
    return pa.table({"id": pa.array(range(len(TIMES)), pa.int64()), "ts": ts})


def _duckdb(table: pa.Table, where: str) -> list[int]:
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    ts = table.schema.field("ts").type
    if ts.tz is None:  # the fabric's meaning of a zoneless time: UTC
        table = table.set_column(1, "ts", table["ts"].cast(pa.timestamp(ts.unit, "UTC")))
    con.register("x", table)
    sql = where
    for name in PARAMS:
        sql = sql.replace(f"{{{{session.{name}}}}}", f"${name}::TIMESTAMPTZ")
    used = {k: v for k, v in PARAMS.items() if f"${k}::" in sql}
    rows = con.execute(f"SELECT id FROM x WHERE {sql}", used).fetchall()
    return sorted(r[0] for r in rows)


@pytest.mark.parametrize("unit", ["s", "us", "ns"])
@pytest.mark.parametrize("tz", ["America/New_York", "Asia/Kolkata", "UTC", "+05:30", None])
def test_calendar_fields_of_a_zoned_timestamp_are_utcs(tz: str | None, unit: str) -> None:
    t = _table(tz, unit)
    wrong = []
    for where in FILTERS:
        want = _duckdb(t, where)
        e = parse_expr(where)
        got = [
            sorted(
                functions.filter_table(t, e, PARAMS, resolve=lambda c: c.name)["id"].to_pylist()
            ),
            sorted(arrow_expr.filter_table(t, e, PARAMS)["id"].to_pylist()),
        ]
        if got != [want, want]:
            wrong.append((where, got, want))
    assert not wrong, wrong


@pytest.mark.s3
@pytest.mark.parametrize("reader", ["duckdb", "pyarrow"])
def test_a_zoned_parquet_column_on_s3_filters_in_utc(s3: Any, reader: str) -> None:
    """The same filters over a Parquet file whose column is zoned America/New_York, on
    the S3 server, by the connector (either Parquet reader), vs DuckDB."""
    from connectors.testing.conformance import fabric_scan

    t = _table("America/New_York", "us")
    pq.write_table(t, s3.path(f"rt_time_{reader}/t.parquet"), filesystem=s3.fs)
    conn = s3.connection("lake", parquet_reader=reader)
    try:
        src = conn.source(f"rt_time_{reader}/t.parquet")
        assert src.schema().field("ts").type == pa.timestamp("us", "America/New_York")
        wrong = []
        for where in FILTERS:
            got, _, _ = fabric_scan(src, [parse_expr(where)], PARAMS)
            want = _duckdb(t, where)
            if sorted(got["id"].to_pylist()) != want:
                wrong.append((where, sorted(got["id"].to_pylist()), want))
        assert not wrong, wrong
    finally:
        conn.close()
