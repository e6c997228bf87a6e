"""A correlated exists / not exists pushed into the source of the same SQL connection
(fabric/optimizer/push_exists.py, connectors/sql.py ``ExistsIn``).

TPC-H Q22 keeps the customers with no order: ``not exists(ordered where
ordered.o_custkey = c.c_custkey)``. Customer and orders live in the same MariaDB, yet
the fabric read the customers that pass the other filters (1,856 for 641 needed at SF
0.1) and every order (149,775), then filtered in DuckDB. Pushed, the server answers
``WHERE NOT EXISTS (SELECT 1 FROM orders WHERE orders.o_custkey = customer.c_custkey)``
and nothing else is read.

The answer must be DuckDB's over the same rows on random tables (NULL keys on either
side, duplicate keys, an empty inner table, strings differing in case and trailing
spaces, session values inside the stage's filters, an exists under an OR, a derived
outer column, a second correlation with ``<>``), on the real MariaDB and PostgreSQL
servers and on SQLite (no server), with and without the rule; with the rule the outer
source returns exactly the rows of the answer and the stage's table is not read.
Explain-text fixtures: tests/fixtures/optimizer/push_exists/.
"""

from __future__ import annotations

import decimal
import random
from typing import Any

import duckdb
import pyarrow as pa
import pytest
import sqlalchemy as sa

import fabric.optimizer as opt
from connectors.base import Pushdown
from connectors.sql import SqlConnection
from dsl.ast import Binary, Column, ExistsIn, Unary
from dsl.loader import load_text
from fabric.execute import execute
from fabric.execute.local import LocalCatalog
from fabric.optimizer.push_exists import push_exists
from fabric.optimizer.push_filters import push_filters
from fabric.plan.builder import build
from fabric.plan.nodes import WithStages
from tests.servers import sql_url

D = decimal.Decimal
STRINGS = ["a", "A", "a ", "b", "ß", "", None]

OUTER_DDL = (
    "CREATE TABLE pe_c (id BIGINT PRIMARY KEY, k BIGINT, k2 BIGINT, s VARCHAR(8), v DECIMAL(10, 2))"
)
INNER_DDL = (
    "CREATE TABLE pe_o (id BIGINT PRIMARY KEY, k BIGINT, k2 BIGINT, s VARCHAR(8), v DECIMAL(10, 2))"
)
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("k", pa.int64()),
        ("k2", pa.int64()),
        ("s", pa.string()),
        ("v", pa.decimal128(10, 2)),
    ]
)

# name -> (the stage's where, the outer where, the reference's WHERE over c and st,
#          whether the rule pushes it on every server)
CASES: dict[str, tuple[str, str, str, bool]] = {
    "not_exists": (
        "",
        "not exists(st where st.k = c.k)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k)",
        True,
    ),
    "exists": (
        "",
        "exists(st where st.k = c.k)",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k)",
        True,
    ),
    "q21_shape": (
        "",
        "exists(st where st.k = c.k and st.k2 <> c.k2) and not exists(st2 where st2.k = c.k and st2.k2 <> c.k2)",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k AND st.k2 <> c.k2) "
        "AND NOT EXISTS (SELECT 1 FROM st2 WHERE st2.k = c.k AND st2.k2 <> c.k2)",
        True,
    ),
    "stage_filters": (
        "s = 'a' and v > {{session.lo}}",
        "not exists(st where st.k = c.k)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k)",
        True,
    ),
    "under_or": (
        "v < {{session.lo}}",
        "not exists(st where st.k = c.k) or c.v > {{session.lo}}",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k) OR c.v > $lo",
        True,
    ),
    "outer_filter_inside": (
        "",
        "exists(st where st.k = c.k and c.s = 'a')",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k AND c.s = 'a')",
        True,
    ),
    "derived_outer": (
        "",
        "not exists(st where st.k = c.kk)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k + 1)",
        True,
    ),
    # text keys: exact on PostgreSQL (both sides in byte order); MariaDB compares two
    # columns by their collations, so the fabric applies it there
    "text_key": (
        "",
        "not exists(st where st.s = c.s)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.s = c.s)",
        False,
    ),
}


def _binding(case: str) -> str:
    stage_where, outer_where, _, _ = CASES[case]
    where = f'\n        where: "{stage_where}"' if stage_where else ""
    st2 = (
        """
  st2:
    sources:
      o2: {from: KIND://db/pe_o, where: "v > 0"}
    select: [o2.k, o2.k2]"""
        if "st2" in outer_where
        else ""
    )
    return f"""
binding: pe_{case}
session: {{lo: decimal}}
stages:
  st:
    sources:
      o:
        from: KIND://db/pe_o{where}
    select: [o.k, o.k2, o.s]{st2}
sources:
  c:
    from: KIND://db/pe_c
    derive: {{kk: k + 1}}
    where: "{outer_where}"
select: [c.id]
"""


def _reference(case: str, outer: pa.Table, inner: pa.Table, lo: D, extra: str = "") -> list[int]:
    """The ids DuckDB answers over the same rows (the stages as tables of ``inner``)."""
    stage_where, _, where, _ = CASES[case]
    con = duckdb.connect()
    con.register("c", outer)
    con.register("o", inner)
    sw = stage_where.replace("{{session.lo}}", str(lo))
    con.execute(f"CREATE TEMP TABLE st AS SELECT * FROM o {'WHERE ' + sw if sw else ''}")
    con.execute("CREATE TEMP TABLE st2 AS SELECT * FROM o WHERE v > 0")
    sql = f"SELECT c.id FROM c WHERE ({where.replace('$lo', str(lo))}) {extra}"
    return sorted(r[0] for r in con.execute(sql).fetchall())


def _expect_push(kind: str, case: str) -> bool:
    if kind == "sql":  # SQLite: the translator knows its numbers, not its strings
        return case not in ("stage_filters", "outer_filter_inside", "text_key")
    return CASES[case][3] or kind == "postgres"


def _tables(seed: int, n_outer: int, n_inner: int, null_share: float) -> tuple[pa.Table, pa.Table]:
    rng = random.Random(seed)

    def maybe(v: Any) -> Any:
        return None if rng.random() < null_share else v

    def rows(n: int, base: int) -> list[dict[str, Any]]:
        return [
            {
                "id": base + i,
                "k": maybe(rng.randrange(12)),  # few keys: duplicates on both sides
                "k2": maybe(rng.randrange(3)),
                "s": maybe(rng.choice(STRINGS)),
                "v": maybe(D(rng.randrange(-500, 500)) / 100),
            }
            for i in range(n)
        ]

    return (
        pa.Table.from_pylist(rows(n_outer, 0), schema=SCHEMA),
        pa.Table.from_pylist(rows(n_inner, 10_000), schema=SCHEMA),
    )


@pytest.fixture(scope="module", params=["mysql", "postgres"])
def server(request) -> tuple[str, str]:
    return request.param, sql_url(request, request.param)


def _load(url: str, kind: str, outer: pa.Table, inner: pa.Table, index: bool = True) -> None:
    """The two tables on the server; ``index``: pe_o(k) indexed (MariaDB then looks an
    order up per row where a correlation beyond ``=`` keeps it from a semi-join)."""
    engine = sa.create_engine(url)
    tail = " CHARACTER SET utf8mb4" if kind == "mysql" else ""
    try:
        with engine.begin() as c:
            for name, ddl, t in (("pe_c", OUTER_DDL, outer), ("pe_o", INNER_DDL, inner)):
                c.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
                c.exec_driver_sql(ddl + tail)
                rows = t.to_pylist()
                if kind == "sql":  # SQLite binds no Decimal
                    rows = [{**r, "v": None if r["v"] is None else str(r["v"])} for r in rows]
                if rows:
                    c.execute(sa.text(f"INSERT INTO {name} VALUES (:id, :k, :k2, :s, :v)"), rows)
            if index:
                c.exec_driver_sql("CREATE INDEX pe_o_k ON pe_o (k)")
    finally:
        engine.dispose()


def _run(kind: str, url: str, case: str, lo: D, with_rule: bool):
    conn = SqlConnection("db", {"kind": kind, "url": url})
    try:
        cat = LocalCatalog({"db": conn})
        spec = load_text(_binding(case).replace("KIND", kind), f"pe_{case}.yaml")[0]
        rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r is not push_exists)
        plan = opt.optimize(build(spec, cat), cat, rules=rules)
        res = execute(plan, {"lo": lo}, cat, binding=spec.name)
        return plan, res
    finally:
        conn.close()


def _pushed(plan) -> bool:
    (c,) = [s for s in plan.scans() if s.alias == "c"]
    return any(isinstance(x, ExistsIn) for f in c.exact for x in f.walk())


def test_the_rule_runs_between_push_filters_and_dynamic_filters() -> None:
    names = [r.__name__ for r in opt.RULES]
    assert names.index("push_filters") < names.index("push_exists") < names.index("dynamic_filters")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "seed,n_outer,n_inner,null_share,lo",
    [
        (1, 60, 40, 0.0, D("0.00")),
        (2, 80, 60, 0.25, D("-1.50")),  # NULL keys, strings and values on both sides
        (3, 50, 0, 0.1, D("0.00")),  # an empty inner table: exists never, not exists always
        (4, 0, 30, 0.1, D("0.00")),  # no outer rows
        (5, 100, 300, 0.3, D("4.99")),  # many duplicate inner keys
    ],
)
def test_random_tables_give_duckdbs_answer_with_and_without_the_rule(
    server: tuple[str, str],
    case: str,
    seed: int,
    n_outer: int,
    n_inner: int,
    null_share: float,
    lo: D,
) -> None:
    kind, url = server
    outer, inner = _tables(seed, n_outer, n_inner, null_share)
    _load(url, kind, outer, inner)
    want = _reference(case, outer, inner, lo)
    pushes = _expect_push(kind, case)
    for with_rule in (True, False):
        plan, res = _run(kind, url, case, lo, with_rule)
        got = sorted(res.table.column("id").to_pylist())
        assert got == want, f"{kind} {case} with_rule={with_rule}:\n{plan.explain()}"
        assert _pushed(plan) == (with_rule and pushes), plan.explain()
        if with_rule and pushes:
            sources = res.stats["sources"]
            # the outer source returns the answer's rows, the stage's table is not read
            assert sources["c"]["rows"] == len(want), plan.explain()
            assert "o" not in sources and "o2" not in sources, sorted(sources)
            assert not isinstance(plan, WithStages), plan.explain()


def test_q22_shape_reads_only_the_rows_of_the_answer(server: tuple[str, str]) -> None:
    """Customers with no order among those with a balance over a stage's average, as
    TPC-H Q22: before the rule the scan returned every customer over the average."""
    kind, url = server
    outer, inner = _tables(11, 400, 300, 0.05)
    _load(url, kind, outer, inner)
    want = _reference("not_exists", outer, inner, D(0), extra="AND c.v > -1")
    conn = SqlConnection("db", {"kind": kind, "url": url})
    binding = f"""
binding: pe_q22
stages:
  st:
    sources:
      o: {{from: {kind}://db/pe_o}}
    select: [o.k]
sources:
  c:
    from: {kind}://db/pe_c
    where: [v > -1, "not exists(st where st.k = c.k)"]
select: [c.id]
"""
    try:
        cat = LocalCatalog({"db": conn})
        spec = load_text(binding, "pe_q22.yaml")[0]
        fetched = {}
        for with_rule in (True, False):
            rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r is not push_exists)
            plan = opt.optimize(build(spec, cat), cat, rules=rules)
            res = execute(plan, {}, cat, binding=spec.name)
            assert sorted(res.table.column("id").to_pylist()) == want
            fetched[with_rule] = {a: s["rows"] for a, s in res.stats["sources"].items()}
    finally:
        conn.close()
    assert fetched[True] == {"c": len(want)}
    assert fetched[False]["c"] > len(want)  # the old plan: every customer over -1
    assert fetched[False]["o"] > 0


def test_only_a_table_of_the_same_connection_is_taken(tmp_path) -> None:
    """Another connection (even to the same database), an unknown table, a column the
    table lacks: UNSUPPORTED, so the fabric keeps evaluating the exists."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    _load(url, "sql", *_tables(1, 3, 3, 0.0))
    a, b = (
        SqlConnection("a", {"kind": "sql", "url": url}),
        SqlConnection("b", {"kind": "sql", "url": url}),
    )
    try:
        src = a.source("pe_c")
        cond = Binary("=", Column("k", "st"), Column("k"))
        assert src.supports_filter(ExistsIn("sql://a/pe_o", "st", cond)) is Pushdown.EXACT
        assert (
            src.supports_filter(Unary("not", ExistsIn("sql://a/pe_o", "st", cond)))
            is Pushdown.EXACT
        )
        assert src.supports_filter(ExistsIn("sql://b/pe_o", "st", cond)) is Pushdown.UNSUPPORTED
        assert src.supports_filter(ExistsIn("sql://a/nope", "st", cond)) is Pushdown.UNSUPPORTED
        bad = Binary("=", Column("nope", "st"), Column("k"))
        assert src.supports_filter(ExistsIn("sql://a/pe_o", "st", bad)) is Pushdown.UNSUPPORTED
        assert (
            b.source("pe_c").supports_filter(ExistsIn("sql://a/pe_o", "st", cond))
            is Pushdown.UNSUPPORTED
        )
    finally:
        a.close()
        b.close()


def test_nothing_is_pushed_into_other_sources() -> None:
    """Memory tables (and S3, Mongo, ...) do not take an ExistsIn: the plan is unchanged."""
    from fixtures.optimizer import world

    cat = world.catalog()
    spec = load_text(
        """
binding: pe_memory
stages:
  st:
    sources:
      o: {from: memory://t/orders}
    select: [o.user_id]
sources:
  m:
    from: memory://t/merchants
    where: "not exists(st where st.user_id = m.id)"
select: [m.id]
""",
        "pe_memory.yaml",
    )[0]
    plan = opt.optimize(build(spec, cat), cat, rules=[push_filters])
    assert isinstance(plan, WithStages)
    assert push_exists(plan, cat) == plan
    assert not _pushed_anywhere(opt.optimize(build(spec, cat), cat))


def _pushed_anywhere(plan) -> bool:
    return any(isinstance(x, ExistsIn) for s in plan.scans() for f in s.exact for x in f.walk())


def test_mariadb_gets_a_correlation_beyond_equalities_only_with_an_index(
    server: tuple[str, str],
) -> None:
    """MariaDB turns ``exists(... where o.k = c.k)`` into a materialized lookup, but runs
    ``... and o.k2 <> c.k2`` once per outer row: without an index on ``o.k`` that scans
    the inner table per row (100k x 150k rows: past 20 s), so it is left to the fabric.
    PostgreSQL plans both as hash semi-joins. No equality at all: nowhere."""
    kind, url = server
    _load(url, kind, *_tables(1, 5, 5, 0.0), index=False)
    eq = Binary("=", Column("k", "st"), Column("k"))
    beyond = Binary("and", eq, Binary("!=", Column("k2", "st"), Column("k2")))
    only_beyond = Binary(">", Column("v", "st"), Column("v"))
    uri = f"{kind}://db/pe_o"
    for index in (False, True):
        if index:
            _load(url, kind, *_tables(1, 5, 5, 0.0), index=True)
        conn = SqlConnection("db", {"kind": kind, "url": url})
        try:
            src = conn.source("pe_c")
            answers = [
                src.supports_filter(ExistsIn(uri, "st", cond)) for cond in (eq, beyond, only_beyond)
            ]
        finally:
            conn.close()
        want_beyond = Pushdown.EXACT if (index or kind == "postgres") else Pushdown.UNSUPPORTED
        assert answers == [Pushdown.EXACT, want_beyond, Pushdown.UNSUPPORTED], (kind, index)


def test_an_exists_written_under_a_joined_source_goes_below_the_join(
    server: tuple[str, str],
) -> None:
    """A condition on ``c`` written in the ``where`` of the source ``d`` joined to it sits
    above the join; it goes into ``c``'s scan (inner join: either side; the answer is
    the same), and ``c`` returns the rows passing it."""
    kind, url = server
    outer, inner = _tables(21, 120, 90, 0.2)
    _load(url, kind, outer, inner)
    binding = f"""
binding: pe_join
stages:
  st:
    sources:
      o: {{from: {kind}://db/pe_o, where: "v > 0"}}
    select: [o.k]
sources:
  c: {{from: {kind}://db/pe_c}}
  d:
    from: {kind}://db/pe_o
    join: d.k2 = c.k2
    where: "not exists(st where st.k = c.k)"
select: [c.id, d.id as did]
"""
    con = duckdb.connect()
    con.register("c", outer)
    con.register("o", inner)
    cond = "NOT EXISTS (SELECT 1 FROM o st WHERE st.v > 0 AND st.k = c.k)"
    want = sorted(
        con.execute(f"SELECT c.id, d.id FROM c JOIN o d ON d.k2 = c.k2 WHERE {cond}").fetchall()
    )
    passing = con.execute(f"SELECT count(*) FROM c WHERE {cond}").fetchall()[0][0]
    conn = SqlConnection("db", {"kind": kind, "url": url})
    try:
        cat = LocalCatalog({"db": conn})
        spec = load_text(binding, "pe_join.yaml")[0]
        for with_rule in (True, False):
            rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r is not push_exists)
            plan = opt.optimize(build(spec, cat), cat, rules=rules)
            res = execute(plan, {}, cat, binding=spec.name)
            t = res.table
            got = sorted(zip(t.column("id").to_pylist(), t.column("did").to_pylist()))
            assert got == want, f"with_rule={with_rule}\n{plan.explain()}"
            assert _pushed(plan) == with_rule, plan.explain()
            if with_rule:
                assert res.stats["sources"]["c"]["rows"] <= passing  # (c may be keyed too)
                assert "o" not in res.stats["sources"]
    finally:
        conn.close()
