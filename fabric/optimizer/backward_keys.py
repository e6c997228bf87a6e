"""Read a provider of keys after its consumers, keyed by them (a semi-join's backward pass).

``dynamic_filters`` reads the side providing keys first, so its rows are cut only by its
own filters and its own providers; what its consumers' filters drop is already fetched.
Yannakakis' full reducer adds a backward pass: each provider reduced again by the rows
that survived on the other side. For a unit ``x`` whose column ``a`` keys another
scan ``t`` (``t.b in keys(x.a)``), this rule gives every consumer of ``x`` a key-only
pre-scan ``x#keys`` instead (the same scan of ``x``'s source reading only the columns
they take, with ``x``'s pushed and dynamic filters: the same keys, ``semijoin_reduce``'s
``KeyScanFilter``), and keys ``x`` itself by what its consumers read: ``x.a in
keys(t.b)``. Nothing waits on ``x`` any more, so ``x`` waits on ``t`` without a cycle.
TPC-H Q3: the orders of the segment's customers before the date are 15,224; only the
1,216 with a line shipped after it are needed. The lines, keyed by the pre-scan's order
keys, read 3,321 rows; the orders, keyed by those lines' 1,216 order keys, read 1,216.

The pre-scan's keys are those ``x`` gave before (it lacks only ``x``'s unit's residual
filters, and a unit with one is not chosen), ``x`` reads a subset of its rows holding
every row the join keeps, and the join re-checks every key: the answer is unchanged.
Only where ``x`` may be keyed by ``t`` (``equi_sides``: not the preserved side of a left
join), ``x`` a plain scan (no aggregate, limit or ``latest_by``, no stage or ``exists`` in
its filters, no residual filter, in the main block, keying no stage), each consumer's
key a base column of ``x`` taken by an IN list or a bound.

Made where it is expected to pay, for a consumer ``t`` joined to ``x`` (``_pays``):
``t``'s own pushed filters and ``x``'s compare columns with the same session value (a
correlated pair, which independent selectivities cannot see: Q3's orders before the
date whose lines ship just after it), or the estimates say ``t`` keeps at most
``MIN_GAIN`` of ``x``'s keys. And where the cost stays bounded: ``x`` has columns besides
the keys it gives (else the pre-scan reads what the second fetch would, and the rows
merely move: Q3's customers), ``MIN_ROWS`` to ``MAX_ROWS`` estimated rows (fewer cost
less than the round trip; at worst ``x`` is read twice, once one column wide), and ``x``
not already read after a consumer (``_flipped``, ``_keyed_by_prescan_of``). The price is
one more round trip to ``x``'s source, after ``t``'s. On the 22 TPC-H plans it changes
only Q3's (TPC-H Q5's customers, keyed by the year's orders, would fall from 3,014 rows to
1,729 for 655, at 1.7x the wall time: not made, their orders share no session value).

    Scan: o <- mysql://tpch/orders ... dynamic=[o_custkey in keys(c.c_custkey) ...,
      o_orderkey in keys(l.l_orderkey) max=50000 else range]
    Scan: l <- s3://lake/lineitem/ exact=[l_shipdate > {{session.date}}]
      dynamic=[l_orderkey in keys(o#keys.o_orderkey) max=50000 else range <- key-only
      scan (o#keys <- mysql://tpch/orders projection=[o_orderkey] exact=[...] ...)]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Binary, Column, Expr, InList, Param
from dsl.types import is_stage_param
from fabric.optimizer._util import (
    aliases,
    ask_filter,
    derived_names,
    equi_sides,
    replace_node,
    unit_scan,
)
from fabric.optimizer.cardinality import Estimator, rewrite_to_fixpoint
from fabric.optimizer.push_projection import push_projection
from fabric.optimizer.reverse_full_keys import whole_keys
from fabric.optimizer.semijoin_reduce import (
    KEYS,
    KeyScanFilter,
    _stage_free,
    all_scans,
    map_dynamic,
    reaches,
    unit_deps,
)
from fabric.plan.nodes import DynamicFilter, Filter, Join, Plan, Scan, WithStages

MAX_ROWS = 50_000  # estimated rows of x: its pre-scan and its second fetch stay small
MIN_GAIN = 0.5  # the consumers must be expected to keep at most this share of x's keys
MIN_ROWS = 1_000  # below, reading x's rows costs less than the round trip that would cut them
MAX_KEYS = 50_000
_KEYED = ("in", "<", "<=", ">", ">=")


def backward_keys(plan: Plan, catalog: Any) -> Plan:
    """Key providers by their consumers, giving the consumers key-only pre-scans
    (module docstring)."""
    return rewrite_to_fixpoint(plan, catalog, _candidate)


def _candidate(root: Plan, est: Estimator, catalog: Any) -> Plan | None:
    main = root.input if isinstance(root, WithStages) else root
    main_scans = {s.alias: s for s in main.scans()}
    stage_scans = {s.alias for s in all_scans(root)} - {s.alias for s in all_scans(main)}
    deps = unit_deps(root)
    joins = [n for n in main.walk() if isinstance(n, Join)]
    projected: dict[str, tuple[str, ...]] | None = None
    tried: set[str] = set()
    for join in reversed(joins):  # innermost first
        for t_expr, x_key, t_side, x_side in equi_sides(join):
            if not (isinstance(x_key, Column) and x_key.source in main_scans):
                continue
            x = x_key.source
            if x in tried or x not in aliases(x_side):
                continue
            if not (isinstance(t_expr, Column) and t_expr.source in main_scans):
                continue
            if t_expr.source not in aliases(t_side):
                continue
            x_scan = main_scans[x]
            consumers = _consumers(root, x)
            if not consumers or any(s.alias in stage_scans for s, _ in consumers):
                continue
            if not any(s.alias == t_expr.source for s, _ in consumers):
                continue  # t is not keyed by x: dynamic_filters' own business
            if projected is None:
                projected = {
                    s.alias: s.projection or () for s in push_projection(root, None).scans()
                }
            tried.add(x)
            out = _flip(root, est, catalog, x_scan, consumers, projected.get(x, ()), deps)
            if out is not None:
                return out
    return None


def _consumers(root: Plan, x: str) -> list[tuple[Scan, DynamicFilter]]:
    """Every scan (pre-scans too) with a dynamic filter whose keys come from ``x``."""
    return [(s, d) for s in all_scans(root) for d in s.dynamic if d.provider == x]


def _pays(est: Estimator, t: Scan, x_scan: Scan) -> bool:
    """Whether ``t`` is expected to keep at most ``MIN_GAIN`` of ``x``'s keys: by the
    estimates (``t``'s rows spread over ``x``'s keys, each key as likely: ``K (1 -
    e^(-n/K))`` distinct of ``K``), or because ``t``'s own filters and ``x``'s compare
    columns with the same session value. Such a pair is correlated (Q3's
    ``o_orderdate < {{session.date}}`` and ``l_shipdate > {{session.date}}``: the
    orders kept are those just before the date, whose lines ship just after it), which
    the independent selectivities of the estimates cannot see."""
    others = [d for d in t.dynamic if d.provider not in (None, x_scan.alias)]
    if not (t.exact or t.inexact or any(not whole_keys(est, d) for d in others)):
        return False  # nothing but x's own keys cuts t: it keeps every one of them
    mine = _params(x_scan)
    if mine & _params(t):
        return True
    k = est.scan_rows(x_scan)
    n = est.scan_rows(t)
    return k > 0 and (1 - math.exp(-n / k)) <= MIN_GAIN


def _params(scan: Scan) -> set[str]:
    return {
        n.name
        for f in (*scan.exact, *scan.inexact)
        for n in f.walk()
        if isinstance(n, Param) and not is_stage_param(n.name)
    }


def _flipped(root: Plan, x: str, deps: dict[str, set[str]]) -> bool:
    """Whether ``x`` already waits on a unit that takes the keys of a pre-scan of ``x``
    (``x#keys...``: this rule's or ``semijoin_reduce``'s): ``x`` is read after its
    consumers already, and flipping it again would only move the pre-scan round."""
    mine = {a for a in deps if a.split("#")[0] == x and a != x}
    return any(reaches(deps, p, m) for p in deps.get(x, ()) for m in mine)


def _keyed_by_prescan_of(x_scan: Scan, consumers: set[str]) -> bool:
    """Whether ``x`` already takes keys from a pre-scan of one of its consumers
    (``semijoin_reduce``: Q8's customers keyed by ``o#keys``): the consumer's filters
    already cut ``x``'s rows."""
    return any(
        isinstance(d, KeyScanFilter)
        and d.prescan is not None
        and d.prescan.alias.split("#")[0] in consumers
        for d in x_scan.dynamic
    )


def _flip(
    root: Plan,
    est: Estimator,
    catalog: Any,
    x_scan: Scan,
    consumers: list[tuple[Scan, DynamicFilter]],
    projection: tuple[str, ...],
    deps: dict[str, set[str]],
) -> Plan | None:
    x = x_scan.alias
    unit = est.units.get(x)
    if unit is None or unit_scan(unit) is not x_scan:
        return None
    if any(isinstance(n, Filter) for n in unit.walk()):
        return None  # a residual filter: the pre-scan's keys would be more than x's
    if x_scan.aggregate is not None or x_scan.limit is not None or x_scan.latest_by:
        return None
    if not _stage_free(x_scan):
        return None
    derived = derived_names(root)
    given: list[str] = []
    for _, d in consumers:
        e = d.from_expr
        if d.op not in _KEYED or d.branches or not isinstance(e, Column) or e.source != x:
            return None
        if e.name not in x_scan.source_schema.names or e.qualified in derived:
            return None
        if e.name not in given:
            given.append(e.name)
    if not set(projection) - set(given):
        return None  # x reads only the keys it gives: a second fetch would read them again
    if not MIN_ROWS <= est.scan_rows(x_scan) <= MAX_ROWS or _flipped(root, x, deps):
        return None
    if _keyed_by_prescan_of(x_scan, {s.alias for s, _ in consumers}):
        return None
    # x waits on every consumer t joined to it that keeps fewer keys than it is given
    main = root.input if isinstance(root, WithStages) else root
    new_filters: list[DynamicFilter] = []
    for join in (n for n in main.walk() if isinstance(n, Join)):
        for t_expr, x_key, t_side, x_side in equi_sides(join):
            if not (isinstance(x_key, Column) and x_key.source == x and x in aliases(x_side)):
                continue
            if not (isinstance(t_expr, Column) and t_expr.source in aliases(t_side)):
                continue
            t_alias = t_expr.source or ""
            t = next((s for s, _ in consumers if s.alias == t_alias), None)
            if t is None or not _stage_free(t) or not _pays(est, t, x_scan):
                continue
            if x_key.name not in x_scan.source_schema.names or x_key.qualified in derived:
                continue
            f = _keyed_by(catalog, x_scan, x_key.name, t_expr)
            if f is not None and f not in new_filters:
                new_filters.append(f)
    if not new_filters:
        return None
    alias = _fresh(x + KEYS, deps)
    prescan = dataclasses.replace(
        x_scan,
        alias=alias,
        projection=tuple(n for n in x_scan.source_schema.names if n in given),
        order_by=(),
        estimated_rows=None,
    )
    prescan = dataclasses.replace(prescan, estimated_rows=int(est.scan_rows(prescan)))

    def redirect(d: DynamicFilter) -> DynamicFilter:
        if d.provider != x:
            return d
        assert isinstance(d.from_expr, Column)
        return KeyScanFilter(
            d.column,
            Column(d.from_expr.name, alias),
            d.max_keys,
            d.range,
            d.op,
            unit=alias,
            prescan=prescan,
        )

    out = map_dynamic(root, redirect)
    x_now = next(s for s in out.scans() if s.alias == x)
    return replace_node(
        out, x_now, dataclasses.replace(x_now, dynamic=(*x_now.dynamic, *new_filters))
    )


def _keyed_by(catalog: Any, x_scan: Scan, column: str, t_expr: Expr) -> DynamicFilter | None:
    """``column in keys(t_expr)`` for ``x_scan``, when its source takes an IN list."""
    if any(d.column == column and d.from_expr == t_expr for d in x_scan.dynamic):
        return None
    probe = InList(Column(column), Param("__dyn_probe"))
    if ask_filter(catalog, x_scan.uri, probe) not in (Pushdown.EXACT, Pushdown.INEXACT):
        return None
    lo, hi = (
        Binary(">=", Column(column), Param("__dyn_lo")),
        Binary("<=", Column(column), Param("__dyn_hi")),
    )
    ranged = all(
        ask_filter(catalog, x_scan.uri, c) in (Pushdown.EXACT, Pushdown.INEXACT) for c in (lo, hi)
    )
    return DynamicFilter(column, t_expr, MAX_KEYS, ranged)


def _fresh(base: str, deps: dict[str, set[str]]) -> str:
    taken = set(deps) | {p for ps in deps.values() for p in ps}
    if base not in taken:
        return base
    n = 2
    while f"{base}{n}" in taken:
        n += 1
    return f"{base}{n}"


__all__ = ["backward_keys"]
