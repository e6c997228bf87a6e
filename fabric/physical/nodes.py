"""Physical plan nodes: frozen, typed, checked when built.

Each node runs one part of an optimized logical plan (``logical``: the logical node at the
top of that part) in one engine:

- ``SourceUnit``: one source's Scan or VectorSearch and the Filter/Derive chain right
  above it, computed together on one thread: on the shared scan pool, or ``inline`` on
  the caller's thread (a lone unit over an in-process source). ``deps`` are the units
  whose keys its dynamic filters wait for, ``requires`` the stages its filters use;
  ``prescans`` the key-only pre-scans (units of their own) it is the first to wait for;
- ``PyArrowStep``: one unary node (Filter, Derive, Project, Sort, Limit, a stage read as
  a source) in pyarrow compute;
- ``DuckDBStep``: one unary node over one Arrow table in DuckDB, because an expression
  of it has no pyarrow form (a registry function without ``arrow``/``array``, a
  correlated ``exists``, a non-constant LIKE pattern);
- ``DuckDBRegion``: one DuckDB query over several inputs: the joins and aggregates and
  the unary nodes above them (``nodes``, top first), its ``inputs`` registered as Arrow
  tables;
- ``SandboxCall`` (``pushdown.python``), ``CkksScore`` (encrypted scoring);
- ``StagesFirst``: stages used in expressions, run in order before ``input``;
  ``StageTable``: the result of such a stage, read where it is used as a source.

``PhysicalPlan`` holds the root and what scheduling needs (units in dependency order,
their depth, the session values referred to, the output schema).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from connectors.base import Aggregation
from dsl.ast import Expr
from dsl.errors import FabricError
from fabric.plan.nodes import (
    Aggregate,
    Derive,
    EncryptedScore,
    Filter,
    Join,
    Limit,
    Plan,
    Project,
    Scan,
    Sort,
    Stage,
    StageRef,
    StageResult,
    UserFunction,
    VectorSearch,
    WithStages,
)


class PhysicalError(FabricError, ValueError):
    """A physical node was built with inconsistent inputs (a bug in the planner)."""


PLACEMENTS = ("pool", "inline")
ENGINES = ("pyarrow", "duckdb")


@dataclass(frozen=True, eq=False)
class Physical:
    """A part of the plan run by one engine; ``logical`` is the node at its top."""

    logical: Plan

    def children(self) -> tuple[Physical, ...]:
        return ()

    def walk(self) -> Iterator[Physical]:
        yield self
        for c in self.children():
            yield from c.walk()

    @property
    def schema(self) -> pa.Schema:
        return self.logical.schema


@dataclass(frozen=True, eq=False)
class SourceUnit(Physical):
    alias: str
    leaf: Scan | VectorSearch
    chain: tuple[Plan, ...]  # the Filter/Derive nodes above the leaf, top first
    engines: tuple[str, ...]  # per chain node: pyarrow | duckdb
    deps: frozenset[str]
    requires: frozenset[str]
    filters: tuple[Expr, ...]  # exact + inexact (Scan) / filters (VectorSearch), now() bound
    text: Mapping[str, tuple[str, ...]] = field(repr=False)  # for stats
    placement: str = "pool"
    #: the Scan's pushed aggregate over the source's own column names (its ScanRequest's)
    aggregate: Aggregation | None = None
    #: key-only pre-scans this unit's dynamic filters take keys from, planned here
    #: (``fabric.optimizer.semijoin_reduce``): units of their own, shown below this one
    prescans: tuple[SourceUnit, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.leaf, Scan | VectorSearch):
            raise PhysicalError(f"unit {self.alias}: its leaf is a {type(self.leaf).__name__}")
        if self.leaf.alias != self.alias:
            raise PhysicalError(f"unit {self.alias}: its leaf reads {self.leaf.alias}")
        top = self.chain[0] if self.chain else self.leaf
        if top is not self.logical:
            raise PhysicalError(f"unit {self.alias}: logical is not the top of its chain")
        below: Plan = self.leaf
        for node in reversed(self.chain):
            if not isinstance(node, Filter | Derive) or node.input is not below:
                raise PhysicalError(f"unit {self.alias}: {node.header()} is not a chain step")
            below = node
        if len(self.engines) != len(self.chain) or not set(self.engines) <= set(ENGINES):
            raise PhysicalError(f"unit {self.alias}: engines {self.engines} for its chain")
        if self.placement not in PLACEMENTS:
            raise PhysicalError(f"unit {self.alias}: placement {self.placement!r}")
        if self.alias in self.deps:
            raise PhysicalError(f"unit {self.alias} waits on itself")
        for p in self.prescans:
            if p.alias not in self.deps or p.chain:
                raise PhysicalError(f"unit {self.alias}: pre-scan {p.alias} is not a key scan")

    def children(self) -> tuple[Physical, ...]:
        return self.prescans


@dataclass(frozen=True, eq=False)
class PyArrowStep(Physical):
    input: Physical

    def __post_init__(self) -> None:
        _unary_over(self, Filter | Derive | Project | Sort | Limit | StageRef | Stage | Aggregate)

    def children(self) -> tuple[Physical, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class DuckDBStep(Physical):
    input: Physical
    why: str = ""

    def __post_init__(self) -> None:
        _unary_over(self, Filter | Derive | Project | Sort | Limit)

    def children(self) -> tuple[Physical, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class DuckDBRegion(Physical):
    nodes: tuple[Plan, ...]  # the logical nodes compiled into the query, top first
    inputs: tuple[Physical, ...]  # computed first, registered as Arrow tables

    def __post_init__(self) -> None:
        if not self.nodes or self.nodes[0] is not self.logical:
            raise PhysicalError("DuckDB region: logical must be its first node")
        if not any(isinstance(n, Join | Aggregate) for n in self.nodes):
            raise PhysicalError("DuckDB region without a join or aggregate")
        inside = {id(n) for n in self.nodes}
        for n in self.nodes:
            if not isinstance(n, Join | Aggregate | Filter | Derive | Project | Sort | Limit):
                raise PhysicalError(f"DuckDB region cannot run {type(n).__name__}")
            for c in n.children():
                if id(c) not in inside and not any(i.logical is c for i in self.inputs):
                    raise PhysicalError(f"DuckDB region: no input for {c.header()}")

    def children(self) -> tuple[Physical, ...]:
        return self.inputs


@dataclass(frozen=True, eq=False)
class SandboxCall(Physical):
    input: Physical

    def __post_init__(self) -> None:
        _unary_over(self, UserFunction)

    def children(self) -> tuple[Physical, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class CkksScore(Physical):
    input: Physical

    def __post_init__(self) -> None:
        _unary_over(self, EncryptedScore)

    def children(self) -> tuple[Physical, ...]:
        return (self.input,)


@dataclass(frozen=True, eq=False)
class StageTable(Physical):
    def __post_init__(self) -> None:
        if not isinstance(self.logical, StageResult):
            raise PhysicalError(f"StageTable over {type(self.logical).__name__}")

    @property
    def name(self) -> str:
        return self.logical.name  # type: ignore[attr-defined]


@dataclass(frozen=True, eq=False)
class StagesFirst(Physical):
    stages: tuple[Physical, ...]  # one per logical Stage, in order
    input: Physical

    def __post_init__(self) -> None:
        if not isinstance(self.logical, WithStages):
            raise PhysicalError(f"StagesFirst over {type(self.logical).__name__}")
        if len(self.stages) != len(self.logical.stages):
            raise PhysicalError("StagesFirst: one physical node per stage")
        for st, lg in zip(self.stages, self.logical.stages):
            if st.logical is not lg:
                raise PhysicalError(f"StagesFirst: stage {lg.name} out of place")
        if self.input.logical is not self.logical.input:
            raise PhysicalError("StagesFirst: input is not the plan's input")

    def children(self) -> tuple[Physical, ...]:
        return (*self.stages, self.input)


def _unary_over(node: Any, kinds: Any) -> None:
    name = type(node).__name__
    if not isinstance(node.logical, kinds):
        raise PhysicalError(f"{name} cannot run {type(node.logical).__name__}")
    if node.input.logical is not node.logical.input:
        raise PhysicalError(f"{name}: its input is not {node.logical.header()}'s input")


@dataclass(frozen=True, eq=False)
class PhysicalPlan:
    """A runnable plan: ``root``, and the facts scheduling needs (computed once)."""

    root: Physical
    logical: Plan
    units: Mapping[str, SourceUnit]
    order: tuple[str, ...]  # key-producing units before the units waiting for their keys
    depth: int  # the longest chain of units waiting on each other (timeouts scale with it)
    params: frozenset[str]
    schema: pa.Schema
    headers: Mapping[int, str] = field(repr=False)  # id(logical node) -> its header

    def __post_init__(self) -> None:
        if self.root.logical is not self.logical:
            raise PhysicalError("the physical root does not run the logical root")
        found = {p.alias for p in self.root.walk() if isinstance(p, SourceUnit)}
        if found != set(self.units) or set(self.order) != found:
            raise PhysicalError(f"units {sorted(self.units)} != the units found {sorted(found)}")
        for alias in self.order:
            for d in self.units[alias].deps:
                if self.order.index(d) > self.order.index(alias):
                    raise PhysicalError(f"unit {alias} is ordered before {d}, which it waits on")

    def walk(self) -> Iterator[Physical]:
        return self.root.walk()

    def explain(self, annotate: Any = None) -> str:
        from fabric.physical.display import render

        return render(self, annotate)

    def replace(self, **changes: Any) -> PhysicalPlan:
        return dataclasses.replace(self, **changes)
