"""MariaDB BIGINT UNSIGNED values at and past 2^63 come back exact (Arrow uint64).

The column was typed int64, so reading 2^63 raised a raw ``OverflowError`` (no column,
no hint) from pyarrow's conversion. Now the column is uint64: every value reads back as
stored, a pushed comparison against a value past 2^63 finds its rows, and the fabric's
own filters, joins and aggregates over the column give DuckDB's answer. INT UNSIGNED
(at most 2^32 - 1) still fits int64 and stays int64.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import duckdb
import pyarrow as pa
import pytest
import sqlalchemy as sa
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.base import ScanRequest
from connectors.sql import SqlConnection
from dsl.ast import Binary, Column, Literal
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build

TOP = (1 << 64) - 1
HALF = 1 << 63
VALUES = [0, 1, HALF - 1, HALF, HALF + 5, TOP, None]


@pytest.fixture
def unsigned(mariadb_url: str) -> Iterator[Any]:
    engine = sa.create_engine(mariadb_url)
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS unsigned_vals")
        c.exec_driver_sql(
            "CREATE TABLE unsigned_vals (id INT PRIMARY KEY, u BIGINT UNSIGNED, w INT UNSIGNED)"
        )
        c.execute(
            sa.text("INSERT INTO unsigned_vals VALUES (:i, :u, :w)"),
            [{"i": i, "u": v, "w": 4294967295 - i} for i, v in enumerate(VALUES)],
        )
    conn = SqlConnection("db", {"kind": "mysql", "url": mariadb_url})
    yield conn.source("unsigned_vals")
    conn.close()
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS unsigned_vals")
    engine.dispose()


def _read(src: Any, *filters: Any) -> pa.Table:
    req = ScanRequest(columns=("id", "u", "w"), filters=tuple(filters))
    batches = list(src.scan(req))
    return pa.Table.from_batches(batches, schema=batches[0].schema if batches else None)


def test_values_past_2_63_read_back_exact(unsigned: Any) -> None:
    schema = unsigned.schema()
    assert schema.field("u").type == pa.uint64()
    assert schema.field("w").type == pa.int64()
    got = _read(unsigned).sort_by("id")
    assert got.column("u").to_pylist() == VALUES
    assert got.column("w").to_pylist() == [4294967295 - i for i in range(len(VALUES))]


def test_a_pushed_comparison_past_2_63_finds_its_rows(unsigned: Any) -> None:
    got = _read(unsigned, Binary(">=", Column("u"), Literal(HALF, "int")))
    assert sorted(got.column("u").to_pylist()) == [HALF, HALF + 5, TOP]
    got = _read(unsigned, Binary("=", Column("u"), Literal(TOP, "int")))
    assert got.column("id").to_pylist() == [5]


def test_the_fabrics_filters_joins_and_aggregates_give_duckdbs_answer(unsigned: Any) -> None:
    binding = """
binding: unsigned_join
sources:
  a:
    from: memory://t/vals
  b:
    from: memory://t/vals
    join: b.u = a.u
    where: a.u > 1 and b.id != 2
select: [a.id, b.u, count(*) as n, max(a.u) as top]
group_by: [a.id, b.u]
"""
    cat = world.catalog(world.make_tables(), vals=unsigned)
    spec = load_text(binding, "unsigned_join.yaml")[0]
    plan = opt.optimize(build(spec, cat), cat)
    got = execute(plan, {}, cat, binding=spec.name, now=world.NOW).table
    rows = sorted(zip(*(got.column(c).to_pylist() for c in got.column_names)), key=repr)
    con = duckdb.connect()
    con.register("vals", _read(unsigned))
    want = con.sql(
        "SELECT a.id, b.u, count(*) AS n, max(a.u) AS top FROM vals a JOIN vals b "
        "ON b.u = a.u WHERE a.u > 1 AND b.id != 2 GROUP BY a.id, b.u"
    ).fetchall()
    assert rows == sorted(want, key=repr)
