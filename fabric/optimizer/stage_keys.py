"""Key a scan by the join keys of a side computed from stages alone (a semi-join).

``dynamic_filters`` takes keys from a source unit, which runs on the scan pool beside
the scan it keys. A join side made only of stage results (``StageRef`` over
``StageResult``, with Filter / Project / Derive / Sort / Limit above: TPC-H Q15's
``rv`` = revenue0 where total_revenue = top.max_revenue) is no unit: its keys exist only
once the stages ran, so no dynamic filter reached the other side and Q15 read all 1,000
suppliers for 1.

This rule adds a stage holding that side's distinct keys (``__keys_<alias>_<column>``,
run after the binding's stages) and the filter ``column in __keys_...`` to the scan of
the other side's key column (``dynamic_filters._target``: through a grouped stage only
on a group key), which the source applies like any ``x in S`` (``stage:S:list``); the
scan then starts when that stage is done. The join still matches every row, so the
answer is unchanged. Done only when the source takes the filter EXACT, the side is
estimated at most ``MAX_KEYS`` rows and the scanned side at least ``MIN_RATIO`` times
bigger and at least ``MIN_ROWS`` rows (below that, reading it in parallel with the
stages costs less than waiting for them).

    WithStages: revenue0, top                      WithStages: revenue0, top, __keys_rv_supplier_no
      Join: inner on rv.supplier_no = s.s_suppkey    Join: ...
        Scan: s <- postgres://pg/supplier     ->      Scan: s <- ... exact=[s_suppkey in __keys_rv_supplier_no]
        Filter: rv.total_revenue = top.max_revenue    Filter: ...
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Column, InList, Param
from dsl.types import stage_param
from fabric.optimizer._util import aliases, ask_filter, equi_sides, replace_node
from fabric.optimizer.cardinality import Estimator
from fabric.optimizer.dynamic_filters import _target
from fabric.plan.nodes import (
    Derive,
    Filter,
    Join,
    Limit,
    Plan,
    Project,
    Sort,
    Stage,
    StageRef,
    StageResult,
    WithStages,
)

MAX_KEYS = 10_000
MIN_RATIO = 10.0
MIN_ROWS = 500


def stage_keys(plan: Plan, catalog: Any) -> Plan:
    """Add one key stage + scan filter per stage-computed join side (module docstring)."""
    if not isinstance(plan, WithStages):
        return plan
    while True:
        est = Estimator(plan, catalog)
        added = _first(plan, est, catalog)
        if added is None:
            return plan
        plan = added


def _stage_side(node: Plan) -> bool:
    """Whether ``node`` is computed from stage results alone (no source is read)."""
    if isinstance(node, StageResult):
        return True
    if isinstance(node, StageRef | Filter | Project | Derive | Sort | Limit):
        return _stage_side(node.children()[0])
    return False


def _inlined(node: Plan, root: WithStages) -> Plan:
    """``node`` with its StageResult replaced by that stage's plan (for the estimate: a
    StageResult alone has no statistics)."""
    plans = {s.name: s.input for s in root.stages}
    for n in node.walk():
        if isinstance(n, StageResult) and n.name in plans:
            try:
                return replace_node(node, n, plans[n.name])
            except Exception:  # a plan the stage's columns do not fit: estimate without it
                return node
    return node


def _first(root: WithStages, est: Estimator, catalog: Any) -> WithStages | None:
    names = {s.name for s in root.stages}
    for join in root.input.walk():
        if not isinstance(join, Join):
            continue
        for small_expr, key, small, big in equi_sides(join):
            if not (isinstance(small_expr, Column) and isinstance(key, Column)):
                continue
            if small_expr.source not in aliases(small) or not _stage_side(small):
                continue
            if key.source not in aliases(big):
                continue
            out = _try(root, names, small, big, small_expr, key, est, catalog)
            if out is not None:
                return out
    return None


def _try(
    root: WithStages,
    names: set[str],
    small: Plan,
    big: Plan,
    small_expr: Column,
    key: Column,
    est: Estimator,
    catalog: Any,
) -> WithStages | None:
    target = _target(big, key)
    if target is None:
        return None
    scan, column = target
    if column not in scan.source_schema.names:
        return None
    name = f"__keys_{small_expr.source}_{small_expr.name}"
    param = Param(stage_param(name, "list"))
    filt = InList(Column(column), param)
    if name in names and filt in scan.exact:
        return None  # done in an earlier pass
    if name in names:
        name = f"{name}_{len(names)}"  # the same side keying another scan
        param = Param(stage_param(name, "list"))
        filt = InList(Column(column), param)
    keys = est.rows(_inlined(small, root))
    big_rows = est.rows(big, dynamic=False)
    if keys > MAX_KEYS or big_rows < max(MIN_ROWS, MIN_RATIO * keys):
        return None
    if ask_filter(catalog, scan.uri, filt) is not Pushdown.EXACT:
        return None
    typ = small.schema.field(small_expr.qualified).type
    stage = Stage(Project(small, (("key", small_expr, typ),)), name)
    new_scan = dataclasses.replace(scan, exact=(*scan.exact, filt))
    body = replace_node(root.input, scan, new_scan)
    return dataclasses.replace(root, stages=(*root.stages, stage), input=body)
