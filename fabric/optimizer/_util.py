"""Helpers shared by the optimizer rules: source lookup, aliases, units, node replacement."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from connectors.base import Pushdown, Source
from dsl.ast import Binary, Expr, conjuncts
from fabric.plan.nodes import Derive, Filter, Join, Plan, Scan, StageRef, VectorSearch


def source_of(catalog: Any, uri: str) -> Source | None:
    """The planning view of ``uri``, or None when no catalog is given."""
    if catalog is None:
        return None
    return catalog.source(uri)


def ask_filter(catalog: Any, uri: str, expr: Expr) -> Pushdown:
    """The source's answer for one unqualified conjunct (UNSUPPORTED when unknown)."""
    src = source_of(catalog, uri)
    if src is None:
        return Pushdown.UNSUPPORTED
    try:
        answer = src.supports_filter(expr)
    except Exception:  # a planning view that cannot judge a filter does not get it
        return Pushdown.UNSUPPORTED
    return answer if isinstance(answer, Pushdown) else Pushdown.UNSUPPORTED


def capabilities(catalog: Any, uri: str) -> frozenset[str]:
    src = source_of(catalog, uri)
    return frozenset(getattr(src, "capabilities", ())) if src is not None else frozenset()


def aliases(plan: Plan) -> set[str]:
    """Source aliases read below ``plan`` (a stage used as a source is one alias: the
    sources inside it are not visible to the plan above)."""
    if isinstance(plan, Scan | VectorSearch | StageRef):
        return {plan.alias}
    return set().union(*(aliases(c) for c in plan.children()))


def derived_names(plan: Plan) -> set[str]:
    """Qualified names of the columns computed by Derive nodes below ``plan``."""
    return {n for p in plan.walk() if isinstance(p, Derive) for n, _, _ in p.items}


def units(plan: Plan) -> dict[str, Plan]:
    """alias -> the top of its *source unit*: the Scan plus the Filter/Derive chain
    directly above it (what the executor computes per source, in parallel)."""
    out: dict[str, Plan] = {}

    def visit(node: Plan) -> Plan | None:
        # returns the unit top if ``node`` is inside a single-scan chain
        if isinstance(node, Scan | VectorSearch):
            return node
        if isinstance(node, Filter | Derive):
            return node if visit(node.input) is not None else None
        for c in node.children():
            top = visit(c)
            if top is not None:
                out[unit_scan(top).alias] = top
        return None

    top = visit(plan)
    if top is not None:
        out[unit_scan(top).alias] = top
    # the key-only pre-scans of dynamic filters (semijoin_reduce) are units too
    todo = plan.scans()
    while todo:
        for d in todo.pop().dynamic:
            pre = getattr(d, "prescan", None)
            if isinstance(pre, Scan) and pre.alias not in out:
                out[pre.alias] = pre
                todo.append(pre)
    return out


def unit_scan(unit: Plan) -> Scan | VectorSearch:
    """The Scan or VectorSearch at the bottom of a source unit."""
    while not isinstance(unit, Scan | VectorSearch):
        unit = unit.children()[0]
    return unit


def replace_node(node: Plan, old: Plan, new: Plan) -> Plan:
    """``node`` with the subtree ``old`` (by identity) replaced by ``new``; subtrees that
    do not contain ``old`` are kept as they are."""
    if node is old:
        return new
    children = node.children()
    if not children:
        return node
    out = tuple(replace_node(c, old, new) for c in children)
    return node if all(a is b for a, b in zip(out, children)) else node.with_children(*out)


def equi_sides(join: Join) -> Iterator[tuple[Expr, Expr, Plan, Plan]]:
    """``(small_expr, key, small, big)`` for each ``=`` conjunct of ``join.on``, each way
    round, and each side that may be the small one (whose values can key the big side's
    scan): either side of an inner join, only the left of an outer one (the right side's
    keys must not drop the left's unmatched rows)."""
    for c in conjuncts(join.on):
        if not (isinstance(c, Binary) and c.op == "="):
            continue
        for small_expr, key in ((c.left, c.right), (c.right, c.left)):
            yield small_expr, key, join.left, join.right
            if join.how == "inner":
                yield small_expr, key, join.right, join.left


def filters_before_latest(scan: Any, names: set[str]) -> bool:
    """Whether a filter over columns ``names`` may go into ``scan``: a ``latest_by`` source
    filters before it keeps each key's newest record, so only a filter on its key columns
    gives what filtering the table of newest records gives (push_filters, and the dynamic
    filters of dynamic_filters / join_bounds / stage_keys; tests/test_latest_by_joins.py)."""
    return not scan.latest_by or names <= set(scan.latest_by)
