"""The physical plan: what runs where, decided once per compiled binding.

``fabric.plan`` says *what* a binding computes (the logical plan, rewritten by
``fabric.optimizer``); this package says *how* it runs: ``planner.plan(logical)`` turns an
optimized logical plan into a ``PhysicalPlan`` of typed nodes (``nodes``): source units
(a Scan / VectorSearch and the Filter/Derive chain run by pyarrow next to it, on the scan
pool or inline), pyarrow steps, DuckDB steps and regions, sandbox calls, CKKS scoring and
stages. Engines are decided statically, from the function registry
(``fabric.functions.REGISTRY``). ``display.render`` is the text ``explain`` shows before
anything runs; ``fabric.execute`` schedules the nodes.
"""

from __future__ import annotations

from fabric.physical.nodes import (
    CkksScore,
    DuckDBRegion,
    DuckDBStep,
    Physical,
    PhysicalError,
    PhysicalPlan,
    PyArrowStep,
    SandboxCall,
    SourceUnit,
    StagesFirst,
    StageTable,
)
from fabric.physical.planner import plan

__all__ = [
    "CkksScore",
    "DuckDBRegion",
    "DuckDBStep",
    "Physical",
    "PhysicalError",
    "PhysicalPlan",
    "PyArrowStep",
    "SandboxCall",
    "SourceUnit",
    "StageTable",
    "StagesFirst",
    "plan",
]
