"""Push the join keys of a small side into the big side's scan, at run time.

For an equi-join ``a = b`` where the side providing ``a`` is estimated small (at most
``SMALL_SIDE`` rows: an equality on a session value or key, ``latest_by`` per key, or a
small table) and the other side is at least ``MIN_RATIO`` times bigger, the Scan that
reads ``b`` gets ``DynamicFilter(b, a, max_keys)``: the executor scans the small side
first, collects the distinct values of ``a`` and sends them to the big source as a
bound ``b in (...)`` list when there are at most ``max_keys`` of them. With more keys, and
when the big source accepts ``b >= $lo and b <= $hi``, the range of the keys is pushed
instead (a key list in a narrow range, e.g. orders of one month, still prunes most rows);
otherwise the push is skipped and the join alone filters. The choice is made on the
measured key count, not the estimate. The big source must support an ``in`` filter on
``b`` (EXACT or INEXACT: the join re-checks every key either way).

``a`` must come from a single source; its keys are read from that source's unit (scan +
filters + derived columns), which runs first. Only the inner side of a left join may be
filtered. A filter that would make two sources wait on each other is not added.

    Join: inner on m.geo_hash = loc.cell
      Derive: loc.cell = geo_hash(loc.lat, loc.lon, 6)
        Scan: loc <- kafka://bus/location_stream latest_by=[user_id] exact=[user_id = {{session.user_id}}]
      Scan: m <- mysql://shop/merchants dynamic=[geo_hash in keys(loc.cell) max=50000 else range]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Binary, Column, Expr, InList, Param, conjuncts, sources_of
from fabric.optimizer._util import aliases, ask_filter, derived_names, replace_node
from fabric.optimizer.cardinality import Estimator
from fabric.plan.nodes import (
    Aggregate,
    Derive,
    DynamicFilter,
    Filter,
    Join,
    Plan,
    Project,
    Scan,
    Sort,
    StageRef,
)

SMALL_SIDE = 100_000  # estimated keys; the executor chooses the form on the measured count
MIN_RATIO = 2.0
MAX_KEYS = 50_000


def dynamic_filters(plan: Plan, catalog: Any) -> Plan:
    """Add DynamicFilters from small join sides into big sides' scans (see module docstring)."""
    while True:
        est = Estimator(plan, catalog)
        added = _first_candidate(plan, plan, est, catalog)
        if added is None:
            return plan
        plan = added


def _first_candidate(root: Plan, node: Plan, est: Estimator, catalog: Any) -> Plan | None:
    """Add one dynamic filter (innermost joins first) and return the new plan, or None."""
    for child in node.children():
        out = _first_candidate(root, child, est, catalog)
        if out is not None:
            return out
    if not isinstance(node, Join):
        return None
    for c in conjuncts(node.on):
        if not (isinstance(c, Binary) and c.op == "="):
            continue
        for small_expr, key in ((c.left, c.right), (c.right, c.left)):
            for small, big, big_is_right in (
                (node.left, node.right, True),
                (node.right, node.left, False),
            ):
                if not big_is_right and node.how != "inner":
                    continue
                if not (sources_of(small_expr) and sources_of(small_expr) <= aliases(small)):
                    continue
                if not (isinstance(key, Column) and key.source in aliases(big)):
                    continue
                out = _try(root, node, small, big, small_expr, key, est, catalog)
                if out is not None:
                    return out
    return None


def _try(
    root: Plan,
    join: Join,
    small: Plan,
    big: Plan,
    from_expr: Expr,
    key: Column,
    est: Estimator,
    catalog: Any,
) -> Plan | None:
    if len(sources_of(from_expr)) != 1:
        return None
    from_alias = next(iter(sources_of(from_expr)))
    target = _target(big, key)
    if target is None:
        return None
    scan, column = target
    if column not in scan.source_schema.names:
        return None
    if any(d.column == column and d.from_expr == from_expr for d in scan.dynamic):
        return None
    keys = est.keys_estimate(from_expr)
    small_rows = keys  # the keys come from the source unit of from_expr
    big_rows = est.rows(big, dynamic=False)
    if small_rows > SMALL_SIDE or big_rows < MIN_RATIO * small_rows:
        return None
    if _depends_on(root, from_alias, scan.alias):
        return None
    probe = InList(Column(column), Param("__dyn_probe"))
    if ask_filter(catalog, scan.uri, probe) not in (Pushdown.EXACT, Pushdown.INEXACT):
        return None
    lo, hi = (
        Binary(">=", Column(column), Param("__dyn_lo")),
        Binary("<=", Column(column), Param("__dyn_hi")),
    )
    ranged = all(
        ask_filter(catalog, scan.uri, c) in (Pushdown.EXACT, Pushdown.INEXACT) for c in (lo, hi)
    )
    new_scan = dataclasses.replace(
        scan, dynamic=(*scan.dynamic, DynamicFilter(column, from_expr, MAX_KEYS, ranged))
    )
    return replace_node(root, scan, new_scan)


def _target(big: Plan, key: Column) -> tuple[Scan, str] | None:
    """The Scan of ``key.source`` reachable without crossing a row-changing operator,
    with ``key`` a base column of it (not a derived one), and that column's name.

    Inside a stage used as a source (``StageRef``) the key is followed through the
    stage's select to a group_by column of its aggregate and below: keeping only some
    groups' input rows leaves those groups' results unchanged (a correlated scalar
    subquery written as a grouped stage then reads only the groups it is joined to)."""
    node: Plan = big
    while True:
        if key.qualified in derived_names(node):
            return None
        if isinstance(node, Scan):
            return (node, key.name) if node.alias == key.source else None
        if isinstance(node, StageRef):
            if key.source != node.alias:
                return None
            key = Column(key.name, None)  # a name of the stage's output
            node = node.input
            continue
        if isinstance(node, Project) and key.source is None:
            hit = next((e for n, e, _ in node.items if n == key.name), None)
            if not isinstance(hit, Column) or hit.source is None:
                return None
            key, node = hit, node.input
            continue
        if isinstance(node, Aggregate):
            if not any(e == key for _, e, _ in node.group_by):
                return None
            node = node.input
            continue
        if key.source is None:
            return None
        if isinstance(node, Filter | Derive | Sort):
            node = node.input
        elif isinstance(node, Join):
            if key.source in aliases(node.left):
                node = node.left
            elif node.how == "inner":
                node = node.right
            else:
                return None
        else:
            return None


def _depends_on(root: Plan, alias: str, target: str) -> bool:
    """Whether the scan of ``alias`` waits (transitively) on ``target``'s keys."""
    deps: dict[str, set[str]] = {}
    for s in root.scans():
        deps[s.alias] = {src for d in s.dynamic for src in sources_of(d.from_expr)}
    seen, todo = set(), [alias]
    while todo:
        a = todo.pop()
        if a == target:
            return True
        if a in seen:
            continue
        seen.add(a)
        todo.extend(deps.get(a, ()))
    return False
