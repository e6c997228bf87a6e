"""In-process Arrow tables as a source (``memory://<connection>/<table>``).

Used by the planner and executor tests (no server needed), by the demo for small
reference data, and by ``kind: memory`` connections of fabric.yaml (filled with
``fab.catalog.connection(name).add(table_name, arrow_table)``). Every filter that pyarrow compute can
evaluate is EXACT; limit, order and projection are pushed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from connectors.arrow_expr import filter_table, sort_indices, translatable
from connectors.base import (
    Capability,
    ColumnStats,
    Connection,
    Pushdown,
    ScanRequest,
    Source,
    Statistics,
    UnknownObjectError,
    check_columns,
)
from dsl.ast import Expr


class MemorySource(Source):
    capabilities = frozenset(
        {Capability.PROJECTION, Capability.LIMIT, Capability.IN_PROCESS, Capability.ORDER_BY}
    )

    def __init__(self, uri: str, table: pa.Table):
        super().__init__(uri)
        self.table = table
        self.scans = 0  # how many times scan() ran (tests check dynamic filters and caching)

    def schema(self) -> pa.Schema:
        return self.table.schema

    def supports_filter(self, expr: Expr) -> Pushdown:
        return Pushdown.EXACT if translatable(expr) else Pushdown.UNSUPPORTED

    def statistics(self) -> Statistics:
        cols = {}
        for name in self.table.column_names:
            col = self.table.column(name)
            if (
                pa.types.is_integer(col.type)
                or pa.types.is_floating(col.type)
                or pa.types.is_timestamp(col.type)
            ):
                mm = pc.min_max(col)
                cols[name] = ColumnStats(
                    null_count=col.null_count, min=mm["min"].as_py(), max=mm["max"].as_py()
                )
        return Statistics(
            row_count=self.table.num_rows, exact=True, total_bytes=self.table.nbytes, columns=cols
        )

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        self.scans += 1
        t = self.table
        check_columns(self.uri, request.columns, t.column_names)
        for f in request.filters:
            t = filter_table(t, f, request.params)
        if request.order_by:
            keys = []
            for k in request.order_by:
                name = getattr(k.expr, "name", None)
                if name is None:
                    raise ValueError(f"memory source can only order by columns, got {k}")
                order = "descending" if k.descending else "ascending"
                keys.append((name, order, "at_start" if k.nulls_first else "at_end"))
            t = t.take(sort_indices(t, keys))  # nulls where asked, NaN as DuckDB orders it
        if request.limit is not None:
            t = t.slice(0, request.limit)
        if request.columns is not None:
            t = t.select(list(request.columns))
        yield from t.to_batches(max_chunksize=request.batch_size)


class MemoryConnection(Connection):
    """``{kind: memory}``; tables are registered from Python (``add``)."""

    kind = "memory"

    def __init__(self, name: str, options: Mapping[str, Any] | None = None):
        super().__init__(name, options or {"kind": "memory"})
        self.tables: dict[str, MemorySource] = {}

    def add(self, obj: str, table: pa.Table) -> MemorySource:
        src = MemorySource(f"memory://{self.name}/{obj}", table)
        self.tables[obj] = src
        return src

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> Source:
        try:
            return self.tables[obj]
        except KeyError:
            raise UnknownObjectError(f"memory://{self.name}/{obj}", sorted(self.tables)) from None

    def list_objects(self) -> list[str]:
        return sorted(self.tables)
