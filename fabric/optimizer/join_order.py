"""Order a chain of inner joins by estimated cardinality and fill ``estimated_rows``.

The inner joins of a (left-deep or bushy) chain are flattened into their inputs and
conditions, then rebuilt left-deep greedily: start from the smallest input, and add at
each step the connected input that gives the smallest estimated intermediate result
(ties: smaller input, then the binding's order). Only inputs joined by a condition to
what is already joined are taken while any remain (no accidental cross products). Each
condition is attached to the lowest join that sees all its sources. Left joins are
boundaries: their sides are ordered separately, never across.

Every Scan and Join gets ``estimated_rows`` (Scans including their dynamic filters),
which ``explain analyze`` prints next to the actual rows. When the plan's root is the
join chain itself, a Project restores the original column order so the output schema
does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsl.ast import Column, Expr, Literal, and_all, conjuncts, sources_of
from fabric.optimizer._util import aliases
from fabric.optimizer.cardinality import Estimator
from fabric.plan.nodes import Join, Plan, Project, Scan


def join_order(plan: Plan, catalog: Any) -> Plan:
    """Reorder inner-join chains by estimated size; fill estimated_rows (see module docstring)."""
    est = Estimator(plan, catalog)
    out = _visit(plan, est)
    out = _fill(out, Estimator(out, catalog))
    if out.schema.names != plan.schema.names and sorted(out.schema.names) == sorted(
        plan.schema.names
    ):
        items = tuple((f.name, _col(f.name), f.type) for f in plan.schema)
        out = Project(out, items)
    return out


def _col(qualified: str) -> Column:
    alias, _, name = qualified.partition(".")
    return Column(name, alias) if name else Column(alias)


def _visit(node: Plan, est: Estimator) -> Plan:
    if isinstance(node, Join) and node.how == "inner":
        inputs, conds = _flatten(node)
        inputs = [_visit(i, est) for i in inputs]
        return _greedy(inputs, conds, est)
    children = node.children()
    if not children:
        return node
    new = tuple(_visit(c, est) for c in children)
    return node if all(a is b for a, b in zip(new, children)) else node.with_children(*new)


def _flatten(node: Plan) -> tuple[list[Plan], list[Expr]]:
    if isinstance(node, Join) and node.how == "inner":
        li, lc = _flatten(node.left)
        ri, rc = _flatten(node.right)
        own = [c for c in conjuncts(node.on) if not (isinstance(c, Literal) and c.value is True)]
        return li + ri, lc + rc + own
    return [node], []


def _greedy(inputs: list[Plan], conds: list[Expr], est: Estimator) -> Plan:
    sizes = [est.rows(i, dynamic=False) for i in inputs]
    names = [aliases(i) for i in inputs]
    remaining = list(range(len(inputs)))
    first = min(remaining, key=lambda i: (sizes[i], i))
    remaining.remove(first)
    tree: Plan = inputs[first]
    covered = set(names[first])
    used: set[int] = set()
    tree_rows = float(sizes[first])
    while remaining:

        def connecting(i: int, covered: set[str] = covered, used: set[int] = used) -> list[int]:
            return [
                k
                for k, c in enumerate(conds)
                if k not in used
                and sources_of(c) <= covered | names[i]
                and sources_of(c) & names[i]
            ]

        connected = [i for i in remaining if connecting(i)]
        pool = connected or remaining
        scored = []
        for i in pool:
            ks = connecting(i)
            on = and_all([conds[k] for k in ks]) or Literal(True, "bool")
            rows = est.join_rows(Join(tree, inputs[i], on), tree_rows, float(sizes[i]))
            scored.append((rows, sizes[i], i, ks, on))
        rows, _, i, ks, on = min(scored, key=lambda s: (s[0], s[1], s[2]))
        tree = Join(tree, inputs[i], on, "inner")
        tree_rows = rows
        covered |= names[i]
        used |= set(ks)
        remaining.remove(i)
    leftover = [c for k, c in enumerate(conds) if k not in used]
    if leftover and isinstance(tree, Join):
        tree = dataclasses.replace(tree, on=and_all([*conjuncts(tree.on), *leftover]) or tree.on)
    return tree


def _fill(node: Plan, est: Estimator) -> Plan:
    children = node.children()
    new = tuple(_fill(c, est) for c in children)
    if children and not all(a is b for a, b in zip(new, children)):
        node = node.with_children(*new)
    if isinstance(node, Scan | Join):
        rows = est.rows(node, dynamic=True)
        if node.estimated_rows != rows:
            node = dataclasses.replace(node, estimated_rows=rows)
    return node
