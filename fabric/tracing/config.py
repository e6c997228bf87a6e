"""``tracing:`` of fabric.yaml (docs/tracing.md).

tracing:
  enabled: true                 # default: spans kept in the local ring buffer
  ring_spans: 10000             # spans kept in memory (oldest dropped first)
  otlp_endpoint: http://collector:4318/v1/traces   # also exported by OTLP/HTTP
  service_name: agent-data-fabric
  session_values: hash          # hash (default) | redact: how session values are recorded
  redact: [user_id]             # never recorded, not even hashed
  record: [region]              # recorded in clear
  max_sessions: 1000            # sessions whose data cost is kept for /metrics
  prices:
    connections: {shop: {call: 0.0001, row: 0.000001, mib: 0.02}}
    sandbox_cpu_second: 0.00005
    ckks_op: 0.00001
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TRACING_KEYS = (
    "enabled",
    "ring_spans",
    "otlp_endpoint",
    "otlp_headers",
    "service_name",
    "session_values",
    "redact",
    "record",
    "max_sessions",
    "prices",
)
PRICE_KEYS = ("connections", "sandbox_cpu_second", "ckks_op")
UNIT_KEYS = ("call", "row", "mib")
SESSION_VALUE_MODES = ("hash", "redact")


@dataclass(frozen=True)
class Prices:
    """Price per unit: per connection (``call``: one source call, ``row``: one row fetched,
    ``mib``: one MiB fetched), per sandbox CPU second, per CKKS operation."""

    connections: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    sandbox_cpu_second: float = 0.0
    ckks_op: float = 0.0


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = True
    ring_spans: int = 10_000
    otlp_endpoint: str | None = None
    otlp_headers: Mapping[str, str] = field(default_factory=dict)
    service_name: str = "agent-data-fabric"
    #: how a session value not named in ``record:`` or ``redact:`` is recorded
    session_values: str = "hash"
    redact: tuple[str, ...] = ()
    record: tuple[str, ...] = ()
    max_sessions: int = 1000
    prices: Prices = Prices()


def _number(L: Any, m: Any, key: Any, what: str) -> float:
    v = m[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise L.y.error(
            f"{what} must be a number >= 0, not {v!r}", L.y.value_span(m, key), "e.g. 0.0001"
        )
    return float(v)


def _names(L: Any, m: Any, key: str) -> tuple[str, ...]:
    y = L.y
    if not isinstance(m[key], list):
        raise y.error(f"{key} must be a list of session value names", y.value_span(m, key))
    return tuple(str(c[k]) for c, k in y.items(m, key))


def parse_tracing(L: Any, doc: Any) -> TracingConfig:
    """The ``tracing:`` section (``fabric.config`` calls this with its loader)."""
    y = L.y
    m = y.mapping(doc, "tracing", "tracing")
    y.check_keys(m, TRACING_KEYS, "tracing")
    kw: dict[str, Any] = {}
    if "enabled" in m:
        kw["enabled"] = y.boolean(m, "enabled", "enabled")
    for k, low in (("ring_spans", 1), ("max_sessions", 1)):
        if k in m:
            kw[k] = y.integer(m, k, k, low)
    if "otlp_endpoint" in m:
        url = str(L.subst(m, "otlp_endpoint"))
        if not url.startswith(("http://", "https://")):
            raise y.error(
                f"otlp_endpoint must be an http(s) URL, not {url!r}",
                y.value_span(m, "otlp_endpoint"),
                "e.g. http://127.0.0.1:4318/v1/traces (OTLP over HTTP, protobuf)",
            )
        kw["otlp_endpoint"] = url
    if "otlp_headers" in m:
        hm = y.mapping(m, "otlp_headers", "otlp_headers")
        kw["otlp_headers"] = {str(k): str(L.subst(hm, k)) for k in hm}
    if "service_name" in m:
        kw["service_name"] = y.string(m, "service_name", "service_name")
    if "session_values" in m:
        mode = str(m["session_values"])
        if mode not in SESSION_VALUE_MODES:
            raise y.error(
                f"session_values must be hash or redact, not {mode!r}",
                y.value_span(m, "session_values"),
                "hash records a keyed hash (equal values match, values stay unreadable); "
                "name values to keep in clear under record:",
            )
        kw["session_values"] = mode
    for k in ("redact", "record"):
        if k in m:
            kw[k] = _names(L, m, k)
    both = set(kw.get("redact", ())) & set(kw.get("record", ()))
    if both:
        raise y.error(
            f"session value(s) {', '.join(sorted(both))} are both in redact: and record:",
            y.value_span(m, "record"),
            "name each value in one of them",
        )
    if "prices" in m:
        kw["prices"] = _prices(L, m, doc)
    return TracingConfig(**kw)


def _prices(L: Any, m: Any, doc: Any) -> Prices:
    from dsl.errors import did_you_mean

    y = L.y
    known = [str(k) for sec in ("connections", "datasets") for k in (doc.get(sec) or {})]
    pm = y.mapping(m, "prices", "tracing prices")
    y.check_keys(pm, PRICE_KEYS, "tracing prices")
    kw: dict[str, Any] = {}
    for k in ("sandbox_cpu_second", "ckks_op"):
        if k in pm:
            kw[k] = _number(L, pm, k, k)
    if "connections" in pm:
        cm = y.mapping(pm, "connections", "tracing prices connections")
        conns: dict[str, dict[str, float]] = {}
        for name in cm:
            if str(name) not in known:
                raise y.error(
                    f"prices for {name!r}: no connection or dataset of that name",
                    y.key_span(cm, name),
                    did_you_mean(str(name), known, "connections and datasets"),
                )
            um = y.mapping(cm, name, f"prices of connection {name}")
            y.check_keys(um, UNIT_KEYS, f"prices of connection {name}")
            conns[str(name)] = {str(u): _number(L, um, u, f"{name}.{u}") for u in um}
        kw["connections"] = conns
    return Prices(**kw)
