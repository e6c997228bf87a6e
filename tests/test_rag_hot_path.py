"""The multi-hop hot path (issue 17): a stage's lone source unit runs on the caller's
thread (no pool handoff) while units ready together still share the pool, and an
aggregate of one input (count / count_distinct / min / max) runs in pyarrow, not DuckDB,
with DuckDB's answer: checked against DuckDB running the same SQL on the same table,
NULL keys, NULL and NaN values, strings and timestamps included."""

from __future__ import annotations

import datetime as dt

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from fixtures.optimizer import world
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsl.loader import load_text
from fabric.execute import execute, physical
from fabric.optimizer import optimize
from fabric.plan.builder import build


def events() -> pa.Table:
    rng = np.random.default_rng(11)
    n = 300
    kinds = [None if i % 17 == 0 else ["buy", "sell", "hold"][i % 3] for i in range(n)]
    score = [None if i % 13 == 0 else float(x) for i, x in enumerate(rng.normal(size=n))]
    t0 = dt.datetime(2026, 1, 1)
    return pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "kind": pa.array(kinds, pa.string()),
            "sym": pa.array([f"S{int(i) % 7}" for i in rng.integers(0, 100, n)]),
            "score": pa.array(score, pa.float64()),
            "ts": pa.array([t0 + dt.timedelta(minutes=int(m)) for m in rng.integers(0, 10**5, n)]),
        }
    )


@pytest.fixture(scope="module")
def tables() -> dict[str, pa.Table]:
    t = world.make_tables()
    t["events"] = events()
    nan = events()
    score = nan.column("score").to_pylist()
    score[5] = float("nan")
    t["events_nan"] = nan.set_column(3, "score", pa.array(score, pa.float64()))
    return t


@pytest.fixture(scope="module")
def cat(tables):  # type: ignore[no-untyped-def]
    return world.catalog(tables)


@pytest.fixture(scope="module")
def ref(tables):  # type: ignore[no-untyped-def]
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con


def run(cat, binding: str):  # type: ignore[no-untyped-def]
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    return physical(plan, cat, spec.name), execute(plan, {}, cat, binding=spec.name)


def norm(rows: list[tuple]) -> list[tuple]:
    def v(x: object) -> object:
        if isinstance(x, float) and np.isnan(x):
            return "NaN"
        return round(x, 9) if isinstance(x, float) else x

    return sorted((tuple(v(x) for x in r) for r in rows), key=repr)


GROUPED = """
binding: per_kind
sources:
  e: {from: memory://t/%(table)s, where: e.id > 3}
select: [e.kind, count(*) as n, count(e.score) as scored, count_distinct(e.sym) as syms,
         min(e.score) as lo, max(e.score) as hi, min(e.sym) as first, max(e.ts) as last]
group_by: [e.kind]
"""
GROUPED_SQL = """SELECT kind, count(*), count(score), count(DISTINCT sym), min(score),
    max(score), min(sym), max(ts) FROM %(table)s WHERE id > 3 GROUP BY kind"""


def test_grouped_aggregate_runs_in_pyarrow_with_duckdbs_answer(cat, ref) -> None:  # type: ignore[no-untyped-def]
    pp, res = run(cat, GROUPED % {"table": "events"})
    assert "pyarrow Aggregate: group_by=[e.kind]" in pp.explain(), pp.explain()
    assert "DuckDB" not in pp.explain(), pp.explain()
    got = [tuple(r.values()) for r in res.table.to_pylist()]
    want = ref.execute(GROUPED_SQL % {"table": "events"}).fetchall()
    assert norm(got) == norm(want)
    assert any(r[0] is None for r in got), "a NULL key is a group of its own"
    assert res.table.schema.field("n").type == pa.int64()


def test_nan_under_min_max_gives_duckdbs_answer(cat, ref) -> None:  # type: ignore[no-untyped-def]
    # pyarrow's min / max skip NaN, DuckDB orders it above every number: DuckDB answers
    _, res = run(cat, GROUPED % {"table": "events_nan"})
    got = [tuple(r.values()) for r in res.table.to_pylist()]
    want = ref.execute(GROUPED_SQL % {"table": "events_nan"}).fetchall()
    assert norm(got) == norm(want)
    assert any(r[5] == "NaN" for r in norm(got)), "the NaN is the max of its group"


@pytest.mark.parametrize("where", ["e.id > 3", "e.id < 0"])
def test_global_aggregate_one_row_even_when_empty(cat, ref, where: str) -> None:  # type: ignore[no-untyped-def]
    binding = f"""
binding: totals
sources:
  e: {{from: memory://t/events, where: "{where}"}}
select: [count(*) as n, min(e.score) as lo, max(e.ts) as last, count(e.kind) as kinds]
"""
    pp, res = run(cat, binding)
    assert "pyarrow Aggregate" in pp.explain(), pp.explain()
    got = [tuple(r.values()) for r in res.table.to_pylist()]
    sql = f"SELECT count(*), min(score), max(ts), count(kind) FROM events WHERE {where[2:]}"
    assert norm(got) == norm(ref.execute(sql).fetchall())
    assert len(got) == 1


def test_sum_and_joins_stay_in_duckdb(cat) -> None:  # type: ignore[no-untyped-def]
    pp, _ = run(
        cat,
        """
binding: sums
sources:
  e: {from: memory://t/events}
select: [e.kind, sum(e.score) as total]
group_by: [e.kind]
""",
    )
    assert "DuckDB query over 1 input" in pp.explain(), pp.explain()


STAGED = """
binding: staged
stages:
  top:
    sources:
      e: {from: memory://t/events, where: e.score > 1.0}
    select: [e.sym]
sources:
  f: {from: memory://t/events, where: f.sym in top}
select: [f.sym, count(*) as n]
group_by: [f.sym]
"""
TWO_READY = """
binding: two_ready
stages:
  both:
    sources:
      a: {from: memory://t/events, where: a.score > 1.0}
      b: {from: memory://t/events, join: b.id = a.id + 1}
    select: [b.sym]
sources:
  f: {from: memory://t/events, where: f.sym in both}
select: [f.sym, count(*) as n]
group_by: [f.sym]
"""


def analyze(cat, binding: str) -> str:  # type: ignore[no-untyped-def]
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    res = execute(plan, {}, cat, binding=spec.name, analyze=True)
    assert res.explain is not None
    return res.explain


def line(text: str, alias: str) -> str:
    return next(ln for ln in text.splitlines() if f"Scan: {alias} <- " in ln)


def test_lone_stage_units_run_inline(cat, ref) -> None:  # type: ignore[no-untyped-def]
    text = analyze(cat, STAGED)
    for alias in ("e", "f"):  # each is the one unit ready when it starts
        assert "ran inline (ready alone)" in line(text, alias), text
    _, res = run(cat, STAGED)
    want = ref.execute(
        """SELECT sym, count(*) FROM events WHERE sym IN
           (SELECT sym FROM events WHERE score > 1.0) GROUP BY sym"""
    ).fetchall()
    assert norm([tuple(r.values()) for r in res.table.to_pylist()]) == norm(want)


def test_units_ready_together_share_the_pool(cat) -> None:  # type: ignore[no-untyped-def]
    text = analyze(cat, TWO_READY)
    for alias in ("a", "b"):  # b takes a's keys: both go to the pool
        assert "ran inline" not in line(text, alias), text
    assert "ran inline (ready alone)" in line(text, "f"), text


_TEXT = st.one_of(
    st.none(), st.sampled_from(["", "a", "A", "b", "é", "a ", "zz", "\u00ff", "日本"])
)
_FLOAT = st.one_of(
    st.none(),
    st.sampled_from([0.0, -0.0, 1.5, -2.25, float("inf"), float("-inf"), float("nan")]),
    st.floats(-1e6, 1e6, allow_nan=False),
)
_DEC = st.one_of(st.none(), st.decimals(-1000, 1000, places=2, allow_nan=False))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_TEXT, _TEXT, _FLOAT, _DEC), min_size=0, max_size=40))
def test_random_pyarrow_aggregates_equal_duckdb(rows) -> None:  # type: ignore[no-untyped-def]
    """Random tables (NULL keys, empty and non-ASCII strings, -0.0, infinities, NaN,
    DECIMAL): whichever engine the planner picks (pyarrow, or DuckDB when a NaN is under
    min / max), the answer is DuckDB's over the same table."""
    t = pa.table(
        {
            "id": pa.array(range(len(rows)), pa.int64()),
            "kind": pa.array([r[0] for r in rows], pa.string()),
            "sym": pa.array([r[1] for r in rows], pa.string()),
            "score": pa.array([r[2] for r in rows], pa.float64()),
            "price": pa.array([r[3] for r in rows], pa.decimal128(9, 2)),
        }
    )
    tables = world.make_tables()
    tables["rnd"] = t
    binding = """
binding: rnd
sources:
  e: {from: memory://t/rnd, where: e.id >= 0}
select: [e.kind, count(*) as n, count(e.score) as scored, count_distinct(e.sym) as syms,
         min(e.score) as lo, max(e.score) as hi, min(e.sym) as first, max(e.sym) as last,
         min(e.price) as cheap, max(e.price) as dear]
group_by: [e.kind]
"""
    _, res = run(world.catalog(tables), binding)
    con = duckdb.connect()
    con.register("rnd", t)
    want = con.execute(
        "SELECT kind, count(*), count(score), count(DISTINCT sym), min(score), max(score), "
        "min(sym), max(sym), min(price), max(price) FROM rnd WHERE id >= 0 GROUP BY kind"
    ).fetchall()
    got = [tuple(r.values()) for r in res.table.to_pylist()]
    assert norm(got) == norm(want)


# ---------------------------------------------------------------- the small-table path
# An Aggregate or Sort over at most fabric.execute.pyarrow_ops.SMALL_ROWS rows runs in Python
# (pyarrow's kernels cost more to set up than the 20 rows of a multi-hop answer);
# SMALL_ROWS = 0 is the general path. The two must give the same table: rows, their order, types.

_INT = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from([2**62, -(2**63)]))
_ROWS = st.lists(st.tuples(_TEXT, _TEXT, _FLOAT, _DEC, _INT), min_size=0, max_size=40)
SMALL_AGG = """
binding: small_agg
sources:
  e: {from: memory://t/rnd, where: e.id >= 0}
select: [e.kind, e.n, count(*) as rows, count(e.score) as scored, count_distinct(e.sym) as syms,
         count_distinct(e.n) as ns, min(e.score) as lo, max(e.score) as hi, min(e.sym) as first,
         max(e.sym) as last, min(e.price) as cheap, max(e.price) as dear, max(e.n) as top]
group_by: [e.kind, e.n]
"""
SMALL_ONE_KEY = """
binding: small_one_key
sources:
  e: {from: memory://t/rnd, where: e.id >= 0}
select: [e.%s, count(*) as rows, count(e.score) as scored, count_distinct(e.sym) as syms,
         min(e.score) as lo, max(e.score) as hi, min(e.sym) as first, max(e.price) as dear,
         min(e.n) as low, count_distinct(e.n) as ns]
group_by: [e.%s]
"""
SMALL_TOTAL = """
binding: small_total
sources:
  e: {from: memory://t/rnd, where: e.id >= 0}
select: [count(*) as rows, min(e.score) as lo, max(e.sym) as last, count_distinct(e.kind) as kinds]
"""
SMALL_SORT = """
binding: small_sort
sources:
  e: {from: memory://t/rnd, where: e.id >= 0}
select: [e.id, e.kind, e.sym, e.score, e.price, e.n]
order_by: [%s]
"""


def rnd_table(rows: list[tuple]) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(len(rows)), pa.int64()),
            "kind": pa.array([r[0] for r in rows], pa.string()),
            "sym": pa.array([r[1] for r in rows], pa.string()),
            "score": pa.array([r[2] for r in rows], pa.float64()),
            "price": pa.array([r[3] for r in rows], pa.decimal128(9, 2)),
            "n": pa.array([r[4] for r in rows], pa.int64()),
        }
    )


def both_paths(t: pa.Table, binding: str) -> tuple[pa.Table, pa.Table]:
    import fabric.execute.pyarrow_ops as fx

    tables = world.make_tables()
    tables["rnd"] = t
    cat = world.catalog(tables)
    saved = fx.SMALL_ROWS
    try:
        fx.SMALL_ROWS = 10**6
        _, small = run(cat, binding)
        fx.SMALL_ROWS = 0
        _, general = run(cat, binding)
    finally:
        fx.SMALL_ROWS = saved
    return small.table, general.table


def same_table(a: pa.Table, b: pa.Table, ordered: bool = True) -> None:
    """Same schema, same rows in the same order (NaN equal to NaN, -0.0 to 0.0); not
    ``ordered``: in any order (DuckDB's groups come in no set order)."""

    def rows(t: pa.Table) -> list[tuple]:
        nan = lambda x: "NaN" if isinstance(x, float) and np.isnan(x) else x  # noqa: E731
        out = [tuple(nan(x) for x in r.values()) for r in t.to_pylist()]
        return out if ordered else sorted(out, key=repr)

    assert a.schema == b.schema
    assert rows(a) == rows(b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ROWS)
def test_small_aggregate_equals_the_general_path(rows) -> None:  # type: ignore[no-untyped-def]
    """Random tables (NULL keys, -0.0 and 0.0, infinities, NaN, DECIMAL, non-ASCII and
    empty strings, int64 extremes): aggregates grouped by one key (the Python path), by
    two (pyarrow's either way) and global ones, the Python path and
    pyarrow's give the same table, groups in the same order (both DuckDB's, in its order,
    when a NaN is under min / max)."""
    t = rnd_table(rows)
    nan = any(r[2] is not None and r[2] != r[2] for r in rows)
    for binding in (SMALL_AGG, SMALL_TOTAL, *(SMALL_ONE_KEY % (k, k) for k in ("kind", "n"))):
        same_table(*both_paths(t, binding), ordered=not nan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _ROWS,
    st.lists(
        st.tuples(
            st.sampled_from(["e.kind", "e.sym", "e.score", "e.price", "e.n", "e.n + 1"]),
            st.sampled_from(["", " asc", " desc"]),
            st.sampled_from(["", " nulls first", " nulls last"]),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_small_sort_equals_the_general_path(rows, keys) -> None:  # type: ignore[no-untyped-def]
    """The same random tables sorted by 1-3 random keys (a column or an expression, asc /
    desc, NULLs first / last / default): the same rows in the same order (a stable sort:
    ties keep their input order), NaN keys through pyarrow's sort."""
    order = ", ".join(f"{k}{d}{n}" for k, d, n in keys)
    same_table(*both_paths(rnd_table(rows), SMALL_SORT % order))


def test_stage_list_is_sorted_whatever_the_row_order() -> None:
    """``x in S`` binds S's distinct values sorted, NULL last: the same set is the same
    parameter (the dataset's filter cache and guard history are keyed by it)."""
    from fabric.execute.stages import bind

    names = frozenset({"stage:syms:list"})
    a = pa.table({"symbol": ["MSFT", None, "AAPL", "MSFT", "NVDA"]})
    b = pa.table({"symbol": ["NVDA", "AAPL", None, "MSFT", "AAPL"]})
    assert bind("syms", a, names) == bind("syms", b, names)
    assert bind("syms", a, names) == {"stage:syms:list": ["AAPL", "MSFT", "NVDA", None]}
    many = pa.table({"symbol": [f"S{i % 7}" for i in range(100, 0, -1)] + [None]})  # pc.unique
    assert bind("syms", many, names) == {"stage:syms:list": [f"S{i}" for i in range(7)] + [None]}
    ints = pa.table({"n": pa.array([3, None, -1, 3, 2], pa.int64())})
    assert bind("syms", ints, names) == {"stage:syms:list": [-1, 2, 3, None]}
