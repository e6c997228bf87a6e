"""The tracer: one OpenTelemetry span per query and per plan operator, built from the
figures the executor collects anyway.

The query path pays for two clock reads and one deque append (``Tracer.run``). Spans are
built later, in batches (attributes computed there, never per row), handed to the SDK's
processors (the bounded ring buffer, always; OTLP/HTTP with a batch processor when
``otlp_endpoint`` is set) and the run's data cost added to the ``CostBook``: when anything
reads them (``spans``, ``flush``, a timeline, a /metrics scrape), when the fabric has been
idle for a moment, every second when exporting, or when ``DRAIN_AT`` runs are waiting.
There is no thread that builds spans while queries run: a Python thread doing that holds
the GIL the query thread is waiting for (measured: a 0.4 ms dataset query took 5.6 ms at
p50 with such a worker behind it).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import numpy as np

from fabric.tracing.config import TracingConfig
from fabric.tracing.cost import CostBook, QueryCost, connection_of

log = logging.getLogger("fabric.tracing")

MAX_QUEUED = 10_000  # finished runs waiting to be recorded; past it new ones are dropped
DRAIN_AT = 2_000  # runs waiting: the drainer records them even while queries keep coming
IDLE_S = 0.2  # no query for this long: the drainer records what waits
EXPORT_EVERY_S = 1.0  # with OTLP configured: record (and so export) at least this often
LAG_SAMPLES = 20_000  # about 5.5 hours of one source at a 1 s heartbeat

_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fabric_session_id", default=None
)

#: attribute names (one place: spans, timeline and tests read these)
A_BINDING = "fabric.binding"
A_VERSION = "fabric.binding.version"
A_SESSION = "fabric.session.id"
A_VALUE = "fabric.session.value."  # + name: the value, hashed / redacted / in clear


@contextlib.contextmanager
def session(session_id: str | None) -> Iterator[None]:
    """Queries run inside ``with fabric.tracing.session("conv-42"):`` (on this thread, and
    in tasks / ``asyncio.to_thread`` calls started inside it) carry that session id."""
    token = _SESSION.set(session_id)
    try:
        yield
    finally:
        _SESSION.reset(token)


def current_session() -> str | None:
    return _SESSION.get()


def _digest_input(v: Any) -> bytes:
    """The bytes a session value is hashed from: its buffer for arrays and vectors (the
    repr of a 128-d numpy vector cost 2-4 ms of the GIL per query), its repr otherwise."""
    if isinstance(v, bytes | bytearray | memoryview):
        return bytes(v)
    if isinstance(v, np.ndarray):
        return v.dtype.str.encode() + v.tobytes()
    if isinstance(v, list | tuple) and len(v) > 8 and all(type(x) is float for x in v):
        return b"<f8" + np.asarray(v, dtype=np.float64).tobytes()
    return repr(v).encode()


class Redactor:
    """Session values as recorded: in clear for ``record:``, ``[redacted]`` for ``redact:``
    (and every value when ``session_values: redact``), else a keyed hash (HMAC-SHA256 with a
    key made at start, 16 hex digits): equal values match within one process, and a value
    cannot be recovered by hashing guesses without the key."""

    def __init__(self, config: TracingConfig, key: bytes | None = None):
        self.record = frozenset(config.record)
        self.redact = frozenset(config.redact)
        self.mode = config.session_values
        self._key = key if key is not None else os.urandom(32)

    def value(self, name: str, v: Any) -> str:
        if name in self.record:
            return str(v)
        if name in self.redact or self.mode == "redact":
            return "[redacted]"
        if type(v).__name__.startswith("Encrypted"):  # a CKKS ciphertext: its kind only
            return f"[{type(v).__name__}]"
        digest = hmac.new(self._key, _digest_input(v), hashlib.sha256).hexdigest()[:16]
        return f"hmac:{digest}"

    def text(self, s: str, params: Mapping[str, Any]) -> str:
        """``s`` (an error message) with every session value not recorded in clear replaced."""
        for name, v in params.items():
            if name in self.record or v is None or isinstance(v, bool | bytes | bytearray):
                continue  # (a ciphertext's text is not in a message)
            for form in {str(v), repr(v)}:
                if len(form) >= 2 and form in s:
                    s = s.replace(form, self.value(name, v))
        return s


class Tracer:
    """Per fabric (``fab.tracer``, ``catalog.tracer``); ``None`` there when tracing is off."""

    def __init__(self, config: TracingConfig | None = None, *, hash_key: bytes | None = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from fabric.tracing.ring import RingBuffer

        self.config = config or TracingConfig()
        self.resource = Resource.create({"service.name": self.config.service_name})
        self.scope = InstrumentationScope("fabric.tracing")
        self.ring = RingBuffer(self.config.ring_spans)
        self.processors: list[Any] = [self.ring]  # SpanProcessors: on_end(span) each
        self.exporter: Any = None
        if self.config.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self.exporter = OTLPSpanExporter(
                endpoint=self.config.otlp_endpoint, headers=dict(self.config.otlp_headers)
            )
            self.processors.append(BatchSpanProcessor(self.exporter))
        self.redactor = Redactor(self.config, hash_key)
        self.costs = CostBook(self.config.prices, self.config.max_sessions)
        self._pending: deque[Any] = deque()  # finished runs not yet turned into spans
        self._drain_lock = threading.Lock()
        self._last_put = 0.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._unlisten: Any = None
        #: (unix ns, source, lag in messages) from the signals and heartbeats, newest last
        self.lag_samples: deque[tuple[int, str, int]] = deque(maxlen=LAG_SAMPLES)
        self.errors = 0  # runs the worker could not turn into spans (logged)
        self.dropped_runs = 0  # runs not recorded because the worker was MAX_QUEUED behind

    def attach(self, tracker: Any) -> None:
        """Record the freshness signals of ``tracker`` (a ``fabric.freshness.FreshnessTracker``):
        each ``data_stale`` / ``data_fresh`` (not heartbeats) becomes a ``signal`` span, shown
        on the timelines of the sessions running around it."""
        self._unlisten = tracker.listen(self._on_signal)

    def _on_signal(self, event: Mapping[str, Any]) -> None:
        now = time.time_ns()
        lag = event.get("lag_messages")
        if isinstance(lag, int) and event.get("scope", "source") == "source":
            self.lag_samples.append((now, str(event.get("source")), lag))
        if event.get("event") == "heartbeat":  # a lag sample only (every heartbeat interval)
            return
        self._put(("signal", dict(event), now))

    # ---- the query path
    def run(self, run: Any, session_id: str | None, version: str | None) -> Any:
        """Run ``run`` (a ``fabric.execute._Run``) and queue what it did for the worker."""
        sid = session_id if session_id is not None else _SESSION.get()
        wall0, perf0 = time.time_ns(), time.perf_counter()
        try:
            res = run.run()
        except BaseException as e:
            self._put((run, None, e, sid, version, wall0, perf0, time.perf_counter()))
            raise
        perf1 = time.perf_counter()
        # every unit is done: the inputs' tables are not kept alive while the run waits
        run.done, run.futures, run.stage_tables = {}, {}, {}
        self._put((run, res, None, sid, version, wall0, perf0, perf1))
        return res

    def cached(
        self, binding: str, version: str, params: Mapping[str, Any], sid: str | None, fn: Any
    ) -> Any:
        """``fn()`` (a binding's semantic-cache lookup, fabric/semantic_cache.py); an answer
        served from the cache, which runs no plan, is recorded as a query span with one
        cache hit and no source calls."""
        sid = sid if sid is not None else _SESSION.get()
        wall0, perf0 = time.time_ns(), time.perf_counter()
        res = fn()
        info = res.stats.get("cache") if isinstance(res.stats, Mapping) else None
        if isinstance(info, Mapping) and info.get("status") == "hit":
            perf1 = time.perf_counter()
            self._put(("cache", binding, version, dict(params), sid, res, wall0, perf0, perf1))
        return res

    def _put(self, item: Any) -> None:
        if self._closed:
            return
        if len(self._pending) >= MAX_QUEUED:  # nothing drained for that long: drop, count
            self.dropped_runs += 1
            return
        self._pending.append(item)  # atomic under the GIL; drained in order
        self._last_put = time.monotonic()
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(
                        target=self._drainer, name="fabric-tracing", daemon=True
                    )
                    self._thread.start()
        if len(self._pending) >= DRAIN_AT:
            self._wake.set()

    # ---- recording
    def drain(self) -> None:
        """Turn every finished run waiting so far into spans and cost, in order."""
        from fabric.tracing.spans import emit, emit_cache_hit, emit_signal

        with self._drain_lock:
            while self._pending:
                item = self._pending.popleft()
                try:
                    if item[0] == "signal":
                        emit_signal(self, item[1], item[2])
                    elif item[0] == "cache":
                        emit_cache_hit(self, *item[1:])
                    else:
                        emit(self, *item)
                except Exception:
                    self.errors += 1
                    log.exception("fabric tracing: could not record a query's spans")

    def _drainer(self) -> None:
        last = time.monotonic()
        while not self._closed:
            self._wake.wait(IDLE_S)
            self._wake.clear()
            if self._closed:
                return
            now = time.monotonic()
            if not self._pending:
                last = now
                continue
            idle = now - self._last_put >= IDLE_S
            due = self.exporter is not None and now - last >= EXPORT_EVERY_S
            if idle or due or len(self._pending) >= DRAIN_AT:
                self.drain()
                last = now

    def deliver(self, spans: list[Any]) -> None:
        """Finished spans (children first) to every processor."""
        for p in self.processors:
            for sp in spans:
                p.on_end(sp)

    def flush(self, timeout: float = 10.0) -> bool:
        """Record every query finished so far in the ring buffer (and hand it to the OTLP
        exporter, which is flushed too)."""
        self.drain()
        return all(p.force_flush(int(timeout * 1000)) for p in self.processors)

    def close(self) -> None:
        if self._closed:
            return
        if self._unlisten is not None:
            self._unlisten()
        self.flush()
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(5)
        self.drain()  # a run that finished while closing
        for p in self.processors:
            p.shutdown()

    # ---- reading
    def spans(self) -> list[Any]:
        """The finished spans in the ring buffer, oldest first."""
        self.drain()
        return self.ring.spans()

    def timeline(self, session_id: str, *, may_see: Any = None) -> dict[str, Any]:
        from fabric.tracing.timeline import timeline

        self.flush()
        return timeline(self, session_id, may_see=may_see)

    def collector(self) -> Any:
        """A Prometheus collector of the per-session data cost (``/metrics``)."""
        from fabric.tracing.cost import CostCollector

        return CostCollector(self.costs, before=self.drain)


# ---------------------------------------------------------------- plan text, once per plan

_plan_texts: dict[int, tuple[weakref.ref[Any], str]] = {}


def _forget_text(key: int, _ref: Any) -> None:
    _plan_texts.pop(key, None)


def plan_text(pp: Any) -> str:
    """The physical plan's explain text, rendered once per plan object."""
    hit = _plan_texts.get(id(pp))
    if hit is not None and hit[0]() is pp:
        return hit[1]
    text = pp.explain()
    key = id(pp)
    try:
        ref = weakref.ref(pp, partial(_forget_text, key))
    except TypeError:
        return text
    _plan_texts[key] = (ref, text)
    return text


__all__ = [
    "A_BINDING",
    "A_SESSION",
    "A_VALUE",
    "A_VERSION",
    "QueryCost",
    "Redactor",
    "Tracer",
    "connection_of",
    "current_session",
    "plan_text",
    "session",
]
