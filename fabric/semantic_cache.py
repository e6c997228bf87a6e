"""A semantic cache of a binding's answers, keyed by the meaning of the session's question.

A binding declares it::

    cache: {by: "{{session.question_vec}}", similarity: 0.92,
            ttl: {kafka: 30s, mysql: 10m, s3: 1d, default: 5m}, max_entries: 1024}

(``by: "{{embed(session.question)}}"`` embeds a ``str`` session value with ``model`` into
``dim`` values, the built-in ``hash`` model by default). A query is answered from the cache
when all of these hold, else it runs and its answer is stored:

- a cached question's vector has cosine similarity >= ``similarity`` with this one (found
  through an HNSW index over the cached vectors, hnswlib, cosine space);
- every other session value is equal (the cached entry was computed with the same ones);
- no source it read has advanced since: a dataset's write version, a Kafka topic's end
  offsets, the newest S3 object / Last-Modified of an API (``Source.watermark()``) are
  compared with what they were when the answer was computed; any change invalidates;
- the entry is younger than the smallest ``ttl`` of the kinds of the sources it read (a
  kind not listed takes ``default``). A source whose watermark is only the query time (SQL,
  Mongo: the fabric cannot see their changes) is trusted only for its ``ttl``: without one,
  such an answer is never reused.

Answers that were stale, partial or unverified are never stored; a hit is never served as
fresher than it is: its ``freshness`` is the cached one, and ``res.stats['cache']`` says
``hit`` with the similarity, the age and the entry, or ``miss`` and why (``no similar
question``, ``other session values differ``, ``source advanced: <uri>``, ``expired (ttl
<s> s for <kind>)``, ``not stored: stale``). Entries are evicted least recently used beyond
``max_entries``; counters: hits, misses by reason, invalidations, evictions
(:meth:`SemanticCache.metrics`). ``Fabric.prewarm(name, sessions)`` fills the cache from
representative sessions at start-up.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dsl.spec import CacheSpec

#: candidates taken from the HNSW index per lookup (then checked for the other values)
CANDIDATES = 16


def source_state(source: Any) -> tuple[str, Any] | None:
    """What identifies the data a source holds now, or None when the fabric cannot see its
    changes (SQL, Mongo: watermark = query time), so only a TTL bounds a cached answer."""
    ds = getattr(source, "dataset", None)
    if ds is not None and hasattr(ds, "version"):
        return ("version", int(ds.version))
    inner = getattr(source, "inner", source)  # a rate-limited source: the connector's
    refresh = getattr(inner, "refresh", None)
    if callable(refresh) and type(inner).__name__ == "S3Source":
        refresh()  # the object list is refreshed at every scan; so here too
    wm = source.watermark()
    if wm is None:
        return None
    detail = dict(getattr(wm, "detail", None) or {})
    if detail.get("kind") == "query time":
        return None
    if "end_offsets" in detail:
        return ("offsets", sorted((str(k), v) for k, v in dict(detail["end_offsets"]).items()))
    if wm.event_time is None and wm.lag_messages is None:
        return None
    return ("watermark", (wm.event_time, detail.get("files")))


@dataclass
class _Entry:
    label: int
    group: str  # the other session values, as canonical JSON
    vector: np.ndarray
    result: Any
    states: dict[str, tuple[str, Any] | None]  # uri -> source_state when computed
    kinds: dict[str, str]  # uri -> kind
    created: float = field(default_factory=time.monotonic)
    hits: int = 0


def _canonical(values: Mapping[str, Any]) -> str:
    def norm(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, Mapping):
            return {str(k): norm(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [norm(x) for x in v]
        return v

    return json.dumps(norm(dict(values)), sort_keys=True, default=str)


class SemanticCache:
    """One binding's cache (thread-safe)."""

    def __init__(self, binding: str, spec: CacheSpec):
        import hnswlib

        self.binding = binding
        self.spec = spec
        self.ttl = dict(spec.ttl)
        self._lock = threading.RLock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # label -> entry, LRU order
        self._free: list[int] = []
        self._next = 0
        self._index = hnswlib.Index(space="cosine", dim=spec.dim)
        self._index.init_index(
            max_elements=spec.max_entries, ef_construction=100, M=16, allow_replace_deleted=True
        )
        self._index.set_ef(max(32, CANDIDATES))
        self.counters: dict[str, int] = {
            "hits": 0,
            "misses": 0,
            "stored": 0,
            "invalidations": 0,
            "expirations": 0,
            "evictions": 0,
        }
        self.miss_reasons: dict[str, int] = {}

    # ---------------------------------------------------------------- keys

    def key(self, params: Mapping[str, Any]) -> tuple[np.ndarray, str]:
        """(the question's unit vector, the other session values as canonical JSON)."""
        raw = params.get(self.spec.by)
        if self.spec.embed:
            from fabric.embed import embed

            vec = embed([raw], self.spec.dim, self.spec.model)[0]
        else:
            vec = np.asarray(raw, dtype=np.float32).reshape(-1)
            if vec.shape[0] != self.spec.dim:
                raise ValueError(
                    f"binding {self.binding}: cache by session.{self.spec.by} has "
                    f"{vec.shape[0]} values, the cache {self.spec.dim}"
                )
        vec = np.asarray(vec, dtype=np.float32)
        norm = float(np.linalg.norm(vec))
        vec = vec / norm if norm > 0 else vec
        others = {k: v for k, v in params.items() if k != self.spec.by and not k.startswith("__")}
        return vec, _canonical(others)

    def _ttl_of(self, kind: str) -> float | None:
        return self.ttl.get(kind, self.ttl.get("default"))

    # ---------------------------------------------------------------- lookup and store

    def lookup(
        self, params: Mapping[str, Any], catalog: Any
    ) -> tuple[Any | None, dict[str, Any], np.ndarray, str]:
        """(cached result or None, what ``res.stats['cache']`` says, vector, group)."""
        vec, group = self.key(params)
        with self._lock:
            n = len(self._entries)
            if n == 0:
                return None, self._miss("empty"), vec, group
            k = min(CANDIDATES, n)
            labels, dists = self._index.knn_query(vec, k=k)
            cands = [
                (int(lbl), 1.0 - float(d))
                for lbl, d in zip(labels[0], dists[0])
                if int(lbl) in self._entries
            ]
        close = [(lbl, sim) for lbl, sim in cands if sim >= self.spec.similarity]
        if not close:
            best = max((s for _, s in cands), default=0.0)
            return (
                None,
                self._miss("no similar question", best_similarity=round(best, 4)),
                vec,
                group,
            )
        same = [
            (lbl, sim)
            for lbl, sim in close
            if self._entries.get(lbl) is not None and self._entries[lbl].group == group
        ]
        if not same:
            return None, self._miss("other session values differ"), vec, group
        lbl, sim = same[0]
        e = self._entries.get(lbl)
        if e is None:
            return None, self._miss("evicted"), vec, group
        age = time.monotonic() - e.created
        for kind in e.kinds.values():
            ttl = self._ttl_of(kind)
            if ttl is not None and age > ttl:
                self._drop(lbl, "expirations")
                return None, self._miss(f"expired (ttl {ttl:g} s for {kind})"), vec, group
        for uri, then in e.states.items():
            try:
                now = source_state(catalog.source(uri))
            except Exception as exc:  # cannot check: do not trust the entry
                self._drop(lbl, "invalidations")
                return None, self._miss(f"cannot check {uri}: {type(exc).__name__}"), vec, group
            if then is None or now is None:
                if self._ttl_of(e.kinds[uri]) is None:
                    self._drop(lbl, "invalidations")
                    return None, self._miss(f"untracked source without ttl: {uri}"), vec, group
                continue  # its ttl held above
            if now != then:
                self._drop(lbl, "invalidations")
                return None, self._miss(f"source advanced: {uri}"), vec, group
        with self._lock:
            if lbl in self._entries:
                self._entries.move_to_end(lbl)
            e.hits += 1
            self.counters["hits"] += 1
        info = {"status": "hit", "similarity": round(sim, 4), "age_s": round(age, 3), "entry": lbl}
        return e.result, info, vec, group

    def _miss(self, reason: str, **extra: Any) -> dict[str, Any]:
        with self._lock:
            self.counters["misses"] += 1
            self.miss_reasons[reason] = self.miss_reasons.get(reason, 0) + 1
        return {"status": "miss", "reason": reason, **extra}

    def _drop(self, label: int, counter: str) -> None:
        with self._lock:
            if self._entries.pop(label, None) is not None:
                self._index.mark_deleted(label)
                self._free.append(label)
                self.counters[counter] += 1

    def store(
        self,
        vec: np.ndarray,
        group: str,
        result: Any,
        states: dict[str, tuple[str, Any] | None],
        kinds: dict[str, str],
    ) -> str | None:
        """Keep ``result``; the reason when it is not kept."""
        if result.partial:
            return "partial"
        if result.stale:
            return "stale"
        if result.unverified:
            return "unverified"
        with self._lock:
            while len(self._entries) >= self.spec.max_entries:
                old, _ = self._entries.popitem(last=False)
                self._index.mark_deleted(old)
                self._free.append(old)
                self.counters["evictions"] += 1
            if self._free:
                label = self._free.pop()
                self._index.add_items(vec[None, :], [label], replace_deleted=True)
            else:
                label = self._next
                self._next += 1
                self._index.add_items(vec[None, :], [label])
            self._entries[label] = _Entry(label, group, vec, result, states, kinds)
            self.counters["stored"] += 1
        return None

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counters,
                "entries": len(self._entries),
                "miss_reasons": dict(self.miss_reasons),
            }

    def clear(self) -> None:
        with self._lock:
            for lbl in list(self._entries):
                self._index.mark_deleted(lbl)
                self._free.append(lbl)
            self._entries.clear()


def uris_of(plan: Any) -> dict[str, str]:
    """uri -> kind of every source a (logical) plan reads: scans, searches, stages."""
    import dataclasses

    out: dict[str, str] = {}
    todo, seen = [plan], set()
    while todo:
        node = todo.pop()
        if id(node) in seen or not dataclasses.is_dataclass(node):
            continue
        seen.add(id(node))
        uri = getattr(node, "uri", None)
        if isinstance(uri, str) and "://" in uri and not uri.startswith("stage://"):
            out[uri] = uri.split("://", 1)[0]
        for f in dataclasses.fields(node):
            v = getattr(node, f.name, None)
            items = (
                v if isinstance(v, list | tuple) else v.values() if isinstance(v, Mapping) else (v,)
            )
            todo.extend(x for x in items if dataclasses.is_dataclass(x) and not isinstance(x, type))
    return out


def run_cached(
    cache: SemanticCache,
    params: Mapping[str, Any],
    catalog: Any,
    uris: Mapping[str, str],
    run: Callable[[], Any],
) -> Any:
    """The binding's answer from ``cache`` when a similar question's answer is still valid,
    else ``run()``'s (then stored). ``res.stats['cache']`` says which, and why."""
    t0 = time.perf_counter()
    hit, info, vec, group = cache.lookup(params, catalog)
    if hit is not None:
        stats = {
            "cache": {**info, "lookup_ms": round((time.perf_counter() - t0) * 1000, 3)},
            "sources": {},
            "total_ms": round((time.perf_counter() - t0) * 1000, 3),
            "cached_stats": hit.stats,
        }
        return replace(hit, stats=stats, explain=None)
    states: dict[str, tuple[str, Any] | None] = {}
    for uri in uris:  # before running: an update during the run invalidates, not hides
        try:
            states[uri] = source_state(catalog.source(uri))
        except Exception:
            states[uri] = None
    res = run()
    why = cache.store(vec, group, res, states, dict(uris))
    if why is not None:
        info = {**info, "stored": False, "not_stored": why}
    else:
        info = {**info, "stored": True}
    return replace(res, stats={**res.stats, "cache": info})
