"""The expression tree shared by the binding language, the planner and the connectors.

Every expression inside a binding (``where``, ``join``, ``derive``, ``order_by``, select
items, ``nearest.to``) parses into these frozen, hashable nodes. Session placeholders
(``{{session.user_id}}``) become ``Param`` nodes: they are bound at execution time by
the connectors (SQL bind parameters, typed Mongo values, Arrow scalars) and are never
spliced into query text.

Spans are kept for error messages but excluded from equality, so the same expression
written in YAML and in the compact text form compares equal.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from dsl.errors import Span

COMPARISONS = ("=", "!=", "<", "<=", ">", ">=")
ARITHMETIC = ("+", "-", "*", "/", "%", "||")
LOGICAL = ("and", "or")
AGGREGATES = ("count", "sum", "avg", "min", "max", "count_distinct")


@dataclass(frozen=True)
class Expr:
    span: Span | None = field(default=None, kw_only=True, compare=False, repr=False)

    def children(self) -> tuple[Expr, ...]:
        out: list[Expr] = []
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Expr):
                out.append(v)
            elif isinstance(v, tuple):
                out.extend(x for x in v if isinstance(x, Expr))
        return tuple(out)

    def walk(self) -> Iterator[Expr]:
        """Pre-order traversal of this expression and every sub-expression."""
        yield self
        for c in self.children():
            yield from c.walk()

    def columns(self) -> set[Column]:
        return {e for e in self.walk() if isinstance(e, Column)}

    def params(self) -> set[str]:
        return {e.name for e in self.walk() if isinstance(e, Param)}

    def sql(self) -> str:
        """Canonical text, used by explain and as the test oracle."""
        return to_text(self)

    def __str__(self) -> str:
        return to_text(self)


@dataclass(frozen=True)
class Column(Expr):
    """``m.status`` -> Column('status', 'm'); ``status`` -> Column('status', None).

    Nested document fields keep their dots in ``name`` (``c.meta.city`` -> source 'c',
    name 'meta.city') once resolved against the catalog.
    """

    name: str
    source: str | None = None

    @property
    def qualified(self) -> str:
        return f"{self.source}.{self.name}" if self.source else self.name


@dataclass(frozen=True)
class Star(Expr):
    """``*`` inside ``count(*)`` or ``select: [m.*]``."""

    source: str | None = None


@dataclass(frozen=True)
class Literal(Expr):
    """A constant. ``type`` is one of int, float, decimal, str, bool, null, timestamp,
    interval, list. ``0.06`` is a ``decimal`` (a ``decimal.Decimal``, exact as in SQL);
    ``1e-3`` is a ``float``.

    A ``list`` literal (``[0.5, 0.3, 0.2]``, e.g. policy weights) holds a tuple of constants."""

    value: Any
    type: str


@dataclass(frozen=True)
class Param(Expr):
    """A session value, ``{{session.name}}``; bound at execution, never text."""

    name: str


@dataclass(frozen=True)
class Call(Expr):
    """A function call: now(), geo_hash(lat, lon, 6), match(body, 'fed rates'), sum(x)."""

    name: str
    args: tuple[Expr, ...] = ()
    distinct: bool = False

    @property
    def is_aggregate(self) -> bool:
        return self.name in AGGREGATES


@dataclass(frozen=True)
class Unary(Expr):
    op: str  # 'not' | '-'
    operand: Expr


@dataclass(frozen=True)
class Binary(Expr):
    op: str  # COMPARISONS + ARITHMETIC + LOGICAL
    left: Expr
    right: Expr


@dataclass(frozen=True)
class InList(Expr):
    """``x in (1, 2)`` (items is a tuple) or ``x in {{session.symbols}}`` (items is a Param)."""

    expr: Expr
    items: tuple[Expr, ...] | Param
    negated: bool = False


@dataclass(frozen=True)
class Between(Expr):
    expr: Expr
    low: Expr
    high: Expr
    negated: bool = False


@dataclass(frozen=True)
class Like(Expr):
    expr: Expr
    pattern: Expr
    negated: bool = False
    case_insensitive: bool = False


@dataclass(frozen=True)
class IsNull(Expr):
    expr: Expr
    negated: bool = False


@dataclass(frozen=True)
class Exists(Expr):
    """``exists(late where late.l_orderkey = o.o_orderkey)``: whether the stage ``late`` has
    a row satisfying ``where`` (columns ``late.<col>`` are the stage's, others the
    enclosing sources'). Without ``where`` the builder binds it as a parameter."""

    stage: str
    where: Expr | None = None


@dataclass(frozen=True)
class ExistsIn(Expr):
    """A correlated ``exists`` pushed into a source by ``fabric.optimizer.push_exists``:
    whether the object ``uri`` (a table of the same connection as the source holding the
    filter) has a row satisfying ``where``. In ``where`` the columns ``alias.<col>`` are
    that table's own (``alias`` is the stage the exists named); unqualified columns are
    the enclosing source's, as in every filter a source is given. Only a source whose
    ``supports_filter`` answers it EXACT (``connectors.sql``: same connection) gets it."""

    uri: str
    alias: str
    where: Expr

    def inner_columns(self) -> set[Column]:
        """The columns of ``where`` that are the table ``uri``'s (``alias.<col>``)."""
        return {c for c in self.where.columns() if c.source == self.alias}


@dataclass(frozen=True)
class SortKey(Expr):
    expr: Expr
    descending: bool = False
    nulls_first: bool | None = None


# ---------------------------------------------------------------- helpers


def conjuncts(e: Expr | None) -> list[Expr]:
    """Split ``a and (b and c)`` into [a, b, c]."""
    if e is None:
        return []
    if isinstance(e, Binary) and e.op == "and":
        return conjuncts(e.left) + conjuncts(e.right)
    return [e]


def and_all(items: list[Expr] | tuple[Expr, ...]) -> Expr | None:
    out: Expr | None = None
    for it in items:
        out = it if out is None else Binary("and", out, it)
    return out


def sources_of(e: Expr) -> set[str]:
    return {c.source for c in e.columns() if c.source is not None}


def replace(e: Expr, fn: Any, *, pre: Any = None) -> Expr:
    """Rewrite ``e``: ``fn(node) -> node | None`` bottom-up (None keeps the node).

    ``pre(node) -> node | None`` runs top-down first: a node it returns replaces the
    whole sub-tree, which is not visited further (e.g. substituting an expression that
    an operator below already computed by the column holding it)."""
    if pre is not None:
        hit = pre(e)
        if hit is not None:
            return hit
    changes: dict[str, Any] = {}
    for f in fields(e):
        if f.name == "span":
            continue
        v = getattr(e, f.name)
        if isinstance(v, Expr):
            nv = replace(v, fn, pre=pre)
            if nv is not v:
                changes[f.name] = nv
        elif isinstance(v, tuple) and any(isinstance(x, Expr) for x in v):
            nt = tuple(replace(x, fn, pre=pre) if isinstance(x, Expr) else x for x in v)
            if any(a is not b for a, b in zip(nt, v)):
                changes[f.name] = nt
    if changes:
        e = dataclasses.replace(e, **changes)
    out = fn(e)
    return e if out is None else out


def unqualify(e: Expr) -> Expr:
    """Drop source qualifiers (what a connector sees: its own column names); inside an
    ``ExistsIn`` the other table's columns keep theirs."""

    def inner(n: Expr) -> Expr | None:
        if not isinstance(n, ExistsIn):
            return None
        keep = n.alias
        where = replace(
            n.where,
            lambda c: (
                Column(c.name, None, span=c.span)
                if isinstance(c, Column) and c.source and c.source != keep
                else None
            ),
        )
        return ExistsIn(n.uri, n.alias, where, span=n.span)

    return replace(
        e,
        lambda n: Column(n.name, None, span=n.span) if isinstance(n, Column) and n.source else None,
        pre=inner,
    )


# ---------------------------------------------------------------- canonical text

_PREC = {
    "or": 1,
    "and": 2,
    "not": 3,
    "=": 4,
    "!=": 4,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "||": 5,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "%": 6,
}


def _lit(v: Any, t: str) -> str:
    if t == "null" or v is None:
        return "null"
    if t == "bool":
        return "true" if v else "false"
    if t == "decimal":
        text = str(v)
        return text if "." in text or "E" in text else text + ".0"
    if t == "str":
        return "'" + str(v).replace("'", "''") + "'"
    if t == "timestamp":
        return f"timestamp '{v.isoformat() if isinstance(v, _dt.datetime) else v}'"
    if t == "date":
        return f"date '{v.isoformat() if isinstance(v, _dt.date) else v}'"
    if t == "list":
        return (
            "["
            + ", ".join(
                _lit(x, "bool" if isinstance(x, bool) else "str" if isinstance(x, str) else "num")
                for x in v
            )
            + "]"
        )
    if t == "interval":
        if isinstance(v, _dt.timedelta):
            secs = v.total_seconds()
            return f"interval '{int(secs) if secs == int(secs) else secs} seconds'"
        return f"interval '{v}'"
    return repr(v)


def to_text(e: Expr, parent_prec: int = 0) -> str:
    if isinstance(e, Column):
        return e.qualified
    if isinstance(e, Star):
        return f"{e.source}.*" if e.source else "*"
    if isinstance(e, Literal):
        return _lit(e.value, e.type)
    if isinstance(e, Param):
        if e.name.startswith("stage:"):  # a stage's result (dsl.types.stage_param)
            stage, _, what = e.name[6:].partition(":")
            return f"exists({stage})" if what == "exists" else stage
        return f"{{{{session.{e.name}}}}}"
    if isinstance(e, Exists):
        return f"exists({e.stage}{' where ' + to_text(e.where) if e.where is not None else ''})"
    if isinstance(e, ExistsIn):
        return f"exists({e.uri} as {e.alias} where {to_text(e.where)})"
    if isinstance(e, Call) and e.name == "case":
        a = e.args
        whens = " ".join(
            f"when {to_text(a[i])} then {to_text(a[i + 1])}" for i in range(0, len(a) - 1, 2)
        )
        default = f" else {to_text(a[-1])}" if len(a) % 2 else ""
        return f"case {whens}{default} end"
    if isinstance(e, Call) and e.name == "cast" and len(e.args) == 2:
        t = e.args[1].value if isinstance(e.args[1], Literal) else e.args[1]
        return f"cast({to_text(e.args[0])} as {t})"
    if isinstance(e, Call):
        inner = ", ".join(to_text(a) for a in e.args)
        return f"{e.name}({'distinct ' if e.distinct else ''}{inner})"
    if isinstance(e, Unary):
        if e.op == "not":
            s = f"not {to_text(e.operand, _PREC['not'])}"
            return f"({s})" if parent_prec > _PREC["not"] else s
        return f"-{to_text(e.operand, 7)}"
    if isinstance(e, Binary):
        p = _PREC[e.op]
        s = f"{to_text(e.left, p)} {e.op} {to_text(e.right, p + 1)}"
        return f"({s})" if parent_prec > p else s
    if isinstance(e, InList):
        items = (
            to_text(e.items)
            if isinstance(e.items, Param)
            else "(" + ", ".join(to_text(i) for i in e.items) + ")"
        )
        s = f"{to_text(e.expr, 5)} {'not in' if e.negated else 'in'} {items}"
        return f"({s})" if parent_prec > 4 else s
    if isinstance(e, Between):
        s = f"{to_text(e.expr, 5)} {'not between' if e.negated else 'between'} {to_text(e.low, 5)} and {to_text(e.high, 5)}"
        return f"({s})" if parent_prec > 4 else s
    if isinstance(e, Like):
        kw = "ilike" if e.case_insensitive else "like"
        s = f"{to_text(e.expr, 5)} {'not ' if e.negated else ''}{kw} {to_text(e.pattern, 5)}"
        return f"({s})" if parent_prec > 4 else s
    if isinstance(e, IsNull):
        s = f"{to_text(e.expr, 5)} is {'not ' if e.negated else ''}null"
        return f"({s})" if parent_prec > 4 else s
    if isinstance(e, SortKey):
        s = f"{to_text(e.expr)} {'desc' if e.descending else 'asc'}"
        if e.nulls_first is not None:
            s += " nulls first" if e.nulls_first else " nulls last"
        return s
    raise TypeError(f"unknown expression node {type(e).__name__}")
