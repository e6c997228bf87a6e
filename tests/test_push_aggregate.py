"""An aggregate pushed into its source (fabric/optimizer/push_aggregate.py) answers what
DuckDB answers over the same rows, exactly (DECIMAL sums to the last digit, in DuckDB's
types), and the source returns the groups instead of the rows.

Differential checks: bindings over the in-memory world (a source that aggregates itself
with the SQL the S3 source falls back to) against DuckDB over the same table, with the
rule on and off; and S3 Parquet scans asked for an aggregate (grouped in DuckDB's reading
query, or over the rows read when a filter is left to pyarrow, or when the connection
reads with pyarrow) against DuckDB over the same rows. The explain-text fixtures are in
tests/fixtures/optimizer/push_aggregate/.
"""

from __future__ import annotations

import datetime as dt
import decimal
import random
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.base import Aggregation, ScanRequest
from connectors.s3 import S3Connection
from dsl import ast as A
from dsl.loader import load_text
from dsl.parser import parse_expr
from fabric.execute import execute
from fabric.plan.builder import build
from fabric.plan.nodes import Aggregate, Scan

D = decimal.Decimal
NOW = world.NOW

BINDINGS = {
    "by_user": (
        """
binding: by_user
session: {since: timestamp}
sources:
  o:
    from: memory://t/sales
    where: ordered_at >= {{session.since}}
select: [o.user_id, sum(o.amount) as spent, count(*) as n, avg(o.amount * 2 - 1) as a,
         min(o.sku) as lo, max(o.ordered_at) as last]
group_by: [o.user_id]
order_by: [o.user_id]
""",
        "SELECT user_id, sum(amount) AS spent, count(*) AS n, avg(amount * 2 - 1) AS a, "
        "min(sku) AS lo, max(ordered_at) AS last FROM orders WHERE ordered_at >= $since "
        "GROUP BY user_id ORDER BY user_id",
    ),
    "whole": (
        """
binding: whole
session: {user_id: int}
sources:
  o:
    from: memory://t/sales
    where: user_id = {{session.user_id}}
select:
  - sum(o.amount) as spent
  - count(*) as n
  - sum(o.sku * {{session.user_id}}) as k
""",
        "SELECT sum(amount) AS spent, count(*) AS n, sum(sku * $user_id) AS k FROM orders "
        "WHERE user_id = $user_id",
    ),
    "nothing_matches": (
        """
binding: nothing_matches
sources:
  o: {from: memory://t/sales, where: user_id = -1}
select: [sum(o.amount) as spent, count(*) as n]
""",
        "SELECT sum(amount) AS spent, count(*) AS n FROM orders WHERE user_id = -1",
    ),
    "having": (
        """
binding: having
sources:
  o: {from: memory://t/sales}
select: [o.sku, sum(o.amount) as spent]
group_by: [o.sku]
having: sum(o.amount) > 3000
order_by: [o.sku]
""",
        "SELECT sku, sum(amount) AS spent FROM orders GROUP BY sku HAVING sum(amount) > 3000 "
        "ORDER BY sku",
    ),
}
PARAMS = {"since": NOW - dt.timedelta(days=5), "user_id": 7}


def _run(text: str, rules: tuple) -> tuple[pa.Table, Any, Any]:
    cat = world.catalog()
    spec = load_text(text, "b.yaml")[0]
    plan = opt.optimize(build(spec, cat), cat, rules=rules)
    params = dict(PARAMS)
    res = execute(plan, params, cat, binding=spec.name, now=NOW)
    return res.table, plan, cat.source("memory://t/sales")


@pytest.mark.parametrize("name", sorted(BINDINGS))
def test_pushed_aggregate_equals_duckdb_and_the_unpushed_plan(name: str) -> None:
    text, sql = BINDINGS[name]
    got, plan, src = _run(text, opt.RULES)
    assert any(isinstance(s, Scan) and s.aggregate is not None for s in plan.walk())
    assert not any(isinstance(n, Aggregate) for n in plan.walk())
    assert src.asked, "the source was not asked for the aggregate"
    without = tuple(r for r in opt.RULES if r.__name__ != "push_aggregate")
    plain, plan2, _ = _run(text, without)
    assert any(isinstance(n, Aggregate) for n in plan2.walk())
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("orders", world.make_tables()["orders"])
    used = {k: v for k, v in PARAMS.items() if f"${k}" in sql}
    want = con.sql(sql, params=used).to_arrow_table()
    assert got.column_names == plain.column_names
    assert got.to_pylist() == plain.to_pylist()
    assert [list(r.values()) for r in got.to_pylist()] == [
        list(r.values()) for r in want.to_pylist()
    ]
    assert got.schema == plain.schema


# ---------------------------------------------------------------- S3 Parquet

N = 1200
SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("flag", pa.string()),
        ("q", pa.decimal128(15, 2)),
        ("p", pa.decimal128(15, 2)),
        ("f", pa.float64()),
        ("day", pa.date32()),
    ]
)


def _rows() -> list[dict[str, Any]]:
    rnd = random.Random(11)
    return [
        {
            "k": i,
            "flag": None if i % 13 == 0 else rnd.choice(["A", "N", "R"]),
            "q": None if i % 9 == 0 else D(rnd.randint(100, 5000)) / 100,
            "p": D(rnd.randint(0, 10)) / 100,
            "f": rnd.random() * 10,
            "day": dt.date(1994, 1, 1) + dt.timedelta(days=i % 700),
        }
        for i in range(N)
    ]


def _c(name: str) -> A.Column:
    return A.Column(name)


AGG = Aggregation(
    (("flag", _c("flag"), pa.string()),),
    (
        ("s", A.Call("sum", (_c("q"),)), pa.decimal128(38, 2)),
        (
            "rev",
            A.Call(
                "sum",
                (
                    A.Binary(
                        "*",
                        A.Binary("*", _c("q"), A.Binary("-", A.Literal(1, "int"), _c("p"))),
                        A.Binary("+", A.Literal(1, "int"), _c("p")),
                    ),
                ),
            ),
            pa.decimal128(38, 6),
        ),
        ("a", A.Call("avg", (_c("q"),)), pa.float64()),
        ("n", A.Call("count", (A.Star(),)), pa.int64()),
        ("last", A.Call("max", (_c("day"),)), pa.date32()),
    ),
)
REF_SQL = (
    "SELECT flag, sum(q) AS s, sum(q * (1 - p) * (1 + p)) AS rev, avg(q) AS a, "
    "CAST(count(*) AS BIGINT) AS n, max(day) AS last FROM t WHERE {where} GROUP BY flag"
)


@pytest.fixture(scope="module")
def lake(s3: Any) -> dict[str, Any]:
    table = pa.Table.from_pylist(_rows(), schema=SCHEMA)
    for i in range(3):
        pq.write_table(
            table.slice(i * 400, 400), f"{s3.bucket}/agg/part-{i}.parquet", filesystem=s3.fs
        )
    opts = {
        "kind": "s3",
        "endpoint": s3.endpoint,
        "bucket": s3.bucket,
        "access_key": s3.access_key,
        "secret_key": s3.secret_key,
    }
    return {
        "table": table,
        "duckdb": S3Connection("lake", opts),
        "pyarrow": S3Connection("lake", {**opts, "parquet_reader": "pyarrow"}),
    }


@pytest.mark.parametrize(
    ("reader", "text", "where"),
    [
        ("duckdb", "day >= {{session.day}} and q < {{session.qty}}", "day >= $day AND q < $qty"),
        ("duckdb", "f > 5", "f > 5"),  # floats are left to pyarrow: aggregated after it
        ("pyarrow", "day >= {{session.day}}", "day >= $day"),
        ("duckdb", "k < 0", "k < 0"),  # no rows: no groups
    ],
)
def test_s3_aggregate_equals_duckdb(lake: dict[str, Any], reader: str, text: str, where: str):
    params = {"day": dt.date(1994, 6, 1), "qty": 30}
    src = lake[reader].source("agg/")
    req = ScanRequest(
        columns=("flag", "q", "p", "day"),
        filters=(A.unqualify(parse_expr(text)),),
        params=params,
        aggregate=AGG,
    )
    got = pa.Table.from_batches(list(src.scan(req)), schema=AGG.schema)
    assert got.schema == AGG.schema
    con = duckdb.connect()
    con.register("t", lake["table"])
    used = {k: v for k, v in params.items() if f"${k}" in where}
    want = con.sql(REF_SQL.format(where=where), params=used).to_arrow_table()

    def key(r: dict[str, Any]) -> Any:
        return (r["flag"] is None, r["flag"] or "")

    assert sorted(got.to_pylist(), key=key) == sorted(want.to_pylist(), key=key)
    assert got.num_rows == (0 if where == "k < 0" else 4)


# ---------------------------------------------------------------- SQL servers

SQL_AGG = Aggregation(
    (("g", _c("g"), pa.int64()),),
    (
        ("s", A.Call("sum", (_c("q"),)), pa.decimal128(38, 2)),
        (
            "rev",
            A.Call(
                "sum",
                (
                    A.Binary(
                        "*",
                        A.Binary("*", _c("q"), A.Binary("-", A.Literal(1, "int"), _c("p"))),
                        A.Binary("+", A.Literal(1, "int"), _c("p")),
                    ),
                ),
            ),
            pa.decimal128(38, 6),
        ),
        ("ks", A.Call("sum", (_c("k"),)), pa.int64()),
        ("n", A.Call("count", (A.Star(),)), pa.int64()),
        ("nq", A.Call("count", (_c("q"),)), pa.int64()),
        ("lo", A.Call("min", (_c("q"),)), pa.decimal128(15, 2)),
        ("last", A.Call("max", (_c("day"),)), pa.date32()),
    ),
)
SQL_REF = (
    "SELECT g, sum(q) AS s, sum(q * (1 - p) * (1 + p)) AS rev, CAST(sum(k) AS BIGINT) AS ks, "
    "CAST(count(*) AS BIGINT) AS n, CAST(count(q) AS BIGINT) AS nq, min(q) AS lo, "
    "max(day) AS last FROM t WHERE {where} GROUP BY g"
)


def _sql_source(url: str, name: str) -> Any:
    import sqlalchemy as sa

    from connectors.sql import SqlConnection

    engine = sa.create_engine(url)
    md = sa.MetaData()
    t = sa.Table(
        name,
        md,
        sa.Column("k", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("g", sa.BigInteger),
        sa.Column("flag", sa.String(4)),
        sa.Column("q", sa.Numeric(15, 2)),
        sa.Column("p", sa.Numeric(15, 2)),
        sa.Column("f", sa.Float(53)),
        sa.Column("day", sa.Date),
    )
    md.drop_all(engine)
    md.create_all(engine)
    with engine.begin() as c:
        c.execute(t.insert(), [{**r, "g": r["k"] % 5} for r in _rows()])
    engine.dispose()
    conn = SqlConnection("db", {"url": url})
    return conn, conn.source(name)


@pytest.mark.parametrize("server", ["mariadb", "postgres"])
@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("day >= {{session.day}} and q < {{session.qty}}", "day >= $day AND q < $qty"),
        ("k < 0", "k < 0"),
    ],
)
def test_sql_aggregate_is_grouped_by_the_server_and_equals_duckdb(
    request: Any, server: str, text: str, where: str
) -> None:
    url = request.getfixturevalue("mariadb_url" if server == "mariadb" else "pg_url")
    conn, src = _sql_source(url, "agg_t")
    agg = SQL_AGG
    if server == "mariadb":  # no sum of integers there (its cast back saturates)
        agg = Aggregation(SQL_AGG.group_by, tuple(a for a in SQL_AGG.aggregates if a[0] != "ks"))
        assert not src.supports_aggregate(SQL_AGG)
    try:
        assert src.supports_aggregate(agg)
        params = {"day": dt.date(1994, 6, 1), "qty": 30}
        req = ScanRequest(
            columns=("g", "q", "p", "k", "day"),
            filters=(A.unqualify(parse_expr(text)),),
            params=params,
            aggregate=agg,
        )
        got = pa.Table.from_batches(list(src.scan(req)), schema=agg.schema)
        assert "GROUP BY" in (req.metrics.statement or "").upper()
        table = pa.Table.from_pylist([{**r, "g": r["k"] % 5} for r in _rows()])
        con = duckdb.connect()
        con.register("t", table)
        used = {k: v for k, v in params.items() if f"${k}" in where}
        want = con.sql(SQL_REF.format(where=where), params=used).to_arrow_table()
        want = want.select(agg.schema.names)
        assert sorted(got.to_pylist(), key=lambda r: r["g"]) == sorted(
            want.to_pylist(), key=lambda r: r["g"]
        )
    finally:
        conn.close()


@pytest.mark.parametrize("server", ["mariadb", "postgres"])
def test_sql_sources_decline_what_the_server_computes_otherwise(request: Any, server: str):
    url = request.getfixturevalue("mariadb_url" if server == "mariadb" else "pg_url")
    conn, src = _sql_source(url, "agg_t2")
    try:
        avg = Aggregation((), (("a", A.Call("avg", (_c("q"),)), pa.float64()),))
        div = Aggregation(
            (),
            (("h", A.Call("sum", (A.Binary("/", _c("q"), A.Literal(2, "int")),)), pa.float64()),),
        )
        floats = Aggregation((), (("x", A.Call("sum", (_c("f"),)), pa.float64()),))
        text = Aggregation(
            (("flag", _c("flag"), pa.string()),), (("n", A.Call("count", (A.Star(),)), pa.int64()),)
        )
        for agg in (avg, div, floats):
            assert not src.supports_aggregate(agg), agg
        # PostgreSQL groups text by equality; MariaDB's collations fold case
        assert src.supports_aggregate(text) == (server == "postgres")
    finally:
        conn.close()


@pytest.mark.parametrize("server", ["mariadb", "postgres"])
def test_a_pushed_integer_sum_past_bigint_is_exact_or_an_error(request: Any, server: str):
    """MariaDB's CAST(... AS SIGNED) saturates at 2^63-1 with only a warning: a pushed
    SUM of integers past it came back as 9223372036854775807, quietly wrong. Pushed or
    not, the answer is the exact sum or an error."""
    import sqlalchemy as sa

    from connectors.base import SourceError
    from connectors.sql import SqlConnection

    url = request.getfixturevalue("mariadb_url" if server == "mariadb" else "pg_url")
    engine = sa.create_engine(url)
    md = sa.MetaData()
    t = sa.Table(
        "agg_ovf",
        md,
        sa.Column("k", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("x", sa.BigInteger),
    )
    md.drop_all(engine)
    md.create_all(engine)
    big = 9_000_000_000_000_000_000
    with engine.begin() as c:
        c.execute(t.insert(), [{"k": 1, "x": big}, {"k": 2, "x": big}])
    engine.dispose()
    conn = SqlConnection("db", {"url": url})
    try:
        src = conn.source("agg_ovf")
        agg = Aggregation((), (("s", A.Call("sum", (_c("x"),)), pa.int64()),))
        if not src.supports_aggregate(agg):
            return  # the fabric sums the rows itself
        req = ScanRequest(columns=("x",), filters=(), params={}, aggregate=agg)
        try:
            got = pa.Table.from_batches(list(src.scan(req))).to_pylist()
        except SourceError as e:  # refused by the server: an error, not a number
            assert "out of range" in str(e)
            assert "running and reachable" not in str(e)  # the server is up: say so
            return
        assert got == [{"s": 2 * big}]
    finally:
        conn.close()
