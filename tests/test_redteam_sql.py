"""Red team, MariaDB and PostgreSQL: each filter evaluated pushed (as the planner and
executor do: ``connectors.testing.conformance.fabric_scan``), by the fabric on the rows
as read, and by DuckDB on the same rows. Trailing spaces under MariaDB's PAD SPACE
collations, LIKE escapes, empty strings and NULL, ``in`` lists with NULL, reversed
BETWEEN bounds, DECIMAL(38, 10) extremes, NaN and infinities in PostgreSQL floats, and
DECIMALs wider than Arrow's (read as doubles).

Found here: a DECIMAL wider than 38 digits (MariaDB DECIMAL(65, 30), PostgreSQL NUMERIC
without a precision) is read as a double but was compared exactly by the server:
``w = 0.3`` answered 1 row where the fabric reads 0.3 in 3 of them (0.30000000000000001
and 0.29999999999999999 stored), and ``w > 0.3`` returned a row that shows 0.3;
PostgreSQL orders NaN above every number and equal to itself, as DuckDB does and, since
ee8b589, the fabric's pyarrow evaluation too, so its floats are pushed as they are (for a
while they were guarded to IEEE semantics, which then disagreed with the fabric)."""

from __future__ import annotations

import decimal
from collections.abc import Iterator
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from connectors.testing.conformance import fabric_scan
from dsl.parser import parse_expr
from fabric import functions
from tests.servers import sql_source, sql_url

D = decimal.Decimal
BIG = D("9999999999999999999999999999.9999999999")
NAN, INF = float("nan"), float("inf")
S = ["a", "a ", " a", "A", "", None, "a_b", "a%b", "a\\b", "ab\\", "ß", "b", "a\t"]
F = [NAN, INF, -INF, 0.0, -0.0, 1.5, None, 2.0, -2.5]
W = [D("0.30000000000000001"), D("0.3"), D("0.29999999999999999"), None, D("1"), D("-0.3")]
DD = [
    BIG,
    D("-9999999999999999999999999999.9999999999"),
    D("0"),
    None,
    D("0.0000000001"),
    D("-0.0000000001"),
]
ROWS = [
    {
        "id": i,
        "s": S[i % len(S)],
        "f": F[i % len(F)],
        "w": W[i % len(W)],
        "d": DD[i % len(DD)],
    }
    for i in range(60)
]
DDL = {
    "mysql": "CREATE TABLE rt_vals (id BIGINT PRIMARY KEY, s VARCHAR(20), f DOUBLE, "
    "w DECIMAL(65, 30), d DECIMAL(38, 10)) CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci",
    "postgres": "CREATE TABLE rt_vals (id BIGINT PRIMARY KEY, s VARCHAR(20), "
    "f DOUBLE PRECISION, w NUMERIC, d NUMERIC(38, 10))",
}


@pytest.fixture(scope="module", params=["mysql", "postgres"])
def src(request: pytest.FixtureRequest) -> Iterator[Any]:
    kind = request.param
    rows = ROWS
    if kind == "mysql":  # MariaDB stores no NaN nor infinity
        rows = [
            {**r, "f": None if r["f"] in (INF, -INF) or r["f"] != r["f"] else r["f"]} for r in ROWS
        ]
    with sql_source(sql_url(request, kind), kind, "rt_vals", DDL[kind], rows) as s:
        yield s


FILTERS = [
    "s = 'a'",
    "s = 'a '",
    "s != 'a'",
    "s in ('a ', 'b')",
    "s in ('a', null)",
    "s not in ('a', null)",
    "not (s in ('a', null))",
    "s < 'a '",
    "s >= 'a'",
    "s = ''",
    "s != ''",
    "s is null",
    "s like 'a '",
    "s like 'a_'",
    "s like 'a\\_b'",
    "s like 'a\\%b'",
    "s like 'a\\\\b'",
    "s like '%\\\\'",
    "s like '%\\\\%'",
    "s like ''",
    "s not like 'a%'",
    "s between 'b' and 'a'",
    "not (s between 'b' and 'a')",
    "f > 1",
    "f >= 2",
    "f = 0",
    "f < 1",
    "not (f > 1)",
    "not (f <= 1)",
    "f != 1.5",
    "f in (1.5, 0)",
    "f in (1.5, null)",
    "f not in (1.5, 0)",
    "f between 2 and 1",
    "not (f between 2 and 1)",
    "f between -3 and 3",
    "f > -1 or f < -1",
    "w = 0.3",
    "w > 0.3",
    "w <= 0.3",
    "w in (0.3, 1)",
    "w between 0.3 and 1",
    "w != 0.3",
    "d = 9999999999999999999999999999.9999999999",
    "d > 9999999999999999999999999999.999999999",
    "d < -9999999999999999999999999999.999999999",
    "d = 0.0000000001",
    "d > 0",
    "d in (0.0000000001, -0.0000000001)",
    "d between -0.0000000001 and 0.0000000001",
]


def _duckdb(full: pa.Table, where: str) -> list[int]:
    con = duckdb.connect()
    con.register("t", full)
    sql = f"SELECT id FROM t WHERE {where}"
    if "like" in where:
        sql += " ESCAPE '\\'"
    return sorted(r[0] for r in con.sql(sql).fetchall())


@pytest.mark.parametrize("where", FILTERS)
def test_a_pushed_filter_keeps_the_rows_the_fabric_keeps(src: Any, where: str) -> None:
    e = parse_expr(where)
    full, _, _ = fabric_scan(src, [])
    got, answers, _ = fabric_scan(src, [e])
    local = functions.filter_table(full, e, {}, resolve=lambda c: c.name)
    assert sorted(got["id"].to_pylist()) == sorted(local["id"].to_pylist()), answers
    assert sorted(local["id"].to_pylist()) == _duckdb(full, where), "fabric vs DuckDB"


def test_a_wide_decimal_reads_as_the_double_it_is_compared_as(src: Any) -> None:
    full, _, _ = fabric_scan(src, [])
    assert full.schema.field("w").type == pa.float64()
    zero3 = [r["id"] for r in full.to_pylist() if r["w"] == 0.3]
    got, _, _ = fabric_scan(src, [parse_expr("w = 0.3")])
    assert sorted(got["id"].to_pylist()) == sorted(zero3) and len(zero3) == 30
