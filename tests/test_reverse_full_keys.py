"""Keys that are every value of a table, reversed (fabric/optimizer/reverse_full_keys.py).

The shape of TPC-H Q8: suppliers ``s`` keyed by every nation ``n`` (no filter: all of
them), lines ``l`` keyed by the parts ``p`` of one type and, without the rule, by every
supplier, which filters nothing; with it the lines read without the suppliers' keys and
the suppliers are read after the lines, keyed by their supplier keys: as many rows as
the join needs. Random data with NULL supplier and nation keys, no part of the type, and
a left join (the preserved suppliers are not keyed by the lines); the suppliers in
memory and in PostgreSQL: the answer equals DuckDB's with the rule and without it.
Explain-text fixtures: tests/fixtures/optimizer/reverse_full_keys/.
"""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.memory import MemorySource
from dsl.loader import load_text
from fabric.execute import execute
from fabric.physical import plan as physical_plan
from fabric.plan.builder import build
from tests.servers import sql_source

N_NATION, N_SUPP, N_PART, N_LINES = 25, 2000, 4000, 40000


def binding(how: str) -> str:
    return f"""
binding: lines_of_a_type
sources:
  n:
    from: memory://t/n
  s:
    from: memory://t/s
    join: s.nk = n.nk
  l:
    from: memory://t/l
    join: {{on: l.sk = s.sk, how: {how}}}
  p:
    from: memory://t/p
    join: p.pk = l.pk
    where: typ = 'T1'
select: [n.name as nation, s.sk, s.name as supplier, l.id as lid]
"""


def reference(how: str) -> str:
    join = "JOIN" if how == "inner" else "LEFT JOIN"
    return f"""
SELECT n.name, s.sk, s.name, l.id FROM n JOIN s ON s.nk = n.nk
{join} l ON l.sk = s.sk JOIN p ON p.pk = l.pk WHERE p.typ = 'T1'"""


def tables(variant: str, seed: int = 3) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    null = 0.1 if variant == "nulls" else 0.0

    def ints(values: Any) -> pa.Array:
        v = np.asarray(values)
        return pa.array(v, pa.int64(), mask=rng.random(len(v)) < null)

    types = np.array([f"T{i}" for i in range(50)])
    typ = types[rng.integers(0, 50, N_PART)]
    if variant == "no part":
        typ[typ == "T1"] = "T2"
    return {
        "n": pa.table(
            {
                "nk": pa.array(np.arange(N_NATION), pa.int64()),
                "name": [f"N{i}" for i in range(N_NATION)],
            }
        ),
        "s": pa.table(
            {
                "sk": ints(np.arange(N_SUPP)),
                "nk": ints(rng.integers(0, N_NATION, N_SUPP)),
                "name": [f"S{i}" for i in range(N_SUPP)],
            }
        ),
        "p": pa.table({"pk": pa.array(np.arange(N_PART), pa.int64()), "typ": typ.tolist()}),
        "l": pa.table(
            {
                "id": pa.array(np.arange(N_LINES), pa.int64()),
                "pk": pa.array(rng.integers(0, N_PART, N_LINES), pa.int64()),
                "sk": ints(rng.integers(0, N_SUPP, N_LINES)),
            }
        ),
    }


def _run(cat: Any, how: str, with_rule: bool) -> tuple[Any, Any]:
    spec = load_text(binding(how), "lines.yaml")[0]
    rules = (
        opt.RULES if with_rule else tuple(r for r in opt.RULES if r.__name__ != "reverse_full_keys")
    )
    plan = opt.optimize(build(spec, cat), cat, rules=rules)
    res = execute(physical_plan(plan, cat), {}, cat, binding=spec.name, now=world.NOW)
    return plan, res


def _rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)), key=repr)


def _check(cat: Any, t: dict[str, pa.Table], variant: str, how: str) -> None:
    con = duckdb.connect()
    for name, table in t.items():
        con.register(name, table)
    want = sorted(con.sql(reference(how)).fetchall(), key=repr)
    needed = len({r[1] for r in want if r[1] is not None})
    got = {}
    for with_rule in (True, False):
        plan, res = _run(cat, how, with_rule)
        got[with_rule] = (plan, res)
        assert _rows(res.table) == want, (with_rule, res.table.num_rows, len(want))
    plan, res = got[True]
    text = plan.explain()
    s_line = next(x for x in text.splitlines() if "Scan: s <-" in x)
    l_line = next(x for x in text.splitlines() if "Scan: l <-" in x)
    if how == "left":  # the preserved suppliers are never keyed by the lines
        assert "keys(l." not in s_line, text
        return
    # the lines read without every supplier's key, the suppliers after them by theirs ...
    assert "keys(s." not in l_line and "sk in keys(l.sk)" in s_line, text
    assert "sk in keys(s.sk)" in next(
        x for x in got[False][0].explain().splitlines() if "Scan: l <-" in x
    )
    # ... so the suppliers fetch exactly the rows the join needs (without: all 2,000)
    fetched = {w: got[w][1].stats["sources"]["s"]["rows"] for w in (True, False)}
    assert fetched[True] == needed, (fetched, needed)
    assert fetched[False] == N_SUPP if variant != "nulls" else fetched[False] > 2 * needed


VARIANTS = [("plain", "inner"), ("nulls", "inner"), ("no part", "inner"), ("plain", "left")]


@pytest.mark.parametrize(
    "variant,how", VARIANTS, ids=[f"{v}-{h}".replace(" ", "_") for v, h in VARIANTS]
)
def test_suppliers_read_after_their_lines_keep_duckdbs_answer(variant: str, how: str) -> None:
    t = tables(variant)
    cat = world.catalog(
        world.make_tables(), **{k: MemorySource(f"memory://t/{k}", v) for k, v in t.items()}
    )
    _check(cat, t, variant, how)


@pytest.mark.parametrize("variant,how", [("plain", "inner"), ("nulls", "inner")])
def test_suppliers_on_postgres_read_after_their_lines(pg_url: str, variant: str, how: str) -> None:
    t = tables(variant)
    name = f"rfk_s_{variant}"
    ddl = f"CREATE TABLE {name} (sk BIGINT, nk BIGINT, name VARCHAR(16))"
    rows = t["s"].to_pylist()
    with sql_source(pg_url, "postgres", name, ddl, rows, (f"ANALYZE {name}",)) as suppliers:
        cat = world.catalog(
            world.make_tables(),
            **{k: MemorySource(f"memory://t/{k}", v) for k, v in t.items() if k != "s"},
            s=suppliers,
        )
        _check(cat, t, variant, how)
