"""A join into a ``latest_by`` scan (the newest row per key, then the join) gives DuckDB's
answer over the same rows: a filter the optimizer derives from the join (a dynamic key
list, a join bound) reaches such a scan only on a key column, since the source filters
before it keeps the newest row per key. Pushed on another column it kept an older row:
``loc.level < u.cap`` pushed as ``level <= max(cap)`` answered each user's older level 1
where the newest level 100 fails the join (100 rows for 0), and ``loc.zone = z.zone`` as
``zone in keys(z.zone)`` likewise (200 for 0)."""

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

BOUND = """
binding: newest_level_under_cap
sources:
  u:
    from: memory://t/caps
    where: cap < 50
  loc:
    from: memory://t/live
    latest_by: user_id
    join: loc.user_id = u.user_id and loc.level < u.cap
select: [loc.user_id, loc.level, u.cap]
"""
BOUND_REF = """
SELECT l.user_id, l.level, u.cap FROM caps u JOIN newest l
ON l.user_id = u.user_id AND l.level < u.cap WHERE u.cap < 50
"""
KEYS = """
binding: newest_zone_listed
sources:
  z:
    from: memory://t/zones
    where: zone < 3
  loc:
    from: memory://t/live
    latest_by: user_id
    join: loc.zone = z.zone
select: [loc.user_id, loc.zone]
"""
KEYS_REF = "SELECT l.user_id, l.zone FROM zones z JOIN newest l ON l.zone = z.zone WHERE z.zone < 3"


def _tables(seed: int) -> dict[str, pa.Table]:
    n = 200
    if seed == 0:  # each user's older row passes the join, its newest does not
        level, zone = [1] * n + [100] * n, [1] * n + [7] * n
    else:
        rng = np.random.default_rng(seed)
        level = rng.integers(0, 40, 2 * n).tolist()
        zone = rng.integers(0, 6, 2 * n).tolist()
    live = pa.table(
        {
            "user_id": pa.array(list(range(n)) * 2, pa.int64()),
            "level": pa.array(level, pa.int64()),
            "zone": pa.array(zone, pa.int64()),
            "seq": pa.array(range(2 * n), pa.int64()),
        }
    )
    caps = pa.table(
        {
            "user_id": pa.array(range(0, n, 2), pa.int64()),
            "cap": pa.array([10 + i % 20 for i in range(n // 2)], pa.int64()),
        }
    )
    zones = pa.table({"zone": pa.array([1, 2], pa.int64())})
    return {"live": live, "caps": caps, "zones": zones}


def _rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "binding,ref", [(BOUND, BOUND_REF), (KEYS, KEYS_REF)], ids=["bound", "keys"]
)
def test_a_join_into_a_latest_by_scan_gives_duckdbs_answer(
    binding: str, ref: str, seed: int
) -> None:
    tables = _tables(seed)
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    con.execute(
        "CREATE TEMP VIEW newest AS SELECT * FROM live "
        "QUALIFY row_number() OVER (PARTITION BY user_id ORDER BY seq DESC) = 1"
    )
    want = sorted(con.sql(ref).fetchall())
    live = world.LatestMemorySource("memory://t/live", tables["live"])
    cat = world.catalog(
        {**world.make_tables(), "caps": tables["caps"], "zones": tables["zones"]}, live=live
    )
    spec = load_text(binding, "latest.yaml")[0]
    plan = opt.optimize(build(spec, cat), cat)
    line = next(x for x in plan.explain().splitlines() if "Scan: loc <-" in x)
    assert "level <" not in line and "zone in" not in line, line
    got = _rows(execute(plan, {}, cat, binding=spec.name, now=world.NOW).table)
    assert got == want


WHERE = """
binding: newest_level_low
sources:
  loc:
    from: memory://t/live
    latest_by: user_id
    where: level < 10
select: [loc.user_id, loc.level]
"""


def test_a_filter_on_a_latest_by_scan_gives_one_answer_pushed_or_not() -> None:
    """A latest_by source is the table of each key's newest record; a where: on another
    column filters that table (docs/bindings.md). Pushed into the scan it ran before the
    newest record was kept: each user's older level 1 came back (100 rows) where the
    newest level, 100, fails the filter (0 rows)."""
    tables = _tables(0)
    live = world.LatestMemorySource("memory://t/live", tables["live"])
    cat = world.catalog(world.make_tables(), live=live)
    spec = load_text(WHERE, "latest.yaml")[0]
    pushed = opt.optimize(build(spec, cat), cat)
    got = _rows(execute(pushed, {}, cat, binding=spec.name, now=world.NOW).table)
    fabric = _rows(execute(build(spec, cat), {}, cat, binding=spec.name, now=world.NOW).table)
    assert got == fabric == []
    line = next(x for x in pushed.explain().splitlines() if "Scan: loc <-" in x)
    assert "level <" not in line, line
