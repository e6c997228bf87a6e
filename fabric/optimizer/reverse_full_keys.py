"""Keys that are every value of a table filter nothing: reverse them.

``dynamic_filters`` keys the big side ``t`` of ``t.b = x.a`` by the small side ``x``
when ``x`` is estimated small. When ``x`` reads its whole table (no filter of its own,
and its own dynamic filters' keys are whole tables' too: TPC-H Q8's suppliers, keyed by
all 25 nations), ``t.b in keys(x.a)`` sends every value of ``x.a`` and keeps every
row of ``t`` whose ``b`` is a key of ``x``: ``t`` reads what it reads without it, plus the
cost of the list (1,000 supplier keys into every lineitem read). This rule drops that
filter (from every scan keyed by that column, key-only pre-scans too) where ``t`` keeps
fewer rows than its whole table (a filter or another source's keys of its own) and ``x``
may be keyed by ``t`` (``equi_sides``: not the preserved side of a left join), and keys
``x`` by ``t`` instead: ``x.a in keys(t.b)``, ``x`` read after
``t``. Q8: lineitem, keyed by part's 147 keys and orders' 280, reads 282 rows; the
suppliers, keyed by those rows' supplier keys, read 210 rows for 210 (was 1,000).

Dropping a dynamic filter only adds rows to the scan it left (a superset, and the join
re-checks every key); the filter added reads a subset of ``x`` holding every row the
join keeps: the answer is unchanged. ``t`` must not wait on ``x`` through
another filter (no cycle), nor ``x`` be ``latest_by``, aggregated, limited, derive the key
or filter it above the scan.

    Scan: s <- postgres://pg/supplier projection=[s_suppkey, s_nationkey]
      dynamic=[s_nationkey in keys(n2.n_nationkey) ..., s_suppkey in keys(l.l_suppkey) ...]
    Scan: l <- s3://lake/lineitem/ dynamic=[l_orderkey in keys(o.o_orderkey) ...,
      l_partkey in keys(p.p_partkey) ...]                       (no l_suppkey in keys(s...))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Binary, Column, InList, Param
from fabric.optimizer._util import (
    aliases,
    ask_filter,
    derived_names,
    equi_sides,
    replace_node,
    unit_scan,
)
from fabric.optimizer.cardinality import Estimator, rewrite_to_fixpoint
from fabric.optimizer.semijoin_reduce import _stage_free, map_dynamic, reaches, unit_deps
from fabric.plan.nodes import DynamicFilter, Filter, Join, Plan, Scan, WithStages

MAX_KEYS = 50_000
MIN_ROWS = 1_000  # x's table: smaller ones are read whole sooner than waited for


def reverse_full_keys(plan: Plan, catalog: Any) -> Plan:
    """Drop dynamic filters whose keys are a whole table's, keying that table instead
    (module docstring)."""
    return rewrite_to_fixpoint(plan, catalog, _candidate)


def _candidate(root: Plan, est: Estimator, catalog: Any) -> Plan | None:
    main = root.input if isinstance(root, WithStages) else root
    scans = {s.alias: s for s in main.scans()}
    for t in main.scans():
        for d in t.dynamic:
            if type(d) is not DynamicFilter or d.op != "in" or not isinstance(d.from_expr, Column):
                continue
            col = d.from_expr
            x_scan = scans.get(col.source or "")
            if x_scan is None or not _whole(est, x_scan, col):
                continue
            if (est.stats(x_scan.uri).row_count or 0) < MIN_ROWS:
                continue  # a small table costs less to read whole than a round trip

            def drop(e: DynamicFilter, col: Column = col) -> DynamicFilter | None:
                # every scan keyed by x's whole column (pre-scans too) reads without it
                same = type(e) is DynamicFilter and e.op == "in" and e.from_expr == col
                return None if same else e

            out = _key_x(map_dynamic(root, drop), est, catalog, x_scan.alias, t.alias, d.column)
            if out is not None:
                return out
    return None


def whole_keys(est: Estimator, d: DynamicFilter) -> bool:
    """Whether the keys of dynamic filter ``d`` are every value of a whole table's column
    (``_whole``): such a filter cuts nothing."""
    if type(d) is not DynamicFilter or d.op != "in" or not isinstance(d.from_expr, Column):
        return False
    unit = est.units.get(d.from_expr.source or "")
    scan = unit_scan(unit) if unit is not None else None
    return isinstance(scan, Scan) and _whole(est, scan, d.from_expr)


def _whole(est: Estimator, x_scan: Scan, col: Column) -> bool:
    """Whether ``x``'s unit gives every value of its column ``col`` that the table holds:
    a plain scan with no filter of its own (pushed or in its unit), whose dynamic filters
    all take keys from such whole scans (by structure, not by the estimates: a filter
    estimated to keep everything may keep a fifth, as TPC-H Q5's customers of 5 nations)."""
    unit = est.units.get(x_scan.alias)
    if unit is None or unit_scan(unit) is not x_scan:
        return False
    if any(isinstance(n, Filter) for n in unit.walk()):
        return False
    if x_scan.aggregate is not None or x_scan.limit is not None or x_scan.latest_by:
        return False
    if x_scan.exact or x_scan.inexact or col.name not in x_scan.source_schema.names:
        return False
    return all(whole_keys(est, d) for d in x_scan.dynamic)


def _key_x(root: Plan, est: Estimator, catalog: Any, x: str, t: str, t_col: str) -> Plan | None:
    """``root`` with ``x`` keyed by ``t``'s rows on a join ``x.a = t.b``, where ``t`` keeps
    fewer rows than its table, ``x`` may be keyed by it and nothing makes a cycle."""
    main = root.input if isinstance(root, WithStages) else root
    scans = {s.alias: s for s in main.scans()}
    x_scan, t_scan = scans[x], scans[t]
    if not _stage_free(x_scan) or not _stage_free(t_scan):
        return None
    if not (
        t_scan.exact
        or t_scan.inexact
        or any(d.provider not in (None, x) and not whole_keys(est, d) for d in t_scan.dynamic)
    ):
        return None  # t reads its whole table too: its keys cut nothing
    if reaches(unit_deps(root), t, x):
        return None
    derived = derived_names(root)
    for join in (n for n in main.walk() if isinstance(n, Join)):
        for t_expr, x_key, t_side, x_side in equi_sides(join):
            if not (isinstance(t_expr, Column) and t_expr.source == t and t_expr.name == t_col):
                continue
            if not (isinstance(x_key, Column) and x_key.source == x and x in aliases(x_side)):
                continue
            if t not in aliases(t_side) or x_key.qualified in derived:
                continue
            if x_key.name not in x_scan.source_schema.names:
                continue
            if any(d.column == x_key.name and d.from_expr == t_expr for d in x_scan.dynamic):
                return None
            probe = InList(Column(x_key.name), Param("__dyn_probe"))
            if ask_filter(catalog, x_scan.uri, probe) not in (Pushdown.EXACT, Pushdown.INEXACT):
                return None
            lo, hi = (
                Binary(">=", Column(x_key.name), Param("__dyn_lo")),
                Binary("<=", Column(x_key.name), Param("__dyn_hi")),
            )
            ranged = all(
                ask_filter(catalog, x_scan.uri, c) in (Pushdown.EXACT, Pushdown.INEXACT)
                for c in (lo, hi)
            )
            f = DynamicFilter(x_key.name, t_expr, MAX_KEYS, ranged)
            return replace_node(
                root, x_scan, dataclasses.replace(x_scan, dynamic=(*x_scan.dynamic, f))
            )
    return None


__all__ = ["reverse_full_keys"]
