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
