"""A scan bounded by the values it is compared with in a join (fabric/optimizer/join_bounds.py,
fabric/execute/bounds.py): TPC-H Q17's lineitem read 555 rows for 43 (its 18 parts' rows;
``l_quantity < a.qty_limit`` was left to the join). The answers equal DuckDB's over the
same tables on random data (NULL keys and values, duplicates, an empty stage, an empty
side), with and without the rule, and the bounded scan reads fewer rows.
Explain-text fixtures: tests/fixtures/optimizer/join_bounds/.
"""

from __future__ import annotations

import decimal

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from dsl.loader import load_text
from fabric.execute import execute
from fabric.execute.bounds import pushed
from fabric.plan.builder import build

STAGE = """
binding: below_half_average
stages:
  lim:
    sources:
      o2: {from: memory://t/sales}
    select: [o2.sku, 0.5 * avg(o2.id) as lim]
    group_by: [o2.sku]
sources:
  k:
    from: memory://t/categories
    where: category = 'cat3'
  o: {from: memory://t/orders, join: o.sku = k.sku}
  a:
    from: stage://lim
    join: a.sku = k.sku
    where: o.id < a.lim
select: [o.id, o.sku, a.lim]
"""
STAGE_REF = """
WITH lim AS (SELECT sku, 0.5 * avg(id) AS lim FROM orders GROUP BY sku)
SELECT o.id, o.sku, a.lim FROM categories k JOIN orders o ON o.sku = k.sku
JOIN lim a ON a.sku = k.sku AND o.id < a.lim WHERE k.category = 'cat3'
"""
DIRECT = """
binding: coupons_above_their_merchant
sources:
  m:
    from: memory://t/merchants
    where: status = 'active' and id < 40
  c:
    from: memory://t/coupons
    join: c.merchant_id = m.id and c.discount <= m.id
select: [c.id, c.discount, m.id as mid]
"""
DIRECT_REF = """
SELECT c.id, c.discount, m.id AS mid FROM merchants m JOIN coupons c
ON c.merchant_id = m.id AND c.discount <= m.id WHERE m.status = 'active' AND m.id < 40
"""


def _run(binding: str, tables: dict[str, pa.Table], with_rule: bool):
    cat = world.catalog(tables)
    spec = load_text(binding, "bounds.yaml")[0]
    rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r.__name__ != "join_bounds")
    plan = opt.optimize(build(spec, cat), cat, rules=rules)
    return plan, execute(plan, {}, cat, binding=spec.name, now=world.NOW)


def _reference(sql: str, tables: dict[str, pa.Table]) -> list[tuple]:
    con = duckdb.connect()
    for name in ("categories", "orders", "merchants", "coupons"):
        con.register(name, tables[name])
    return sorted(con.sql(sql).fetchall(), key=repr)


def _rows(res) -> list[tuple]:
    t = res.table
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)), key=repr)


def _close(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:-1] == w[:-1] and (g[-1] == w[-1] or abs(g[-1] - w[-1]) <= 1e-9 * abs(w[-1]))


@pytest.mark.parametrize(
    "binding,ref,alias", [(STAGE, STAGE_REF, "o"), (DIRECT, DIRECT_REF, "c")], ids=["stage", "unit"]
)
def test_the_bounded_scan_reads_fewer_rows_and_the_answer_is_duckdbs(
    binding: str, ref: str, alias: str
) -> None:
    tables = world.make_tables()
    want = _reference(ref, tables)
    plan, res = _run(binding, tables, True)
    line = next(x for x in plan.explain().splitlines() if f"Scan: {alias} <-" in x)
    assert " of " in line, line  # the bound is in the plan
    _, base = _run(binding, tables, False)
    _close(_rows(res), want)
    _close(_rows(base), want)
    got, before = res.stats["sources"][alias]["rows"], base.stats["sources"][alias]["rows"]
    assert got < before, f"{alias} read {got} rows with the bound, {before} without"


def _random(seed: int, n_sku: int, n_orders: int, nulls: float) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    base = world.make_tables(seed=seed)

    def ints(n: int, hi: int) -> pa.Array:
        return pa.array(rng.integers(0, max(hi, 1), n), pa.int64(), mask=rng.random(n) < nulls)

    sku = ints(n_sku * 2, n_sku)  # each sku about twice (duplicates), some NULL
    categories = pa.table(
        {"sku": sku, "category": [f"cat{int(c)}" for c in rng.integers(0, 4, len(sku))]}
    )
    orders = base["orders"].slice(0, n_orders)
    orders = orders.set_column(0, "id", ints(n_orders, 10 * n_orders))
    orders = orders.set_column(orders.schema.get_field_index("sku"), "sku", ints(n_orders, n_sku))
    coupons = base["coupons"]
    coupons = coupons.set_column(
        coupons.schema.get_field_index("discount"), "discount", ints(coupons.num_rows, 60)
    )
    return {**base, "categories": categories, "orders": orders, "coupons": coupons}


@pytest.mark.parametrize(
    "seed,n_sku,n_orders,nulls",
    [
        (1, 200, 5000, 0.0),
        (2, 200, 5000, 0.2),  # NULL keys, ids and discounts
        (3, 20, 3000, 0.05),  # few skus: many duplicates
        (4, 200, 0, 0.0),  # no orders: the stage and o are empty
        (5, 1, 400, 0.5),  # one sku
        (6, 0, 300, 0.0),  # every key 0
    ],
)
def test_random_tables_give_duckdbs_answer_with_and_without_the_rule(
    seed: int, n_sku: int, n_orders: int, nulls: float
) -> None:
    tables = _random(seed, n_sku, n_orders, nulls)
    for binding, ref in ((STAGE, STAGE_REF), (DIRECT, DIRECT_REF)):
        want = _reference(ref, tables)
        for with_rule in (True, False):
            _, res = _run(binding, tables, with_rule)
            _close(_rows(res), want)


D = decimal.Decimal


@pytest.mark.parametrize(
    "op,values,typ,want",
    [
        # never strict, rounded outwards to the column's scale: c < 6.26 keeps c = 6.26?
        # no, but the pushed c <= 6.27 keeps every row c < 6.26 keeps, however computed
        ("<", pa.array([6.260000000000001, 1.5]), pa.decimal128(15, 2), ("<=", D("6.27"))),
        (
            "<=",
            pa.array([D("6.26")], pa.decimal128(10, 2)),
            pa.decimal128(15, 2),
            ("<=", D("6.27")),
        ),
        (">", pa.array([2.5, 7.0]), pa.decimal128(15, 2), (">=", D("2.49"))),
        ("<", pa.array([4.0]), pa.int64(), ("<=", 5)),
        (">=", pa.array([-3], pa.int64()), pa.int32(), (">=", -4)),
        ("<", pa.array([1.0, float("nan")]), pa.decimal128(15, 2), None),  # NaN: c < NaN holds
        ("<", pa.array([float("inf")]), pa.int64(), None),
        ("<", pa.array([1e30]), pa.int32(), None),  # past the column type's range
        ("<", pa.array(["x"]), pa.int64(), None),
        ("<", pa.array([1.0]), pa.float64(), None),  # a float column may hold NaN
    ],
)
def test_the_pushed_bound_never_drops_a_row_the_join_keeps(op, values, typ, want) -> None:
    assert pushed(op, values, typ) == want
