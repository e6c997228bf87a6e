"""A session's timeline: its queries in order, each with plan, operator figures, waits
and cost, read from the ring buffer; ``render_html`` draws it as one self-contained page
(an SVG chart with one lane per source; waits for fresh data drawn as such)."""

from __future__ import annotations

import html
from typing import Any

from fabric.tracing.tracer import A_BINDING, A_SESSION, A_VERSION

#: freshness signals this long before the first query or after the last are left out
SIGNAL_WINDOW_NS = 60 * 10**9


def _ms(ns: int, t0: int) -> float:
    return round((ns - t0) / 1e6, 3)


def timeline(tracer: Any, session_id: str, *, may_see: Any = None) -> dict[str, Any]:
    """``may_see(binding) -> bool`` leaves out the queries of bindings a caller may not run."""
    spans = tracer.spans()
    queries = [
        s
        for s in spans
        if s.parent is None
        and s.attributes.get(A_SESSION) == session_id
        and s.name.startswith("query ")
        and (may_see is None or may_see(s.attributes.get(A_BINDING)))
    ]
    queries.sort(key=lambda s: s.start_time)
    traces = {q.context.trace_id for q in queries}
    children: dict[int, list[Any]] = {}
    for s in spans:
        if s.context.trace_id in traces and s.parent is not None:
            children.setdefault(s.parent.span_id, []).append(s)
    t0 = queries[0].start_time if queries else 0
    out = []
    for q in queries:
        a = q.attributes
        ops: list[dict[str, Any]] = []
        waits: list[dict[str, Any]] = []

        def walk(span: Any, depth: int, ops: list = ops, waits: list = waits) -> None:
            for c in sorted(children.get(span.context.span_id, []), key=lambda s: s.start_time):
                ca = dict(c.attributes)
                item = {
                    "name": c.name,
                    "start_ms": _ms(c.start_time, t0),
                    "duration_ms": round((c.end_time - c.start_time) / 1e6, 3),
                    "depth": depth,
                    "attributes": {
                        k: list(v) if isinstance(v, tuple) else v for k, v in ca.items()
                    },
                }
                if c.name.startswith("freshness wait "):
                    waits.append(item)
                else:
                    ops.append(item)
                walk(c, depth + 1)

        walk(q, 0)
        status = "error" if q.status.status_code.name == "ERROR" else "ok"
        out.append(
            {
                "binding": a.get(A_BINDING),
                "version": a.get(A_VERSION),
                "trace_id": f"{q.context.trace_id:032x}",
                "start_ms": _ms(q.start_time, t0),
                "duration_ms": round((q.end_time - q.start_time) / 1e6, 3),
                "status": status,
                "error": a.get("fabric.error"),
                "rows": a.get("fabric.rows"),
                "rows_fetched": a.get("fabric.rows_fetched"),
                "bytes_fetched": a.get("fabric.bytes_fetched"),
                "wait_seconds": a.get("fabric.wait.seconds"),
                "stale": list(a.get("fabric.stale", ())),
                "partial": a.get("fabric.partial"),
                "cost": {
                    "source_calls": a.get("fabric.cost.source_calls"),
                    "sandbox_seconds": a.get("fabric.cost.sandbox_seconds"),
                    "ckks_ops": a.get("fabric.cost.ckks_ops"),
                    "cache_hits": a.get("fabric.cost.cache_hits"),
                    "price": a.get("fabric.cost.price"),
                },
                "session_values": {
                    k[len("fabric.session.value.") :]: v
                    for k, v in a.items()
                    if k.startswith("fabric.session.value.")
                },
                "plan": a.get("fabric.plan"),
                "operators": ops,
                "waits": waits,
            }
        )
    signals: list[dict[str, Any]] = []
    lag: list[dict[str, Any]] = []
    if queries:
        lo = queries[0].start_time - SIGNAL_WINDOW_NS
        hi = max(q.end_time for q in queries) + SIGNAL_WINDOW_NS
        for s in spans:
            if s.name.startswith("signal ") and lo <= s.start_time <= hi:
                a = s.attributes
                signals.append(
                    {
                        "event": a.get("fabric.signal.event"),
                        "source": a.get("fabric.signal.source"),
                        "scope": a.get("fabric.signal.scope"),
                        "bindings": list(a.get("fabric.signal.bindings", ())),
                        "lag_messages": a.get("fabric.signal.lag_messages"),
                        "lag_seconds": a.get("fabric.signal.lag_seconds"),
                        "at_ms": _ms(s.start_time, t0),
                    }
                )
        signals.sort(key=lambda x: x["at_ms"])
        read = {
            u.split("://", 1)[1].split("/", 1)[0]
            for q in out
            for o in q["operators"]
            if str(u := o["attributes"].get("fabric.source.uri", "")).startswith("dataset://")
        }
        lag = [
            {"source": src, "at_ms": _ms(t, t0), "lag_messages": n}
            for t, src, n in list(tracer.lag_samples)
            if lo <= t <= hi and src in read
        ]
    return {
        "session": session_id,
        "started_at_unix_ns": t0 or None,
        "queries": out,
        "signals": signals,
        "lag": lag,
        "cost": tracer.costs.session(session_id),
        "ring": {
            "spans": len(tracer.ring),
            "capacity": tracer.ring.capacity,
            "dropped": tracer.ring.dropped,
            "runs_not_recorded": tracer.dropped_runs,
        },
    }


# ---------------------------------------------------------------- rendering

_LANE_H, _LEFT, _WIDTH, _TOP = 34, 230, 1000, 64
_COLORS = {
    "query": "#4c78a8",
    "error": "#d62728",
    "scan": "#59a14f",
    "wait": "#f28e2b",
    "op": "#9c9ede",
}


def _lanes(tl: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Lanes: the queries, one per source (uri), then the operators above the sources."""
    lanes: dict[str, list[dict[str, Any]]] = {"queries": []}
    for i, q in enumerate(tl["queries"]):
        lanes["queries"].append(
            {
                "kind": "error" if q["status"] == "error" else "query",
                "start": q["start_ms"],
                "dur": q["duration_ms"],
                "label": f"#{i + 1} {q['binding']}",
                "title": f"{q['binding']}: {q['rows']} rows in {q['duration_ms']:.1f} ms"
                + (f" ERROR {q['error']}" if q["error"] else "")
                + (f" stale={','.join(q['stale'])}" if q["stale"] else ""),
            }
        )
        for w in q["waits"]:
            a = w["attributes"]
            uri = a.get("fabric.source.uri") or _uri_of(q, a.get("fabric.source.alias"))
            lanes.setdefault(uri, []).append(
                {
                    "kind": "wait",
                    "start": w["start_ms"],
                    "dur": w["duration_ms"],
                    "label": "waiting for fresh data",
                    "title": f"waiting_for_fresh_data {w['duration_ms']:.1f} ms"
                    + "".join(
                        f" {k.split('.')[-1]}={a[k]}"
                        for k in ("fabric.freshness.lag_messages", "fabric.freshness.lag_seconds")
                        if k in a
                    ),
                }
            )
        for op in q["operators"]:
            a = op["attributes"]
            uri = a.get("fabric.source.uri")
            if uri:
                lanes.setdefault(uri, []).append(
                    {
                        "kind": "scan",
                        "start": op["start_ms"],
                        "dur": op["duration_ms"],
                        "label": op["name"],
                        "title": f"{op['name']}: {a.get('fabric.source.rows', 0)} rows, "
                        f"{a.get('fabric.source.bytes', 0)} B, freshness "
                        f"{a.get('fabric.freshness.status', '?')}",
                    }
                )
            elif op["depth"] == 0 or a.get("fabric.engine") == "duckdb":
                lanes.setdefault("engine (joins, aggregates, steps)", []).append(
                    {
                        "kind": "op",
                        "start": op["start_ms"],
                        "dur": op["duration_ms"],
                        "label": op["name"],
                        "title": f"{a.get('fabric.op')}: rows={a.get('fabric.rows')}",
                    }
                )
    return list(lanes.items())


def _uri_of(q: dict[str, Any], alias: str | None) -> str:
    for op in q["operators"]:
        if op["attributes"].get("fabric.source.alias") == alias and op["attributes"].get(
            "fabric.source.uri"
        ):
            return str(op["attributes"]["fabric.source.uri"])
    return f"source {alias}"


def _lag_points(tl: dict[str, Any]) -> list[tuple[float, float]]:
    """(ms, lag in messages) as the queries and signals saw it, in time order."""
    pts = [(s["at_ms"], float(s["lag_messages"])) for s in tl.get("lag", ())]
    for q in tl["queries"]:  # what each read saw (a wait's figures are after the wait)
        for o in q["operators"]:
            lag = o["attributes"].get("fabric.freshness.lag_messages")
            if isinstance(lag, int | float):
                pts.append((o["start_ms"] + o["duration_ms"], float(lag)))
    for sg in tl.get("signals", ()):
        if isinstance(sg.get("lag_messages"), int | float):
            pts.append((sg["at_ms"], float(sg["lag_messages"])))
    return sorted(pts)


def render_svg(tl: dict[str, Any]) -> str:
    lanes = _lanes(tl)
    lag = _lag_points(tl)
    signals = tl.get("signals", [])
    bars_all = [b for _, bars in lanes for b in bars]
    begin = min([0.0, *(b["start"] for b in bars_all), *(sg["at_ms"] for sg in signals)])
    last = max([1.0, *(b["start"] + b["dur"] for b in bars_all), *(sg["at_ms"] for sg in signals)])
    end = (last - begin) or 1.0
    scale = (_WIDTH - _LEFT - 20) / end
    lag_lanes = 3 if lag else 0  # the lag line is three lanes tall
    h = _TOP + _LANE_H * (len(lanes) + lag_lanes) + 30
    e = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{h}" '
        f'viewBox="0 0 {_WIDTH} {h}" font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{_WIDTH}" height="{h}" fill="#ffffff"/>',
        f'<text x="10" y="18" font-size="14" font-weight="bold">session {e(tl["session"])}: '
        f"{len(tl['queries'])} queries over {end:.1f} ms</text>",
    ]
    for tick in range(6):  # time axis
        x = _LEFT + (_WIDTH - _LEFT - 20) * tick / 5
        parts.append(
            f'<line x1="{x:.1f}" y1="{_TOP - 8}" x2="{x:.1f}" y2="{h - 24}" stroke="#e0e0e0"/>'
            f'<text x="{x:.1f}" y="{h - 8}" text-anchor="middle" fill="#555">'
            f"{begin + end * tick / 5:.0f} ms</text>"
        )
    if lag:  # the lag the queries and signals reported, in messages
        y0, hh = _TOP, _LANE_H * lag_lanes - 8
        top = max(v for _, v in lag) or 1.0

        def xy(t: float, v: float) -> str:
            return f"{_LEFT + (t - begin) * scale:.1f},{y0 + hh - v / top * (hh - 6):.1f}"

        parts.append(
            f'<text x="10" y="{y0 + 20}" fill="#222">lag (messages)</text>'
            f'<text x="10" y="{y0 + 36}" fill="#888">peak {top:,.0f}</text>'
            f'<polyline class="lag" points="{" ".join(xy(t, v) for t, v in lag)}" '
            'fill="none" stroke="#8c564b" stroke-width="3"/>'
        )
        for t, v in lag:
            cx, cy = xy(t, v).split(",")
            parts.append(
                f'<circle cx="{cx}" cy="{cy}" r="4" fill="#8c564b">'
                f"<title>{v:,.0f} messages behind at {t:.0f} ms</title></circle>"
            )
    for i, sg in enumerate(signals):  # data_stale / data_fresh across every lane
        x = _LEFT + (sg["at_ms"] - begin) * scale
        stale = sg["event"] == "data_stale"
        color = "#d62728" if stale else "#2ca02c"
        what = sg["source"] if sg.get("scope", "source") == "source" else ",".join(sg["bindings"])
        label = f"{sg['event']} {what}" + ("" if stale else " (release)")
        ty = _TOP - 10 - 13 * (i % 2)  # neighbours alternate rows
        anchor, tx = ("end", x - 4) if x > _WIDTH - 220 else ("start", x + 4)
        parts.append(
            f'<g class="signal {e(str(sg["event"]))}"><title>{e(label)}: lag '
            f"{sg.get('lag_messages')} messages, bindings {e(', '.join(sg['bindings']))}"
            f'</title><line x1="{x:.1f}" y1="{_TOP - 6}" x2="{x:.1f}" y2="{h - 24}" '
            f'stroke="{color}" stroke-width="3" stroke-dasharray="6 3"/>'
            f'<text x="{tx:.1f}" y="{ty}" fill="{color}" font-size="11" '
            f'text-anchor="{anchor}">{e(label)}</text></g>'
        )
    for i, (name, bars) in enumerate(lanes):
        y = _TOP + (i + lag_lanes) * _LANE_H
        parts.append(
            f'<text x="10" y="{y + 20}" fill="#222">{e(name[:34])}</text>'
            f'<line x1="{_LEFT}" y1="{y + _LANE_H - 2}" x2="{_WIDTH - 20}" '
            f'y2="{y + _LANE_H - 2}" stroke="#f0f0f0"/>'
        )
        for b in bars:
            x = _LEFT + (b["start"] - begin) * scale
            w = max(2.0, b["dur"] * scale)
            color = _COLORS[b["kind"]]
            pattern = ' stroke="#a0522d" stroke-dasharray="4 2"' if b["kind"] == "wait" else ""
            parts.append(
                f'<g class="bar {b["kind"]}"><title>{e(b["title"])}</title>'
                f'<rect x="{x:.1f}" y="{y + 6}" width="{w:.1f}" height="{_LANE_H - 14}" '
                f'rx="3" fill="{color}"{pattern}/>'
                + (
                    f'<text x="{x + 3:.1f}" y="{y + 21}" fill="#fff" font-size="11">'
                    f"{e(b['label'][: int(w / 7)])}</text>"
                    if w > 30
                    else ""
                )
                + "</g>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _took(o: dict[str, Any]) -> str:
    if o["attributes"].get("fabric.in_duckdb_query"):
        return "(in the DuckDB query)"
    return f"{o['duration_ms']:.2f}"


def render_html(tl: dict[str, Any]) -> str:
    """One self-contained page: the chart, then each query's figures and plan."""
    e = html.escape
    rows = []
    for i, q in enumerate(tl["queries"]):
        ops = "".join(
            f"<tr><td style='padding-left:{8 + 14 * o['depth']}px'>{e(o['name'])}</td>"
            f"<td>{e(str(o['attributes'].get('fabric.rows', '')))}</td>"
            f"<td>{_took(o)}</td>"
            f"<td>{e(str(o['attributes'].get('fabric.source.bytes', '')))}</td>"
            f"<td>{e(str(o['attributes'].get('fabric.freshness.status', '')))}</td></tr>"
            for o in q["operators"]
        )
        waits = "".join(
            f"<li>waiting for fresh data on {e(str(w['attributes'].get('fabric.source.alias')))}: "
            f"{w['duration_ms']:.1f} ms</li>"
            for w in q["waits"]
        )
        rows.append(
            f"<section><h3>#{i + 1} {e(str(q['binding']))} <small>{q['status']}, "
            f"{q['duration_ms']:.1f} ms, {q['rows']} rows, {q['rows_fetched']} rows / "
            f"{q['bytes_fetched']} B fetched, cost {q['cost']['price']:.6g}</small></h3>"
            + (f"<p class='err'>{e(str(q['error']))}</p>" if q["error"] else "")
            + (f"<ul>{waits}</ul>" if waits else "")
            + "<table><tr><th>operator</th><th>rows</th><th>ms</th><th>bytes</th>"
            f"<th>freshness</th></tr>{ops}</table>"
            f"<details><summary>plan</summary><pre>{e(str(q['plan']))}</pre></details></section>"
        )
    total = tl["cost"]["total"]
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>fabric timeline {e(tl['session'])}</title><style>"
        "body{font-family:sans-serif;margin:16px;background:#fff;color:#222}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px}"
        ".err{color:#d62728}pre{font-size:11px}</style></head><body>"
        f"<h2>Session {e(tl['session'])}</h2>"
        f"<p>{total['queries']} queries, {total['errors']} failed, waited "
        f"{total['wait_seconds']:.3f} s for fresh data, cost {total['price']:.6g}</p>"
        + render_svg(tl)
        + "<p><span style='color:#f28e2b'>&#9632;</span> waiting for fresh data "
        "<span style='color:#59a14f'>&#9632;</span> source scan "
        "<span style='color:#4c78a8'>&#9632;</span> query "
        "<span style='color:#d62728'>&#9632;</span> failed query / data_stale "
        "<span style='color:#2ca02c'>&#9632;</span> data_fresh (release) "
        "<span style='color:#8c564b'>&#9632;</span> lag</p>" + "".join(rows) + "</body></html>"
    )


def render_text(tl: dict[str, Any]) -> str:
    """``fabric timeline SESSION``: the queries in order with figures and waits."""
    lines = [f"session {tl['session']}: {len(tl['queries'])} queries"]
    for i, q in enumerate(tl["queries"]):
        lines.append(
            f"#{i + 1} +{q['start_ms']:.1f} ms {q['binding']} [{q['status']}] "
            f"{q['duration_ms']:.1f} ms, {q['rows']} rows, fetched {q['rows_fetched']} rows / "
            f"{q['bytes_fetched']} B, waited {q['wait_seconds'] or 0:.3f} s, "
            f"cost {q['cost']['price'] or 0:.6g}"
        )
        if q["error"]:
            lines.append(f"    error: {q['error']}")
        for w in q["waits"]:
            lines.append(
                f"    wait {w['attributes'].get('fabric.source.alias')}: waiting for fresh data "
                f"{w['duration_ms']:.1f} ms"
            )
        for o in q["operators"]:
            a = o["attributes"]
            extra = ""
            if "fabric.source.uri" in a:
                extra = (
                    f" {a['fabric.source.uri']} fetched={a.get('fabric.source.rows')} rows/"
                    f"{a.get('fabric.source.bytes')} B freshness={a.get('fabric.freshness.status')}"
                )
            rows = a.get("fabric.rows")
            took = (
                "in the DuckDB query above"
                if a.get("fabric.in_duckdb_query")
                else f"{o['duration_ms']:.2f} ms"
            )
            lines.append(
                f"    {'  ' * o['depth']}{o['name']}: rows={'-' if rows is None else rows} "
                f"{took}{extra}"
            )
    for sg in tl.get("signals", ()):
        lines.append(
            f"signal +{sg['at_ms']:.1f} ms {sg['event']} {sg['source']} "
            f"lag={sg.get('lag_messages')} bindings={','.join(sg['bindings'])}"
        )
    t = tl["cost"]["total"]
    lines.append(
        f"total: {t['queries']} queries, {t['errors']} failed, waited {t['wait_seconds']:.3f} s, "
        f"cost {t['price']:.6g}"
    )
    for conn, s in sorted(t["sources"].items()):
        lines.append(
            f"  {conn}: {s['calls']} calls, {s['rows']} rows, {s['bytes']} B, cost {s['price']:.6g}"
        )
    return "\n".join(lines)
