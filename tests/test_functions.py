"""Every registered function, in every local engine, against DuckDB SQL as the reference.

``CASES`` holds, per function of ``fabric.functions.REGISTRY``, calls of it over a table
with NULLs, unicode, trailing spaces, decimals and time-zoned timestamps, each with the
DuckDB SQL that is the reference. A function without cases fails
``test_every_registered_function_has_cases``: a function that cannot run cannot be
registered. The pushdown engines (MariaDB, PostgreSQL, Mongo, S3, files, Kafka) run the
same cases in tests/test_differential.py.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from connectors.arrow_expr import to_arrow
from dsl import ast as A
from dsl.errors import DslError
from dsl.parser import parse_expr
from fabric import functions
from fabric.execute.sql import SqlBuilder
from fabric.plan.types import Env, infer

D = decimal.Decimal
UTC = dt.UTC
NOW = dt.datetime(2024, 6, 1, 12, 0, tzinfo=UTC)

TABLE = pa.table(
    {
        "id": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
        "s": pa.array(["Köln ", "  abc", "ÉCOLE straße", None, "", "x y"], pa.string()),
        "d": pa.array(
            [D("1.25"), D("-2.50"), D("0.05"), None, D("1234567.89"), D("-0.01")],
            pa.decimal128(15, 2),
        ),
        "f": pa.array([2.5, -2.5, 1.005, None, 0.125, -7.75], pa.float64()),
        "i": pa.array([7, -3, 0, None, 24, 100], pa.int64()),
        "ts": pa.array(
            [
                dt.datetime(2024, 1, 7, 23, 59, 59, 500000, tzinfo=UTC),
                dt.datetime(1999, 12, 31, 0, 0, 1, tzinfo=UTC),
                dt.datetime(2024, 2, 29, 12, 30, tzinfo=UTC),
                None,
                dt.datetime(2023, 10, 1, 0, 0, tzinfo=UTC),
                dt.datetime(2020, 6, 15, 6, 7, 8, tzinfo=UTC),
            ],
            pa.timestamp("us", tz="UTC"),
        ),
        "day": pa.array(
            [dt.date(2024, 1, 7), dt.date(1999, 12, 31), None, dt.date(2024, 2, 29)] * 1
            + [dt.date(2023, 10, 1), dt.date(2020, 6, 15)],
            pa.date32(),
        ),
        "lat": pa.array([48.85, -33.9, None, 0.0, 89.9, 10.0], pa.float64()),
        "lon": pa.array([2.35, 151.2, 1.0, 0.0, -179.9, None], pa.float64()),
        "v": pa.array(
            [[1.0, 0.0], [0.0, 1.0], [3.0, 4.0], None, [1.0, 1.0], [-1.0, 2.0]],
            pa.list_(pa.float64()),
        ),
        "tags": pa.array(
            [["a", "b"], [], ["fed", None], None, ["b"], ["x y"]], pa.list_(pa.string())
        ),
        "body": pa.array(
            ["Fed raises rates", "fed", None, "rates fed", "Federal", "the FED, rates!"]
        ),
    }
)

#: function -> [(binding expression, DuckDB reference SQL)]
CASES: dict[str, list[tuple[str, str]]] = {
    "now": [("now()", "TIMESTAMPTZ '2024-06-01 12:00:00+00'")],
    "lower": [("lower(s)", "lower(s)")],
    "upper": [("upper(s)", "upper(s)")],
    "trim": [("trim(s)", "trim(s)")],
    "length": [("length(s)", "length(s)")],
    "abs": [("abs(d)", "abs(d)"), ("abs(f)", "abs(f)"), ("abs(i)", "abs(i)")],
    "round": [
        ("round(d)", "round(d)"),
        ("round(d, 1)", "round(d, 1)"),
        ("round(f, 2)", "round(f, 2)"),
        ("round(f)", "round(f)"),
        ("round(i)", "round(i)"),
    ],
    "floor": [("floor(d)", "floor(d)"), ("floor(f)", "floor(f)")],
    "ceil": [("ceil(d)", "ceil(d)"), ("ceil(f)", "ceil(f)")],
    "coalesce": [
        ("coalesce(s, 'none')", "coalesce(s, 'none')"),
        ("coalesce(i, 0)", "coalesce(i, 0)"),
    ],
    "geo_hash": [("geo_hash(lat, lon, 5)", None), ("geo_hash(lat, lon)", None)],
    "match": [
        (
            "match(body, 'fed rates')",
            "regexp_matches(body, '(?i)(^|\\W)fed($|\\W)') AND regexp_matches(body, '(?i)(^|\\W)rates($|\\W)')",
        )
    ],
    "date_trunc": [
        (f"date_trunc('{u}', ts)", f"date_trunc('{u}', ts)")
        for u in ("second", "minute", "hour", "day", "week", "month", "quarter", "year")
    ]
    + [("date_trunc('month', day)", "CAST(date_trunc('month', day) AS DATE)")],
    "date_part": [(f"date_part('{u}', ts)", f"date_part('{u}', ts)") for u in functions.PART_UNITS]
    + [("date_part('dow', day)", "date_part('dow', day)")],
    "extract": [
        ("extract('year', ts)", "extract(year FROM ts)"),
        ("extract('month', day)", "extract(month FROM day)"),
    ],
    "substring": [
        ("substring(s, 1, 3)", "substring(s, 1, 3)"),
        ("substring(s, 2)", "substring(s, 2)"),
        ("substring(s, 4, 0)", "substring(s, 4, 0)"),
        ("substring(s, 20, 2)", "substring(s, 20, 2)"),
    ],
    "contains": [("contains(tags, 'b')", "list_contains(tags, 'b')")],
    "cosine": [("cosine(v, [1.0, 0.0])", "list_cosine_distance(v, [1.0, 0.0])")],
    "l2": [("l2(v, [0.0, 0.0])", "list_distance(v, [0.0, 0.0])")],
    "dot": [("dot(v, [2.0, 3.0])", "list_inner_product(v, [2.0, 3.0])")],
    "case": [
        (
            "case when i > 0 then 'pos' when i < 0 then 'neg' else 'zero' end",
            "CASE WHEN i > 0 THEN 'pos' WHEN i < 0 THEN 'neg' ELSE 'zero' END",
        ),
        ("case when f > 0 then d end", "CASE WHEN f > 0 THEN d END"),
        (
            "case i when 7 then f when 24 then 1 else 0 end",
            "CASE i WHEN 7 THEN f WHEN 24 THEN 1 ELSE 0 END",
        ),
        (
            "case when s like '%a%' then i * 2 else i end",
            "CASE WHEN s LIKE '%a%' THEN i * 2 ELSE i END",
        ),
    ],
    "cast": [
        ("cast(f as int)", "CAST(f AS BIGINT)"),
        ("cast(i as float)", "CAST(i AS DOUBLE)"),
        ("cast(d as str)", "CAST(d AS VARCHAR)"),
        ("cast(f as decimal(10,1))", "CAST(f AS DECIMAL(10, 1))"),
        ("cast(ts as date)", "CAST(ts AS DATE)"),
        ("cast(day as timestamp)", "CAST(day AS TIMESTAMPTZ)"),
        ("cast(i as bool)", "CAST(i AS BOOLEAN)"),
    ],
    # aggregates run in DuckDB only (their engine test is the aggregate query)
    "count": [("count(*)", "count(*)"), ("count(s)", "count(s)")],
    "count_distinct": [("count_distinct(i)", "count(DISTINCT i)")],
    "sum": [("sum(d)", "sum(d)"), ("sum(i)", "sum(i)"), ("sum(f)", "sum(f)")],
    "avg": [("avg(d)", "avg(d)"), ("avg(i)", "avg(i)")],
    "min": [("min(s)", "min(s)"), ("min(ts)", "min(ts)")],
    "max": [("max(d)", "max(d)"), ("max(day)", "max(day)")],
}

SCALAR_CASES = [
    (name, text, ref)
    for name, cases in CASES.items()
    if not functions.REGISTRY[name].aggregate
    for text, ref in cases
]
AGG_CASES = [
    (name, text, ref)
    for name, cases in CASES.items()
    if functions.REGISTRY[name].aggregate
    for text, ref in cases
]
ENV = Env({f.name: f.type for f in TABLE.schema}, {})


def _ref() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("t", TABLE)
    return con


REF = _ref()


def _expr(text: str) -> A.Expr:
    return parse_expr(text)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dt.datetime) and isinstance(b, dt.date) and not isinstance(b, dt.datetime):
        return a.date() == b and a.time() == dt.time()
    return a == b and type(a) is type(b) if isinstance(a, decimal.Decimal) else a == b


def _reference(text: str, ref: str | None) -> list[Any]:
    if ref is None:  # no DuckDB builtin: the fabric's own implementation is the reference
        e = _expr(text)
        args = [TABLE.column(a.name) if isinstance(a, A.Column) else a.value for a in e.args]
        return functions.geo_hash(args[0], args[1], args[2] if len(args) > 2 else 6).to_pylist()
    return [r[0] for r in REF.execute(f"SELECT {ref} FROM t ORDER BY id").fetchall()]


def _duckdb(e: A.Expr) -> list[Any]:
    b = SqlBuilder({}, NOW)
    rel = b.table(TABLE)
    sql = b.expr(e, rel)
    return b.run(f"SELECT {sql} AS v FROM ({rel.sql}) AS q ORDER BY id").column("v").to_pylist()


def test_every_registered_function_has_cases() -> None:
    missing = sorted(set(functions.REGISTRY) - set(CASES))
    assert not missing, f"registered functions without engine cases: {missing}"
    assert {n for n, f in functions.REGISTRY.items() if f.aggregate} == set(A.AGGREGATES)


def test_every_function_has_a_form_for_each_local_engine() -> None:
    for f in functions.REGISTRY.values():
        assert f.duckdb is not None or f.name == "now", f"{f.name}() cannot run in DuckDB"


@pytest.mark.parametrize(("name", "text", "ref"), SCALAR_CASES, ids=[c[1] for c in SCALAR_CASES])
def test_scalar_function_in_pyarrow_and_duckdb_equals_reference(
    name: str, text: str, ref: str | None
) -> None:
    e = _expr(text)
    typ = infer(e, ENV)  # the type rule accepts the call
    want = _reference(text, ref)
    f = functions.REGISTRY[name]
    local = functions.evaluate(e, TABLE, {}, resolve=lambda c: c.name, now=NOW)
    got = local.to_pylist() if hasattr(local, "to_pylist") else local
    assert all(_same(a, b) for a, b in zip(got, want, strict=True)), (text, got, want)
    if f.arrow is not None:  # pyarrow computes it itself (no fallback to DuckDB)
        to_arrow(e, {}, now=NOW)
    duck = _duckdb(e)
    assert all(_same(a, b) for a, b in zip(duck, want, strict=True)), (text, duck, want)
    # the value has the declared type (or casts to it without loss)
    arr = pa.array(got) if not isinstance(local, pa.Array | pa.ChunkedArray) else local
    if arr.type != typ and not pa.types.is_null(arr.type):
        assert arr.cast(typ).to_pylist() == arr.to_pylist() or pa.types.is_floating(typ)


@pytest.mark.parametrize(("name", "text", "ref"), AGG_CASES, ids=[c[1] for c in AGG_CASES])
def test_aggregate_in_duckdb_equals_reference_and_keeps_its_type(
    name: str, text: str, ref: str
) -> None:
    e = _expr(text)
    typ = infer(e, ENV)
    want = REF.execute(f"SELECT {ref} FROM t").fetchall()[0][0]
    b = SqlBuilder({}, NOW)
    rel = b.table(TABLE)
    out = b.run(f"SELECT {b.expr(e, rel)} AS v FROM ({rel.sql}) AS q").column("v")
    got = out[0].as_py()
    assert got == want if not isinstance(want, float) else _same(got, want), (text, got, want)
    if pa.types.is_decimal(typ):  # sum(decimal(15, 2)) is decimal(38, 2), as DuckDB's
        assert out.type == typ


def test_decimal_sum_is_decimal_not_float() -> None:
    """Regression (issue 11): sums of DECIMAL came back as float64."""
    assert infer(_expr("sum(d)"), ENV) == pa.decimal128(38, 2)
    assert infer(_expr("sum(d * (1 - d))"), ENV) == pa.decimal128(38, 4)


# ------------------------------------------------------------------ functions that ran nowhere


@pytest.mark.parametrize(
    "text",
    [
        "date_trunc('year', ts)",
        "round(f, 1)",
        "floor(d)",
        "ceil(f)",
        "trim(s)",
        "substring(s, 2, 2)",
        "date_part('year', ts)",
    ],
)
def test_functions_that_validated_but_never_ran_now_run_in_pyarrow(text: str) -> None:
    """Regression (issue 11): 'function date_trunc() cannot be applied with pyarrow'."""
    to_arrow(_expr(text), {}, now=NOW)


def test_round_above_a_join_runs_in_duckdb() -> None:
    """Regression (issue 11): 'function round() is not available in joins and aggregates'."""
    assert _duckdb(_expr("round(d, 1)"))[0] == D("1.3")


def test_function_without_a_pyarrow_form_is_computed_by_duckdb() -> None:
    got = functions.filter_table(TABLE, _expr("contains(tags, 'b')"), {}, resolve=lambda c: c.name)
    assert got.column("id").to_pylist() == [1, 5]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("date_trunc('fortnight', ts)", "must be unit"),
        ("date_part(s, ts)", "must be a constant field"),
        ("substring(s, 0, 2)", "start position of 1 or more"),
        ("round(d, i)", "must be a constant number of digits"),
        ("round(s)", "must be a number"),
        ("substring(s)", "takes 2 to 3 arguments"),
    ],
)
def test_type_rule_errors(text: str, message: str) -> None:
    with pytest.raises(DslError, match=message):
        infer(_expr(text), ENV)


# ------------------------------------------------------------------ decimals and integers


def _filter(text: str, table: pa.Table = TABLE) -> list[int]:
    out = functions.filter_table(table, _expr(text), {}, resolve=lambda c: c.name)
    return out.column("id").to_pylist()


def _ref_ids(where: str, table: pa.Table = TABLE) -> list[int]:
    con = _ref()
    con.register("x", table)
    return [r[0] for r in con.execute(f"SELECT id FROM x WHERE {where} ORDER BY id").fetchall()]


def test_decimal_literal_arithmetic_is_exact() -> None:
    """Regression (issue 11, TPC-H Q6): 0.06 - 0.01 and 0.06 + 0.01 folded in binary floats
    (0.049999..., 0.069999...) dropped every row at the bounds."""
    disc = pa.table(
        {
            "id": pa.array(range(11), pa.int64()),
            "d": pa.array([D(f"0.{k:02d}") for k in range(11)], pa.decimal128(15, 2)),
            "f": pa.array([k / 100 for k in range(11)], pa.float64()),
        }
    )
    for where in (
        "d between 0.06 - 0.01 and 0.06 + 0.01",
        "f between 0.06 - 0.01 and 0.06 + 0.01",
        "d = 0.07",
        "f = 0.07",
        "d * 100 = 7",
        "d > 0.1 - 0.05",
    ):
        assert _filter(where, disc) == _ref_ids(where, disc), where
    assert _filter("d between 0.06 - 0.01 and 0.06 + 0.01", disc) == [5, 6, 7]


def test_decimal_compared_with_integers_and_integer_arithmetic() -> None:
    """Regression (issue 11): 'ArrowInvalid: Precision is not great enough' for
    l_quantity < 24 and for l_extendedprice * (1 - l_discount) on DECIMAL(15, 2)."""
    assert _filter("d < 24") == _ref_ids("d < 24")
    assert _filter("d * (1 - d) > 0") == _ref_ids("d * (1 - d) > 0")
    got = functions.evaluate(_expr("d * (1 - d)"), TABLE, {}, resolve=lambda c: c.name)
    want = [r[0] for r in REF.execute("SELECT d * (1 - d) FROM t ORDER BY id").fetchall()]
    assert got.to_pylist() == want
    assert pa.types.is_decimal(got.type)


def test_division_is_float_division_as_in_sql() -> None:
    """7 / 2 is 3.5 in SQL (DuckDB); pyarrow's integer divide gave 3."""
    got = functions.evaluate(_expr("i / 2"), TABLE, {}, resolve=lambda c: c.name).to_pylist()
    want = [r[0] for r in REF.execute("SELECT i / 2 FROM t ORDER BY id").fetchall()]
    assert got == want
    assert _filter("i / 2 > 3") == _ref_ids("i / 2 > 3")


def test_like_escapes_with_a_backslash_in_duckdb_as_in_pyarrow() -> None:
    """Regression: above a join (DuckDB) 'a\\_b%' matched nothing, because DuckDB's LIKE has
    no escape character unless one is named; pyarrow, PostgreSQL and MariaDB escape with
    a backslash."""
    t = pa.table({"id": [1, 2], "s": ["a_bc", "aXbc"]})
    e = _expr("s like 'a\\_b%'")
    b = SqlBuilder({}, NOW)
    rel = b.table(t)
    duck = b.run(f"SELECT id FROM ({rel.sql}) AS q WHERE {b.expr(e, rel)}").column("id")
    local = functions.filter_table(t, e, {}, resolve=lambda c: c.name).column("id")
    assert duck.to_pylist() == local.to_pylist() == [1]


# ------------------------------------------------------------------ end to end, through the fabric


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """lineitem-like Parquet (DECIMAL(15, 2) as TPC-H's) and a small parts file."""
    import pyarrow.parquet as pq

    import fabric

    root = tmp_path_factory.mktemp("fnlake")
    n = 400
    li = pa.table(
        {
            "l_orderkey": pa.array(range(n), pa.int64()),
            "l_partkey": pa.array([k % 7 for k in range(n)], pa.int64()),
            "l_quantity": pa.array([D(k % 50 + 1) for k in range(n)], pa.decimal128(15, 2)),
            "l_extendedprice": pa.array(
                [D(1000 + 37 * k) / 100 for k in range(n)], pa.decimal128(15, 2)
            ),
            "l_discount": pa.array([D(k % 11) / 100 for k in range(n)], pa.decimal128(15, 2)),
            "l_shipdate": pa.array(
                [dt.date(1993, 1, 1) + dt.timedelta(days=3 * k) for k in range(n)], pa.date32()
            ),
        }
    )
    parts = pa.table(
        {
            "p_partkey": pa.array(range(7), pa.int64()),
            "p_brand": pa.array([f"Brand#{k}3" for k in range(7)], pa.string()),
        }
    )
    (root / "lineitem").mkdir()
    pq.write_table(li, root / "lineitem" / "part-0.parquet")
    pq.write_table(parts, root / "part.parquet")
    con = _ref()
    con.register("lineitem", li)
    con.register("part", parts)
    config = {"connections": {"lake": {"kind": "file", "root": str(root)}}}
    with fabric.open(config, ingest=False, watch=False) as fab:
        yield fab, con


def test_q6_with_folded_decimal_bounds_equals_duckdb(lake: Any) -> None:
    """Regression (issue 11): TPC-H Q6 as the spec writes it gave 7,115,406.70 instead of
    11,803,420.25 (the between bounds were folded in binary floats), and its sum was a
    float."""
    fab, con = lake
    res = fab.query_text(
        "from file://lake/lineitem/ as l "
        "where l.l_shipdate >= date '1994-01-01' and l.l_shipdate < date '1995-01-01' "
        "and l.l_discount between 0.06 - 0.01 and 0.06 + 0.01 and l.l_quantity < 24 "
        "select sum(l.l_extendedprice * l.l_discount) as revenue"
    )
    want = con.execute(
        "SELECT sum(l_extendedprice * l_discount) FROM lineitem "
        "WHERE l_shipdate >= DATE '1994-01-01' AND l_shipdate < DATE '1995-01-01' "
        "AND l_discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01 AND l_quantity < 24"
    ).fetchall()[0][0]
    got = res.table.column("revenue")[0].as_py()
    assert got == want and isinstance(got, D), (got, want)
    assert pa.types.is_decimal(res.table.schema.field("revenue").type)


def test_decimal_derive_with_integers_runs_and_stays_exact(lake: Any) -> None:
    """Regression (issue 11): derive rev = l_extendedprice * (1 - l_discount) raised
    'ArrowInvalid: Precision is not great enough'."""
    fab, con = lake
    res = fab.query_text(
        "from file://lake/lineitem/ as l derive rev = l.l_extendedprice * (1 - l.l_discount) "
        "where l.l_quantity < 24 select l.l_orderkey, rev order by l.l_orderkey"
    )
    want = con.execute(
        "SELECT l_orderkey, l_extendedprice * (1 - l_discount) FROM lineitem "
        "WHERE l_quantity < 24 ORDER BY l_orderkey"
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == want


def test_date_trunc_on_a_source_and_round_above_a_join(lake: Any) -> None:
    """Regression (issue 11): 'function date_trunc() cannot be applied with pyarrow' and,
    above a join, 'function round() is not available in joins and aggregates'."""
    fab, con = lake
    res = fab.query_text(
        "from file://lake/lineitem/ as l derive y = date_trunc('year', l.l_shipdate) "
        "select y order by y limit 1"
    )
    assert res.table.column("y").to_pylist() == [dt.date(1993, 1, 1)]
    res = fab.query_text(
        "from file://lake/lineitem/ as l join file://lake/part.parquet as p "
        "on p.p_partkey = l.l_partkey "
        "select p.p_brand, round(avg(l.l_quantity), 2) as q, "
        "sum(l.l_extendedprice) as total, date_part('year', min(l.l_shipdate)) as y "
        "group by p.p_brand order by p.p_brand"
    )
    want = con.execute(
        "SELECT p_brand, round(avg(l_quantity), 2), sum(l_extendedprice), "
        "date_part('year', min(l_shipdate)) FROM lineitem JOIN part ON p_partkey = l_partkey "
        "GROUP BY p_brand ORDER BY p_brand"
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == want
    assert res.table.schema.field("total").type == pa.decimal128(38, 2)


def test_decimal_and_float_compare_in_floats_as_sql() -> None:
    """Regression: pyarrow casts the float to the decimal's type when they meet, so a
    float column never equalled the decimal literal -4.77 (and a DECIMAL column never
    equalled a float session value -4.77); SQL compares them in floats."""
    t = pa.table(
        {
            "id": pa.array([1, 2, 3, 4], pa.int64()),
            "f": pa.array([-4.77, 0.07, 1.005, None], pa.float64()),
            "d": pa.array([D("-4.77"), D("0.07"), D("1.01"), None], pa.decimal128(15, 2)),
        }
    )
    for where, params in (
        ("f = -4.77", {}),
        ("f != -4.77", {}),
        ("f in (-4.77, 1.005)", {}),
        ("f between -4.77 and 0.07", {}),
        ("d = {{session.x}}", {"x": -4.77}),
        ("d < {{session.x}}", {"x": 1.01}),
        ("d = f", {}),
        ("d * 2 = f * 2", {}),
    ):
        e = _expr(where)
        got = functions.filter_table(t, e, params, resolve=lambda c: c.name).column("id")
        sql = where.replace("{{session.x}}", repr(params.get("x")))
        assert got.to_pylist() == _ref_ids(sql, t), where
        if "= f" not in where:  # without the schema, a constant still meets a column in floats
            plain = t.filter(to_arrow(e, params)).column("id").to_pylist()
            assert plain == _ref_ids(sql, t), ("no schema", where)
