"""explain(analyze=True) of a run: rows, times, what each source fetched and was sent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from fabric.execute.state import RunState
from fabric.plan.nodes import (
    Plan,
    Scan,
)


class Explain(RunState):
    """``explain(analyze=True)``: the physical plan annotated with what each node did."""

    def _explain(self, table: pa.Table, total_ms: float) -> str:
        scan_alias = {id(u.leaf): alias for alias, u in self.units.items()}

        def annotate(node: Plan) -> str | None:
            s = self.node_stats.get(id(node))
            parts = []
            if s is None:
                return None
            if s.get("rows") is not None:
                parts.append(f"rows={s['rows']}")
            est = getattr(node, "estimated_rows", None)
            if est is not None:
                parts.append(f"est={est}")
            if "time_ms" in s:
                parts.append(f"time={s['time_ms']:.2f}ms")
            if s.get("engine") and s["engine"] != "arrow":
                parts.append(s["engine"])
            alias = scan_alias.get(id(node))
            if alias is not None and alias in self.sources:
                src = self.sources[alias]
                parts.append(f"fetched={src.get('rows', 0)} rows/{_kib(src.get('bytes', 0))}")
                if isinstance(node, Scan):
                    parts.append(
                        f"pushed exact=[{', '.join(src['exact'])}] inexact=[{', '.join(src['inexact'])}]"
                    )
                if src.get("residual"):
                    parts.append(f"residual=[{', '.join(src['residual'])}]")
                for d in src.get("dynamic", ()):
                    how = {
                        "in": "pushed",
                        "range": f"pushed as range [{d.get('range', ['?', '?'])[0]}, {d.get('range', ['?', '?'])[1]}]",
                        "bound": " ".join(["pushed as", *d.get("bound", ())]),
                    }.get(d.get("form") or "", "NOT pushed (over max)")
                    parts.append(f"dynamic {d['filter']}: {d['keys']} keys {how}")
                if src.get("skipped"):
                    parts.append("scan skipped (no keys)")
                if alias in self.ran_inline:
                    parts.append("ran inline (ready alone)")
                parts.extend(_measured(src.get("source") or {}))
                f = self.freshness.get(alias)
                if f is not None:
                    parts.append(f"freshness={f['status']}")
            return " ".join(parts)

        lines = [f"Result: {table.num_rows} rows in {total_ms:.2f} ms (binding {self.binding})"]
        lines.append(self.pp.explain(annotate))
        for q in self.queries:
            lines.append(f"DuckDB: {q}")
        for alias, src in self.sources.items():  # what each scan sent to its server
            statement = (src.get("source") or {}).get("statement")
            if statement is not None:  # on one line (SQLAlchemy breaks before FROM, WHERE)
                lines.append(f"Sent {alias} <- {src['uri']}: {' '.join(statement.split())}")
        for alias, info in self.infos.items():
            kind = "Ranking" if type(info).__name__ == "RankExplain" else "VectorSearch"
            lines.append(f"{kind} {alias}:")
            lines.extend("  " + ln for ln in str(info).splitlines())
        if self.freshness:
            lines.append("Freshness:")
            for alias, f in self.freshness.items():
                extra = "".join(
                    f" {k}={f[k]}"
                    for k in ("lag_messages", "lag_seconds", "watermark")
                    if f.get(k) is not None
                )
                lines.append(f"  {alias} <- {f['uri']}: {f['status']}{extra}")
        return "\n".join(lines)


def _measured(m: Mapping[str, Any]) -> list[str]:
    """A scan's ScanMetrics (``as_dict()``) on its line of explain(analyze=True)."""
    parts = []
    if "requests" in m:  # the connection's budget: REST pages, rate-limited scans
        parts.append(
            f"requests={m['requests']} retries={m.get('retries', 0)}"
            f" throttled={m.get('throttle_wait_ms', 0):.1f}ms"
            f" backoff={m.get('backoff_wait_ms', 0):.1f}ms"
        )
    if "records" in m:
        parts.append(f"records={m['records']} bad_records={m.get('bad_records', 0)}")
    if "files_read" in m:
        parts.append(f"files={m['files_read']}/{m.get('files_total', '?')}")
    if "row_groups_read" in m:
        parts.append(f"row_groups={m['row_groups_read']}/{m.get('row_groups_total', '?')}")
    if "cache" in m:
        parts.append(f"cache={m['cache']}")
    return parts


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}KiB" if n >= 1024 else f"{n}B"
