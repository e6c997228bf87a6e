"""The exact top-k of many distances (issue 12: right after a bulk upsert every query scans
the ~50k rows of the growing segment, and a full ``argpartition`` of their distances cost
0.5-1.5 ms of it). ``topk`` partitions only the rows at or below the k-th smallest
distance of a strided sample: differential against numpy's full sort, on orders and ties
chosen to defeat the sample, and through the searches that are exact."""

from __future__ import annotations

import numpy as np
import pytest

from dsl.parser import parse_expr
from indexes import Dataset, IndexSpec
from indexes.retrieval import TOPK_SAMPLE_MIN, topk
from tests.test_retrieval import ASCHEMA, anti_data, anti_table


def _cases():
    rng = np.random.default_rng(3)
    n = 50_000
    r = rng.random(n).astype(np.float32)
    step = int((n / 10) ** 0.5)  # topk's stride for k = 10
    periodic = np.ones(n, np.float32)
    periodic[::step] = 2.0  # every sampled row is the worst: the bound passes everything
    periodic[5::step] = 0.5
    boundary = np.repeat(np.float32(1.0), n)
    boundary[rng.choice(n, 7, replace=False)] = 0.0  # 7 below, a tie of 49,993 at the k-th
    nan = r.copy()
    nan[rng.choice(n, n - 5, replace=False)] = np.nan  # fewer than k finite distances
    some_nan = r.copy()
    some_nan[::3] = np.nan
    yield "random", r, 10
    yield "random k=148", r, 148
    yield "random k=n/16", r, n // 16
    yield "ascending", np.sort(r), 10
    yield "descending", np.sort(r)[::-1].copy(), 10
    yield "all equal", np.zeros(n, np.float32), 10
    yield "periodic against the stride", periodic, 10
    yield "a tie at the k-th", boundary, 10
    yield "mostly NaN", nan, 10
    yield "some NaN", some_nan, 10
    yield "just above the threshold", r[:TOPK_SAMPLE_MIN], 10
    yield "integers, many ties", rng.integers(0, 50, n).astype(np.float32), 25


@pytest.mark.parametrize("name,d,k", list(_cases()), ids=[c[0] for c in _cases()])
def test_topk_is_the_exact_top_k(name, d, k):
    ids = np.arange(len(d), dtype=np.int64) * 3 + 11
    got_ids, got_d = topk(ids, d, k)
    want = np.sort(d)[:k]  # NaN sort last, as in argpartition
    assert len(got_ids) == k == len(np.unique(got_ids))
    np.testing.assert_array_equal(got_d, want)
    np.testing.assert_array_equal(d[(got_ids - 11) // 3], got_d)  # each id's own distance
    finite = ~np.isnan(got_d)
    for a, b, ia, ib in zip(got_d[:-1], got_d[1:], got_ids[:-1], got_ids[1:]):
        if not np.isnan(b):
            assert a < b or (a == b and ia < ib)  # ascending, equal distances by row id
    assert finite.all() or name == "mostly NaN"


def test_searches_over_a_large_growing_segment_are_exact():
    """10,000 rows, none folded: the growing segment's scan (post-filter), the pre-filter
    and the exact scan all return numpy's top-10, unfiltered and filtered."""
    n = 10_000
    lab, x, rnd = anti_data(n, seed=5)
    ds = Dataset.create(
        "topk",
        ASCHEMA,
        "id",
        {"v": IndexSpec("hnsw", metric="l2"), "rnd": "btree"},
        fold_rows=n + 1,
        background_fold=False,
    )
    try:
        ds.upsert(anti_table(np.arange(n), lab, x, rnd))
        assert ds.growing() == n
        rng = np.random.default_rng(9)
        for where, mask in ((None, np.ones(n, bool)), ("rnd < 0.5", rnd < 0.5)):
            for q in x[rng.choice(n, 5, replace=False)] + 0.1:
                d = ((x - q) ** 2).sum(axis=1)
                d[~mask] = np.inf
                want = np.argsort(d, kind="stable")[:10]
                for strategy in ("postfilter", "prefilter", "exact"):
                    t, _ = ds.search(
                        "v",
                        q,
                        10,
                        parse_expr(where) if where else None,
                        columns=["id"],
                        strategy=strategy,
                    )
                    assert t.column("id").to_pylist() == want.tolist(), (where, strategy)
    finally:
        ds.close()


@pytest.mark.parametrize("n", [40, TOPK_SAMPLE_MIN * 4])
def test_ties_at_the_k_th_distance_go_to_the_lowest_row_ids(n):
    """Equal distances are ordered by row id *across the boundary* too: of rows tied at
    the k-th distance the lowest ids are kept, whatever the partition's order (it used
    to keep whichever tied rows ``argpartition`` left in front, so two exact paths over
    the same candidates -- a gather, a slice, the 8-bit first pass -- could answer
    different rows)."""
    rng = np.random.default_rng(1)
    for k in (1, 3, 10):
        for _ in range(20):
            d = rng.integers(0, 4, n).astype(np.float32)  # ties everywhere
            ids = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int64)
            got_ids, got_d = topk(ids, d, k)
            want = np.lexsort((ids, d))[:k]
            assert got_ids.tolist() == ids[want].tolist()
            np.testing.assert_array_equal(got_d, d[want])
