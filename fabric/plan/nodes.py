"""Logical plan nodes: frozen, hashable, typed, validated when built (after ibis).

Column names in a plan are qualified by the binding's source alias (``m.name``); a
``Scan`` maps its alias to a source URI. Rules in ``fabric/optimizer/`` rewrite plans
into plans; ``explain()`` renders the indented text form that is both the output of
``fabric explain`` and the oracle of the fixture tests, in the style of

    Limit: 10
      Sort: c.discount desc
        Project: m.name, c.discount, c.code
          Join: inner on c.merchant_id = m.id
            ...
              Scan: m <- mysql://shop/merchants projection=[id, name, geo_hash] exact=[status = 'active']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from connectors.base import Aggregation
from dsl.ast import Call, Column, Exists, Expr, SortKey, conjuncts
from dsl.errors import FabricError
from dsl.spec import SandboxLimits as SandboxLimitsSpec  # a binding's pushdown.limits


class PlanError(FabricError, ValueError):
    """A plan node was built with inconsistent inputs (a bug in a rule or the builder)."""


@dataclass(frozen=True)
class Freshness:
    """``freshness: {max_lag: 5s, on_stale: wait}``; max_lag in seconds and/or messages."""

    max_lag_seconds: float | None = None
    max_lag_messages: int | None = None
    on_stale: str = "flag"  # wait | flag | fail
    wait_timeout: float | None = None

    def __str__(self) -> str:
        parts = []
        if self.max_lag_seconds is not None:
            parts.append(f"max_lag={self.max_lag_seconds:g}s")
        if self.max_lag_messages is not None:
            parts.append(f"max_lag_messages={self.max_lag_messages}")
        parts.append(f"on_stale={self.on_stale}")
        return " ".join(parts)


@dataclass(frozen=True)
class Plan:
    def children(self) -> tuple[Plan, ...]:
        return tuple(
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Plan)
        )

    @property
    def schema(self) -> pa.Schema:
        raise NotImplementedError

    def with_children(self, *children: Plan) -> Plan:
        names = [
            f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Plan)
        ]
        return dataclasses.replace(self, **dict(zip(names, children, strict=True)))

    def walk(self) -> Iterator[Plan]:
        yield self
        for c in self.children():
            yield from c.walk()

    def scans(self) -> list[Scan]:
        return [p for p in self.walk() if isinstance(p, Scan)]

    def header(self) -> str:
        raise NotImplementedError

    def explain(self, indent: int = 0, annotate: Any = None) -> str:
        """Indented text; ``annotate(node) -> str | None`` appends run-time facts."""
        extra = annotate(self) if annotate else None
        line = "  " * indent + self.header() + (f"  [{extra}]" if extra else "")
        return "\n".join([line, *(c.explain(indent + 1, annotate) for c in self.children())])


def _qualify(alias: str, schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f"{alias}.{f.name}", f.type, f.nullable) for f in schema])


def _outputs(plan: Plan) -> dict[Expr, str]:
    """Expressions a node outputs under a name (Project / Aggregate items, through the
    Filter / Sort / Limit above them): a node above may refer to them by expression."""
    while isinstance(plan, Filter | Sort | Limit):
        plan = plan.input
    if isinstance(plan, Project):
        return {e: n for n, e, _ in plan.items}
    if isinstance(plan, Aggregate):
        return {e: n for n, e, _ in (*plan.group_by, *plan.aggregates)}
    if isinstance(plan, Scan) and plan.aggregate is not None:
        return {e: n for n, e, _ in (*plan.aggregate.group_by, *plan.aggregate.aggregates)}
    return {}


def _known(col: Column, names: set[str]) -> bool:
    """Whether ``col`` denotes a column of ``names``: the qualified name, an output name,
    a bare name matching ``x.name``, or a field inside a struct column."""
    q = col.qualified
    if q in names or col.name in names:
        return True
    if col.source is None and any(n.endswith("." + col.name) for n in names):
        return True
    return any(q.startswith(n + ".") for n in names)  # c.meta.city inside c.meta


def check_columns(node: str, exprs: Any, inputs: Plan | tuple[Plan, ...], extra: Any = ()) -> None:
    """Raise PlanError naming a column ``exprs`` refer to that no input has (and the
    existing ones). Columns of a stage inside ``exists(S where ...)`` are the stage's."""
    plans = inputs if isinstance(inputs, tuple) else (inputs,)
    outputs: dict[Expr, str] = {}
    names: set[str] = set(extra)
    for p in plans:
        names.update(p.schema.names)
        outputs.update(_outputs(p))
    for e in exprs:
        stages = {x.stage for x in e.walk() if isinstance(x, Exists)}
        computed = {x for x in e.walk() if x in outputs}
        inside = {c for x in computed for c in x.columns()}
        for c in e.columns():
            if c in inside or c in outputs or c.source in stages or _known(c, names):
                continue
            raise PlanError(
                f"{node}: column {c.qualified} is not among the columns of its input "
                f"({', '.join(sorted(names))})"
            )


def _exprs(items: tuple[Expr, ...]) -> str:
    return "[" + ", ".join(str(e) for e in items) + "]"


@dataclass(frozen=True)
class DynamicFilter:
    """Keys of ``column`` taken at run time from the already-computed ``from_expr`` of
    another source and pushed into this scan: as an IN list when there are at most
    ``max_keys`` of them, else (when ``range``: the source accepts ``>=``/``<=`` on
    ``column``) as the range ``[min key, max key]``; the join re-checks every row.

    With ``op`` one of ``<``, ``<=``, ``>``, ``>=`` it is a bound instead
    (``fabric.optimizer.join_bounds``): ``column op max(from_expr)`` (``min`` for ``>``,
    ``>=``), pushed rounded outwards to the column's type. ``unit`` names the source unit
    whose output ``from_expr`` is computed over when ``from_expr`` does not name it (an
    aggregate's output columns are unqualified); ``provider`` is that alias.

    With ``op`` ``or`` it is keyed per branch (``fabric.optimizer.branch_keys``): for each
    ``(when, rest)`` of ``branches``, the keys of the provider's rows where ``when`` is true
    (every row when None), pushed as ``(column in those keys and rest) or ...``; ``rest``
    is over this scan's own columns (None: the keys alone)."""

    column: str
    from_expr: Expr
    max_keys: int = 50_000
    range: bool = False
    op: str = "in"
    unit: str | None = None
    branches: tuple[tuple[Expr | None, Expr | None], ...] = ()

    @property
    def provider(self) -> str | None:
        """The alias of the source unit whose output gives the values."""
        if self.unit is not None:
            return self.unit
        found = {c.source for c in self.from_expr.columns() if c.source}
        return next(iter(found)) if len(found) == 1 else None

    def __str__(self) -> str:
        if self.op == "or":
            parts = []
            for when, rest in self.branches:
                keys = f"{self.column} in keys({self.from_expr}"
                keys += f" where {when})" if when is not None else ")"
                parts.append(f"({keys} and {rest})" if rest is not None else f"({keys})")
            more = " else range" if self.range else ""
            return f"{' or '.join(parts)} max={self.max_keys}{more}"
        if self.op != "in":
            agg = "max" if self.op in ("<", "<=") else "min"
            return f"{self.column} {self.op} {agg}({self.from_expr}) of {self.provider}"
        more = " else range" if self.range else ""
        return f"{self.column} in keys({self.from_expr}) max={self.max_keys}{more}"


@dataclass(frozen=True)
class Scan(Plan):
    """Read one source. ``source_schema`` holds the source's own column names.

    After pushdown: ``projection`` (None: all columns), ``exact`` filters the source
    applies fully, ``inexact`` filters it applies partially (a Filter above re-checks
    them), ``limit``/``order_by`` only when all pushed filters are exact. ``aggregate``:
    the source groups the filtered rows itself (``push_aggregate``); the scan's output is
    then the aggregate's (its names and types, as the Aggregate it replaced), and
    ``projection`` the columns the aggregate reads.
    """

    alias: str
    uri: str
    source_schema: pa.Schema
    projection: tuple[str, ...] | None = None
    exact: tuple[Expr, ...] = ()
    inexact: tuple[Expr, ...] = ()
    limit: int | None = None
    order_by: tuple[SortKey, ...] = ()
    latest_by: tuple[str, ...] = ()
    dynamic: tuple[DynamicFilter, ...] = ()
    freshness: Freshness | None = None
    estimated_rows: int | None = None
    aggregate: Aggregation | None = None

    def __post_init__(self) -> None:
        names = set(self.source_schema.names)
        for c in (self.projection or ()) + self.latest_by:
            if c not in names:
                raise PlanError(f"scan {self.alias}: no column {c!r} in {self.uri}")
        if self.aggregate is not None:
            if self.limit is not None or self.order_by or self.latest_by or self.inexact:
                raise PlanError(
                    f"scan {self.alias}: an aggregate under a limit, order, latest_by or "
                    "inexact filter"
                )
            items = (*self.aggregate.group_by, *self.aggregate.aggregates)
            for _, e, _ in items:
                for col in e.columns():
                    if col.source != self.alias or col.name not in (self.projection or names):
                        raise PlanError(
                            f"scan {self.alias}: its aggregate reads {col.qualified}, not a "
                            f"projected column of {self.uri}"
                        )

    @property
    def schema(self) -> pa.Schema:
        if self.aggregate is not None:
            return self.aggregate.schema
        s = self.source_schema
        if self.projection is not None:
            s = pa.schema([s.field(n) for n in self.projection])
        return _qualify(self.alias, s)

    def header(self) -> str:
        parts = [f"Scan: {self.alias} <- {self.uri}"]
        if self.projection is not None:
            parts.append(f"projection=[{', '.join(self.projection)}]")
        if self.latest_by:
            parts.append(f"latest_by=[{', '.join(self.latest_by)}]")
        if self.exact:
            parts.append(f"exact={_exprs(self.exact)}")
        if self.inexact:
            parts.append(f"inexact={_exprs(self.inexact)}")
        if self.dynamic:
            parts.append(f"dynamic=[{', '.join(map(str, self.dynamic))}]")
        if self.order_by:
            parts.append(f"order_by={_exprs(self.order_by)}")
        if self.limit is not None:
            parts.append(f"limit={self.limit}")
        if self.aggregate is not None:
            parts.append(f"aggregate=({self.aggregate})")
        if self.freshness:
            parts.append(f"freshness=({self.freshness})")
        if self.estimated_rows is not None:
            parts.append(f"est_rows={self.estimated_rows}")
        return " ".join(parts)


@dataclass(frozen=True)
class TextArm:
    """The keyword arm of a ranked search: the ``k`` rows with the highest BM25 relevance
    of the inverted-indexed ``column`` to ``query`` (a Param or a text literal)."""

    column: str
    query: Expr
    k: int

    def __str__(self) -> str:
        return f"search({self.column}, {self.query}) k={self.k}"


@dataclass(frozen=True)
class RankFusion:
    """Reciprocal-rank fusion of the arms: ``rrf_k`` constant, ``k`` rows kept (None: the
    larger arm's k), optional recency decay (half-life in seconds on a timestamp)."""

    rrf_k: int = 60
    k: int | None = None
    recency: str | None = None
    half_life_seconds: float | None = None

    def __str__(self) -> str:
        parts = [f"rrf_k={self.rrf_k}"]
        if self.k is not None:
            parts.append(f"k={self.k}")
        if self.recency is not None:
            parts.append(f"recency={self.recency} half_life={self.half_life_seconds:g}s")
        return f"rank(rrf {' '.join(parts)})"


@dataclass(frozen=True)
class VectorSearch(Plan):
    """k nearest rows of an indexed dataset to ``query`` (a Param or literal vector),
    among rows satisfying ``filters`` (conjuncts over the dataset's columns). The
    retrieval strategy (HNSW post-filter, HNSW in-search filter, pre-filter + exact,
    exact scan) is chosen per execution by the cost model, because selectivity depends
    on the session values.

    A ranked search (``search:`` / ``rank:`` in the binding) adds a keyword arm
    (``text``: BM25 over an inverted index) and/or a ``fusion`` of the arms; without
    ``nearest:`` ``column`` and ``query`` are None and ``k`` is the keyword arm's. Its
    extra columns: ``_distance`` (vector arm), ``_bm25`` (keyword arm), ``_score``
    (the fused score, or BM25 without fusion)."""

    alias: str
    uri: str
    source_schema: pa.Schema
    column: str | None
    query: Expr | None
    k: int
    filters: tuple[Expr, ...] = ()
    projection: tuple[str, ...] | None = None
    metric: str | None = None
    distance_column: str = "_distance"
    freshness: Freshness | None = None
    text: TextArm | None = None
    fusion: RankFusion | None = None

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise PlanError(f"nearest k must be positive, got {self.k}")
        if self.column is None and self.text is None:
            raise PlanError(f"search {self.alias}: neither a vector nor a keyword arm")
        for c in (self.column, self.text.column if self.text else None):
            if c is not None and c not in self.source_schema.names:
                raise PlanError(f"vector search {self.alias}: no column {c!r} in {self.uri}")

    @property
    def rows_out(self) -> int:
        """Rows the search returns at most: the fused k (default: the larger arm's k),
        else the one arm's k."""
        if self.fusion is not None and self.fusion.k is not None:
            return self.fusion.k
        return max(self.k if self.column is not None else 0, self.text.k if self.text else 0)

    @property
    def inputs(self) -> tuple[Expr, ...]:
        """The query values (vector, text) the search binds at run time."""
        return tuple(e for e in (self.query, self.text.query if self.text else None) if e)

    @property
    def extra_columns(self) -> list[pa.Field]:
        out = []
        if self.column is not None:
            out.append(pa.field(self.distance_column, pa.float32()))
        if self.text is not None:
            out.append(pa.field("_bm25", pa.float64()))
        if self.text is not None or self.fusion is not None:
            out.append(pa.field("_score", pa.float64()))
        return out

    @property
    def schema(self) -> pa.Schema:
        s = self.source_schema
        if self.projection is not None:
            s = pa.schema([s.field(n) for n in self.projection])
        for f in self.extra_columns:
            s = s.append(f)
        return _qualify(self.alias, s)

    def header(self) -> str:
        if self.column is not None:
            parts = [
                f"VectorSearch: {self.alias} <- {self.uri} nearest({self.column}, {self.query}) k={self.k}"
            ]
        else:
            parts = [f"KeywordSearch: {self.alias} <- {self.uri}"]
        if self.text is not None:
            parts.append(str(self.text))
        if self.fusion is not None:
            parts.append(str(self.fusion))
        if self.metric:
            parts.append(f"metric={self.metric}")
        if self.projection is not None:
            parts.append(f"projection=[{', '.join(self.projection)}]")
        if self.filters:
            parts.append(f"filters={_exprs(self.filters)}")
        if self.freshness:
            parts.append(f"freshness=({self.freshness})")
        return " ".join(parts)


@dataclass(frozen=True)
class Filter(Plan):
    input: Plan
    predicate: Expr

    def __post_init__(self) -> None:
        check_columns("Filter", (self.predicate,), self.input)

    @property
    def schema(self) -> pa.Schema:
        return self.input.schema

    def header(self) -> str:
        return f"Filter: {self.predicate}"

    @property
    def conjuncts(self) -> list[Expr]:
        return conjuncts(self.predicate)


@dataclass(frozen=True)
class Derive(Plan):
    """Add computed columns ``alias.name = expr`` (``derive:`` in a source)."""

    input: Plan
    items: tuple[tuple[str, Expr, pa.DataType], ...]

    def __post_init__(self) -> None:
        # an item may use the ones before it
        for i, (_, e, _) in enumerate(self.items):
            check_columns("Derive", (e,), self.input, (n for n, _, _ in self.items[:i]))

    @property
    def schema(self) -> pa.Schema:
        s = self.input.schema
        for name, _, typ in self.items:
            s = s.append(pa.field(name, typ))
        return s

    def header(self) -> str:
        return "Derive: " + ", ".join(f"{n} = {e}" for n, e, _ in self.items)


@dataclass(frozen=True)
class Join(Plan):
    left: Plan
    right: Plan
    on: Expr
    how: str = "inner"  # inner | left
    estimated_rows: int | None = None

    def __post_init__(self) -> None:
        if self.how not in ("inner", "left"):
            raise PlanError(f"join kind {self.how!r} is not supported")
        check_columns("Join", (self.on,), (self.left, self.right))

    @property
    def schema(self) -> pa.Schema:
        return pa.schema(list(self.left.schema) + list(self.right.schema))

    def header(self) -> str:
        return f"Join: {self.how} on {self.on}"


@dataclass(frozen=True)
class Project(Plan):
    """The select list: output name, expression, output type."""

    input: Plan
    items: tuple[tuple[str, Expr, pa.DataType], ...]

    def __post_init__(self) -> None:
        check_columns("Project", (e for _, e, _ in self.items), self.input)

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, t) for n, _, t in self.items])

    def header(self) -> str:
        return "Project: " + ", ".join(
            str(e) if isinstance(e, Column) and e.name == n.split(".")[-1] else f"{e} as {n}"
            for n, e, _ in self.items
        )


@dataclass(frozen=True)
class Aggregate(Plan):
    input: Plan
    group_by: tuple[tuple[str, Expr, pa.DataType], ...]
    aggregates: tuple[tuple[str, Call, pa.DataType], ...]

    def __post_init__(self) -> None:
        check_columns(
            "Aggregate", (e for _, e, _ in (*self.group_by, *self.aggregates)), self.input
        )

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, t) for n, _, t in self.group_by + self.aggregates])

    def header(self) -> str:
        g = ", ".join(str(e) for _, e, _ in self.group_by)
        a = ", ".join(f"{e} as {n}" for n, e, _ in self.aggregates)
        return f"Aggregate: group_by=[{g}] aggregates=[{a}]"


@dataclass(frozen=True)
class Sort(Plan):
    input: Plan
    keys: tuple[SortKey, ...]

    def __post_init__(self) -> None:
        check_columns("Sort", (k.expr for k in self.keys), self.input)

    @property
    def schema(self) -> pa.Schema:
        return self.input.schema

    def header(self) -> str:
        return "Sort: " + ", ".join(str(k) for k in self.keys)


@dataclass(frozen=True)
class Limit(Plan):
    input: Plan
    n: int
    offset: int = 0

    def __post_init__(self) -> None:
        if self.n < 0 or self.offset < 0:
            raise PlanError("limit and offset must be non-negative")

    @property
    def schema(self) -> pa.Schema:
        return self.input.schema

    def header(self) -> str:
        return f"Limit: {self.n}" + (f" offset {self.offset}" if self.offset else "")


@dataclass(frozen=True)
class UserFunction(Plan):
    """``pushdown: python:``: run(table) in a sandboxed worker next to the data."""

    input: Plan
    code: str
    file: str
    line: int
    col: int = 1
    params: tuple[str, ...] = ()
    limits: SandboxLimitsSpec = field(default_factory=SandboxLimitsSpec)
    output_schema: pa.Schema | None = None

    @property
    def schema(self) -> pa.Schema:
        return self.output_schema if self.output_schema is not None else self.input.schema

    def header(self) -> str:
        p = f" params=[{', '.join(self.params)}]" if self.params else ""
        return f"UserFunction: python sandbox ({self.file}:{self.line}){p}"


@dataclass(frozen=True)
class EncryptedScore(Plan):
    """Score an encrypted session vector against each input row, under CKKS.

    ``expr`` is e.g. ``dot({{session.ctx}}, n.embedding)`` or
    ``weighted({{session.ctx}}, [..], b)``; the output column ``name`` is encrypted."""

    input: Plan
    name: str
    expr: Call
    depth: int = 1

    @property
    def schema(self) -> pa.Schema:
        return self.input.schema.append(pa.field(self.name, pa.binary()))

    def header(self) -> str:
        return f"EncryptedScore: {self.name} = {self.expr} (CKKS, depth {self.depth})"


@dataclass(frozen=True)
class StageRef(Plan):
    """A stage used as a source (``from: stage://NAME`` as ``alias``): the stage's plan,
    its output columns qualified by ``alias`` (``s.revenue``)."""

    input: Plan
    alias: str
    stage: str

    @property
    def schema(self) -> pa.Schema:
        return _qualify(self.alias, self.input.schema)

    def header(self) -> str:
        return f"StageRef: {self.alias} <- stage://{self.stage}"


@dataclass(frozen=True)
class Stage(Plan):
    """A named stage whose result feeds expressions (``exists(NAME ...)``, ``x in NAME``,
    the value ``NAME.col``); computed before the plan that uses it."""

    input: Plan
    name: str

    @property
    def schema(self) -> pa.Schema:
        return self.input.schema

    def header(self) -> str:
        return f"Stage: {self.name}"


@dataclass(frozen=True)
class WithStages(Plan):
    """The root of a binding with stages used in expressions: ``stages`` run first, in
    order (each may use the ones before it), then ``input``. Their results reach the
    expressions as bound parameters (``dsl.types.stage_param``) or, for a correlated
    ``exists``, as a table DuckDB reads."""

    input: Plan
    stages: tuple[Stage, ...]

    def children(self) -> tuple[Plan, ...]:
        return (*self.stages, self.input)

    def with_children(self, *children: Plan) -> Plan:
        *stages, last = children
        if not all(isinstance(s, Stage) for s in stages):
            raise PlanError("WithStages: every child but the last must be a Stage")
        return dataclasses.replace(self, stages=tuple(stages), input=last)  # type: ignore[arg-type]

    @property
    def schema(self) -> pa.Schema:
        return self.input.schema

    def header(self) -> str:
        return "WithStages: " + ", ".join(s.name for s in self.stages)


@dataclass(frozen=True)
class StageResult(Plan):
    """The result of a stage computed once under ``WithStages`` (a stage used in
    expressions, or read by several sources), read where the stage is used as a source."""

    name: str
    stage_schema: pa.Schema

    @property
    def schema(self) -> pa.Schema:
        return self.stage_schema

    def header(self) -> str:
        return f"StageResult: {self.name}"
