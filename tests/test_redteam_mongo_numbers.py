"""Red team, MongoDB: numbers the fabric reads as doubles but the server holds exactly.

A ``float`` column reads a long 2^53 + 1, or a Decimal128 9007199254740993 or
3.5000000000000001, as the nearest double (2^53, 3.5), and compares it with the
constant as a double, as DuckDB does. The server compares what it holds exactly.

Found here (quiet wrong answers on the old code): pushed to the server, ``f = 2^53``
dropped the long 2^53 + 1 and the Decimal128 9007199254740993 (the fabric: [0, 1, 4],
pushed: [0]); ``f = 3.5`` dropped the Decimal128 3.5000000000000001; ``f in (2^53 + 1,
3.5)`` kept 3 of 5 rows. And the fabric's own filter ``f = 9007199254740993`` (an
integer past 2^53 next to a float column) raised pyarrow's 'Integer value
9007199254740993 not in range' from the connector instead of answering.
"""

from __future__ import annotations

import re
from typing import Any

import duckdb
import pytest

from connectors.mongo import MongoConnection
from connectors.testing.conformance import fabric_scan
from dsl.parser import parse_expr
from fabric import functions

pytestmark = pytest.mark.mongo

B = 2**53


def _docs() -> list[dict[str, Any]]:
    from bson.decimal128 import Decimal128
    from bson.int64 import Int64

    return [
        {"id": 0, "f": float(B), "i": Int64(B)},
        {"id": 1, "f": Int64(B + 1), "i": Int64(B + 1)},
        {"id": 2, "f": Decimal128("3.5000000000000001"), "i": Int64(2**63 - 1)},
        {"id": 3, "f": 3.5, "i": Int64(-(2**63))},
        {"id": 4, "f": Decimal128("9007199254740993"), "i": Decimal128("9007199254740993")},
        {"id": 5, "f": Int64(2**63 - 1), "i": float(B)},
        {"id": 6, "f": Decimal128("1E+400"), "i": 5},
        {"id": 7, "f": Decimal128("NaN"), "i": 6},
        {"id": 8, "f": Decimal128("-0"), "i": 7},
        {"id": 9, "f": -float(B), "i": Int64(-B - 1)},
    ]


@pytest.fixture(scope="module")
def src(mongo_db: Any, mongo_url: str) -> Any:
    coll = mongo_db["rt_numbers"]
    coll.delete_many({})
    coll.insert_many(_docs())
    conn = MongoConnection(
        "crm",
        {
            "url": mongo_url,
            "database": mongo_db.name,
            "schemas": {"rt_numbers": {"id": "int", "f": "float", "i": "int"}},
        },
    )
    yield conn.source("rt_numbers")
    conn.close()


PARAMS = {"b": B, "b1": B + 1, "nb1": -B - 1, "m": 2**63 - 1, "h": 3.5, "l": [B + 1, 3.5]}
FILTERS = [
    "f = {{session.b}}",
    "f = {{session.b1}}",
    "f != {{session.b1}}",
    "f >= {{session.b1}}",
    "f <= {{session.b}}",
    "f > {{session.b}}",
    "f < {{session.b1}}",
    "f = {{session.nb1}}",
    "f <= {{session.nb1}}",
    "f = {{session.h}}",
    "f <= {{session.h}}",
    "f >= {{session.h}}",
    "f in {{session.l}}",
    "f not in {{session.l}}",
    "f = 9007199254740993",
    "f >= 9007199254740993",
    "f between 3.5 and 9007199254740993",
    "f = 3.5",
    "f = {{session.m}}",
    "f > 1e300",
    "i = {{session.b}}",
    "i = {{session.b1}}",
    "i >= {{session.m}}",
    "i != {{session.b}}",
    "i < {{session.nb1}}",
    "i + 0.5 > {{session.b}}",
    "f + 1 = 9007199254740993",
]


@pytest.mark.parametrize("where", FILTERS)
def test_a_big_number_filter_pushed_keeps_the_rows_the_fabric_and_duckdb_keep(
    src: Any, where: str
) -> None:
    e = parse_expr(where)
    full, _, _ = fabric_scan(src, [])
    got, _, _ = fabric_scan(src, [e], PARAMS)
    local = functions.filter_table(full, e, PARAMS, resolve=lambda c: c.name)
    con = duckdb.connect()
    con.register("t", full)
    sql = where
    for k in sorted(PARAMS, key=len, reverse=True):
        sql = sql.replace(f"{{{{session.{k}}}}}", f"${k}")
    used = {k: v for k, v in PARAMS.items() if re.search(rf"\${k}\b", sql)}
    want = sorted(r[0] for r in con.execute(f"SELECT id FROM t WHERE {sql}", used).fetchall())
    assert sorted(local["id"].to_pylist()) == want, "fabric vs DuckDB"
    assert sorted(got["id"].to_pylist()) == want, "pushed vs DuckDB"
