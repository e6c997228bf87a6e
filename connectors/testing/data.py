"""The logical data every connector is tested with, and the cases with independent oracles.

200 merchants with ints, strings (mixed case, a trailing space, non-ASCII), floats,
timestamps and nulls. Each case is a filter (dsl.ast), its session values, and a plain
Python predicate over the row dict that says which rows must come back: the oracle
never goes through pyarrow or any connector code.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dsl.ast import (
    Between,
    Binary,
    Call,
    Column,
    Expr,
    InList,
    IsNull,
    Like,
    Literal,
    Param,
    Unary,
)

N = 200
BASE = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
STATUSES = ["active", "inactive", "pending", "ACTIVE", "active ", None]
CITIES = ["Paris", "Berlin", "Köln", "São Paulo", "lyon"]

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("name", pa.string()),
        ("status", pa.string()),
        ("rating", pa.float64()),
        ("score", pa.int64()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("city", pa.string()),
    ]
)
DECLARED = {
    "id": "int",
    "name": "str",
    "status": "str",
    "rating": "float",
    "score": "int",
    "created_at": "timestamp",
    "city": "str",
}


def rows() -> list[dict[str, Any]]:
    out = []
    for i in range(1, N + 1):
        out.append(
            {
                "id": i,
                "name": (f"merchant {i:03d}" if i % 10 == 0 else f"Merchant {i:03d}"),
                "status": STATUSES[i % 6],
                "rating": None if i % 7 == 0 else round((i * 37 % 50) / 10, 1),
                "score": None if i % 11 == 0 else (i * 13) % 100,
                "created_at": BASE + dt.timedelta(hours=5 * i, seconds=i),
                "city": CITIES[i % 5],
            }
        )
    return out


def table() -> pa.Table:
    return pa.Table.from_pylist(rows(), schema=SCHEMA)


def col(name: str) -> Column:
    return Column(name)


def lit(v: Any) -> Literal:
    t = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}.get(
        type(v), "timestamp"
    )
    return Literal(v, t)


def _nn(*vals: Any) -> bool:
    return all(v is not None for v in vals)


@dataclass(frozen=True)
class Case:
    name: str
    expr: Expr
    oracle: Callable[[dict[str, Any]], bool]
    params: dict[str, Any] = field(default_factory=dict)


T0 = BASE + dt.timedelta(days=20)

CASES = [
    Case(
        "eq_literal", Binary("=", col("status"), lit("active")), lambda r: r["status"] == "active"
    ),
    Case(
        "eq_param",
        Binary("=", col("status"), Param("s")),
        lambda r: r["status"] == "active",
        {"s": "active"},
    ),
    Case(
        "eq_param_left",
        Binary("=", Param("s"), col("city")),
        lambda r: r["city"] == "Köln",
        {"s": "Köln"},
    ),
    Case(
        "ne",
        Binary("!=", col("status"), lit("active")),
        lambda r: _nn(r["status"]) and r["status"] != "active",
    ),
    Case(
        "lt_int", Binary("<", col("score"), lit(30)), lambda r: _nn(r["score"]) and r["score"] < 30
    ),
    Case(
        "ge_float",
        Binary(">=", col("rating"), Param("r")),
        lambda r: _nn(r["rating"]) and r["rating"] >= 2.5,
        {"r": 2.5},
    ),
    Case(
        "between",
        Between(col("score"), lit(10), lit(20)),
        lambda r: _nn(r["score"]) and 10 <= r["score"] <= 20,
    ),
    Case(
        "not_between",
        Between(col("score"), lit(10), lit(90), negated=True),
        lambda r: _nn(r["score"]) and not 10 <= r["score"] <= 90,
    ),
    Case(
        "in_literal",
        InList(col("city"), (lit("Paris"), lit("Köln"))),
        lambda r: r["city"] in ("Paris", "Köln"),
    ),
    Case(
        "in_param",
        InList(col("id"), Param("ids")),
        lambda r: r["id"] in (3, 5, 7),
        {"ids": [3, 5, 7, 500]},
    ),
    Case("in_param_empty", InList(col("id"), Param("ids")), lambda r: False, {"ids": []}),
    Case(
        "not_in",
        InList(col("status"), (lit("active"), lit("pending")), negated=True),
        lambda r: _nn(r["status"]) and r["status"] not in ("active", "pending"),
    ),
    Case(
        "like",
        Like(col("name"), lit("Merchant 01%")),
        lambda r: r["name"].startswith("Merchant 01"),
    ),
    Case(
        "not_like",
        Like(col("name"), lit("Merchant%"), negated=True),
        lambda r: not r["name"].startswith("Merchant"),
    ),
    Case(
        "ilike",
        Like(col("name"), lit("merchant 01%"), case_insensitive=True),
        lambda r: r["name"].lower().startswith("merchant 01"),
    ),
    Case(
        "like_param_underscore",
        Like(col("status"), Param("p")),
        lambda r: _nn(r["status"]) and len(r["status"]) == 6 and r["status"].startswith("activ"),
        {"p": "activ_"},
    ),
    Case("is_null", IsNull(col("rating")), lambda r: r["rating"] is None),
    Case("is_not_null", IsNull(col("status"), negated=True), lambda r: r["status"] is not None),
    Case(
        "and_or",
        Binary(
            "and",
            Binary(
                "or",
                Binary("=", col("status"), lit("active")),
                Binary("=", col("status"), lit("pending")),
            ),
            Binary(">", col("score"), lit(50)),
        ),
        lambda r: r["status"] in ("active", "pending") and _nn(r["score"]) and r["score"] > 50,
    ),
    Case(
        "not",
        Unary("not", Binary(">", col("score"), lit(50))),
        lambda r: _nn(r["score"]) and r["score"] <= 50,
    ),
    Case(
        "not_or",
        Unary(
            "not",
            Binary(
                "or", Binary("=", col("city"), lit("Paris")), Binary("<", col("score"), lit(50))
            ),
        ),
        lambda r: r["city"] != "Paris" and _nn(r["score"]) and r["score"] >= 50,
    ),
    Case(
        "timestamp_param",
        Binary(">", col("created_at"), Param("t")),
        lambda r: r["created_at"] > T0,
        {"t": T0},
    ),
    Case("timestamp_now", Binary("<", col("created_at"), Call("now")), lambda r: True),
    Case("eq_null_param", Binary("=", col("score"), Param("x")), lambda r: False, {"x": None}),
    Case("unicode", Binary("=", col("city"), lit("São Paulo")), lambda r: r["city"] == "São Paulo"),
    Case(
        "case_sensitive",
        Binary("=", col("status"), lit("ACTIVE")),
        lambda r: r["status"] == "ACTIVE",
    ),
    Case(
        "string_range",
        Binary(">", col("name"), lit("Merchant 150")),
        lambda r: r["name"] > "Merchant 150",
    ),
    Case(
        "arithmetic",
        Binary(">", Binary("+", col("score"), lit(10)), lit(100)),
        lambda r: _nn(r["score"]) and r["score"] + 10 > 100,
    ),
    Case(
        "lower",
        Binary("=", Call("lower", (col("city"),)), lit("paris")),
        lambda r: r["city"].lower() == "paris",
    ),
    Case(
        "keyword_match",
        Call("match", (col("name"), lit("MERCHANT"))),
        lambda r: r["name"].split()[0].lower() == "merchant",
    ),
]
CASE_IDS = [c.name for c in CASES]

#: session values that must be bound as plain values (name = {{session.v}} -> no rows)
HOSTILE = [
    "1 OR 1=1",
    "'; DROP TABLE x; --",
    {"$ne": None},
    {"$where": "sleep(1000)"},
    "x' OR '1'='1",
]
