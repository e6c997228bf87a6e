"""Key a scan per branch of an OR that spans both sides of its equi-join.

A join ``p.k = l.k and (P1 and L1 or P2 and L2 or ...)``, with each ``Pi`` over ``p``
alone and each ``Li`` over ``l`` alone (other conjuncts of a branch are left to the
join), keeps an ``l`` row only if, for some branch ``i``, its key is the key of a ``p``
row where ``Pi`` holds and ``Li`` holds for it. ``dynamic_filters`` pushes
``l.k in keys(p.k)`` (the keys of every branch) and ``factor_or`` the OR of the ``Li``,
which lets through a row whose key is of branch 1 and whose values are of branch 2:
TPC-H Q19 read 25 lineitem rows for 10 joined. This rule refines that dynamic filter:

    (l.k in keys(p.k where P1) and L1) or (l.k in keys(p.k where P2) and L2) or ...

Each branch's keys are those of the rows of ``p``'s source unit where ``Pi`` is true
(every row when a branch has no condition on ``p``; a branch with no condition on ``l``
is its keys alone), so the scan returns exactly the rows the OR can join, NULLs
included (a NULL key joins nothing; a ``Pi`` that is NULL keeps no key). The OR stays
in the join, which re-checks every row. At run time a branch with no keys drops out (no
branch left: the scan is skipped), and one past ``max_keys`` keeps the keys' range or,
without one, its ``Li`` alone: always a superset of the rows it joins.

Made only where ``dynamic_filters`` already keys that scan by ``p.k`` (its size, cost
and cycle checks hold), every branch's ``Pi`` reads columns of ``p``'s unit, and the
source takes the whole OR (EXACT or INEXACT).

    Join: inner on p.k = l.k and (p.b = 1 and l.q < 5 or p.b = 2 and l.q > 9)
      Scan: p <- ... exact=[b = 1 or b = 2]
      Scan: l <- ... exact=[q < 5 or q > 9] dynamic=[k in keys(p.k) max=50000]
        ->
      Scan: l <- ... dynamic=[k in keys(p.k) max=50000,
                              (k in keys(p.k where p.b = 1) and q < 5) or
                              (k in keys(p.k where p.b = 2) and q > 9) max=50000]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import (
    Binary,
    Column,
    Exists,
    Expr,
    InList,
    Param,
    and_all,
    conjuncts,
    sources_of,
    unqualify,
)
from fabric.optimizer._util import (
    aliases,
    ask_filter,
    derived_names,
    equi_sides,
    filters_before_latest,
    replace_node,
    units,
)
from fabric.optimizer.dynamic_filters import _target
from fabric.optimizer.factor_or import disjuncts, or_all
from fabric.plan.nodes import DynamicFilter, Join, Plan, Scan

PUSHED = (Pushdown.EXACT, Pushdown.INEXACT)


def branch_keys(plan: Plan, catalog: Any) -> Plan:
    """Add per-branch dynamic filters for ORs across an equi-join (module docstring)."""
    while True:
        added = _first(plan, catalog)
        if added is None:
            return plan
        plan = added


def _first(root: Plan, catalog: Any) -> Plan | None:
    unit_of = units(root)
    for join in root.walk():
        if not isinstance(join, Join):
            continue
        ors = [c for c in conjuncts(join.on) if len(disjuncts(c)) > 1]
        if not ors:
            continue
        for small_expr, key, small, big in equi_sides(join):
            if not (isinstance(small_expr, Column) and isinstance(key, Column)):
                continue
            if small_expr.source not in aliases(small) or key.source not in aliases(big):
                continue
            target = _target(big, key)
            if target is None:
                continue
            scan, column = target
            plain = next(
                (
                    d
                    for d in scan.dynamic
                    if d.op == "in" and d.column == column and d.from_expr == small_expr
                ),
                None,
            )
            unit = unit_of.get(small_expr.source or "")
            if plain is None or unit is None:
                continue
            for c in ors:
                dyn = _branched(c, small_expr, key, scan, column, big, unit, plain, catalog)
                if dyn is not None and dyn not in scan.dynamic:
                    new_scan = dataclasses.replace(scan, dynamic=(*scan.dynamic, dyn))
                    return replace_node(root, scan, new_scan)
    return None


def _branched(
    c: Expr,
    small_expr: Column,
    key: Column,
    scan: Scan,
    column: str,
    big: Plan,
    unit: Plan,
    plain: DynamicFilter,
    catalog: Any,
) -> DynamicFilter | None:
    """The per-branch filter of the OR ``c`` for ``scan``, or None when it adds nothing
    or cannot be made (module docstring)."""
    provided = set(unit.schema.names)
    derived = derived_names(big)
    branches: list[tuple[Expr | None, Expr | None]] = []
    for branch in disjuncts(c):
        whens, rests = [], []
        for x in conjuncts(branch):
            if any(isinstance(y, Exists) for y in x.walk()):
                continue  # reads a stage's table: left to the join
            srcs = sources_of(x)
            if srcs == {small_expr.source}:
                if all(col.qualified in provided for col in x.columns()):
                    whens.append(x)
            elif srcs == {key.source} and _pushable(x, scan, derived, catalog):
                rests.append(unqualify(x))
        branches.append((and_all(whens), and_all(rests)))
    if not any(w is not None for w, _ in branches) or not any(r is not None for _, r in branches):
        return None  # the keys of every branch, or no branch's own values: the plain filter
    probe = or_all([_with_keys(Param("__dyn_probe"), column, rest) for _, rest in branches])
    if ask_filter(catalog, scan.uri, probe) not in PUSHED:
        return None
    return DynamicFilter(
        column, small_expr, plain.max_keys, plain.range, op="or", branches=tuple(branches)
    )


def _pushable(x: Expr, scan: Scan, derived: set[str], catalog: Any) -> bool:
    names = {col.name for col in x.columns()}
    if any(col.qualified in derived for col in x.columns()):
        return False
    if not names <= set(scan.source_schema.names) or not filters_before_latest(scan, names):
        return False
    return ask_filter(catalog, scan.uri, unqualify(x)) in PUSHED


def _with_keys(keys: Param, column: str, rest: Expr | None) -> Expr:
    """``column in keys and rest`` (the pushed form of one branch)."""
    held = InList(Column(column), keys)
    return held if rest is None else Binary("and", held, rest)
