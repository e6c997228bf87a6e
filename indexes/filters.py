"""Filters over a dataset: expression tree -> predicates answered by indexes where possible.

``compile_filter(ds, expr, params)`` turns a ``dsl.ast`` filter (Params bound from
``params``) into a small predicate tree:

- ``RangePred`` (btree column: ``=``, ``<``, ``<=``, ``>``, ``>=``, ``between``, ``in``),
- ``MatchPred`` (inverted column: ``match(col, 'a b')`` = rows holding every token),
- ``ResidualPred`` (anything else pyarrow can evaluate; applied with
  ``connectors.arrow_expr.to_arrow`` on the candidate rows only),
- ``AndPred`` / ``OrPred`` / ``NotPred``.

Each predicate answers ``estimate()`` -- a row count, exact for index leaves (B-tree
range counts, posting cardinalities), sampled for residual leaves -- and
``evaluate(within)`` -> a roaring bitmap of matching live rows, narrowed to ``within``.
An ``AndPred`` evaluates its most selective child first and tests the others only on the
survivors (value look-ups by row id instead of materializing a large range).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from connectors.arrow_expr import (
    NotTranslatable,
    eval_constant,
    is_constant,
    match_tokens,
    to_arrow,
    translatable,
)
from dsl.ast import Between, Binary, Call, Column, Expr, InList, Literal, Param, Unary
from indexes.btree import Range, array_of, bitmap_of
from indexes.spec import DatasetError

_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "=": "=", "!=": "!="}
SAMPLE = 512


@dataclass(frozen=True)
class Estimate:
    rows: int  # best guess of matching live rows
    exact: bool  # rows is exact
    upper: int  # a sure upper bound


class Pred:
    indexed = True
    _est: Estimate | None = None

    def estimate(self) -> Estimate:
        """Computed once per predicate (``_estimate``); composite predicates override it."""
        if self._est is None:
            self._est = self._estimate()
        return self._est

    def _estimate(self) -> Estimate:
        raise NotImplementedError

    def evaluate(self, within: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.describe()


class RangePred(Pred):
    def __init__(self, ds: Any, column: str, ranges: list[Range], text: Any):
        self.ds, self.column, self.ranges = ds, column, ranges
        self.text = text  # str(expr) lazily
        self.bt = ds.btrees[column]

    def _estimate(self) -> Estimate:
        c = self.bt.count(self.ranges)
        return Estimate(c, True, c)

    def evaluate(self, within: Any) -> Any:
        if within is None:
            return self.bt.rows(self.ranges)
        if len(within) <= self.estimate().rows:
            ids = array_of(within)
            return bitmap_of(ids[self.bt.test(ids, self.ranges)])
        return self.bt.rows(self.ranges) & within

    def describe(self) -> str:
        return f"btree({self.text})"


class MatchPred(Pred):
    def __init__(self, ds: Any, column: str, tokens: list[str], text: Any):
        self.inv, self.tokens, self.text = ds.inverted[column], tokens, text

    def _estimate(self) -> Estimate:
        c = self.inv.match_count(self.tokens)
        return Estimate(c, True, c)

    def evaluate(self, within: Any) -> Any:
        out = self.inv.match(self.tokens)
        return out if within is None else out & within

    def describe(self) -> str:
        return f"postings({self.text})"


class ResidualPred(Pred):
    """A predicate no index answers: pyarrow compute over the (candidate) rows."""

    indexed = False

    def __init__(self, ds: Any, expr: Expr, params: Mapping[str, Any], now: dt.datetime):
        self.ds, self.expr, self.params, self.now = ds, expr, params, now
        self.cols = sorted(c.name for c in expr.columns())
        for c in self.cols:
            if c in ds.vectors or c not in ds.schema.names:
                raise DatasetError(
                    f"dataset {ds.name!r}: cannot filter on column {c!r}"
                    + ("" if c in ds.schema.names else f"; columns: {', '.join(ds.schema.names)}")
                )
        try:
            self.arrow = to_arrow(expr, params, now=now, schema=ds.schema)
        except (NotTranslatable, KeyError) as e:
            raise DatasetError(f"dataset {ds.name!r}: cannot apply filter {expr}: {e}") from None

    def _mask(self, ids: np.ndarray) -> np.ndarray:
        rowid = pa.array(ids.astype(np.uint32))
        if not self.cols:  # a condition on session values alone: no column to take
            return pa.table({"__rowid": rowid}).filter(self.arrow).column("__rowid").to_numpy()
        t = self.ds._scalar_table().select(self.cols).take(pa.array(ids.astype(np.int64)))
        t = t.append_column("__rowid", rowid)
        return t.filter(self.arrow).column("__rowid").to_numpy()

    def _estimate(self) -> Estimate:
        from indexes.dataset import sample_rowids

        n = len(self.ds.live)
        ids = sample_rowids(self.ds, SAMPLE)
        frac = (len(self._mask(ids)) / len(ids)) if len(ids) else 0.0
        return Estimate(round(frac * n), len(ids) >= n, n)

    def evaluate(self, within: Any) -> Any:
        ids = array_of(within if within is not None else self.ds.live)
        if not len(ids):
            return bitmap_of(ids)
        return bitmap_of(self._mask(ids))

    def describe(self) -> str:
        return f"residual({self.expr})"


class AndPred(Pred):
    def __init__(self, ds: Any, children: list[Pred]):
        self.ds, self.children = ds, children
        self.indexed = all(c.indexed for c in children)

    def estimate(self) -> Estimate:
        n = max(len(self.ds.live), 1)
        ests = [c.estimate() for c in self.children]
        upper = min(e.upper for e in ests)
        sel = 1.0
        for e in ests:
            sel *= e.rows / n
        return Estimate(min(upper, round(sel * n)), False, upper)

    def evaluate(self, within: Any) -> Any:
        out = within
        for c in sorted(self.children, key=lambda c: (not c.indexed, c.estimate().rows)):
            out = c.evaluate(out)
            if not out:
                break
        return out

    def describe(self) -> str:
        return " and ".join(c.describe() for c in self.children)


class OrPred(Pred):
    def __init__(self, ds: Any, children: list[Pred]):
        self.ds, self.children = ds, children
        self.indexed = all(c.indexed for c in children)

    def estimate(self) -> Estimate:
        n = max(len(self.ds.live), 1)
        ests = [c.estimate() for c in self.children]
        miss = 1.0
        for e in ests:
            miss *= 1 - e.rows / n
        upper = min(n, sum(e.upper for e in ests))
        return Estimate(min(upper, round((1 - miss) * n)), False, upper)

    def evaluate(self, within: Any) -> Any:
        out = None
        for c in self.children:
            r = c.evaluate(within)
            out = r if out is None else out | r
        return out

    def describe(self) -> str:
        return "(" + " or ".join(c.describe() for c in self.children) + ")"


class NotPred(Pred):
    """``not p`` over an index leaf: live rows minus matches minus the column's nulls."""

    def __init__(self, ds: Any, child: Pred, nulls: Any):
        self.ds, self.child, self.nulls = ds, child, nulls

    def estimate(self) -> Estimate:
        e = self.child.estimate()
        n = len(self.ds.live) - len(self.nulls)
        return Estimate(n - e.rows, e.exact, n - (e.rows if e.exact else 0))

    def evaluate(self, within: Any) -> Any:
        base = (self.ds.live if within is None else within) - self.nulls
        return base - self.child.evaluate(base)

    def describe(self) -> str:
        return f"not {self.child.describe()}"


# ---------------------------------------------------------------------- compilation


def _const(e: Expr, params: Mapping[str, Any], now: dt.datetime) -> Any:
    return eval_constant(e, params, now)


def _leaf(ds: Any, e: Expr, params: Mapping[str, Any], now: dt.datetime) -> Pred | None:
    """An index predicate for ``e``, or None when no index answers it."""
    text = e  # rendered only when described (explain), not on every query
    if isinstance(e, Binary) and e.op in _FLIP:
        col, other, op = e.left, e.right, e.op
        if not isinstance(col, Column):
            col, other, op = e.right, e.left, _FLIP[e.op]
        if isinstance(col, Column) and col.name in ds.btrees and is_constant(other):
            v = _const(other, params, now)
            if v is None:
                return None
            r = {
                "=": Range(v, v),
                "<": Range(None, v, True, False),
                "<=": Range(None, v),
                ">": Range(v, None, False, True),
                ">=": Range(v, None),
            }.get(op)
            if r is not None:
                return RangePred(ds, col.name, [r], text)
            bt = ds.btrees[col.name]
            return NotPred(ds, RangePred(ds, col.name, [Range(v, v)], text), bt.nulls)
    if (
        isinstance(e, Between)
        and isinstance(e.expr, Column)
        and e.expr.name in ds.btrees
        and is_constant(e.low)
        and is_constant(e.high)
    ):
        lo, hi = _const(e.low, params, now), _const(e.high, params, now)
        if lo is None or hi is None:  # a null bound: unknown (not an open range): pyarrow
            return None
        p = RangePred(ds, e.expr.name, [Range(lo, hi)], text)
        return NotPred(ds, p, ds.btrees[e.expr.name].nulls) if e.negated else p
    if isinstance(e, InList) and isinstance(e.expr, Column) and e.expr.name in ds.btrees:
        if isinstance(e.items, Param):
            if e.items.name not in params:
                raise DatasetError(
                    f"session value {e.items.name!r} is not bound (needed by {text})"
                )
            values = list(params[e.items.name])
        elif all(type(i) is Literal for i in e.items) or all(is_constant(i) for i in e.items):
            # literals first: the common case needs no walk of every item's subtree
            values = [_const(i, params, now) for i in e.items]
        else:
            return None
        if any(v is None for v in values):  # a value not found is unknown: pyarrow's 3VL
            return None
        values = sorted(set(values), key=lambda v: (str(type(v)), v))
        p = RangePred(ds, e.expr.name, [Range.point(v) for v in values], text)
        return NotPred(ds, p, ds.btrees[e.expr.name].nulls) if e.negated else p
    if (
        isinstance(e, Call)
        and e.name == "match"
        and len(e.args) == 2
        and isinstance(e.args[0], Column)
        and e.args[0].name in ds.inverted
        and is_constant(e.args[1])
    ):
        q = _const(e.args[1], params, now)
        return MatchPred(ds, e.args[0].name, match_tokens(str(q)), text)
    return None


def compile_filter(
    ds: Any, e: Expr, params: Mapping[str, Any], now: dt.datetime | None = None
) -> Pred:
    now = now or dt.datetime.now(dt.UTC)
    return _compile(ds, e, params, now)


def _flatten(e: Expr, op: str) -> list[Expr]:
    if isinstance(e, Binary) and e.op == op:
        return _flatten(e.left, op) + _flatten(e.right, op)
    return [e]


def _compile(ds: Any, e: Expr, params: Mapping[str, Any], now: dt.datetime) -> Pred:
    if isinstance(e, Binary) and e.op in ("and", "or"):
        kids = [_compile(ds, x, params, now) for x in _flatten(e, e.op)]
        if e.op == "and":
            idx = [k for k in kids if k.indexed]
            res = [k for k in kids if not k.indexed]
            if len(res) > 1:  # one pyarrow pass for all residual conjuncts
                exprs = [k.expr for k in res]  # type: ignore[attr-defined]
                merged = exprs[0]
                for x in exprs[1:]:
                    merged = Binary("and", merged, x)
                res = [ResidualPred(ds, merged, params, now)]
            kids = idx + res
            return kids[0] if len(kids) == 1 else AndPred(ds, kids)
        if all(k.indexed for k in kids):
            return OrPred(ds, kids)
        return ResidualPred(ds, e, params, now)
    if isinstance(e, Unary) and e.op == "not":
        inner = _leaf(ds, e.operand, params, now)
        if isinstance(inner, RangePred):
            return NotPred(ds, inner, ds.btrees[inner.column].nulls)
        return ResidualPred(ds, e, params, now)
    if isinstance(e, Literal) and e.type == "bool":
        return ResidualPred(ds, e, params, now)
    leaf = _leaf(ds, e, params, now)
    return leaf if leaf is not None else ResidualPred(ds, e, params, now)


def supported(ds: Any, e: Expr) -> bool:
    """Plan-time check (params unbound): can the dataset apply ``e`` exactly?"""
    cols = {c.name for c in e.columns()}
    if any(c not in ds.schema.names or c in ds.vectors for c in cols):
        return False
    if _all_indexed(ds, e):
        return True
    return translatable(e)


def _all_indexed(ds: Any, e: Expr) -> bool:
    if isinstance(e, Binary) and e.op in ("and", "or"):
        return _all_indexed(ds, e.left) and _all_indexed(ds, e.right)
    if isinstance(e, Call) and e.name == "match":
        return (
            len(e.args) == 2
            and isinstance(e.args[0], Column)
            and e.args[0].name in ds.inverted
            and is_constant(e.args[1])
        )
    if isinstance(e, InList) and isinstance(e.items, Param):
        return isinstance(e.expr, Column) and e.expr.name in ds.btrees
    return False
