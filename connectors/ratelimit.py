"""Request budgets of a connection: a token bucket and retries with backoff.

``rate_limit: {per_second: N, burst: M}`` on a connection gives it one :class:`TokenBucket`
shared by every source, scan and thread of that connection in this process: each request
(a REST page, a scan of another kind) takes one token; tokens refill at ``N`` per second up
to ``M`` (default ``max(1, N)``). A caller that finds no token reserves the next one and
sleeps until it is due, so under any number of concurrent callers the requests started in
any window of ``T`` seconds are at most ``M + N * T``.

``retries: {max: 3, base: 0.1, max_delay: 10}`` (:class:`RetryPolicy`) retries transient
failures (HTTP 429/502/503/504, refused or reset connections, timeouts) up to ``max``
times, waiting ``uniform(0, min(max_delay, base * 2**attempt))`` (exponential backoff with
full jitter), and never less than the server's ``Retry-After``. A wait that would end after
the query's deadline is not taken: the request fails at once, saying so.

Both report what they did into a scan's metrics (``ScanMetrics``): requests, retries, the
seconds waited for tokens and for backoff, which ``res.stats`` and ``explain(analyze=True)``
show under the source.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class RateLimitConfigError(ValueError):
    """A ``rate_limit:`` or ``retries:`` option that is not valid."""


def _number(options: Mapping[str, Any], key: str, what: str, default: float | None) -> float | None:
    v = options.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise RateLimitConfigError(f"{what}.{key} must be a non-negative number, got {v!r}")
    return float(v)


@dataclass
class ScanMetrics:
    """What one scan spent on its connection's budget (reported in ``res.stats``)."""

    requests: int = 0
    retries: int = 0
    throttle_wait_s: float = 0.0  # waiting for a rate-limit token
    backoff_wait_s: float = 0.0  # waiting between retries (Retry-After included)
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> count

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests,
            "retries": self.retries,
            "throttle_wait_ms": round(self.throttle_wait_s * 1000, 3),
            "backoff_wait_ms": round(self.backoff_wait_s * 1000, 3),
        }
        if self.statuses:
            out["statuses"] = {str(k): v for k, v in sorted(self.statuses.items())}
        return out


class TokenBucket:
    """``per_second`` tokens a second, at most ``burst`` saved; thread-safe.

    >>> b = TokenBucket(per_second=1000, burst=2)
    >>> b.acquire() == 0.0 and b.acquire() == 0.0
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

    def reserve(self) -> float:
        """Take a token; the seconds until it is due (0: now). Does not sleep."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= 1.0
            self.granted += 1
            wait = 0.0 if self._tokens >= 0 else -self._tokens / self.rate
            self.waited_s += wait
            return wait

    def acquire(self, deadline: float | None = None, what: str = "request") -> float:
        """Wait for a token (at most until ``deadline``, a ``time.monotonic()`` instant);
        the seconds waited. Raises ``TimeoutError`` when the token is due after the deadline
        (the token is still consumed: the budget stays honest)."""
        wait = self.reserve()
        if wait <= 0:
            return 0.0
        if deadline is not None and time.monotonic() + wait > deadline:
            raise TimeoutError(
                f"rate limit ({self.rate:g}/s, burst {self.burst:g}): the next {what} is due in "
                f"{wait:.2f} s, after the query's deadline"
            )
        time.sleep(wait)
        return wait


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
