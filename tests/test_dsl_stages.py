"""Stages, subqueries and HAVING, end to end: binding -> plan -> execution over in-memory
sources, each answer checked against DuckDB running the SQL the binding stands for on
the same tables (the reference never goes through the fabric)."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest
from fixtures.optimizer import world

from dsl.loader import load_text
from dsl.parser import parse_binding_text
from fabric.execute import QueryError, execute
from fabric.optimizer import optimize
from fabric.plan import nodes as N
from fabric.plan.builder import build


@pytest.fixture(scope="module")
def tables():
    t = world.make_tables()
    # a null merchant id, so that `not in` must follow SQL's null semantics
    coupons = t["coupons"]
    ids = coupons.column("merchant_id").to_pylist()
    ids[coupons.column("discount").to_pylist().index(59)] = None  # inside `discount > 55`
    t["coupons"] = coupons.set_column(1, "merchant_id", pa.array(ids, pa.int64()))
    return t


@pytest.fixture(scope="module")
def cat(tables):
    return world.catalog(tables)


@pytest.fixture(scope="module")
def ref(tables):
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con


def run(cat, binding: str, session: dict | None = None, text: bool = False):
    spec = parse_binding_text(binding) if text else load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    return plan, execute(plan, session or {}, cat, binding=spec.name).table


def rows(table: pa.Table) -> list[tuple]:
    return [tuple(r.values()) for r in table.to_pylist()]


def same(got: list[tuple], want: list[tuple]) -> None:
    def norm(r):
        return tuple(round(v, 6) if isinstance(v, float) else v for v in r)

    assert sorted(map(norm, got), key=repr) == sorted(map(norm, want), key=repr)
    assert got, "the case should select something"


EXISTS = """
binding: big_spenders
session: {floor: float}
stages:
  big:
    sources:
      o: {from: memory://t/orders, where: "amount > {{session.floor}}"}
    select: [o.user_id, o.sku]
sources:
  c:
    from: memory://t/categories
    where: exists(big where big.sku = c.sku and big.user_id < 10)
select: [c.sku, c.category]
"""


def test_correlated_exists(cat, ref) -> None:
    plan, got = run(cat, EXISTS, {"floor": 190.0})
    want = ref.execute(
        """SELECT c.sku, c.category FROM categories c WHERE EXISTS (SELECT 1 FROM orders o
           WHERE o.amount > ? AND o.sku = c.sku AND o.user_id < 10)""",
        [190.0],
    ).fetchall()
    same(rows(got), want)
    assert isinstance(plan, N.WithStages) and [s.name for s in plan.stages] == ["big"]


def test_not_exists(cat, ref) -> None:
    binding = EXISTS.replace("where: exists(", "where: not exists(")
    _, got = run(cat, binding, {"floor": 150.0})
    want = ref.execute(
        """SELECT c.sku, c.category FROM categories c WHERE NOT EXISTS (SELECT 1 FROM orders o
           WHERE o.amount > ? AND o.sku = c.sku AND o.user_id < 10)""",
        [150.0],
    ).fetchall()
    same(rows(got), want)


IN_STAGE = """
binding: coupon_merchants
stages:
  ids:
    sources:
      c: {from: memory://t/coupons, where: discount > 55}
    select: [c.merchant_id]
sources:
  m:
    from: memory://t/merchants
    where: id {op} ids
select: [m.id, m.name]
"""


@pytest.mark.parametrize("op", ["in", "not in"])
def test_in_stage_with_null_semantics(cat, ref, op: str) -> None:
    plan, got = run(cat, IN_STAGE.replace("{op}", op))
    want = ref.execute(
        f"""SELECT m.id, m.name FROM merchants m WHERE m.id {op.upper()}
            (SELECT merchant_id FROM coupons WHERE discount > 55)"""
    ).fetchall()
    if op == "in":
        same(rows(got), want)
        # the stage's values reach the source as a bound list: the filter is pushed
        scan = next(s for s in plan.scans() if s.alias == "m")
        assert [str(f) for f in scan.exact] == ["id in ids"]
    else:
        # ids holds a null: `x not in (..., null)` is never true (SQL)
        assert want == [] and rows(got) == []


def test_not_in_without_nulls(cat, ref) -> None:
    binding = IN_STAGE.replace("{op}", "not in").replace(
        "discount > 55}", "discount > 55 and merchant_id is not null}"
    )
    _, got = run(cat, binding)
    want = ref.execute(
        """SELECT m.id, m.name FROM merchants m WHERE m.id NOT IN (SELECT merchant_id FROM
           coupons WHERE discount > 55 AND merchant_id IS NOT NULL)"""
    ).fetchall()
    same(rows(got), want)


SCALAR = """
binding: above_average
stages:
  avg_amount:
    sources: {o2: {from: memory://t/orders}}
    select: [avg(o2.amount) * 1.9 as a]
sources:
  o:
    from: memory://t/orders
    where: amount > avg_amount.a
select: [o.id, o.amount]
"""


def test_scalar_value_is_pushed_to_the_source(cat, ref) -> None:
    plan, got = run(cat, SCALAR)
    want = ref.execute(
        "SELECT id, amount FROM orders WHERE amount > (SELECT avg(amount) * 1.9 FROM orders)"
    ).fetchall()
    same(rows(got), want)
    scan = next(s for s in plan.scans() if s.alias == "o")
    assert [str(f) for f in scan.exact] == ["amount > avg_amount.a"]


CORRELATED_SCALAR = """
binding: above_sku_average
stages:
  per_sku:
    sources: {o2: {from: memory://t/orders}}
    select: [o2.sku, avg(o2.amount) as a]
    group_by: [o2.sku]
sources:
  o:
    from: memory://t/orders
  s:
    from: stage://per_sku
    join: s.sku = o.sku
    where: o.amount > s.a * 1.8
select: [o.id, o.amount]
"""


def test_correlated_scalar_as_a_joined_grouped_stage(cat, ref) -> None:
    _, got = run(cat, CORRELATED_SCALAR)
    want = ref.execute(
        """SELECT o.id, o.amount FROM orders o WHERE o.amount >
           (SELECT avg(o2.amount) * 1.8 FROM orders o2 WHERE o2.sku = o.sku)"""
    ).fetchall()
    same(rows(got), want)


AGG_OVER_AGG = """
binding: best_user
stages:
  spend:
    sources: {o: {from: memory://t/orders}}
    select: [o.user_id, sum(o.amount) as total]
    group_by: [o.user_id]
  best:
    sources: {s2: {from: stage://spend}}
    select: [max(s2.total) as top]
sources:
  s:
    from: stage://spend
    where: total = best.top
select: [s.user_id, s.total]
"""


def test_aggregate_over_aggregate_with_a_stage_read_twice(cat, ref) -> None:
    plan, got = run(cat, AGG_OVER_AGG)
    want = ref.execute(
        """WITH spend AS (SELECT user_id, sum(amount) AS total FROM orders GROUP BY user_id)
           SELECT user_id, total FROM spend WHERE total = (SELECT max(total) FROM spend)"""
    ).fetchall()
    same(rows(got), want)
    assert isinstance(plan, N.WithStages)
    assert [s.name for s in plan.stages] == ["spend", "best"]
    # spend is read twice and computed once
    assert sum(isinstance(n, N.StageResult) for n in plan.walk()) == 2


HAVING = """
binding: busy_categories
sources:
  o: {from: memory://t/orders}
  k:
    from: memory://t/categories
    join: k.sku = o.sku
select: [k.category, sum(o.amount) as spent]
group_by: [k.category]
having: count(*) > 400 and spent > 40000 and max(o.amount) > 199
order_by: spent desc
"""


def test_having_with_alias_and_unselected_aggregates(cat, ref) -> None:
    _, got = run(cat, HAVING)
    want = ref.execute(
        """SELECT k.category, sum(o.amount) AS spent FROM orders o JOIN categories k
           ON k.sku = o.sku GROUP BY k.category
           HAVING count(*) > 400 AND sum(o.amount) > 40000 AND max(o.amount) > 199
           ORDER BY spent DESC"""
    ).fetchall()
    assert [r[0] for r in rows(got)] == [r[0] for r in want]
    same(rows(got), want)


def test_text_form_runs_the_same(cat) -> None:
    text = (
        "with avg_amount as (from memory://t/orders as o2 select avg(o2.amount) * 1.9 as a) "
        "from memory://t/orders as o where amount > avg_amount.a select o.id, o.amount"
    )
    _, a = run(cat, text, text=True)
    _, b = run(cat, SCALAR)
    assert rows(a) == rows(b)


def test_stage_value_with_several_rows_at_run_time_is_an_error(cat) -> None:
    binding = """
binding: two_rows
stages:
  firsts:
    sources: {o2: {from: memory://t/orders}}
    select: [o2.amount as a]
    limit: 1
sources:
  o:
    from: memory://t/orders
    where: amount > firsts.a
select: [o.id]
"""
    _, got = run(cat, binding)  # limit 1: one row, fine
    assert got.num_rows > 0
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    # a stage that returns several rows where one value is needed fails loudly (never a
    # wrong answer): the same stage without its limit, put in after planning
    every = N.Project(world.scan(cat, "o2", "orders"), (("a", world.C("o2.amount"), pa.float64()),))
    broken = plan.with_children(N.Stage(every, "firsts"), plan.input)
    with pytest.raises(QueryError, match=r"returned .* rows"):
        execute(broken, {}, cat, binding="two_rows")


CASE_AGG = """
binding: share_of_big_orders
sources:
  o:
    from: memory://t/orders
    where: case when amount > 100 then sku < 100 else sku < 50 end
  k:
    from: memory://t/categories
    join: k.sku = o.sku
select:
  - k.category
  - "100.0 * sum(case when o.amount > 150 then o.amount else 0 end) / sum(o.amount) as share"
  - "sum(case when k.category like 'cat1%' then 1 else 0 end) as ones"
group_by: [k.category]
"""


def test_case_in_a_pushed_filter_and_in_aggregates(cat, ref) -> None:
    plan, got = run(cat, CASE_AGG)
    want = ref.execute(
        """SELECT k.category, 100.0 * sum(CASE WHEN o.amount > 150 THEN o.amount ELSE 0 END)
           / sum(o.amount), sum(CASE WHEN k.category LIKE 'cat1%' THEN 1 ELSE 0 END)
           FROM orders o JOIN categories k ON k.sku = o.sku
           WHERE CASE WHEN o.amount > 100 THEN o.sku < 100 ELSE o.sku < 50 END
           GROUP BY k.category"""
    ).fetchall()
    same(rows(got), want)
    scan = next(s for s in plan.scans() if s.alias == "o")
    assert [str(f) for f in scan.exact] == [
        "case when amount > 100 then sku < 100 else sku < 50 end"
    ]


def test_cast_month_intervals_and_date_literals(cat, ref) -> None:
    binding = """
binding: recent
sources:
  o:
    from: memory://t/orders
    where:
      - cast(ordered_at as date) >= date '2026-11-29' - interval '1 month'
      - cast(ordered_at as date) < date '2026-10-31' + interval '1 month'
select: [o.id, "cast(o.amount as int) as whole", "cast(o.ordered_at as date) as day"]
"""
    _, got = run(cat, binding)
    want = ref.execute(
        """SELECT id, CAST(amount AS BIGINT), CAST(ordered_at AS DATE) FROM orders
           WHERE CAST(ordered_at AS DATE) >= DATE '2026-11-29' - INTERVAL 1 MONTH
           AND CAST(ordered_at AS DATE) < DATE '2026-10-31' + INTERVAL 1 MONTH"""
    ).fetchall()
    same(rows(got), want)


def test_like_with_a_pattern_built_from_a_session_value(cat, ref) -> None:
    binding = """
binding: by_name
session: {part: str}
sources:
  m:
    from: memory://t/merchants
    where: "name like '%' || {{session.part}} || '7'"
select: [m.id, m.name]
"""
    _, got = run(cat, binding, {"part": "nt 1"})
    want = ref.execute(
        "SELECT id, name FROM merchants WHERE name LIKE '%' || ? || '7'", ["nt 1"]
    ).fetchall()
    same(rows(got), want)


def test_like_pattern_from_a_session_value_pushed_to_mariadb(mariadb_url: str) -> None:
    """Issue 11: ``like '%' || {{session.c}} || '%'`` failed on a SQL source with the hint
    "check that the server is up and the source exists"; it now runs (the pattern is one
    bound value) and matches DuckDB."""
    import sqlalchemy as sa

    from connectors.sql import SqlConnection
    from fabric.execute.local import LocalCatalog

    eng = sa.create_engine(mariadb_url)
    names = ["alpha", "beta", "alphabet", "gamma", None]
    with eng.begin() as c:
        c.execute(sa.text("CREATE TABLE words (id BIGINT PRIMARY KEY, name VARCHAR(20))"))
        for i, n in enumerate(names):
            c.execute(sa.text("INSERT INTO words VALUES (:i, :n)"), {"i": i, "n": n})
    eng.dispose()
    cat = LocalCatalog({"db": SqlConnection("db", {"url": mariadb_url})})
    binding = """
binding: words
session: {c: str}
sources:
  w:
    from: mysql://db/words
    where: "name like '%' || {{session.c}} || '%'"
select: [w.id]
order_by: w.id
"""
    plan, got = run(cat, binding, {"c": "pha"})
    assert [r[0] for r in rows(got)] == [0, 2]
    con = duckdb.connect()
    con.register("words", pa.table({"id": range(5), "name": names}))
    assert con.execute(
        "SELECT id FROM words WHERE name LIKE '%' || ? || '%' ORDER BY id", ["pha"]
    ).fetchall() == [(0,), (2,)]
    # pushed to MariaDB as one bound pattern
    assert [str(f) for f in plan.scans()[0].exact] == ["name like '%' || {{session.c}} || '%'"]


def test_a_filter_a_source_cannot_translate_is_not_blamed_on_the_server(tables) -> None:
    """A source that accepted a filter at planning but cannot translate it when scanning
    (the case of issue 11's non-constant LIKE pattern) gets a hint about the filter, not
    "check that the server is up"."""
    from connectors.arrow_expr import NotTranslatable
    from connectors.memory import MemorySource

    class Forgetful(MemorySource):
        def scan(self, request):
            raise NotTranslatable(f"cannot translate {request.filters[0]}")

    cat = world.catalog(tables, words=Forgetful("memory://t/words", tables["merchants"]))
    binding = """
binding: words
session: {c: str}
sources:
  w:
    from: memory://t/words
    where: "name like '%' || {{session.c}} || '%'"
select: [w.id]
"""
    with pytest.raises(QueryError) as info:
        run(cat, binding, {"c": "x"})
    text = str(info.value) + str(getattr(info.value, "hint", ""))
    assert "server is up" not in text
    assert "name like" in text and "filter" in text


def test_month_intervals_over_columns_and_extract_from(cat, ref) -> None:
    """``ts + interval '1 month 2 days'`` over a column (pyarrow adds no months: DuckDB
    computes it) and SQL's ``extract(year from ts)``."""
    binding = """
binding: later
sources:
  o:
    from: memory://t/orders
    where: cast(ordered_at as date) + interval '1 month' > date '2026-12-20'
    derive: {later: "ordered_at + interval '1 month 2 days'", y: "extract(year from ordered_at)"}
select: [o.id, o.later, o.y]
"""
    plan, got = run(cat, binding)
    want = ref.execute(
        """SELECT id, ordered_at + INTERVAL '1 month 2 days', extract(year FROM ordered_at)
           FROM orders WHERE CAST(ordered_at AS DATE) + INTERVAL 1 MONTH > DATE '2026-12-20'"""
    ).fetchall()
    same(rows(got), want)
    assert "interval '1 month 2 days'" in plan.explain()


def test_a_stage_value_is_the_query_vector_of_the_next_step() -> None:
    """Multi-hop in one plan (issue 17's shape): step 1 reads one row's embedding, step 2
    searches its nearest neighbours; checked against numpy brute force."""
    import numpy as np

    from connectors.dataset import DatasetSource
    from fabric.execute.local import LocalCatalog
    from indexes.dataset import Dataset

    rng = np.random.default_rng(5)
    n, d = 300, 8
    vecs = rng.normal(size=(n, d)).astype(np.float32)
    symbols = rng.choice(["AAPL", "NVDA"], n)
    schema = pa.schema(
        [("id", pa.int64()), ("symbol", pa.string()), ("embedding", pa.list_(pa.float32(), d))]
    )
    ds = Dataset.create("news", schema, "id", {"embedding": {"kind": "hnsw", "metric": "l2"}})
    ds.upsert(
        pa.table(
            {
                "id": pa.array(range(n), pa.int64()),
                "symbol": symbols,
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), d),
            },
            schema=schema,
        )
    )
    cat = LocalCatalog({}, datasets={"news": DatasetSource("dataset://news", ds)})
    binding = """
binding: more_like_this
session: {id: int}
stages:
  seed:
    sources:
      n0: {from: dataset://news, where: "id = {{session.id}}"}
    select: [n0.embedding]
    limit: 1
sources:
  n:
    from: dataset://news
    nearest: {column: embedding, to: seed.embedding, k: 5}
    where: symbol = 'NVDA'
select: [n.id]
"""
    _, got = run(cat, binding, {"id": 17})
    dist = ((vecs - vecs[17]) ** 2).sum(axis=1)
    want = [int(i) for i in np.argsort(np.where(symbols == "NVDA", dist, np.inf))[:5]]
    assert got.column("id").to_pylist() == want


def test_decimal_and_interval_session_values(cat, ref, mariadb_url: str) -> None:
    """``decimal(p,s)`` and ``interval`` session values: coerced when bound, compared
    exactly, pushed to MariaDB as bound values, and equal to DuckDB."""
    import datetime as dt
    import decimal

    import sqlalchemy as sa

    from connectors.sql import SqlConnection
    from dsl.types import bind_session
    from fabric.execute.local import LocalCatalog

    spec = load_text(
        """
binding: recent_big
session: {min: "decimal(10,2)", window: interval}
sources:
  o:
    from: mysql://db/sales
    where: ["amount >= {{session.min}}", "sold_at > timestamp '2024-06-01T00:00:00Z' - {{session.window}}"]
select: [o.id]
order_by: o.id
"""
    )[0]
    values = bind_session(spec.session_types, {"min": "10.25", "window": "3 days"})
    assert values == {"min": decimal.Decimal("10.25"), "window": dt.timedelta(days=3)}
    t0 = dt.datetime(2024, 6, 1, tzinfo=dt.UTC)
    data = pa.table(
        {
            "id": pa.array(range(8), pa.int64()),
            "amount": pa.array(
                [decimal.Decimal(x) for x in ("10.24", "10.25", "10.26", "99.00")] * 2,
                pa.decimal128(10, 2),
            ),
            "sold_at": pa.array(
                [t0 - dt.timedelta(days=d) for d in (1, 2, 3, 4, 5, 1, 2, 10)],
                pa.timestamp("us", "UTC"),
            ),
        }
    )
    eng = sa.create_engine(mariadb_url)
    with eng.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE sales (id BIGINT PRIMARY KEY, amount DECIMAL(10,2), sold_at DATETIME(6))"
            )
        )
        for r in data.to_pylist():
            c.execute(
                sa.text("INSERT INTO sales VALUES (:id, :amount, :sold_at)"),
                {**r, "sold_at": r["sold_at"].replace(tzinfo=None)},
            )
    eng.dispose()
    maria = LocalCatalog({"db": SqlConnection("db", {"kind": "mysql", "url": mariadb_url})})
    plan = optimize(build(spec, maria), maria)
    got = execute(plan, values, maria, binding="recent_big").table
    con = duckdb.connect()
    con.register("sales", data)
    want = con.execute(
        "SELECT id FROM sales WHERE amount >= ? AND sold_at > TIMESTAMPTZ '2024-06-01 00:00:00+00' - ? ORDER BY id",
        [decimal.Decimal("10.25"), dt.timedelta(days=3)],
    ).fetchall()
    assert [r[0] for r in rows(got)] == [r[0] for r in want] == [1, 5, 6]
    assert len(plan.scans()[0].exact) == 2  # both pushed


def test_exists_in_having_correlated_on_a_group_key(cat, ref) -> None:
    binding = """
binding: skus_with_big_orders
stages:
  big:
    sources:
      o2: {from: memory://t/orders, where: amount > 195}
    select: [o2.sku]
sources:
  o: {from: memory://t/orders}
select: [o.sku, count(*) as n]
group_by: [o.sku]
having: exists(big where big.sku = o.sku) and count(*) > 20
"""
    _, got = run(cat, binding)
    want = ref.execute(
        """SELECT o.sku, count(*) FROM orders o GROUP BY o.sku
           HAVING EXISTS (SELECT 1 FROM orders o2 WHERE o2.amount > 195 AND o2.sku = o.sku)
           AND count(*) > 20"""
    ).fetchall()
    same(rows(got), want)


GROUPED_JOIN = """
binding: sku_averages_of_a_category
stages:
  per_sku:
    sources: {o2: {from: memory://t/orders}}
    select: [o2.sku, avg(o2.amount) as a, count(*) as n]
    group_by: [o2.sku]
    having: n > 1
sources:
  k:
    from: memory://t/categories
    where: category = 'cat3'
  s:
    from: stage://per_sku
    join: s.sku = k.sku
select: [k.sku, s.a, s.n]
"""


def test_keys_of_a_small_side_reach_the_scan_inside_a_grouped_stage(cat, ref, tables) -> None:
    """A correlated scalar subquery written as a grouped stage joined on its group key:
    the small side's keys are pushed into the stage's scan (below its aggregate), so only
    the groups that can join are read; the answer is unchanged."""
    plan, _ = run(cat, GROUPED_JOIN)
    inner = next(s for s in plan.scans() if s.alias == "o2")
    assert [str(d).split(" max=")[0] for d in inner.dynamic] == ["sku in keys(k.sku)"]
    spec = load_text(GROUPED_JOIN)[0]
    res = execute(plan, {}, cat, binding=spec.name)
    want = ref.execute(
        """SELECT k.sku, s.a, s.n FROM categories k JOIN (SELECT sku, avg(amount) AS a,
           count(*) AS n FROM orders GROUP BY sku HAVING count(*) > 1) s ON s.sku = k.sku
           WHERE k.category = 'cat3'"""
    ).fetchall()
    same(rows(res.table), want)
    needed = ref.execute(
        """SELECT count(*) FROM orders WHERE sku IN
           (SELECT sku FROM categories WHERE category = 'cat3')"""
    ).fetchone()[0]
    assert res.stats["sources"]["o2"]["rows"] == needed < tables["orders"].num_rows


def test_like_with_a_column_pattern_across_a_join(cat, ref) -> None:
    """A LIKE pattern built from another source's column (not a constant): no source can
    apply it, the fabric does (DuckDB above the join)."""
    binding = """
binding: prefix_match
sources:
  k:
    from: memory://t/categories
    where: sku < 20
  o:
    from: memory://t/orders
    join: o.sku = k.sku
    where: "cast(o.user_id as str) like substring(k.category, 4) || '%'"
select: [o.id, k.category]
"""
    _, got = run(cat, binding)
    want = ref.execute(
        """SELECT o.id, k.category FROM categories k JOIN orders o ON o.sku = k.sku
           WHERE k.sku < 20 AND CAST(o.user_id AS VARCHAR) LIKE substring(k.category, 4) || '%'"""
    ).fetchall()
    same(rows(got), want)


CORRELATED = """
binding: skus_of_a_category_with_orders
stages:
  big:
    sources:
      o: {from: memory://t/orders, where: amount > 20}
    select: [o.user_id, o.sku]
sources:
  c:
    from: memory://t/categories
    where: [category = 'cat3', "exists(big where big.sku = c.sku and big.user_id < 25)"]
select: [c.sku, c.category]
"""


@pytest.fixture(scope="module")
def null_keys(tables):
    """orders and categories with NULL skus on both sides of the correlation."""
    t = dict(tables)
    for name in ("orders", "categories"):
        tab = t[name]
        skus = tab.column("sku").to_pylist()
        for i in range(0, len(skus), 7):
            skus[i] = None
        i = tab.schema.get_field_index("sku")
        t[name] = tab.set_column(i, "sku", pa.array(skus, tab.schema.field("sku").type))
    con = duckdb.connect()
    for name, tab in t.items():
        con.register(name, tab)
    return t, world.catalog(t), con


@pytest.mark.parametrize("neg", ["", "not "])
def test_correlation_keys_of_exists_reach_the_stage_scan(null_keys, neg: str) -> None:
    """``exists(S where S.k = x.k ...)`` and its negation: the keys of x.k (once x's unit
    is done) are pushed into the stage's scan, which then reads only the rows that can
    match; the answer is DuckDB's, with NULL keys on both sides."""
    tables, cat, con = null_keys
    binding = CORRELATED.replace('"exists(', f'"{neg}exists(')
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    inner = next(s for s in plan.scans() if s.alias == "o")
    assert [str(d).split(" max=")[0] for d in inner.dynamic] == ["sku in keys(c.sku)"]
    res = execute(plan, {}, cat, binding=spec.name)
    want = con.execute(
        f"""SELECT c.sku, c.category FROM categories c WHERE c.category = 'cat3' AND
           {neg.upper()}EXISTS (SELECT 1 FROM orders o WHERE o.amount > 20 AND
           o.sku = c.sku AND o.user_id < 25)"""
    ).fetchall()
    same(rows(res.table), want)
    needed = con.execute(
        """SELECT count(*) FROM orders WHERE amount > 20 AND sku IN
           (SELECT sku FROM categories WHERE category = 'cat3')"""
    ).fetchone()[0]
    assert res.stats["sources"]["o"]["rows"] == needed < tables["orders"].num_rows


def test_a_stage_used_twice_keeps_all_its_rows(cat, ref) -> None:
    """The stage is used by a second exists that is not correlated on the key: its scan
    is not reduced (the second one needs all its rows)."""
    binding = CORRELATED.replace("category = 'cat3'", "not exists(big where big.user_id = -1)")
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    assert not next(s for s in plan.scans() if s.alias == "o").dynamic
    got = execute(plan, {}, cat, binding=spec.name).table
    want = ref.execute(
        """SELECT c.sku, c.category FROM categories c WHERE EXISTS (SELECT 1 FROM orders o
           WHERE o.amount > 20 AND o.sku = c.sku AND o.user_id < 25)"""
    ).fetchall()
    same(rows(got), want)


TWO_STAGES = """
binding: skus_bought_by_a_low_user_and_no_late_high_user
stages:
  floor:
    sources: {o0: {from: memory://t/orders}}
    select: [avg(o0.amount) as a]
  low:
    sources: {o1: {from: memory://t/orders, where: user_id < 10}}
    select: [o1.sku, o1.user_id]
  high:
    sources: {o2: {from: memory://t/orders, where: user_id > 20}}
    select: [o2.sku, o2.amount]
sources:
  c:
    from: memory://t/categories
    where:
      - category = 'cat3'
      - sku > floor.a - 1000
      - exists(low where low.sku = c.sku and low.user_id != c.sku)
      - not exists(high where high.sku = c.sku and high.amount > 190)
select: [c.sku, c.category]
"""
TWO_STAGES_SQL = """SELECT c.sku, c.category FROM categories c WHERE c.category = 'cat3'
    AND c.sku > (SELECT avg(amount) FROM orders) - 1000
    AND EXISTS (SELECT 1 FROM orders o WHERE o.user_id < 10 AND o.sku = c.sku
                AND o.user_id != c.sku)
    AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.user_id > 20 AND o.sku = c.sku
                    AND o.amount > 190)"""


def test_exists_and_not_exists_of_two_stages_in_one_filter(null_keys) -> None:
    """Q21's shape (both in one filter) and Q22's (the outer scan uses an earlier stage's
    value): both stages' scans take the keys of c.sku; the answer is DuckDB's."""
    tables, cat, con = null_keys
    spec = load_text(TWO_STAGES)[0]
    plan = optimize(build(spec, cat), cat)
    for alias in ("o1", "o2"):
        scan = next(s for s in plan.scans() if s.alias == alias)
        assert [str(d).split(" max=")[0] for d in scan.dynamic] == ["sku in keys(c.sku)"]
    res = execute(plan, {}, cat, binding=spec.name)
    want = con.execute(TWO_STAGES_SQL).fetchall()
    same(rows(res.table), want)
    assert res.stats["sources"]["o1"]["rows"] < tables["orders"].num_rows // 2


def test_a_grouped_stage_correlated_on_an_aggregate_keeps_all_its_rows(cat, ref) -> None:
    """exists over a grouped stage correlated on an aggregate, not a group key: keeping
    some rows would change the aggregate, so nothing is pushed."""
    binding = """
binding: categories_matching_an_order_count
stages:
  per_user:
    sources: {o: {from: memory://t/orders}}
    select: [o.user_id, count(*) as n]
    group_by: [o.user_id]
sources:
  c:
    from: memory://t/categories
    where: exists(per_user where per_user.n = c.sku)
select: [c.sku]
"""
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    assert not next(s for s in plan.scans() if s.alias == "o").dynamic
    got = execute(plan, {}, cat, binding=spec.name).table
    want = ref.execute(
        """SELECT c.sku FROM categories c WHERE EXISTS (SELECT 1 FROM (SELECT user_id,
           count(*) AS n FROM orders GROUP BY user_id) p WHERE p.n = c.sku)"""
    ).fetchall()
    same(rows(got), want)


def test_no_keys_from_a_unit_that_waits_on_a_later_stage(null_keys) -> None:
    """The outer scan uses the value of a stage that runs after the exists' stage: taking
    its keys would make the stage wait on a unit waiting on a later stage, so nothing is
    pushed (and the query still runs)."""
    _, cat, con = null_keys
    binding = TWO_STAGES.replace(
        """  floor:
    sources: {o0: {from: memory://t/orders}}
    select: [avg(o0.amount) as a]
""",
        "",
    ).replace(
        "sources:\n  c:",
        "  floor:\n    sources: {o0: {from: memory://t/orders}}\n"
        "    select: [avg(o0.amount) as a]\nsources:\n  c:",
    )
    spec = load_text(binding)[0]
    plan = optimize(build(spec, cat), cat)
    assert [s.name for s in plan.stages] == ["low", "high", "floor"]
    assert not any(s.dynamic for s in plan.scans())
    same(
        rows(execute(plan, {}, cat, binding=spec.name).table),
        con.execute(TWO_STAGES_SQL).fetchall(),
    )
