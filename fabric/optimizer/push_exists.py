"""Push a correlated ``exists`` / ``not exists`` into the source when its stage reads a
table of the same SQL connection, or Parquet of the same S3 connection.

``exists(S where S.k = x.k and ...)`` is evaluated by the fabric: the stage ``S`` is
read whole (or keyed by ``dynamic_filters``), then DuckDB filters the rows of ``x`` with
``EXISTS (SELECT 1 FROM <S's table> WHERE ...)``. When ``S`` is one table read with
filters the source applies EXACTLY (``Project`` of its columns over a ``Scan``: no
residual filter, limit, aggregate, latest_by or dynamic filter) and ``x``'s scan is
below the filter through ``Filter`` / ``Derive`` / ``Sort`` and inner joins
(``_chain``), the conjunct becomes
one filter of ``x``'s scan, ``ExistsIn``: the same condition with ``S``'s columns named
by the table's own columns and ``S``'s pushed filters added to it,

    exists(mysql://shop/orders as ordered where ordered.o_custkey = c_custkey and ...)

which ``x``'s source is asked for like any filter. Only a source that can evaluate it
exactly says EXACT: ``connectors.sql`` for a table of its own connection (one server,
one database), each comparison translated as its own filters are, session values bound,
and only where the server runs it as a semi-join (docs/engine.md); ``connectors.s3``
for plain Parquet of its own connection read by the DuckDB reader, as
``EXISTS (SELECT 1 FROM read_parquet([...]) ...)`` with at least one top-level key
equality (TPC-H Q21: lineitem l1 935 rows for 465 needed instead of 17,752, and l2 / l3
not fetched). Elsewhere nothing changes. The source then answers with the rows that pass, so TPC-H
Q22 reads 641 customers for 641 needed instead of 1,856, and no order at all.

Semantics are SQL's on both sides: ``=`` never matches NULL (a customer with a NULL key
has no order, so ``not exists`` keeps it, as DuckDB does), an empty table makes every
``exists`` false, and duplicates do not multiply rows (``not in``, which differs on
NULLs, is not rewritten here). A stage no longer used once its ``exists`` went into the
source is dropped from ``WithStages`` (its table is not read); the rule runs after
``push_filters`` (the stage's filters are in its scan) and before ``dynamic_filters``
(which would otherwise key the stage's scan by the outer keys).

    WithStages: ordered                              Scan: c <- mysql://shop/customer
      Stage: ordered                                   exact=[c_acctbal > 0,
        Project: o.o_custkey                ->           not exists(mysql://shop/orders as
          Scan: o <- mysql://shop/orders                   ordered where ordered.o_custkey
      Filter: not exists(ordered where                     = c_custkey)]
          ordered.o_custkey = c.c_custkey)
        Scan: c <- mysql://shop/customer exact=[c_acctbal > 0]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Column, Exists, ExistsIn, Expr, Param, and_all, conjuncts, replace, unqualify
from dsl.types import is_stage_param
from fabric.optimizer._util import aliases, ask_filter, replace_node
from fabric.plan.nodes import (
    Derive,
    Filter,
    Join,
    Plan,
    Project,
    Scan,
    Sort,
    Stage,
    StageResult,
    WithStages,
)


def push_exists(plan: Plan, catalog: Any) -> Plan:
    """Move each pushable correlated (not) exists into its source's scan (module docstring)."""
    if not isinstance(plan, WithStages) or catalog is None:
        return plan
    stages = {s.name: s for s in plan.stages}
    pushed: set[str] = set()
    root: Plan = plan
    while True:
        step = _first(root, stages, catalog)
        if step is None:
            break
        root, names = step
        pushed |= names
    if not pushed:
        return plan
    assert isinstance(root, WithStages)
    return _drop_unused(root, pushed)


def _first(root: Plan, stages: dict[str, Stage], catalog: Any) -> tuple[Plan, set[str]] | None:
    """One conjunct pushed: (the new plan, the stages it named), or None."""
    for node in root.walk():
        if not isinstance(node, Filter):
            continue
        for c in conjuncts(node.predicate):
            inner = {x.stage for x in c.walk() if isinstance(x, Exists)}
            if not inner:
                continue
            outer = {col.source for col in c.columns()} - inner
            if len(outer) != 1:
                continue
            (alias,) = outer
            scan, items = _chain(node.input, alias) if alias is not None else (None, {})
            if scan is None:
                continue
            pushed = _rewrite(c, scan, items, stages)
            if pushed is None:
                continue
            filt, names = pushed
            if filt in scan.exact or ask_filter(catalog, scan.uri, filt) is not Pushdown.EXACT:
                continue
            rest = [x for x in conjuncts(node.predicate) if x is not c]
            below = replace_node(
                node.input, scan, dataclasses.replace(scan, exact=(*scan.exact, filt))
            )
            kept = and_all(rest)
            new = below if kept is None else Filter(below, kept)
            return replace_node(root, node, new), names
    return None


def _chain(node: Plan, alias: str) -> tuple[Scan | None, dict[str, Expr]]:
    """The Scan of ``alias`` under ``node`` through Filter / Derive / Sort and into the
    side of an inner join holding it (a condition on one source's columns filters that
    source's rows the same before the join as after), and the derived columns on the way.
    Not through a left join (kept simple: push_filters' rules for one would apply)."""
    items: dict[str, Expr] = {}
    while isinstance(node, Filter | Derive | Sort | Join):
        if isinstance(node, Derive):
            items.update({n: e for n, e, _ in node.items})
        if isinstance(node, Join):
            if node.how != "inner":
                return None, {}
            node = node.left if alias in aliases(node.left) else node.right
            continue
        node = node.input
    if not isinstance(node, Scan) or node.alias != alias:
        return None, {}
    if node.aggregate is not None or node.latest_by or node.limit is not None:
        # grouped rows (HAVING), the newest record per key, or a cut: a filter in the
        # scan would apply before them
        return None, {}
    return node, items


def _rewrite(
    c: Expr, scan: Scan, derived: dict[str, Expr], stages: dict[str, Stage]
) -> tuple[Expr, set[str]] | None:
    """``c`` with every ``exists`` as ``ExistsIn`` and every other column one of ``scan``'s
    own (derived ones as their expression), unqualified; None when that cannot be."""
    names: set[str] = set()
    failed = False

    def fn(n: Expr) -> Expr | None:
        nonlocal failed
        if isinstance(n, Exists):
            inner = _inner(n, stages)
            if inner is None:
                failed = True
                return None
            names.add(n.stage)
            return inner
        return None

    out = replace(c, fn)
    if failed:
        return None

    def inline(n: Expr) -> Expr | None:
        if isinstance(n, ExistsIn):  # the other table's columns are not derived here
            return ExistsIn(n.uri, n.alias, replace(n.where, lambda e: None, pre=inline_outer))
        return inline_outer(n)

    def inline_outer(n: Expr) -> Expr | None:
        if isinstance(n, Column) and n.qualified in derived:
            return replace(derived[n.qualified], lambda e: None, pre=inline_outer)
        return None

    out = replace(out, lambda e: None, pre=inline)
    for x in out.walk():
        if isinstance(x, ExistsIn) and any(isinstance(y, ExistsIn) for y in x.where.walk()):
            return None  # one level: the translator names one table per exists
    inner = {col for x in out.walk() if isinstance(x, ExistsIn) for col in x.inner_columns()}
    for col in out.columns() - inner:
        if col.source != scan.alias or col.name not in scan.source_schema.names:
            return None
    return unqualify(out), names


def _inner(e: Exists, stages: dict[str, Stage]) -> ExistsIn | None:
    """``e`` over the table its stage reads, when the stage is one table's columns with
    filters its source applies exactly; None otherwise."""
    stage = stages.get(e.stage)
    if stage is None or e.where is None:
        return None
    body = stage.input
    if not isinstance(body, Project) or not isinstance(body.input, Scan):
        return None
    scan = body.input
    if (
        scan.inexact
        or scan.dynamic
        or scan.limit is not None
        or scan.aggregate is not None
        or scan.latest_by
        or any(isinstance(x, ExistsIn | Exists) for f in scan.exact for x in f.walk())
    ):
        return None
    cols: dict[str, str] = {}
    for name, expr, _ in body.items:
        if not (isinstance(expr, Column) and expr.source == scan.alias):
            return None  # a computed stage column: not a column of the table
        cols[name] = expr.name
        cols[name.rpartition(".")[2]] = expr.name
    bad = False

    def rename(n: Expr) -> Expr | None:
        nonlocal bad
        if isinstance(n, Column) and n.source == e.stage:
            if n.name not in cols:
                bad = True
                return None
            return Column(cols[n.name], e.stage, span=n.span)
        if isinstance(n, Exists):
            bad = True  # an exists inside the condition
        return None

    where = replace(e.where, rename)
    if bad:
        return None
    own = [replace(f, _qualifier(e.stage)) for f in scan.exact]
    cond = and_all([where, *own])
    assert cond is not None
    return ExistsIn(scan.uri, e.stage, cond, span=e.span)


def _qualifier(alias: str) -> Any:
    def fn(n: Expr) -> Expr | None:
        if isinstance(n, Column) and n.source is None:
            return Column(n.name, alias, span=n.span)
        return None

    return fn


# ---------------------------------------------------------------- stages left unused


def _drop_unused(root: WithStages, pushed: set[str]) -> Plan:
    """``root`` without the stages of ``pushed`` nothing uses any more (and without
    ``WithStages`` when no stage is left)."""
    stages = list(root.stages)
    while True:
        used = _used(root.input) | {n for s in stages for n in _used(s.input)}
        keep = [s for s in stages if s.name not in pushed or s.name in used]
        if len(keep) == len(stages):
            break
        stages = keep
    if not stages:
        return root.input
    return dataclasses.replace(root, stages=tuple(stages))


def _used(plan: Plan) -> set[str]:
    """The stages ``plan`` reads: StageResults, exists, stage values in any expression."""
    out: set[str] = set()
    for node in plan.walk():
        if isinstance(node, StageResult):
            out.add(node.name)
        for e in _exprs(node):
            for x in e.walk():
                if isinstance(x, Exists):
                    out.add(x.stage)
                elif isinstance(x, Param) and is_stage_param(x.name):
                    out.add(x.name[len("stage:") :].partition(":")[0].partition(".")[0])
    return out


def _exprs(node: Any) -> list[Expr]:
    """Every expression a node holds, at any depth of its fields (tuples, filters)."""
    out: list[Expr] = []

    def visit(v: Any) -> None:
        if isinstance(v, Expr):
            out.append(v)
        elif isinstance(v, tuple | list):
            for x in v:
                visit(x)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type | Plan):
            for f in dataclasses.fields(v):
                visit(getattr(v, f.name))

    for f in dataclasses.fields(node):
        v = getattr(node, f.name)
        if not isinstance(v, Plan):
            visit(v)
    return out
