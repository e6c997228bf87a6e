"""Optimized logical plan -> physical plan: which engine runs each part, decided once.

``plan(logical, catalog)``:

- each source's Scan / VectorSearch and the Filter/Derive chain right above it is a
  ``SourceUnit``; it runs on the shared scan pool, except a plan's lone unit over an
  in-process source (one whose capabilities hold ``Capability.IN_PROCESS``: ``dataset://``,
  ``memory://``; planned offline, a kind ``connectors.registry.inline_kinds()`` names),
  which runs on the caller's thread. A unit whose dynamic filters take keys from other
  units depends on them; units are ordered key producers first; a key-only pre-scan
  (``semijoin_reduce``) is a unit of its own, planned under the first unit waiting for
  it; a Filter / Derive using a stage whose scans take keys from a unit (a correlated
  ``exists``) is left out of that unit's chain, so the unit never waits on that stage;
- a Join or Aggregate, with the Filter / Project / Sort / Limit nodes above it, is one
  ``DuckDBRegion`` (one SQL query over its inputs' Arrow tables); the rest of a plan
  without join or aggregate stays in pyarrow (DuckDB's fixed cost is ~0.6-5 ms a query),
  and so does an Aggregate of one input by count / count_distinct / min / max
  (``pyarrow_aggregate_lacks``: pyarrow's hash aggregation, DuckDB's answer);
- a unary node runs in pyarrow unless one of its expressions has no pyarrow form: a call
  of a registry function with neither an ``arrow`` nor an ``array`` form (and not a
  constant the fabric folds), a correlated ``exists``, a LIKE with a non-constant
  pattern. Then it is a ``DuckDBStep`` (in a unit's chain: the step's engine ``duckdb``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from connectors.arrow_expr import is_constant
from dsl.ast import Call, Column, Exists, Expr, Like, Param, Star, unqualify
from dsl.ast import replace as replace_expr
from dsl.types import is_stage_param
from fabric import functions
from fabric.optimizer.push_aggregate import unqualified
from fabric.optimizer.semijoin_reduce import unit_deps
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

NOW_PARAM = "__now"


class PlanningError(PhysicalError):
    """A logical plan that cannot be run (carries a hint for the user)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint


def plan(logical: Plan, catalog: Any = None) -> PhysicalPlan:
    """The physical plan of the optimized ``logical`` plan (see the module docstring);
    ``catalog`` answers whether a source works in process (None: by its URI kind)."""
    units: dict[str, SourceUnit] = {}
    root = _Planner(units, _stage_waits(logical)).node(logical)
    deps = {a: u.deps for a, u in units.items()}
    order = _unit_order(units, deps)
    if len(order) == 1 and not isinstance(logical, WithStages):
        only = units[order[0]]
        if _in_process(catalog, only.leaf.uri):
            inline = dataclasses.replace(only, placement="inline")
            units[order[0]] = inline
            root = _swap(root, only, inline)
    memo: dict[str, int] = {}

    def depth(a: str) -> int:
        if a not in memo:
            memo[a] = 1 + max((depth(d) for d in deps[a]), default=-1)
        return memo[a]

    return PhysicalPlan(
        root=root,
        logical=logical,
        units=dict(units),
        order=order,
        depth=max((depth(a) for a in units), default=0),
        params=frozenset(plan_params(logical)),
        schema=logical.schema,
        headers={id(n): n.header() for n in logical.walk()},
    )


# ---------------------------------------------------------------- engines


def pyarrow_lacks(e: Expr) -> str | None:
    """Why pyarrow cannot compute ``e`` (None: it can), from the function registry."""
    for x in e.walk():
        if isinstance(x, Exists):
            return f"exists({x.stage} ...) reads a stage's table"
        if isinstance(x, Like) and not is_constant(x.pattern):
            return "a LIKE pattern that is not a constant"
        if isinstance(x, Call) and not (x.name == "now" and not x.args):
            f = functions.lookup(x.name)
            if f is None or (f.arrow is None and f.array is None):
                if is_constant(x):
                    continue  # folded to a value before pyarrow sees it
                return f"{x.name}() has no pyarrow form"
    return None


def node_exprs(node: Plan) -> list[Expr]:
    """The expressions a unary node evaluates."""
    if isinstance(node, Filter):
        return [node.predicate]
    if isinstance(node, Derive | Project):
        return [e for _, e, _ in node.items]
    if isinstance(node, Sort):
        return [k.expr for k in node.keys]
    return []


def exprmap(node: Plan) -> dict[Expr, str]:
    """Expressions whose values a node outputs under a name (Project / Aggregate items)."""
    if isinstance(node, Project):
        return {e: n for n, e, _ in node.items}
    if isinstance(node, Aggregate):
        return {e: n for n, e, _ in (*node.group_by, *node.aggregates)}
    if isinstance(node, Scan) and node.aggregate is not None:  # aggregated at the source
        agg = node.aggregate
        return {e: n for n, e, _ in (*agg.group_by, *agg.aggregates)}
    if isinstance(node, Filter | Sort | Limit):
        return exprmap(node.input)
    return {}


def unary_engine(node: Plan) -> tuple[str, str]:
    """(engine, why) for a unary node over one table: pyarrow unless it lacks a form."""
    from fabric.execute.sql import substitute

    below = exprmap(node.children()[0]) if node.children() else {}
    if _over_source_aggregate(node) and not all(isinstance(e, Column) for e in node_exprs(node)):
        # what it computes from the groups is computed as above an Aggregate: DuckDB's
        # DECIMAL arithmetic (pyarrow's 0.5 * a decimal(38,2) sum overflows, TPC-H Q20)
        return "duckdb", "over an aggregate computed at its source"
    for e in node_exprs(node):
        why = pyarrow_lacks(substitute(e, below))
        if why is not None:
            return "duckdb", why
    return "pyarrow", ""


#: aggregates pyarrow's hash aggregation computes as DuckDB does; sum and avg stay in
#: DuckDB (a float sum depends on the order of addition, pyarrow's int64 sum wraps)
PYARROW_AGGREGATES = frozenset({"count", "count_distinct", "min", "max"})


def pyarrow_aggregate_lacks(node: Aggregate) -> str | None:
    """Why pyarrow cannot run this Aggregate (None: it can, over one input without a
    join, saving DuckDB's fixed cost of ~5 ms a query on a 20-row multi-hop answer)."""
    from fabric.execute.sql import substitute

    if needs_sql(node.input):
        return "over a join or a DuckDB region"
    below = exprmap(node.input)
    for _, c, _ in node.aggregates:
        if c.name not in PYARROW_AGGREGATES or c.distinct:
            return f"{c} is computed in DuckDB"
    exprs = [e for _, e, _ in node.group_by]
    exprs += [a for _, c, _ in node.aggregates for a in c.args if not isinstance(a, Star)]
    for e in exprs:
        why = pyarrow_lacks(substitute(e, below))
        if why is not None:
            return why
    return None


def _over_source_aggregate(node: Plan) -> bool:
    """Whether ``node`` reads (through Filter / Derive / Project / Sort / Limit) a Scan
    whose source computes its aggregate (``push_aggregate``)."""
    below = node.children()[0] if node.children() else None
    while isinstance(below, Filter | Derive | Project | Sort | Limit):
        below = below.input
    return isinstance(below, Scan) and below.aggregate is not None


def needs_sql(node: Plan) -> bool:
    """A join, an aggregate pyarrow cannot compute, or a Filter / Project / Sort / Limit
    above one: DuckDB."""
    if isinstance(node, Join):
        return True
    if isinstance(node, Aggregate):
        return pyarrow_aggregate_lacks(node) is not None
    if isinstance(node, Filter | Project | Sort | Limit):
        return needs_sql(node.input)
    return False


# ---------------------------------------------------------------- building


def _stage_waits(logical: Plan) -> dict[str, set[str]]:
    """stage -> the aliases whose units its scans take dynamic-filter keys from
    (transitively): a unit among them must not wait on that stage."""
    if not isinstance(logical, WithStages):
        return {}
    deps = unit_deps(logical)
    out: dict[str, set[str]] = {}
    for st in logical.stages:
        seen: set[str] = set()
        todo = [d for s in st.scans() for d in deps.get(s.alias, ())]
        while todo:
            a = todo.pop()
            if a not in seen:
                seen.add(a)
                todo.extend(deps.get(a, ()))
        out[st.name] = seen
    return out


class _Planner:
    def __init__(self, units: dict[str, SourceUnit], waits: Mapping[str, set[str]]):
        self.units = units
        self.waits = waits

    def node(self, n: Plan) -> Physical:
        unit = self.unit(n)
        if unit is not None:
            return self.register(unit)
        if needs_sql(n):
            return self.region(n)
        if isinstance(n, Filter | Derive | Project | Sort | Limit):
            engine, why = unary_engine(n)
            child = self.node(n.input)
            if engine == "duckdb":
                return DuckDBStep(n, child, why)
            return PyArrowStep(n, child)
        if isinstance(n, StageRef | Stage | Aggregate):  # Aggregate: needs_sql said pyarrow
            return PyArrowStep(n, self.node(n.input))
        if isinstance(n, StageResult):
            return StageTable(n)
        if isinstance(n, UserFunction):
            return SandboxCall(n, self.node(n.input))
        if isinstance(n, EncryptedScore):
            return CkksScore(n, self.node(n.input))
        if isinstance(n, WithStages):
            stages = tuple(self.node(s) for s in n.stages)
            return StagesFirst(n, stages, self.node(n.input))
        raise PlanningError(f"cannot execute plan node {type(n).__name__}")

    def register(self, unit: SourceUnit) -> SourceUnit:
        """Record ``unit`` and its key-only pre-scans (each planned once: a pre-scan
        already planned under another unit is shown there only)."""
        if unit.alias in self.units:
            raise PlanningError(f"two sources are named {unit.alias}")
        kept = []
        for p in unit.prescans:
            known = self.units.get(p.alias)
            if known is None:
                kept.append(self.register(p))
            elif known.leaf != p.leaf:
                raise PlanningError(f"two key-only pre-scans are named {p.alias}")
        if len(kept) != len(unit.prescans):
            unit = dataclasses.replace(unit, prescans=tuple(kept))
        self.units[unit.alias] = unit
        return unit

    def unit(self, n: Plan) -> SourceUnit | None:
        chain: list[Plan] = []
        leaf = n
        while isinstance(leaf, Filter | Derive):
            chain.append(leaf)
            leaf = leaf.input
        if not isinstance(leaf, Scan | VectorSearch):
            return None
        if any(
            leaf.alias in self.waits.get(s, ())
            for x in chain
            for e in node_exprs(x)
            for s in stage_refs(e)
        ):
            # a filter using a stage that takes this unit's keys: it runs above the unit
            return None
        residual = tuple(str(c) for x in chain if isinstance(x, Filter) for c in x.conjuncts)
        if isinstance(leaf, Scan):
            deps = frozenset(d.provider for d in leaf.dynamic if d.provider) - {leaf.alias}
            filters = tuple(bind_now(f) for f in (*leaf.exact, *leaf.inexact))
            text = {
                "exact": tuple(str(f) for f in leaf.exact),
                "inexact": tuple(str(f) for f in leaf.inexact),
                "residual": residual,
            }
            exprs: list[Expr] = [*leaf.exact, *leaf.inexact]
            pre = [getattr(d, "prescan", None) for d in leaf.dynamic]
            prescans = tuple(self.unit(p) for p in pre if isinstance(p, Scan))
        else:
            deps = frozenset()
            prescans = ()
            filters = tuple(bind_now(unqualify(f)) for f in leaf.filters)
            text = {"filters": tuple(str(f) for f in leaf.filters), "residual": residual}
            exprs = [*leaf.filters, *leaf.inputs]
        for x in chain:
            exprs += node_exprs(x)
        requires = frozenset().union(*(stage_refs(e) for e in exprs)) if exprs else frozenset()
        return SourceUnit(
            n,
            alias=leaf.alias,
            leaf=leaf,
            chain=tuple(chain),
            engines=tuple(unary_engine(x)[0] for x in chain),
            deps=deps,
            requires=requires,
            filters=filters,
            text=text,
            aggregate=(
                unqualified(leaf.aggregate)
                if isinstance(leaf, Scan) and leaf.aggregate is not None
                else None
            ),
            prescans=tuple(p for p in prescans if p is not None),
        )

    def region(self, top: Plan) -> DuckDBRegion:
        nodes: list[Plan] = []
        inputs: list[Physical] = []

        def visit(n: Plan) -> None:
            if not needs_sql(n) or self.unit(n) is not None:
                inputs.append(self.node(n))
                return
            nodes.append(n)
            for c in n.children():
                visit(c)

        visit(top)
        return DuckDBRegion(top, tuple(nodes), tuple(inputs))


# ---------------------------------------------------------------- helpers


def _in_process(catalog: Any, uri: str) -> bool:
    """Whether ``uri``'s source scans in this process (no network I/O): the source's
    capabilities hold ``IN_PROCESS``; without a source to ask, its kind is one of the
    registry's inline kinds (``connectors.registry.inline_kinds``)."""
    from connectors.base import Capability
    from connectors.registry import inline_kinds

    caps = None
    if catalog is not None:
        try:
            caps = getattr(catalog.source(uri), "capabilities", None)
        except Exception:  # the unit reports it when it runs (same error, same place)
            caps = None
    if caps is not None:
        return Capability.IN_PROCESS in caps
    return uri.partition("://")[0] in inline_kinds()


def _swap(root: Physical, old: Physical, new: Physical) -> Physical:
    """``root`` with the node ``old`` (by identity) replaced by ``new``."""
    if root is old:
        return new
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(root):
        v = getattr(root, f.name)
        if isinstance(v, Physical):
            w = _swap(v, old, new)
            if w is not v:
                changes[f.name] = w
        elif isinstance(v, tuple) and v and all(isinstance(x, Physical) for x in v):
            w2 = tuple(_swap(x, old, new) for x in v)
            if any(a is not b for a, b in zip(w2, v)):
                changes[f.name] = w2
    return dataclasses.replace(root, **changes) if changes else root


def _unit_order(
    units: Mapping[str, SourceUnit], deps: Mapping[str, frozenset[str]]
) -> tuple[str, ...]:
    order: list[str] = []
    seen: set[str] = set()

    def visit(a: str, stack: tuple[str, ...]) -> None:
        if a in seen:
            return
        if a in stack:
            raise PlanningError(
                f"dynamic filters wait on each other: {' -> '.join((*stack, a))}",
                "this is an optimizer bug; report the binding",
            )
        for d in sorted(deps[a]):
            if d not in units:
                raise PlanningError(f"dynamic filter of {a} needs source {d}, which is not a unit")
            visit(d, (*stack, a))
        seen.add(a)
        order.append(a)

    for a in units:
        visit(a, ())
    return tuple(order)


def plan_params(plan: Plan) -> set[str]:
    """Names of the session values a plan refers to."""
    out: set[str] = set()

    def collect(v: Any) -> None:
        if isinstance(v, Expr):
            out.update(v.params())
        elif isinstance(v, tuple):
            for x in v:
                collect(x)
        elif dataclasses.is_dataclass(v) and not isinstance(v, Plan | type):
            for f in dataclasses.fields(v):
                collect(getattr(v, f.name))

    for node in plan.walk():
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if not isinstance(v, Plan):
                collect(v)
        if isinstance(node, UserFunction):
            out.update(node.params)
    return out


def bind_now(e: Expr) -> Expr:
    """``now()`` -> the ``__now`` parameter, so every source sees the same instant."""
    return replace_expr(
        e,
        lambda n: (
            Param(NOW_PARAM) if isinstance(n, Call) and n.name == "now" and not n.args else None
        ),
    )


def parse_stage_param(name: str) -> tuple[str, str]:
    """``stage:S.col`` -> (S, col); ``stage:S:list`` -> (S, ':list')."""
    rest = name[len("stage:") :]
    if ":" in rest:
        stage, _, what = rest.partition(":")
        return stage, ":" + what
    stage, _, col = rest.partition(".")
    return stage, col


def stage_refs(e: Expr) -> set[str]:
    """Names of the stages whose results ``e`` uses."""
    out: set[str] = set()
    for x in e.walk():
        if isinstance(x, Exists):
            out.add(x.stage)
        elif isinstance(x, Param) and is_stage_param(x.name):
            out.add(parse_stage_param(x.name)[0])
    return out
