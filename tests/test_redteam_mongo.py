"""Red team, MongoDB: a field of the wrong type, several numeric types in one field,
arrays in a scalar column, NaN, and case-insensitive matching of letters whose case
mapping differs between Python's ``re`` (SecantusDB) and RE2 (pyarrow). Every filter is
evaluated pushed (``connectors.testing.conformance.fabric_scan``, as the planner and
executor do), by the fabric on the rows as read, and by DuckDB on the same rows: all
three must agree.

Found here: a document with one cell of the wrong type shifted the cells after it into
the wrong columns (``json_decode.rows_to_batch`` appended an extra null for every field
after the bad one, and the row was cut to the schema's width), so a value of ``c`` came
back as ``d``; and pushed filters matched what the server holds where the fabric had
read a null (``x > 4`` returned the document whose ``x`` of 5.5 is read as null in an
int column; ``x is null`` missed it)."""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa
import pytest

from connectors.mongo import MongoConnection
from connectors.testing.conformance import fabric_scan
from dsl.parser import parse_expr
from fabric import functions

pytestmark = pytest.mark.mongo


def _docs() -> list[dict[str, Any]]:
    from bson.decimal128 import Decimal128
    from bson.int64 import Int64

    nan = float("nan")
    return [
        {"id": 0, "x": 5, "f": 1.5, "s": "a", "t": "t0"},
        {"id": 1, "x": Int64(7), "f": nan, "s": "A", "t": "t1"},
        {"id": 2, "x": 5.0, "f": 2, "s": "ß", "t": "t2"},
        {"id": 3, "x": 5.5, "f": Decimal128("3.5"), "s": "ı", "t": "t3"},
        {"id": 4, "x": "5", "f": "2", "s": "İ", "t": "t4"},
        {"id": 5, "x": Decimal128("6"), "f": None, "s": "ſ", "t": "t5"},
        {"id": 6, "x": None, "s": "K", "t": "t6"},
        {"id": 7, "f": True, "s": 5, "t": "t7"},
        {"id": 8, "x": [5, 6], "f": [1.0], "s": ["a"], "t": "t8"},
        {"id": 9, "x": True, "f": -0.0, "s": "a.b", "t": "t9"},
        {"id": 10, "x": 2**62, "f": float("inf"), "s": "i", "t": "t10"},
        {"id": 11, "x": -3, "f": 0.0, "s": "Straße", "t": None},
        {"id": 12, "x": 0, "f": -2.5, "s": "e\u0301", "t": "t12"},
        {"id": 13, "x": {"a": 1}, "f": {"b": 2}, "s": {"c": 3}, "t": "t13"},
        {"id": 14, "s": "x(y)*", "t": "t14"},
        {"id": 15, "x": 4, "f": 4.0, "s": "\\d", "t": "t15"},
    ]


SCHEMA = {"id": "int", "x": "int", "f": "float", "s": "str", "t": "str"}


@pytest.fixture(scope="module")
def src(mongo_db: Any, mongo_url: str) -> Any:
    coll = mongo_db["rt_mixed"]
    coll.delete_many({})
    coll.insert_many(_docs())
    conn = MongoConnection(
        "crm", {"url": mongo_url, "database": mongo_db.name, "schemas": {"rt_mixed": SCHEMA}}
    )
    yield conn.source("rt_mixed")
    conn.close()


def test_a_bad_cell_leaves_the_other_cells_of_its_document_in_their_columns(src: Any) -> None:
    full, _, _ = fabric_scan(src, [])
    rows = {r["id"]: r for r in full.to_pylist()}
    for d in _docs():
        got = rows[d["id"]]
        assert got["t"] == d["t"], (d, got)  # the last column, after every bad cell
        if isinstance(d.get("s"), str):
            assert got["s"] == d["s"], (d, got)
    assert rows[3]["f"] == 3.5 and rows[3]["x"] is None  # 5.5 is no int: null, counted


FILTERS = [
    "x > 4",
    "x = 5",
    "x != 5",
    "x is null",
    "x is not null",
    "not (x is not null)",
    "x is null or x > 6",
    "x in (5, 6)",
    "x not in (5, 6)",
    "x < 100",
    "x between 0 and 6",
    "not (x between 0 and 6)",
    "f > 1",
    "f < 1",
    "f != 1.5",
    "f = 0",
    "f is null",
    "not (f > 1)",
    "f in (0, 1.5)",
    "f in (0.0, 1.5)",
    "f >= -2.5 and f <= 2",
    "f >= 1.5",
    "not (f < 2)",
    "f between 1 and 4",
    "s is null",
    "s != 'a'",
    "s > 'Z'",
    "s like 'a_b'",
    "s like 'a.b'",
    "s like 'x(y)*'",
    "s like '\\d'",
    "s like '%)%'",
    "s ilike 'i'",
    "s ilike 'I'",
    "s ilike 's'",
    "s ilike 'k'",
    "s ilike 'SS'",
    "s ilike 'ẞ'",
    "s ilike 'STRASSE'",
    "s ilike 'straẞe'",
    "s ilike 'e_'",
    "s like 'e_'",
    "t is null",
    "t != 't1'",
]


def _duckdb(full: pa.Table, where: str) -> list[int]:
    con = duckdb.connect()
    con.register("t", full)
    sql = f"SELECT id FROM t WHERE {where}"
    if "like" in where:  # the fabric's LIKE escapes with a backslash (pyarrow's, SQL's)
        sql += " ESCAPE '\\'"
    return sorted(r[0] for r in con.sql(sql).fetchall())


@pytest.mark.parametrize("where", FILTERS)
def test_a_pushed_filter_keeps_the_rows_the_fabric_keeps(src: Any, where: str) -> None:
    e = parse_expr(where)
    full, _, _ = fabric_scan(src, [])
    got, _, _ = fabric_scan(src, [e])
    local = functions.filter_table(full, e, {}, resolve=lambda c: c.name)
    assert sorted(got["id"].to_pylist()) == sorted(local["id"].to_pylist())
    # a returned row shows the values the filter was applied to
    by_id = {r["id"]: repr(r) for r in full.to_pylist()}
    assert all(by_id[r["id"]] == repr(r) for r in got.to_pylist())
    # the fabric's two engines (pyarrow here, DuckDB above joins) agree: NaN above every
    # number, ilike as lower(s) like lower(p) (these were strict xfails)
    assert sorted(local["id"].to_pylist()) == _duckdb(full, where), "fabric vs DuckDB"


@pytest.mark.parametrize("value", [float("nan"), 1.5, float("-inf")], ids=repr)
@pytest.mark.parametrize("op", ["=", "!=", "<", "<=", ">", ">="])
def test_a_float_session_value_pushed_keeps_duckdbs_rows(src: Any, op: str, value: float) -> None:
    """The server orders NaN below every number, the fabric (DuckDB) above: a pushed
    f > v sends NaN too; f op NaN is the fabric's to apply."""
    e = parse_expr(f"f {op} {{{{session.v}}}}")
    full, _, _ = fabric_scan(src, [])
    got, _, _ = fabric_scan(src, [e], {"v": value})
    con = duckdb.connect()
    con.register("t", full)
    want = con.execute(f"SELECT id FROM t WHERE f {op} $v::DOUBLE", {"v": value}).fetchall()
    assert sorted(got["id"].to_pylist()) == sorted(r[0] for r in want)


@pytest.mark.parametrize(
    "key", ["f", "x", "s"], ids=["float with NaN", "int with bad cells", "str with bad cells"]
)
@pytest.mark.parametrize("desc", [False, True], ids=["asc", "desc"])
@pytest.mark.parametrize("nulls_first", [None, True, False], ids=["default", "first", "last"])
def test_an_order_and_limit_pushed_gives_duckdbs_first_rows(
    src: Any, key: str, desc: bool, nulls_first: bool | None
) -> None:
    """order_by + limit pushed to the server (no filter): the first rows by the values the
    fabric reads, in DuckDB's order (NaN above every number; a value read as null is
    null, wherever the server sorts its type)."""
    from dsl.ast import Column, SortKey

    k = SortKey(Column(key), desc, nulls_first)
    full, _, _ = fabric_scan(src, [])
    got, _, _ = fabric_scan(src, [], order_by=(k,), limit=4)
    con = duckdb.connect()
    con.register("t", full)
    nulls = "" if nulls_first is None else " NULLS FIRST" if nulls_first else " NULLS LAST"
    sql = f"SELECT {key} FROM t ORDER BY {key} {'DESC' if desc else 'ASC'}{nulls} LIMIT 4"
    want = [r[0] for r in con.sql(sql).fetchall()]

    def tie(v: Any) -> Any:  # -0.0 and 0.0 are one value: either order is right
        return v + 0.0 if isinstance(v, float) else v

    assert repr([tie(v) for v in got[key].to_pylist()]) == repr([tie(v) for v in want])
