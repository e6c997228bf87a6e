"""Pushed vs local vs DuckDB: every filter kind on every connector, on the same data.

One seeded random table (DECIMAL(15, 2), CHAR(10) and VARCHAR strings with unicode,
mixed case and trailing spaces, NULLs, time-zoned timestamps, ints, floats) is loaded
once per module into MariaDB, PostgreSQL, MongoDB, S3 Parquet, a local CSV file, a
Kafka topic and an indexed dataset (dataset://: B-tree and inverted indexes). Hypothesis
draws filters (comparisons, between, in, like / ilike, is null, and / or / not,
arithmetic, session values, the registered functions) with constants from the data.
Each filter is evaluated four ways and the row ids must agree:

- pushed: the connector's own answer (``supports_filter`` then ``scan``; what it cannot
  take is re-applied by the fabric, as the planner does: tests/connectors/conformance.py);
- local: ``fabric.functions.filter_table`` (pyarrow, DuckDB for what pyarrow lacks) over
  the connector's full scan;
- above a join: the fabric's own DuckDB SQL (``fabric.execute.sql.SqlBuilder``) over it;
- oracle: DuckDB SQL (the filter's canonical text, DuckDB's own function names) over it.

The full scan itself is compared with the generated rows, so the three start from the
data that was written (CHAR(n) values unpadded, as MariaDB's and DuckDB's scanners give).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsl import ast as A
from dsl.parser import parse_expr
from fabric import functions
from fabric.execute.sql import SqlBuilder
from tests.connectors.conformance import fabric_scan
from tests.servers import TopicFactory

D = decimal.Decimal
UTC = dt.UTC
N = 240
STRINGS = ["Köln", "köln", "KÖLN", "abc", "abc ", " abc", "São Paulo", "straße", "", "a_b%c", "Ab"]
CHARS = ["Brand#13", "Brand#1", "BRAND#13", "x", "Brand#45", "ß"]


def _rows() -> list[dict[str, Any]]:
    rnd = random.Random(11)
    base = dt.datetime(2023, 12, 31, 22, 0, tzinfo=UTC)
    out = []
    for i in range(1, N + 1):
        out.append(
            {
                "id": i,
                # half like TPC-H's l_discount (0.00-0.10), half wide
                "d": None
                if i % 9 == 0
                else D(rnd.randint(0, 10) if i % 2 else rnd.randint(-500, 1500)) / 100,
                "f": None if i % 10 == 0 else rnd.choice([0.05, 0.07, -1.5, 2.5, 0.125]) + i % 3,
                "i": None if i % 11 == 0 else rnd.randint(-30, 60),
                "s": None if i % 8 == 0 else rnd.choice(STRINGS),
                "c": None if i % 7 == 0 else rnd.choice(CHARS),
                # millisecond precision: what MongoDB keeps
                "ts": None
                if i % 12 == 0
                else base
                + dt.timedelta(hours=rnd.randint(0, 24 * 400), milliseconds=rnd.randint(0, 999)),
                # a vector, where the source can hold lists (Parquet, Mongo, Kafka JSON)
                "v": None
                if i % 13 == 0
                else [float(rnd.randint(-3, 3)), float(rnd.randint(-3, 3))],
            }
        )
    return out


ROWS = _rows()
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("d", pa.decimal128(15, 2)),
        ("f", pa.float64()),
        ("i", pa.int64()),
        ("s", pa.string()),
        ("c", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("v", pa.list_(pa.float64())),
    ]
)
TABLE = pa.Table.from_pylist(ROWS, schema=SCHEMA)
DECLARED = {
    "id": "int",
    "d": "float",
    "f": "float",
    "i": "int",
    "s": "str",
    "c": "str",
    "ts": "timestamp",
    "v": "list[float]",
}


# ------------------------------------------------------------------ loading, once per module


def _load_sql(url: str, name: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    md = sa.MetaData()
    t = sa.Table(
        name,
        md,
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("d", sa.Numeric(15, 2)),
        sa.Column("f", sa.Float(53)),
        sa.Column("i", sa.BigInteger),
        sa.Column("s", sa.String(40)),
        sa.Column("c", sa.CHAR(10)),
        sa.Column("ts", sa.DateTime(timezone=True)),
    )
    md.drop_all(engine)
    md.create_all(engine)
    rows = [{k: v for k, v in r.items() if k != "v"} for r in ROWS]  # no list type in SQL
    if engine.dialect.name in ("mysql", "mariadb"):
        with engine.begin() as c:
            c.exec_driver_sql(f"ALTER TABLE {name} MODIFY ts DATETIME(6)")
            c.exec_driver_sql(f"ALTER TABLE {name} CONVERT TO CHARACTER SET utf8mb4")
        rows = [{**r, "ts": r["ts"].replace(tzinfo=None) if r["ts"] else None} for r in rows]
    with engine.begin() as c:
        c.execute(t.insert(), rows)
    engine.dispose()


@pytest.fixture(scope="module")
def mariadb_source(mariadb_url: str) -> Iterator[Any]:
    from connectors.sql import SqlConnection

    _load_sql(mariadb_url, "diff_t")
    conn = SqlConnection("db", {"kind": "mysql", "url": mariadb_url})
    yield conn.source("diff_t")
    conn.close()


@pytest.fixture(scope="module")
def postgres_source(pg_url: str) -> Iterator[Any]:
    from connectors.sql import SqlConnection

    _load_sql(pg_url, "diff_t")
    conn = SqlConnection("pg", {"kind": "postgres", "url": pg_url})
    yield conn.source("diff_t")
    conn.close()


@pytest.fixture(scope="module")
def mongo_source(mongo_db: Any, mongo_url: str) -> Iterator[Any]:
    from connectors.mongo import MongoConnection

    docs = []
    for r in ROWS:
        doc = {k: (float(v) if isinstance(v, D) else v) for k, v in r.items()}
        docs.append({k: v for k, v in doc.items() if v is not None or r["id"] % 2})
    mongo_db.diff_t.drop()
    mongo_db.diff_t.insert_many(docs)
    conn = MongoConnection(
        "crm", {"url": mongo_url, "database": mongo_db.name, "schemas": {"diff_t": DECLARED}}
    )
    yield conn.source("diff_t")
    conn.close()


@pytest.fixture(scope="module")
def s3_source(s3: Any) -> Any:

    with s3.fs.open_output_stream(s3.path("diff/t/part-0.parquet")) as f:
        pq.write_table(TABLE, f, row_group_size=60)
    conn = s3.connection("lake")
    return conn.source("diff/t/*.parquet")


@pytest.fixture(scope="module")
def csv_source(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import pyarrow.csv as pcsv

    from connectors.s3 import S3Connection

    root = tmp_path_factory.mktemp("difflake")
    pcsv.write_csv(TABLE.drop_columns(["v"]), root / "t.csv")  # CSV holds no lists
    declared = {k: v for k, v in DECLARED.items() if k != "v"}
    conn = S3Connection(
        "files", {"kind": "file", "root": str(root), "schemas": {"t.csv": declared}}
    )
    return conn.source("t.csv")


@pytest.fixture(scope="module")
def kafka_source(kafka_bootstrap: str, test_run_id: str) -> Iterator[Any]:
    from confluent_kafka import Producer

    from connectors.kafka import KafkaConnection

    topics = TopicFactory(kafka_bootstrap, test_run_id + "d")
    topic = topics(partitions=2, prefix="diff")
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    now = int(time.time() * 1000) - 10 * N
    for k, r in enumerate(ROWS):
        value = {
            key: (
                float(v) if isinstance(v, D) else v.isoformat() if isinstance(v, dt.datetime) else v
            )
            for key, v in r.items()
        }
        p.produce(
            topic,
            key=str(r["id"]).encode(),
            value=json.dumps(value).encode(),
            timestamp=now + 10 * k,
        )
    p.flush(30)
    conn = KafkaConnection("bus", {"bootstrap": kafka_bootstrap, "schemas": {topic: DECLARED}})
    yield conn.source(topic)
    topics.cleanup()


@pytest.fixture(scope="module")
def dataset_source() -> Any:
    """An indexed dataset (B-trees on i, f and ts, an inverted index on s): filters on
    indexed columns go through the indexes, the rest through pyarrow on the candidates."""
    from connectors.dataset import DatasetConnection
    from indexes import Dataset

    ds = Dataset.create(
        "diff", SCHEMA, "id", {"i": "btree", "f": "btree", "ts": "btree", "s": "inverted"}
    )
    ds.upsert(TABLE)
    conn = DatasetConnection()
    return conn.add(ds)


CONNECTORS = ["mariadb", "postgres", "mongo", "s3", "csv", "kafka", "dataset"]


@pytest.fixture(scope="module", params=CONNECTORS)
def loaded(request: pytest.FixtureRequest) -> tuple[str, Any, pa.Table, duckdb.DuckDBPyConnection]:
    """(name, source, its full scan, a DuckDB connection with the scan as table t)."""
    source = request.getfixturevalue(f"{request.param}_source")
    names = [n for n in SCHEMA.names if n in source.schema().names]  # v: where lists exist
    full, _, _ = fabric_scan(source, [], columns=names)
    full = full.sort_by("id")
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("t", full)
    con.create_function(
        "ref_geohash",
        _textbook_geohash,
        ["DOUBLE", "DOUBLE", "BIGINT"],
        "VARCHAR",
        null_handling="special",
    )
    return request.param, source, full, con


def _norm(v: Any) -> Any:
    return float(v) if isinstance(v, D) else v


def test_full_scan_returns_the_rows_written(loaded: Any) -> None:
    name, _, full, _ = loaded
    got = full.to_pylist()
    assert [r["id"] for r in got] == [r["id"] for r in ROWS]
    for want, row in zip(ROWS, got):
        for k, v in want.items():
            if k not in row:
                continue
            if name == "csv" and v == "":  # CSV writes '' and null alike (an empty field)
                v = None
            assert _norm(row[k]) == _norm(v), (
                f"{name}: row {want['id']} column {k}: {row[k]!r} != {v!r}"
            )


# ------------------------------------------------------------------ filters

_VALS: dict[str, list[Any]] = {
    k: sorted({r[k] for r in ROWS if r[k] is not None}) for k in ("d", "f", "i", "s", "c", "ts")
}


def _lit(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, list):
        return "(" + ", ".join(_lit(x) for x in v) + ")"
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, dt.datetime):  # written in another zone: the same instant
        return f"timestamp '{v.astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat()}'"
    if isinstance(v, float):
        return repr(v)
    return str(v)


@st.composite
def atom(draw: Any) -> str:
    kind = draw(
        st.sampled_from(["cmp", "between", "in", "like", "isnull", "arith", "function", "cmp_cols"])
    )
    op = draw(st.sampled_from(["=", "!=", "<", "<=", ">", ">="]))
    if kind == "cmp":
        col = draw(st.sampled_from(["d", "f", "i", "s", "c", "ts"]))
        v = draw(st.sampled_from(_VALS[col]))
        if col in ("d", "f") and draw(st.booleans()):  # a constant folded from decimals
            k = draw(st.sampled_from(["0.01", "0.07", "0.1", "0.3"]))
            return f"{col} {op} {D(str(v)) - D(k)} + {k}"
        return f"{col} {op} {_lit(v)}"
    if kind == "cmp_cols":
        return draw(st.sampled_from([f"s {op} c", f"d {op} f", f"i {op} d"]))
    if kind == "between":
        col = draw(st.sampled_from(["d", "f", "i", "ts", "s"]))
        a, b = sorted(draw(st.lists(st.sampled_from(_VALS[col]), min_size=2, max_size=2)))
        neg = draw(st.sampled_from(["", "not "]))
        if col in ("d", "f") and draw(st.booleans()):  # TPC-H Q6: folded decimal bounds
            k = draw(st.sampled_from(["0.01", "0.07", "0.1", "0.3"]))
            return f"{col} {neg}between {D(str(a)) - D(k)} + {k} and {D(str(b)) + D(k)} - {k}"
        return f"{col} {neg}between {_lit(a)} and {_lit(b)}"
    if kind == "in":
        col = draw(st.sampled_from(["d", "i", "s", "c"]))
        items = [
            _lit(x) for x in draw(st.lists(st.sampled_from(_VALS[col]), min_size=1, max_size=4))
        ]
        if draw(st.integers(0, 5)) == 0:  # a null in the list: 'not in' is never true
            items.append("null")
        neg = draw(st.sampled_from(["in", "not in"]))
        return f"{col} {neg} ({', '.join(items)})"
    if kind == "like":
        col = draw(st.sampled_from(["s", "c"]))
        pat = draw(
            st.sampled_from(["k%", "%ö%", "_b%", "%c", "abc", "% ", "Brand#1%", "%#13", "a\\_b%"])
        )
        kw = draw(st.sampled_from(["like", "not like", "ilike"]))
        return f"{col} {kw} {_lit(pat)}"
    if kind == "param":
        return draw(
            st.sampled_from(
                [
                    "s like '%' || {{session.w}} || '%'",  # TPC-H Q9/Q13: a built pattern
                    "c like {{session.brand}} || '%'",
                    "c not like {{session.brand}} || '3'",
                    f"i {op} {{{{session.n}}}}",
                    f"d {op} {{{{session.n}}}}",
                    f"d {op} {{{{session.x}}}}",
                    f"f {op} {{{{session.x}}}} - 1",
                    f"ts {op} {{{{session.t}}}}",
                    "s = lower({{session.w}}) || 'c'",
                    f"date_trunc('day', ts) {op} date_trunc('day', {{{{session.t}}}})",
                ]
            )
        )
    if kind == "isnull":
        col = draw(st.sampled_from(["d", "f", "i", "s", "c", "ts"]))
        return f"{col} is {draw(st.sampled_from(['', 'not ']))}null"
    if kind == "arith":
        form = draw(
            st.sampled_from(
                [
                    "d * (1 - d) {op} {v}",
                    "d * 2 + 1 {op} {v}",
                    "i / 2 {op} {v}",
                    "i - 3 {op} {v}",
                    "f * 2 {op} {v}",
                    "-d {op} {v}",
                    "d + 0.06 - 0.01 {op} {v}",
                ]
            )
        )
        v = draw(st.sampled_from([0, 1, 24, "0.05", "1.5", "-2.25", "12.5", "0.06 + 0.01"]))
        return form.format(op=op, v=v)
    fn = draw(
        st.sampled_from(
            [
                "lower(s) {op} 'köln'",
                "upper(s) {op} 'ABC'",
                "upper(c) {op} 'BRAND#13'",
                "length(s) {op} 3",
                "length(c) {op} 8",
                "trim(s) {op} 'abc'",
                "substring(s, 1, 2) {op} 'ab'",
                "substring(c, 7) {op} '13'",
                "abs(i) {op} 10",
                "abs(d) {op} 5.5",
                "round(d, 1) {op} 2.5",
                "round(d) {op} 3",
                "floor(d) {op} 2",
                "ceil(d) {op} 2",
                "floor(f) {op} 1",
                "coalesce(i, 0) {op} 0",
                "coalesce(s, 'none') {op} 'none'",
                "date_part('year', ts) {op} 2024",
                "date_part('month', ts) {op} 6",
                "date_part('hour', ts) {op} 12",
                "date_part('dow', ts) {op} 0",
                "extract('day', ts) {op} 15",
                "date_trunc('month', ts) {op} timestamp '2024-03-01T00:00:00+00:00'",
                "date_trunc('day', ts) {op} timestamp '2024-03-01T02:00:00+02:00'",
                "date_trunc('year', ts) {op} timestamp '2024-01-01T00:00:00Z'",
            ]
        )
    )
    return fn.format(op=op)


@st.composite
def condition(draw: Any) -> str:
    parts = draw(st.lists(atom(), min_size=1, max_size=3))
    out = parts[0]
    for p in parts[1:]:
        out = f"{out} {draw(st.sampled_from(['and', 'or']))} {p}"
    if draw(st.integers(0, 4)) == 0:
        out = f"not ({out})"
    return out


#: session values the filters may use (bound as parameters; spliced into the oracle's SQL)
PARAMS: dict[str, Any] = {
    "w": "b",
    "brand": "Brand#1",
    "n": 24,
    "x": 2.5,
    "t": dt.datetime(2024, 3, 1, 9, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5))),
    "li": [7, None, 24],
}


def _like_escape(n: A.Expr) -> A.Expr | None:
    """The fabric's LIKE escapes with a backslash (as PostgreSQL, MariaDB and pyarrow do);
    DuckDB's has no escape character unless named: like_escape(x, pattern, '\\')."""
    if not isinstance(n, A.Like):
        return None
    fn = "ilike_escape" if n.case_insensitive else "like_escape"
    call = A.Call(fn, (n.expr, n.pattern, A.Literal("\\", "str")))
    return A.Unary("not", call) if n.negated else call


#: the fabric's functions written as DuckDB's own (hand-written here, not the registry's)
_DUCK_NAMES = {
    "extract": "date_part",
    "cosine": "list_cosine_distance",
    "l2": "list_distance",
    "dot": "list_inner_product",
    "contains": "list_contains",
    "geo_hash": "ref_geohash",
}
_DUCK_CASTS = {"str": "VARCHAR", "int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN"}


def _duck_call(n: A.Expr) -> A.Expr | None:
    hit = _like_escape(n)
    if hit is not None or not isinstance(n, A.Call):
        return hit
    if n.name == "match":  # every word of the query is a word of the text
        query = n.args[1]
        assert isinstance(query, A.Literal)
        words = [
            A.Literal(r"(?i)(^|\W)" + re.escape(w) + r"($|\W)", "str")
            for w in re.findall(r"\w+", query.value.lower())
        ]
        return A.and_all([A.Call("regexp_matches", (n.args[0], w)) for w in words])
    if n.name in _DUCK_NAMES:
        return A.Call(_DUCK_NAMES[n.name], n.args)
    return None


def _oracle_sql(e: A.Expr) -> str:
    sql = A.to_text(A.replace(e, _duck_call))
    for ours, duck in _DUCK_CASTS.items():
        sql = sql.replace(f" as {ours})", f" AS {duck})")
    return sql


def _textbook_geohash(lat: float | None, lon: float | None, precision: int) -> str | None:
    from tests.fixtures.optimizer.scenario_data import textbook_geohash

    return None if lat is None or lon is None else textbook_geohash(lat, lon, precision)


def _three_ways(loaded: Any, text: str) -> tuple[list[int], list[int], list[int]]:
    _, source, full, con = loaded
    e = A.unqualify(parse_expr(text))
    pushed, _, _ = fabric_scan(source, [e], dict(PARAMS), columns=["id"])
    local = functions.filter_table(full, e, dict(PARAMS), resolve=lambda c: c.name)
    sql = _oracle_sql(e)
    for k, v in PARAMS.items():
        sql = sql.replace("{{session." + k + "}}", _lit(v))
    oracle = [r[0] for r in con.execute(f"SELECT id FROM t WHERE {sql} ORDER BY id").fetchall()]
    # and as the fabric evaluates it above a join: its own DuckDB SQL (fabric.execute.sql)
    b = SqlBuilder(dict(PARAMS), dt.datetime.now(UTC))
    rel = b.table(full)
    above = b.run(f"SELECT id FROM ({rel.sql}) AS q WHERE {b.expr(e, rel)} ORDER BY id")
    assert above.column("id").to_pylist() == oracle, f"{loaded[0]}: fabric's DuckDB SQL for {text}"
    return sorted(pushed.column("id").to_pylist()), sorted(local.column("id").to_pylist()), oracle


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(text=condition())
def test_pushed_local_and_duckdb_agree(loaded: Any, text: str) -> None:
    pushed, local, oracle = _three_ways(loaded, text)
    assert local == oracle, f"{loaded[0]}: local pyarrow vs DuckDB differ for {text}"
    assert pushed == oracle, f"{loaded[0]}: pushed vs DuckDB differ for {text}"


# ------------------------------------------------------------------ regressions, every connector


@pytest.mark.parametrize(
    "text",
    [
        "d between 0.06 - 0.01 and 0.06 + 0.01",  # TPC-H Q6 (binary floats dropped the bounds)
        "d < 24",  # 'Precision is not great enough' on DECIMAL(15, 2)
        "d * (1 - d) > 0.5",
        "c = 'Brand#13'",  # CHAR(10): blank-padded on PostgreSQL
        "c = 'Brand#13' or i < -100",
        "c like '%#13'",
        "c in ('Brand#13', 'x')",
        "length(c) = 8",
        "s = 'abc '",  # trailing spaces are significant in VARCHAR (MariaDB's PAD collations)
        "s = 'köln'",  # case-sensitive, unicode
        "i / 2 > 3",  # float division, as SQL
        "round(d, 1) = 2.5",
        "date_trunc('month', ts) = timestamp '2024-03-01T00:00:00Z'",
        "date_part('year', ts) = 2024",
        "substring(s, 1, 2) = 'ab'",
        "trim(s) = 'abc'",
        "s like 'a\\_b%'",  # backslash escapes _ (DuckDB's LIKE has no default escape)
        "s like '%' || {{session.w}} || '%'",  # TPC-H Q9: '||' over a session value folded
        "c not like {{session.brand}} || '3'",
        # three-valued logic under not: a null in an 'in' list, a comparison with null
        "not (d in (0.05, null))",
        "not (i not in (7, null))",
        "not (s in (null))",
        "not (d = null)",
        "not (d between null and 1)",
        "i between null and 1",
        "not (i between 1 and null)",
        "not (i in (7, null))",
        "not (i in {{session.li}})",
        "not (i not in {{session.li}})",
        "i in {{session.li}} or s = 'abc'",
        # conditions on session values alone (no column): folded per query
        "{{session.n}} > 1 or i < 0",
        "{{session.n}} = 24 and s = 'abc'",
        "not ({{session.n}} < 1) and d > 0",
        "{{session.w}} like 'b%' or {{session.x}} is null",
    ],
)
def test_known_wrong_answers_stay_fixed(loaded: Any, text: str) -> None:
    pushed, local, oracle = _three_ways(loaded, text)
    assert local == oracle, f"{loaded[0]}: local vs DuckDB for {text}"
    assert pushed == oracle, f"{loaded[0]}: pushed vs DuckDB for {text}"


def test_char_values_are_unpadded_and_pushed_equals_local(loaded: Any) -> None:
    name, source, full, _ = loaded
    assert "Brand#13  " not in full.column("c").to_pylist()
    want = sorted(r["id"] for r in ROWS if r["c"] == "Brand#13")
    assert want
    pushed, _, _ = fabric_scan(source, [parse_expr("c = 'Brand#13'")], columns=["id"])
    assert sorted(pushed.column("id").to_pylist()) == want, name


def test_functions_pushed_where_a_form_exists(loaded: Any) -> None:
    """A function with a SQL form is pushed to the SQL servers (EXACT); the others are
    left to the fabric (UNSUPPORTED) and still give the right rows (above)."""
    from connectors.base import Pushdown

    name, source, _, _ = loaded
    for text in ("round(d, 1) = 2.5", "trim(s) = 'abc'", "date_part('year', ts) = 2024"):
        got = source.supports_filter(parse_expr(text))
        if name in ("mariadb", "postgres", "s3", "csv", "kafka", "dataset"):
            assert got is Pushdown.EXACT, (name, text, got)
        else:
            assert got is Pushdown.UNSUPPORTED, (name, text, got)


# ------------------------------------------------------------------ every function x every connector

_GH = functions.geo_hash(pa.array([ROWS[0]["f"]]), pa.array([float(ROWS[0]["i"])]), 2)[0].as_py()

#: every field of date_part, with a value that some rows have
_PARTS = [
    ("year", 2024),
    ("quarter", 2),
    ("month", 6),
    ("week", 10),
    ("day", 15),
    ("dow", 0),
    ("isodow", 7),
    ("doy", 60),
    ("hour", 23),
    ("minute", 0),
    ("second", 0),
]

#: every registered scalar function, as filters over this table
FUNCTION_FILTERS: dict[str, list[str]] = {
    "now": ["ts < now()"],
    "lower": ["lower(s) = 'köln'", "lower(c) like 'brand#1%'"],
    "upper": ["upper(s) = 'STRASSE'", "upper(c) = 'BRAND#13'"],
    "trim": ["trim(s) = 'abc'"],
    "length": ["length(s) = 4", "length(c) < 3"],
    "abs": ["abs(i) > 10", "abs(d) < 0.05"],
    "round": [
        "round(d, 1) = 0.1",
        "round(d) = 0",
        "round(i) > 5",
        "round(f) = 3",  # 2.5: half away from zero in every engine that rounds floats
        "round(f, 2) = 1.13",  # 1.125
        "round(f, 1) = -1.5",
    ],
    "floor": ["floor(d) = 0", "floor(f) = 1"],
    "ceil": ["ceil(d) = 1", "ceil(f) > 1"],
    "coalesce": ["coalesce(i, -1) = -1", "coalesce(s, 'none') = 'none'"],
    "geo_hash": [f"geo_hash(f, i, 2) = '{_GH}'"],
    "match": ["match(s, 'paulo')", "match(s, 'Köln')"],
    "date_trunc": [
        "date_trunc('month', ts) = timestamp '2024-03-01T00:00:00Z'",
        "date_trunc('week', ts) = timestamp '2024-01-29T00:00:00Z'",
        "date_trunc('quarter', ts) = timestamp '2024-04-01T00:00:00Z'",
        "date_trunc('hour', ts) = timestamp '2024-03-01T02:00:00+02:00'",
        "date_trunc('year', ts) < timestamp '2024-06-01T00:00:00Z'",
    ],
    "date_part": [f"date_part('{u}', ts) = {v}" for u, v in _PARTS],
    "extract": ["extract('month', ts) = 6", "extract('hour', ts) >= 20"],
    "substring": ["substring(s, 1, 2) = 'ab'", "substring(c, 7) = '13'"],
    "contains": ["contains(v, 1.0)"],
    "cosine": ["cosine(v, [1.0, 0.0]) < 0.5"],
    "l2": ["l2(v, [0.0, 0.0]) > 3"],
    "dot": ["dot(v, [1.0, 1.0]) > 0"],
    "case": ["case when i > 0 then s else c end = 'abc'"],
    "cast": ["cast(i as str) = '7'", "cast(d as int) = 2"],
}
_LIST_FUNCTIONS = {"contains", "cosine", "l2", "dot"}
FUNCTION_CASES = [
    (name, text)
    for name in sorted(FUNCTION_FILTERS)
    if name in functions.REGISTRY
    for text in FUNCTION_FILTERS[name]
]


def test_every_registered_function_has_a_filter_here() -> None:
    scalar = {n for n, f in functions.REGISTRY.items() if not f.aggregate}
    assert not scalar - set(FUNCTION_FILTERS), sorted(scalar - set(FUNCTION_FILTERS))


@pytest.mark.parametrize(("fn", "text"), FUNCTION_CASES, ids=[t for _, t in FUNCTION_CASES])
def test_every_function_at_every_connector_equals_duckdb(loaded: Any, fn: str, text: str) -> None:
    """Pushed where the connector has a form for the function (the registry's sql form
    for MariaDB / PostgreSQL, the pyarrow form for S3, files and Kafka), evaluated by the
    fabric where not; the rows equal DuckDB's either way."""
    from connectors.base import Pushdown

    name, source, full, _ = loaded
    if fn in _LIST_FUNCTIONS and "v" not in full.column_names:
        pytest.skip(f"{name} has no list column type")
    pushed, local, oracle = _three_ways(loaded, text)
    assert local == oracle, f"{name}: local vs DuckDB for {text}"
    assert pushed == oracle, f"{name}: pushed vs DuckDB for {text}"
    f = functions.REGISTRY[fn]
    answer = source.supports_filter(A.unqualify(parse_expr(text)))
    if name in ("s3", "csv", "kafka", "dataset") and f.arrow is not None and fn != "now":
        assert answer is Pushdown.EXACT, (name, text, answer)
    if name == "mongo" and fn != "now":
        assert (answer is Pushdown.EXACT) == (f.mongo is not None), (name, text, answer)
    if name in ("mariadb", "postgres") and f.sql is None and fn != "now":
        assert answer is Pushdown.UNSUPPORTED, (name, text, answer)
