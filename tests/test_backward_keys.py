"""A provider of keys read after its consumers (fabric/optimizer/backward_keys.py).

The shape of TPC-H Q3: customers ``c`` of one segment key orders ``o`` placed before a
date, and the orders key lines ``l`` shipped after it, each line shipped 1-60 days after
its order: of the orders before the date only those just before it have such a line.
Without the rule the orders are read first and every one of the segment's orders before
the date is fetched; with it the lines take the orders' keys from a key-only pre-scan
``o#keys`` and the orders are read last, keyed by the lines: as many rows as the join
needs. Random data with NULL keys and dates, duplicate order keys, no order before the
date, and a left join (the preserved orders are not keyed by the lines); the orders in
memory, in MariaDB and in PostgreSQL: the answer equals DuckDB's with the rule and
without it. Explain-text fixtures: tests/fixtures/optimizer/backward_keys/.
"""

from __future__ import annotations

import datetime as dt
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

N_CUST, N_ORDERS, N_LINES = 2000, 20000, 60000
DAY0 = dt.date(2000, 1, 1)
CUT = DAY0 + dt.timedelta(days=500)


def binding(how: str) -> str:
    return f"""
binding: orders_near_the_date
session:
  d: date
sources:
  c:
    from: memory://t/c
    where: seg = 'A'
  o:
    from: memory://t/o
    join: o.ck = c.ck
    where: od < {{{{session.d}}}}
  l:
    from: memory://t/l
    join: {{on: l.ok = o.ok, how: {how}}}
    where: sd > {{{{session.d}}}}
select: [c.ck, o.id as oid, o.ok, o.pay, l.id as lid]
"""


def reference(how: str) -> str:
    join = "JOIN" if how == "inner" else "LEFT JOIN"
    return f"""
SELECT c.ck, o.id, o.ok, o.pay, l.id FROM c JOIN o ON o.ck = c.ck
{join} (SELECT * FROM l WHERE sd > $d) l ON l.ok = o.ok
WHERE c.seg = 'A' AND o.od < $d"""


def tables(variant: str, seed: int = 5) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    null = 0.1 if variant == "nulls" else 0.0
    oks = np.arange(N_ORDERS)
    if variant == "duplicates":
        oks = rng.integers(0, N_ORDERS // 3, N_ORDERS)
    days = rng.integers(0, 1000, N_ORDERS)
    if variant == "none before":
        days = rng.integers(600, 1000, N_ORDERS)
    od = [DAY0 + dt.timedelta(days=int(x)) for x in days]
    line_order = rng.integers(0, N_ORDERS, N_LINES)
    sd = [od[i] + dt.timedelta(days=int(rng.integers(1, 61))) for i in line_order]

    def nulls(values: list, typ: pa.DataType) -> pa.Array:
        mask = rng.random(len(values)) < null
        return pa.array([None if m else v for v, m in zip(values, mask)], typ)

    return {
        "c": pa.table(
            {
                "ck": nulls(list(range(N_CUST)), pa.int64()),
                "seg": rng.choice(list("ABCDE"), N_CUST).tolist(),
            }
        ),
        "o": pa.table(
            {
                "id": pa.array(np.arange(N_ORDERS), pa.int64()),
                "ok": nulls(oks.tolist(), pa.int64()),
                "ck": nulls(rng.integers(0, N_CUST, N_ORDERS).tolist(), pa.int64()),
                "od": nulls(od, pa.date32()),
                "pay": pa.array(rng.integers(0, 1000, N_ORDERS), pa.int64()),
            }
        ),
        "l": pa.table(
            {
                "id": pa.array(np.arange(N_LINES), pa.int64()),
                "ok": nulls([int(oks[i]) for i in line_order], pa.int64()),
                "sd": nulls(sd, pa.date32()),
            }
        ),
    }


def _run(cat: Any, how: str, with_rule: bool) -> tuple[Any, Any]:
    spec = load_text(binding(how), "near.yaml")[0]
    rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r.__name__ != "backward_keys")
    plan = opt.optimize(build(spec, cat), cat, rules=rules)
    res = execute(physical_plan(plan, cat), {"d": CUT}, cat, binding=spec.name, now=world.NOW)
    return plan, res


def _rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)), key=repr)


def _reference(t: dict[str, pa.Table], how: str) -> tuple[list[tuple], int]:
    """DuckDB's answer, and the orders it joins (distinct order rows: what ``o`` needs)."""
    con = duckdb.connect()
    for name, table in t.items():
        con.register(name, table)
    rows = con.sql(reference(how), params={"d": CUT}).fetchall()
    return sorted(rows, key=repr), len({r[1] for r in rows})


VARIANTS = [
    ("plain", "inner"),
    ("nulls", "inner"),
    ("duplicates", "inner"),
    ("none before", "inner"),
    ("plain", "left"),
    ("nulls", "left"),
]


def _check(cat: Any, t: dict[str, pa.Table], variant: str, how: str) -> None:
    want, needed = _reference(t, how)
    got = {}
    for with_rule in (True, False):
        plan, res = _run(cat, how, with_rule)
        got[with_rule] = (plan, res)
        assert _rows(res.table) == want, (with_rule, res.table.num_rows, len(want))
    plan, res = got[True]
    o_line = next(x for x in plan.explain().splitlines() if "Scan: o <-" in x)
    fetched = {w: got[w][1].stats["sources"]["o"]["rows"] for w in (True, False)}
    if how == "left":  # the preserved orders are never keyed by the lines
        assert "keys(l." not in o_line, plan.explain()
        return
    # the orders wait for the lines, which take the orders' keys from the pre-scan ...
    assert "ok in keys(l.ok)" in o_line, plan.explain()
    l_line = next(x for x in plan.explain().splitlines() if "Scan: l <-" in x)
    assert "ok in keys(o#keys.ok)" in l_line, plan.explain()
    assert "o#keys" in res.stats["sources"]
    # ... and read exactly the orders the join needs (without the rule: every order of
    # the segment before the date)
    assert fetched[True] == needed, (fetched, needed)
    if variant in ("plain", "nulls"):
        assert fetched[False] > 5 * needed, (fetched, needed)


@pytest.mark.parametrize(
    "variant,how", VARIANTS, ids=[f"{v}-{h}".replace(" ", "_") for v, h in VARIANTS]
)
def test_orders_read_after_their_lines_keep_duckdbs_answer(variant: str, how: str) -> None:
    t = tables(variant)
    cat = world.catalog(
        world.make_tables(), **{k: MemorySource(f"memory://t/{k}", v) for k, v in t.items()}
    )
    _check(cat, t, variant, how)


SERVER_VARIANTS = [("plain", "inner"), ("nulls", "inner"), ("plain", "left")]


@pytest.mark.parametrize("server", ["mysql", "postgres"])
@pytest.mark.parametrize(
    "variant,how", SERVER_VARIANTS, ids=[f"{v}-{h}" for v, h in SERVER_VARIANTS]
)
def test_orders_on_a_server_read_after_their_lines(
    request: pytest.FixtureRequest, server: str, variant: str, how: str
) -> None:
    t = tables(variant)
    url = request.getfixturevalue("pg_url" if server == "postgres" else "mariadb_url")
    name = f"bk_o_{variant}_{how}"
    ddl = f"CREATE TABLE {name} (id BIGINT PRIMARY KEY, ok BIGINT, ck BIGINT, od DATE, pay BIGINT)"
    after = (f"CREATE INDEX {name}_ok ON {name} (ok)",)
    after += (f"ANALYZE {name}",) if server == "postgres" else ()
    with sql_source(url, server, name, ddl, t["o"].to_pylist(), after) as orders:
        cat = world.catalog(
            world.make_tables(),
            c=MemorySource("memory://t/c", t["c"]),
            o=orders,
            l=MemorySource("memory://t/l", t["l"]),
        )
        _check(cat, t, variant, how)
