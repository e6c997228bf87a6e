"""Materialized, indexed datasets as a source (``dataset://<name>``).

Every filter the dataset can evaluate -- through its B-tree / inverted indexes or with
pyarrow over the candidate rows -- is EXACT, so limits and projections are pushed too.
``search()`` is what the executor calls for a ``VectorSearch`` plan node: the dataset's
cost-based optimizer picks the retrieval strategy per call (``indexes.retrieval``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

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
from dsl.ast import Expr, and_all
from indexes import Dataset
from indexes.filters import supported
from indexes.retrieval import RetrievalExplain


class DatasetSource(Source):
    capabilities = frozenset({Capability.PROJECTION, Capability.LIMIT, Capability.IN_PROCESS})

    def __init__(self, uri: str, dataset: Dataset):
        super().__init__(uri)
        self.dataset = dataset

    def schema(self) -> pa.Schema:
        return self.dataset.schema

    def supports_filter(self, expr: Expr) -> Pushdown:
        return Pushdown.EXACT if supported(self.dataset, expr) else Pushdown.UNSUPPORTED

    def statistics(self) -> Statistics:
        st = self.dataset.statistics()
        cols = {}
        for c, s in st["indexes"].items():
            if s["kind"] == "btree":
                cols[c] = ColumnStats(null_count=s["nulls"], min=s["min"], max=s["max"])
        return Statistics(row_count=st["rows"], exact=True, columns=cols)

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        check_columns(self.uri, request.columns, self.schema().names)
        where = and_all(list(request.filters))
        t = self.dataset.scan(where, request.params, request.columns, request.limit)
        yield from t.to_batches(max_chunksize=request.batch_size)

    def search(
        self,
        column: str,
        query: Any,
        k: int,
        filters: Sequence[Expr] = (),
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        analyze: bool = False,
        *,
        strategy: str | None = None,
        guards: bool = True,
    ) -> tuple[pa.Table, RetrievalExplain]:
        """k nearest rows to ``query`` satisfying every filter; adds float32 ``_distance``.

        The explain object always carries the estimated cost of every strategy, the choice
        and the actual rows and time (``analyze`` is accepted for symmetry with explain)."""
        where = and_all(list(filters))
        return self.dataset.search(
            column, query, k, where, params or {}, columns=columns, strategy=strategy, guards=guards
        )

    def rank(
        self,
        *,
        vector: tuple[str, Any, int] | None = None,
        text: tuple[str, str, int] | None = None,
        fusion: tuple[int, int | None, str | None, float | None] | None = None,
        filters: Sequence[Expr] = (),
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
    ) -> tuple[pa.Table, Any]:
        """Ranked retrieval (indexes.ranking.rank): BM25 over ``text = (column, query,
        k)``, the vector arm ``(column, query, k)``, fused by ``fusion = (rrf_k, k,
        recency column, half-life seconds)``; adds ``_distance`` / ``_bm25`` / ``_score``."""
        from indexes.ranking import Fusion, rank

        return rank(
            self.dataset,
            vector=vector,
            text=text,
            fusion=Fusion(*fusion) if fusion is not None else None,
            where=and_all(list(filters)),
            params=params or {},
            columns=columns,
        )


class DatasetConnection(Connection):
    """Holds the fabric's datasets by name; ``source('news')`` opens ``dataset://news``."""

    kind = "dataset"

    def __init__(
        self,
        name: str = "dataset",
        options: Mapping[str, Any] | None = None,
        datasets: Mapping[str, Dataset] | None = None,
    ):
        super().__init__(name, options or {"kind": "dataset"})
        self.datasets: dict[str, Dataset] = dict(datasets or {})

    def add(self, dataset: Dataset) -> DatasetSource:
        self.datasets[dataset.name] = dataset
        return self.source(dataset.name)

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> DatasetSource:
        if obj not in self.datasets:
            raise UnknownObjectError(f"dataset://{obj}", sorted(self.datasets))
        return DatasetSource(f"dataset://{obj}", self.datasets[obj])

    def list_objects(self) -> list[str]:
        return sorted(self.datasets)
