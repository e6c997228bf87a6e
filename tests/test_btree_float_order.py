"""The B-tree of a float column orders its keys as DuckDB does, against DuckDB.

DuckDB (as PostgreSQL, and the fabric's pyarrow filters since the NaN red team) orders
NaN above every number, +inf included, and makes NaN = NaN true whatever its bits;
-0.0 = 0.0. The B-tree kept IEEE floats in numpy arrays and a SortedList, where NaN is
unordered: over f = [1.5, NaN, null, inf, -inf, -0.0, 0.0, 2.0, NaN, -1.0] ``f > 1``
answered [3, 7, 8] where DuckDB answers [0, 1, 3, 7, 8] (the row of 1.5 missed, a NaN
too) and ``f != 1.5`` kept the row of 1.5; c93183a then refused such upserts. Now a float
key is an order-preserving int64 (NaN one key above +inf, -0.0 folded into 0.0), and
every comparison, between, in, not in, != and not through the B-tree answers DuckDB's
rows: random float64 and float32 columns with NaN of three bit patterns, -0.0, infinities
and nulls, through bulk and small upserts, deletes, re-upserts, a save and a load.
"""

from __future__ import annotations

import struct
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from dsl.parser import parse_expr
from indexes.btree import BTreeIndex, Range, array_of
from indexes.dataset import Dataset
from indexes.filters import AndPred, NotPred, OrPred, Pred, RangePred, compile_filter

NAN, INF = float("nan"), float("inf")


def _bits(u: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", u))[0])


NEG_NAN = _bits(0xFFF8000000000000)  # the NaN of x86 arithmetic (inf - inf): sign bit set
PAY_NAN = _bits(0x7FF0000000000001)  # a NaN with a payload (signalling)
VALUES = [NAN, NEG_NAN, PAY_NAN, -0.0, 0.0, INF, -INF, -1.0, 1.0, 1.5, 2.0, 3.0, 0.25, -7.5]
VALUES64 = [*VALUES, 1e300, -1e300, 5e-324, -5e-324]  # not float32 values

#: session values: DuckDB's spelling of each
PARAMS: dict[str, Any] = {
    "nan": NAN,
    "negnan": NEG_NAN,
    "inf": INF,
    "ninf": -INF,
    "nzero": -0.0,
    "vals": [NAN, NEG_NAN, 1.5, 0.0, -0.0],
    "few": [2.0, NAN],
}
SQL_PARAMS = {
    "nan": "'nan'::DOUBLE",
    "negnan": "'nan'::DOUBLE",
    "inf": "'inf'::DOUBLE",
    "ninf": "'-inf'::DOUBLE",
    "nzero": "(-0.0)::DOUBLE",
    "vals": "('nan'::DOUBLE, 'nan'::DOUBLE, 1.5, 0.0, (-0.0)::DOUBLE)",
    "few": "(2.0, 'nan'::DOUBLE)",
}
CONSTANTS = ["-1", "0", "-0.0", "1.5", "2", "{{session.nan}}", "{{session.negnan}}"]
CONSTANTS += ["{{session.inf}}", "{{session.ninf}}", "{{session.nzero}}"]
WHERE = [f"f {op} {c}" for op in ("=", "!=", "<", "<=", ">", ">=") for c in CONSTANTS]
WHERE += [
    "1.5 < f",
    "{{session.nan}} <= f",
    "{{session.nan}} > f",
    "f between 0 and 2",
    "f between -0.0 and {{session.nan}}",
    "f between {{session.ninf}} and {{session.inf}}",
    "f between {{session.nan}} and {{session.nan}}",
    "f between {{session.inf}} and {{session.nan}}",
    "f not between 1 and 2",
    "f not between -1 and {{session.inf}}",
    "f not between {{session.ninf}} and {{session.nan}}",
    "f in (0, 2)",
    "f in (-0.0, 1.5, 2, 3, -1)",  # five points: the vectorized path
    "f in {{session.vals}}",
    "f in {{session.few}}",
    "f not in (1.5, 2, 3, -1)",
    "f not in {{session.vals}}",
    "f not in {{session.few}}",
    "not (f > 1)",
    "not (f <= {{session.nan}})",
    "not (f = {{session.nan}})",
    "not (f < {{session.inf}})",
    "f < 0 or f = {{session.nan}}",
    # a small candidate set first (g), then the float B-tree tests keys by row id
    "g = 1 and f > 1",
    "g = 2 and f != 1.5",
    "g = 0 and f in {{session.vals}}",
    "g = 3 and f between 0 and {{session.nan}}",
    "g = 1 and not (f < 2)",
    "g = 2 and f >= {{session.inf}}",
    "g = 0 and f in (-0.0, 1.5, 2, 3, -1)",
]


def _sql(where: str) -> str:
    for k, v in SQL_PARAMS.items():
        where = where.replace("{{session." + k + "}}", v)
    return where


def _index_only(p: Pred) -> bool:
    if isinstance(p, RangePred):
        return True
    if isinstance(p, NotPred):
        return _index_only(p.child)
    if isinstance(p, AndPred | OrPred):
        return all(_index_only(c) for c in p.children)
    return False


def _ranges(p: Pred) -> list[RangePred]:
    if isinstance(p, RangePred):
        return [p]
    if isinstance(p, NotPred):
        return _ranges(p.child)
    if isinstance(p, AndPred | OrPred):
        return [r for c in p.children for r in _ranges(c)]
    return []


def _same_as_duckdb(ds: Dataset, rows: dict[int, tuple[Any, int]], typ: pa.DataType) -> None:
    ids = sorted(rows)
    t = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "f": pa.array([rows[i][0] for i in ids], typ),
            "g": pa.array([rows[i][1] for i in ids], pa.int64()),
        }
    )
    con = duckdb.connect()
    con.register("t", t)
    assert ds.count() == len(ids)
    for w in WHERE:
        pred = compile_filter(ds, parse_expr(w), PARAMS)
        assert _index_only(pred), (w, pred.describe())  # the B-tree answers it, no pyarrow
        bm = pred.evaluate(None)
        got = sorted(ds.rows(array_of(bm).astype(np.int64), ["id"])["id"].to_pylist())
        want = sorted(r[0] for r in con.sql(f"SELECT id FROM t WHERE {_sql(w)}").fetchall())
        assert got == want, (w, len(got), len(want))
        for rp in _ranges(pred):  # range counts exact (the planner's estimates)
            assert rp.bt.count(rp.ranges) == len(rp.bt.rows(rp.ranges)), w


def _batch(rng: np.random.Generator, keys: np.ndarray, pool: list[float]) -> list[Any]:
    out: list[Any] = []
    for _ in keys:
        u = rng.random()
        out.append(None if u < 0.08 else pool[int(rng.integers(len(pool)))])
    return out


@pytest.mark.parametrize("typ", [pa.float64(), pa.float32()], ids=["float64", "float32"])
def test_btree_float_filters_with_nan_zero_signs_and_infinities_equal_duckdb(typ, tmp_path):
    rng = np.random.default_rng(7)
    pool = VALUES64 if typ == pa.float64() else VALUES
    schema = pa.schema([("id", pa.int64()), ("f", typ), ("g", pa.int64())])
    ds = Dataset("bt_nan", schema, "id", {"f": "btree", "g": "btree"}, background_fold=False)
    rows: dict[int, tuple[Any, int]] = {}
    # bulk (>= BULK_ROWS non-null: straight into main), small (the delta), re-upserts
    for size in (1500, 60, 300, 1400, 40, 900):
        keys = rng.choice(3000, size, replace=False)
        vals = _batch(rng, keys, pool)
        gs = rng.integers(0, 4, size)
        ds.upsert(
            pa.table(
                {
                    "id": pa.array(keys, pa.int64()),
                    "f": pa.array(vals, typ),
                    "g": pa.array(gs, pa.int64()),
                }
            )
        )
        for k, v, g in zip(keys.tolist(), vals, gs.tolist(), strict=True):
            rows[k] = (v, g)
        gone = rng.choice(sorted(rows), min(len(rows), int(rng.integers(10, 400))), replace=False)
        assert ds.delete(gone.tolist()) == len(gone)
        for k in gone.tolist():
            rows.pop(k)
        _same_as_duckdb(ds, rows, typ)
    ds.save(str(tmp_path / "bt"))
    back = Dataset.load(str(tmp_path / "bt"))
    _same_as_duckdb(back, rows, typ)
    new = {0: (NAN, 1), 1: (-0.0, 2), 5000: (NEG_NAN, 0)}  # re-upserts and a new key
    back.upsert(
        pa.table(
            {
                "id": pa.array(list(new), pa.int64()),
                "f": pa.array([v for v, _ in new.values()], typ),
                "g": pa.array([g for _, g in new.values()], pa.int64()),
            }
        )
    )
    rows.update(new)
    _same_as_duckdb(back, rows, typ)


def test_a_nan_upsert_in_the_red_team_rows_answers_duckdbs_rows() -> None:
    """The rows of c93183a: on the old code f > 1 gave [3, 7, 8] (DuckDB [0, 1, 3, 7, 8])."""
    f = [1.5, NAN, None, INF, -INF, -0.0, 0.0, 2.0, NAN, -1.0]
    ds = Dataset(
        "bt_rt",
        pa.schema([("id", pa.int64()), ("f", pa.float64()), ("g", pa.int64())]),
        "id",
        {"f": "btree", "g": "btree"},
        background_fold=False,
    )
    g = [i % 4 for i in range(10)]
    ds.upsert(pa.table({"id": pa.array(range(10), pa.int64()), "f": pa.array(f), "g": g}))
    bm = ds.filter_rows(parse_expr("f > 1"))
    assert sorted(ds.rows(array_of(bm).astype(np.int64), ["id"])["id"].to_pylist()) == [
        0,
        1,
        3,
        7,
        8,
    ]
    _same_as_duckdb(ds, {i: (v, g[i]) for i, v in enumerate(f)}, pa.float64())


def test_float_keys_order_as_duckdb_and_decode_to_the_values() -> None:
    """Every NaN is one key above +inf; -0.0 is 0.0's key; min_max answers the values."""
    bt = BTreeIndex("f", pa.float64())
    vals = [NEG_NAN, 2.0, -INF, -0.0, PAY_NAN, 5e-324, INF, 0.0, NAN, -1e300]
    bt.add(np.arange(len(vals)), pa.array(vals, pa.float64()))
    keys = bt.to_keys(pa.array(vals, pa.float64()))[0]
    assert len({keys[0], keys[4], keys[8]}) == 1 and keys[3] == keys[7]
    order = [-INF, -1e300, 0.0, 5e-324, 2.0, INF]
    enc = [bt.key_of(v) for v in order]
    assert enc == sorted(enc) and len(set(enc)) == len(enc) and bt.key_of(NAN) > bt.key_of(INF)
    lo, hi = bt.min_max()
    assert lo == -INF and np.isnan(hi)
    assert bt.count([Range(INF, None, False, True)]) == 3  # the three NaNs, one key
    assert bt.count([Range.point(NAN), Range.point(NEG_NAN)]) == 3  # duplicate points once
    assert bt.count([Range.point(-0.0)]) == 2
    assert set(array_of(bt.rows([Range(None, 0.0, True, False)])).tolist()) == {2, 9}


def test_a_float_btree_saved_with_float64_keys_restores_in_key_order() -> None:
    """A B-tree saved before float_keys (its keys float64, -0.0 among them) loads re-keyed."""
    vals = [2.0, -0.0, -INF, 1.5, 0.0, INF, -1.0, 2.0]
    bt = BTreeIndex("f", pa.float64())
    bt.add(np.arange(len(vals)), pa.array(vals, pa.float64()))
    st = bt.state()
    old = dict(st, keys=np.sort(np.array(vals)), by_rowid=np.array(vals))
    old["rowids"] = np.argsort(np.array(vals), kind="stable").astype(np.uint32)
    back = BTreeIndex("f", pa.float64())
    back.restore(old)
    assert back.keys.dtype == np.int64 and np.array_equal(back.keys, st["keys"])
    assert back.count([Range.point(0.0)]) == 2 and back.min_max() == (-INF, INF)
    assert set(array_of(back.rows([Range(-0.0, 2.0, False, True)])).tolist()) == {0, 3, 7}
    assert back.test(np.array([1, 4, 5], np.uint32), [Range.point(-0.0)]).tolist() == [
        True,
        True,
        False,
    ]
