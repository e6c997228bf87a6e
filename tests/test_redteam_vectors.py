"""Red team: what an upsert puts into a vector index, against numpy's brute force.

Found here: a vector with a NaN or an infinity was accepted by ``Dataset.upsert`` (the
query side refuses one: 'the query vector contains NaN or infinite values'). In the HNSW
graph such rows break the walk for every other row: with 5% of 4,000 rows NaN, the graph
search's top 10 held 0.4 of the true 10 nearest finite rows on average (recall 0.04;
1.0 without them), and with an infinity under cosine 0.024; no error, no warning. Now the
upsert is refused, naming the keys. Likewise a NaN in a B-tree indexed float column: the
B-tree answered ``f > 1`` with [3, 7, 8] where DuckDB answers [0, 1, 3, 7, 8] (the row
of 1.5 missed) and ``f != 1.5`` kept the row of 1.5; it was refused, and now the B-tree
orders float keys as DuckDB (NaN above +inf, -0.0 = 0.0) and answers DuckDB's rows
(``tests/test_btree_float_order.py`` tries every filter shape on random columns).

Held (kept as tests): the last of duplicate keys in one batch wins; an upserted key's old
vector is no longer found by any strategy; a zero vector under l2 / ip and finite
extreme values are found as numpy ranks them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest

from indexes.dataset import Dataset
from indexes.spec import DatasetError, IndexSpec

DIM = 16
STRATEGIES = ["exact", "postfilter", "insearch", "prefilter"]


def _rows(ids: list[int], vecs: np.ndarray) -> pa.Table:
    flat = pa.array(np.asarray(vecs, np.float32).reshape(-1), pa.float32())
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "v": pa.FixedSizeListArray.from_arrays(flat, DIM)}
    )


def _dataset(metric: str, background: bool = False) -> Dataset:
    schema = _rows([0], np.zeros((1, DIM))).schema
    return Dataset(
        "rt_vec",
        schema,
        "id",
        {"v": IndexSpec("hnsw", metric=metric)},
        background_fold=background,
        fold_rows=256,
    )


def _numpy_top(rows: dict[int, np.ndarray], q: np.ndarray, metric: str, k: int) -> list[float]:
    m = np.stack(list(rows.values())).astype(np.float64)
    qq = q.astype(np.float64)
    if metric == "cosine":
        d = 1 - (m @ qq) / (np.linalg.norm(m, axis=1) * np.linalg.norm(qq))
    elif metric == "l2":
        d = ((m - qq) ** 2).sum(axis=1)
    else:
        d = 1 - m @ qq
    return sorted(d.tolist())[:k]


@pytest.mark.parametrize("metric", ["cosine", "l2", "ip"])
@pytest.mark.parametrize(
    "bad",
    [
        np.r_[np.nan, np.ones(DIM - 1)],
        np.full(DIM, np.inf),
        np.r_[-np.inf, np.zeros(DIM - 1)],
        np.full(DIM, 3e38),  # finite in float32, its squared length is not
        np.full(DIM, 1e300),  # a float64 beyond float32: inf once stored
    ],
    ids=["nan", "inf", "-inf", "3e38", "1e300"],
)
def test_an_upsert_of_a_non_finite_vector_is_refused_naming_its_key(metric, bad) -> None:
    ds = _dataset(metric)
    ds.upsert(_rows([1, 2], np.ones((2, DIM))))
    vecs = np.stack([np.ones(DIM), bad]).astype(np.float64)
    table = pa.table(
        {
            "id": pa.array([3, 4], pa.int64()),
            "v": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), DIM),
        }
    )
    with pytest.raises(DatasetError, match=r"'v'.*\b4\b"):
        ds.upsert(table)
    assert ds.count() == 2  # nothing of the refused batch was written
    assert ds.get(3) is None


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_the_graph_finds_the_true_neighbours_when_bad_rows_were_offered(metric: str) -> None:
    """Batches where 5% of the rows are NaN: each batch is refused whole, so the graph
    only holds the finite batches, and its top 10 are numpy's (recall 0.04 on the old
    code, where the NaN rows went into the graph)."""
    rng = np.random.default_rng(1)
    n = 4000
    v = rng.normal(size=(n, DIM)).astype(np.float32)
    bad = rng.random(n) < 0.05
    v[bad] = np.nan
    ds = _dataset(metric)
    kept: dict[int, np.ndarray] = {}
    for s in range(0, n, 10):
        ids = list(range(s, min(n, s + 10)))
        try:
            ds.upsert(_rows(ids, v[s : s + 10]))
        except DatasetError:
            continue
        kept.update({i: v[i] for i in ids if np.isfinite(v[i]).all()})
    assert 0 < len(kept) < n
    recall = []
    for _ in range(30):
        q = rng.normal(size=DIM).astype(np.float32)
        got, _ = ds.search("v", q, 10, strategy="postfilter")
        want = _numpy_top(kept, q, metric, 10)
        top = sorted(got["_distance"].to_pylist())
        recall.append(np.mean([g <= want[-1] + 1e-4 for g in top]))
    assert np.mean(recall) >= 0.9


@pytest.mark.parametrize("metric", ["cosine", "l2", "ip"])
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_duplicates_in_a_batch_and_replaced_keys_as_numpy(metric: str, background: bool) -> None:
    rng = np.random.default_rng(2)
    n = 600
    v = rng.normal(size=(n, DIM)).astype(np.float32)
    ds = _dataset(metric, background)
    try:
        ds.upsert(_rows(list(range(n)), v))
        # one batch: key 5 twice (the last wins), key 6 replaced, and extreme finite rows
        zero, big, small = np.zeros(DIM), np.full(DIM, 1e15), np.full(DIM, 1e-15)
        batch = np.stack([-v[0], -v[1], -v[2], zero, big, small]).astype(np.float32)
        if metric == "cosine":  # a zero vector has no direction: not a cosine row
            batch[3] = 1.0
        ds.upsert(_rows([5, 5, 6, 9000, 9001, 9002], batch))
        if background:
            assert ds.wait_folded()
        rows = {i: v[i] for i in range(n)}
        rows.update({5: -v[1], 6: -v[2], 9000: batch[3], 9001: big, 9002: small})
        assert ds.count() == len(rows)
        for q in (v[5], v[6], -v[1], np.ones(DIM, np.float32), rng.normal(size=DIM)):
            q = np.asarray(q, np.float32)
            want = _numpy_top(rows, q, metric, 5)
            for strategy in STRATEGIES:
                got, _ = ds.search("v", q, 5, strategy=strategy)
                d = got["_distance"].to_pylist()
                # the old vectors of 5 and 6 are gone: nothing at distance 0 from v[5]
                # unless numpy has it; each strategy's distances are numpy's
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    assert np.allclose(sorted(d), want, rtol=1e-3, atol=1e-3), (strategy, d, want)
                ids = got["id"].to_pylist()
                assert len(set(ids)) == len(ids)
                vecs = np.stack(got["v"].to_numpy(zero_copy_only=False))
                for i, vec in zip(ids, vecs, strict=True):
                    assert np.array_equal(vec, rows[i].astype(np.float32)), (i, strategy)
    finally:
        ds.close()


NAN = float("nan")
FLOATS = [1.5, NAN, None, float("inf"), -float("inf"), -0.0, 0.0, 2.0, NAN, -1.0]
WHERE = [
    "f > 1",
    "f >= 1.5",
    "f < 3",
    "f != 1.5",
    "f between 1 and 3",
    "not (f > 1)",
    "f = 0",
    "f > -0.0",
    "f is null",
    "f in (0, 2)",
]


def _floats_table() -> pa.Table:
    return pa.table({"id": pa.array(range(len(FLOATS)), pa.int64()), "f": pa.array(FLOATS)})


def test_a_nan_in_a_btree_float_column_filters_as_duckdb() -> None:
    """On the old code the B-tree took NaN and answered f > 1 with [3, 7, 8] where DuckDB
    answers [0, 1, 3, 7, 8] (1.5 missed, one NaN of two), f != 1.5 kept the row of 1.5;
    c93183a refused the upsert; the B-tree now orders NaN as DuckDB does."""
    t = _floats_table()
    ds = Dataset("rt_bt", t.schema, "id", {"f": "btree"}, background_fold=False)
    ds.upsert(t)
    assert ds.count() == len(FLOATS)
    _same_rows_as_duckdb(ds, t)


def test_a_float_column_without_a_btree_filters_nan_as_duckdb() -> None:
    t = _floats_table()
    ds = Dataset("rt_nobt", t.schema, "id", {}, background_fold=False)
    ds.upsert(t)
    _same_rows_as_duckdb(ds, t)


def _same_rows_as_duckdb(ds: Dataset, t: pa.Table) -> None:
    import duckdb

    from dsl.parser import parse_expr

    con = duckdb.connect()
    con.register("t", t)
    for w in WHERE:
        rowids = np.array(sorted(ds.filter_rows(parse_expr(w))), np.int64)
        got = sorted(ds.rows(rowids, ["id"])["id"].to_pylist())
        want = sorted(r[0] for r in con.sql(f"SELECT id FROM t WHERE {w}").fetchall())
        assert got == want, w


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_zero_query_vector_under_cosine_is_refused(strategy: str) -> None:
    """The cosine distance to a zero vector is undefined (DuckDB's list_cosine_distance
    answers NaN); every strategy answered ten arbitrary rows at distance 1.0, quietly."""
    ds = _dataset("cosine")
    rng = np.random.default_rng(5)
    ds.upsert(_rows(list(range(200)), rng.normal(size=(200, DIM))))
    with pytest.raises(DatasetError, match=r"nearest\(v\).*zero.*cosine"):
        ds.search("v", np.zeros(DIM, np.float32), 10, strategy=strategy)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_a_zero_query_vector_is_a_query_under_l2_and_ip(metric: str) -> None:
    ds = _dataset(metric)
    rng = np.random.default_rng(6)
    vecs = rng.normal(size=(200, DIM))
    ds.upsert(_rows(list(range(200)), vecs))
    got, _ = ds.search("v", np.zeros(DIM, np.float32), 10, strategy="exact")
    want = _numpy_top(dict(enumerate(vecs)), np.zeros(DIM), metric, 10)
    assert np.allclose(sorted(got["_distance"].to_pylist()), want, atol=1e-4)
