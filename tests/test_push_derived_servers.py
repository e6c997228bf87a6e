"""A derived column's filter pushed as its expression (fabric/optimizer/push_filters.py
``_inlined``) into MariaDB, PostgreSQL and S3 Parquet gives DuckDB's rows over the same
scanned data, as the fabric's own evaluation does: modulo and arithmetic of negative
integers and DECIMALs, substring of multibyte UTF-8 (CJK, a combining accent), CHAR(n)
padding in substring / || / length, NULLs through || and coalesce, round / floor / ceil
of negative decimals, case."""

from __future__ import annotations

import decimal
from collections.abc import Iterator
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.sql import SqlConnection
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build
from tests.connectors.conformance import fabric_scan

D = decimal.Decimal
S = [
    "Köln",
    "köln",
    "abc",
    "abc ",
    " abc",
    "São Paulo",
    "straße",
    "",
    "a_b%c",
    "Ab",
    None,
    "日本語テキスト",
    "e\u0301x",
]
C = ["ab", "ab ", "x", "ß", "", None, "Brand#"]
INTS = [-7, -1, 0, 1, 7, 13, -13, None, 2**40, -(2**40)]
DD = [D("-7.25"), D("-0.01"), D("0"), D("3.00"), D("7.5"), None, D("-3.00")]
ROWS = [
    {
        "id": k,
        "i": INTS[k % len(INTS)],
        "s": S[k % len(S)],
        "c": C[k % len(C)],
        "d": DD[k % len(DD)],
    }
    for k in range(120)
]
TABLE = pa.Table.from_pylist(
    ROWS,
    schema=pa.schema(
        [
            ("id", pa.int64()),
            ("i", pa.int64()),
            ("s", pa.string()),
            ("c", pa.string()),
            ("d", pa.decimal128(15, 2)),
        ]
    ),
)


def _sql(url: str, kind: str) -> Iterator[Any]:
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS pd_t")
        tail = " CHARACTER SET utf8mb4" if kind == "mysql" else ""
        c.exec_driver_sql(
            f"CREATE TABLE pd_t (id BIGINT PRIMARY KEY, i BIGINT, s VARCHAR(40), c CHAR(6), d DECIMAL(15, 2)){tail}"
        )
        c.execute(sa.text("INSERT INTO pd_t VALUES (:id, :i, :s, :c, :d)"), ROWS)
    conn = SqlConnection("db", {"kind": kind, "url": url})
    yield conn.source("pd_t")
    conn.close()
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS pd_t")
    engine.dispose()


@pytest.fixture(scope="module", params=["mysql", "postgres", "s3"])
def src(request):
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        with s3.fs.open_output_stream(s3.path("pd/t/part-0.parquet")) as f:
            pq.write_table(TABLE, f)
        yield s3.connection("lake").source("pd/t/*.parquet")
        return
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "mariadb_url")
    yield from _sql(url, request.param)


CASES = [
    ("i % 7", "p = -1"),
    ("i % 7", "p < 0"),
    ("d % 3", "p < -1"),
    ("-i", "p > 5"),
    ("i * 2 + 1", "p = -13"),
    ("i - 3", "p < 0"),
    ("d * 2", "p = -14.5"),
    ("d + i", "p > 0"),
    ("substring(s, 2, 2)", "p = 'öl'"),
    ("substring(s, 2, 2)", "p = 'ã'"),
    ("substring(s, 3)", "p = 'c '"),
    ("substring(s, 2, 1)", "p = '本'"),
    ("substring(s, 2, 1)", "p = '\u0301'"),
    ("substring(c, 1, 2)", "p = 'ab'"),
    ("substring(c, 2)", "p = 'b'"),
    ("c || '!'", "p = 'ab!'"),
    ("s || c", "p = 'abcab'"),
    ("s || c", "p is null"),
    ("c || s", "p like 'ab%'"),
    ("length(c)", "p = 2"),
    ("length(s)", "p = 4"),
    ("length(s)", "p = 3"),
    ("coalesce(s, c) || 'x'", "p = 'abx'"),
    ("trim(s)", "p = 'abc'"),
    ("lower(s) || c", "p = 'kölnab'"),
    ("abs(i)", "p = 7"),
    ("round(d)", "p = -7"),
    ("round(d, 1)", "p = 7.5"),
    ("floor(d)", "p = -8"),
    ("ceil(d)", "p = -7"),
    ("case when i > 0 then s else c end", "p = 'ab'"),
]


@pytest.mark.parametrize("derive,where", CASES, ids=[f"{d}: {w}" for d, w in CASES])
def test_a_pushed_derived_filter_gives_duckdbs_rows(src: Any, derive: str, where: str) -> None:
    binding = f"""
binding: derived_pushed
sources:
  m:
    from: memory://t/pd
    derive:
      p: {derive}
    where: {where}
select: [m.id]
"""
    cat = world.catalog(world.make_tables(), pd=src)
    spec = load_text(binding, "derived.yaml")[0]
    got = {}
    for pushed in (True, False):
        plan = build(spec, cat)
        if pushed:
            plan = opt.optimize(plan, cat)
        got[pushed] = sorted(
            execute(plan, {}, cat, binding=spec.name, now=world.NOW).table["id"].to_pylist()
        )
    con = duckdb.connect()
    full, _, _ = fabric_scan(src, [], columns=TABLE.column_names)  # CHAR(n) read unpadded
    con.register("t", full)
    want = sorted(
        r[0]
        for r in con.sql(
            f"SELECT id FROM (SELECT id, {derive} AS p FROM t) WHERE {where}"
        ).fetchall()
    )
    assert got[False] == want, "fabric"
    assert got[True] == want, "pushed"
