"""A filter on a derived column is pushed as the expression computing it
(fabric/optimizer/push_filters.py ``_inlined``): TPC-H Q22's customer read 6,749 rows for
641 because ``cntrycode in {{session.codes}}`` (cntrycode = substring(c_phone, 1, 2))
stayed above the Derive; the same filter in the stage next to it was pushed. The answer
is the same pushed or applied by the fabric, on names with NULLs, empty and non-ASCII
strings. Explain-text fixture: tests/fixtures/optimizer/push_filters/derived_column.yaml.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from dsl.loader import load_text
from fabric.execute import execute
from fabric.plan.builder import build

BINDING = """
binding: merchants_by_prefix
session:
  prefixes: list[str]
sources:
  m:
    from: memory://t/merchants
    derive:
      prefix: substring(name, 2, 3)
    where: prefix in {{session.prefixes}}
select: [m.id, m.prefix]
"""


def _run(tables, pushed: bool, prefixes: list[str]):
    cat = world.catalog(tables)
    spec = load_text(BINDING, "prefix.yaml")[0]
    plan = build(spec, cat)
    if pushed:
        plan = opt.optimize(plan, cat)
    res = execute(plan, {"prefixes": prefixes}, cat, binding=spec.name, now=world.NOW)
    rows = sorted(zip(res.table.column("id").to_pylist(), res.table.column("prefix").to_pylist()))
    return plan, res, rows


def test_the_derived_filter_reaches_the_scan() -> None:
    tables = world.make_tables()
    plan, _, rows = _run(tables, True, ["erc"])
    scan = next(x for x in plan.explain().splitlines() if "Scan: m" in x)
    assert "substring(name, 2, 3) in {{session.prefixes}}" in scan, scan
    _, _, want = _run(tables, False, ["erc"])
    assert rows == want and len(rows) == tables["merchants"].num_rows
    tables2 = dict(tables)
    names = [f"x{i}" if i % 10 else f"merchant {i}" for i in range(tables["merchants"].num_rows)]
    tables2["merchants"] = tables["merchants"].set_column(1, "name", pa.array(names))
    _, res2, rows2 = _run(tables2, True, ["erc"])
    _, _, want2 = _run(tables2, False, ["erc"])
    assert rows2 == want2
    assert res2.stats["sources"]["m"]["rows"] == len(want2) < tables2["merchants"].num_rows


@pytest.mark.parametrize("prefixes", [["erc"], ["", "é"], ["xx", "erc", "ér"], []])
def test_pushed_or_not_the_answer_is_the_same(prefixes: list[str]) -> None:
    tables = world.make_tables()
    n = tables["merchants"].num_rows
    odd = [None, "", "é", "aéé", "ér", "xx", "m", "merchant"]
    names = [odd[i % len(odd)] if i % 3 == 0 else f"merchant {i}" for i in range(n)]
    tables["merchants"] = tables["merchants"].set_column(1, "name", pa.array(names, pa.string()))
    assert _run(tables, True, prefixes)[2] == _run(tables, False, prefixes)[2]
