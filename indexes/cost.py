"""Unit costs of the retrieval strategies, calibrated on this machine.

All figures are milliseconds or nanoseconds measured by ``calibrate()``; defaults come
from ``/work/shared/PERF_FACTS.md`` (2-core machine, 128-d). The model:

- HNSW search: ``hnsw_base_ms + hnsw_per_ef_ms * ef`` (per dataset column when measured on
  its own graph; otherwise scaled by dimension);
- exact distances: ``contig_ns_per_dim * dim`` per row over a contiguous row-id range,
  ``gather_ns_per_dim * dim`` per row gathered by index; a gather of many rows runs the
  8-bit first pass instead (``indexes.quantized``) when the model says it is cheaper:
  ``first_pass_ms`` fixed, ``quant_ns_per_dim * dim`` per row, then the exact distances of
  a shortlist of about ``SHORTLIST_PER_K * k`` rows;
- candidate sets: ``bitmap_ns_per_row`` to turn a B-tree range into a roaring bitmap,
  ``test_ns_per_row`` to test a value by row id, ``residual_ns_per_row`` for pyarrow;
- in-search filter: ``callback_ns`` per node hnswlib visits, ``visits_per_ef * ef`` nodes
  visited by an unfiltered search (a filtered one visits about that divided by the
  selectivity, since it walks until it has ``ef`` matches).

Stored as JSON (``<dataset dir>/costs.json`` or ``~/.cache/fabric/retrieval_costs.json``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SHORTLIST_PER_K = 8  # rows the first pass keeps per k, modelled (60 of 21,828 measured)
DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "fabric", "retrieval_costs.json")


@dataclass
class CostModel:
    hnsw_base_ms: float = 0.045
    hnsw_per_ef_ms: float = 0.0013
    hnsw_dim: int = 128  # dimension the two hnsw figures were measured at
    contig_ns_per_dim: float = 24.0 / 128
    gather_ns_per_dim: float = 90.0 / 128
    topk_ns_per_row: float = 4.0
    # the 8-bit first pass over gathered candidates: gather codes + integer dots + bound
    quant_ns_per_dim: float = 20.0 / 128
    first_pass_ms: float = 0.04
    bitmap_ns_per_row: float = 12.0
    test_ns_per_row: float = 25.0
    residual_ns_per_row: float = 250.0
    callback_ns: float = 900.0
    visits_per_ef: float = 12.0
    overhead_ms: float = 0.015
    overheads: dict[str, float] = field(default_factory=dict)  # measured fixed ms per strategy
    calibrated_at: float | None = None
    columns: dict[str, list[list[float]]] = field(default_factory=dict)  # column -> [[ef, ms], ...]
    # learned at run time, not saved: per strategy, actual / modelled cost (retrieval)
    scale: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------- unit costs
    def hnsw_ms(self, ef: float, dim: int, column: str | None = None) -> float:
        pts = self.columns.get(column or "")
        if pts:  # piecewise-linear through the measured points, extrapolated linearly
            # plain Python, not np.interp: this runs several times per query (one planning
            # of a 7-value partition filter called it ~30 times, ~10 % of the search)
            if ef <= pts[0][0] or len(pts) < 2:
                return float(pts[0][1])
            for (e0, m0), (e1, m1) in itertools.pairwise(pts):
                if ef <= e1:
                    return float(m0 + (m1 - m0) * (ef - e0) / (e1 - e0)) if e1 > e0 else float(m1)
            (e0, m0), (e1, m1) = pts[-2], pts[-1]
            return float(m1 + (m1 - m0) / (e1 - e0) * (ef - e1)) if e1 > e0 else float(m1)
        scale = dim / self.hnsw_dim
        return (self.hnsw_base_ms + self.hnsw_per_ef_ms * ef) * scale

    def fixed_ms(self, strategy: str) -> float:
        """Fixed (Python) cost of running ``strategy`` once, beyond its modelled work."""
        return self.overheads.get(strategy, self.overhead_ms)

    def exact_ms(
        self, rows: int, dim: int, contiguous: bool, k: int = 10, first_pass: bool = True
    ) -> float:
        """Exact top-k over ``rows`` rows: one contiguous pass, or a gather (the cheaper of
        gathering every row and, with ``first_pass``, the 8-bit first pass, as
        ``retrieval.exact_on`` picks)."""
        if contiguous:
            return rows * (self.contig_ns_per_dim * dim + self.topk_ns_per_row) * 1e-6
        if not first_pass:
            return self.gather_ms(rows, dim)
        return min(self.gather_ms(rows, dim), self.first_pass_cost_ms(rows, dim, k))

    def gather_ms(self, rows: int, dim: int) -> float:
        """Exact distances of ``rows`` rows gathered by row id, and their top-k."""
        return rows * (self.gather_ns_per_dim * dim + self.topk_ns_per_row) * 1e-6

    def first_pass_cost_ms(self, rows: int, dim: int, k: int) -> float:
        """The 8-bit first pass over ``rows`` gathered rows, then the exact distances of
        its shortlist."""
        per_row = (self.quant_ns_per_dim * dim + self.topk_ns_per_row) * 1e-6
        return self.first_pass_ms + rows * per_row + self.gather_ms(SHORTLIST_PER_K * k, dim)

    # ---------------------------------------------------------------- storage
    def save(self, path: str = DEFAULT_PATH) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            data = dataclasses.asdict(self)
            data.pop("scale", None)
            json.dump(data, f, indent=1)

    @classmethod
    def load(cls, path: str = DEFAULT_PATH) -> CostModel:
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def default(cls) -> CostModel:
        """The calibrated model in ~/.cache/fabric if there is one, else the built-in figures."""
        if os.path.exists(DEFAULT_PATH):
            try:
                return cls.load(DEFAULT_PATH)
            except (OSError, ValueError, TypeError):
                pass
        return cls()


def _best(fn: Any, reps: int) -> float:
    """Low-quantile seconds of fn() over reps runs (robust to a busy, shared machine)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.min(ts))


def calibrate(
    ds: Any = None, *, dim: int = 128, rows: int = 50_000, save_to: str | None = None, seed: int = 0
) -> CostModel:
    """Measure the unit costs here. With a dataset, also time its own HNSW graphs at
    ef 16/64/256 and count the nodes a search visits. Saves to ``save_to`` (default: the
    dataset directory if it has one, else ~/.cache/fabric)."""
    from pyroaring import BitMap

    from indexes.btree import bitmap_of

    rng = np.random.default_rng(seed)
    cm = CostModel()
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    q = rng.standard_normal(dim, dtype=np.float32)
    from indexes.hnsw import VectorIndex
    from indexes.spec import IndexSpec

    vi = VectorIndex("calibration", dim, IndexSpec("hnsw", metric="ip"))
    vi.append(0, x)  # (fits its 8-bit codes)
    t_contig = _best(lambda: vi.distances(q, slice(0, rows)), 20)
    idx = np.sort(rng.choice(rows, rows // 4, replace=False))
    t_gather = _best(lambda: vi.distances(q, idx), 20)
    cm.contig_ns_per_dim = t_contig / rows / dim * 1e9
    cm.gather_ns_per_dim = t_gather / len(idx) / dim * 1e9
    _measure_first_pass(cm, vi, q, idx)
    d = rng.random(rows).astype(np.float32)
    cm.topk_ns_per_row = _best(lambda: np.argpartition(d, 10)[:10], 15) / rows * 1e9
    ids = np.arange(0, rows, 2, dtype=np.uint32)
    cm.bitmap_ns_per_row = _best(lambda: bitmap_of(ids), 15) / len(ids) * 1e9
    keys = rng.random(rows)
    sub = idx.astype(np.int64)
    cm.test_ns_per_row = (
        _best(lambda: bitmap_of(idx[(keys[sub] > 0.3) & (keys[sub] < 0.6)]), 15) / len(idx) * 1e9
    )
    bm = BitMap(ids.tolist())
    contains = bm.__contains__
    calls = [0]

    def cb(label: int) -> bool:
        calls[0] += 1
        return contains(label)

    cm.callback_ns = (
        4 * _best(lambda: [cb(i) for i in range(10_000)], 5) / 10_000 * 1e9
    )  # x4: pybind11
    if ds is not None:
        with ds.lock.read(), ds.graph_lock.read():  # no background fold meanwhile
            _calibrate_dataset(cm, ds, rng)
    cm.calibrated_at = time.time()
    path = save_to or (
        os.path.join(ds.directory, "costs.json")
        if ds is not None and ds.directory
        else DEFAULT_PATH
    )
    cm.save(path)
    if ds is not None:
        ds.cost_model = cm
    return cm


def _calibrate_dataset(cm: CostModel, ds: Any, rng: np.random.Generator) -> None:
    import pyarrow as pa

    from indexes.dataset import sample_rowids

    sample = sample_rowids(ds, 64, rng)
    if len(sample) < 8:
        return
    for vi in ds.vectors.values():  # distances over this dataset's own matrix (cache effects)
        if vi.n >= 10_000:
            q = vi.vectors[int(sample[0])]
            t = _best(lambda vi=vi, q=q: vi.distances(q, slice(0, vi.n)), 10)
            cm.contig_ns_per_dim = t / vi.n / vi.dim * 1e9
            idx = np.sort(rng.choice(vi.n, vi.n // 50, replace=False))
            t = _best(lambda vi=vi, q=q, idx=idx: vi.distances(q, idx), 20)
            cm.gather_ns_per_dim = t / len(idx) / vi.dim * 1e9
            _measure_first_pass(cm, vi, q, np.sort(rng.choice(vi.n, vi.n // 10, replace=False)))
            break
    for col, vi in ds.vectors.items():
        if vi.in_graph >= 1000:
            qs = vi.vectors[sample] + 0.01 * rng.standard_normal(
                (len(sample), vi.dim), dtype=np.float32
            )
            _measure_graph(cm, col, vi, qs)
    _measure_overheads(cm, ds, rng)
    scal = [c for c in ds.scalar_names if c != ds.key][:1] or [ds.key]
    ids = sample_rowids(ds, 4096, rng)
    t = ds._scalar_table().select(scal)
    expr = pa.compute.is_valid(pa.compute.field(scal[0]))
    cm.residual_ns_per_row = (
        _best(
            lambda: (
                t.take(pa.array(ids))
                .append_column("__r", pa.array(ids.astype(np.uint32)))
                .filter(expr)
                .column("__r")
                .to_numpy()
            ),
            5,
        )
        / max(len(ids), 1)
        * 1e9
    )


def _measure_first_pass(cm: CostModel, vi: Any, q: np.ndarray, idx: np.ndarray) -> None:
    """The 8-bit first pass (``indexes.quantized``): its fixed cost (on 256 rows) and its
    cost per row and dimension (the slope up to ``idx``), shortlists included."""
    small = idx[:: max(1, len(idx) // 256)][:256].astype(np.int64)
    big = idx.astype(np.int64)
    if len(big) <= 2 * len(small) or not vi.codes.fitted:
        return
    t_small = _best(lambda: vi.codes.shortlist(q, small, 10, vi.aux), 20)
    t_big = _best(lambda: vi.codes.shortlist(q, big, 10, vi.aux), 10)
    per_row = max(t_big - t_small, 0.0) / (len(big) - len(small))
    cm.quant_ns_per_dim = max(per_row / vi.dim * 1e9, 0.01)
    cm.first_pass_ms = max((t_small - per_row * len(small)) * 1e3, 0.005)


def _measure_graph(cm: CostModel, col: str, vi: Any, qs: np.ndarray) -> None:
    """Fit search time = base + per_ef * ef on this graph, and count visited nodes."""
    pts = []
    for ef, k in (
        (16, 10),
        (64, 10),
        (128, 10),
        (256, 256),
        (1024, 1024),
        (4096, 4096),
    ):  # post-filter: k' = ef
        if k > vi.in_graph:
            continue
        vi.graph.set_ef(ef)
        t = _best(lambda k=k: [vi.graph.knn_query(q, k=k, num_threads=1) for q in qs], 3) / len(qs)
        pts.append((ef, t * 1e3))
    cm.columns[col] = [[float(e), float(m)] for e, m in pts]
    calls = [0]

    def count(label: int) -> bool:
        calls[0] += 1
        return True

    vi.graph.set_ef(64)
    for q in qs[:16]:
        vi.graph.knn_query(q, k=10, num_threads=1, filter=count)
    cm.visits_per_ef = calls[0] / 16 / 64
    # the callback's own price, through hnswlib (pybind11 call + Python), per visited node
    plain = _best(lambda: [vi.graph.knn_query(q, k=10, num_threads=1) for q in qs], 3)
    calls[0] = 0
    filt = _best(lambda: [vi.graph.knn_query(q, k=10, num_threads=1, filter=count) for q in qs], 3)
    per_call = calls[0] / 3 / len(qs)
    cm.callback_ns = max((filt - plain) / len(qs) / max(per_call, 1.0) * 1e9, 50.0)
    vi.graph.set_ef(vi.spec.ef)


def _measure_overheads(cm: CostModel, ds: Any, rng: np.random.Generator) -> None:
    """Fixed cost of every strategy in ``indexes.retrieval.STRATEGIES`` that declares a
    ``calibration``: median(actual - modelled work), unfiltered or on a 2 % B-tree range."""
    from dsl.ast import Binary, Column, Literal
    from indexes.dataset import sample_rowids
    from indexes.retrieval import STRATEGIES

    if not ds.vectors or not ds.btrees or len(ds.live) < 1000:
        return
    col, vi = next(iter(ds.vectors.items()))
    bcol, bt = (
        next((c, b) for c, b in ds.btrees.items() if b.kind != "str")
        if any(b.kind != "str" for b in ds.btrees.values())
        else (None, None)
    )
    if bt is None or bcol is None:
        return
    bt.merge()
    v = bt._to_py(bt.keys[len(bt.keys) // 50])
    where = Binary("<", Column(bcol), Literal(v, "timestamp" if hasattr(v, "tzinfo") else "float"))
    qs = vi.vectors[sample_rowids(ds, 40, rng)]
    saved, ds.cost_model = ds.cost_model, cm
    cm.overheads = {}
    try:
        for s in list(STRATEGIES.values()):  # every registered strategy that says how
            how = s.calibration
            if how is None:
                continue
            extra = []
            w = where if how.filtered else None  # small modelled work
            for q in qs[: how.queries]:
                _, info = ds.search(col, q, 10, w, strategy=s.name, guards=False)
                model = next((a.cost_ms for a in info.alternatives if a.strategy == s.name), None)
                if model is None:  # it does not answer this search
                    continue
                extra.append(
                    # planning is paid by every strategy alike: count it in the fixed cost
                    info.elapsed_ms - (model - cm.overhead_ms)
                )
            if extra:
                cm.overheads[s.name] = min(max(float(np.median(extra)), 0.005), 0.5)
    finally:
        ds.cost_model = saved if saved is not None else cm
        ds.feedback.clear()
