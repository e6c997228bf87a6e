"""Key-only pre-scans (fabric/optimizer/semijoin_reduce.py) on the real servers.

The shape of TPC-H Q7: lines ``l`` (S3 Parquet) keyed by the selected suppliers ``s``,
orders ``o`` (MariaDB or PostgreSQL) keyed by the selected customers ``c`` and by the
lines' order keys; the lines cannot also take the orders' keys (the two would wait on
each other), so without the rule they read every line of the suppliers. With it, a
key-only pre-scan ``o#keys`` of the customers' orders keys the lines as well.

Random data with NULL keys, duplicate order keys, empty sides (no customer, no supplier
selected) and left joins (only the inner side may be filtered), the order key an
integer, a string, a DECIMAL and a DATE: the answer equals DuckDB's over the same rows,
with the rule and without it. Explain-text fixture:
tests/fixtures/optimizer/semijoin_reduce/cycle.yaml.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Iterator
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.memory import MemorySource
from dsl.loader import load_text
from fabric.execute import execute
from fabric.physical import plan as physical_plan
from fabric.plan.builder import build
from tests.servers import sql_source

N_ORDERS, N_LINES, N_CUST, N_SUPP = 20000, 12000, 2000, 400

KEY_TYPES = {
    "int": ("BIGINT", pa.int64(), lambda n: int(n)),
    "str": ("VARCHAR(24)", pa.string(), lambda n: f"k{int(n):05d}"),
    "decimal": ("DECIMAL(12, 2)", pa.decimal128(12, 2), lambda n: decimal.Decimal(int(n)) / 4),
    "date": ("DATE", pa.date32(), lambda n: dt.date(2000, 1, 1) + dt.timedelta(days=int(n))),
}


def binding(how: str) -> str:
    return f"""
binding: cycle
sources:
  s:
    from: memory://t/s
    where: nat = 'N1'
  l:
    from: memory://t/l
    join: l.sk = s.sk
  o:
    from: memory://t/o
    join: {{on: o.ok = l.ok, how: {how}}}
  c:
    from: memory://t/c
    join: c.ck = o.ck
    where: seg = 'A'
select: [s.sk, l.id as lid, o.id as oid, c.ck, o.ok]
"""


REF = {
    "inner": """
SELECT s.sk, l.id, o.id, c.ck, o.ok FROM s JOIN l ON l.sk = s.sk JOIN o ON o.ok = l.ok
JOIN c ON c.ck = o.ck WHERE s.nat = 'N1' AND c.seg = 'A'""",
    "left": """
SELECT s.sk, l.id, o.id, c.ck, o.ok FROM s JOIN l ON l.sk = s.sk LEFT JOIN o ON o.ok = l.ok
JOIN c ON c.ck = o.ck WHERE s.nat = 'N1' AND c.seg = 'A'""",
}


def tables(kind: str, variant: str, seed: int = 11) -> dict[str, pa.Table]:
    rng = np.random.default_rng(seed)
    _, typ, conv = KEY_TYPES[kind]
    null = 0.2 if variant == "nulls" else 0.0
    span = N_ORDERS // 4 if variant == "duplicates" else N_ORDERS

    def keys(n: int) -> pa.Array:
        v = rng.integers(0, span, n)
        mask = rng.random(n) < null
        return pa.array([None if m else conv(x) for x, m in zip(v, mask)], typ)

    ok = (
        keys(N_ORDERS)
        if variant in ("nulls", "duplicates")
        else pa.array([conv(i) for i in range(N_ORDERS)], typ)
    )
    segs = np.array(list("ABCDEFGHIJKLMNOPQRST"))
    nats = np.array([f"N{i}" for i in range(20)])
    seg = segs[rng.integers(0, 20, N_CUST)]
    nat = nats[rng.integers(0, 20, N_SUPP)]
    if variant == "no customer":
        seg[seg == "A"] = "B"
    if variant == "no supplier":
        nat[nat == "N1"] = "N2"
    ck = rng.integers(0, N_CUST, N_ORDERS)
    return {
        "s": pa.table({"sk": pa.array(np.arange(N_SUPP), pa.int64()), "nat": nat.tolist()}),
        "c": pa.table(
            {
                "ck": pa.array(np.arange(N_CUST), pa.int64(), mask=rng.random(N_CUST) < null),
                "seg": seg.tolist(),
            }
        ),
        "o": pa.table(
            {"id": pa.array(np.arange(N_ORDERS), pa.int64()), "ok": ok, "ck": pa.array(ck)}
        ),
        "l": pa.table(
            {
                "id": pa.array(np.arange(N_LINES), pa.int64()),
                "ok": keys(N_LINES),
                "sk": pa.array(rng.integers(0, N_SUPP, N_LINES), pa.int64()),
            }
        ),
    }


def _sql_source(url: str, kind: str, name: str, t: pa.Table, key_sql: str) -> Iterator[Any]:
    ddl = f"CREATE TABLE {name} (id BIGINT PRIMARY KEY, ok {key_sql}, ck BIGINT)"
    after = (f"CREATE INDEX {name}_ck ON {name} (ck)", f"CREATE INDEX {name}_ok ON {name} (ok)")
    after += (f"ANALYZE {name}",) if kind == "postgres" else ()
    with sql_source(url, kind, name, ddl, t.to_pylist(), after) as source:
        yield source


def _run(cat: Any, how: str, with_rule: bool) -> tuple[Any, Any]:
    spec = load_text(binding(how), "cycle.yaml")[0]
    # without: no key-only pre-scan at all (backward_keys, which reads the orders after
    # the lines through a pre-scan of its own, would otherwise cut the lines as well)
    without = ("semijoin_reduce", "backward_keys")
    rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r.__name__ not in without)
    plan = opt.optimize(build(spec, cat), cat, rules=rules)
    res = execute(physical_plan(plan, cat), {}, cat, binding=spec.name, now=world.NOW)
    return plan, res


def _rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)), key=repr)


def _reference(t: dict[str, pa.Table], how: str) -> list[tuple]:
    con = duckdb.connect()
    for name, table in t.items():
        con.register(name, table)
    return sorted(con.sql(REF[how]).fetchall(), key=repr)


CASES = [
    (kind, server, variant, how)
    for kind, server in [
        ("int", "mysql"),
        ("str", "mysql"),
        ("decimal", "mysql"),
        ("date", "mysql"),
        ("int", "postgres"),
        ("str", "postgres"),
        ("decimal", "postgres"),
        ("date", "postgres"),
    ]
    for variant, how in [
        ("plain", "inner"),
        ("nulls", "inner"),
        ("duplicates", "inner"),
        ("no customer", "inner"),
        ("no supplier", "inner"),
        ("plain", "left"),
        ("nulls", "left"),
    ]
]


@pytest.mark.parametrize(
    "kind,server,variant,how", CASES, ids=["-".join(c).replace(" ", "_") for c in CASES]
)
def test_key_only_prescan_keeps_duckdbs_answer(
    request: pytest.FixtureRequest, s3: Any, kind: str, server: str, variant: str, how: str
) -> None:
    t = tables(kind, variant)
    url = request.getfixturevalue("pg_url" if server == "postgres" else "mariadb_url")
    key_sql = KEY_TYPES[kind][0]
    path = f"sj/{kind}-{variant.replace(' ', '_')}/part-0.parquet"
    with s3.fs.open_output_stream(s3.path(path)) as f:
        pq.write_table(t["l"], f, row_group_size=2000)
    lines = s3.connection("lake").source(path)
    name = f"sj_o_{kind}_{variant.replace(' ', '_')}"
    gen = _sql_source(url, server, name, t["o"], key_sql)
    orders = next(gen)
    try:
        cat = world.catalog(
            world.make_tables(),
            s=MemorySource("memory://t/s", t["s"]),
            c=MemorySource("memory://t/c", t["c"]),
            o=orders,
            l=lines,
        )
        want = _reference(t, how)
        got = {}
        for with_rule in (True, False):
            _, res = _run(cat, how, with_rule)
            got[with_rule] = res
            assert _rows(res.table) == want, (with_rule, res.table.num_rows, len(want))
        text = plan_text = _run(cat, how, True)[0].explain()
        if how == "inner" and server == "mysql":
            # the lines take the customers' orders' keys from the key-only pre-scan (on
            # PostgreSQL the estimates sit near the rule's threshold, e.g. int keys: 1,080
            # lines saved where 2,001 keys read need 1,000, and whether it fires turned on
            # ANALYZE's figures from run to run, so there only the answers are checked) ...
            line = next(x for x in text.splitlines() if "Scan: l <-" in x)
            assert "ok in keys(o#keys.ok)" in line, plan_text
            if variant in ("plain", "duplicates"):
                # ... and read fewer rows than without it
                with_, without = (got[w].stats["sources"]["l"]["rows"] for w in (True, False))
                assert with_ < without / 2, (with_, without)
                assert "o#keys" in got[True].stats["sources"]
        elif how == "left":  # the preserved side of the left join is never keyed by the orders
            line = next(x for x in text.splitlines() if "Scan: l <-" in x)
            assert "keys(o" not in line, plan_text
    finally:
        gen.close()
