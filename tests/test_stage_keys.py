"""A join side computed from stages alone keys the other side's scan (a semi-join,
fabric/optimizer/stage_keys.py): TPC-H Q15 read all suppliers for the one top supplier.
The answer equals DuckDB's over the same tables, and the scan returns only the rows
whose key the stage side holds. Explain-text fixtures: tests/fixtures/optimizer/stage_keys/.
"""

from __future__ import annotations

import pathlib

import duckdb
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "optimizer" / "stage_keys"
REF = """
WITH spend AS (SELECT user_id, sum(amount) AS spent FROM orders GROUP BY user_id)
SELECT m.id, m.amount FROM orders m JOIN spend s ON s.user_id = m.user_id
WHERE s.spent = (SELECT max(spent) FROM spend) ORDER BY m.id
"""


@pytest.mark.parametrize("rules", ["all", "without stage_keys"])
def test_stage_side_keys_the_scan_and_the_answer_is_duckdbs(rules: str) -> None:
    text = (FIXTURE / "top_spender.yaml").read_text().partition("---- optimized\n")[0]
    cat = world.catalog()
    spec = load_text(text, "top_spender.yaml")[0]
    chosen = (
        opt.RULES if rules == "all" else tuple(r for r in opt.RULES if r.__name__ != "stage_keys")
    )
    plan = opt.optimize(build(spec, cat), cat, rules=chosen)
    res = execute(plan, {}, cat, binding=spec.name, now=world.NOW)
    con = duckdb.connect()
    con.register("orders", world.make_tables()["orders"])
    want = con.sql(REF).fetchall()
    got = sorted(zip(res.table.column("id").to_pylist(), res.table.column("amount").to_pylist()))
    assert got == [tuple(r) for r in want]
    fetched = res.stats["sources"]["m"]["rows"]
    if rules == "all":
        assert fetched == len(want), "the scan was not keyed by the stage side"
    else:
        assert fetched == world.make_tables()["orders"].num_rows
