"""Factor an OR of AND-groups so that its parts can reach the sources.

A filter ``(a and b and x) or (a and c and y)`` is rewritten, exactly, in two ways:

- conjuncts common to every branch move out of the OR:
  ``a and ((b and x) or (c and y))`` (Kleene's three-valued logic is distributive, so the
  rows a WHERE keeps are the same, NULLs included);
- for each source that every branch constrains, the implied disjunction of those
  constraints is added as one more conjunct: with ``b``, ``c`` over ``p`` and ``x``, ``y``
  over ``l``, ``(b or c)`` and ``(x or y)`` are added and the original OR stays. A row the
  OR keeps satisfies some branch, so it satisfies that branch's part over each source: the
  added conjuncts never drop a row the filter keeps, and ``push_filters`` can hand them to
  the sources (TPC-H Q19: the part and lineitem halves of three AND-groups).

Conjuncts over two sources that become common (``p.p_partkey = l.l_partkey``) turn into
join conditions when ``push_filters`` runs next. Filters with no OR, or whose OR reads a
single source, are left as they are.

    Filter: (p.k = l.k and p.b = 1 and l.q < 5) or (p.k = l.k and p.b = 2 and l.q > 9)
      ->
    Filter: p.k = l.k and (p.b = 1 and l.q < 5 or p.b = 2 and l.q > 9)
                      and (p.b = 1 or p.b = 2) and (l.q < 5 or l.q > 9)
"""

from __future__ import annotations

from typing import Any

from dsl.ast import Binary, Expr, and_all, conjuncts, sources_of
from fabric.plan.nodes import Filter, Plan


def factor_or(plan: Plan, catalog: Any) -> Plan:
    """Factor common conjuncts out of ORs and add per-source implied ORs (see module doc)."""
    children = plan.children()
    if children:
        new = tuple(factor_or(c, catalog) for c in children)
        if not all(a is b for a, b in zip(new, children)):
            plan = plan.with_children(*new)
    if not isinstance(plan, Filter):
        return plan
    out: list[Expr] = []
    for c in conjuncts(plan.predicate):
        for item in _factor(c):
            if item not in out:
                out.append(item)
    if out == conjuncts(plan.predicate):
        return plan
    predicate = and_all(out)
    assert predicate is not None
    return Filter(plan.input, predicate)


def disjuncts(e: Expr) -> list[Expr]:
    """Split ``a or (b or c)`` into [a, b, c]."""
    if isinstance(e, Binary) and e.op == "or":
        return disjuncts(e.left) + disjuncts(e.right)
    return [e]


def or_all(items: list[Expr]) -> Expr:
    out = items[0]
    for it in items[1:]:
        out = Binary("or", out, it)
    return out


def _factor(c: Expr) -> list[Expr]:
    """``c`` as the conjuncts that replace it (``[c]`` when there is nothing to do)."""
    branches = [conjuncts(d) for d in disjuncts(c)]
    if len(branches) < 2:
        return [c]
    common = [x for x in branches[0] if all(x in b for b in branches[1:])]
    rest = [[x for x in b if x not in common] for b in branches]
    out = list(common)
    if any(not r for r in rest):
        return out  # one branch is only the common part: the OR adds nothing to it
    residual = or_all([_and(r) for r in rest])
    out.append(residual)
    srcs = sources_of(residual)
    if len(srcs) < 2:
        return out
    for s in sorted(srcs):
        parts = [[x for x in r if sources_of(x) == {s}] for r in rest]
        if all(parts):
            implied = or_all([_and(p) for p in parts])
            if implied != residual:
                out.append(implied)
    return out


def _and(items: list[Expr]) -> Expr:
    e = and_all(items)
    assert e is not None
    return e
