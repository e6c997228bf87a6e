"""Push a whole Aggregate (GROUP BY + aggregates) into the one Scan below it.

When an Aggregate reads a Scan directly (every filter pushed into it, EXACT; no
residual Filter, Derive or Join in between), and the source can aggregate
(``Capability.AGGREGATE`` and ``supports_aggregate`` accepts the unqualified
aggregation), the Scan takes the aggregate: it returns one row per group instead of
every row (TPC-H Q1: 4 rows instead of 592k leave DuckDB's Parquet reader; a SQL source
answers with GROUP BY in its statement). The Scan's output is the Aggregate's (same
names and types), so the nodes above are unchanged; its projection is the columns the
aggregate reads.

Only what every engine computes alike is pushed: group keys are plain columns of the
scan; each aggregate is ``sum``, ``count``, ``avg``, ``min`` or ``max`` (not distinct)
of columns, literals and session values under ``+ - *`` and unary minus (``count(*)``
too). The source then decides per aggregation (a SQL server's ``avg`` or ``/`` would not
give DuckDB's DECIMAL/double answer, so it declines them). An aggregate without group
keys is not pushed into a scan with dynamic filters (no keys skips the scan, and that
must still give one row).

    Aggregate: group_by=[l.f] aggregates=[sum(l.q) as s]        Scan: l <- s3://lake/li/
      Scan: l <- s3://lake/li/ exact=[d <= {{session.d}}]  ->      projection=[f, q] exact=[...]
                                                                   aggregate=(group_by=[l.f] ...)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from connectors.base import Aggregation, Capability
from dsl.ast import Binary, Call, Column, Expr, Literal, Param, Star, Unary, unqualify
from fabric.optimizer._util import capabilities, source_of
from fabric.plan.nodes import Aggregate, Plan, Scan

PUSHED = ("sum", "count", "avg", "min", "max")


def push_aggregate(plan: Plan, catalog: Any) -> Plan:
    """Replace ``Aggregate(Scan)`` by the Scan with the aggregate (see module docstring)."""
    children = plan.children()
    if children:
        new = tuple(push_aggregate(c, catalog) for c in children)
        if not all(a is b for a, b in zip(new, children)):
            plan = plan.with_children(*new)
    if isinstance(plan, Aggregate) and isinstance(plan.input, Scan):
        pushed = _push(plan, plan.input, catalog)
        if pushed is not None:
            return pushed
    return plan


def _push(agg: Aggregate, scan: Scan, catalog: Any) -> Scan | None:
    if scan.aggregate is not None or scan.inexact or scan.limit is not None:
        return None
    if scan.order_by or scan.latest_by or (scan.dynamic and not agg.group_by):
        return None
    if Capability.AGGREGATE not in capabilities(catalog, scan.uri):
        return None
    for _, e, _ in agg.group_by:
        if not (isinstance(e, Column) and e.source == scan.alias):
            return None
    for _, e, _ in agg.aggregates:
        if not _plain_aggregate(e, scan.alias):
            return None
    qualified = Aggregation(agg.group_by, agg.aggregates)
    asked = unqualified(qualified)
    names = set(scan.source_schema.names)
    cols = {c.name for _, e, _ in (*asked.group_by, *asked.aggregates) for c in e.columns()}
    if not cols <= names:
        return None
    src = source_of(catalog, scan.uri)
    ask = getattr(src, "supports_aggregate", None)
    try:
        if not callable(ask) or ask(asked, scan.source_schema) is not True:
            return None
    except Exception:  # a planning view that cannot judge an aggregate does not get it
        return None
    projection = tuple(n for n in scan.source_schema.names if n in cols)
    if not projection:  # count(*) alone reads the first column (rows need a column)
        projection = (scan.source_schema.names[0],)
    return dataclasses.replace(scan, aggregate=qualified, projection=projection)


def unqualified(agg: Aggregation) -> Aggregation:
    """The aggregation over the source's own column names (what a ScanRequest holds)."""
    return Aggregation(
        tuple((n, unqualify(e), t) for n, e, t in agg.group_by),
        tuple((n, unqualify(e), t) for n, e, t in agg.aggregates),
    )


def _plain_aggregate(e: Expr, alias: str) -> bool:
    if not (isinstance(e, Call) and e.name in PUSHED and not e.distinct and len(e.args) == 1):
        return False
    arg = e.args[0]
    if isinstance(arg, Star):
        return e.name == "count"
    return _plain(arg, alias)


def _plain(e: Expr, alias: str) -> bool:
    """Columns of the scan, literals and session values under + - * and unary minus."""
    if isinstance(e, Column):
        return e.source == alias
    if isinstance(e, Literal):
        return e.type in ("int", "decimal", "float") and e.value is not None
    if isinstance(e, Param):
        return not e.name.startswith("stage:")
    if isinstance(e, Binary):
        return e.op in ("+", "-", "*") and _plain(e.left, alias) and _plain(e.right, alias)
    if isinstance(e, Unary):
        return e.op == "-" and _plain(e.operand, alias)
    return False
