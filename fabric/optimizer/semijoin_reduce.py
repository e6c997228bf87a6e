"""Break a cycle of dynamic filters with a key-only pre-scan (semi-join reduction).

``dynamic_filters`` gives each scan one fetch, so of two selective sources joined on
``t.b = x.a`` only one can take the other's keys: when ``x`` already waits (directly
or through other units) for ``t``'s keys, ``t`` cannot wait for ``x``'s, and ``t``
reads every row its other filters keep. Bernstein and Chiu's semi-join reduction breaks
that cycle with a second, narrower fetch of ``x``: a *key-only pre-scan* ``x#keys``
reading only column ``a`` of ``x``'s source, with ``x``'s own pushed filters and those
of its dynamic filters that do not wait on ``t`` (so nothing waits on itself). ``t``
then takes ``b in keys(x#keys.a)``, and ``x`` still takes ``t``'s keys as before
(TPC-H Q7: orders' keys of the two nations' customers, 11,730 of them, reduce lineitem
from 15,631 rows to about 1,200 for 643 needed; orders, keyed by those, read 601).

The pre-scan goes through the same scan path as any unit (the same pushed filters,
bound parameters, the same dynamic filters), so its keys are a superset of the keys of
``x``'s rows in the join (it lacks only filters, never adds one), and the join
re-checks every key: the answer is unchanged. Only the inner side of a left join is
keyed (``equi_sides``); ``x`` must be a plain scan (no aggregate, limit or latest_by)
whose filters use no stage, ``a`` one of its source columns.

Chosen when it pays by the estimates: the pre-scan's keys at most ``SMALL_SIDE``, and
``t``'s estimated rows, scaled by the share of ``b``'s domain the keys cover (the
filters independent: ``Estimator.scan_rows`` keeps only the smallest), falling to at
most ``MIN_GAIN`` of what they were and by more rows than ``KEY_COST`` per key read.
At run time the measured key count decides the form as for every dynamic filter (an
IN list up to ``max_keys``, else the keys' range, else nothing).

    Scan: l <- s3://lake/lineitem/ dynamic=[l_suppkey in keys(s.s_suppkey) max=50000
      else range, l_orderkey in keys(o#keys.o_orderkey) max=50000 else range <- key-only
      scan (o#keys <- mysql://tpch/orders projection=[o_orderkey] exact=[...]
      dynamic=[o_custkey in keys(c.c_custkey) ...])]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from connectors.base import Pushdown
from dsl.ast import Binary, Column, Exists, InList, Param
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
from fabric.plan.nodes import DynamicFilter, Join, Plan, Scan, WithStages

KEYS = "#keys"
SMALL_SIDE = 100_000  # estimated keys of the pre-scan
MAX_KEYS = 50_000
MIN_GAIN = 0.5  # the keyed scan must keep at most this share of its estimated rows
KEY_COST = 0.5  # rows of the keyed scan saved per key the pre-scan reads, at least


@dataclass(frozen=True)
class KeyScanFilter(DynamicFilter):
    """A dynamic filter whose keys come from ``prescan``: a key-only scan of another
    source (projection: the key column), run as its own source unit (alias
    ``<x>#keys``) before the scan holding this filter."""

    prescan: Scan | None = None

    def __str__(self) -> str:
        more = " else range" if self.range else ""
        head = f"{self.column} in keys({self.from_expr}) max={self.max_keys}{more}"
        if self.prescan is None:
            return head
        return f"{head} <- key-only scan ({self.prescan.header().removeprefix('Scan: ')})"


def prescans(scan: Scan) -> list[Scan]:
    """The key-only pre-scans ``scan``'s dynamic filters take keys from (and theirs)."""
    out: list[Scan] = []
    for d in scan.dynamic:
        pre = getattr(d, "prescan", None)
        if isinstance(pre, Scan):
            out.append(pre)
            out.extend(prescans(pre))
    return out


def all_scans(plan: Plan) -> list[Scan]:
    """``plan.scans()`` and the key-only pre-scans their dynamic filters run."""
    out: list[Scan] = []
    for s in plan.scans():
        out.append(s)
        out.extend(prescans(s))
    return out


def map_dynamic(root: Plan, fn: Any) -> Plan:
    """``root`` with ``fn`` applied to every dynamic filter of every scan, key-only
    pre-scans (nested in dynamic filters) included; ``fn`` returning None drops it."""
    memo: dict[int, Scan] = {}

    def scan(s: Scan) -> Scan:
        if id(s) in memo:
            return memo[id(s)]
        dyn = []
        for d in s.dynamic:
            if isinstance(d, KeyScanFilter) and d.prescan is not None:
                new_pre = scan(d.prescan)
                if new_pre is not d.prescan:
                    d = dataclasses.replace(d, prescan=new_pre)
            e = fn(d)
            if e is not None:
                dyn.append(e)
        same = len(dyn) == len(s.dynamic) and all(a is b for a, b in zip(dyn, s.dynamic))
        out = s if same else dataclasses.replace(s, dynamic=tuple(dyn))
        memo[id(s)] = out
        return out

    out = root
    for s in root.scans():
        new = scan(s)
        if new is not s:
            out = replace_node(out, s, new)
    return out


def unit_deps(plan: Plan) -> dict[str, set[str]]:
    """alias -> the aliases of the units its dynamic filters wait for (pre-scans too)."""
    return {s.alias: {d.provider for d in s.dynamic if d.provider} for s in all_scans(plan)}


def reaches(deps: dict[str, set[str]], alias: str, target: str) -> bool:
    """Whether the unit of ``alias`` waits (transitively) on ``target``."""
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


def semijoin_reduce(plan: Plan, catalog: Any) -> Plan:
    """Add key-only pre-scans where they break a cycle and pay (module docstring)."""
    return rewrite_to_fixpoint(plan, catalog, _candidate)


def _candidate(root: Plan, est: Estimator, catalog: Any) -> Plan | None:
    main = root.input if isinstance(root, WithStages) else root
    joins = [n for n in main.walk() if isinstance(n, Join)]
    for join in reversed(joins):  # innermost first
        for small_expr, key, small, big in equi_sides(join):
            if not (isinstance(small_expr, Column) and small_expr.source in aliases(small)):
                continue
            if not (isinstance(key, Column) and key.source in aliases(big)):
                continue
            out = _try(root, big, small_expr, key, est, catalog)
            if out is not None:
                return out
    return None


def _try(
    root: Plan, big: Plan, x_col: Column, key: Column, est: Estimator, catalog: Any
) -> Plan | None:
    from fabric.optimizer.dynamic_filters import _target

    target = _target(big, key)
    if target is None:
        return None
    t_scan, column = target
    if column not in t_scan.source_schema.names or t_scan.aggregate is not None:
        return None
    x = x_col.source or ""
    unit = est.units.get(x)
    if unit is None:
        return None
    x_scan = unit_scan(unit)
    if not isinstance(x_scan, Scan) or x_scan.alias != x:
        return None
    if x_scan.aggregate is not None or x_scan.limit is not None or x_scan.latest_by:
        return None
    if x_col.name not in x_scan.source_schema.names or x_col.qualified in derived_names(root):
        return None
    if not _stage_free(x_scan):
        return None
    deps = unit_deps(root)
    if not reaches(deps, x, t_scan.alias):
        return None  # no cycle: dynamic_filters' own business
    for d in t_scan.dynamic:
        pre = getattr(d, "prescan", None)
        mine = d.provider == x or (isinstance(pre, Scan) and pre.alias.split("#")[0] == x)
        if d.column == column and d.op == "in" and mine:
            return None
    kept = tuple(
        d
        for d in x_scan.dynamic
        if d.provider and d.provider != t_scan.alias and not reaches(deps, d.provider, t_scan.alias)
    )
    alias = _fresh(x + KEYS, deps)
    prescan = dataclasses.replace(
        x_scan,
        alias=alias,
        projection=(x_col.name,),
        dynamic=kept,
        order_by=(),
        estimated_rows=None,
    )
    read = est.scan_rows(prescan)
    prescan = dataclasses.replace(prescan, estimated_rows=int(read))
    keys = min(read, float(est.ndv(x_col) or read))  # distinct keys
    if keys > SMALL_SIDE:
        return None
    before = est.scan_rows(t_scan)
    domain = est.key_domain(x_col) or est.ndv(Column(column, t_scan.alias))
    if not domain:
        return None
    after = before * min(1.0, keys / domain)
    if after > MIN_GAIN * before or before - after < KEY_COST * read:
        return None
    probe = InList(Column(column), Param("__dyn_probe"))
    if ask_filter(catalog, t_scan.uri, probe) not in (Pushdown.EXACT, Pushdown.INEXACT):
        return None
    lo, hi = (
        Binary(">=", Column(column), Param("__dyn_lo")),
        Binary("<=", Column(column), Param("__dyn_hi")),
    )
    ranged = all(
        ask_filter(catalog, t_scan.uri, c) in (Pushdown.EXACT, Pushdown.INEXACT) for c in (lo, hi)
    )
    f = KeyScanFilter(
        column, Column(x_col.name, alias), MAX_KEYS, ranged, unit=alias, prescan=prescan
    )
    return replace_node(root, t_scan, dataclasses.replace(t_scan, dynamic=(*t_scan.dynamic, f)))


def _stage_free(scan: Scan) -> bool:
    """Whether ``scan``'s pushed filters use no stage's values and no ``exists``."""
    for e in (*scan.exact, *scan.inexact):
        for n in e.walk():
            if isinstance(n, Exists) or (isinstance(n, Param) and is_stage_param(n.name)):
                return False
    return True


def _fresh(base: str, deps: dict[str, set[str]]) -> str:
    taken = set(deps) | {p for ps in deps.values() for p in ps}
    if base not in taken:
        return base
    n = 2
    while f"{base}{n}" in taken:
        n += 1
    return f"{base}{n}"
