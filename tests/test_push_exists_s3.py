"""A correlated exists / not exists over Parquet of the same S3 connection, evaluated in
the reading query of DuckDB's Parquet reader (connectors/s3.py ``_exists_ok``,
connectors/s3_duckdb.py ``Filters._exists``; the rule: fabric/optimizer/push_exists.py).

TPC-H Q21 reads lineitem three times from one S3 connection: l1 keyed by the suppliers
(17,752 rows for 465 needed at SF 0.1) and both stages whole (600,572 + 379,809 rows),
then DuckDB filtered l1 with ``exists(l2 ...) and not exists(l3 ...)``. Pushed, DuckDB
reads l1 with ``[NOT] EXISTS (SELECT 1 FROM read_parquet([...]) AS "__x_l2" WHERE ...)``
and the stages are not fetched.

The answer must be DuckDB's over the same rows on random tables (NULL keys on either
side, duplicates, an empty stage file, strings, dates compared with dates inside the
stage, the Q21 shape with ``<>``, an exists under an OR) with and without the rule; with
the rule the outer source returns exactly the answer's rows and the stage's objects
are not read. Shapes whose meaning could differ (float keys, arithmetic, session values
inside the exists, the pyarrow reader, another connection) are refused.
"""

from __future__ import annotations

import datetime as dt
import decimal
import random
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fabric.optimizer as opt
from connectors.base import Pushdown
from connectors.s3 import S3Connection
from dsl.ast import Binary, Column, ExistsIn, Unary
from dsl.loader import load_text
from fabric.execute import execute
from fabric.execute.local import LocalCatalog
from fabric.optimizer.push_exists import push_exists
from fabric.plan.builder import build
from fabric.plan.nodes import WithStages

D = decimal.Decimal
STRINGS = ["a", "A", "a ", "b", "ß", "", None]
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("k", pa.int64()),
        ("k2", pa.int32()),
        ("s", pa.string()),
        ("v", pa.decimal128(10, 2)),
        ("d1", pa.date32()),
        ("d2", pa.date32()),
        ("f", pa.float64()),
    ]
)

# name -> (the stage's where, the outer where, the reference's WHERE over c and st,
#          whether the S3 source takes it)
CASES: dict[str, tuple[str, str, str, bool]] = {
    "not_exists": (
        "",
        "not exists(st where st.k = c.k)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k)",
        True,
    ),
    "exists": (
        "",
        "exists(st where st.k = c.k)",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k)",
        True,
    ),
    # TPC-H Q21: exists(l2 where same order, other supplier) and not exists(l3 where
    # same order, other supplier, late)
    "q21_shape": (
        "",
        "exists(st where st.k = c.k and st.k2 <> c.k2) and "
        "not exists(st2 where st2.k = c.k and st2.k2 <> c.k2)",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k AND st.k2 <> c.k2) "
        "AND NOT EXISTS (SELECT 1 FROM st2 WHERE st2.k = c.k AND st2.k2 <> c.k2)",
        True,
    ),
    "stage_filters": (
        "s = 'a' and v > 0",
        "not exists(st where st.k = c.k)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k)",
        True,
    ),
    "under_or": (
        "v < 1",
        "not exists(st where st.k = c.k) or c.v > 2",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k) OR c.v > 2",
        True,
    ),
    "outer_filter_inside": (
        "",
        "exists(st where st.k = c.k and c.s = 'a')",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k AND c.s = 'a')",
        True,
    ),
    "text_key": (  # DuckDB compares text by bytes, as the fabric's own evaluation does
        "",
        "not exists(st where st.s = c.s)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.s = c.s)",
        True,
    ),
    # refused: arithmetic on the enclosing column, a float key, a session value
    "derived_outer": (
        "",
        "not exists(st where st.k = c.kk)",
        "NOT EXISTS (SELECT 1 FROM st WHERE st.k = c.k + 1)",
        False,
    ),
    "float_key": (
        "",
        "exists(st where st.f = c.f)",
        "EXISTS (SELECT 1 FROM st WHERE st.f = c.f)",
        False,
    ),
    "session_inside": (
        "",
        "exists(st where st.k = c.k and st.v > {{session.lo}})",
        "EXISTS (SELECT 1 FROM st WHERE st.k = c.k AND st.v > 0)",
        False,
    ),
}


def _binding(case: str) -> str:
    stage_where, outer_where, _, _ = CASES[case]
    where = f'\n        where: "{stage_where}"' if stage_where else ""
    st2 = (
        """
  st2:
    sources:
      o2: {from: s3://lake/pe_o/, where: "d2 > d1"}
    select: [o2.k, o2.k2]"""
        if "st2" in outer_where
        else ""
    )
    return f"""
binding: pes3_{case}
session: {{lo: decimal}}
stages:
  st:
    sources:
      o:
        from: s3://lake/pe_o/{where}
    select: [o.k, o.k2, o.s, o.v, o.f]{st2}
sources:
  c:
    from: s3://lake/pe_c/
    derive: {{kk: k + 1}}
    where: "{outer_where}"
select: [c.id]
"""


def _reference(case: str, outer: pa.Table, inner: pa.Table) -> list[int]:
    stage_where, _, where, _ = CASES[case]
    con = duckdb.connect()
    con.register("c", outer)
    con.register("o", inner)
    con.execute(
        f"CREATE TEMP TABLE st AS SELECT * FROM o {'WHERE ' + stage_where if stage_where else ''}"
    )
    con.execute("CREATE TEMP TABLE st2 AS SELECT * FROM o WHERE d2 > d1")
    return sorted(r[0] for r in con.execute(f"SELECT c.id FROM c WHERE ({where})").fetchall())


def _tables(seed: int, n_outer: int, n_inner: int, null_share: float) -> tuple[pa.Table, pa.Table]:
    rng = random.Random(seed)
    day = dt.date(1995, 1, 1)

    def maybe(v: Any) -> Any:
        return None if rng.random() < null_share else v

    def rows(n: int, base: int) -> list[dict[str, Any]]:
        return [
            {
                "id": base + i,
                "k": maybe(rng.randrange(12)),  # few keys: duplicates on both sides
                "k2": maybe(rng.randrange(3)),
                "s": maybe(rng.choice(STRINGS)),
                "v": maybe(D(rng.randrange(-500, 500)) / 100),
                "d1": maybe(day + dt.timedelta(days=rng.randrange(5))),
                "d2": maybe(day + dt.timedelta(days=rng.randrange(5))),
                "f": maybe(rng.choice([0.0, -0.0, 1.5, float("nan")])),
            }
            for i in range(n)
        ]

    return (
        pa.Table.from_pylist(rows(n_outer, 0), schema=SCHEMA),
        pa.Table.from_pylist(rows(n_inner, 10_000), schema=SCHEMA),
    )


@pytest.fixture(scope="module")
def lake(s3: Any) -> dict[str, Any]:
    return {
        "s3": s3,
        "opts": {
            "kind": "s3",
            "endpoint": s3.endpoint,
            "bucket": s3.bucket,
            "access_key": s3.access_key,
            "secret_key": s3.secret_key,
        },
    }


def _load(lake: dict[str, Any], outer: pa.Table, inner: pa.Table) -> None:
    s3 = lake["s3"]
    for name, t in (("pe_c", outer), ("pe_o", inner)):
        half = t.num_rows // 2  # two files, several row groups
        for i, part in enumerate((t.slice(0, half), t.slice(half))):
            pq.write_table(
                part, f"{s3.bucket}/{name}/part-{i}.parquet", filesystem=s3.fs, row_group_size=16
            )


def _run(lake: dict[str, Any], case: str, with_rule: bool, **opts: Any):
    conn = S3Connection("lake", {**lake["opts"], **opts})
    try:
        cat = LocalCatalog({"lake": conn})
        spec = load_text(_binding(case), f"pes3_{case}.yaml")[0]
        rules = opt.RULES if with_rule else tuple(r for r in opt.RULES if r is not push_exists)
        plan = opt.optimize(build(spec, cat), cat, rules=rules)
        res = execute(plan, {"lo": D(0)}, cat, binding=spec.name)
        return plan, res
    finally:
        conn.close()


def _pushed(plan) -> bool:
    (c,) = [s for s in plan.scans() if s.alias == "c"]
    return any(isinstance(x, ExistsIn) for f in c.exact for x in f.walk())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "seed,n_outer,n_inner,null_share",
    [
        (1, 60, 40, 0.0),
        (2, 80, 60, 0.25),  # NULL keys, strings and values on both sides
        (3, 50, 0, 0.1),  # an empty stage: exists never, not exists always
        (5, 100, 300, 0.3),  # many duplicate inner keys
    ],
)
def test_random_tables_give_duckdbs_answer_with_and_without_the_rule(
    lake: dict[str, Any], case: str, seed: int, n_outer: int, n_inner: int, null_share: float
) -> None:
    outer, inner = _tables(seed, n_outer, n_inner, null_share)
    _load(lake, outer, inner)
    want = _reference(case, outer, inner)
    pushes = CASES[case][3]
    for with_rule in (True, False):
        plan, res = _run(lake, case, with_rule)
        got = sorted(res.table.column("id").to_pylist())
        assert got == want, f"{case} with_rule={with_rule}:\n{plan.explain()}"
        assert _pushed(plan) == (with_rule and pushes), plan.explain()
        sources = res.stats["sources"]
        if with_rule and pushes:
            # the outer source returns the answer's rows, the stage's objects are not read
            assert sources["c"]["rows"] == len(want), plan.explain()
            assert "o" not in sources and "o2" not in sources, sorted(sources)
            assert not isinstance(plan, WithStages), plan.explain()
        else:
            assert "o" in sources


def test_the_pyarrow_reader_and_other_connections_are_refused(lake: dict[str, Any]) -> None:
    """pyarrow cannot evaluate an exists after its scan, another connection's objects are
    not this query's, a column the other set lacks or of another family: UNSUPPORTED."""
    _load(lake, *_tables(1, 5, 5, 0.0))
    duck = S3Connection("lake", lake["opts"])
    arrow = S3Connection("lake", {**lake["opts"], "parquet_reader": "pyarrow"})
    try:
        src = duck.source("pe_c/")
        cond = Binary("=", Column("k", "st"), Column("k"))
        assert src.supports_filter(ExistsIn("s3://lake/pe_o/", "st", cond)) is Pushdown.EXACT
        assert (
            src.supports_filter(Unary("not", ExistsIn("s3://lake/pe_o/", "st", cond)))
            is Pushdown.EXACT
        )
        for uri in ("s3://other/pe_o/", "s3://lake/nope/"):
            assert src.supports_filter(ExistsIn(uri, "st", cond)) is Pushdown.UNSUPPORTED, uri
        for bad in (
            Binary("=", Column("nope", "st"), Column("k")),
            Binary("=", Column("k2", "st"), Column("k")),  # int32 vs int64: one family, fine
            Binary("=", Column("s", "st"), Column("k")),  # string vs int
            Binary(">", Column("v", "st"), Column("v")),  # no equality: a loop per row
        ):
            want = Pushdown.EXACT if bad.left == Column("k2", "st") else Pushdown.UNSUPPORTED
            assert src.supports_filter(ExistsIn("s3://lake/pe_o/", "st", bad)) is want, bad
        assert (
            arrow.source("pe_c/").supports_filter(ExistsIn("s3://lake/pe_o/", "st", cond))
            is Pushdown.UNSUPPORTED
        )
    finally:
        duck.close()
        arrow.close()


def test_the_pyarrow_reader_evaluates_it_in_the_fabric_as_before(lake: dict[str, Any]) -> None:
    outer, inner = _tables(2, 80, 60, 0.25)
    _load(lake, outer, inner)
    want = _reference("q21_shape", outer, inner)
    plan, res = _run(lake, "q21_shape", True, parquet_reader="pyarrow")
    assert sorted(res.table.column("id").to_pylist()) == want
    assert not _pushed(plan)
