"""Per-session data cost: what each query fetched, from where, at what price.

A query's cost (``QueryCost``) is computed by the tracing worker from the figures the
executor keeps per source (rows, bytes, one call per source scan or search) and per
operator (sandbox seconds, CKKS operations); the ``CostBook`` sums it per session and
binding (the ``max_sessions`` most recent sessions) for ``/metrics`` and the timeline.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fabric.tracing.config import Prices

MIB = 1024 * 1024


def connection_of(uri: str) -> str:
    """``mysql://shop/merchants`` -> ``shop``; ``dataset://news`` -> ``news``."""
    rest = uri.split("://", 1)[1] if "://" in uri else uri
    return rest.split("/", 1)[0]


@dataclass
class QueryCost:
    #: connection -> {"rows", "bytes", "calls", "price"}
    sources: dict[str, dict[str, float]] = field(default_factory=dict)
    sandbox_seconds: float = 0.0
    ckks_ops: int = 0
    cache_hits: int = 0
    wait_seconds: float = 0.0
    price: float = 0.0

    def add_source(self, prices: Prices, conn: str, rows: int, nbytes: int, calls: int) -> None:
        s = self.sources.setdefault(conn, {"rows": 0, "bytes": 0, "calls": 0, "price": 0.0})
        s["rows"] += rows
        s["bytes"] += nbytes
        s["calls"] += calls
        unit = prices.connections.get(conn, {})
        p = (
            calls * unit.get("call", 0.0)
            + rows * unit.get("row", 0.0)
            + nbytes / MIB * unit.get("mib", 0.0)
        )
        s["price"] += p
        self.price += p

    def finish(self, prices: Prices) -> None:
        self.price += self.sandbox_seconds * prices.sandbox_cpu_second
        self.price += self.ckks_ops * prices.ckks_op

    def as_dict(self) -> dict[str, Any]:
        return {
            "sources": {k: dict(v) for k, v in self.sources.items()},
            "source_calls": int(sum(s["calls"] for s in self.sources.values())),
            "rows_fetched": int(sum(s["rows"] for s in self.sources.values())),
            "bytes_fetched": int(sum(s["bytes"] for s in self.sources.values())),
            "sandbox_seconds": round(self.sandbox_seconds, 6),
            "ckks_ops": self.ckks_ops,
            "cache_hits": self.cache_hits,
            "wait_seconds": round(self.wait_seconds, 6),
            "price": self.price,
        }


def _blank() -> dict[str, Any]:
    return {
        "queries": 0,
        "errors": 0,
        "sources": {},
        "sandbox_seconds": 0.0,
        "ckks_ops": 0,
        "cache_hits": 0,
        "wait_seconds": 0.0,
        "price": 0.0,
    }


class CostBook:
    """Sums per (session, binding); keeps the ``max_sessions`` most recently active ones."""

    def __init__(self, prices: Prices, max_sessions: int = 1000):
        self.prices = prices
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, dict[str, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def add(self, session: str | None, binding: str, cost: QueryCost, failed: bool) -> None:
        sid = session if session is not None else "-"
        with self._lock:
            by_binding = self._sessions.get(sid)
            if by_binding is None:
                by_binding = self._sessions[sid] = {}
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
                    self.evicted += 1
            else:
                self._sessions.move_to_end(sid)
            t = by_binding.setdefault(binding, _blank())
            t["queries"] += 1
            t["errors"] += int(failed)
            for conn, s in cost.sources.items():
                ts = t["sources"].setdefault(
                    conn, {"rows": 0, "bytes": 0, "calls": 0, "price": 0.0}
                )
                for k, v in s.items():
                    ts[k] += v
            for k in ("sandbox_seconds", "ckks_ops", "cache_hits", "wait_seconds", "price"):
                t[k] += getattr(cost, k)

    def session(self, session: str) -> dict[str, Any]:
        """``{"bindings": {name: totals}, "total": totals}`` of one session."""
        with self._lock:
            by_binding = {b: _copy(t) for b, t in self._sessions.get(session, {}).items()}
        total = _blank()
        for t in by_binding.values():
            for k in ("queries", "errors", "sandbox_seconds", "ckks_ops", "cache_hits"):
                total[k] += t[k]
            total["wait_seconds"] += t["wait_seconds"]
            total["price"] += t["price"]
            for conn, s in t["sources"].items():
                ts = total["sources"].setdefault(
                    conn, {"rows": 0, "bytes": 0, "calls": 0, "price": 0.0}
                )
                for k, v in s.items():
                    ts[k] += v
        return {"bindings": by_binding, "total": total}

    def snapshot(self) -> list[tuple[str, str, dict[str, Any]]]:
        with self._lock:
            return [(sid, b, _copy(t)) for sid, by in self._sessions.items() for b, t in by.items()]


def _copy(t: dict[str, Any]) -> dict[str, Any]:
    return {**t, "sources": {k: dict(v) for k, v in t["sources"].items()}}


class CostCollector:
    """Prometheus collector reading the CostBook at scrape time."""

    def __init__(self, book: CostBook, before: Any = None):
        self.book = book
        self.before = before  # the tracer's drain: runs not yet recorded are counted first

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        if self.before is not None:
            self.before()

        per_source = {
            "rows": CounterMetricFamily(
                "fabric_session_rows_fetched",
                "Rows fetched from a connection",
                labels=["session", "binding", "connection"],
            ),
            "bytes": CounterMetricFamily(
                "fabric_session_bytes_fetched",
                "Bytes fetched from a connection (Arrow buffers)",
                labels=["session", "binding", "connection"],
            ),
            "calls": CounterMetricFamily(
                "fabric_session_source_calls",
                "Scans and searches sent to a connection",
                labels=["session", "binding", "connection"],
            ),
            "price": CounterMetricFamily(
                "fabric_session_source_cost",
                "Price of what was fetched from a connection (tracing.prices)",
                labels=["session", "binding", "connection"],
            ),
        }
        per_binding = {
            "queries": CounterMetricFamily(
                "fabric_session_queries", "Queries run", labels=["session", "binding"]
            ),
            "errors": CounterMetricFamily(
                "fabric_session_query_errors", "Queries that failed", labels=["session", "binding"]
            ),
            "sandbox_seconds": CounterMetricFamily(
                "fabric_session_sandbox_seconds",
                "Seconds spent in pushdown.python sandbox calls",
                labels=["session", "binding"],
            ),
            "ckks_ops": CounterMetricFamily(
                "fabric_session_ckks_ops",
                "CKKS operations (encrypted results computed)",
                labels=["session", "binding"],
            ),
            "cache_hits": CounterMetricFamily(
                "fabric_session_cache_hits",
                "Source reads answered from a cache",
                labels=["session", "binding"],
            ),
            "wait_seconds": CounterMetricFamily(
                "fabric_session_freshness_wait_seconds",
                "Seconds spent waiting for fresh data",
                labels=["session", "binding"],
            ),
            "price": CounterMetricFamily(
                "fabric_session_cost",
                "Price of the session's queries (sources, sandbox, CKKS; tracing.prices)",
                labels=["session", "binding"],
            ),
        }
        for sid, binding, t in self.book.snapshot():
            for k, fam in per_binding.items():
                fam.add_metric([sid, binding], float(t[k]))
            for conn, s in t["sources"].items():
                for k, fam in per_source.items():
                    fam.add_metric([sid, binding, conn], float(s[k]))
        yield from per_source.values()
        yield from per_binding.values()
