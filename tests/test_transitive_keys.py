"""A scan keyed through an equality inside the other side (fabric/optimizer/dynamic_filters.py,
``_equivalents``): TPC-H Q9 read all 80,000 partsupp rows for 4,299 because its join side
(lineitem x part) was too big to key it, though that side's l_partkey = p_partkey. The
answer equals DuckDB's over the same tables, on random data with NULL keys, duplicate
keys and empty sides; the scan returns only rows whose key the small source holds.
Explain-text fixture: tests/fixtures/optimizer/dynamic_filters/transitive_keys.yaml.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build

BINDING = """
binding: category_pairs
sources:
  k:
    from: memory://t/categories
    where: category = 'cat3'
  o:
    from: memory://t/orders
    join: o.sku = k.sku
  c2:
    from: memory://t/categories
    join: c2.sku = o.sku
select: [o.id, c2.category, k.sku]
"""
REF = """
SELECT o.id, c2.category, k.sku FROM categories k JOIN orders o ON o.sku = k.sku
JOIN categories c2 ON c2.sku = o.sku WHERE k.category = 'cat3'
"""


def _tables(seed: int, n_sku: int, n_orders: int, null_share: float) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    base = world.make_tables(n_orders=max(n_orders, 1), seed=seed)

    def keys(n: int) -> pa.Array:
        v = rng.integers(0, max(n_sku, 1), n)
        return pa.array(v, pa.int64(), mask=rng.random(n) < null_share)

    # duplicate skus in categories (each sku up to 3 times, some categories differ)
    cat_sku = keys(n_sku * 2)
    categories = pa.table(
        {
            "sku": cat_sku,
            "category": [f"cat{int(c)}" for c in rng.integers(0, 4, len(cat_sku))],
        }
    )
    orders = base["orders"].slice(0, n_orders)
    orders = orders.set_column(orders.schema.get_field_index("sku"), "sku", keys(n_orders))
    return {**base, "categories": categories, "orders": orders}


def _run(tables: dict[str, pa.Table], rules: str):
    cat = world.catalog(tables)
    spec = load_text(BINDING, "category_pairs.yaml")[0]
    chosen = (
        opt.RULES
        if rules == "all"
        else tuple(r for r in opt.RULES if r.__name__ != "dynamic_filters")
    )
    plan = opt.optimize(build(spec, cat), cat, rules=chosen)
    return plan, execute(plan, {}, cat, binding=spec.name, now=world.NOW)


def _reference(tables: dict[str, pa.Table]) -> list[tuple]:
    con = duckdb.connect()
    for name in ("categories", "orders"):
        con.register(name, tables[name])
    return sorted(con.sql(REF).fetchall(), key=repr)


def _rows(res) -> list[tuple]:
    t = res.table
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)), key=repr)


def test_the_far_scan_is_keyed_by_the_small_source_and_the_answer_is_duckdbs() -> None:
    tables = world.make_tables()
    plan, res = _run(tables, "all")
    c2 = next(line for line in plan.explain().splitlines() if "Scan: c2" in line)
    assert "dynamic=[sku in keys(k.sku)" in c2, c2
    want = _reference(tables)
    assert _rows(res) == want
    needed = len({r[2] for r in want})
    fetched = res.stats["sources"]["c2"]["rows"]
    assert fetched == needed, f"c2 read {fetched} rows for the {needed} skus of cat3"


@pytest.mark.parametrize(
    "seed,n_sku,n_orders,null_share",
    [
        (1, 200, 5000, 0.0),
        (2, 200, 5000, 0.2),  # NULL keys on every side
        (3, 30, 4000, 0.1),  # few keys: many duplicates
        (4, 200, 0, 0.0),  # no orders: the middle side is empty
        (5, 1, 500, 0.5),  # one sku, half NULL
        (6, 0, 300, 0.0),  # one key value (0) everywhere
    ],
)
def test_random_tables_give_duckdbs_answer_with_and_without_the_rule(
    seed: int, n_sku: int, n_orders: int, null_share: float
) -> None:
    tables = _tables(seed, n_sku, n_orders, null_share)
    want = _reference(tables)
    for rules in ("all", "without dynamic_filters"):
        _, res = _run(tables, rules)
        assert _rows(res) == want, rules
