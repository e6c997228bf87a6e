"""Materialized, indexed datasets and the cost-based retrieval optimizer.

``Dataset.create(name, schema, key, {col: IndexSpec(...)})`` holds rows as Arrow segments
with HNSW (vectors), B-tree (ordered values) and inverted (keywords/tags) indexes;
``Dataset.search`` picks a retrieval strategy per query (see ``indexes.retrieval``).
"""

from indexes.cost import CostModel, calibrate
from indexes.dataset import Dataset
from indexes.retrieval import STRATEGIES, RetrievalExplain, Strategy, register_strategy
from indexes.spec import DatasetError, IndexSpec

__all__ = [
    "STRATEGIES",
    "CostModel",
    "Dataset",
    "DatasetError",
    "IndexSpec",
    "RetrievalExplain",
    "Strategy",
    "calibrate",
    "register_strategy",
]
