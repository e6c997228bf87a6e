"""The 8-bit first pass over gathered candidates (indexes/quantized.py, issue 12).

The pass must never change an answer: for every safe row the proven bound holds
(``|d32 - (key + const)| <= B``, d32 the float32 distance the exact path computes), and
the exact top-k over its shortlist is the exact top-k over all candidates -- the same
row ids in the same order with the same distances, ties going to the lowest row id.
Checked by hypothesis on adversarial stores (tiny, huge, zero, NaN and infinite rows,
duplicates, integer-valued rows full of ties, narrow ranges far from zero, a drifting
distribution that forces refits, k above the candidates) for every metric and both
kernels; and the exact path itself against a float64 numpy brute force where float32
can represent the distances.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexes import quantized
from indexes.hnsw import VectorIndex
from indexes.quantized import NORM_MAX, Codes, set_kernel
from indexes.retrieval import topk
from indexes.spec import IndexSpec

METRICS = ("l2", "ip", "cosine")
KERNELS = ["numpy"] + (["numkong"] if quantized._NK is not None else [])
ROW_KINDS = (
    "gauss",
    "cluster",
    "tiny",
    "huge",
    "large",
    "zero",
    "dup",
    "int",
    "nan",
    "inf",
    "offset",
    "scaled",
)


def make_rows(rng: np.random.Generator, n: int, dim: int, kinds: list[str], prev: np.ndarray):
    out = np.empty((n, dim), dtype=np.float32)
    centers = rng.standard_normal((4, dim)) * 3
    for i in range(n):
        kind = kinds[rng.integers(len(kinds))]
        g = rng.standard_normal(dim)
        if kind == "cluster":
            v = centers[rng.integers(4)] + g
        elif kind == "tiny":
            v = g * 1e-21
        elif kind == "huge":
            v = g * 1e19  # norm above NORM_MAX: not safe, always in the shortlist
        elif kind == "large":
            v = g * 1e15
        elif kind == "zero":
            v = np.zeros(dim)
        elif kind == "dup":
            pool = np.concatenate([prev, out[:i]])
            v = pool[rng.integers(len(pool))] if len(pool) else g
        elif kind == "int":
            v = rng.integers(-2, 3, dim).astype(np.float64)  # ties everywhere
        elif kind == "nan":
            v = g.copy()
            v[rng.integers(dim)] = np.nan
        elif kind == "inf":
            v = g.copy()
            v[rng.integers(dim)] = np.inf * (1 if rng.random() < 0.5 else -1)
        elif kind == "offset":
            v = 1000.0 + g * 0.01  # a narrow range far from zero
        elif kind == "scaled":
            v = g * 10.0 ** rng.uniform(-5, 5)
        else:
            v = g
        out[i] = v
    return out


def make_query(rng: np.random.Generator, dim: int, kind: str, rows: np.ndarray) -> np.ndarray:
    g = rng.standard_normal(dim)
    finite = rows[np.isfinite(rows).all(axis=1)] if len(rows) else rows
    if kind == "row" and len(finite):
        v = finite[rng.integers(len(finite))].astype(np.float64) + 0.01 * g
    elif kind == "tiny":
        v = g * 1e-21
    elif kind == "huge":
        v = g * 1e19
    elif kind == "zero":
        v = np.zeros(dim)
    elif kind == "int":
        v = rng.integers(-2, 3, dim).astype(np.float64)
    else:
        v = g
    return np.ascontiguousarray(v.astype(np.float32))


def store(metric: str, dim: int, batches: list[np.ndarray]) -> VectorIndex:
    vi = VectorIndex("v", dim, IndexSpec("hnsw", metric=metric))
    start = 0
    for b in batches:
        vi.append(start, b)
        start += len(b)
    return vi


def exact_topk(vi: VectorIndex, q: np.ndarray, ids: np.ndarray, k: int):
    return topk(ids, vi.distances(q, ids), k)


def first_pass_topk(vi: VectorIndex, q: np.ndarray, ids: np.ndarray, k: int):
    sl = vi.codes.shortlist(q, ids, k, vi.aux)
    if sl is None:
        return None, exact_topk(vi, q, ids, k)
    return sl, topk(sl, vi.distances(q, sl), k)


def reference64(metric: str, x: np.ndarray, q: np.ndarray) -> np.ndarray:
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    if metric == "l2":
        return ((x64 - q64) ** 2).sum(axis=1)
    if metric == "ip":
        return 1.0 - x64 @ q64
    nx, nq = np.linalg.norm(x64, axis=1), np.linalg.norm(q64)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.where((nx > 0) & (nq > 0), (x64 @ q64) / (nx * nq), 0.0)
    return 1.0 - c


@st.composite
def cases(draw):
    return {
        "metric": draw(st.sampled_from(METRICS)),
        "dim": draw(st.sampled_from([1, 2, 3, 7, 16, 33, 128])),
        "batches": draw(st.lists(st.integers(1, 150), min_size=1, max_size=4)),
        "kinds": draw(st.lists(st.sampled_from(ROW_KINDS), min_size=1, max_size=4, unique=True)),
        "qkind": draw(st.sampled_from(["gauss", "row", "tiny", "huge", "zero", "int"])),
        "k": draw(st.sampled_from([1, 2, 3, 10, 40, 500])),
        "frac": draw(st.sampled_from([1.0, 0.5, 0.1, 0.01])),
        "kernel": draw(st.sampled_from(KERNELS)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_the_first_pass_bound_holds_and_its_top_k_is_the_exact_top_k(c):
    rng = np.random.default_rng(c["seed"])
    dim, metric, k = c["dim"], c["metric"], c["k"]
    batches, prev = [], np.zeros((0, dim), np.float32)
    for n in c["batches"]:
        b = make_rows(rng, n, dim, c["kinds"], prev)
        batches.append(b)
        prev = np.concatenate([prev, b])
    old = set_kernel(c["kernel"])
    try:
        vi = store(metric, dim, batches)
        codes = vi.codes
        assert codes.n == vi.n
        assert codes.unsafe == int(np.count_nonzero(~codes.safe[: vi.n]))
        q = make_query(rng, dim, c["qkind"], prev)
        ids = np.flatnonzero(rng.random(vi.n) < c["frac"]).astype(np.int64)
        # 1. the bound: every safe row's float32 distance is within B of the estimate
        fp = codes.first_pass(q, ids, vi.aux)
        if fp is not None:
            key, bound, const = fp
            d32 = vi.distances(q, ids).astype(np.float64)
            safe = codes.safe[ids]
            assert np.isfinite(d32[safe]).all()
            gap = np.abs(d32[safe] - (key[safe] + const))
            assert (gap <= bound).all(), (float(gap.max()), bound)
        else:  # only a query of norm above NORM_MAX is refused (everything is fitted)
            assert np.linalg.norm(q.astype(np.float64)) > NORM_MAX
        # 2. the shortlist's exact top-k is the exact pass's: same ids, same distances
        want_ids, want_d = exact_topk(vi, q, ids, k)
        sl, (got_ids, got_d) = first_pass_topk(vi, q, ids, k)
        assert got_ids.tolist() == want_ids.tolist()
        np.testing.assert_array_equal(got_d, want_d)
        if sl is not None:
            assert np.isin(sl, ids).all() and (np.diff(sl) > 0).all()
    finally:
        set_kernel(old)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    metric=st.sampled_from(METRICS),
    dim=st.sampled_from([2, 16, 128]),
    n=st.integers(1, 400),
    kinds=st.lists(
        st.sampled_from(["gauss", "cluster", "tiny", "large", "zero", "dup", "int", "scaled"]),
        min_size=1,
        max_size=3,
        unique=True,
    ),
    qkind=st.sampled_from(["gauss", "row", "int"]),
    k=st.sampled_from([1, 5, 10, 50, 1000]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_answer_is_numpy_float64_brute_force_where_float32_holds_it(
    metric, dim, n, kinds, qkind, k, seed
):
    """Finite rows of norm up to 1e16 (tiny ones included: under cosine their float32
    sum of squares used to underflow, and the exact path ranked them wrongly) against
    float64: the rows returned are the float64 top-k up to float32's own error."""
    rng = np.random.default_rng(seed)
    x = make_rows(rng, n, dim, kinds, np.zeros((0, dim), np.float32))
    vi = store(metric, dim, [x])
    q = make_query(rng, dim, qkind, x)
    ids = np.arange(n, dtype=np.int64)
    got_ids, got_d = first_pass_topk(vi, q, ids, k)[1]
    ref = reference64(metric, x, q)
    nx = np.linalg.norm(x.astype(np.float64), axis=1).max()
    nq = float(np.linalg.norm(q.astype(np.float64)))
    tol = {"l2": 1e-5 * (nx + nq) ** 2 + 1e-36, "ip": 1e-5 * (1 + nx * nq), "cosine": 1e-5}[metric]
    assert len(got_ids) == min(k, n) == len(np.unique(got_ids))
    np.testing.assert_array_less(np.abs(got_d - ref[got_ids]), tol + 0 * got_d + 1e-300)
    kth = np.sort(ref)[min(k, n) - 1]
    assert (ref[got_ids] <= kth + 2 * tol).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("metric", METRICS)
def test_the_first_pass_shortlists_few_rows_of_clustered_data(metric, kernel):
    """The pass earns its place: on clustered 128-d data (the benchmark's shape) the
    shortlist of 2,000 scattered candidates holds a few dozen rows, not all of them."""
    rng = np.random.default_rng(4)
    centers = rng.standard_normal((16, 128)) * 2
    lab = rng.integers(0, 16, 20_000)
    x = (centers[lab] + rng.standard_normal((20_000, 128))).astype(np.float32)
    old = set_kernel(kernel)
    try:
        vi = store(metric, 128, [x[:5000], x[5000:]])  # fitted on the first 5,000
        assert vi.codes.unsafe <= 0.002 * len(x)  # the tails of the later ones
        ids = np.flatnonzero(lab >= 14).astype(np.int64)  # two far clusters, scattered
        sizes = []
        for q in (centers[rng.integers(0, 14, 20)] + rng.standard_normal((20, 128))).astype(
            np.float32
        ):
            sl, got = first_pass_topk(vi, q, ids, 10)
            assert sl is not None
            want = exact_topk(vi, q, ids, 10)
            assert got[0].tolist() == want[0].tolist()
            sizes.append(len(sl))
        assert np.median(sizes) <= 0.05 * len(ids), (np.median(sizes), len(ids))
    finally:
        set_kernel(old)


def test_rows_outside_the_fitted_range_are_exact_until_a_refit():
    """Rows appended after the fit that fall outside its range are not safe (always
    re-ranked exactly); once they are more than 1/64 of the rows the codes are fitted
    again over every row and they are safe."""
    rng = np.random.default_rng(2)
    vi = VectorIndex("v", 16, IndexSpec("hnsw", metric="l2"))
    vi.append(0, rng.standard_normal((2000, 16)).astype(np.float32))
    assert vi.codes.unsafe == 0
    vi.append(2000, (rng.standard_normal((40, 16)) * 50).astype(np.float32))
    assert 0 < vi.codes.unsafe <= 40
    assert not vi.codes.safe[2000:2040].all()
    q = rng.standard_normal(16).astype(np.float32) * 50
    ids = np.arange(vi.n, dtype=np.int64)
    assert first_pass_topk(vi, q, ids, 10)[1][0].tolist() == exact_topk(vi, q, ids, 10)[0].tolist()
    vi.append(2040, (rng.standard_normal((200, 16)) * 50).astype(np.float32))
    assert vi.codes.unsafe == 0  # refitted
    assert first_pass_topk(vi, q, ids, 10)[1][0].tolist() == exact_topk(vi, q, ids, 10)[0].tolist()


def test_a_query_too_large_for_float32_skips_the_first_pass():
    vi = store("l2", 8, [np.ones((100, 8), np.float32)])
    q = np.full(8, 1e30, np.float32)
    assert vi.codes.first_pass(q, np.arange(100), vi.aux) is None
    assert math.isfinite(NORM_MAX)


def test_codes_are_rebuilt_when_a_saved_column_is_loaded(tmp_path):
    rng = np.random.default_rng(0)
    vi = store("cosine", 32, [rng.standard_normal((3000, 32)).astype(np.float32)])
    vi.fold(np.ones(3000, bool), force=True)
    vi.save(str(tmp_path))
    again = VectorIndex("v", 32, IndexSpec("hnsw", metric="cosine"))
    again.load(str(tmp_path), vi.n, vi.folded, vi.in_graph)
    assert again.codes.n == 3000
    np.testing.assert_array_equal(again.codes.codes[:3000], vi.codes.codes[:3000])
    assert isinstance(again.codes, Codes)


def _anti(metric: str, n: int = 8000, name: str = "quant"):
    from indexes import Dataset
    from tests.test_retrieval import ASCHEMA, anti_data, anti_table

    lab, x, rnd = anti_data(n)
    ds = Dataset.create(
        name,
        ASCHEMA,
        "id",
        {"v": IndexSpec("hnsw", metric=metric), "cl": "btree", "rnd": "btree"},
        fold_rows=n + 1,
    )
    ds.upsert(anti_table(np.arange(n), lab, x, rnd))
    ds.flush()
    return ds, lab, x, rnd


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("metric", METRICS)
def test_a_gathered_prefilter_answers_the_same_with_and_without_the_first_pass(
    metric, kernel, monkeypatch
):
    """Through ``Dataset.search``: an anti-correlated ``cl in (...)`` (10 far clusters,
    scattered over the row ids: a gather) answered by the pre-filter with the 8-bit first
    pass (explain says so, and it ran) and without it -- the same rows, ties to the lowest
    row id included -- and numpy's float64 brute force."""
    from indexes import CostModel
    from indexes.retrieval import candidates_of
    from tests.test_retrieval import FAR10, cl_in

    ds, lab, x, _rnd = _anti(metric)
    runs = []
    real = Codes.shortlist

    def counted(self, *a, **kw):
        out = real(self, *a, **kw)
        runs.append(out is not None)
        return out

    monkeypatch.setattr(Codes, "shortlist", counted)
    old = set_kernel(kernel)
    try:
        where, mask = cl_in(FAR10), np.isin(lab, FAR10)
        qs = x[np.flatnonzero(lab < 50)[:12]] + 0.05
        for q in qs:
            # gathers as dear as on the loaded 200k benchmark (~5x a contiguous pass): the
            # model sends these 826 rows through the first pass
            ds.cost_model = CostModel(gather_ns_per_dim=4.0)
            on, info = ds.search("v", q, 10, where, {}, strategy="prefilter", columns=["id"])
            assert "8-bit first pass" in str(info) and info.guarantee == "exact", str(info)
            monkeypatch.setattr(quantized, "ENABLED", False)
            off, _ = ds.search("v", q, 10, where, {}, strategy="prefilter", columns=["id"])
            monkeypatch.setattr(quantized, "ENABLED", True)
            assert on.column("id").to_pylist() == off.column("id").to_pylist()
            assert on.column("_distance").to_pylist() == off.column("_distance").to_pylist()
            ids = np.flatnonzero(mask)
            ref = reference64(metric, x[ids], q)
            assert set(on.column("id").to_pylist()) == set(ids[np.argsort(ref)[:10]].tolist())
        assert runs and all(runs)
        assert candidates_of(ds, ds.pred_cache[next(iter(ds.pred_cache))]) is not None
    finally:
        set_kernel(old)
        ds.close()


def test_the_remembered_candidate_bitmap_follows_every_write():
    """The candidate bitmap kept on a compiled filter is the one of its dataset version: a
    delete and an upsert in between are seen by the next search."""
    from tests.test_retrieval import FAR10, anti_table, brute, cl_in

    ds, lab, x, _rnd = _anti("l2", 4000, name="memo")
    try:
        where = cl_in(FAR10)
        q = x[int(np.flatnonzero(lab == 3)[0])]
        first, _ = ds.search("v", q, 10, where, {}, strategy="prefilter", columns=["id"])
        top = first.column("id").to_pylist()
        ds.delete(top[:3])
        alive = np.ones(len(lab), bool)
        alive[top[:3]] = False
        again, _ = ds.search("v", q, 10, where, {}, strategy="prefilter", columns=["id"])
        assert again.column("id").to_pylist() == brute(x, alive & np.isin(lab, FAR10), q).tolist()
        near = (np.repeat(q[None, :], 2, axis=0) + 0.01).astype(np.float32)
        ds.upsert(anti_table(np.array([9000, 9001]), np.full(2, FAR10[0]), near, np.zeros(2)))
        fresh, _ = ds.search("v", q, 10, where, {}, strategy="prefilter", columns=["id"])
        assert fresh.column("id").to_pylist()[:2] == [9000, 9001]
    finally:
        ds.close()
