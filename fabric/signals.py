"""Freshness signals for schedulers: a fresh|stale state machine with hysteresis, and a
background sender that pushes JSON events to UDP and HTTP targets.

State machine (one per source, and one per binding/source pair when a binding states its
own bound): it turns *stale* as soon as ``lag_messages > N`` or ``lag_seconds > S`` (or the
source reports an error), and turns *fresh* again only when both lags are at or below
half of their thresholds (and no error), after at least ``min_dwell`` seconds in the
stale state. A lag that saw-tooths between, say, 0.6 N and 1.2 N therefore goes stale once
and stays stale instead of flapping.

Every pushed event is one JSON object (one UDP datagram, or one HTTP POST body)::

    {"event": "data_stale", "source": "dataset://news", "bindings": ["market_open_news"],
     "lag_messages": 120345, "lag_seconds": 41.2, "at": "2026-11-29T12:40:01.123+00:00",
     "state": "stale", "since": "...", "reason": "lag_messages 120345 > 1000",
     "last_error": null, "seq": 17}

``event`` is ``data_stale``, ``data_fresh`` or ``heartbeat``.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("fabric.signals")

FRESH = "fresh"
STALE = "stale"
DATA_STALE = "data_stale"
DATA_FRESH = "data_fresh"
HEARTBEAT = "heartbeat"


def iso(ts: float) -> str:
    """Epoch seconds -> ISO-8601 UTC with milliseconds."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Thresholds:
    """When a source is stale: ``lag_messages > lag_messages`` or ``lag_seconds > lag_seconds``.

    ``None`` disables that criterion. Fresh again only at or below ``recover_ratio`` (half)
    of every enabled threshold, after ``min_dwell`` seconds in the stale state, and once
    the lag has stayed that low for ``recover_after`` seconds without interruption (a
    stabilization window, as in Kubernetes' HPA: a sawtooth lag whose peaks cross the
    stale threshold more often than that stays stale instead of flapping).
    """

    lag_messages: int | None = 1000
    lag_seconds: float | None = 30.0
    recover_ratio: float = 0.5
    min_dwell: float = 0.0
    recover_after: float = 0.0

    def __post_init__(self) -> None:
        if self.lag_messages is not None and self.lag_messages < 0:
            raise ValueError(f"stale_when.lag_messages must be >= 0, got {self.lag_messages}")
        if self.lag_seconds is not None and self.lag_seconds < 0:
            raise ValueError(f"stale_when.lag_seconds must be >= 0, got {self.lag_seconds}")
        if not 0.0 <= self.recover_ratio <= 1.0:
            raise ValueError(f"recover_ratio must be within [0, 1], got {self.recover_ratio}")

    def stale_reason(self, lag_messages: int | None, lag_seconds: float | None) -> str | None:
        if (
            self.lag_messages is not None
            and lag_messages is not None
            and lag_messages > self.lag_messages
        ):
            return f"lag_messages {lag_messages} > {self.lag_messages}"
        if (
            self.lag_seconds is not None
            and lag_seconds is not None
            and lag_seconds > self.lag_seconds
        ):
            return f"lag_seconds {lag_seconds:.3f} > {self.lag_seconds}"
        return None

    def recovered(self, lag_messages: int | None, lag_seconds: float | None) -> bool:
        r = self.recover_ratio
        if self.lag_messages is not None and (lag_messages or 0) > self.lag_messages * r:
            return False
        return not (self.lag_seconds is not None and (lag_seconds or 0.0) > self.lag_seconds * r)


@dataclass(frozen=True)
class Transition:
    state: str  # the new state
    at: float
    reason: str


class StateMachine:
    """fresh|stale with hysteresis and an optional minimum dwell. Not thread-safe by itself."""

    def __init__(self, thresholds: Thresholds, *, now: float | None = None, state: str = FRESH):
        self.thresholds = thresholds
        self.state = state
        self.since = time.time() if now is None else now
        self.reason = "started"
        self.recovered_since: float | None = None

    def update(
        self,
        lag_messages: int | None,
        lag_seconds: float | None,
        *,
        error: str | None = None,
        now: float | None = None,
    ) -> Transition | None:
        now = time.time() if now is None else now
        t = self.thresholds
        if self.state == FRESH:
            reason = f"error: {error}" if error else t.stale_reason(lag_messages, lag_seconds)
            if reason is None:
                return None
            return self._go(STALE, now, reason)
        if error or not t.recovered(lag_messages, lag_seconds):
            self.recovered_since = None
            return None
        if self.recovered_since is None:
            self.recovered_since = now
        if t.min_dwell and now - self.since < t.min_dwell:
            return None
        if t.recover_after and now - self.recovered_since < t.recover_after:
            return None
        self.recovered_since = None
        return self._go(FRESH, now, "lag below half of every threshold")

    def _go(self, state: str, now: float, reason: str) -> Transition:
        self.state, self.since, self.reason = state, now, reason
        return Transition(state, now, reason)


def make_event(
    event: str,
    source: str,
    bindings: Iterable[str],
    lag_messages: int | None,
    lag_seconds: float | None,
    *,
    at: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The pushed JSON object (see the module docstring)."""
    body: dict[str, Any] = {
        "event": event,
        "source": source,
        "bindings": sorted(bindings),
        "lag_messages": lag_messages,
        "lag_seconds": None if lag_seconds is None else round(lag_seconds, 3),
        "at": iso(time.time() if at is None else at),
    }
    body.update(extra)
    return body


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str  # udp | http | https
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Target:
        p = urllib.parse.urlsplit(url)
        if p.scheme not in ("udp", "http", "https"):
            raise ValueError(
                f"signals target {url!r}: unsupported scheme {p.scheme!r}; "
                "use udp://host:port or http(s)://host[:port]/path"
            )
        if not p.hostname:
            raise ValueError(f"signals target {url!r}: missing host; e.g. udp://127.0.0.1:9999")
        try:
            port = p.port
        except ValueError:
            raise ValueError(f"signals target {url!r}: the port is not a number") from None
        if port is None:
            if p.scheme == "udp":
                raise ValueError(
                    f"signals target {url!r}: a UDP target needs a port, e.g. udp://127.0.0.1:9999"
                )
            port = 443 if p.scheme == "https" else 80
        return cls(url, p.scheme, p.hostname, port)


@dataclass
class SenderStats:
    sent: int = 0
    failed: int = 0
    dropped: int = 0
    retries: int = 0
    last_error: str | None = None


class _TargetSender:
    """One bounded queue + one daemon thread per target, so a slow webhook never delays UDP."""

    def __init__(
        self, target: Target, queue_size: int, http_timeout: float, retries: int, backoff: float
    ):
        self.target = target
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.queue_size = queue_size
        self.http_timeout = http_timeout
        self.retries = retries
        self.backoff = backoff
        self.stats = SenderStats()
        self.cond = threading.Condition()
        self.closed = False
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"fabric-signal-{target.url}", daemon=True
        )
        self.thread.start()

    def put(self, event: dict[str, Any]) -> None:
        with self.cond:
            if len(self.queue) >= self.queue_size:
                self._drop_one()
            self.queue.append(event)
            self.cond.notify()

    def _drop_one(self) -> None:
        """Queue full: drop the oldest heartbeat; if there is none, the oldest event."""
        for i, ev in enumerate(self.queue):
            if ev.get("event") == HEARTBEAT:
                del self.queue[i]
                break
        else:
            self.queue.popleft()
        self.stats.dropped += 1

    def close(self, timeout: float) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout)
        if self.sock is not None:
            self.sock.close()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue and self.closed:
                    return
                event = self.queue.popleft()
            data = json.dumps(event, separators=(",", ":")).encode()
            try:
                self._send(data)
                self.stats.sent += 1
            except Exception as exc:  # a target being down must never stop the sender
                self.stats.failed += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("signal to %s failed: %s", self.target.url, self.stats.last_error)

    def _send(self, data: bytes) -> None:
        if self.target.scheme == "udp":
            if self.sock is None:
                self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.sendto(data, (self.target.host, self.target.port))
            return
        delay = self.backoff
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(
                self.target.url,
                data=data,
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=self.http_timeout) as resp:
                    resp.read()
                return
            except (urllib.error.URLError, OSError) as exc:
                if attempt == self.retries or self.closed:
                    raise
                self.stats.retries += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                time.sleep(delay)
                delay = min(delay * 2, 5.0)


class SignalEmitter:
    """Pushes events to every target from background threads; ``emit`` never blocks."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        queue_size: int = 1000,
        http_timeout: float = 2.0,
        retries: int = 3,
        backoff: float = 0.2,
    ):
        parsed = [Target.parse(t) for t in targets]
        self._senders = [
            _TargetSender(t, queue_size, http_timeout, retries, backoff) for t in parsed
        ]
        self._seq = 0
        self._lock = threading.Lock()

    def emit(self, event: Mapping[str, Any]) -> None:
        with self._lock:
            self._seq += 1
            ev = {**event, "seq": self._seq}
        for s in self._senders:
            s.put(ev)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {s.target.url: {**vars(s.stats), "queued": len(s.queue)} for s in self._senders}

    @property
    def dropped(self) -> int:
        return sum(s.stats.dropped for s in self._senders)

    def close(self, timeout: float = 2.0) -> None:
        for s in self._senders:
            s.close(timeout)


@dataclass(frozen=True)
class SignalsConfig:
    """The ``signals:`` block of fabric.yaml as plain values."""

    stale_when: Thresholds = field(default_factory=Thresholds)
    heartbeat: float | None = 5.0
    targets: tuple[str, ...] = ()
    per_source: Mapping[str, Thresholds] = field(default_factory=dict)
