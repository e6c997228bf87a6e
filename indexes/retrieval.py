"""Filtered nearest-neighbour retrieval: four strategies and the cost-based choice.

Strategies (all return the same contract: live row ids and distances, ascending):

- ``postfilter``: HNSW for k' = k * 1.5 / selectivity + k candidates (capped), keep the
  ones passing the filter. Guard: the *graph walk alone* must keep min(k, candidates in
  the graph) rows -- the growing segment's exact matches never count, they cannot vouch
  for rows the walk missed. Short: the pass rate observed in this query's own walk sizes
  one wider walk when that is cheaper than exact, else exact on the candidates answers.
- ``insearch``: HNSW with hnswlib's ``filter=`` callback testing the candidate bitmap.
  Guard: the callback counts visited nodes; once they exceed the number of candidates
  the search is aborted and the exact path answers (Lucene's rule); a walk that found
  fewer than the graph's share of rows goes exact too.
- ``prefilter``: candidate bitmap from B-tree ranges and posting lists (residual
  predicates on the survivors), then exact distances on the candidates: a contiguous
  slice when the candidates are dense in row-id (= arrival) order, a gather otherwise.
- ``exact``: distances to every stored row, masked by liveness and the filter.

The optimizer estimates each one's cost from the calibrated unit costs (``indexes.cost``)
and the predicate's row count -- exact from the indexes when it is cheap -- plus the
observed rate at which each guard fired for this filter and its bound values (query
feedback: a post-filter that keeps failing near the queries means the filter correlates
with the vectors), and
runs the cheapest. ``RetrievalExplain`` records every alternative, the choice, any
guard that fired, the actual rows and time, and ``guarantee``: ``exact`` (distances to
every candidate), ``graph`` (the walk itself held the filtered top-k: as good as the
graph's recall at its ef) or ``unverified: <why>`` -- only with ``guards=False``, which
benchmarks use to see a fixed strategy's raw result. Never silently wrong: a guarded
path either shows its result or falls back to exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pyroaring import BitMap

from dsl.ast import Expr
from indexes.btree import Range, array_of, bitmap_of
from indexes.cost import CostModel
from indexes.filters import (
    AndPred,
    MatchPred,
    NotPred,
    OrPred,
    Pred,
    RangePred,
    ResidualPred,
    compile_filter,
)
from indexes.hnsw import VectorIndex
from indexes.spec import DatasetError

STRATEGIES = ("postfilter", "insearch", "prefilter", "exact", "partition")
# the strategies that read a graph (and the growing segment's bounds ``folded``): they run
# under the graph lock; prefilter and exact read only the vectors and the filter's rows
GRAPH_STRATEGIES = frozenset({"postfilter", "insearch", "partition"})
MAX_PARTITION_VALUES = 64  # an `in` list longer than this is not walked value by value
# a per-value graph is walked with PARTITION_EF_FACTOR x the column's ef: queries are
# usually far from a value the filter pins (that is why it is pinned), and HNSW recall
# drops for such out-of-distribution queries -- one 3k-row Gaussian cluster, 128-d, M=16:
# recall@10 0.905 at ef 128, 0.964-0.970 at 256, 0.99 at 512 (benchmarks/retrieval.py data)
PARTITION_EF_FACTOR = 2
# the Python price of one exact pass over a value's posting matrix beyond its distances
# (einsum call, liveness / conjunct masks, top-k): ~10-15 us measured at a few hundred rows
POSTING_PASS_MS = 0.012
KPRIME_CAP = 4096  # largest post-filter oversampling
OVERSAMPLE = 1.5
MATERIALIZE_FRACTION = (
    0.25  # compute the exact candidate set when its upper bound is below this share
)


@dataclass
class Alternative:
    strategy: str
    cost_ms: float  # from the cost model, including the expected cost of a guard firing
    detail: str = ""
    base_ms: float = 0.0  # the strategy's own modelled work, before learned scales

    def __str__(self) -> str:
        return f"{self.strategy:<10} est {self.cost_ms:8.3f} ms  {self.detail}"


@dataclass
class RetrievalExplain:
    column: str
    k: int
    rows: int
    filter: str | None = None
    candidates: int | None = None
    candidates_exact: bool = False
    alternatives: list[Alternative] = field(default_factory=list)
    chosen: str = ""
    forced: bool = False
    executed: str = ""
    guard: str | None = None
    # what the result is known to be: "exact" (distances to every candidate), "graph"
    # (the graph walk itself held the filtered top-k -- as good as the graph's recall at
    # its ef -- merged with the growing segment's exact matches), or "unverified: <why>"
    # (guards off, benchmarks only: the walk could not show it found the top-k)
    guarantee: str = ""
    observed: str | None = None  # per-query pass rate seen in the graph walk
    walk_ms: float | None = field(default=None, repr=False)  # a failed walk's own time
    scale: dict[str, float] = field(default_factory=dict)  # learned cost factors applied
    actual_rows: int = 0
    visited: int | None = None
    plan_ms: float = 0.0
    elapsed_ms: float = 0.0
    materialize_ms: float = 0.0
    feedback_key: str = field(default="", repr=False)
    guards: bool = field(default=True, repr=False)
    # the exact answer a fired guard falls back to when cheaper than a pre-filter: the
    # pinned values' posting matrices (set by search() when a partition plan exists)
    fallback: Any = field(default=None, repr=False, compare=False)

    @property
    def selectivity(self) -> float | None:
        return None if self.candidates is None or not self.rows else self.candidates / self.rows

    def lines(self) -> list[str]:
        sel = self.selectivity
        out = [f"VectorRetrieval: nearest({self.column}) k={self.k} over {self.rows} rows"]
        if self.filter:
            kind = "exact" if self.candidates_exact else "estimated"
            out.append(f"  filter: {self.filter}")
            out.append(
                f"  candidates: {self.candidates} ({kind}, selectivity {sel:.4%})"
                if sel is not None
                else "  candidates: ?"
            )
        out.append(
            "  alternatives:"
            + (
                " (x learned cost scale: "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.scale.items()))
                + ")"
                if self.scale
                else ""
            )
        )
        for a in sorted(self.alternatives, key=lambda a: a.cost_ms):
            mark = "*" if a.strategy == self.chosen else " "
            out.append(f"   {mark} {a}")
        out.append(f"  chosen: {self.chosen}" + (" (forced)" if self.forced else ""))
        if self.observed:
            out.append(f"  observed: {self.observed}")
        if self.guard:
            out.append(f"  guard: {self.guard} -> ran {self.executed}")
        if self.guarantee:
            out.append(f"  guarantee: {self.guarantee}")
        extra = f", visited {self.visited} nodes" if self.visited is not None else ""
        out.append(
            f"  actual: {self.actual_rows} rows in {self.elapsed_ms:.3f} ms (planning {self.plan_ms:.3f} ms{extra})"
        )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


class _Abort(Exception):
    """Raised from the hnswlib filter callback when the visit budget is exhausted."""


# ---------------------------------------------------------------------- helpers


def query_vector(vi: VectorIndex, query: Any) -> np.ndarray:
    try:
        q = np.asarray(query, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as e:
        raise DatasetError(
            f"nearest({vi.column}): the query vector must be a list or array of numbers: {e}"
        ) from None
    if q.shape[0] != vi.dim:
        raise DatasetError(
            f"nearest({vi.column}): the query vector has {q.shape[0]} dimensions but the column holds {vi.dim}-d vectors"
        )
    if not np.all(np.isfinite(q)):
        raise DatasetError(
            f"nearest({vi.column}): the query vector contains NaN or infinite values"
        )
    return np.ascontiguousarray(q)


def topk(ids: np.ndarray, d: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if len(d) > k:
        part = np.argpartition(d, k - 1)[:k]
        ids, d = ids[part], d[part]
    order = np.lexsort((ids, d))
    return ids[order], d[order]


def exact_on(
    vi: VectorIndex, q: np.ndarray, ids: np.ndarray, k: int, cm: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k over sorted row ids: contiguous slice when dense enough, else gathered."""
    if not len(ids):
        return ids.astype(np.int64), np.empty(0, np.float32)
    lo, hi = int(ids[0]), int(ids[-1]) + 1
    ids64 = ids.astype(np.int64)
    if (hi - lo) * cm.contig_ns_per_dim <= len(ids) * cm.gather_ns_per_dim:
        d = vi.distances(q, slice(lo, hi))[ids64 - lo]
    else:
        d = vi.distances(q, ids64)
    return topk(ids64, d, k)


def _merge(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int
) -> tuple[np.ndarray, np.ndarray]:
    if not len(b[0]):
        return topk(a[0], a[1], k) if len(a[0]) > k else a
    return topk(
        np.concatenate([a[0], b[0]]),
        np.concatenate([a[1].astype(np.float32), b[1].astype(np.float32)]),
        k,
    )


def _growing(
    ds: Any,
    vi: VectorIndex,
    q: np.ndarray,
    k: int,
    cand: BitMap | None,
    pred: Pred | None,
    cm: CostModel,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact search over the growing segment (rows not yet folded into the graph; at most
    ``max_growing`` of them, by backpressure): unfiltered, one contiguous pass masked by
    liveness; filtered, the segment's candidates, sliced or gathered."""
    lo, hi = vi.folded, vi.n
    if lo >= hi:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    if cand is None and pred is None:
        d = vi.distances(q, slice(lo, hi))
        live = np.flatnonzero(ds.alive[lo:hi])
        return topk(live + lo, d[live], k)
    seg = BitMap()
    seg.add_range(lo, hi)
    seg = seg & cand if cand is not None else pred.evaluate(seg & ds.live)  # type: ignore[union-attr]
    return exact_on(vi, q, array_of(seg), k, cm)


def materialize_ms(p: Pred, cm: CostModel, n: int, within: int | None = None) -> float:
    """Rough cost of computing ``p``'s bitmap (within a candidate set of ``within`` rows)."""
    rows = p.estimate().rows
    if isinstance(p, RangePred):
        if within is not None and within <= rows:
            return within * cm.test_ns_per_row * 1e-6
        return rows * cm.bitmap_ns_per_row * 1e-6
    if isinstance(p, MatchPred):
        return 0.003 + rows * 0.3e-6
    if isinstance(p, ResidualPred):
        return (within if within is not None else n) * cm.residual_ns_per_row * 1e-6
    if isinstance(p, AndPred):
        total, w = 0.0, within
        for c in sorted(p.children, key=lambda c: (not c.indexed, c.estimate().rows)):
            total += materialize_ms(c, cm, n, w)
            w = min(w if w is not None else n, c.estimate().rows)
        return total
    if isinstance(p, OrPred):
        return sum(materialize_ms(c, cm, n, within) for c in p.children)
    if isinstance(p, NotPred):
        return n * 1e-6 + materialize_ms(p.child, cm, n, within)
    return n * cm.residual_ns_per_row * 1e-6


def check_ms(p: Pred | None, cand: BitMap | None, rows: int, cm: CostModel, n: int) -> float:
    """Cost of testing ``rows`` HNSW results against the filter."""
    if p is None:
        return 0.0
    if cand is not None:
        return rows * 0.1e-3
    return materialize_ms(p, cm, n, within=rows) + 0.005


# ---------------------------------------------------------------------- the optimizer


def search(
    ds: Any,
    column: str,
    query: Any,
    k: int,
    where: Expr | None,
    params: Mapping[str, Any],
    *,
    strategy: str | None = None,
    ef: int | None = None,
    guards: bool = True,
    graph_lock: Any = None,
) -> tuple[np.ndarray, np.ndarray, RetrievalExplain]:
    """Caller holds the dataset's read lock. ``guards=False`` (benchmarks only) lets a
    forced strategy return what it found instead of switching to exact.

    ``graph_lock`` (the dataset's ``RWLock`` of its graphs): planning runs without it and
    only a strategy that reads a graph (``GRAPH_STRATEGIES``) takes it for reading, so a
    pre-filter or exact scan never waits behind a folder chunk. Without it the caller
    holds the graph lock already."""
    t0 = time.perf_counter()
    vi = ds.vectors.get(column)
    if vi is None:
        hint = (
            f"; hnsw columns: {', '.join(ds.vectors)}"
            if ds.vectors
            else "; declare one with indexes: {col: hnsw}"
        )
        raise DatasetError(f"dataset {ds.name!r}: column {column!r} has no hnsw index{hint}")
    if k <= 0:
        raise DatasetError(f"nearest({column}): k must be positive, got {k}")
    if strategy is not None and strategy not in STRATEGIES:
        raise DatasetError(
            f"unknown retrieval strategy {strategy!r}; use one of {', '.join(STRATEGIES)}"
        )
    q = query_vector(vi, query)
    cm: CostModel = ds.cost_model or CostModel.default()
    ds.cost_model = cm
    ef = ef or vi.spec.ef
    n = len(ds.live)
    ftext = None if where is None else _fkey(where)
    info = RetrievalExplain(column=column, k=k, rows=n, filter=ftext)
    if where is not None and ftext is not None:
        names = _fparams(where)
        info.feedback_key = ftext + (
            "|" + repr(sorted((p, repr(params.get(p))) for p in names)) if names else ""
        )
    info.guards = guards
    pred = _compiled(ds, where, params, ftext, info.feedback_key)
    cand: BitMap | None = None
    if pred is None:
        c, exact_count = n, True
    else:
        est = pred.estimate()
        c, exact_count = est.rows, est.exact
        if not exact_count and est.upper <= MATERIALIZE_FRACTION * n:
            cand = pred.evaluate(None)  # cheap enough: make the count exact (and reuse the set)
            c, exact_count = len(cand), True
        elif exact_count and isinstance(pred, MatchPred):
            cand = pred.evaluate(None)
        if exact_count and c == n:  # every live row passes: costs what no filter costs
            pred, cand = None, None
    info.candidates, info.candidates_exact = c, exact_count
    plan = _partition_plan(vi, pred)
    memo: dict[Any, tuple[str, float]] = {}  # per pinned value: walk or exact, planned once
    part = None
    if plan is not None:
        part = _partition_cost(vi, cm, plan, cand, c, n, k, ef, memo)
        part.base_ms, part.cost_ms = part.cost_ms, part.cost_ms * cm.scale.get("partition", 1.0)
    alts = _costs(
        ds, vi, cm, pred, cand, c, n, k, ef, info.feedback_key, part.cost_ms if part else math.inf
    )
    if part is not None:
        alts["partition"] = part
        if plan is not None and part.cost_ms < alts["prefilter"].cost_ms:
            # a graph walk whose guard fires answers from the posting matrices, not a gather
            info.fallback = lambda: _partition(ds, vi, cm, q, k, ef, pred, cand, plan, info, memo)
    if cm.scale:
        info.scale = dict(cm.scale)
    info.alternatives = list(alts.values())
    if strategy is not None:
        info.chosen, info.forced = strategy, True
    else:
        info.chosen = min(info.alternatives, key=lambda a: a.cost_ms).strategy
    info.plan_ms = (time.perf_counter() - t0) * 1e3
    if graph_lock is not None and info.chosen in GRAPH_STRATEGIES:
        with graph_lock.read():  # counts read while planning may have moved: costs only
            ids, d = _run(ds, vi, cm, q, k, ef, pred, cand, c, exact_count, info, plan, memo)
    else:
        ids, d = _run(ds, vi, cm, q, k, ef, pred, cand, c, exact_count, info, plan, memo)
    if strategy is None and pred is not None:
        for s, p in ds.feedback.get(info.feedback_key, {}).items():
            if s != info.chosen:  # forget slowly, so a strategy that failed gets retried
                ds.feedback[info.feedback_key][s] = p * 0.98
    info.actual_rows = len(ids)
    info.elapsed_ms = (time.perf_counter() - t0) * 1e3
    if info.executed == info.chosen and info.guard is None:
        _learn_cost(cm, info, alts, info.elapsed_ms - info.plan_ms)
    elif info.walk_ms is not None:  # a walk that fell short still shows what walks cost
        _learn_cost(cm, info, alts, info.walk_ms, info.chosen)
    return ids, d, info


SCALE_ALPHA = 0.1  # weight of the newest run in a strategy's cost scale
SCALE_BOUNDS = (0.25, 5.0)


def _learn_cost(
    cm: CostModel,
    info: RetrievalExplain,
    alts: Mapping[str, Alternative],
    ran_ms: float,
    strategy: str | None = None,
) -> None:
    """Keep, per strategy, a moving average of actual run time / modelled cost: unit costs
    are calibrated on a quiet machine (minimum over repetitions) and a loaded one runs
    memory-bound gathers several times slower than that, graph walks less so."""
    a = alts.get(strategy or info.executed)
    if a is None or a.base_ms <= 0:
        return
    old = cm.scale.get(a.strategy, 1.0)
    ratio = ran_ms / a.base_ms
    lo, hi = SCALE_BOUNDS
    cm.scale[a.strategy] = min(hi, max(lo, (1 - SCALE_ALPHA) * old + SCALE_ALPHA * ratio))


def _fkey(where: Expr | None) -> str:
    if where is None:
        return ""
    key = _FKEYS.get(where)
    if key is None:
        if len(_FKEYS) > 1024:
            _FKEYS.clear()
        key = _FKEYS[where] = str(where)
    return key


_FKEYS: dict[Expr, str] = {}


def _fparams(where: Expr) -> set[str]:
    """The filter's session parameters (walking a 64-value ``in`` per query showed up)."""
    names = _FPARAMS.get(where)
    if names is None:
        if len(_FPARAMS) > 1024:
            _FPARAMS.clear()
        names = _FPARAMS[where] = where.params()
    return names


_FPARAMS: dict[Expr, set[str]] = {}


def _compiled(
    ds: Any, where: Expr | None, params: Mapping[str, Any], ftext: str | None, fkey: str
) -> Pred | None:
    """The filter's predicate tree, reused while the dataset is unchanged (``version``):
    compiling a 64-value ``in`` and counting it costs more than the search it plans. A
    filter reading now() is compiled afresh every time (its bounds move)."""
    if where is None:
        return None
    if ftext is None or "now(" in ftext.lower():
        return compile_filter(ds, where, params)
    cache = ds.pred_cache
    key = (fkey or ftext, ds.version)
    pred = cache.get(key)
    if pred is None:
        if len(cache) > 256:
            cache.clear()
        pred = cache[key] = compile_filter(ds, where, params)
    return pred


def _costs(
    ds: Any,
    vi: VectorIndex,
    cm: CostModel,
    pred: Pred | None,
    cand: BitMap | None,
    c: int,
    n: int,
    k: int,
    ef: int,
    fkey: str,
    fallback_ms: float = math.inf,
) -> dict[str, Alternative]:
    """Every strategy's modelled cost; a guard that fires costs the cheaper exact answer:
    the pre-filter, or ``fallback_ms`` (the posting matrices of the pinned values)."""
    dim = vi.dim
    sc = cm.scale  # learned actual / modelled cost per strategy (see _learn_cost)
    grow = _growing_ms(vi, cm, pred, cand, c, n)
    mat = 0.0 if pred is None or cand is not None else materialize_ms(pred, cm, n)
    out: dict[str, Alternative] = {}
    scan = cm.fixed_ms("exact") + cm.exact_ms(ds.n, dim, True) + mat
    out["exact"] = Alternative(
        "exact", scan * sc.get("exact", 1.0), f"{ds.n} rows contiguous", scan
    )
    dense = _dense(cand, cm)
    pre = cm.fixed_ms("prefilter") + mat + cm.exact_ms(c, dim, dense)
    pre_s = pre * sc.get("prefilter", 1.0)
    out["prefilter"] = Alternative(
        "prefilter",
        pre_s,
        f"{c} candidates {'contiguous' if dense else 'gathered'}"
        + (f", build set {mat:.3f} ms" if mat else ""),
        pre,
    )
    sel = c / n if n else 0.0
    if sel <= 0:
        return out
    kp = k if pred is None else min(KPRIME_CAP, math.ceil(k * OVERSAMPLE / sel) + k)
    efp = max(ef, kp)
    own = (
        cm.fixed_ms("postfilter")
        + cm.hnsw_ms(efp, dim, vi.column)
        + check_ms(pred, cand, kp, cm, n)
        + grow
    )
    post = own * sc.get("postfilter", 1.0)
    detail = f"k'={kp} ef={efp}"
    seen = ds.feedback.get(fkey, {}) if pred is not None else {}
    if pred is not None:
        p_fail = 1.0 if kp * sel < k else seen.get("postfilter", 0.0)
        post += p_fail * min(pre_s, fallback_ms)
        detail += f", guard fires {p_fail:.0%} -> + exact"
    out["postfilter"] = Alternative("postfilter", post, detail, own)
    if pred is not None:
        # a filtered HNSW walk keeps going until it holds ef matches: about the work of an
        # unfiltered search with ef / selectivity, plus one Python callback per visit
        s_ins = sc.get("insearch", 1.0)
        ef_eff = min(n, ef / max(sel, 1e-9))
        visits = min(n, cm.visits_per_ef * ef_eff)
        tried = mat + cm.hnsw_ms(min(c, ef_eff), dim, vi.column) + c * cm.callback_ns * 1e-6
        aborted = tried * s_ins + min(pre_s, fallback_ms)
        if visits > c:  # the visit guard aborts and the exact path answers
            ins, base = aborted, 0.0
            note = f"~{visits:.0f} visits > {c} candidates: guard then exact"
        else:
            p = seen.get("insearch", 0.0)
            walk = mat + cm.hnsw_ms(ef_eff, dim, vi.column) + visits * cm.callback_ns * 1e-6 + grow
            base = cm.fixed_ms("insearch") + walk
            ins = (1 - p) * walk * s_ins + p * aborted
            note = f"~{visits:.0f} visits, guard fires {p:.0%}"
        out["insearch"] = Alternative("insearch", cm.fixed_ms("insearch") * s_ins + ins, note, base)
    return out


def _growing_ms(
    vi: VectorIndex, cm: CostModel, pred: Pred | None, cand: BitMap | None, c: int, n: int
) -> float:
    """Cost of the exact scan of the growing segment that every graph strategy adds (it
    can hold up to ``max_growing`` rows while the background folder catches up): the
    segment's rows passing the filter, scanned contiguously or gathered, whichever
    ``exact_on`` will pick, plus evaluating a predicate that has no candidate set."""
    g = vi.n - vi.folded
    if g <= 0:
        return 0.0
    whole = cm.exact_ms(g, vi.dim, True)
    if cand is not None:
        return min(whole, cm.exact_ms(cand.range_cardinality(vi.folded, vi.n), vi.dim, False))
    if pred is not None:
        hits = int(g * c / n) if n else g
        return materialize_ms(pred, cm, n, within=g) + min(whole, cm.exact_ms(hits, vi.dim, False))
    return whole


def _dense(cand: BitMap | None, cm: CostModel) -> bool:
    if cand is None or not cand:
        return False
    span = cand.max() - cand.min() + 1
    return span * cm.contig_ns_per_dim <= len(cand) * cm.gather_ns_per_dim


def _observe(ds: Any, info: RetrievalExplain, strategy: str, fired: bool) -> None:
    """Query feedback: moving average of how often ``strategy``'s guard fires for this
    filter with these bound values."""
    if not info.guards or not info.feedback_key:
        return
    if len(ds.feedback) > 4096:
        ds.feedback.clear()
    fb = ds.feedback.setdefault(info.feedback_key, {})
    fb[strategy] = 0.7 * fb.get(strategy, 0.0) + 0.3 * (1.0 if fired else 0.0)


def _run(
    ds: Any,
    vi: VectorIndex,
    cm: CostModel,
    q: np.ndarray,
    k: int,
    ef: int,
    pred: Pred | None,
    cand: BitMap | None,
    c: int,
    exact_count: bool,
    info: RetrievalExplain,
    plan: tuple[list[Any], Pred | None] | None = None,
    memo: dict[Any, tuple[str, float]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    s = info.chosen
    info.executed = s
    if s == "partition":
        if plan is not None:
            return _partition(ds, vi, cm, q, k, ef, pred, cand, plan, info, memo)
        info.guard = "no per-value graph answers this filter (declare hnsw partition=<column>)"
        s = info.executed = "prefilter"
    if s == "exact":
        info.guarantee = "exact"
        return _exact_scan(ds, vi, q, k, pred, cand)
    if pred is not None and cand is None and s in ("prefilter", "insearch"):
        cand = pred.evaluate(None)
    if s == "prefilter":
        info.guarantee = "exact"
        return exact_on(vi, q, array_of(cand) if cand is not None else array_of(ds.live), k, cm)
    if s == "insearch":
        return _insearch(ds, vi, cm, q, k, ef, cand, info)
    return _postfilter(ds, vi, cm, q, k, ef, pred, cand, c, exact_count, info)


def _exact_scan(
    ds: Any, vi: VectorIndex, q: np.ndarray, k: int, pred: Pred | None, cand: BitMap | None
) -> tuple[np.ndarray, np.ndarray]:
    d = vi.distances(q, slice(0, ds.n))
    if pred is None:
        mask = ds.alive[: ds.n]
    else:
        bm = cand if cand is not None else pred.evaluate(None)
        mask = np.zeros(ds.n, dtype=bool)
        mask[array_of(bm).astype(np.int64)] = True
    ids = np.flatnonzero(mask)
    return topk(ids, d[ids], k)


def _graph_need(
    vi: VectorIndex, k: int, cand: BitMap | None, c: int, exact_count: bool, n: int
) -> int:
    """Rows the graph walk alone must deliver for its part to be the filtered top-k: k, or
    every candidate the graph holds when there are fewer. The growing segment's exact
    matches are never counted: they cannot vouch for the rows the walk missed."""
    if cand is not None:
        g = len(cand) - (cand.range_cardinality(vi.folded, vi.n) if vi.folded < vi.n else 0)
    elif exact_count and vi.folded >= vi.n:
        g = c
    elif exact_count and c < k:
        g = c  # an upper bound on the graph's share: never asks for more than exists
    else:
        g = k
    return max(0, min(k, g, vi.in_graph))


def _keep(
    ds: Any, labels: np.ndarray, dists: np.ndarray, pred: Pred | None, cand: BitMap | None
) -> tuple[np.ndarray, np.ndarray]:
    if pred is None or not len(labels):
        return labels, dists
    found = bitmap_of(labels)
    keep = found & cand if cand is not None else pred.evaluate(found & ds.live)
    m = np.isin(labels, array_of(keep))
    return labels[m], dists[m]


def _fallback(
    ds: Any,
    vi: VectorIndex,
    cm: CostModel,
    q: np.ndarray,
    k: int,
    pred: Pred | None,
    cand: BitMap | None,
    info: RetrievalExplain,
    why: str,
) -> tuple[np.ndarray, np.ndarray]:
    info.guard = why
    if info.fallback is not None:  # the pinned values' posting matrices: cheaper, exact
        info.executed = "partition"
        return info.fallback()  # type: ignore[no-any-return]
    info.executed = "prefilter"
    info.guarantee = "exact"
    if cand is None:
        cand = pred.evaluate(None) if pred is not None else ds.live
    info.candidates, info.candidates_exact = len(cand), True
    return exact_on(vi, q, array_of(cand), k, cm)


def _alt_ms(info: RetrievalExplain, strategy: str) -> float:
    return next((a.cost_ms for a in info.alternatives if a.strategy == strategy), math.inf)


def _postfilter(
    ds: Any,
    vi: VectorIndex,
    cm: CostModel,
    q: np.ndarray,
    k: int,
    ef: int,
    pred: Pred | None,
    cand: BitMap | None,
    c: int,
    exact_count: bool,
    info: RetrievalExplain,
) -> tuple[np.ndarray, np.ndarray]:
    """HNSW walk, then the filter on what it found. The graph's part is trusted only when
    the walk itself kept ``_graph_need`` rows. When it kept fewer, the pass rate observed
    in this query's own neighbourhood sizes one wider walk if that is cheaper than exact
    on the candidates; otherwise (or if the wider walk falls short too) exact answers."""
    n = max(len(ds.live), 1)
    sel = c / n
    kp = k if pred is None else min(KPRIME_CAP, math.ceil(k * OVERSAMPLE / max(sel, 1e-9)) + k)
    need = _graph_need(vi, k, cand, c, exact_count, n)
    t_walk = time.perf_counter()
    labels, dists = vi.knn(q, kp, max(ef, kp))
    walked = len(labels)
    labels, dists = _keep(ds, labels, dists, pred, cand)
    first_short = len(labels) < need
    if pred is not None:
        info.observed = (
            f"walk of {walked} kept {len(labels)} (pass rate {len(labels) / max(walked, 1):.1%})"
        )
        _observe(ds, info, "postfilter", first_short)
    if first_short and pred is not None and walked >= kp and len(labels):
        rate = len(labels) / walked  # this query's neighbourhood, not global selectivity
        kp2 = math.ceil(need * OVERSAMPLE / rate) + k
        wider = cm.hnsw_ms(kp2, vi.dim, vi.column) + check_ms(pred, cand, kp2, cm, n)
        exact_ms = min(
            _alt_ms(info, "prefilter"),
            _alt_ms(info, "partition") if info.fallback is not None else math.inf,
        )
        if kp2 <= KPRIME_CAP and wider < exact_ms:
            labels, dists = vi.knn(q, kp2, kp2)
            walked = len(labels)
            labels, dists = _keep(ds, labels, dists, pred, cand)
            info.observed = f"{info.observed}; wider walk of {walked} kept {len(labels)}"
    if len(labels) < need:
        why = f"post-filter kept {len(labels)} < {need} rows from the graph"
        info.walk_ms = (time.perf_counter() - t_walk) * 1e3
        if info.guards:
            return _fallback(ds, vi, cm, q, k, pred, cand, info, why)
        info.guarantee = f"unverified: {why}"
    else:
        info.guarantee = "graph"
    return _merge((labels, dists), _growing(ds, vi, q, k, cand, pred, cm), k)


def _insearch(
    ds: Any,
    vi: VectorIndex,
    cm: CostModel,
    q: np.ndarray,
    k: int,
    ef: int,
    cand: BitMap | None,
    info: RetrievalExplain,
) -> tuple[np.ndarray, np.ndarray]:
    n = max(len(ds.live), 1)
    if cand is None:
        labels, dists = vi.knn(q, k, ef)
        need = _graph_need(vi, k, None, n, True, n)
        if len(labels) < need:
            why = f"graph walk found {len(labels)} < {need} rows"
            if info.guards:
                return _fallback(ds, vi, cm, q, k, None, None, info, why)
            info.guarantee = f"unverified: {why}"
        else:
            info.guarantee = "graph"
        return _merge((labels, dists), _growing(ds, vi, q, k, None, None, cm), k)
    budget = len(cand) if info.guards else math.inf
    contains = cand.__contains__
    calls = [0]

    def accept(label: int) -> bool:
        calls[0] += 1
        if calls[0] > budget:
            raise _Abort
        return contains(label)

    try:
        labels, dists = vi.knn(q, k, ef, filter=accept)
        aborted = False
    except _Abort:
        labels, dists, aborted = np.empty(0, np.int64), np.empty(0, np.float32), True
    info.visited = calls[0]
    need = _graph_need(vi, k, cand, len(cand), True, n)
    short = aborted or len(labels) < need
    _observe(ds, info, "insearch", short)
    if short:
        why = (
            f"visited {calls[0]} nodes > {budget} candidates"
            if aborted
            else f"in-search filter found {len(labels)} < {need} rows in the graph"
        )
        if info.guards:
            return _fallback(ds, vi, cm, q, k, None, cand, info, why)
        info.guarantee = f"unverified: {why}"
    else:
        info.guarantee = "graph"
    return _merge((labels, dists), _growing(ds, vi, q, k, cand, None, cm), k)


# ---------------------------------------------------------------------- per-value graphs


def _pinned(p: Pred, column: str) -> list[Any] | None:
    """Keys of the values ``p`` pins ``column`` to (an ``=`` or ``in`` on it), else None."""
    if not isinstance(p, RangePred) or p.column != column:
        return None
    out = []
    for r in p.ranges:
        if not (r.lo_inclusive and r.hi_inclusive) or r.lo is None or r.lo != r.hi:
            return None
        out.append(p.bt.key_of(r.lo))
    return out if len(out) <= MAX_PARTITION_VALUES else None


def _partition_plan(vi: VectorIndex, pred: Pred | None) -> tuple[list[Any], Pred | None] | None:
    """(values, the other conjuncts) when the filter pins the partition column."""
    if vi.partitions is None or pred is None:
        return None
    col = vi.partitions.column
    keys = _pinned(pred, col)
    if keys is not None:
        return keys, None
    if isinstance(pred, AndPred):
        for i, c in enumerate(pred.children):
            keys = _pinned(c, col)
            if keys is not None:
                rest = [x for j, x in enumerate(pred.children) if j != i]
                return keys, rest[0] if len(rest) == 1 else AndPred(pred.ds, rest)
    return None


def _rest_kp(rest: Pred | None, k: int, n: int) -> int:
    if rest is None:
        return k
    sel = rest.estimate().rows / max(n, 1)
    return min(KPRIME_CAP, math.ceil(k * OVERSAMPLE / max(sel, 1e-9)) + k)


def _key_plan(
    vi: VectorIndex,
    cm: CostModel,
    key: Any,
    rest: Pred | None,
    cand: BitMap | None,
    kp: int,
    ef: int,
    n: int,
) -> tuple[str, float]:
    """How to answer one pinned value, and at what modelled cost: 'walk' its graph, or
    'exact' on its candidates when that is cheaper (small values, tight other filters);
    '' when the value holds no rows."""
    parts = vi.partitions
    assert parts is not None
    size = parts.size(key)
    if not size:
        return "", 0.0
    # a walk's cost grows with the graph's depth: the main graph's figure at ef 16
    # (mostly the call's fixed price) plus the rest of its cost, scaled
    shrink = max(0.3, math.log2(size + 2) / math.log2(max(vi.in_graph, 2) + 2))
    base = cm.hnsw_ms(16, vi.dim, vi.column)
    walk = base + (cm.hnsw_ms(max(PARTITION_EF_FACTOR * ef, kp), vi.dim, vi.column) - base) * shrink
    # exact: one contiguous pass over the value's posting matrix (deleted rows included,
    # masked), plus a row-mask test of the other conjuncts
    stored = parts.stored(key)
    exact = POSTING_PASS_MS + cm.exact_ms(stored, vi.dim, True)
    if rest is not None:
        walk += check_ms(rest, cand, kp, cm, n)
        exact += stored * cm.test_ns_per_row * 1e-6
    if kp >= size or exact < walk:
        return "exact", exact
    return "walk", walk


def _partition_cost(
    vi: VectorIndex,
    cm: CostModel,
    plan: tuple[list[Any], Pred | None],
    cand: BitMap | None,
    c: int,
    n: int,
    k: int,
    ef: int,
    memo: dict[Any, tuple[str, float]] | None = None,
) -> Alternative:
    keys, rest = plan
    memo = {} if memo is None else memo
    parts = vi.partitions
    assert parts is not None
    kp = _rest_kp(rest, k, n)
    walk = 0.0
    walked = 0
    for key in keys:
        how, ms = memo[key] = _key_plan(vi, cm, key, rest, cand, kp, ef, n)
        if how:
            walked += how == "walk"
            walk += ms
    tail = vi.n - parts.done
    if tail > 0:  # rows not yet in a per-value graph: exact on their candidates
        hits = (
            cand.range_cardinality(parts.done, vi.n)
            if cand is not None
            else int(tail * c / max(n, 1))
        )
        walk += cm.exact_ms(hits, vi.dim, False)
    return Alternative(
        "partition",
        cm.fixed_ms("partition") + walk,
        f"{walked} walk(s), {len(keys) - walked} exact pass(es) over the posting matrices "
        f"of {len(keys)} value(s) of {parts.column}, k'={kp}"
        + (f", {tail} rows not in them" if tail > 0 else ""),
    )


def _partition(
    ds: Any,
    vi: VectorIndex,
    cm: CostModel,
    q: np.ndarray,
    k: int,
    ef: int,
    pred: Pred | None,
    cand: BitMap | None,
    plan: tuple[list[Any], Pred | None],
    info: RetrievalExplain,
    memo: dict[Any, tuple[str, float]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Walk the graph of every pinned value, post-filter the other conjuncts inside it, and
    merge. Each walk must itself keep min(k, that value's candidates in its graph) rows;
    a walk that falls short widens once by its observed pass rate or (guards on) the
    value's candidates answer exactly. Rows not yet in a per-value graph are scanned
    exactly."""
    keys, rest = plan
    parts = vi.partitions
    assert parts is not None
    n = max(len(ds.live), 1)
    lo = parts.done
    kp = _rest_kp(rest, k, n)
    got: list[tuple[np.ndarray, np.ndarray]] = []
    exact_keys, walks, unverified = 0, 0, []
    keep: list[np.ndarray | None] = []  # row mask of the whole filter, built on first need

    def exact_key(key: Any) -> tuple[np.ndarray, np.ndarray]:
        """The value's rows below ``lo`` (the tail comes below), exactly: one contiguous
        pass over its posting matrix, masked by liveness and the other conjuncts."""
        if rest is not None and not keep:
            bm = cand if cand is not None else pred.evaluate(None)  # type: ignore[union-attr]
            m = np.zeros(max(ds.n, 1), dtype=bool)
            m[array_of(bm).astype(np.int64)] = True
            keep.append(m)
        return parts.exact(key, q, k, ds.alive, keep[0] if keep else None)

    for key in keys:
        how, _ = (memo or {}).get(key) or _key_plan(vi, cm, key, rest, cand, kp, ef, n)
        if not how:
            continue
        if how == "exact":
            got.append(exact_key(key))
            continue
        size = parts.size(key)
        labels, dists = parts.knn(key, q, kp, max(PARTITION_EF_FACTOR * ef, kp))
        walks += 1
        walked = len(labels)
        if rest is None:
            need = min(k, size)
        else:
            labels, dists = _keep(ds, labels, dists, rest, cand)
            need = k
            if cand is not None:
                in_graph = parts.bt.rows([Range.point(key)]) & cand
                need = min(k, in_graph.range_cardinality(0, lo) if lo < vi.n else len(in_graph))
        if len(labels) < need and rest is not None and walked >= kp and len(labels):
            kp2 = math.ceil(need * OVERSAMPLE / (len(labels) / walked)) + k
            if kp2 <= KPRIME_CAP:
                labels, dists = parts.knn(key, q, kp2, kp2)
                labels, dists = _keep(ds, labels, dists, rest, cand)
        if len(labels) < need:
            if not info.guards:
                unverified.append(f"{key!r} kept {len(labels)} < {need}")
            else:  # exact on this value's candidates below ``lo``
                labels, dists = exact_key(key)
                exact_keys += 1
        got.append((labels, dists))
    if lo < vi.n:  # rows not yet in a per-value graph
        seg = BitMap()
        seg.add_range(lo, vi.n)
        seg = seg & cand if cand is not None else pred.evaluate(seg & ds.live)  # type: ignore[union-attr]
        got.append(exact_on(vi, q, array_of(seg), k, cm))
    if exact_keys:
        short = f"{exact_keys} of {len(keys)} value walk(s) fell short: exact on their candidates"
        info.guard = f"{info.guard}; {short}" if info.guard else short
    info.guarantee = (
        f"unverified: {'; '.join(unverified)}"
        if unverified
        else "graph"
        if walks > exact_keys
        else "exact"
    )
    if not got:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    ids = np.concatenate([g[0] for g in got])
    d = np.concatenate([g[1].astype(np.float32) for g in got])
    return topk(ids, d, k)
