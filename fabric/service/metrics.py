"""Prometheus series of the query service (served on ``/metrics`` with the freshness ones).

- ``fabric_query_seconds{binding, index_path}``: latency histogram (``index_path``: the
  retrieval strategy of the binding's dataset sources, e.g. ``hnsw``, else ``scan``).
- ``fabric_query_errors_total{agent, kind}``: refused and failed requests by kind.
- ``fabric_source_rows_total{source}`` / ``fabric_source_bytes_total{source}``: rows and
  bytes read per source URI.
- ``fabric_agent_active_queries{agent, state}``: running / waiting per agent.
- ``fabric_build_info{version, python, pyarrow}``: 1.
"""

from __future__ import annotations

import platform
import threading
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-data-fabric")
    except PackageNotFoundError:
        return "unknown"


class ServiceMetrics:
    """Counters kept under one lock; a Prometheus collector reads them at scrape time."""

    def __init__(self, scheduler: Any = None):
        self.scheduler = scheduler
        self.lock = threading.Lock()
        self.latency: dict[tuple[str, str], list[float]] = {}  # bucket counts + [sum, count]
        self.errors: dict[tuple[str, str], int] = {}
        self.rows: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.version = _version()

    def observe(self, agent: str, binding: str, result: Any, seconds: float) -> None:
        sources = (getattr(result, "stats", None) or {}).get("sources", {})
        paths = sorted({str(s["strategy"]) for s in sources.values() if s.get("strategy")})
        key = (binding, "+".join(paths) or "scan")
        with self.lock:
            h = self.latency.setdefault(key, [0.0] * (len(BUCKETS) + 2))
            for i, b in enumerate(BUCKETS):
                if seconds <= b:
                    h[i] += 1
            h[-2] += seconds
            h[-1] += 1
            for s in sources.values():
                uri = str(s.get("uri") or "?")
                self.rows[uri] = self.rows.get(uri, 0) + int(s.get("rows") or 0)
                self.bytes[uri] = self.bytes.get(uri, 0) + int(s.get("bytes") or 0)

    def error(self, agent: str, kind: str, binding: str | None = None) -> None:
        with self.lock:
            self.errors[(agent, kind)] = self.errors.get((agent, kind), 0) + 1

    def collect(self):
        with self.lock:
            lat = {k: list(v) for k, v in self.latency.items()}
            errors = dict(self.errors)
            rows, nbytes = dict(self.rows), dict(self.bytes)
        hist = HistogramMetricFamily(
            "fabric_query_seconds",
            "Query latency on the server, by binding and index path",
            labels=["binding", "index_path"],
        )
        for (binding, path), h in lat.items():
            buckets = [(str(b), h[i]) for i, b in enumerate(BUCKETS)] + [("+Inf", h[-1])]
            hist.add_metric([binding, path], buckets, h[-2])
        yield hist
        err = CounterMetricFamily(
            "fabric_query_errors", "Refused and failed requests", labels=["agent", "kind"]
        )
        for (agent, kind), n in errors.items():
            err.add_metric([agent, kind], n)
        yield err
        r = CounterMetricFamily("fabric_source_rows", "Rows read per source", labels=["source"])
        b = CounterMetricFamily("fabric_source_bytes", "Bytes read per source", labels=["source"])
        for uri, n in rows.items():
            r.add_metric([uri], n)
            b.add_metric([uri], nbytes.get(uri, 0))
        yield r
        yield b
        active = GaugeMetricFamily(
            "fabric_agent_active_queries",
            "Queries running and waiting per agent",
            labels=["agent", "state"],
        )
        if self.scheduler is not None:
            for agent, (running, waiting) in self.scheduler.active().items():
                active.add_metric([agent, "running"], running)
                active.add_metric([agent, "waiting"], waiting)
        yield active
        info = GaugeMetricFamily(
            "fabric_build_info", "Build of this fabric", labels=["version", "python", "pyarrow"]
        )
        import pyarrow

        info.add_metric([self.version, platform.python_version(), pyarrow.__version__], 1)
        yield info
