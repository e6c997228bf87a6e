"""The answer to one query: an Arrow table plus what it cost and how fresh it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class Result:
    """``table``: the rows. ``freshness``: per source alias, ``{uri, status, lag_messages,
    lag_seconds, watermark}`` (status: fresh | stale | unknown). ``stats``: ``{"sources":
    {alias: {uri, rows, bytes, time_ms, ...}}, "operators": [{op, rows, time_ms}],
    "total_ms"}``. ``explain``: annotated plan text when run with ``analyze=True``.
    ``waited``: seconds spent waiting for fresh data. ``partial``: a source failed and the
    binding allowed a partial answer."""

    table: pa.Table
    freshness: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)
    explain: str | None = None
    waited: float = 0.0
    partial: bool = False
    binding: str | None = None

    @property
    def stale(self) -> list[str]:
        """Aliases of the sources that were stale when read."""
        return [a for a, f in self.freshness.items() if f.get("status") == "stale"]

    @property
    def unverified(self) -> list[str]:
        """Aliases of retrievals that could not show their rows are the filtered top-k
        (``stats['sources'][alias]['guarantee']`` starts with 'unverified')."""
        return [
            a
            for a, s in self.stats.get("sources", {}).items()
            if str(s.get("guarantee") or "").startswith("unverified")
        ]

    @property
    def rows_fetched(self) -> int:
        return sum(int(s.get("rows", 0)) for s in self.stats.get("sources", {}).values())

    def to_pylist(self) -> list[dict[str, Any]]:
        return self.table.to_pylist()

    def __len__(self) -> int:
        return self.table.num_rows

    def __repr__(self) -> str:
        flags = []
        if self.stale:
            flags.append(f"stale={','.join(self.stale)}")
        if self.partial:
            flags.append("partial")
        if self.unverified:
            flags.append(f"unverified={','.join(self.unverified)}")
        if self.waited:
            flags.append(f"waited={self.waited:.2f}s")
        total = self.stats.get("total_ms")
        cost = f" in {total:.1f} ms" if isinstance(total, int | float) else ""
        name = f"{self.binding}: " if self.binding else ""
        return (
            f"<Result {name}{self.table.num_rows} rows x {self.table.num_columns} cols "
            f"[{', '.join(self.table.column_names)}]{cost}, {self.rows_fetched} rows fetched"
            f"{' ' + ' '.join(flags) if flags else ''}>"
        )
