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
filters + derived columns), which runs first. When the side of ``a`` is too big to key
``b`` but holds an inner equality ``a = c`` (``_equivalents``: through inner joins, same
type), ``b`` takes the keys of ``c`` instead, if they are estimated to keep at most half
of its rows: every row of that side has ``a`` equal to some ``c`` of ``c``'s unit
(TPC-H Q9: partsupp joins lineitem x part on ``ps_partkey = l_partkey``, too many rows
to key it, but ``l_partkey = p_partkey``: 4,300 partsupp rows for 4,299 needed, was
80,000). Keys that can only be a subset of keys the scan already takes (their unit is a
bare scan keyed by the same keys) are not added. Only the inner side of a left join may be
filtered. A filter that would make two sources wait on each other is not added.

The same filter goes into a stage's scan from a correlated ``exists(S where S.k = x.k
and ...)`` / ``not exists`` that is the stage's only use (``_exists_candidate``): the
stage's rows with other keys can never match. ``x``'s unit then runs before the stage's
scan (the physical planner keeps the filter holding the exists out of that unit). That
costs the parallelism of the two, so it is done only for few keys: at most
``EXISTS_SHARE`` of the stage scan's rows, estimated when planning and measured when
running (the filter's ``max_keys``; past it only the keys' range is pushed, if any).

    Join: inner on m.geo_hash = loc.cell
      Derive: loc.cell = geo_hash(loc.lat, loc.lon, 6)
        Scan: loc <- kafka://bus/location_stream latest_by=[user_id] exact=[user_id = {{session.user_id}}]
      Scan: m <- mysql://shop/merchants dynamic=[geo_hash in keys(loc.cell) max=50000 else range]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Binary, Column, Exists, Expr, InList, Param, conjuncts, sources_of
from dsl.types import is_stage_param
from fabric.optimizer._util import (
    aliases,
    ask_filter,
    derived_names,
    equi_sides,
    filters_before_latest,
    replace_node,
)
from fabric.optimizer.cardinality import Estimator, rewrite_to_fixpoint
from fabric.optimizer.semijoin_reduce import all_scans, reaches, unit_deps
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
    StageResult,
    WithStages,
)

SMALL_SIDE = 100_000  # estimated keys; the executor chooses the form on the measured count
MIN_RATIO = 2.0
MAX_KEYS = 50_000
# An exists-stage push makes the stage's scan wait for the outer unit (no longer in
# parallel with it) and holds the exists filter out of that unit, so the outer side's own
# key lists to other sources grow too. It pays only when the keys are few next to the
# scanned side: estimated (plan) and measured (the filter's max_keys, run time) at most
# EXISTS_SHARE of the stage scan's rows. TPC-H SF 0.1 with the Parquet scan in DuckDB:
# Q21 (16,745 of 600,572: 2.8 %) 3.1 s pushed vs 1.7 s not; Q4 (5,552: 0.9 %) 0.73 vs
# 0.62 s; Q22 (6,749 of 150,000) 0.53 vs 0.47 s; Q17/Q2 (18-63 keys) still pushed.
EXISTS_SHARE = 0.005
EXISTS_MIN_KEYS = 256


def dynamic_filters(plan: Plan, catalog: Any) -> Plan:
    """Add DynamicFilters from small join sides into big sides' scans (see module docstring)."""
    return rewrite_to_fixpoint(plan, catalog, _candidate)


def _candidate(plan: Plan, est: Estimator, catalog: Any) -> Plan | None:
    added = _first_candidate(plan, plan, est, catalog)
    return added if added is not None else _exists_candidate(plan, est, catalog)


def _first_candidate(root: Plan, node: Plan, est: Estimator, catalog: Any) -> Plan | None:
    """Add one dynamic filter (innermost joins first) and return the new plan, or None."""
    for child in node.children():
        out = _first_candidate(root, child, est, catalog)
        if out is not None:
            return out
    if not isinstance(node, Join):
        return None
    for small_expr, key, small, big in equi_sides(node):
        if not (sources_of(small_expr) and sources_of(small_expr) <= aliases(small)):
            continue
        if not (isinstance(key, Column) and key.source in aliases(big)):
            continue
        out = _try(root, node, small, big, small_expr, key, est, catalog)
        if out is not None:
            return out
        if not isinstance(small_expr, Column):
            continue
        target = _target(big, key)
        if target is None or any(d.column == target[1] and d.op == "in" for d in target[0].dynamic):
            continue
        # the same values through an inner equality inside the small side (transitive)
        alts = sorted(_equivalents(small, small_expr), key=est.keys_estimate)
        for alt in alts:
            out = _try(root, node, small, big, alt, key, est, catalog, must_reduce=True)
            if out is not None:
                return out
    return None


def _equivalents(side: Plan, col: Column) -> list[Column]:
    """Columns of ``side`` equal to ``col`` in every row of ``side``, through the
    ``a = b`` conjuncts of the inner joins inside it (below Filter / Derive / Sort and
    inner joins only: an outer join's unmatched rows break the equality, and a stage's
    select or an aggregate renames); the same Arrow type as ``col``, not derived."""
    pairs: list[tuple[Column, Column]] = []

    def visit(node: Plan) -> None:
        if isinstance(node, Filter | Derive | Sort):
            visit(node.input)
        elif isinstance(node, Join):
            if node.how == "inner":
                for c in conjuncts(node.on):
                    if (
                        isinstance(c, Binary)
                        and c.op == "="
                        and isinstance(c.left, Column)
                        and isinstance(c.right, Column)
                    ):
                        pairs.append((c.left, c.right))
            visit(node.left)
            visit(node.right)

    visit(side)
    names = set(side.schema.names)
    if col.qualified not in names:
        return []
    typ = side.schema.field(col.qualified).type
    derived = derived_names(side)
    found, todo = {col}, [col]
    while todo:
        x = todo.pop()
        for a, b in pairs:
            for u, v in ((a, b), (b, a)):
                if u == x and v not in found:
                    found.add(v)
                    todo.append(v)
    return [
        c
        for c in found
        if c != col
        and c.source is not None
        and c.qualified in names
        and c.qualified not in derived
        and side.schema.field(c.qualified).type == typ
    ]


def _exists_candidate(root: Plan, est: Estimator, catalog: Any) -> Plan | None:
    """Add one dynamic filter from the outer side of a correlated ``exists(S where
    S.k = x.k and ...)`` (or ``not exists``) into the scan of ``S.k`` inside stage ``S``:
    the stage's rows whose ``k`` is not among the keys of ``x.k`` can never match, so
    either answer is unchanged. Only when that exists is the stage's one use, ``S.k``
    reaches a scan column (through a grouped stage only on a group key: ``_target``) and
    the unit of ``x`` cannot wait on a stage (it runs before the stage then; the physical
    planner leaves the filter with the exists out of that unit)."""
    if not isinstance(root, WithStages):
        return None
    by_name = {s.name: s for s in root.stages}
    uses: dict[str, list[Exists]] = {}
    other: set[str] = set()
    for node in root.walk():
        if isinstance(node, StageResult):
            other.add(node.name)
        for e in _exprs(node):
            for x in e.walk():
                if isinstance(x, Exists):
                    uses.setdefault(x.stage, []).append(x)
            other |= _stage_params(e)
    scans = {s.alias: s for s in root.scans()}
    for name, found in uses.items():
        stage = by_name.get(name)
        if stage is None or name in other or len(found) != 1 or found[0].where is None:
            continue
        for c in conjuncts(found[0].where):
            if not (isinstance(c, Binary) and c.op == "="):
                continue
            for inner, outer in ((c.left, c.right), (c.right, c.left)):
                if not (isinstance(inner, Column) and inner.source == name):
                    continue
                if not (isinstance(outer, Column) and outer.source in scans):
                    continue
                if outer.source in aliases(stage.input) or not _stage_free(
                    root, outer.source, name
                ):
                    continue
                if outer.qualified in derived_names(root):
                    continue
                if outer.name not in scans[outer.source].source_schema.names:
                    continue
                out = _try(
                    root,
                    None,
                    None,
                    stage.input,
                    outer,
                    Column(inner.name),
                    est,
                    catalog,
                    share=EXISTS_SHARE,
                )
                if out is not None:
                    return out
    return None


def _exprs(node: Plan) -> list[Expr]:
    """The expressions a node holds (filters, items, keys, a scan's pushed filters)."""
    out: list[Expr] = []
    for f in dataclasses.fields(node):
        v = getattr(node, f.name)
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, Expr):
                out.append(x)
            elif isinstance(x, tuple):
                out.extend(y for y in x if isinstance(y, Expr))
            elif dataclasses.is_dataclass(x) and not isinstance(x, Plan | type):
                out.extend(getattr(x, g.name) for g in dataclasses.fields(x))
    return [e for e in out if isinstance(e, Expr)]


def _stage_free(root: WithStages, alias: str, stage: str) -> bool:
    """Whether the unit of ``alias`` and the units it takes dynamic keys from (transitively)
    can all run before ``stage``: their scans and Filter / Derive chains use only the
    values of stages before it, and ``exists`` only of ``stage`` or of a stage that already
    takes keys from that unit (the physical planner leaves those filters out of it)."""
    order = [s.name for s in root.stages]
    before = set(order[: order.index(stage)])
    scans = {s.alias: s for s in all_scans(root)}
    chains: dict[str, list[Plan]] = {}
    for node in root.walk():
        chain: list[Plan] = []
        leaf = node
        while isinstance(leaf, Filter | Derive):
            chain.append(leaf)
            leaf = leaf.input
        if isinstance(leaf, Scan) and chain and len(chain) > len(chains.get(leaf.alias, [])):
            chains[leaf.alias] = chain
    seen, todo = set(), [alias]
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        scan = scans.get(a)
        if scan is None:
            return False
        for e in (*scan.exact, *scan.inexact):
            if not _stage_params(e) <= before or any(isinstance(x, Exists) for x in e.walk()):
                return False
        chain = chains.get(a, [])
        # the planner runs above the unit every chain node from the lowest one using a
        # stage that waits on this unit (once this filter is added: ``stage``) upwards
        cut = [
            i
            for i, x in enumerate(chain)
            if any(t == stage or a in _waits(root, t) for e in _exprs(x) for t in _stage_refs(e))
        ]
        for x in chain[max(cut) + 1 :] if cut else chain:
            for e in _exprs(x):
                if not _stage_params(e) <= before or any(isinstance(y, Exists) for y in e.walk()):
                    return False
        todo.extend(d.provider for d in scan.dynamic if d.provider)
    return True


def _stage_params(e: Expr) -> set[str]:
    """The stages whose values (``stage:S...`` parameters) ``e`` uses."""
    return {
        x.name[len("stage:") :].split(":")[0].split(".")[0]
        for x in e.walk()
        if isinstance(x, Param) and is_stage_param(x.name)
    }


def _stage_refs(e: Expr) -> set[str]:
    return _stage_params(e) | {x.stage for x in e.walk() if isinstance(x, Exists)}


def _waits(root: WithStages, stage: str) -> set[str]:
    """The aliases whose units the scans of ``stage`` take dynamic keys from (transitively)."""
    deps = unit_deps(root)
    seen: set[str] = set()
    todo = [d for st in root.stages if st.name == stage for s in st.scans() for d in deps[s.alias]]
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo.extend(deps.get(a, ()))
    return seen


def _try(
    root: Plan,
    join: Join | None,
    small: Plan | None,
    big: Plan,
    from_expr: Expr,
    key: Column,
    est: Estimator,
    catalog: Any,
    share: float | None = None,
    must_reduce: bool = False,
) -> Plan | None:
    """Add ``key in keys(from_expr)`` to the scan of ``key`` below ``big``; with ``share``
    only when the estimated keys are at most that share of ``big``'s rows, and pushed at
    run time only up to that many measured keys (``max_keys``); with ``must_reduce`` only
    when the keys are estimated to keep at most half of the scan's rows."""
    if len(sources_of(from_expr)) != 1:
        return None
    from_alias = next(iter(sources_of(from_expr)))
    target = _target(big, key)
    if target is None:
        return None
    scan, column = target
    if column not in scan.source_schema.names:
        return None
    if any(d.column == column and d.from_expr == from_expr and d.op == "in" for d in scan.dynamic):
        return None
    keys = est.keys_estimate(from_expr)
    small_rows = keys  # the keys come from the source unit of from_expr
    big_rows = est.rows(big, dynamic=False)
    if small_rows > SMALL_SIDE or big_rows < MIN_RATIO * small_rows:
        return None
    max_keys = MAX_KEYS
    if share is not None:
        max_keys = min(MAX_KEYS, max(EXISTS_MIN_KEYS, int(share * big_rows)))
        if small_rows > max_keys:
            return None
    if _depends_on(root, from_alias, scan.alias):
        return None
    if _subset_of_pushed(est, from_expr, scan, column):
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
        scan, dynamic=(*scan.dynamic, DynamicFilter(column, from_expr, max_keys, ranged))
    )
    if must_reduce and est.scan_rows(new_scan) > 0.5 * est.scan_rows(scan):
        return None
    return replace_node(root, scan, new_scan)


def _subset_of_pushed(est: Estimator, from_expr: Expr, scan: Scan, column: str) -> bool:
    """Whether the keys of ``from_expr`` can only be a subset of keys ``scan`` already
    takes on ``column``: ``from_expr`` is a column of a bare scan (no filter of its own)
    that is itself keyed by those same keys (c2 keyed by k's skus: o, keyed by k's skus,
    gains nothing from c2's, and would wait for c2)."""
    if not isinstance(from_expr, Column):
        return False
    unit = est.units.get(from_expr.source or "")
    if not isinstance(unit, Scan) or unit.exact or unit.inexact:
        return False
    mine = {d.from_expr for d in scan.dynamic if d.column == column and d.op == "in"}
    return any(
        d.column == from_expr.name and d.op == "in" and d.from_expr in mine for d in unit.dynamic
    )


def _target(big: Plan, key: Column) -> tuple[Scan, str] | None:
    """The Scan of ``key.source`` reachable without crossing a row-changing operator,
    with ``key`` a base column of it (not a derived one), and that column's name.

    Inside a stage used as a source (``StageRef``) the key is followed through the
    stage's select to a group_by column of its aggregate and below: keeping only some
    groups' input rows leaves those groups' results unchanged (a correlated scalar
    subquery written as a grouped stage then reads only the groups it is joined to).
    Into a ``latest_by`` scan only on one of its key columns: a filter on another column
    is applied before the newest row per key is kept, so it would pick an older row
    (``loc.level < u.cap`` pushed as ``level <= max(cap)`` kept each user's older level 1
    for a newest level 100 that fails the join)."""
    node: Plan = big
    while True:
        if key.qualified in derived_names(node):
            return None
        if isinstance(node, Scan):
            if node.aggregate is not None and not any(
                e == key for _, e, _ in node.aggregate.group_by
            ):
                return None  # aggregated at the source: only a group key filters its input
            if not filters_before_latest(node, {key.name}):
                # the source filters before it keeps the newest row per key: a filter on
                # another column would keep an older row instead of dropping the key
                return None
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
    return reaches(unit_deps(root), alias, target)
