"""Keyword relevance (BM25 over the inverted index) and hybrid ranking (reciprocal-rank
fusion of a vector and a keyword arm, with an optional recency decay).

BM25 is the Lucene / Robertson form, with the statistics the inverted index keeps exactly
as rows are upserted and deleted (``indexes.inverted``)::

    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    score(d, q) = sum over distinct t in q of
                  idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * len(d) / avgdl))

``N`` is the number of live rows, ``df`` the rows holding the token, ``len(d)`` the
row's token count and ``avgdl`` the mean over live rows; ``k1 = 1.2``, ``b = 0.75``.
Tokens are ``match()``'s (lower-cased ``\\w+`` words); a token repeated in the query
counts once. A row scores only if it holds a query token. Filters (``where``) choose
which rows may be returned; they never change ``N``, ``df`` or ``avgdl`` (as in Lucene
and Elasticsearch, where filters do not score).

Reciprocal-rank fusion (Cormack et al. 2009; Spice.ai's ``rrf``, Pathway's
``HybridIndex``)::

    rrf(d) = sum over arms holding d of 1 / (rrf_k + rank_arm(d))      rank from 1
    score(d) = rrf(d) * 0.5 ** (max(0, now - ts(d)) / half_life)         with recency

Each arm ranks its own top k (the vector arm by the retrieval optimizer of
``indexes.retrieval``, the keyword arm by BM25, with the same ``where``); the union is
fused and the best ``limit`` rows are returned, highest score first (ties: nearer the
top of the vector arm, then of the keyword arm, then row id). A row whose timestamp is
null decays to 0.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from connectors.arrow_expr import match_tokens
from dsl.ast import Expr
from indexes.btree import array_of, bitmap_of
from indexes.spec import DatasetError

K1 = 1.2
B = 0.75
RRF_K = 60
#: modelled cost of scoring one posting entry (numpy gather + arithmetic + bincount)
SCORE_NS_PER_ENTRY = 60.0
NOW_PARAM = "__now"  # fabric.physical.planner.NOW_PARAM: the query's now(), bound once


def query_tokens(text: str) -> list[str]:
    """The distinct tokens of a keyword query, in order (``match()``'s tokenizer)."""
    return list(dict.fromkeys(match_tokens(text)))


def corpus_statistics(ds: Any, column: str, tokens: Sequence[str]) -> dict[str, Any]:
    """What BM25 needs of a dataset's whole corpus for ``tokens``: ``docs`` (N),
    ``total_len`` and each token's ``df``. Every row lives in one shard, so a sharded
    dataset's statistics are its shards' added up (``add_corpus``), and scoring each
    shard with them (``bm25(..., corpus=)``) gives every row the score one dataset
    holding all the rows would."""
    inv = ds.inverted.get(column)
    if inv is None:
        return {"docs": 0, "total_len": 0, "df": {}}
    return {
        "docs": int(inv.docs),
        "total_len": int(inv.total_len),
        "df": {t: len(inv.postings.get(t, ())) for t in tokens},
    }


def add_corpus(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The corpus statistics of the union of disjoint row sets (``corpus_statistics``)."""
    df: dict[str, int] = {}
    for p in parts:
        for t, n in p["df"].items():
            df[t] = df.get(t, 0) + int(n)
    return {
        "docs": sum(int(p["docs"]) for p in parts),
        "total_len": sum(int(p["total_len"]) for p in parts),
        "df": df,
    }


def bm25(
    inv: Any,
    tokens: Sequence[str],
    within: BitMap | None = None,
    k1: float = K1,
    b: float = B,
    corpus: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, BM25 scores) of the rows holding a token, restricted to ``within``;
    row ids ascending, scores float64. ``corpus`` (``corpus_statistics``, of a larger
    corpus this index holds a part of): N, avgdl and df from it instead of this index."""
    n = inv.docs if corpus is None else int(corpus["docs"])
    if n <= 0 or not tokens:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    total_len = inv.total_len if corpus is None else int(corpus["total_len"])
    avgdl = total_len / n if total_len else 1.0
    bms, ids_parts, score_parts = [], [], []
    for t in tokens:
        bm = inv.postings.get(t)
        if not bm:
            continue
        df = len(bm) if corpus is None else int(corpus["df"].get(t, len(bm)))
        idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
        if within is not None:
            bm = bm & within
            if not bm:
                continue
        ids = array_of(bm)
        tf = inv.term_freqs(t, ids)
        norm = k1 * (1.0 - b + b * inv.doclen[ids] / avgdl)
        bms.append(bm)
        ids_parts.append(ids.astype(np.int64))
        score_parts.append(idf * tf * (k1 + 1.0) / (tf + norm))
    if not ids_parts:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    if len(ids_parts) == 1:
        return ids_parts[0], score_parts[0]
    # the sum per row: a dense accumulator by row id (each term's ids are distinct, so a
    # fancy-index add is exact) when the postings are a fair share of the id range, else
    # a sort; the union of the bitmaps gives the rows, ascending
    uniq = array_of(BitMap.union(*bms)).astype(np.int64)
    top_id = int(uniq[-1]) + 1
    if sum(len(x) for x in ids_parts) * 16 >= top_id:
        acc = np.zeros(top_id)
        for ids, sc in zip(ids_parts, score_parts):
            acc[ids] += sc
        return uniq, acc[uniq]
    pos = np.concatenate([np.searchsorted(uniq, ids) for ids in ids_parts])
    return uniq, np.bincount(pos, weights=np.concatenate(score_parts), minlength=len(uniq))


def top(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (score descending, then row id ascending)."""
    if len(ids) > 4 * k:
        part = np.argpartition(-scores, k - 1)[:k]
        cut = scores[part].min()  # keep every tie at the cut, so the order is deterministic
        keep = np.flatnonzero(scores >= cut)
        ids, scores = ids[keep], scores[keep]
    order = np.lexsort((ids, -scores))[:k]
    return ids[order], scores[order]


# ---------------------------------------------------------------- the keyword arm


@dataclass
class KeywordExplain:
    column: str
    query: str
    k: int
    rows: int
    terms: list[tuple[str, int]] = field(default_factory=list)  # (token, df)
    term_rows: int = 0  # rows holding a query token
    filter: str | None = None
    alternatives: list[tuple[str, float, str]] = field(default_factory=list)
    chosen: str = ""
    forced: bool = False
    scored: int = 0
    checked: int = 0
    actual_rows: int = 0
    plan_ms: float = 0.0
    elapsed_ms: float = 0.0
    guarantee: str = "exact"

    @property
    def executed(self) -> str:
        return self.chosen

    def lines(self) -> list[str]:
        out = [
            f"KeywordRetrieval: bm25({self.column}, {self.query!r}) k={self.k} over {self.rows} "
            f"rows (k1={K1} b={B})"
        ]
        terms = ", ".join(f"{t} (df {d})" for t, d in self.terms) or "(none)"
        out.append(f"  terms: {terms}; {self.term_rows} rows hold a term")
        if self.filter:
            out.append(f"  filter: {self.filter}")
        if self.alternatives:
            out.append("  alternatives:")
            for name, ms, detail in sorted(self.alternatives, key=lambda a: a[1]):
                mark = "*" if name == self.chosen else " "
                out.append(f"   {mark} {name:<10} est {ms:8.3f} ms  {detail}")
        out.append(f"  chosen: {self.chosen}" + (" (forced)" if self.forced else ""))
        out.append(
            f"  actual: {self.actual_rows} rows in {self.elapsed_ms:.3f} ms "
            f"(scored {self.scored}, filter checked {self.checked}; planning {self.plan_ms:.3f} ms)"
        )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


KEYWORD_STRATEGIES = ("prefilter", "postfilter")


def keyword_search(
    ds: Any,
    column: str,
    text: str,
    k: int,
    where: Expr | None,
    params: Mapping[str, Any],
    *,
    strategy: str | None = None,
    corpus: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray, KeywordExplain]:
    """The k rows with the highest BM25 score for ``text`` among live rows satisfying
    ``where``. Caller holds the dataset's read lock. Both strategies are exact:
    ``prefilter`` evaluates the filter on the rows holding a query token, then scores the
    survivors; ``postfilter`` scores every such row and tests the filter on the best ones,
    a growing chunk at a time, until k pass (cheaper when the filter passes most rows
    and costs per row, e.g. a residual over the text). ``corpus``: score with a larger
    corpus's N, avgdl and df (a shard of a sharded dataset; ``corpus_statistics``)."""
    from indexes.cost import CostModel
    from indexes.filters import compile_filter
    from indexes.retrieval import materialize_ms

    t0 = time.perf_counter()
    inv = ds.inverted.get(column)
    if inv is None:
        have = ", ".join(ds.inverted) or "none"
        raise DatasetError(
            f"dataset {ds.name!r}: column {column!r} has no inverted index (inverted: {have}); "
            f"declare indexes: {{{column}: inverted}}"
        )
    if k <= 0:
        raise DatasetError(f"search({column}): k must be positive, got {k}")
    if strategy is not None and strategy not in KEYWORD_STRATEGIES:
        raise DatasetError(
            f"unknown keyword strategy {strategy!r}; use one of {', '.join(KEYWORD_STRATEGIES)}"
        )
    if not isinstance(text, str):
        raise DatasetError(f"search({column}): the query must be text, got {type(text).__name__}")
    tokens = query_tokens(text)
    info = KeywordExplain(column, text, k, len(ds.live))
    info.terms = [(t, len(inv.postings.get(t, ()))) for t in tokens]
    if corpus is not None:  # the df it scores with: the whole corpus's
        info.terms = [(t, int(corpus["df"].get(t, d))) for t, d in info.terms]
    bms = [inv.postings[t] for t in tokens if t in inv.postings]
    union = BitMap.union(*bms) if len(bms) > 1 else (bms[0] if bms else BitMap())
    info.term_rows = len(union)
    cm: CostModel = ds.cost_model or CostModel.default()
    n = len(ds.live)
    score_ms = len(union) * SCORE_NS_PER_ENTRY * 1e-6
    pred = None
    if where is not None:
        now = params.get(NOW_PARAM)
        pred = compile_filter(ds, where, params, now if isinstance(now, dt.datetime) else None)
        info.filter = str(where)
        est = pred.estimate()
        sel = est.rows / n if n else 0.0
        passing = max(1, int(len(union) * sel))
        look = min(len(union), max(4 * k, math.ceil(2 * k / max(sel, 1e-9))))
        pre = materialize_ms(pred, cm, n, len(union)) + passing * SCORE_NS_PER_ENTRY * 1e-6
        post = score_ms + materialize_ms(pred, cm, n, look)
        info.alternatives = [
            ("prefilter", pre, f"filter on {len(union)} term rows, score ~{passing}"),
            ("postfilter", post, f"score {len(union)} rows, filter the best ~{look}"),
        ]
        info.chosen = strategy or ("prefilter" if pre <= post else "postfilter")
    else:
        info.chosen = strategy or "postings"
    info.forced = strategy is not None
    info.plan_ms = (time.perf_counter() - t0) * 1e3
    if pred is None:
        ids, scores = bm25(inv, tokens, corpus=corpus)
        info.scored = len(ids)
        ids, scores = top(ids, scores, k)
    elif info.chosen == "prefilter":
        within = pred.evaluate(union) & ds.live if union else BitMap()
        info.checked = len(union)
        ids, scores = bm25(inv, tokens, within, corpus=corpus)
        info.scored = len(ids)
        ids, scores = top(ids, scores, k)
    else:  # postfilter: best first, the filter tested on growing chunks
        all_ids, all_scores = bm25(inv, tokens, corpus=corpus)
        info.scored = len(all_ids)
        order = np.lexsort((all_ids, -all_scores))
        keep: list[np.ndarray] = []
        got, pos, chunk = 0, 0, max(4 * k, 64)
        while got < k and pos < len(order):
            part = order[pos : pos + chunk]
            ok = pred.evaluate(bitmap_of(all_ids[part]))
            info.checked += len(part)
            mask = np.fromiter((int(r) in ok for r in all_ids[part]), bool, len(part))
            keep.append(part[mask])
            got += int(mask.sum())
            pos += len(part)
            chunk *= 4
        sel_ = np.concatenate(keep)[:k] if keep else np.empty(0, np.int64)
        ids, scores = all_ids[sel_], all_scores[sel_]
    info.actual_rows = len(ids)
    info.elapsed_ms = (time.perf_counter() - t0) * 1e3
    return ids.astype(np.int64), scores, info


# ---------------------------------------------------------------- fusion


@dataclass(frozen=True)
class Fusion:
    """``rank:`` of a binding: the RRF constant, rows kept, optional recency decay."""

    rrf_k: int = RRF_K
    limit: int | None = None
    recency: str | None = None  # a timestamp column
    half_life_s: float | None = None


def rrf(ranked: Sequence[np.ndarray], rrf_k: int = RRF_K) -> tuple[np.ndarray, np.ndarray]:
    """Reciprocal-rank fusion of ranked row-id lists (best first): (row ids, scores),
    highest first; ties keep the order of the first list holding the row, then the
    next, then row id. A row listed twice in one list counts at its best rank."""
    parts = [np.asarray(x, np.int64) for x in ranked]
    total = sum(len(p) for p in parts)
    if not total:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    if total <= 512:  # the usual size (two arms of k rows): plain Python is ~2x faster
        return _rrf_small(parts, rrf_k)
    ids = np.concatenate(parts)
    arm = np.concatenate([np.full(len(p), a) for a, p in enumerate(parts)])
    pos = np.concatenate([np.arange(1, len(p) + 1) for p in parts])
    # best (first) rank of each row in each list
    order = np.lexsort((pos, arm, ids))
    ids, arm, pos = ids[order], arm[order], pos[order]
    first = np.ones(len(ids), bool)
    first[1:] = (ids[1:] != ids[:-1]) | (arm[1:] != arm[:-1])
    ids, arm, pos = ids[first], arm[first], pos[first]
    uniq, inv = np.unique(ids, return_inverse=True)
    score = np.bincount(inv, weights=1.0 / (rrf_k + pos), minlength=len(uniq))
    big = np.iinfo(np.int64).max
    ranks = np.full((len(parts), len(uniq)), big, np.int64)
    ranks[arm, inv] = pos
    keys = [uniq, *ranks[::-1], -score]  # lexsort: last key first
    o = np.lexsort(keys)
    return uniq[o], score[o]


def _rrf_small(parts: list[np.ndarray], rrf_k: int) -> tuple[np.ndarray, np.ndarray]:
    score: dict[int, float] = {}
    best: dict[tuple[int, int], int] = {}
    for arm, ids in enumerate(parts):
        for r, rid in enumerate(ids.tolist(), start=1):
            if (rid, arm) not in best:
                best[rid, arm] = r
                score[rid] = score.get(rid, 0.0) + 1.0 / (rrf_k + r)
    big = 1 << 62
    arms = range(len(parts))
    rows = sorted(score, key=lambda x: (-score[x], *[best.get((x, a), big) for a in arms], x))
    return np.array(rows, np.int64), np.array([score[x] for x in rows], np.float64)


_US = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}  # microseconds per timestamp unit


def decay(
    ds: Any, rowids: np.ndarray, column: str, half_life_s: float, now: dt.datetime
) -> np.ndarray:
    """0.5 ** (age / half_life) per row (age clipped at 0; a null timestamp gives 0)."""
    col = ds._scalar_table().column(column)
    return decay_of(col.take(pa.array(rowids, pa.int64())), column, half_life_s, now)


def decay_of(values: Any, column: str, half_life_s: float, now: dt.datetime) -> np.ndarray:
    """``decay`` of the timestamps ``values`` (an Arrow array of ``column``'s)."""
    t = values.type
    if not pa.types.is_timestamp(t):
        raise DatasetError(f"recency column {column!r} is {t}, not a timestamp")
    raw = values.cast(pa.int64())
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks()
    us = np.asarray(raw.to_numpy(zero_copy_only=False), np.float64) * _US[t.unit]  # nulls: nan
    age_s = np.maximum(now.timestamp() - us / 1e6, 0.0)
    out = np.power(0.5, age_s / half_life_s)
    out[np.isnan(us)] = 0.0
    return out


@dataclass
class RankExplain:
    vector: Any = None  # indexes.retrieval.RetrievalExplain
    keyword: KeywordExplain | None = None
    fusion: Fusion | None = None
    rows: int = 0
    elapsed_ms: float = 0.0

    @property
    def executed(self) -> str:
        arms = []
        if self.vector is not None:
            arms.append(f"vector {self.vector.executed or self.vector.chosen}")
        if self.keyword is not None:
            arms.append(f"keyword {self.keyword.chosen}")
        return " + ".join(arms) + (" -> rrf" if self.fusion is not None else "")

    chosen = executed

    @property
    def guarantee(self) -> str:
        gs = []
        if self.vector is not None:
            gs.append(self.vector.guarantee or "")
        if self.keyword is not None:
            gs.append(self.keyword.guarantee)
        bad = [g for g in gs if g != "exact"]
        return bad[0] if bad else "exact"

    def lines(self) -> list[str]:
        out: list[str] = []
        if self.fusion is not None:
            f = self.fusion
            rec = (
                f", recency {f.recency} half-life {f.half_life_s:g}s"
                if f.recency is not None
                else ""
            )
            out.append(f"RankFusion: rrf k={f.rrf_k} limit={f.limit}{rec} -> {self.rows} rows")
        ind = "  " if self.fusion is not None else ""
        for arm in (self.vector, self.keyword):
            if arm is not None:
                out.extend(ind + ln for ln in str(arm).splitlines())
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def rank(
    ds: Any,
    *,
    vector: tuple[str, Any, int] | None = None,
    text: tuple[str, str, int] | None = None,
    fusion: Fusion | None = None,
    where: Expr | None = None,
    params: Mapping[str, Any] | None = None,
    columns: Sequence[str] | None = None,
    strategy: str | None = None,
    keyword_strategy: str | None = None,
    corpus: Mapping[str, Any] | None = None,
) -> tuple[pa.Table, RankExplain]:
    """Ranked retrieval over ``ds``: a keyword arm (``text = (column, query, k)``), a vector
    arm (``vector = (column, query vector, k)``) or both, fused by ``fusion`` (RRF, needed
    when both are given). Returns the rows (``columns``) plus ``_distance`` (float32, the
    vector arm's; null where the row came from the keyword arm only), ``_bm25`` (float64,
    null where it came from the vector arm only) and ``_score`` (float64: the fused score,
    or BM25 without fusion), best first. ``corpus``: the keyword arm's N, avgdl and df
    of a larger corpus (``keyword_search``)."""
    from indexes import retrieval

    params = dict(params or {})
    if vector is None and text is None:
        raise DatasetError("rank: give a vector arm, a keyword arm or both")
    if vector is not None and text is not None and fusion is None:
        fusion = Fusion()
    t0 = time.perf_counter()
    info = RankExplain(fusion=fusion)
    ds.query_at = time.monotonic()
    with ds.lock.read():
        v_ids = k_ids = None
        v_d = k_s = np.empty(0)
        if vector is not None:
            with ds.graph_lock.read():
                v_ids, v_d, info.vector = retrieval.search(
                    ds, vector[0], vector[1], vector[2], where, params, strategy=strategy
                )
            ds.learn(info.vector.feedback)
        if text is not None:
            k_ids, k_s, info.keyword = keyword_search(
                ds,
                text[0],
                text[1],
                text[2],
                where,
                params,
                strategy=keyword_strategy,
                corpus=corpus,
            )
        if fusion is None:
            assert k_ids is not None  # a vector arm alone comes with a fusion
            ids, score = k_ids, k_s
        else:
            ids, score = rrf([x for x in (v_ids, k_ids) if x is not None], fusion.rrf_k)
            if fusion.recency is not None and fusion.half_life_s and len(ids):
                now = params.get(NOW_PARAM)
                if not isinstance(now, dt.datetime):
                    now = dt.datetime.now(dt.UTC)
                score = score * decay(ds, ids, fusion.recency, fusion.half_life_s, now)
                order = np.argsort(-score, kind="stable")  # ties keep the fused order
                ids, score = ids[order], score[order]
            limit = fusion.limit or max(
                vector[2] if vector is not None else 0, text[2] if text is not None else 0
            )
            ids, score = ids[:limit], score[:limit]
        t = ds._rows(ids, columns)
        if vector is not None:
            assert v_ids is not None
            t = t.append_column(
                pa.field("_distance", pa.float32()), _lookup(ids, v_ids, v_d, pa.float32())
            )
        if text is not None:
            assert k_ids is not None
            t = t.append_column(
                pa.field("_bm25", pa.float64()), _lookup(ids, k_ids, k_s, pa.float64())
            )
        t = t.append_column(pa.field("_score", pa.float64()), pa.array(score, pa.float64()))
    info.rows = t.num_rows
    info.elapsed_ms = (time.perf_counter() - t0) * 1e3
    return t, info


def _lookup(ids: np.ndarray, arm_ids: np.ndarray, values: np.ndarray, t: pa.DataType) -> pa.Array:
    """``values`` of the arm at each of ``ids``; null where the arm did not return the row."""
    if not len(arm_ids):
        return pa.nulls(len(ids), t)
    o = np.argsort(arm_ids, kind="stable")
    sa = arm_ids[o]
    p = np.minimum(np.searchsorted(sa, ids), len(sa) - 1)
    hit = sa[p] == ids
    return pa.array(np.asarray(values, np.float64)[o[p]], t, mask=~hit)
