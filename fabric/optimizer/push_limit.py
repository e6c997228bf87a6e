"""Push a Limit (with the Sort under it) into a single-source Scan when that is safe.

Safe means: between the Limit and the Scan there are only row-preserving nodes
(Project, Derive, at most one Sort); the Scan has no inexact filter, no residual filter, no dynamic
filter and no ``latest_by`` (every row the source returns is an answer row); the source
declares the ``limit`` capability (and ``order_by`` when a Sort is pushed); and every
sort key is a plain column of the source. The Scan gets ``limit = n + offset`` and the
sort keys; the Limit and Sort stay above, so the answer is right whatever the source does.

    Limit: 5                             Limit: 5
      Sort: m.name asc                     Sort: m.name asc
        Scan: m <- memory://t/m    ->        Scan: m <- memory://t/m order_by=[name asc] limit=5
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsl.ast import Column, SortKey
from fabric.optimizer._util import capabilities, replace_node
from fabric.plan.nodes import Derive, Limit, Plan, Project, Scan, Sort


def push_limit(plan: Plan, catalog: Any) -> Plan:
    """Copy Limit/Sort into a single-source Scan (see module docstring)."""
    return _visit(plan, catalog)


def _visit(node: Plan, catalog: Any) -> Plan:
    children = node.children()
    if children:
        new = tuple(_visit(c, catalog) for c in children)
        if not all(a is b for a, b in zip(new, children)):
            node = node.with_children(*new)
    if isinstance(node, Limit):
        pushed = _push(node, catalog)
        if pushed is not None:
            return pushed
    return node


def _push(limit: Limit, catalog: Any) -> Plan | None:
    keys: tuple[SortKey, ...] = ()
    below_sort: list[Plan] = []  # the row-preserving nodes between the Sort and the Scan
    node = limit.input
    while isinstance(node, Project | Derive | Sort):
        if isinstance(node, Sort):
            if keys:
                return None
            keys, below_sort = node.keys, []
        else:
            below_sort.append(node)
        node = node.input
    if not isinstance(node, Scan):
        return None
    scan = node
    if scan.inexact or scan.dynamic or scan.latest_by or scan.aggregate is not None:
        return None
    caps = capabilities(catalog, scan.uri)
    if "limit" not in caps or (keys and "order_by" not in caps):
        return None
    mapped = []
    for k in keys:
        col = _resolve(k.expr, below_sort, scan)
        if col is None:
            return None
        mapped.append(SortKey(Column(col), k.descending, k.nulls_first))
    n = limit.n + limit.offset
    if scan.limit == n and scan.order_by == tuple(mapped):
        return None
    new_scan = dataclasses.replace(scan, limit=n, order_by=tuple(mapped))
    return replace_node(limit, scan, new_scan)


def _resolve(e: Any, path: list[Plan], scan: Scan) -> str | None:
    """The source column a sort key denotes, looking through Projects; None if computed."""
    for node in path:
        if isinstance(node, Project):
            hit = None
            for name, expr, _ in node.items:
                if expr == e or (
                    isinstance(e, Column) and e.source is None and name in (e.name, e.qualified)
                ):
                    hit = expr
                    break
            if hit is None:
                if isinstance(e, Column) and e.source == scan.alias:
                    continue
                return None
            e = hit
        elif (
            isinstance(node, Derive)
            and isinstance(e, Column)
            and e.qualified in {n for n, _, _ in node.items}
        ):
            return None
    if isinstance(e, Column) and e.source == scan.alias and e.name in scan.source_schema.names:
        return e.name
    return None
