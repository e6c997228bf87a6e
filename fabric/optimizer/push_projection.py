"""Give every Scan (and VectorSearch) the projection of the columns needed above it.

Walks the plan top-down with the set of qualified column names each node's parent
needs: the root needs its whole output; Filter, Sort and Join add the columns of their
predicates, keys and conditions; Derive needs the inputs of its expressions; Project and
Aggregate need exactly what their items use; a sandboxed UserFunction or an
EncryptedScore needs its whole input. Dynamic-filter key expressions are needed too.
A Scan keeps its source's column order; a Scan that needs nothing keeps its first
column (a source cannot return rows without columns).

    Project: m.name                         Project: m.name
      Scan: m <- mysql://shop/merchants  ->   Scan: m <- mysql://shop/merchants projection=[name]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsl.ast import Expr
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
    UserFunction,
    VectorSearch,
)


def push_projection(plan: Plan, catalog: Any) -> Plan:
    """Set Scan/VectorSearch projections to the columns needed above them."""
    extra: set[str] = set()
    for s in plan.scans():
        for d in s.dynamic:
            extra |= _cols(d.from_expr, *(w for w, _ in d.branches if w is not None))
    return _prune(plan, set(plan.schema.names) | extra, extra)


def _cols(*exprs: Expr) -> set[str]:
    out: set[str] = set()
    for e in exprs:
        for c in e.columns():
            out.add(c.qualified)
            out.add(c.name)
    return out


def _prune(node: Plan, need: set[str], extra: set[str]) -> Plan:
    if isinstance(node, Scan) and node.aggregate is not None:
        return node  # aggregated at the source: it reads what its aggregate uses
    if isinstance(node, Scan):
        cols = tuple(n for n in node.source_schema.names if f"{node.alias}.{n}" in need)
        if not cols:
            cols = (node.source_schema.names[0],)
        return node if node.projection == cols else dataclasses.replace(node, projection=cols)
    if isinstance(node, VectorSearch):
        cols = tuple(n for n in node.source_schema.names if f"{node.alias}.{n}" in need)
        if not cols:
            cols = (node.source_schema.names[0],)
        return node if node.projection == cols else dataclasses.replace(node, projection=cols)
    if isinstance(node, Filter):
        child_need = need | _cols(node.predicate)
    elif isinstance(node, Sort):
        child_need = need | _cols(*(k.expr for k in node.keys))
    elif isinstance(node, Limit):
        child_need = need
    elif isinstance(node, Join):
        child_need = need | _cols(node.on)
    elif isinstance(node, Derive):
        names = {n for n, _, _ in node.items}
        child_need = (need - names) | _cols(*(e for _, e, _ in node.items))
    elif isinstance(node, Project):
        child_need = _cols(*(e for _, e, _ in node.items))
    elif isinstance(node, Aggregate):
        child_need = _cols(*(e for _, e, _ in node.group_by), *(e for _, e, _ in node.aggregates))
    elif isinstance(node, UserFunction | EncryptedScore):
        child_need = set(node.children()[0].schema.names)
    else:
        child_need = (
            set().union(*(set(c.schema.names) for c in node.children()))
            if node.children()
            else set()
        )
    children = node.children()
    if not children:
        return node
    new = tuple(_prune(c, child_need | extra, extra) for c in children)
    return node if all(a is b for a, b in zip(new, children)) else node.with_children(*new)
