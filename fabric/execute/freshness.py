"""Freshness of each source as read: watermark -> status, lag, and the on_stale policy.

The watermark comes from ``catalog.freshness(uri)`` when the catalog has such a provider
(the ingestion side tracks datasets and consumer groups), else from
``source.watermark()``. Either may return a ``connectors.base.Watermark``, a mapping with
``lag_messages`` / ``lag_seconds`` / ``event_time``, or None (unknown).

Seconds of lag count only while messages are pending (or when the message lag is
unknown): a source with nothing left to read is fresh however old its newest event.
A source that cannot tell its freshness gets status ``unknown`` and is not treated as
stale.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import Any

from connectors.base import Source, Watermark
from fabric.execute.errors import QueryError
from fabric.plan.nodes import Freshness

DEFAULT_WAIT_TIMEOUT = 10.0
_NONE = Source.watermark  # a source that does not override it cannot tell
POLL_SECONDS = (0.02, 0.05, 0.1, 0.2)


def read_watermark(catalog: Any, source: Any, uri: str) -> Watermark | Mapping[str, Any] | None:
    """The provider's answer, else the source's; None when neither can tell (a failing
    watermark request makes the freshness unknown, it does not fail the query)."""
    provider = getattr(catalog, "freshness", None)
    if callable(provider):
        try:
            wm = provider(uri)
        except (TypeError, KeyError, LookupError):
            wm = None
        if wm is not None:
            return wm
    fn = getattr(source, "watermark", None)
    if not callable(fn) or getattr(fn, "__func__", None) is _NONE:  # (the base's: None)
        return None
    try:
        return fn()
    except Exception:
        return None


def describe(uri: str, wm: Any, bound: Freshness | None, now: float) -> dict[str, Any]:
    """``{uri, status, lag_messages, lag_seconds, watermark}`` for a watermark."""
    if wm is None:
        return {
            "uri": uri,
            "status": "unknown",
            "lag_messages": None,
            "lag_seconds": None,
            "watermark": None,
        }
    if isinstance(wm, Watermark):
        event_time, lag_messages = wm.event_time, wm.lag_messages
        lag_seconds = None if event_time is None else max(0.0, (wm.observed_at or now) - event_time)
    else:
        event_time = wm.get("event_time", wm.get("watermark"))
        if isinstance(event_time, dt.datetime):
            event_time = event_time.timestamp()
        lag_messages = wm.get("lag_messages")
        lag_seconds = wm.get("lag_seconds")
        if lag_seconds is None and isinstance(event_time, int | float):
            lag_seconds = max(0.0, now - event_time)
    known = lag_messages is not None or lag_seconds is not None
    status = (
        "unknown"
        if not known
        else ("stale" if is_stale(lag_messages, lag_seconds, bound) else "fresh")
    )
    # the provider could not measure (topic missing, broker down, pending messages of
    # unknown age): never fresh
    error = wm.get("error") if isinstance(wm, Mapping) else None
    if error:
        status = "stale"
    watermark = (
        dt.datetime.fromtimestamp(event_time, dt.UTC).isoformat()
        if isinstance(event_time, int | float)
        else event_time
    )
    return {
        "uri": uri,
        "status": status,
        "lag_messages": lag_messages,
        "lag_seconds": None if lag_seconds is None else round(float(lag_seconds), 3),
        "watermark": watermark,
        **({"error": str(error)} if error else {}),
    }


def is_stale(lag_messages: int | None, lag_seconds: float | None, bound: Freshness | None) -> bool:
    if bound is None:
        return False
    if (
        bound.max_lag_messages is not None
        and lag_messages is not None
        and lag_messages > bound.max_lag_messages
    ):
        return True
    pending = lag_messages is None or lag_messages > 0
    return bool(
        bound.max_lag_seconds is not None
        and lag_seconds is not None
        and pending
        and lag_seconds > bound.max_lag_seconds
    )


def check(
    catalog: Any, source: Any, uri: str, alias: str, bound: Freshness | None, binding: str
) -> tuple[dict[str, Any], float]:
    """Read the freshness of one source and apply its ``on_stale`` policy.

    Returns (freshness entry, seconds waited). ``fail`` raises at once when stale;
    ``wait`` polls until fresh or ``wait_timeout`` (then raises); ``flag`` marks it."""
    start = time.monotonic()
    info = describe(uri, read_watermark(catalog, source, uri), bound, time.time())
    if info["status"] != "stale" or bound is None:
        return info, 0.0
    if bound.on_stale == "fail":
        raise QueryError(
            binding,
            f"data is stale: {_lag_text(info)}, bound {bound}",
            alias=alias,
            uri=uri,
            hint="wait for the source to catch up, or declare freshness.on_stale: flag or wait",
        )
    if bound.on_stale == "wait":
        timeout = bound.wait_timeout if bound.wait_timeout is not None else DEFAULT_WAIT_TIMEOUT
        polls = 0
        while info["status"] == "stale":
            waited = time.monotonic() - start
            if waited >= timeout:
                raise QueryError(
                    binding,
                    f"data still stale after waiting {waited:.1f} s: {_lag_text(info)}, bound {bound}",
                    alias=alias,
                    uri=uri,
                    hint="raise freshness.wait_timeout, or declare on_stale: flag to answer with stale data",
                )
            time.sleep(
                min(POLL_SECONDS[min(polls, len(POLL_SECONDS) - 1)], max(0.0, timeout - waited))
            )
            polls += 1
            info = describe(uri, read_watermark(catalog, source, uri), bound, time.time())
        waited = time.monotonic() - start
        info["waited_seconds"] = round(waited, 3)
        return info, waited
    info["flagged"] = True
    return info, 0.0


def _lag_text(info: Mapping[str, Any]) -> str:
    parts = []
    if info.get("lag_messages") is not None:
        parts.append(f"{info['lag_messages']} messages behind")
    if info.get("lag_seconds") is not None:
        parts.append(f"{info['lag_seconds']:g} s behind")
    if info.get("error"):
        parts.append(str(info["error"]))
    return ", ".join(parts) or "lag unknown"
