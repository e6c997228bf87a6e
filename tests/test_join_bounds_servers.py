"""Join bounds (fabric/optimizer/join_bounds.py) pushed into MariaDB, PostgreSQL and S3
Parquet scans: ``x.c < y.v`` with ``c`` a DECIMAL(15, 2) or an integer column and ``v`` a
double with many places, a DECIMAL(18, 4), negative values, NULLs in ``v``, an empty
``y``, and ``y`` on the preserved side of a left join. The answer equals DuckDB's over
the same rows, with and without the rule, and the bound is in the plan."""

from __future__ import annotations

import decimal
from collections.abc import Iterator
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.sql import SqlConnection
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build

D = decimal.Decimal
N = 3000


def _x() -> pa.Table:
    rng = np.random.default_rng(3)
    cents = rng.integers(-5000, 5000, N)
    return pa.table(
        {
            "id": pa.array(np.arange(N), pa.int64()),
            "k": pa.array(rng.integers(0, 200, N), pa.int64()),
            "c": pa.array(
                [None if i % 37 == 0 else D(int(v)) / 100 for i, v in enumerate(cents)],
                pa.decimal128(15, 2),
            ),
            "n": pa.array(rng.integers(-50, 50, N), pa.int32()),
        }
    )


def _y(seed: int, rows: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    v = rng.uniform(-40, 40, rows)
    if seed == 4:  # ties: rows of x themselves, c as a double and as DECIMAL(18, 4)
        x = _x().filter(pc.is_valid(_x()["c"])).slice(0, rows)
        return pa.table(
            {
                "k": x["k"],
                "v": pc.cast(x["c"], pa.float64()),
                "d": pc.cast(x["c"], pa.decimal128(18, 4)),
            }
        )
    return pa.table(
        {
            "k": pa.array(rng.integers(0, 200, rows), pa.int64()),
            "v": pa.array(v, pa.float64(), mask=rng.random(rows) < 0.2),
            "d": pa.array(
                [D(f"{x:.4f}") for x in rng.uniform(-40, 40, rows)], pa.decimal128(18, 4)
            ),
        }
    )


def _sql(url: str, kind: str, x: pa.Table) -> Iterator[Any]:
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS jb_x")
        c.exec_driver_sql(
            "CREATE TABLE jb_x (id BIGINT PRIMARY KEY, k BIGINT, c DECIMAL(15, 2), n INTEGER)"
        )
        c.execute(sa.text("INSERT INTO jb_x VALUES (:id, :k, :c, :n)"), x.to_pylist())
    conn = SqlConnection("db", {"kind": kind, "url": url})
    yield conn.source("jb_x")
    conn.close()
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS jb_x")
    engine.dispose()


@pytest.fixture(scope="module", params=["mysql", "postgres", "s3"])
def xsource(request: pytest.FixtureRequest) -> Iterator[Any]:
    x = _x()
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        with s3.fs.open_output_stream(s3.path("jb/x/part-0.parquet")) as f:
            pq.write_table(x, f, row_group_size=500)
        yield s3.connection("lake").source("jb/x/*.parquet")
        return
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "mariadb_url")
    yield from _sql(url, request.param, x)


CONDS = ["x.c < y.v", "x.c >= y.d", "x.n <= y.v", "x.n > y.d", "y.v > x.c", "x.c <= y.d"]


def _binding(cond: str, how: str) -> str:
    return f"""
binding: bounded
sources:
  y:
    from: memory://t/y
    where: k < 150
  x:
    from: memory://t/x
    join: {{on: "x.k = y.k and {cond}", how: {how}}}
select: [y.k, x.id]
"""


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize("cond", CONDS)
@pytest.mark.parametrize(
    "seed,rows", [(1, 30), (2, 5), (3, 0), (4, 40)], ids=["30", "5", "empty", "ties"]
)
def test_a_bound_pushed_to_a_server_keeps_duckdbs_rows(
    xsource: Any, cond: str, how: str, seed: int, rows: int
) -> None:
    x, y = _x(), _y(seed, rows)
    con = duckdb.connect()
    con.register("x", x)
    con.register("y", y)
    sql = f"SELECT y.k, x.id FROM y {how.upper()} JOIN x ON x.k = y.k AND {cond} WHERE y.k < 150"
    want = sorted(con.sql(sql).fetchall(), key=repr)
    cat = world.catalog(world.make_tables(), x=xsource, y=world.MemorySource("memory://t/y", y))
    spec = load_text(_binding(cond, how), "bounded.yaml")[0]
    for with_rule in (True, False):
        rules = (
            opt.RULES if with_rule else tuple(r for r in opt.RULES if r.__name__ != "join_bounds")
        )
        plan = opt.optimize(build(spec, cat), cat, rules=rules)
        if with_rule and rows:
            line = next(s for s in plan.explain().splitlines() if "Scan: x <-" in s)
            assert " of y" in line, line
        t = execute(plan, {}, cat, binding=spec.name, now=world.NOW).table
        got = sorted(zip(t["k"].to_pylist(), t["id"].to_pylist()), key=repr)
        assert got == want, (with_rule, len(got), len(want))
