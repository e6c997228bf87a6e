"""Validation shared by the YAML and compact text forms: durations, freshness, nearest,
sandbox limits, source URIs. One code path, so both forms accept and reject the same."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dsl.ast import Expr
from dsl.errors import DslError, Span, did_you_mean
from dsl.spec import FreshnessSpec, Name, NearestSpec, RankSpec, SandboxLimits, SearchSpec

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_MESSAGES = re.compile(r"^\s*(\d[\d_,]*)\s*(?:messages|msgs)\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}

#: (key, value, span) as given by either form; values are Python scalars.
Option = tuple[str, Any, Span | None]

ON_STALE = ("wait", "flag", "fail")
METRICS = ("cosine", "l2", "ip", "dot")
URI_RE = re.compile(r"^([a-z][a-z0-9+]*)://([^/\s]+)(?:/(\S+))?$")


def duration_seconds(v: Any, span: Span | None, what: str) -> float:
    """``5s``, ``500ms``, ``2m``, ``1h``, ``1d`` or a plain number of seconds."""
    if isinstance(v, bool):
        raise DslError.at(f"{what} must be a duration like 5s, 500ms or 2m, got {v!r}", span)
    if isinstance(v, int | float):
        if v < 0:
            raise DslError.at(f"{what} must not be negative", span)
        return float(v)
    m = _DURATION.match(str(v))
    if not m:
        raise DslError.at(
            f"{what} must be a duration like 5s, 500ms or 2m, got {v!r}",
            span,
            "units: ms, s, m, h, d (a bare number means seconds)",
        )
    return float(m.group(1)) * _UNIT[m.group(2)]


def _int(v: Any, span: Span | None, what: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise DslError.at(f"{what} must be an integer >= {minimum}, got {v!r}", span)
    return v


def _check_keys(
    items: Sequence[Option], allowed: Sequence[str], what: str
) -> dict[str, tuple[Any, Span | None]]:
    out: dict[str, tuple[Any, Span | None]] = {}
    for key, value, span in items:
        if key not in allowed:
            raise DslError.at(
                f"unknown {what} option '{key}'", span, did_you_mean(key, allowed, "options")
            )
        if key in out:
            raise DslError.at(f"{what} option '{key}' is given twice", span)
        out[key] = (value, span)
    return out


def make_freshness(items: Sequence[Option], span: Span | None) -> FreshnessSpec:
    opts = _check_keys(
        items, ("max_lag", "max_lag_messages", "on_stale", "wait_timeout"), "freshness"
    )
    max_lag = max_msgs = timeout = None
    on_stale = "flag"
    if "max_lag" in opts:
        v, s = opts["max_lag"]
        if isinstance(v, str) and v.strip().endswith(("messages", "msgs")):
            m = _MESSAGES.match(v)
            if not m:
                raise DslError.at(
                    f"freshness max_lag must be a whole number of messages, got {v!r}",
                    s,
                    "write e.g. '1000 messages'",
                )
            max_msgs = int(re.sub(r"[_,]", "", m.group(1)))
        else:
            max_lag = duration_seconds(v, s, "freshness max_lag")
    if "max_lag_messages" in opts:
        v, s = opts["max_lag_messages"]
        max_msgs = _int(v, s, "freshness max_lag_messages")
    if "on_stale" in opts:
        v, s = opts["on_stale"]
        if v not in ON_STALE:
            raise DslError.at(
                f"freshness on_stale must be one of {', '.join(ON_STALE)}, got {v!r}",
                s,
                did_you_mean(str(v), ON_STALE, "choices"),
            )
        on_stale = v
    if "wait_timeout" in opts:
        v, s = opts["wait_timeout"]
        timeout = duration_seconds(v, s, "freshness wait_timeout")
    if max_lag is None and max_msgs is None:
        raise DslError.at(
            "freshness needs max_lag (e.g. 5s or '1000 messages') or max_lag_messages", span
        )
    return FreshnessSpec(max_lag, max_msgs, on_stale, timeout, span=span)


def make_nearest(
    column: Name,
    to: Expr,
    k: Any,
    k_span: Span | None,
    metric: Any,
    metric_span: Span | None,
    span: Span | None,
) -> NearestSpec:
    k = _int(k, k_span, "nearest k", 1)
    if metric is not None and metric not in METRICS:
        raise DslError.at(
            f"unknown metric {metric!r}", metric_span, did_you_mean(str(metric), METRICS, "metrics")
        )
    return NearestSpec(column, to, k, metric, span=span)


def make_search(
    column: Name, query: Expr, k: Any, k_span: Span | None, span: Span | None
) -> SearchSpec:
    return SearchSpec(column, query, _int(k, k_span, "search k", 1), span=span)


RANK_KEYS = ("k", "rrf_k", "recency", "half_life")


def make_rank(items: Sequence[Option], span: Span | None) -> RankSpec:
    """``rank: {k, rrf_k, recency, half_life}`` (all optional; recency and half_life
    together). ``k``: rows kept after fusion (default: the larger arm's k)."""
    opts = _check_keys(items, RANK_KEYS, "rank")
    kw: dict[str, Any] = {}
    if "rrf_k" in opts:
        kw["rrf_k"] = _int(*opts["rrf_k"], "rank rrf_k", 0)
    if "k" in opts:
        kw["k"] = _int(*opts["k"], "rank k", 1)
    if "recency" in opts:
        v, s = opts["recency"]
        if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v.strip()):
            raise DslError.at(f"rank recency must be a timestamp column name, got {v!r}", s)
        kw["recency"] = Name(v.strip(), s)
    if "half_life" in opts:
        v, s = opts["half_life"]
        kw["half_life_seconds"] = duration_seconds(v, s, "rank half_life")
        if kw["half_life_seconds"] <= 0:
            raise DslError.at("rank half_life must be positive", s)
    if ("recency" in kw) != ("half_life_seconds" in kw):
        given, missing = ("recency", "half_life") if "recency" in kw else ("half_life", "recency")
        raise DslError.at(
            f"rank {given} needs {missing}",
            opts[given if given == "recency" else "half_life"][1] or span,
            "write both, e.g. rank: {recency: published_at, half_life: 7d}",
        )
    return RankSpec(**kw, span=span)


def make_limits(items: Sequence[Option]) -> SandboxLimits:
    opts = _check_keys(
        items, ("cpu_seconds", "wall_seconds", "memory_mb", "output_mb"), "sandbox limits"
    )
    kw: dict[str, Any] = {}
    for key, (v, s) in opts.items():
        if key.endswith("_seconds"):
            kw[key] = duration_seconds(v, s, f"limits {key}")
        else:
            kw[key] = _int(v, s, f"limits {key}", 1)
    return SandboxLimits(**kw)


def check_uri(uri: str, span: Span | None) -> str:
    """``<kind>://<connection>/<object>``, ``dataset://<name>`` or ``stage://<name>``."""
    m = URI_RE.match(uri)
    if (
        not m
        or (m.group(1) not in ("dataset", "stage") and not m.group(3))
        or (m.group(1) in ("dataset", "stage") and m.group(3))
    ):
        raise DslError.at(
            f"malformed source '{uri}'",
            span,
            "write <kind>://<connection>/<object> (e.g. mysql://shop/merchants), "
            "dataset://<name> or stage://<name>",
        )
    return uri


def default_alias(uri: str) -> str:
    """The alias of ``from <uri>`` without ``as``: the object's last path segment."""
    tail = uri.rstrip("/").rsplit("/", 1)[-1]
    tail = re.split(r"[.*?\[]", tail, maxsplit=1)[0] or "src"
    alias = re.sub(r"\W", "_", tail)
    return alias if not alias[0].isdigit() else "_" + alias
