"""Index declarations and the errors a dataset raises."""

from __future__ import annotations

from dataclasses import dataclass

from dsl.errors import FabricError

KINDS = ("hnsw", "btree", "inverted")
METRICS = ("cosine", "l2", "ip")


class DatasetError(FabricError, ValueError):
    """A dataset was used wrongly (bad schema, unknown column, wrong vector size...)."""


@dataclass(frozen=True)
class IndexSpec:
    """One index on one column: ``IndexSpec('hnsw', metric='cosine')``, ``IndexSpec('btree')``.

    ``M``, ``ef_construction`` and ``ef`` only matter for ``hnsw``; ``metric`` defaults to
    cosine there. ``ef`` is the search breadth used when the optimizer does not raise it.
    """

    kind: str
    metric: str | None = None
    M: int = 16
    ef_construction: int = 200
    ef: int = 64
    partition: str | None = None  # hnsw only: a btree column with one graph per value

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DatasetError(f"unknown index kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == "hnsw":
            if self.metric is None:
                object.__setattr__(self, "metric", "cosine")
            if self.metric not in METRICS:
                raise DatasetError(
                    f"unknown hnsw metric {self.metric!r}; use one of {', '.join(METRICS)}"
                )
            if self.M < 2 or self.ef_construction < 1 or self.ef < 1:
                raise DatasetError(
                    f"hnsw parameters must be positive (M={self.M}, ef_construction={self.ef_construction}, ef={self.ef})"
                )
        elif self.partition is not None:
            raise DatasetError(f"partition= only applies to hnsw indexes, not {self.kind}")
        if self.kind != "hnsw" and self.metric is not None:
            raise DatasetError(
                f"metric={self.metric!r} only applies to hnsw indexes, not {self.kind}"
            )

    @classmethod
    def parse(cls, value: IndexSpec | str | dict) -> IndexSpec:
        """Accept ``'hnsw'``, ``{'kind': 'hnsw', 'metric': 'l2'}`` or an IndexSpec."""
        if isinstance(value, IndexSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            unknown = set(value) - {"kind", "metric", "M", "ef_construction", "ef", "partition"}
            if unknown:
                raise DatasetError(
                    f"unknown index option(s) {sorted(unknown)}; allowed: kind, metric, M, ef_construction, ef, partition"
                )
            return cls(**value)
        raise DatasetError(f"an index is declared as a kind name or a mapping, got {value!r}")

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "metric": self.metric,
            "M": self.M,
            "ef_construction": self.ef_construction,
            "ef": self.ef,
            **({"partition": self.partition} if self.partition else {}),
        }
