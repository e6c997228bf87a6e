"""Row estimates from source statistics (used by join_order and dynamic_filters).

Rules of thumb in the style of DataFusion's and PostgreSQL's defaults when statistics
are missing: an equality keeps ``1 / distinct_count`` of the rows (or ``EQ_SELECTIVITY`` for a
session value, ``EQ_LITERAL_SELECTIVITY`` for a literal),
a range keeps the fraction of ``[min, max]`` it covers (or ``RANGE_SELECTIVITY``),
``latest_by`` keeps one row per key (one row when every key is pinned by an equality),
an unknown row count counts as ``UNKNOWN_ROWS``. An equi-join returns
``|L| * |R| / max(ndv(a), ndv(b))`` rows, with an unknown ndv taken as the larger side
(a key / foreign-key join).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from connectors.arrow_expr import is_constant
from connectors.base import Statistics
from dsl.ast import (
    Between,
    Binary,
    Column,
    Expr,
    InList,
    IsNull,
    Like,
    Literal,
    Param,
    Unary,
    conjuncts,
    unqualify,
)
from dsl.types import CalendarInterval
from fabric.optimizer._util import aliases, source_of, unit_scan, units
from fabric.plan.nodes import (
    Aggregate,
    Derive,
    EncryptedScore,
    Filter,
    Join,
    Limit,
    Plan,
    Project,
    Scan,
    Sort,
    Stage,
    StageRef,
    UserFunction,
    VectorSearch,
    WithStages,
)

UNKNOWN_ROWS = 1_000_000
EQ_SELECTIVITY = 0.001  # column = session value: usually a key (user_id = {{session.user_id}})
EQ_LITERAL_SELECTIVITY = 0.1  # column = literal: usually a category (status = 'active')
RANGE_SELECTIVITY = 0.3
DEFAULT_SELECTIVITY = 0.5
IN_PARAM_ITEMS = 10  # assumed length of a session list in ``x in {{session.xs}}``


def rewrite_to_fixpoint(
    plan: Plan, catalog: Any, step: Callable[[Plan, Estimator, Any], Plan | None]
) -> Plan:
    """Apply ``step`` (one rewrite, or None when it finds nothing more to do) until it
    stops, estimating each new plan afresh: the loop of every rule that adds one filter
    or pre-scan at a time and must see the rows it changed."""
    while True:
        out = step(plan, Estimator(plan, catalog), catalog)
        if out is None:
            return plan
        plan = out


class Estimator:
    """Estimated rows of plan nodes; statistics are fetched once per source."""

    def __init__(self, plan: Plan, catalog: Any):
        self.catalog = catalog
        self.units = units(plan)
        self._stats: dict[str, Statistics] = {}

    # ------------------------------------------------------------ statistics
    def stats(self, uri: str) -> Statistics:
        if uri not in self._stats:
            src = source_of(self.catalog, uri)
            try:
                self._stats[uri] = src.statistics() if src is not None else Statistics()
            except Exception:  # statistics are advisory; a failing source plans with defaults
                self._stats[uri] = Statistics()
        return self._stats[uri]

    def ndv(self, col: Column) -> int | None:
        """Distinct values of a base column, when a source can tell."""
        unit = self.units.get(col.source or "")
        if unit is None:
            return None
        scan = unit_scan(unit)
        if not isinstance(scan, Scan):
            return None
        cs = self.stats(scan.uri).columns.get(col.name)
        if cs is not None and cs.distinct_count:
            return int(cs.distinct_count)
        if scan.latest_by == (col.name,):
            return self.rows(unit, dynamic=False)
        return None

    # ------------------------------------------------------------ estimates
    def rows(self, node: Plan, *, dynamic: bool = True) -> int:
        return max(1, int(self._rows(node, dynamic)))

    def _rows(self, node: Plan, dynamic: bool) -> float:
        if isinstance(node, Scan) and node.aggregate is not None:
            return self.grouped(node.aggregate.group_by, self.scan_rows(node, dynamic=dynamic))
        if isinstance(node, Scan):
            return self.scan_rows(node, dynamic=dynamic)
        if isinstance(node, VectorSearch):
            return node.rows_out
        if isinstance(node, Filter):
            below = self._rows(node.input, dynamic)
            scan = node.input if isinstance(node.input, Scan) else None
            sel = 1.0
            for c in conjuncts(node.predicate):
                if scan is not None and unqualify(c) in scan.inexact:
                    continue  # already counted in the scan
                sel *= self.selectivity(c, scan)
            return below * sel
        if isinstance(node, Join):
            return self.join_rows(
                node, self._rows(node.left, dynamic), self._rows(node.right, dynamic)
            )
        if isinstance(node, Aggregate):
            return self.grouped(node.group_by, self._rows(node.input, dynamic))
        if isinstance(node, Limit):
            return min(node.n, self._rows(node.input, dynamic))
        if isinstance(node, Derive | Project | Sort | UserFunction | EncryptedScore):
            return self._rows(node.children()[0], dynamic)
        if isinstance(node, StageRef | Stage | WithStages):  # a stage's rows: its plan's
            return self._rows(node.input, dynamic)
        return UNKNOWN_ROWS

    def grouped(self, group_by: Any, below: float) -> float:
        """Groups of ``below`` rows by ``group_by``: the product of the keys' distinct
        counts (at most ``below``), else a tenth of the rows; one row without keys."""
        if not group_by:
            return 1
        prod = 1.0
        for _, e, _ in group_by:
            d = self.ndv(e) if isinstance(e, Column) else None
            if d is None:
                return max(1.0, below / 10)
            prod *= d
        return min(below, prod)

    def scan_rows(self, scan: Scan, *, dynamic: bool = True) -> float:
        st = self.stats(scan.uri)
        rows = float(st.row_count if st.row_count is not None else UNKNOWN_ROWS)
        filters = (*scan.exact, *scan.inexact)
        bounded, rest = self._bounded_ranges(filters, scan)
        rows *= bounded
        for f in rest:
            rows *= self.selectivity(f, scan, qualified=False)
        if scan.latest_by:
            pinned = {
                _eq_column(c) for f in filters for c in conjuncts(f) if _eq_column(c) is not None
            }
            if set(scan.latest_by) <= pinned:
                rows = min(rows, 1.0)
            elif len(scan.latest_by) == 1:
                cs = st.columns.get(scan.latest_by[0])
                if cs is not None and cs.distinct_count:
                    rows = min(rows, float(cs.distinct_count))
        if dynamic:
            for d in scan.dynamic:
                if d.op == "or":  # per branch (branch_keys): fewer rows than its plain keys
                    continue
                if d.op != "in":  # a bound (join_bounds): a range of unknown width
                    rows *= RANGE_SELECTIVITY
                    continue
                keys = self.keys_estimate(d.from_expr)
                cs = st.columns.get(d.column)
                ndv = (
                    cs.distinct_count if cs and cs.distinct_count else self.key_domain(d.from_expr)
                )
                per_key = (st.row_count or UNKNOWN_ROWS) / ndv if ndv else 1.0
                rows = min(rows, keys * max(per_key, 1.0))
        if scan.limit is not None:
            rows = min(rows, scan.limit)
        return max(rows, 1.0)

    def _bounded_ranges(self, filters: Any, scan: Scan) -> tuple[float, list[Expr]]:
        """The selectivity of the ranges ``lo <= c < hi`` among ``filters`` whose width
        ``hi - lo`` is known without the session values (``c >= {{session.d}} and c <
        {{session.d}} + interval '1 month'``, a BETWEEN of the same form, or of two
        literals), as that width over the column's [min, max]; and the other filters.
        Taken one by one, each bound of TPC-H Q14's month would keep RANGE_SELECTIVITY
        (0.09 for both: 7x the 1/84 of lineitem it keeps)."""
        st = self.stats(scan.uri)
        lows: dict[str, list[Binary]] = {}
        highs: dict[str, list[Binary]] = {}
        for f in filters:
            if isinstance(f, Binary) and f.op in ("<", "<=", ">", ">="):
                col, const, op = _column_vs_constant(f)
                if col is not None and const is not None:
                    (lows if op in (">", ">=") else highs).setdefault(col.name, []).append(f)
        sel, used = 1.0, set()
        for f in filters:
            if isinstance(f, Between) and not f.negated and isinstance(f.expr, Column):
                s = _width_share(st.columns.get(f.expr.name), f.low, f.high)
                if s is not None:
                    sel *= s
                    used.add(id(f))
        for name, lo_fs in lows.items():
            for lo_f in lo_fs:
                for hi_f in highs.get(name, []):
                    if id(lo_f) in used or id(hi_f) in used:
                        continue
                    lo = _column_vs_constant(lo_f)[1]
                    hi = _column_vs_constant(hi_f)[1]
                    s = _width_share(st.columns.get(name), lo, hi)
                    if s is not None:
                        sel *= s
                        used |= {id(lo_f), id(hi_f)}
        return sel, [f for f in filters if id(f) not in used]

    def key_domain(self, from_expr: Expr) -> float | None:
        """Distinct values a join key can take, seen from the side providing the keys:
        the provider column's distinct count, else its table's unfiltered rows (a key the
        other side refers to: a foreign key takes about as many values as the table it
        points to holds rows). None when ``from_expr`` is not a plain column."""
        if not isinstance(from_expr, Column):
            return None
        d = self.ndv(from_expr)
        if d:
            return float(d)
        unit = self.units.get(from_expr.source or "")
        scan = unit_scan(unit) if unit is not None else None
        if isinstance(scan, Scan):
            n = self.stats(scan.uri).row_count
            return float(n) if n else None
        return None

    def keys_estimate(self, from_expr: Expr) -> float:
        """Rows of the source unit that provides a dynamic filter's keys."""
        srcs = {c.source for c in from_expr.columns()}
        if len(srcs) != 1:
            return UNKNOWN_ROWS
        unit = self.units.get(next(iter(srcs)) or "")
        return self._rows(unit, True) if unit is not None else UNKNOWN_ROWS

    def side_ndv(self, col: Column, join: Join, left: float, right: float) -> float:
        """Distinct values of a join key on its side: the column's ndv (or, unknown, the
        larger side), at most that side's rows and, under a dynamic filter, its keys."""
        rows = left if col.source in aliases(join.left) else right
        d = float(self.ndv(col) or max(left, right))
        unit = self.units.get(col.source or "")
        scan = unit_scan(unit) if unit is not None else None
        if isinstance(scan, Scan):
            for dyn in scan.dynamic:
                if dyn.column == col.name and dyn.op == "in":
                    d = min(d, self.keys_estimate(dyn.from_expr))
        return min(d, rows)

    def join_rows(self, join: Join, left: float, right: float) -> float:
        best = left * right
        for c in conjuncts(join.on):
            if (
                isinstance(c, Binary)
                and c.op == "="
                and isinstance(c.left, Column)
                and isinstance(c.right, Column)
            ):
                da = self.side_ndv(c.left, join, left, right)
                db = self.side_ndv(c.right, join, left, right)
                best = min(best, left * right / max(da, db, 1))
        if join.how == "left":
            best = max(best, left)
        return best

    # ------------------------------------------------------------ selectivity
    def selectivity(self, e: Expr, scan: Scan | None, *, qualified: bool = True) -> float:
        st = self.stats(scan.uri) if scan is not None else Statistics()
        rows = st.row_count

        def col_stats(x: Expr) -> Any:
            if isinstance(x, Column) and scan is not None:
                return st.columns.get(x.name)
            return None

        if isinstance(e, Binary) and e.op == "and":
            return self.selectivity(e.left, scan, qualified=qualified) * self.selectivity(
                e.right, scan, qualified=qualified
            )
        if isinstance(e, Binary) and e.op == "or":
            a = self.selectivity(e.left, scan, qualified=qualified)
            b = self.selectivity(e.right, scan, qualified=qualified)
            return min(1.0, a + b - a * b)
        if isinstance(e, Unary) and e.op == "not":
            return 1.0 - self.selectivity(e.operand, scan, qualified=qualified)
        if isinstance(e, Binary) and e.op in ("=", "!=", "<", "<=", ">", ">="):
            col, const, op = _column_vs_constant(e)
            if col is None:
                return DEFAULT_SELECTIVITY if e.op != "=" else EQ_SELECTIVITY
            cs = col_stats(col)
            if op in ("=", "!="):
                default = EQ_LITERAL_SELECTIVITY if isinstance(const, Literal) else EQ_SELECTIVITY
                eq = 1.0 / cs.distinct_count if cs is not None and cs.distinct_count else default
                return eq if op == "=" else 1.0 - eq
            return _range_fraction(cs, const, op)
        if isinstance(e, InList):
            cs = col_stats(e.expr)
            # a literal list names categories (shipmode in ('AIR', 'MAIL')), like column =
            # literal; a session list names keys, like column = session value
            default = EQ_SELECTIVITY if isinstance(e.items, Param) else EQ_LITERAL_SELECTIVITY
            eq = 1.0 / cs.distinct_count if cs is not None and cs.distinct_count else default
            n = IN_PARAM_ITEMS if isinstance(e.items, Param) else len(e.items)
            s = min(1.0, n * eq)
            return 1.0 - s if e.negated else s
        if isinstance(e, Between):
            return RANGE_SELECTIVITY / 2
        if isinstance(e, IsNull):
            cs = col_stats(e.expr)
            s = (
                cs.null_count / rows
                if cs is not None and cs.null_count is not None and rows
                else 0.05
            )
            return 1.0 - s if e.negated else s
        if isinstance(e, Like):
            return 0.1
        return DEFAULT_SELECTIVITY


def _eq_column(e: Expr) -> str | None:
    col, _, op = _column_vs_constant(e) if isinstance(e, Binary) else (None, None, None)
    return col.name if col is not None and op == "=" else None


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}


def _column_vs_constant(e: Binary) -> tuple[Column | None, Expr | None, str]:
    if isinstance(e.left, Column) and is_constant(e.right):
        return e.left, e.right, e.op
    if isinstance(e.right, Column) and is_constant(e.left):
        return e.right, e.left, _FLIP[e.op]
    return None, None, e.op


def _width_share(cs: Any, lo: Expr | None, hi: Expr | None) -> float | None:
    """``(hi - lo) / (max - min)`` of a column (dates in days, timestamps in seconds,
    numbers as they are) when the width is known while planning: ``hi`` is ``lo +
    interval`` (a month taken as 30.44 days) or both are literals; None otherwise."""
    if cs is None or cs.min is None or cs.max is None or lo is None or hi is None:
        return None
    width: float | None = None
    seconds = isinstance(cs.min, dt.datetime)
    if isinstance(hi, Binary) and hi.op == "+" and hi.left == lo:
        v = hi.right.value if isinstance(hi.right, Literal) else None
        days = None
        if isinstance(v, dt.timedelta):
            days = v.total_seconds() / 86400
        elif isinstance(v, CalendarInterval):
            days = v.months * 30.44 + v.delta.total_seconds() / 86400
        if days is not None:
            width = days * 86400 if seconds else days
    elif isinstance(lo, Literal) and isinstance(hi, Literal):
        try:
            a, b = lo.value, hi.value
            if isinstance(a, dt.datetime):
                width = (b - a).total_seconds()
            elif isinstance(a, dt.date):
                width = float((b - a).days)
            else:
                width = float(b - a)
        except (TypeError, ValueError, AttributeError):
            return None
    if width is None:
        return None
    try:
        if isinstance(cs.min, dt.datetime):
            span = (cs.max - cs.min).total_seconds()
        elif isinstance(cs.min, dt.date):
            span = float((cs.max - cs.min).days)
        else:
            span = float(cs.max - cs.min)
    except (TypeError, ValueError, AttributeError):
        return None
    if span <= 0:
        return None
    return min(1.0, max(width / span, 0.0))


def _range_fraction(cs: Any, const: Expr | None, op: str) -> float:
    if cs is None or not isinstance(const, Literal) or cs.min is None or cs.max is None:
        return RANGE_SELECTIVITY
    lo, hi, v = cs.min, cs.max, const.value
    try:
        if isinstance(lo, dt.datetime):
            lo, hi = lo.timestamp(), hi.timestamp()
            v = v.timestamp() if isinstance(v, dt.datetime) else float(v)
        lo, hi, v = float(lo), float(hi), float(v)
    except (TypeError, ValueError, AttributeError):
        return RANGE_SELECTIVITY
    if hi <= lo:
        return RANGE_SELECTIVITY
    frac = (v - lo) / (hi - lo)
    frac = 1.0 - frac if op in (">", ">=") else frac
    return min(1.0, max(frac, 1.0 / max(1.0, hi - lo + 1)))
