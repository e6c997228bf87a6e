"""One finished run -> OpenTelemetry spans (on the tracing worker's thread).

The spans are built as finished ``ReadableSpan``s (the figures are known once the run is
over) and handed to the processors directly: a third of the cost of the SDK's live span
machinery, with the same objects reaching the ring buffer and the OTLP exporter.

Span tree: ``query <binding>`` (the whole run) with one child per plan operator that
recorded figures, nested as in the plan; a source's leaf operator (``Scan m``,
``VectorSearch d``) carries what the source did, and a ``freshness wait <alias>`` child
covers the time spent waiting for fresh data. Attribute names are in docs/tracing.md.
"""

from __future__ import annotations

import random
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from fabric.tracing.cost import QueryCost, connection_of
from fabric.tracing.tracer import A_BINDING, A_SESSION, A_VALUE, A_VERSION, plan_text

_LEAVES = ("Scan", "VectorSearch")


def _ns(wall0: int, perf0: float, p: float) -> int:
    return wall0 + int((p - perf0) * 1e9)


def _strs(v: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in v)


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)


def _context(trace_id: int) -> SpanContext:
    return SpanContext(trace_id, random.getrandbits(64) or 1, False, _SAMPLED)


def emit(
    tracer: Any,
    run: Any,
    res: Any,
    err: BaseException | None,
    sid: str | None,
    version: str | None,
    wall0: int,
    perf0: float,
    perf1: float,
) -> None:
    with run._lock:  # units cancelled by an error may still be writing
        node_stats = dict(run.node_stats)
        sources = {k: dict(v) for k, v in run.sources.items()}
        freshness = {k: dict(v) for k, v in run.freshness.items()}
        waits = dict(getattr(run, "waits", {}))
    pp = run.pp
    binding = run.binding
    cfg = tracer.config
    red = tracer.redactor
    ns = lambda p: _ns(wall0, perf0, p)  # noqa: E731
    end_ns = ns(perf1)

    attrs: dict[str, Any] = {A_BINDING: binding, "fabric.analyze": bool(run.analyze)}
    if version:
        attrs[A_VERSION] = version
    if sid is not None:
        attrs[A_SESSION] = str(sid)
    session_params = {k: v for k, v in run.params.items() if not k.startswith(("stage:", "__"))}
    for k, v in session_params.items():
        attrs[A_VALUE + k] = red.value(k, v)
    attrs["fabric.plan"] = plan_text(pp)

    cost = QueryCost()
    prices = cfg.prices
    for alias, s in sources.items():
        calls = 0 if s.get("skipped") else 1
        cost.add_source(
            prices,
            connection_of(s.get("uri", alias)),
            int(s.get("rows", 0)),
            int(s.get("bytes", 0)),
            calls,
        )
        cost.cache_hits += int(bool(s.get("cache_hit") or s.get("cached")))
    cost.wait_seconds = float(run.waited)

    out: list[ReadableSpan] = []
    resource, scope = tracer.resource, tracer.scope
    trace_id = random.getrandbits(128) or 1
    ctx = _context(trace_id)

    def span(
        name: str, c: SpanContext, parent: Any, t0: int, t1: int, a: dict, st: Status = _OK
    ) -> None:
        out.append(
            ReadableSpan(
                name,
                context=c,
                parent=parent,
                resource=resource,
                attributes=a,
                status=st,
                start_time=t0,
                end_time=t1,
                instrumentation_scope=scope,
            )
        )

    visited: set[int] = set()
    scan_alias = {id(u.leaf): a for a, u in pp.units.items()}

    def open_span(key: int, node: Any, parent_ctx: Any, lo: int, hi: int) -> tuple:
        """The span of one recorded operator (None when it recorded nothing), the context
        and times its children nest in."""
        s = node_stats.get(key)
        if s is None or key in visited:
            return None, parent_ctx, lo, hi
        visited.add(key)
        kind = type(node).__name__ if node is not None else str(s["op"]).split(":", 1)[0]
        alias = scan_alias.get(key)
        clo, chi = lo, hi
        if "end" in s:
            chi = ns(s["end"])
            clo = chi - int(s.get("time_ms", 0.0) * 1e6)
        a: dict[str, Any] = {"fabric.op": s["op"], "fabric.engine": str(s.get("engine"))}
        if s.get("rows") is not None:
            a["fabric.rows"] = int(s["rows"])
        if "time_ms" in s:
            a["fabric.time_ms"] = float(s["time_ms"])
        else:  # compiled into its DuckDB query: timed with the query, not on its own
            a["fabric.in_duckdb_query"] = True
        if kind == "UserFunction":
            secs = s.get("time_ms", 0.0) / 1000
            a["fabric.sandbox.seconds"] = secs
            cost.sandbox_seconds += secs
        elif kind == "EncryptedScore" and node is not None:
            args = node.expr.args
            shared = len(args) > 1 and type(args[1]).__name__ == "Literal"
            n = 1 if shared else int(s.get("rows") or 0)
            a["fabric.ckks.ops"] = n
            cost.ckks_ops += n
        if alias is not None:
            a.update(_source_attrs(alias, sources.get(alias), freshness.get(alias)))
            if "fabric.source.error" in a:
                a["fabric.source.error"] = red.text(a["fabric.source.error"], session_params)
        name = f"{kind} {alias}" if alias else kind
        mine = _context(trace_id)
        if alias is not None and alias in waits:
            w0, w1 = waits[alias]
            fa = freshness.get(alias) or {}
            wa: dict[str, Any] = {
                "fabric.source.alias": alias,
                "fabric.wait.seconds": w1 - w0,
                "fabric.wait.reason": "waiting_for_fresh_data",
            }
            for k in ("lag_messages", "lag_seconds", "status"):
                if fa.get(k) is not None:
                    wa[f"fabric.freshness.{k}"] = fa[k]
            span(f"freshness wait {alias}", _context(trace_id), parent_ctx, ns(w0), ns(w1), wa)
        return (name, mine, parent_ctx, clo, a), mine, clo, max(chi, clo)

    def close(rec: Any, hi: int) -> None:
        if rec is not None:
            name, mine, parent, lo, a = rec
            span(name, mine, parent, lo, hi, a)

    def walk_logical(node: Any, c: Any, lo: int, hi: int, inputs: dict[int, Any]) -> None:
        inp = inputs.get(id(node))
        if inp is not None:
            walk(inp, c, lo, hi)
            return
        rec, c, lo, hi = open_span(id(node), node, c, lo, hi)
        for child in node.children():
            walk_logical(child, c, lo, hi, inputs)
        close(rec, hi)

    def walk(p: Any, c: Any, lo: int, hi: int) -> None:
        """The physical plan, top down: the spans nest as the operators ran."""
        kind = type(p).__name__
        if kind == "SourceUnit":
            opened = []
            for n in (*p.chain, p.leaf):  # chain top first, then the scan / search
                rec, c, lo, hi = open_span(id(n), n, c, lo, hi)
                opened.append((rec, hi))
            for rec, h in reversed(opened):
                close(rec, h)
            return
        if kind == "DuckDBRegion":
            walk_logical(p.logical, c, lo, hi, {id(i.logical): i for i in p.inputs})
            return
        rec, c, lo, hi = open_span(id(p.logical), p.logical, c, lo, hi)
        for child in (*getattr(p, "stages", ()), getattr(p, "input", None)):
            if child is not None:
                walk(child, c, lo, hi)
        close(rec, hi)

    walk(pp.root, ctx, wall0, end_ns)
    for key in list(node_stats):  # recorded but not reached from the root (none known)
        rec, _, _, hi = open_span(key, None, ctx, wall0, end_ns)
        close(rec, hi)
    # waits of a source whose unit never recorded (the wait timed out: the query failed)
    for alias, (w0, w1) in waits.items():
        leaf = pp.units[alias].leaf if alias in pp.units else None
        if leaf is not None and id(leaf) in visited:
            continue
        wa = {
            "fabric.source.alias": alias,
            "fabric.wait.seconds": w1 - w0,
            "fabric.wait.reason": "waiting_for_fresh_data",
            **({"fabric.source.uri": leaf.uri} if leaf is not None else {}),
        }
        span(f"freshness wait {alias}", _context(trace_id), ctx, ns(w0), ns(w1), wa)

    cost.finish(prices)
    q: dict[str, Any] = {
        "fabric.total_ms": (perf1 - perf0) * 1000,
        "fabric.wait.seconds": float(run.waited),
        "fabric.rows_fetched": int(sum(int(s.get("rows", 0)) for s in sources.values())),
        "fabric.bytes_fetched": int(sum(int(s.get("bytes", 0)) for s in sources.values())),
        "fabric.cost.source_calls": int(sum(c["calls"] for c in cost.sources.values())),
        "fabric.cost.sandbox_seconds": cost.sandbox_seconds,
        "fabric.cost.ckks_ops": cost.ckks_ops,
        "fabric.cost.cache_hits": cost.cache_hits,
        "fabric.cost.price": cost.price,
        "fabric.partial": bool(run.partial),
    }
    stale = tuple(a for a, f in freshness.items() if f.get("status") == "stale")
    if stale:
        q["fabric.stale"] = stale
    if res is not None:
        q["fabric.rows"] = int(res.table.num_rows)
    attrs.update(q)
    status = _OK
    if err is not None:
        msg = red.text(f"{type(err).__name__}: {err}", session_params)
        attrs["fabric.error"] = msg
        status = Status(StatusCode.ERROR, msg)
    span(f"query {binding}", ctx, None, wall0, end_ns, attrs, status)
    tracer.costs.add(sid, binding, cost, failed=err is not None)
    tracer.deliver(out)


_SCAN_COUNTS = (
    "requests",
    "retries",
    "records",
    "bad_records",
    "files_total",
    "files_read",
    "row_groups_total",
    "row_groups_read",
)


def _source_attrs(alias: str, s: dict[str, Any] | None, f: dict[str, Any] | None) -> dict[str, Any]:
    a: dict[str, Any] = {"fabric.source.alias": alias}
    if s:
        uri = str(s.get("uri", ""))
        a["fabric.source.uri"] = uri
        a["fabric.source.connection"] = connection_of(uri)
        a["fabric.source.rows"] = int(s.get("rows", 0))
        a["fabric.source.bytes"] = int(s.get("bytes", 0))
        a["fabric.source.batches"] = int(s.get("batches", 0))
        a["fabric.source.time_ms"] = float(s.get("time_ms", 0.0))
        if s.get("estimated_rows") is not None:
            a["fabric.source.estimated_rows"] = int(s["estimated_rows"])
        m = s.get("source") or {}  # the scan's own metrics (connectors.base.ScanMetrics)
        for k in _SCAN_COUNTS:  # counts only: a statement may hold session values
            if m.get(k) is not None:
                a[f"fabric.source.{k}"] = int(m[k])
        if m.get("cache") is not None:
            a["fabric.source.cache"] = str(m["cache"])
        for k in ("exact", "inexact", "residual", "filters"):
            if s.get(k):
                a[f"fabric.pushdown.{k}"] = _strs(s[k])
        if s.get("dynamic"):
            a["fabric.pushdown.dynamic"] = [
                f"{d['filter']}: {d['keys']} keys "
                + {"in": "pushed", "range": "pushed as range"}.get(
                    d.get("form") or "", "not pushed"
                )
                for d in s["dynamic"]
            ]
        if s.get("strategy"):
            a["fabric.index.path"] = str(s["strategy"])
        if s.get("guarantee"):
            a["fabric.index.guarantee"] = str(s["guarantee"])
        if s.get("skipped"):
            a["fabric.source.skipped"] = str(s["skipped"])
        if s.get("error"):
            a["fabric.source.error"] = str(s["error"])
    if f:
        a["fabric.freshness.status"] = str(f.get("status"))
        for k in ("lag_messages", "lag_seconds", "watermark"):
            if f.get(k) is not None:
                v = f[k]
                a[f"fabric.freshness.{k}"] = v if isinstance(v, int | float) else str(v)
    return a


def emit_signal(tracer: Any, event: dict[str, Any], at_ns: int) -> None:
    """A freshness signal as a span of its own (no duration, no session)."""
    a: dict[str, Any] = {
        "fabric.signal.event": str(event.get("event")),
        "fabric.signal.source": str(event.get("source")),
        "fabric.signal.scope": str(event.get("scope", "source")),
        "fabric.signal.bindings": tuple(str(b) for b in event.get("bindings") or ()),
    }
    for k in ("lag_messages", "lag_seconds"):
        if isinstance(event.get(k), int | float):
            a[f"fabric.signal.{k}"] = event[k]
    name = f"signal {a['fabric.signal.event']} {a['fabric.signal.source']}"
    ctx = _context(random.getrandbits(128) or 1)
    sp = ReadableSpan(
        name,
        context=ctx,
        parent=None,
        resource=tracer.resource,
        attributes=a,
        start_time=at_ns,
        end_time=at_ns,
        instrumentation_scope=tracer.scope,
    )
    tracer.deliver([sp])


def emit_cache_hit(
    tracer: Any,
    binding: str,
    version: str,
    params: dict[str, Any],
    sid: str | None,
    res: Any,
    wall0: int,
    perf0: float,
    perf1: float,
) -> None:
    """A query answered from its binding's semantic cache: one span, one cache hit."""
    info = res.stats.get("cache") or {}
    a: dict[str, Any] = {
        A_BINDING: binding,
        A_VERSION: version,
        "fabric.analyze": False,
        "fabric.cache.status": "hit",
        "fabric.rows": int(res.table.num_rows),
        "fabric.rows_fetched": 0,
        "fabric.bytes_fetched": 0,
        "fabric.total_ms": (perf1 - perf0) * 1000,
        "fabric.wait.seconds": 0.0,
        "fabric.partial": bool(res.partial),
        "fabric.cost.source_calls": 0,
        "fabric.cost.sandbox_seconds": 0.0,
        "fabric.cost.ckks_ops": 0,
        "fabric.cost.cache_hits": 1,
        "fabric.cost.price": 0.0,
    }
    for k in ("similarity", "age_s"):
        if isinstance(info.get(k), int | float):
            a[f"fabric.cache.{k}"] = info[k]
    if sid is not None:
        a[A_SESSION] = str(sid)
    for k, v in params.items():
        if not k.startswith(("stage:", "__")):
            a[A_VALUE + k] = tracer.redactor.value(k, v)
    ctx = _context(random.getrandbits(128) or 1)
    end = wall0 + int((perf1 - perf0) * 1e9)
    sp = ReadableSpan(
        f"query {binding}",
        context=ctx,
        parent=None,
        resource=tracer.resource,
        attributes=a,
        start_time=wall0,
        end_time=end,
        instrumentation_scope=tracer.scope,
    )
    cost = QueryCost(cache_hits=1)
    tracer.costs.add(sid, binding, cost, failed=False)
    tracer.deliver([sp])
