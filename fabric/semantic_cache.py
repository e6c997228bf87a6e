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
``max_entries`` or beyond ``max_mb`` megabytes (an entry's bytes: its answer's Arrow
buffers, its question vector and other session values, plus ``ENTRY_OVERHEAD``); counters:
hits, misses by reason, invalidations, evictions, bytes (:meth:`SemanticCache.metrics`;
on ``fabric serve``'s ``/metrics`` through :class:`CacheCollector`).
``Fabric.prewarm(name, sessions)`` fills the cache from representative sessions, and a
``prewarm: sessions.jsonl`` of the ``cache:`` (one JSON object of session values a line,
the path relative to the binding file, read by :func:`prewarm_sessions`) does so when
the fabric opens.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dsl.spec import CacheSpec

#: candidates taken from the HNSW index per lookup (then checked for the other values)
CANDIDATES = 16
#: bytes counted per entry beyond its answer's buffers, vector and session values (the
#: entry object, its stats and source states)
ENTRY_OVERHEAD = 512


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
    nbytes: int = 0


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
            "not_stored": 0,
            "invalidations": 0,
            "expirations": 0,
            "evictions": 0,
            "prewarmed": 0,
            "prewarm_failed": 0,
        }
        self.miss_reasons: dict[str, int] = {}
        self.bytes = 0  # of the entries kept

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
            e = self._entries.pop(label, None)
            if e is not None:
                self._index.mark_deleted(label)
                self._free.append(label)
                self.bytes -= e.nbytes
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
        why = self._unkept(result)
        limit = self.spec.max_bytes
        nbytes = entry_bytes(result, vec, group) if why is None else 0
        if why is None and limit is not None and nbytes > limit:
            why = f"larger than max_mb ({nbytes} bytes > {limit})"
        if why is not None:
            with self._lock:
                self.counters["not_stored"] += 1
            return why
        with self._lock:
            while self._entries and (
                len(self._entries) >= self.spec.max_entries
                or (limit is not None and self.bytes + nbytes > limit)
            ):
                old, gone = self._entries.popitem(last=False)
                self._index.mark_deleted(old)
                self._free.append(old)
                self.bytes -= gone.nbytes
                self.counters["evictions"] += 1
            if self._free:
                label = self._free.pop()
                self._index.add_items(vec[None, :], [label], replace_deleted=True)
            else:
                label = self._next
                self._next += 1
                self._index.add_items(vec[None, :], [label])
            self._entries[label] = _Entry(label, group, vec, result, states, kinds)
            self._entries[label].nbytes = nbytes
            self.bytes += nbytes
            self.counters["stored"] += 1
        return None

    @staticmethod
    def _unkept(result: Any) -> str | None:
        if result.partial:
            return "partial"
        if result.stale:
            return "stale"
        if result.unverified:
            return "unverified"
        return None

    def count(self, counter: str) -> None:
        with self._lock:
            self.counters[counter] = self.counters.get(counter, 0) + 1

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counters,
                "entries": len(self._entries),
                "bytes": self.bytes,
                "max_bytes": self.spec.max_bytes,
                "miss_reasons": dict(self.miss_reasons),
            }

    def clear(self) -> None:
        with self._lock:
            for lbl in list(self._entries):
                self._index.mark_deleted(lbl)
                self._free.append(lbl)
            self._entries.clear()
            self.bytes = 0


def entry_bytes(result: Any, vec: np.ndarray, group: str) -> int:
    """What keeping ``result`` costs: its table's Arrow buffers (a slice counts the buffers
    it keeps alive), the question vector, the other session values, ``ENTRY_OVERHEAD``."""
    table = getattr(result, "table", None)
    held = table.get_total_buffer_size() if table is not None else 0
    return int(held + vec.nbytes + len(group.encode()) + ENTRY_OVERHEAD)


# ---------------------------------------------------------------- prewarm and /metrics


def prewarm_sessions(spec: Any, binding_file: Path, display: str, bind: Any) -> list[dict]:
    """The sessions of ``cache: {prewarm: FILE}``: ``FILE`` (relative to ``binding_file``)
    holds one JSON object of session values a line (blank lines skipped); each is checked
    by ``bind`` (the binding's session types). A missing file is an error at the
    ``prewarm:`` value of the binding; a line that is not JSON, not an object, or has a
    session value of the wrong type, at that line of the file (``display``: the file as
    errors name it)."""
    from dsl.errors import Diagnostic, DslError, Span
    from dsl.types import SessionError

    cache = spec.cache
    path = binding_file.parent / cache.prewarm
    shown = str(Path(display).parent / cache.prewarm) if display else str(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DslError.at(
            f"cache prewarm: cannot read {shown}: {e.strerror or e}",
            cache.prewarm_span,
            f"create {shown} (one JSON object of session values a line), or fix prewarm: "
            "(a path relative to the binding file)",
        ) from None
    out: list[dict] = []
    problems: list[Diagnostic] = []
    at = cache.prewarm_span
    named = f" (the prewarm: of binding '{spec.name}'" + (
        f" at {at.file}:{at.line}:{at.col})" if at is not None else ")"
    )
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append(
                Diagnostic(
                    f"cache prewarm: not JSON: {e.msg}",
                    Span(shown, n, e.colno),
                    'one JSON object a line, e.g. {"q": [0.1, 0.2], "symbol": "ACME"}' + named,
                    source_line=text,
                )
            )
            continue
        if not isinstance(values, dict):
            problems.append(
                Diagnostic(
                    f"cache prewarm: a line must be a JSON object of session values, "
                    f"not {type(values).__name__}",
                    Span(shown, n, 1),
                    'e.g. {"q": [0.1, 0.2], "symbol": "ACME"}' + named,
                    source_line=text,
                )
            )
            continue
        try:
            bind(values)
        except SessionError as e:
            for d in e.diagnostics:
                value = re.search(r"session value '(\w+)'", d.message)
                col = text.find(f'"{value[1]}"') + 1 if value else 0
                problems.append(
                    Diagnostic(
                        f"cache prewarm: {d.message}",
                        Span(shown, n, max(col, 1)),
                        (d.hint or "give the value the session type the binding declares") + named,
                        source_line=text,
                    )
                )
            continue
        out.append(values)
    if problems:
        raise DslError(problems)
    return out


def reason_kind(reason: str) -> str:
    """A miss reason without its detail (a URI, a TTL), for a bounded metric label."""
    return re.split(r"[:(]", reason, maxsplit=1)[0].strip()


class CacheCollector:
    """The semantic caches' series for Prometheus (``fabric serve``'s ``/metrics``), read
    at scrape time from ``caches()`` (binding -> :meth:`SemanticCache.metrics`):

    - ``fabric_cache_hits_total{binding}``, ``fabric_cache_misses_total{binding, reason}``
      (the reason without its detail: ``source advanced``, ``expired``, ...);
    - ``fabric_cache_stored_total``, ``fabric_cache_invalidations_total``,
      ``fabric_cache_expirations_total``, ``fabric_cache_evictions_total{binding}``;
    - ``fabric_cache_entries{binding}``, ``fabric_cache_bytes{binding}`` (gauges).
    """

    def __init__(self, caches: Callable[[], Mapping[str, Mapping[str, Any]]]):
        self.caches = caches

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.caches()
        hits = CounterMetricFamily(
            "fabric_cache_hits", "Semantic cache hits per binding", labels=["binding"]
        )
        misses = CounterMetricFamily(
            "fabric_cache_misses",
            "Semantic cache misses per binding and reason",
            labels=["binding", "reason"],
        )
        counters = {
            k: CounterMetricFamily(f"fabric_cache_{k}", text, labels=["binding"])
            for k, text in (
                ("stored", "Answers kept in the semantic cache"),
                ("invalidations", "Cached answers dropped because a source advanced"),
                ("expirations", "Cached answers dropped past their source's ttl"),
                ("evictions", "Cached answers evicted (least recently used, max_entries/max_mb)"),
            )
        }
        entries = GaugeMetricFamily(
            "fabric_cache_entries", "Answers in the semantic cache", labels=["binding"]
        )
        nbytes = GaugeMetricFamily(
            "fabric_cache_bytes", "Bytes held by the semantic cache", labels=["binding"]
        )
        for binding, m in sorted(snap.items()):
            hits.add_metric([binding], m.get("hits", 0))
            by_kind: dict[str, int] = {}
            for reason, n in m.get("miss_reasons", {}).items():
                k = reason_kind(reason)
                by_kind[k] = by_kind.get(k, 0) + n
            for k, n in sorted(by_kind.items()):
                misses.add_metric([binding, k], n)
            for k, fam in counters.items():
                fam.add_metric([binding], m.get(k, 0))
            entries.add_metric([binding], m.get("entries", 0))
            nbytes.add_metric([binding], m.get("bytes", 0))
        yield hits
        yield misses
        yield from counters.values()
        yield entries
        yield nbytes


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
