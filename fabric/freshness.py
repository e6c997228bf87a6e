"""Freshness tracking: per source lag (messages, seconds), ingest rate, last error and a
fresh|stale state (fabric.signals.StateMachine), and per binding readiness from the sources
it reads.

Who feeds it:

- the Kafka ingestor calls ``record_applied`` after every batch the dataset holds,
  ``update_lag`` with the lag it measured from the broker's watermarks, and
  ``record_error(kind=...)`` / ``clear_error(kind=...)``: one error per kind of thing that
  failed (``broker``, ``apply``, ``checkpoint``, ``dead_letter`` ...), each cleared only
  when that thing succeeds again; ``begin_recovery`` / ``end_recovery`` around a rebuild
  (topic recreated, checkpoint unusable) and ``note`` for what it decided;
- live sources (SQL, Mongo, S3) are measured on demand with ``observe_watermark`` from a
  ``connectors.base.Watermark`` (see ``live_freshness``).

Lag definitions (docs/freshness.md):

- ``lag_messages``: sum over partitions of ``high - max(next_to_apply, low)`` (never < 0),
  so compacted/deleted ranges below the low watermark and empty partitions count 0.
- ``lag_seconds``: 0 when ``lag_messages`` is 0; otherwise ``now - max(newest event time
  applied, when the source fell behind)``. The second term keeps a source that was idle
  for an hour from reporting an hour of lag the moment one new message arrives.

Listeners (``listen``) receive every transition and heartbeat as the JSON object that
``fabric.signals`` pushes; the server's SSE stream and the ``SignalEmitter`` are listeners.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.base import Source, Watermark
from dsl.errors import FabricError
from fabric.signals import (
    DATA_FRESH,
    DATA_STALE,
    FRESH,
    HEARTBEAT,
    STALE,
    StateMachine,
    Thresholds,
    iso,
    make_event,
)

Listener = Callable[[dict[str, Any]], None]
log = logging.getLogger("fabric.freshness")


@dataclass(frozen=True)
class SourceFreshness:
    """One source's freshness at ``observed_at`` (what results and the endpoint carry)."""

    name: str
    state: str
    since: float
    lag_messages: int | None
    lag_seconds: float | None
    ingest_rate: float
    ingested_total: int
    dead_letter_total: int
    last_error: str | None
    newest_event_time: float | None
    observed_at: float
    kind: str = "kafka"
    uri: str | None = None
    bindings: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)
    status: str = FRESH
    reason: str | None = None
    errors: Mapping[str, str] = field(default_factory=dict)
    notices: tuple[Mapping[str, Any], ...] = ()
    last_dead_letter: Mapping[str, Any] | None = None

    @property
    def stale(self) -> bool:
        return self.state == STALE

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "uri": self.uri,
            "state": self.state,
            "stale": int(self.stale),
            "since": iso(self.since),
            "lag_messages": self.lag_messages,
            "lag_seconds": None if self.lag_seconds is None else round(self.lag_seconds, 3),
            "ingest_rate": round(self.ingest_rate, 3),
            "ingested_total": self.ingested_total,
            "dead_letter_total": self.dead_letter_total,
            "last_error": self.last_error,
            "newest_event_time": None
            if self.newest_event_time is None
            else iso(self.newest_event_time),
            "bindings": list(self.bindings),
            "status": self.status,
            "reason": self.reason,
            "errors": dict(self.errors),
            "notices": [dict(n) for n in self.notices],
            "last_dead_letter": None
            if self.last_dead_letter is None
            else dict(self.last_dead_letter),
            **({"detail": dict(self.detail)} if self.detail else {}),
        }


class FreshnessTimeout(FabricError, TimeoutError):
    """``wait_until_fresh`` gave up; carries how long it waited and the last freshness."""

    def __init__(self, freshness: SourceFreshness, waited: float, bound: str):
        self.freshness = freshness
        self.waited = waited
        super().__init__(
            f"source {freshness.name} still behind after waiting {waited:.2f}s: "
            f"lag {freshness.lag_messages} messages / {freshness.lag_seconds or 0:.2f}s, bound {bound}"
            + (f"; last error: {freshness.last_error}" if freshness.last_error else "")
        )


class _Src:
    """Mutable per-source state, guarded by the tracker's lock."""

    def __init__(self, name: str, thresholds: Thresholds, kind: str, uri: str | None, now: float):
        self.name, self.kind, self.uri = name, kind, uri
        self.machine = StateMachine(thresholds, now=now)
        self.lag_messages: int | None = 0 if kind == "kafka" else None
        self.lag_seconds: float | None = 0.0 if kind == "kafka" else None
        self.newest_event_time: float | None = None
        self.behind_since: float | None = None
        self.errors: dict[str, tuple[str, float]] = {}  # kind -> (message, since)
        self.recovering: str | None = None  # why the data is being rebuilt, until caught up
        self.notices: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self.last_dead_letter: dict[str, Any] | None = None
        self.measured = kind != "kafka"  # a Kafka source's lag is unknown until measured
        self.ingested_total = 0
        self.dead_letter_total = 0
        self.window: collections.deque[tuple[float, int]] = collections.deque()
        self.detail: dict[str, Any] = {}
        self.observed_at = now

    @property
    def last_error(self) -> str | None:
        """The most recent of the errors still standing."""
        if not self.errors:
            return None
        return max(self.errors.values(), key=lambda e: e[1])[0]

    def status(self) -> tuple[str, str | None]:
        """``error`` (something failed and has not succeeded since), ``rebuilding``,
        ``starting`` (lag not measured yet), ``stale`` (past a threshold), ``behind``
        (messages not yet applied) or ``fresh``, with the reason."""
        if self.errors:
            kind, (msg, _) = max(self.errors.items(), key=lambda e: e[1][1])
            return "error", f"{kind}: {msg}"
        if self.recovering is not None:
            return "rebuilding", self.recovering
        if not self.measured:
            return "starting", "lag not measured yet"
        if self.machine.state == STALE:
            return STALE, self.machine.reason
        if self.lag_messages:
            return "behind", f"{self.lag_messages} messages not applied yet"
        return FRESH, None


class FreshnessTracker:
    """Thread-safe registry of source and binding freshness; emits transitions to listeners."""

    def __init__(
        self,
        default_thresholds: Thresholds | None = None,
        *,
        rate_window: float = 10.0,
        clock: Callable[[], float] = time.time,
    ):
        self.default_thresholds = default_thresholds or Thresholds()
        self.rate_window = rate_window
        self.clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._sources: dict[str, _Src] = {}
        self._bindings: dict[str, tuple[str, ...]] = {}
        self._overrides: dict[tuple[str, str], StateMachine] = {}
        self._binding_state: dict[str, tuple[str, float]] = {}
        self._listeners: list[Listener] = []
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ registration

    def register_source(
        self,
        name: str,
        thresholds: Thresholds | None = None,
        *,
        kind: str = "kafka",
        uri: str | None = None,
    ) -> None:
        with self._lock:
            if name not in self._sources:
                now = self.clock()
                self._sources[name] = _Src(
                    name, thresholds or self.default_thresholds, kind, uri, now
                )
                self._refresh_bindings(now)

    def set_bindings(
        self,
        bindings: Mapping[str, Iterable[str]],
        overrides: Mapping[tuple[str, str], Thresholds] | None = None,
    ) -> None:
        """binding -> the sources it reads; ``overrides[(binding, source)]`` = the binding's own bound."""
        with self._lock:
            now = self.clock()
            self._bindings = {b: tuple(sorted(set(s))) for b, s in bindings.items()}
            self._overrides = {k: StateMachine(t, now=now) for k, t in (overrides or {}).items()}
            for b, srcs in self._bindings.items():
                for s in srcs:
                    self.register_source(s, kind="live", uri=s)  # no-op if registered
                self._binding_state.setdefault(b, (FRESH, now))
            self._refresh_bindings(now)

    def listen(self, callback: Listener) -> Callable[[], None]:
        """Call ``callback(event)`` for every transition and heartbeat; returns an unsubscribe."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    # ------------------------------------------------------------------ inputs

    def record_applied(self, source: str, n: int, newest_event_time: float | None = None) -> None:
        """``n`` messages are now held by the dataset (upserts, deletes)."""
        with self._lock:
            s = self._get(source)
            now = self.clock()
            s.ingested_total += n
            s.window.append((now, n))
            if newest_event_time is not None and (
                s.newest_event_time is None or newest_event_time > s.newest_event_time
            ):
                s.newest_event_time = newest_event_time
            self._evaluate(s, now)

    def record_dead_letters(
        self, source: str, n: int, last: Mapping[str, Any] | None = None
    ) -> None:
        """``n`` more messages went to the dead letters; ``last``: the newest one (topic,
        partition, offset, error, where it went)."""
        with self._lock:
            s = self._get(source)
            s.dead_letter_total += n
            if last is not None:
                s.last_dead_letter = dict(last)

    def update_lag(
        self, source: str, lag_messages: int, detail: Mapping[str, Any] | None = None
    ) -> None:
        """The ingestor's measured lag in messages (summed over partitions)."""
        with self._lock:
            s = self._get(source)
            now = self.clock()
            if lag_messages > 0 and (s.lag_messages or 0) == 0:
                s.behind_since = now
            s.lag_messages = max(0, int(lag_messages))
            s.measured = True
            if detail is not None:
                s.detail = dict(detail)
            s.observed_at = now
            self._evaluate(s, now)

    def record_error(self, source: str, error: str, kind: str = "source") -> None:
        """Something of the source failed (``kind``: what, e.g. ``broker``, ``apply``,
        ``checkpoint``): stale, status ``error``, until ``clear_error`` of that kind. The
        error is served (``/v1/freshness``, signals): its credentials are masked."""
        from connectors.credentials import mask

        with self._lock:
            s = self._get(source)
            old = s.errors.get(kind)
            s.errors[kind] = (mask(error), old[1] if old else self.clock())
            self._evaluate(s, self.clock())

    def clear_error(self, source: str, kind: str = "source") -> None:
        """What failed (``kind``) has succeeded: its error goes, the others stay."""
        with self._lock:
            s = self._get(source)
            old = s.errors.pop(kind, None)
            if old is not None:
                s.detail["previous_error"] = old[0]
                self._evaluate(s, self.clock())

    def begin_recovery(self, source: str, reason: str) -> None:
        """The data is being rebuilt or re-read (``reason``): stale, status ``rebuilding``,
        until ``end_recovery``."""
        with self._lock:
            s = self._get(source)
            s.recovering = reason
            s.notices.append({"at": iso(self.clock()), "message": reason})
            self._evaluate(s, self.clock())

    def end_recovery(self, source: str, message: str | None = None) -> None:
        with self._lock:
            s = self._get(source)
            if s.recovering is None:
                return
            s.recovering = None
            if message:
                s.notices.append({"at": iso(self.clock()), "message": message})
            self._evaluate(s, self.clock())

    def note(self, source: str, message: str) -> None:
        """Something the operator should know about the source (kept, the last 20)."""
        with self._lock:
            self._get(source).notices.append({"at": iso(self.clock()), "message": message})

    def observe_watermark(self, source: str, wm: Watermark) -> SourceFreshness:
        """A live source's freshness: lag_seconds = observed_at - event_time (0 if unknown)."""
        with self._lock:
            if source not in self._sources:
                self.register_source(source, kind="live")
            s = self._sources[source]
            s.observed_at = wm.observed_at
            if wm.event_time is not None:
                s.newest_event_time = wm.event_time
            s.lag_seconds = (
                0.0 if wm.event_time is None else max(0.0, wm.observed_at - wm.event_time)
            )
            s.lag_messages = wm.lag_messages
            s.detail = dict(wm.detail)
            self._evaluate(s, self.clock(), live=True)
            return self._snap(s, self.clock())

    # ------------------------------------------------------------------ outputs

    def source(self, name: str) -> SourceFreshness:
        with self._lock:
            s = self._get(name)
            now = self.clock()
            self._evaluate(s, now)
            return self._snap(s, now)

    def sources(self) -> list[str]:
        with self._lock:
            return sorted(self._sources)

    def lag(self, name: str) -> tuple[str, int | None, float | None, float | None] | None:
        """``(kind, lag_messages, lag_seconds, newest_event_time)`` of a source, or None if
        it is not tracked: the cheap read a query makes (no snapshot, no evaluation)."""
        with self._lock:
            s = self._sources.get(name)
            if s is None:
                return None
            lag_seconds = self._lag_seconds(s, self.clock()) if s.kind == "kafka" else s.lag_seconds
            return s.kind, s.lag_messages, lag_seconds, s.newest_event_time

    def binding_sources(self) -> dict[str, tuple[str, ...]]:
        with self._lock:
            return dict(self._bindings)

    def binding_state(self, binding: str) -> tuple[str, float]:
        with self._lock:
            if binding not in self._binding_state:
                raise KeyError(
                    f"unknown binding {binding!r}; known: {', '.join(sorted(self._bindings)) or '(none)'}"
                )
            return self._binding_state[binding]

    def snapshot(self) -> dict[str, Any]:
        """Everything, as ``GET /v1/freshness`` serves it (see docs/freshness.md for the paths)."""
        with self._lock:
            now = self.clock()
            for s in self._sources.values():
                self._evaluate(s, now)
            srcs = {n: self._snap(s, now) for n, s in sorted(self._sources.items())}
            bindings: dict[str, Any] = {}
            for b, names in sorted(self._bindings.items()):
                state, since = self._binding_state[b]
                stale_sources = [n for n in names if self._stale_for(b, n)]
                lags_m = [srcs[n].lag_messages or 0 for n in names]
                lags_s = [srcs[n].lag_seconds or 0.0 for n in names]
                bindings[b] = {
                    "state": state,
                    "stale": int(state == STALE),
                    "since": iso(since),
                    "sources": list(names),
                    "stale_sources": stale_sources,
                    "lag_messages": max(lags_m, default=0),
                    "lag_seconds": round(max(lags_s, default=0.0), 3),
                }
            return {
                "at": iso(now),
                "sources": {n: f.to_dict() for n, f in srcs.items()},
                "bindings": bindings,
                "totals": {
                    "sources": len(srcs),
                    "stale_sources": sum(f.stale for f in srcs.values()),
                    "bindings": len(bindings),
                    "stale_bindings": sum(v["stale"] for v in bindings.values()),
                    "lag_messages": sum(f.lag_messages or 0 for f in srcs.values()),
                    "lag_seconds_max": round(
                        max((f.lag_seconds or 0.0 for f in srcs.values()), default=0.0), 3
                    ),
                },
            }

    def wait_until_fresh(
        self,
        source: str,
        *,
        max_lag_seconds: float | None = None,
        max_lag_messages: int | None = None,
        timeout: float = 10.0,
    ) -> float:
        """Block until the source is within both bounds (default: its state is fresh).

        Returns the seconds waited (0.0 if it already was); raises ``FreshnessTimeout``
        (a ``TimeoutError`` carrying ``waited`` and the last ``freshness``) after ``timeout``.
        """
        start = time.monotonic()

        def ok(f: SourceFreshness) -> bool:
            if f.last_error or f.status == "rebuilding":
                return False
            if max_lag_seconds is None and max_lag_messages is None:
                return f.state == FRESH
            if max_lag_messages is not None and (f.lag_messages or 0) > max_lag_messages:
                return False
            return not (max_lag_seconds is not None and (f.lag_seconds or 0.0) > max_lag_seconds)

        with self._changed:
            while True:
                f = self.source(source)
                waited = time.monotonic() - start
                if ok(f):
                    return waited
                if waited >= timeout:
                    bound = " and ".join(
                        x
                        for x in (
                            f"{max_lag_messages} messages" if max_lag_messages is not None else "",
                            f"{max_lag_seconds}s" if max_lag_seconds is not None else "",
                        )
                        if x
                    )
                    raise FreshnessTimeout(f, waited, bound or "state fresh")
                self._changed.wait(min(0.1, timeout - waited))

    def live_freshness(self, name: str, source: Source) -> SourceFreshness:
        """Freshness of a live SQL/Mongo/S3 source: its watermark, or 'as of query time'."""
        try:
            wm = source.watermark()
        except Exception as exc:
            with self._lock:
                if name not in self._sources:
                    self.register_source(name, kind="live", uri=getattr(source, "uri", None))
            self.record_error(name, f"{type(exc).__name__}: {exc}")
            return self.source(name)
        if name not in self._sources:
            self.register_source(name, kind="live", uri=getattr(source, "uri", None))
        else:
            self.clear_error(name)
        return self.observe_watermark(name, wm or Watermark(observed_at=self.clock()))

    # ------------------------------------------------------------------ heartbeat

    def start(self, heartbeat: float | None = 5.0, tick: float = 0.5) -> None:
        """Background thread: re-evaluate lag_seconds every ``tick`` s, emit heartbeats."""
        if self._ticker is not None:
            return
        self._stop.clear()

        def run() -> None:
            next_beat = time.monotonic() + (heartbeat or 0)
            while not self._stop.wait(tick):
                with self._lock:
                    now = self.clock()
                    for s in self._sources.values():
                        self._evaluate(s, now)
                if heartbeat and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + heartbeat
                    self.heartbeat()

        self._ticker = threading.Thread(target=run, name="fabric-freshness-ticker", daemon=True)
        self._ticker.start()

    def heartbeat(self) -> None:
        """Emit one heartbeat event per source."""
        with self._lock:
            now = self.clock()
            events = [
                make_event(
                    HEARTBEAT,
                    s.name,
                    self._readers(s.name),
                    s.lag_messages,
                    s.lag_seconds,
                    at=now,
                    state=s.machine.state,
                    since=iso(s.machine.since),
                    last_error=s.last_error,
                )
                for s in self._sources.values()
            ]
        for ev in events:
            self._notify(ev)

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(2.0)
            self._ticker = None

    # ------------------------------------------------------------------ internals

    def _get(self, name: str) -> _Src:
        try:
            return self._sources[name]
        except KeyError:
            raise KeyError(
                f"unknown source {name!r}; registered sources: {', '.join(sorted(self._sources)) or '(none)'}"
            ) from None

    def _readers(self, source: str) -> list[str]:
        return [b for b, srcs in self._bindings.items() if source in srcs]

    def _stale_for(self, binding: str, source: str) -> bool:
        """Stale for this binding: the source is stale, or past the binding's own bound."""
        own = self._overrides.get((binding, source))
        return self._sources[source].machine.state == STALE or (
            own is not None and own.state == STALE
        )

    def _rate(self, s: _Src, now: float) -> float:
        while s.window and s.window[0][0] < now - self.rate_window:
            s.window.popleft()
        if not s.window:
            return 0.0
        return sum(n for _, n in s.window) / self.rate_window

    def _lag_seconds(self, s: _Src, now: float) -> float:
        if not s.lag_messages:
            return 0.0
        ref = max(x for x in (s.newest_event_time, s.behind_since, 0.0) if x is not None)
        return max(0.0, now - ref)

    def _evaluate(self, s: _Src, now: float, live: bool = False) -> None:
        if not live and s.kind == "kafka":
            s.lag_seconds = self._lag_seconds(s, now)
        events: list[dict[str, Any]] = []
        error = s.last_error or (None if s.recovering is None else f"rebuilding: {s.recovering}")
        t = s.machine.update(s.lag_messages, s.lag_seconds, error=error, now=now)
        if t is not None:
            events.append(self._event(s, t.state, self._readers(s.name), t.reason, now, s.machine))
        for (b, src), m in self._overrides.items():
            if src == s.name:
                t2 = m.update(s.lag_messages, s.lag_seconds, error=error, now=now)
                if t2 is not None:
                    events.append(self._event(s, t2.state, [b], t2.reason, now, m, scope="binding"))
        self._changed.notify_all()
        if events:
            self._refresh_bindings(now)
            for ev in events:
                self._notify(ev)

    def _event(
        self,
        s: _Src,
        state: str,
        bindings: list[str],
        reason: str,
        now: float,
        m: StateMachine,
        scope: str = "source",
    ) -> dict[str, Any]:
        return make_event(
            DATA_STALE if state == STALE else DATA_FRESH,
            s.name,
            bindings,
            s.lag_messages,
            s.lag_seconds,
            at=now,
            state=state,
            since=iso(m.since),
            reason=reason,
            last_error=s.last_error,
            scope=scope,
        )

    def _refresh_bindings(self, now: float) -> None:
        for b, names in self._bindings.items():
            if any(n not in self._sources for n in names):
                continue
            state = STALE if any(self._stale_for(b, n) for n in names) else FRESH
            old = self._binding_state.get(b)
            if old is None or old[0] != state:
                self._binding_state[b] = (state, now)

    def _notify(self, event: dict[str, Any]) -> None:
        for cb in list(self._listeners):
            try:
                cb(event)
            except Exception:  # a broken listener must not break ingestion
                log.exception("freshness listener failed")

    def _snap(self, s: _Src, now: float) -> SourceFreshness:
        status, reason = s.status()
        return SourceFreshness(
            name=s.name,
            state=s.machine.state,
            since=s.machine.since,
            lag_messages=s.lag_messages,
            lag_seconds=s.lag_seconds,
            ingest_rate=self._rate(s, now),
            ingested_total=s.ingested_total,
            dead_letter_total=s.dead_letter_total,
            last_error=s.last_error,
            newest_event_time=s.newest_event_time,
            observed_at=now,
            kind=s.kind,
            uri=s.uri,
            bindings=tuple(self._readers(s.name)),
            detail=dict(s.detail),
            status=status,
            reason=reason,
            errors={k: m for k, (m, _) in s.errors.items()},
            notices=tuple(dict(n) for n in s.notices),
            last_dead_letter=None if s.last_dead_letter is None else dict(s.last_dead_letter),
        )
