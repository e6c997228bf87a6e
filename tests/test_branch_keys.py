"""Per-branch keys for an OR across two sources (fabric/optimizer/branch_keys.py).

TPC-H Q19 joins part and lineitem on the part key under an OR of three AND-groups, each
with conditions on part and on lineitem. One key list (part's keys of any group) plus
the OR of lineitem's conditions lets a lineitem row through when its part is of group 1
and its quantity of group 2 (25 rows fetched for 10 needed at SF 0.1). Keyed per branch,
``(l_partkey in keys(p where group 1) and group 1's lineitem conditions) or ...``, the
scan returns exactly the rows some branch joins. The answer equals DuckDB's over the
same tables on random data (NULL keys and values, an empty branch, a branch with no
condition on one side), with and without the rule. Explain-text fixture:
tests/fixtures/optimizer/branch_keys/q19_shape.yaml.
"""

from __future__ import annotations

import re

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build

# each: (where over p and i, the rows every branch shares)
WHERES = {
    "q19": """
      (p.brand = {{session.b1}} and p.size between 1 and 5
        and i.q >= {{session.q1}} and i.q <= {{session.q1}} + 10 and i.mode = 'AIR')
      or (p.brand = {{session.b2}} and p.size between 1 and 10
        and i.q >= {{session.q2}} and i.q <= {{session.q2}} + 10 and i.mode = 'AIR')
      or (p.brand = {{session.b3}} and p.size between 1 and 15
        and i.q >= {{session.q3}} and i.q <= {{session.q3}} + 10 and i.mode = 'AIR')""",
    # a branch with no condition on p: its keys are every key of p's unit
    "no_p_condition": """
      (p.brand = {{session.b1}} and i.q >= {{session.q1}} and i.q <= {{session.q1}} + 10)
      or (i.q >= {{session.q3}} and i.mode = 'RAIL')""",
    # a branch with no condition on i: that branch is its keys alone
    "no_i_condition": """
      (p.brand = {{session.b1}} and i.q < {{session.q1}})
      or (p.brand = {{session.b2}} and p.size > 10)
      or (p.size < 3 and i.mode = 'AIR')""",
}


def _binding(where: str) -> str:
    return f"""
binding: branchy
session: {{b1: str, b2: str, b3: str, q1: int, q2: int, q3: int}}
sources:
  i: {{from: memory://t/items}}
  p:
    from: memory://t/parts
    join: p.k = i.pk
    where: >-
{where}
select: [i.id, p.k, i.q]
"""


def _reference_sql(where: str) -> str:
    sql_where = re.sub(r"\{\{session\.(\w+)\}\}", r"$\1", where)
    return f"SELECT i.id, p.k, i.q FROM items i JOIN parts p ON p.k = i.pk WHERE {sql_where}"


def _tables(seed: int, n_parts: int, n_items: int, null_share: float) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)

    def col(values, typ):
        return pa.array(values, typ, mask=rng.random(len(values)) < null_share)

    parts = pa.table(
        {
            "k": col(np.arange(n_parts), pa.int64()),
            "brand": col([f"B{int(b)}" for b in rng.integers(0, 5, n_parts)], pa.string()),
            "size": col(rng.integers(1, 20, n_parts), pa.int64()),
        }
    )
    items = pa.table(
        {
            "id": pa.array(np.arange(n_items), pa.int64()),
            "pk": col(rng.integers(0, max(n_parts, 1), n_items), pa.int64()),
            "q": col(rng.integers(1, 50, n_items), pa.int64()),
            "mode": col(rng.choice(["AIR", "RAIL", "SHIP"], n_items), pa.string()),
        }
    )
    return {**world.make_tables(), "parts": parts, "items": items}


SESSION = {"b1": "B1", "b2": "B2", "b3": "B3", "q1": 1, "q2": 10, "q3": 20}


def _run(tables: dict[str, pa.Table], where: str, session: dict, with_rule: bool):
    cat = world.catalog(tables)
    spec = load_text(_binding(where), "branchy.yaml")[0]
    rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r.__name__ != "branch_keys")
    plan = opt.optimize(build(spec, cat), cat, rules=rules)
    return plan, execute(plan, session, cat, binding=spec.name, now=world.NOW)


def _reference(tables: dict[str, pa.Table], where: str, session: dict) -> list[tuple]:
    con = duckdb.connect()
    for name in ("parts", "items"):
        con.register(name, tables[name])
    used = {k: v for k, v in session.items() if "{{session." + k + "}}" in where}
    return sorted(con.execute(_reference_sql(where), used).fetchall(), key=repr)


def _rows(res) -> list[tuple]:
    t = res.table
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)), key=repr)


@pytest.mark.parametrize("shape", sorted(WHERES))
def test_the_scan_is_keyed_per_branch_and_reads_only_the_rows_a_branch_joins(shape) -> None:
    tables = _tables(1, 300, 6000, 0.0)
    where = WHERES[shape]
    plan, res = _run(tables, where, SESSION, with_rule=True)
    scan = next(line for line in plan.explain().splitlines() if "Scan: i" in line)
    assert "(pk in keys(p.k where " in scan, scan
    want = _reference(tables, where, SESSION)
    assert _rows(res) == want
    needed = len({r[0] for r in want})
    fetched = res.stats["sources"]["i"]["rows"]
    assert fetched == needed, f"{shape}: items read {fetched} rows for {needed} needed"


@pytest.mark.parametrize(
    "seed,n_parts,n_items,null_share,session",
    [
        (1, 300, 6000, 0.0, SESSION),
        (2, 300, 6000, 0.2, SESSION),  # NULL keys, brands, sizes, quantities, modes
        (3, 300, 6000, 0.1, {**SESSION, "b2": "none"}),  # branch 2 matches no part
        (4, 300, 6000, 0.0, {**SESSION, "b1": "none", "b2": "none", "b3": "none"}),
        (5, 40, 3000, 0.3, {**SESSION, "q1": 45}),  # few parts, many duplicate keys
        (6, 300, 0, 0.0, SESSION),  # no items
        (7, 0, 2000, 0.0, SESSION),  # no parts: nothing joins
    ],
)
@pytest.mark.parametrize("shape", sorted(WHERES))
def test_random_tables_give_duckdbs_answer_with_and_without_the_rule(
    shape: str, seed: int, n_parts: int, n_items: int, null_share: float, session: dict
) -> None:
    tables = _tables(seed, n_parts, n_items, null_share)
    where = WHERES[shape]
    want = _reference(tables, where, session)
    for with_rule in (True, False):
        _, res = _run(tables, where, session, with_rule)
        assert _rows(res) == want, f"with_rule={with_rule}"
