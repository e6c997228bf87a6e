"""Filtered nearest-neighbour retrieval: strategies behind one protocol, and the choice.

A strategy is an object with a ``name``, ``cost(ctx) -> Alternative | None`` (its modelled
cost for this search, or None when it cannot answer it) and ``run(ctx) -> (row ids,
distances)`` (live rows, ascending). Strategies are registered in one table,
``STRATEGIES`` (``register_strategy``); the chooser costs every entry, runs the cheapest
(or the forced one), and ``indexes.cost.calibrate`` measures the fixed cost of every
entry that declares a ``calibration``. ``ctx`` is a frozen ``SearchContext``: the query,
the compiled filter, its candidate count, the cost model and what this filter's guards
did before (a snapshot); strategies read it and write only the search's own explain.
Nothing shared is changed during a search: what it learned (guard outcomes, a measured
cost ratio) comes back as ``RetrievalExplain.feedback`` and ``Dataset.learn`` applies it,
under the dataset's lock.

The built-in strategies:

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
- ``partition``: the per-value graphs / posting matrices of a ``partition=`` column, when
  the filter pins that column to a few values.

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
path either shows its result or hands over (``SearchContext.fall_back``) to the cheapest
strategy that answers exactly (``fallback = True``: the pre-filter, or the pinned values'
posting matrices).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np
from pyroaring import BitMap

from dsl.ast import Expr
from indexes import quantized
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

Hits = tuple[np.ndarray, np.ndarray]  # live row ids (int64) and their distances, ascending

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
SCALE_ALPHA = 0.1  # weight of the newest run in a strategy's cost scale
FIRST_PASS_SCALE = "prefilter+8bit"  # the learned scale of a pre-filter's 8-bit first pass
SCALE_BOUNDS = (0.25, 5.0)


@dataclass
class Alternative:
    strategy: str
    cost_ms: float  # from the cost model, including the expected cost of a guard firing
    detail: str = ""
    base_ms: float = 0.0  # the strategy's own modelled work, before learned scales
    # what the strategy's run needs from its planning (the partition plan), if anything
    plan: Any = field(default=None, repr=False, compare=False)
    # the learned cost scale this estimate used and its run teaches (default: the
    # strategy's name; a pre-filter through the 8-bit first pass has its own)
    scale_key: str = field(default="", compare=False)

    def __str__(self) -> str:
        return f"{self.strategy:<10} est {self.cost_ms:8.3f} ms  {self.detail}"


@dataclass(frozen=True)
class Feedback:
    """What one search learned, for ``learn`` to apply (``Dataset.learn``, one place, under
    the dataset's lock): the search itself changes nothing shared."""

    key: str = ""  # the filter and its bound values
    model: CostModel | None = None  # the cost model the search planned with
    fired: tuple[tuple[str, bool], ...] = ()  # (strategy, its guard fired) per guarded walk
    decay_except: str | None = None  # the optimizer's choice: the others' fire rates decay
    cost: tuple[str, float] | None = None  # (strategy, actual / modelled ms)


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
    # what this search learned, applied by Dataset.learn (never by the search itself)
    feedback: Feedback | None = field(default=None, repr=False, compare=False)

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
    q = query
    if not (  # a contiguous float32 vector (what the executor passes) is used as it is
        type(q) is np.ndarray
        and q.dtype == np.float32
        and q.shape == (vi.dim,)
        and q.flags.c_contiguous
    ):
        try:
            q = np.ascontiguousarray(np.asarray(query, dtype=np.float32).reshape(-1))
        except (TypeError, ValueError) as e:
            raise DatasetError(
                f"nearest({vi.column}): the query vector must be a list or array of numbers: {e}"
            ) from None
    if q.shape[0] != vi.dim:
        raise DatasetError(
            f"nearest({vi.column}): the query vector has {q.shape[0]} dimensions but the column holds {vi.dim}-d vectors"
        )
    if not np.isfinite(q).all():
        raise DatasetError(
            f"nearest({vi.column}): the query vector contains NaN or infinite values"
        )
    if vi.metric == "cosine" and not q.any():
        raise DatasetError(
            f"nearest({vi.column}): the query vector is all zeros, and its cosine distance to "
            "any row is undefined; pass a non-zero vector (or index the column with metric l2 / ip)"
        )
    return q  # type: ignore[no-any-return]


# below this many distances (or fewer than TOPK_SAMPLE_RATIO x k) topk partitions them all
TOPK_SAMPLE_MIN = 4096
TOPK_SAMPLE_RATIO = 16


def topk(ids: np.ndarray, d: np.ndarray, k: int) -> Hits:
    """The k smallest distances, ascending (equal distances by row id); exact.

    On many distances a full ``argpartition`` is the scan's dearest step (0.5-1.5 ms on
    the 50k distances of a growing segment right after a bulk upsert, against ~1 ms for
    the distances themselves): the k-th smallest of a strided sample of about
    ``sqrt(n k)`` distances bounds the k-th smallest of all from above (the sample's k
    smallest are among all), so the rows at or below it hold the exact top-k (ties
    included) and only those, about ``sqrt(n k)`` for data in no adversarial order, are
    partitioned. A bound passing fewer than k rows (NaN) falls back to the full pass."""
    n = len(d)
    if n > k:
        part = pool = None
        if n >= TOPK_SAMPLE_MIN and n >= TOPK_SAMPLE_RATIO * k:
            sample = d[:: max(2, int((n / k) ** 0.5))]
            bound = np.partition(sample, k - 1)[k - 1]
            sel = np.flatnonzero(d <= bound)
            if len(sel) >= k:
                part = sel[np.argpartition(d[sel], k - 1)[:k]] if len(sel) > k else sel
                pool = sel  # every row at or below the k-th distance, ties included
        if part is None:
            part = np.argpartition(d, k - 1)[:k]
        # rows tied at the k-th distance compete by row id: argpartition keeps any of them
        kth = d[part].max()
        if kth == kth:  # (NaN: fewer than k finite distances, no tie to settle)
            tied = np.flatnonzero(d == kth) if pool is None else pool[d[pool] == kth]
            if len(tied) > np.count_nonzero(d[part] == kth):
                below = part[d[part] < kth]
                tied = tied[np.argsort(ids[tied], kind="stable")[: k - len(below)]]
                part = np.concatenate([below, tied])
        ids, d = ids[part], d[part]
    order = np.lexsort((ids, d))
    return ids[order], d[order]


def exact_on(vi: VectorIndex, q: np.ndarray, ids: np.ndarray, k: int, cm: CostModel) -> Hits:
    """Exact top-k over sorted row ids: a contiguous slice when dense enough, else gathered
    -- through the 8-bit first pass (``indexes.quantized``: the same rows and distances,
    a quarter of the bytes gathered) when the cost model says it is cheaper."""
    if not len(ids):
        return ids.astype(np.int64), np.empty(0, np.float32)
    lo, hi = int(ids[0]), int(ids[-1]) + 1
    ids64 = ids.astype(np.int64)
    if _contiguous_wins(hi - lo, len(ids), vi.dim, k, cm):
        d = vi.distances(q, slice(lo, hi))[ids64 - lo]
        return topk(ids64, d, k)
    if _first_pass_wins(len(ids), vi.dim, k, cm):
        short = vi.codes.shortlist(q, ids64, k, vi.aux)
        if short is not None:
            ids64 = short
    return topk(ids64, vi.distances(q, ids64), k)


def _first_pass_wins(rows: int, dim: int, k: int, cm: CostModel) -> bool:
    return quantized.ENABLED and cm.first_pass_cost_ms(rows, dim, k) < cm.gather_ms(rows, dim)


def _contiguous_wins(span: int, rows: int, dim: int, k: int, cm: CostModel) -> bool:
    """One pass over ``span`` contiguous rows costs no more than gathering ``rows``."""
    return cm.exact_ms(span, dim, True) <= cm.exact_ms(rows, dim, False, k, quantized.ENABLED)


def candidates_of(ds: Any, pred: Pred) -> BitMap:
    """``pred``'s rows (``pred.evaluate(None)``), kept on the predicate for the dataset
    version it was evaluated at: a compiled filter is reused while the dataset is unchanged
    (``_compiled``), and turning a 7-value ``in`` over 200k rows into a bitmap again for
    every query cost 0.25-0.6 ms, as much as the exact pass it feeds. The bitmap is shared:
    nothing may change it in place."""
    version = getattr(ds, "version", None)
    memo = getattr(pred, "_rows_memo", None)
    if memo is not None and memo[0] == version and version is not None:
        return memo[1]  # type: ignore[no-any-return]
    rows = pred.evaluate(None)
    pred._rows_memo = (version, rows)  # type: ignore[attr-defined]
    return rows  # type: ignore[no-any-return]


def _merge(a: Hits, b: Hits, k: int) -> Hits:
    if not len(b[0]):
        return topk(a[0], a[1], k) if len(a[0]) > k else a
    return topk(
        np.concatenate([a[0], b[0]]),
        np.concatenate([a[1].astype(np.float32), b[1].astype(np.float32)]),
        k,
    )


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


def _dense(cand: BitMap | None, cm: CostModel, dim: int, k: int) -> bool:
    if cand is None or not cand:
        return False
    return _contiguous_wins(cand.max() - cand.min() + 1, len(cand), dim, k, cm)


# ---------------------------------------------------------------------- the protocol


@dataclass(frozen=True)
class Calibration:
    """How ``indexes.cost.calibrate`` measures a strategy's fixed cost on a dataset:
    median(actual - modelled) over ``queries`` searches forced to it, unfiltered or with a
    2 % B-tree range (``filtered``); guards off."""

    queries: int = 10
    filtered: bool = False


class Strategy(Protocol):
    """One way to answer ``nearest(column) k where filter``; registered in ``STRATEGIES``.

    ``cost`` returns the strategy's ``Alternative`` for this search (modelled ms, scaled by
    ``ctx.cm.scale.get(name, 1.0)``, the learned actual/modelled ratio; ``base_ms`` the
    unscaled figure) or None when it cannot answer it. ``run`` returns live row ids and
    distances, ascending (``topk``), sets ``ctx.info.guarantee`` (``exact`` or ``graph``;
    ``unverified: <why>`` only when ``ctx.info.guards`` is off) and, when it cannot show
    its result is the filtered top-k, returns ``ctx.fall_back(why)`` instead."""

    name: str
    reads_graph: bool = False  # runs under the graph lock (it walks an HNSW graph)
    fallback: bool = False  # answers exactly: a fired guard may hand over to it
    needs_candidates: bool = False  # reads ctx.candidate_set (counted exactly on hand-over)
    calibration: Calibration | None = None  # None: its fixed cost is not measured

    def cost(self, ctx: SearchContext) -> Alternative | None: ...

    def run(self, ctx: SearchContext) -> Hits: ...


#: every strategy the chooser considers, in the order its alternatives are listed (a tie
#: in cost goes to the earlier one); ``register_strategy`` adds one
STRATEGIES: dict[str, Strategy] = {}
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def register_strategy(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Add ``strategy`` to ``STRATEGIES`` (a name already there only with ``replace``);
    ``ds.search(..., strategy=name)`` accepts it and the chooser costs it."""
    name = getattr(strategy, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise DatasetError(
            f"retrieval strategy {strategy!r}: name {name!r} must be lower-case letters, digits "
            "and _ (it is what ds.search(strategy=...) and explain show)"
        )
    missing = [m for m in ("cost", "run") if not callable(getattr(strategy, m, None))]
    if missing:
        raise DatasetError(f"retrieval strategy {name!r} has no {' and no '.join(missing)}()")
    if name in STRATEGIES and not replace:
        raise DatasetError(
            f"retrieval strategy {name!r} is already registered; pass replace=True to replace it"
        )
    STRATEGIES[name] = strategy
    return strategy


def unregister_strategy(name: str) -> None:
    """Remove a strategy registered with ``register_strategy`` (tests, plugins unloading)."""
    if name in BUILTIN:
        raise DatasetError(f"retrieval strategy {name!r} is built in and cannot be removed")
    STRATEGIES.pop(name, None)


_COSTING = Alternative("", math.inf)  # marks a cost being computed (a cycle is an error)


@dataclass(frozen=True, eq=False)
class SearchContext:
    """What one search knows, read by every strategy's ``cost`` and ``run``. Its fields
    never change; derived figures are computed once (cached). ``info`` is this search's
    own explain, the one thing strategies write."""

    ds: Any
    vi: VectorIndex
    cm: CostModel
    q: np.ndarray
    k: int
    ef: int
    where: Expr | None  # the filter as written (dsl.ast), for a strategy that plans from it
    params: Mapping[str, Any]  # its session values
    pred: Pred | None  # the compiled filter (None: none, or every live row passes)
    cand: BitMap | None  # its rows, when planning computed them (cheap or exact)
    candidates: int  # their count (exact or estimated: ``exact_count``)
    exact_count: bool
    n: int  # live rows
    info: RetrievalExplain
    seen: Mapping[str, float]  # strategy -> how often its guard fired for this filter
    strategies: Mapping[str, Strategy]  # the table as it was when the search started
    _costs: dict[str, Alternative | None] = field(default_factory=dict, repr=False)
    _fired: list[tuple[str, bool]] = field(default_factory=list, repr=False)
    # ``[None, ...]`` while ``search`` runs a strategy under the graph lock: the growing
    # segment's scans are recorded after the None (the segment's bounds as the walk saw
    # them) and run once the lock is released
    _later: list[tuple[BitMap | None, Pred | None, int, int] | None] = field(
        default_factory=list, repr=False
    )

    # ------------------------------------------------------------- planning figures
    @property
    def sel(self) -> float:
        return self.candidates / self.n if self.n else 0.0

    @property
    def scale(self) -> Mapping[str, float]:
        return self.cm.scale

    def alternative(self, name: str) -> Alternative | None:
        """``name``'s costed alternative for this search (computed once), None if it does
        not apply."""
        if name in self._costs:
            a = self._costs[name]
            if a is _COSTING:
                raise DatasetError(f"retrieval strategy {name!r}: its cost depends on itself")
            return a
        s = self.strategies.get(name)
        if s is None:
            return None
        self._costs[name] = _COSTING
        a = self._costs[name] = s.cost(self)
        return a

    @cached_property
    def fallback_ms(self) -> float:
        """Cost of the cheapest exact answer a fired guard hands over to."""
        a = self._handover_alt
        return a.cost_ms if a is not None else math.inf

    @cached_property
    def _handover_alt(self) -> Alternative | None:
        best = None
        for s in self.strategies.values():
            a = self.alternative(s.name) if s.fallback else None
            if a is not None and (best is None or a.cost_ms < best.cost_ms):
                best = a
        return best

    @cached_property
    def handover(self) -> Strategy:
        """The strategy a fired guard hands over to: the cheapest that answers exactly."""
        a = self._handover_alt
        return self.strategies[a.strategy] if a is not None else BUILTIN["prefilter"]

    @cached_property
    def growing_ms(self) -> float:
        """Cost of the exact scan of the growing segment that every graph strategy adds (it
        can hold up to ``max_growing`` rows while the background folder catches up): the
        segment's rows passing the filter, scanned contiguously or gathered, whichever
        ``exact_on`` will pick, plus evaluating a predicate that has no candidate set."""
        vi, cm = self.vi, self.cm
        g = vi.n - vi.folded
        if g <= 0:
            return 0.0
        whole = cm.exact_ms(g, vi.dim, True)
        if self.cand is not None:
            return min(
                whole,
                cm.exact_ms(
                    self.cand.range_cardinality(vi.folded, vi.n),
                    vi.dim,
                    False,
                    self.k,
                    quantized.ENABLED,
                ),
            )
        if self.pred is not None:
            n, c = self.n, self.candidates
            hits = int(g * c / n) if n else g
            return materialize_ms(self.pred, cm, n, within=g) + min(
                whole, cm.exact_ms(hits, vi.dim, False, self.k, quantized.ENABLED)
            )
        return whole

    @cached_property
    def materialize_ms(self) -> float:
        """Cost of building the candidate bitmap, when planning did not."""
        if self.pred is None or self.cand is not None:
            return 0.0
        return materialize_ms(self.pred, self.cm, self.n)

    # ------------------------------------------------------------- running
    @cached_property
    def candidate_set(self) -> BitMap | None:
        """The filter's live rows as a bitmap (built once per compiled filter and dataset
        version: ``candidates_of``), None unfiltered."""
        if self.cand is not None or self.pred is None:
            return self.cand
        return candidates_of(self.ds, self.pred)

    def exact(self, ids: np.ndarray) -> Hits:
        """Exact top-k over sorted row ids (a contiguous slice or a gather)."""
        return exact_on(self.vi, self.q, ids, self.k, self.cm)

    def passing(
        self, labels: np.ndarray, dists: np.ndarray, pred: Pred | None, cand: BitMap | None
    ) -> Hits:
        """The graph results passing the filter (``cand`` membership, or ``pred`` tested)."""
        if pred is None or not len(labels):
            return labels, dists
        found = bitmap_of(labels)
        keep = found & cand if cand is not None else pred.evaluate(found & self.ds.live)
        m = np.isin(labels, array_of(keep))
        return labels[m], dists[m]

    def growing(self, cand: BitMap | None, pred: Pred | None) -> Hits:
        """Exact search over the growing segment (rows not yet folded into the graph; at
        most ``max_growing`` of them, by backpressure): unfiltered, one contiguous pass
        masked by liveness; filtered, the segment's candidates, sliced or gathered."""
        vi = self.vi
        lo, hi = vi.folded, vi.n
        if lo >= hi:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        if self._later:  # under the graph lock: scanned once it is released (``search``)
            self._later.append((cand, pred, lo, hi))
            return np.empty(0, np.int64), np.empty(0, np.float32)
        return self.growing_rows(cand, pred, lo, hi)

    def growing_rows(self, cand: BitMap | None, pred: Pred | None, lo: int, hi: int) -> Hits:
        """``growing`` over row ids ``lo..hi-1`` (the segment as the graph walk saw it)."""
        ds, vi = self.ds, self.vi
        if cand is None and pred is None:
            d = vi.distances(self.q, slice(lo, hi))
            live = np.flatnonzero(ds.alive[lo:hi])
            return topk(live + lo, d[live], self.k)
        seg = BitMap()
        seg.add_range(lo, hi)
        seg = seg & cand if cand is not None else pred.evaluate(seg & ds.live)  # type: ignore[union-attr]
        return self.exact(array_of(seg))

    def graph_need(self, cand: BitMap | None, count: int, exact_count: bool) -> int:
        """Rows the graph walk alone must deliver for its part to be the filtered top-k: k,
        or every candidate the graph holds when there are fewer. The growing segment's exact
        matches are never counted: they cannot vouch for the rows the walk missed."""
        vi, k = self.vi, self.k
        if cand is not None:
            g = len(cand) - (cand.range_cardinality(vi.folded, vi.n) if vi.folded < vi.n else 0)
        elif exact_count and vi.folded >= vi.n:
            g = count
        elif exact_count and count < k:
            g = count  # an upper bound on the graph's share: never asks for more than exists
        else:
            g = k
        return max(0, min(k, g, vi.in_graph))

    def observe(self, strategy: str, fired: bool) -> None:
        """Record whether ``strategy``'s guard fired (query feedback, applied after the
        search by ``learn``; not with guards off)."""
        if self.info.guards and self.info.feedback_key:
            self._fired.append((strategy, fired))

    def fall_back(self, why: str) -> Hits:
        """The guard fired: say why and hand over to the cheapest strategy that answers
        exactly (``fallback = True``; the pre-filter unless another costs less). Called by
        a strategy's ``run``, under the lock that run holds."""
        info = self.info
        info.guard = why
        s = self.handover
        info.executed = s.name
        if s.needs_candidates:  # its candidate set, counted exactly now
            rows = self.candidate_set if self.candidate_set is not None else self.ds.live
            info.candidates, info.candidates_exact = len(rows), True
        return s.run(self)

    def feedback(self, forced: bool) -> Feedback:
        """What this search learned: guard outcomes, the decay of the other strategies'
        fire rates (optimizer choices only), and the actual/modelled cost of what ran."""
        info = self.info
        cost = None
        s = ran = None
        if info.executed == info.chosen and info.guard is None:
            s, ran = info.executed, info.elapsed_ms - info.plan_ms
        elif info.walk_ms is not None:  # a walk that fell short still shows what walks cost
            s, ran = info.chosen, info.walk_ms
        if s is not None and ran is not None:
            a = self._costs.get(s)
            if a is not None and a.base_ms > 0:
                cost = (a.scale_key or a.strategy, ran / a.base_ms)
        return Feedback(
            key=info.feedback_key,
            model=self.cm,
            fired=tuple(self._fired),
            decay_except=info.chosen if not forced and self.pred is not None else None,
            cost=cost,
        )


def learn(ds: Any, fb: Feedback | None) -> None:
    """Apply one search's ``Feedback`` to the dataset's guard fire rates and its cost
    model's learned scales. The caller serializes (``Dataset.learn`` holds a lock)."""
    if fb is None:
        return
    for strategy, fired in fb.fired:  # moving average of how often the guard fires
        if len(ds.feedback) > 4096:
            ds.feedback.clear()
        rates = ds.feedback.setdefault(fb.key, {})
        rates[strategy] = 0.7 * rates.get(strategy, 0.0) + 0.3 * (1.0 if fired else 0.0)
    if fb.decay_except is not None:
        rates = ds.feedback.get(fb.key, {})
        for s, p in rates.items():
            if s != fb.decay_except:  # forget slowly, so a strategy that failed gets retried
                rates[s] = p * 0.98
    if fb.cost is not None and fb.model is not None:
        # per strategy, a moving average of actual run time / modelled cost: unit costs are
        # calibrated on a quiet machine (minimum over repetitions) and a loaded one runs
        # memory-bound gathers several times slower than that, graph walks less so
        s, ratio = fb.cost
        sc = fb.model.scale
        lo, hi = SCALE_BOUNDS
        sc[s] = min(hi, max(lo, (1 - SCALE_ALPHA) * sc.get(s, 1.0) + SCALE_ALPHA * ratio))


# ---------------------------------------------------------------------- the strategies


class Exact(Strategy):
    """Distances to every stored row, masked by liveness and the filter."""

    name = "exact"
    calibration = Calibration(queries=10)

    def cost(self, ctx: SearchContext) -> Alternative:
        cm, n = ctx.cm, ctx.ds.n
        scan = cm.fixed_ms(self.name) + cm.exact_ms(n, ctx.vi.dim, True) + ctx.materialize_ms
        return Alternative(
            self.name, scan * ctx.scale.get(self.name, 1.0), f"{n} rows contiguous", scan
        )

    def run(self, ctx: SearchContext) -> Hits:
        ctx.info.guarantee = "exact"
        ds = ctx.ds
        d = ctx.vi.distances(ctx.q, slice(0, ds.n))
        rows = ctx.candidate_set
        if rows is None:  # no filter
            mask = ds.alive[: ds.n]
        else:
            mask = np.zeros(ds.n, dtype=bool)
            mask[array_of(rows).astype(np.int64)] = True
        ids = np.flatnonzero(mask)
        return topk(ids, d[ids], ctx.k)


class Prefilter(Strategy):
    """The candidate bitmap, then exact distances on it (a contiguous slice when the
    candidates are dense in arrival order, a gather otherwise)."""

    name = "prefilter"
    fallback = True
    needs_candidates = True
    calibration = Calibration(queries=40, filtered=True)

    def cost(self, ctx: SearchContext) -> Alternative:
        cm, c, mat = ctx.cm, ctx.candidates, ctx.materialize_ms
        dense = _dense(ctx.cand, cm, ctx.vi.dim, ctx.k)
        pre = (
            cm.fixed_ms(self.name)
            + mat
            + cm.exact_ms(c, ctx.vi.dim, dense, ctx.k, quantized.ENABLED)
        )
        # a first pass over ~20k rows is memory-bound, a small gather mostly Python: on a
        # loaded machine they stray from their calibration by different factors, so each
        # learns its own scale (one shared scale, pulled down by small gathers, kept
        # choosing the first pass over a post-filter that was twice as fast at 10 %)
        first = not dense and _first_pass_wins(c, ctx.vi.dim, ctx.k, cm)
        key = FIRST_PASS_SCALE if first else self.name
        return Alternative(
            self.name,
            pre * ctx.scale.get(key, 1.0),
            f"{c} candidates {'contiguous' if dense else 'gathered'}"
            + (" (8-bit first pass)" if first else "")
            + (f", build set {mat:.3f} ms" if mat else ""),
            pre,
            scale_key=key,
        )

    def run(self, ctx: SearchContext) -> Hits:
        ctx.info.guarantee = "exact"
        rows = ctx.candidate_set
        return ctx.exact(array_of(rows) if rows is not None else array_of(ctx.ds.live))


class Postfilter(Strategy):
    """HNSW walk, then the filter on what it found. The graph's part is trusted only when
    the walk itself kept ``graph_need`` rows. When it kept fewer, the pass rate observed
    in this query's own neighbourhood sizes one wider walk if that is cheaper than exact
    on the candidates; otherwise (or if the wider walk falls short too) exact answers."""

    name = "postfilter"
    reads_graph = True
    calibration = Calibration(queries=40)

    def cost(self, ctx: SearchContext) -> Alternative | None:
        sel, pred, k, cm = ctx.sel, ctx.pred, ctx.k, ctx.cm
        if sel <= 0:
            return None
        kp = k if pred is None else min(KPRIME_CAP, math.ceil(k * OVERSAMPLE / sel) + k)
        efp = max(ctx.ef, kp)
        own = (
            cm.fixed_ms(self.name)
            + cm.hnsw_ms(efp, ctx.vi.dim, ctx.vi.column)
            + check_ms(pred, ctx.cand, kp, cm, ctx.n)
            + ctx.growing_ms
        )
        post = own * ctx.scale.get(self.name, 1.0)
        detail = f"k'={kp} ef={efp}"
        if pred is not None:
            p_fail = 1.0 if kp * sel < k else ctx.seen.get(self.name, 0.0)
            post += p_fail * ctx.fallback_ms
            detail += f", guard fires {p_fail:.0%} -> + exact"
        return Alternative(self.name, post, detail, own)

    def run(self, ctx: SearchContext) -> Hits:
        vi, cm, q, k, pred, cand, info = ctx.vi, ctx.cm, ctx.q, ctx.k, ctx.pred, ctx.cand, ctx.info
        n = max(ctx.n, 1)
        sel = ctx.candidates / n
        kp = k if pred is None else min(KPRIME_CAP, math.ceil(k * OVERSAMPLE / max(sel, 1e-9)) + k)
        need = ctx.graph_need(cand, ctx.candidates, ctx.exact_count)
        t_walk = time.perf_counter()
        labels, dists = vi.knn(q, kp, max(ctx.ef, kp))
        walked = len(labels)
        labels, dists = ctx.passing(labels, dists, pred, cand)
        first_short = len(labels) < need
        if pred is not None:
            info.observed = f"walk of {walked} kept {len(labels)} (pass rate {len(labels) / max(walked, 1):.1%})"
            ctx.observe(self.name, first_short)
        if first_short and pred is not None and walked >= kp and len(labels):
            rate = len(labels) / walked  # this query's neighbourhood, not global selectivity
            kp2 = math.ceil(need * OVERSAMPLE / rate) + k
            wider = cm.hnsw_ms(kp2, vi.dim, vi.column) + check_ms(pred, cand, kp2, cm, n)
            if kp2 <= KPRIME_CAP and wider < ctx.fallback_ms:
                labels, dists = vi.knn(q, kp2, kp2)
                walked = len(labels)
                labels, dists = ctx.passing(labels, dists, pred, cand)
                info.observed = f"{info.observed}; wider walk of {walked} kept {len(labels)}"
        if len(labels) < need:
            why = f"post-filter kept {len(labels)} < {need} rows from the graph"
            info.walk_ms = (time.perf_counter() - t_walk) * 1e3
            if info.guards:
                return ctx.fall_back(why)
            info.guarantee = f"unverified: {why}"
        else:
            info.guarantee = "graph"
        return _merge((labels, dists), ctx.growing(cand, pred), k)


class Insearch(Strategy):
    """hnswlib's ``filter=`` callback testing the candidate bitmap; it counts visited
    nodes and aborts past the number of candidates (Lucene's rule): exact answers then."""

    name = "insearch"
    reads_graph = True
    needs_candidates = True
    calibration = Calibration(queries=10, filtered=True)

    def cost(self, ctx: SearchContext) -> Alternative | None:
        pred, sel, cm, c, n, ef = ctx.pred, ctx.sel, ctx.cm, ctx.candidates, ctx.n, ctx.ef
        if pred is None or sel <= 0:
            return None
        # a filtered HNSW walk keeps going until it holds ef matches: about the work of an
        # unfiltered search with ef / selectivity, plus one Python callback per visit
        dim, col, mat = ctx.vi.dim, ctx.vi.column, ctx.materialize_ms
        s_ins = ctx.scale.get(self.name, 1.0)
        ef_eff = min(n, ef / max(sel, 1e-9))
        visits = min(n, cm.visits_per_ef * ef_eff)
        tried = mat + cm.hnsw_ms(min(c, ef_eff), dim, col) + c * cm.callback_ns * 1e-6
        aborted = tried * s_ins + ctx.fallback_ms
        if visits > c:  # the visit guard aborts and the exact path answers
            ins, base = aborted, 0.0
            note = f"~{visits:.0f} visits > {c} candidates: guard then exact"
        else:
            p = ctx.seen.get(self.name, 0.0)
            walk = (
                mat + cm.hnsw_ms(ef_eff, dim, col) + visits * cm.callback_ns * 1e-6 + ctx.growing_ms
            )
            base = cm.fixed_ms(self.name) + walk
            ins = (1 - p) * walk * s_ins + p * aborted
            note = f"~{visits:.0f} visits, guard fires {p:.0%}"
        return Alternative(self.name, cm.fixed_ms(self.name) * s_ins + ins, note, base)

    def run(self, ctx: SearchContext) -> Hits:
        vi, q, k, ef, info = ctx.vi, ctx.q, ctx.k, ctx.ef, ctx.info
        cand = ctx.candidate_set
        if cand is None:
            labels, dists = vi.knn(q, k, ef)
            need = ctx.graph_need(None, max(ctx.n, 1), True)
            if len(labels) < need:
                why = f"graph walk found {len(labels)} < {need} rows"
                if info.guards:
                    return ctx.fall_back(why)
                info.guarantee = f"unverified: {why}"
            else:
                info.guarantee = "graph"
            return _merge((labels, dists), ctx.growing(None, None), k)
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
        need = ctx.graph_need(cand, len(cand), True)
        short = aborted or len(labels) < need
        ctx.observe(self.name, short)
        if short:
            why = (
                f"visited {calls[0]} nodes > {budget} candidates"
                if aborted
                else f"in-search filter found {len(labels)} < {need} rows in the graph"
            )
            if info.guards:
                return ctx.fall_back(why)
            info.guarantee = f"unverified: {why}"
        else:
            info.guarantee = "graph"
        return _merge((labels, dists), ctx.growing(cand, None), k)


class Partition(Strategy):
    """Walk the graph of every pinned value of the ``partition=`` column (or answer a
    value exactly from its posting matrix when that is cheaper), post-filter the other
    conjuncts inside it, and merge. Each walk must itself keep min(k, that value's
    candidates in its graph) rows; a walk that falls short widens once by its observed
    pass rate or (guards on) the value's candidates answer exactly. Rows not yet in a
    per-value graph are scanned exactly."""

    name = "partition"
    reads_graph = True
    fallback = True  # its exact passes answer a fired guard when cheaper than a gather

    def cost(self, ctx: SearchContext) -> Alternative | None:
        plan = _partition_plan(ctx.vi, ctx.pred)
        if plan is None:
            return None
        memo: dict[Any, tuple[str, float]] = {}  # per pinned value: walk or exact, planned once
        a = _partition_cost(ctx, plan, memo)
        a.base_ms, a.cost_ms = a.cost_ms, a.cost_ms * ctx.scale.get(self.name, 1.0)
        a.plan = (plan, memo)
        return a

    def run(self, ctx: SearchContext) -> Hits:
        a = ctx.alternative(self.name)
        if a is None:
            ctx.info.guard = (
                "no per-value graph answers this filter (declare hnsw partition=<column>)"
            )
            ctx.info.executed = "prefilter"
            return BUILTIN["prefilter"].run(ctx)
        plan, memo = a.plan
        return _partition(ctx, plan, memo)


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


Plan = tuple[list[Any], Pred | None]  # the pinned values' keys, the other conjuncts


def _partition_plan(vi: VectorIndex, pred: Pred | None) -> Plan | None:
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


def _key_plan(ctx: SearchContext, key: Any, rest: Pred | None, kp: int) -> tuple[str, float]:
    """How to answer one pinned value, and at what modelled cost: 'walk' its graph, or
    'exact' on its candidates when that is cheaper (small values, tight other filters);
    '' when the value holds no rows."""
    vi, cm = ctx.vi, ctx.cm
    parts = vi.partitions
    assert parts is not None
    size = parts.size(key)
    if not size:
        return "", 0.0
    # a walk's cost grows with the graph's depth: the main graph's figure at ef 16
    # (mostly the call's fixed price) plus the rest of its cost, scaled
    shrink = max(0.3, math.log2(size + 2) / math.log2(max(vi.in_graph, 2) + 2))
    base = cm.hnsw_ms(16, vi.dim, vi.column)
    walk = (
        base
        + (cm.hnsw_ms(max(PARTITION_EF_FACTOR * ctx.ef, kp), vi.dim, vi.column) - base) * shrink
    )
    # exact: one contiguous pass over the value's posting matrix (deleted rows included,
    # masked), plus a row-mask test of the other conjuncts
    stored = parts.stored(key)
    exact = POSTING_PASS_MS + cm.exact_ms(stored, vi.dim, True)
    if rest is not None:
        walk += check_ms(rest, ctx.cand, kp, cm, ctx.n)
        exact += stored * cm.test_ns_per_row * 1e-6
    if kp >= size or exact < walk:
        return "exact", exact
    return "walk", walk


def _partition_cost(
    ctx: SearchContext, plan: Plan, memo: dict[Any, tuple[str, float]]
) -> Alternative:
    keys, rest = plan
    vi, cm, cand, n = ctx.vi, ctx.cm, ctx.cand, ctx.n
    parts = vi.partitions
    assert parts is not None
    kp = _rest_kp(rest, ctx.k, n)
    walk = 0.0
    walked = 0
    for key in keys:
        how, ms = memo[key] = _key_plan(ctx, key, rest, kp)
        if how:
            walked += how == "walk"
            walk += ms
    tail = vi.n - parts.done
    if tail > 0:  # rows not yet in a per-value graph: exact on their candidates
        hits = (
            cand.range_cardinality(parts.done, vi.n)
            if cand is not None
            else int(tail * ctx.candidates / max(n, 1))
        )
        walk += cm.exact_ms(hits, vi.dim, False, ctx.k, quantized.ENABLED)
    return Alternative(
        "partition",
        cm.fixed_ms("partition") + walk,
        f"{walked} walk(s), {len(keys) - walked} exact pass(es) over the posting matrices "
        f"of {len(keys)} value(s) of {parts.column}, k'={kp}"
        + (f", {tail} rows not in them" if tail > 0 else ""),
    )


def _partition(ctx: SearchContext, plan: Plan, memo: dict[Any, tuple[str, float]]) -> Hits:
    ds, vi, q, k, ef, pred, cand, info = (
        ctx.ds, ctx.vi, ctx.q, ctx.k, ctx.ef, ctx.pred, ctx.cand, ctx.info,
    )  # fmt: skip
    keys, rest = plan
    parts = vi.partitions
    assert parts is not None
    n = max(ctx.n, 1)
    lo = parts.done
    kp = _rest_kp(rest, k, n)
    got: list[Hits] = []
    exact_keys, walks, unverified = 0, 0, []
    keep: list[np.ndarray | None] = []  # row mask of the whole filter, built on first need

    def exact_key(key: Any) -> Hits:
        """The value's rows below ``lo`` (the tail comes below), exactly: one contiguous
        pass over its posting matrix, masked by liveness and the other conjuncts."""
        if rest is not None and not keep:
            bm = ctx.candidate_set
            assert bm is not None  # a filter pins the values
            m = np.zeros(max(ds.n, 1), dtype=bool)
            m[array_of(bm).astype(np.int64)] = True
            keep.append(m)
        return parts.exact(key, q, k, ds.alive, keep[0] if keep else None)

    for key in keys:
        how, _ = memo.get(key) or _key_plan(ctx, key, rest, kp)
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
            labels, dists = ctx.passing(labels, dists, rest, cand)
            need = k
            if cand is not None:
                in_graph = parts.bt.rows([Range.point(key)]) & cand
                need = min(k, in_graph.range_cardinality(0, lo) if lo < vi.n else len(in_graph))
        if len(labels) < need and rest is not None and walked >= kp and len(labels):
            kp2 = math.ceil(need * OVERSAMPLE / (len(labels) / walked)) + k
            if kp2 <= KPRIME_CAP:
                labels, dists = parts.knn(key, q, kp2, kp2)
                labels, dists = ctx.passing(labels, dists, rest, cand)
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
        got.append(ctx.exact(array_of(seg)))
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


#: the built-in strategies (``unregister_strategy`` refuses them)
BUILTIN: dict[str, Strategy] = {
    s.name: s for s in (Exact(), Prefilter(), Postfilter(), Insearch(), Partition())
}
for _s in BUILTIN.values():
    register_strategy(_s)


# ---------------------------------------------------------------------- the chooser


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
    only a strategy that reads a graph (``reads_graph``) takes it for reading, so a
    pre-filter or exact scan never waits behind a folder chunk. Without it the caller
    holds the graph lock already.

    Nothing shared changes here: what the search learned is ``info.feedback``, which the
    caller applies with ``Dataset.learn``."""
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
    table = dict(STRATEGIES)  # a registration meanwhile does not change this search
    if strategy is not None and strategy not in table:
        raise DatasetError(
            f"unknown retrieval strategy {strategy!r}; use one of {', '.join(table)}"
        )
    q = query_vector(vi, query)
    ctx = _plan(ds, vi, q, k, where, params, ef or vi.spec.ef, guards, table)
    info, cm = ctx.info, ctx.cm
    info.alternatives = [a for name in table if (a := ctx.alternative(name)) is not None]
    if cm.scale:
        info.scale = dict(cm.scale)
    if strategy is not None:
        info.chosen, info.forced = strategy, True
    else:
        info.chosen = min(info.alternatives, key=lambda a: a.cost_ms).strategy
    info.plan_ms = (time.perf_counter() - t0) * 1e3
    s = table[info.chosen]
    info.executed = s.name
    if graph_lock is not None and s.reads_graph:
        ctx._later.append(None)
        with graph_lock.read():  # counts read while planning may have moved: costs only
            ids, d = s.run(ctx)
        # the growing segment as the walk saw it, scanned without the graph lock so the
        # folder's next chunk need not wait for it: a row folded meanwhile was not in the
        # walked graph and is in the scanned range (never both, never neither)
        later = ctx._later[1:]
        ctx._later.clear()
        for cand, pred, lo, hi in later:  # type: ignore[misc]
            ids, d = _merge((ids, d), ctx.growing_rows(cand, pred, lo, hi), k)
    else:
        ids, d = s.run(ctx)
    info.actual_rows = len(ids)
    info.elapsed_ms = (time.perf_counter() - t0) * 1e3
    info.feedback = ctx.feedback(forced=strategy is not None)
    return ids, d, info


def _plan(
    ds: Any,
    vi: VectorIndex,
    q: np.ndarray,
    k: int,
    where: Expr | None,
    params: Mapping[str, Any],
    ef: int,
    guards: bool,
    table: Mapping[str, Strategy],
) -> SearchContext:
    """The search's context: the compiled filter and its candidate count (exact from the
    indexes when that is cheap; a filter every live row passes is dropped: it costs what
    no filter costs), the cost model, and this filter's guard history (a snapshot)."""
    cm: CostModel = ds.costs()
    n = len(ds.live)
    ftext = None if where is None else _fkey(where)
    info = RetrievalExplain(column=vi.column, k=k, rows=n, filter=ftext)
    if where is not None and ftext is not None:
        names = _fparams(where)
        info.feedback_key = ftext + (
            "|" + repr(sorted((p, _value_key(params.get(p))) for p in names)) if names else ""
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
            cand = candidates_of(ds, pred)  # cheap enough: make the count exact (and reuse)
            c, exact_count = len(cand), True
        elif exact_count and isinstance(pred, MatchPred):
            cand = candidates_of(ds, pred)
        if exact_count and c == n:  # every live row passes: costs what no filter costs
            pred, cand = None, None
    info.candidates, info.candidates_exact = c, exact_count
    seen = dict(ds.feedback.get(info.feedback_key, {})) if pred is not None else {}
    return SearchContext(
        ds=ds,
        vi=vi,
        cm=cm,
        q=q,
        k=k,
        ef=ef,
        where=where,
        params=params,
        pred=pred,
        cand=cand,
        candidates=c,
        exact_count=exact_count,
        n=n,
        info=info,
        seen=seen,
        strategies=table,
    )


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


def _value_key(v: Any) -> str:
    """A parameter value as exact text for the filter cache and the guard feedback: two
    values get one text only if they are equal. ``repr`` is not that: numpy prints an
    array of more than 1,000 items shortened (``[0, 1, 2, ..., 4997, 4998, 4999]``), so
    two different ``in`` lists shared one compiled filter and the second got the first
    one's rows."""
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject:
            return _value_key(v.tolist())
        digest = hashlib.blake2b(np.ascontiguousarray(v).tobytes(), digest_size=16).hexdigest()
        return f"ndarray({v.dtype.str},{v.shape},{digest})"
    if isinstance(v, np.generic):
        return _value_key(v.item())
    if isinstance(v, list | tuple):
        return "[" + ",".join(_value_key(i) for i in v) + "]"
    if isinstance(v, set | frozenset):
        return "{" + ",".join(sorted(_value_key(i) for i in v)) + "}"
    return f"{type(v).__name__}:{v!r}"


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
