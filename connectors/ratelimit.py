"""Request budgets of a connection: a token bucket and retries with backoff.

``rate_limit: {per_second: N, burst: M}`` on a connection gives it one :class:`TokenBucket`
shared by every source, scan and thread of that connection in this process: each request
(a REST page, a scan of another kind) takes one token; tokens refill at ``N`` per second up
to ``M`` (default ``max(1, N)``). A caller that finds no token sleeps until one is due and
tries again (tokens are taken when there, never reserved ahead), so under any number of
concurrent callers the requests started in any window of ``T`` seconds are at most
``M + N * T``.

``retries: {max: 3, base: 0.1, max_delay: 10}`` (:class:`RetryPolicy`) retries transient
failures (HTTP 429/502/503/504, refused or reset connections, timeouts) up to ``max``
times, waiting ``uniform(0, min(max_delay, base * 2**attempt))`` (exponential backoff with
full jitter), and never less than the server's ``Retry-After``. A wait that would end after
the query's deadline is not taken: the request fails at once, saying so.

Both report what they did into the scan's own metrics (``request.metrics``, a
``connectors.base.ScanMetrics``): requests, retries, the seconds waited for tokens and for
backoff, which ``res.stats`` and ``explain(analyze=True)`` show under the source.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsl.errors import FabricError


class RateLimitConfigError(FabricError, ValueError):
    """A ``rate_limit:`` or ``retries:`` option that is not valid."""


def _number(options: Mapping[str, Any], key: str, what: str, default: float | None) -> float | None:
    v = options.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise RateLimitConfigError(f"{what}.{key} must be a non-negative number, got {v!r}")
    return float(v)


class TokenBucket:
    """``per_second`` tokens a second, at most ``burst`` saved; thread-safe.

    >>> b = TokenBucket(per_second=1000, burst=2)
    >>> b.try_take() == 0.0 and b.try_take() == 0.0 and b.try_take() > 0
    True
    """

    def __init__(self, per_second: float, burst: float | None = None):
        if per_second <= 0:
            raise RateLimitConfigError(f"rate_limit.per_second must be > 0, got {per_second!r}")
        self.rate = float(per_second)
        self.burst = float(burst) if burst is not None else max(1.0, self.rate)
        if self.burst < 1:
            raise RateLimitConfigError(f"rate_limit.burst must be >= 1, got {burst!r}")
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.granted = 0  # tokens handed out (for metrics)
        self.waited_s = 0.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, what: str) -> TokenBucket | None:
        if options is None:
            return None
        if not isinstance(options, Mapping):
            raise RateLimitConfigError(
                f"{what} must be a mapping such as {{per_second: 5, burst: 10}}, got {options!r}"
            )
        unknown = sorted(set(options) - {"per_second", "burst"})
        if unknown:
            raise RateLimitConfigError(
                f"{what} has unknown key(s) {', '.join(unknown)}; keys: per_second, burst"
            )
        rate = _number(options, "per_second", what, None)
        if rate is None:
            raise RateLimitConfigError(f"{what} needs per_second (requests per second)")
        return cls(rate, _number(options, "burst", what, None))

    def try_take(self) -> float:
        """Take a token if one is there now (0.0), else the seconds until one will be."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                self.granted += 1
                return 0.0
            return (1.0 - self._tokens) / self.rate

    def acquire(self, deadline: float | None = None, what: str = "request") -> float:
        """Wait for a token (at most until ``deadline``, a ``time.monotonic()`` instant);
        the seconds waited. A token is taken only when it is there at that moment (never
        reserved ahead), so a caller the OS wakes late cannot make requests bunch beyond
        ``burst``. Raises ``TimeoutError`` when none would come before the deadline."""
        t0 = time.monotonic()
        while True:
            wait = self.try_take()
            if wait <= 0:
                waited = time.monotonic() - t0
                with self._lock:
                    self.waited_s += waited
                return waited
            if deadline is not None and time.monotonic() + wait > deadline:
                raise TimeoutError(
                    f"rate limit ({self.rate:g}/s, burst {self.burst:g}): no token for the "
                    f"next {what} before the query's deadline"
                )
            time.sleep(wait)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient failures: exponential backoff with full jitter."""

    max: int = 3
    base: float = 0.1
    max_delay: float = 10.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, what: str) -> RetryPolicy:
        if options is None:
            return cls()
        if isinstance(options, int) and not isinstance(options, bool):
            return cls(max=options)
        if not isinstance(options, Mapping):
            raise RateLimitConfigError(
                f"{what} must be a count or a mapping such as {{max: 3, base: 0.1, max_delay: 10}},"
                f" got {options!r}"
            )
        unknown = sorted(set(options) - {"max", "base", "max_delay"})
        if unknown:
            raise RateLimitConfigError(
                f"{what} has unknown key(s) {', '.join(unknown)}; keys: max, base, max_delay"
            )
        n = options.get("max", 3)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise RateLimitConfigError(f"{what}.max must be a non-negative integer, got {n!r}")
        return cls(
            max=n,
            base=_number(options, "base", what, 0.1) or 0.0,
            max_delay=_number(options, "max_delay", what, 10.0) or 0.0,
        )

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        d = random.uniform(0.0, min(self.max_delay, self.base * (2**attempt)))
        if retry_after is not None:
            d = max(d, retry_after)
        return d


# ---------------------------------------------------------------- any kind's sources

#: the connection options this module reads for any kind (``rest`` applies them per request)
OPTIONS = ("rate_limit", "retries")


@dataclass(frozen=True)
class Limits:
    """One connection's budget: its bucket (shared by all its sources) and retry policy."""

    bucket: TokenBucket | None
    retry: RetryPolicy


def _ours(value: Any, kind: str | None) -> bool:
    """Whether a ``retries`` value is this module's: a mapping, or a number except for
    S3 (whose connector takes a number as its client's retry attempts)."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and kind != "s3"


def limits_of(options: Mapping[str, Any], what: str, kind: str | None = None) -> Limits | None:
    """The ``rate_limit`` / ``retries`` of a connection of any kind but ``rest`` (None:
    neither is set). ``retries`` is ``{max, base, max_delay}`` or a number (``max``); for
    ``s3`` a number stays the connector's own (its client's retry attempts).
    Raises RateLimitConfigError naming the option."""
    rl = options.get("rate_limit")
    rt = options.get("retries")
    if not _ours(rt, kind):
        rt = None
    if rl is None and rt is None:
        return None
    bucket = TokenBucket.from_options(rl, f"{what}: rate_limit")
    retry = RetryPolicy.from_options(rt, f"{what}: retries") if rt is not None else RetryPolicy()
    return Limits(bucket, retry)


def connector_options(options: Mapping[str, Any], kind: str | None = None) -> dict[str, Any]:
    """``options`` without what this module consumes (``rate_limit``, and ``retries``
    unless it is S3's number), as the connector of a kind other than ``rest`` receives them."""
    return {
        k: v
        for k, v in options.items()
        if not (k == "rate_limit" or (k == "retries" and _ours(v, kind)))
    }


class LimitedSource:
    """A source of a connection with ``rate_limit`` / ``retries`` (any kind but ``rest``,
    which limits each HTTP request itself): every scan takes a token of the connection's
    bucket, and a scan that fails with a retriable ``SourceError`` (the server down,
    refused, timed out) before its first batch is retried with backoff and jitter. A scan
    that failed after yielding rows is not retried (the rows are already out). Everything
    else is the wrapped source's (attributes are forwarded)."""

    def __init__(self, inner: Any, limits: Limits):
        self.inner = inner
        self.limits = limits
        self.uri = inner.uri
        self.capabilities = inner.capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"LimitedSource({self.inner!r})"

    def schema(self) -> Any:
        return self.inner.schema()

    def supports_filter(self, expr: Any) -> Any:
        return self.inner.supports_filter(expr)

    def statistics(self) -> Any:
        return self.inner.statistics()

    def watermark(self) -> Any:
        return self.inner.watermark()

    def scan(self, request: Any) -> Any:
        from connectors.base import SourceError

        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        metrics = request.metrics  # this scan's own; the wrapped source fills the rest
        bucket, retry = self.limits.bucket, self.limits.retry
        attempt = 0
        while True:
            if bucket is not None:
                try:
                    metrics.throttle_wait_s += bucket.acquire(deadline, "scan")
                except TimeoutError as e:
                    raise SourceError(self.uri, str(e), retriable=True) from None
            metrics.requests += 1
            batches = iter(self.inner.scan(request))
            try:
                first = next(batches)
            except StopIteration:
                return
            except SourceError as e:
                if not e.retriable or attempt >= retry.max:
                    raise
                delay = retry.delay(attempt)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                metrics.backoff_wait_s += delay
                metrics.retries += 1
                attempt += 1
                continue
            yield first
            yield from batches
            return
