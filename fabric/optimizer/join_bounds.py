"""Bound a scan's column by the values it is compared with in a join (a per-key bound).

For a join whose condition holds ``x.c < y`` (or ``<=``, ``>``, ``>=``), with ``x.c`` a
base column of a scan on one side (reached as ``dynamic_filters._target`` reaches a
join key: not through a row-changing operator, into a grouped stage only on a group
key) and ``y`` computed from one source unit on the other side, no row of ``x`` with
``c >= max(y)`` can ever satisfy the join: the scan gets ``DynamicFilter(c, y, op)``;
the executor waits for that unit and pushes ``c <= max(y)`` (``c >= min(y)`` for ``>``,
``>=``), rounded outwards to ``c``'s type (``fabric.execute.bounds``: a comparison
computed in another engine or in binary floats can never lose a row). ``y`` is either
an expression over one source of that side, or a column of a stage used as a source
whose select reads one unit directly (TPC-H Q17: ``l.l_quantity < a.qty_limit`` with
``a`` = ``0.2 * avg(l2.l_quantity)`` per part, aggregated in l2's scan; l then reads 56
rows for the 43 needed, not the 555 of its 18 parts).

Only integer and DECIMAL columns are bounded (a float column may hold NaN, which DuckDB
orders above every number), only the inner side of an outer join, and only when the
source takes ``c <= $v`` (EXACT or INEXACT: the join re-checks every row). The bounded
scan then waits for the unit giving ``y`` too, so only a scan that already waits for
another unit's join keys is bounded (a scan read in parallel with everything else, e.g.
under a join on ``c.discount > m.id`` alone, stays so); a filter that would make two
units wait on each other is not added.

    Join: inner on l.l_partkey = p.p_partkey and l.l_quantity < a.qty_limit
      Join: inner on a.l_partkey = p.p_partkey
        Scan: p <- ...
        StageRef: a <- stage://avg_qty
          Project: l2.l_partkey, 0.2 * avg(l2.l_quantity) as qty_limit
            Scan: l2 <- s3://lake/lineitem/ aggregate=(...)
      Scan: l <- s3://lake/lineitem/ dynamic=[..., l_quantity < max(0.2 * avg(l2.l_quantity)) of l2]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa

from connectors.base import Pushdown
from dsl.ast import Binary, Column, Expr, Param, conjuncts, sources_of
from dsl.ast import replace as replace_expr
from fabric.optimizer._util import aliases, ask_filter, replace_node, units
from fabric.optimizer.cardinality import Estimator
from fabric.optimizer.dynamic_filters import SMALL_SIDE, _depends_on, _target
from fabric.plan.nodes import DynamicFilter, Filter, Join, Limit, Plan, Project, Sort, StageRef

FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def join_bounds(plan: Plan, catalog: Any) -> Plan:
    """Add one bound per join comparison that can have one (see module docstring)."""
    while True:
        added = _first(plan, catalog)
        if added is None:
            return plan
        plan = added


def _first(root: Plan, catalog: Any) -> Plan | None:
    est: Estimator | None = None
    for join in root.walk():
        if not isinstance(join, Join) or join.how not in ("inner", "left"):
            continue
        for c in conjuncts(join.on):
            if not (isinstance(c, Binary) and c.op in FLIP):
                continue
            for x, op, y in ((c.left, c.op, c.right), (c.right, FLIP[c.op], c.left)):
                if not isinstance(x, Column):
                    continue
                sides = [(join.right, join.left)]
                if join.how == "inner":
                    sides.append((join.left, join.right))
                for big, other in sides:
                    if x.source not in aliases(big) or not sources_of(y) <= aliases(other):
                        continue
                    est = est or Estimator(root, catalog)
                    out = _try(root, big, other, x, op, y, est, catalog)
                    if out is not None:
                        return out
    return None


def _try(
    root: Plan,
    big: Plan,
    other: Plan,
    x: Column,
    op: str,
    y: Expr,
    est: Estimator,
    catalog: Any,
) -> Plan | None:
    found = _provider(other, y)
    if found is None:
        return None
    from_expr, unit = found
    target = _target(big, x)
    if target is None:
        return None
    scan, column = target
    if column not in scan.source_schema.names:
        return None
    typ = scan.source_schema.field(column).type
    if not (pa.types.is_integer(typ) or pa.types.is_decimal(typ)):
        return None
    if not any(d.op == "in" for d in scan.dynamic):
        return None  # a scan read in parallel with the rest stays so (a theta join alone)
    if any(d.op == op and d.column == column and d.from_expr == from_expr for d in scan.dynamic):
        return None
    if unit == scan.alias or _depends_on(root, unit, scan.alias):
        return None
    top = units(root).get(unit)
    if top is None or est.rows(top) > SMALL_SIDE:
        return None
    probe = Binary("<=" if op in ("<", "<=") else ">=", Column(column), Param("__dyn_bound"))
    if ask_filter(catalog, scan.uri, probe) not in (Pushdown.EXACT, Pushdown.INEXACT):
        return None
    bound = DynamicFilter(column, from_expr, op=op, unit=unit)
    new_scan = dataclasses.replace(scan, dynamic=(*scan.dynamic, bound))
    return replace_node(root, scan, new_scan)


def _provider(other: Plan, y: Expr) -> tuple[Expr, str] | None:
    """``(expression over one unit's output, that unit's alias)`` giving every value
    ``y`` takes in the rows of ``other``, or None."""
    srcs = sources_of(y)
    if len(srcs) != 1:
        return None
    alias = next(iter(srcs))
    found = units(other)
    if alias in found:
        names = set(found[alias].schema.names)
        return (y, alias) if {c.qualified for c in y.columns()} <= names else None
    # a stage used as a source: follow its select to the one unit it reads
    ref = next((n for n in other.walk() if isinstance(n, StageRef) and n.alias == alias), None)
    if ref is None:
        return None
    node = ref.input
    while isinstance(node, Filter | Sort | Limit):  # fewer rows: the bound is looser
        node = node.input
    if not isinstance(node, Project):
        return None
    items = {n: e for n, e, _ in node.items}
    if any(c.name not in items for c in y.columns()):
        return None
    inner = units(node.input)
    if len(inner) != 1:
        return None
    ((unit, top),) = inner.items()
    if top is not node.input:
        return None

    def sub(e: Expr) -> Expr | None:
        if isinstance(e, Column) and e.source == alias:
            return items[e.name]
        return None

    expr = replace_expr(y, lambda e: None, pre=sub)
    names = set(top.schema.names)
    return (expr, unit) if {c.qualified for c in expr.columns()} <= names else None
