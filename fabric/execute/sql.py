"""DuckDB SQL generated from the plan, for the part of a plan above the source units.

Every value (session parameters, literals, ``now()``, dynamic key lists) is bound as a
DuckDB ``$n`` parameter; identifiers are double-quoted; nothing the user typed is
spliced into the SQL text. Tables are the Arrow results of the source units, registered
zero-copy on a per-query cursor of one process-wide DuckDB connection (a fresh
``duckdb.connect()`` costs ~15 ms; a cursor ~5 us).
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from connectors.arrow_expr import NotTranslatable, eval_constant, is_constant
from dsl.ast import (
    Between,
    Binary,
    Call,
    Column,
    Expr,
    InList,
    IsNull,
    Like,
    Literal,
    Param,
    SortKey,
    Star,
    Unary,
    replace,
)
from dsl.errors import FabricError
from dsl.types import CalendarInterval
from fabric.functions import REGISTRY, register_duckdb, uses_array_functions

_lock = threading.Lock()
_base: duckdb.DuckDBPyConnection | None = None
_ids = itertools.count()


class UnresolvedColumn(FabricError, LookupError):
    def __init__(self, col: Column, names: list[str]):
        self.col = col
        self.names = names
        super().__init__(f"column {col.qualified} is not among [{', '.join(names)}]")


def cursor() -> duckdb.DuckDBPyConnection:
    """A cursor on the process-wide DuckDB connection (one per query / thread)."""
    global _base
    with _lock:
        if _base is None:
            _base = duckdb.connect()
            _base.execute("SET TimeZone = 'UTC'")
            # once, on the connection itself: a function registered on a cursor is freed
            # with the cursor while the catalog keeps its entry (the next query through
            # another cursor called whatever object then lived at that address)
            register_duckdb(_base)
        return _base.cursor()


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def resolve(col: Column, names: list[str], exprmap: Mapping[Expr, str]) -> str:
    """The table column a plan column denotes: qualified name, an output of a Project or
    Aggregate below, or an unambiguous bare name."""
    if col.qualified in names:
        return col.qualified
    if col in exprmap:
        return exprmap[col]
    if col.name in names:
        return col.name
    tail = [n for n in names if n.endswith("." + col.name)]
    if len(tail) == 1:
        return tail[0]
    raise UnresolvedColumn(col, names)


def substitute(e: Expr, exprmap: Mapping[Expr, str]) -> Expr:
    """Top-down: replace sub-expressions computed below (Project/Aggregate outputs) by
    columns of their output names."""
    if not exprmap:
        return e

    def computed(n: Expr) -> Expr | None:
        return Column(exprmap[n], None) if n in exprmap and not isinstance(n, Column) else None

    return replace(e, lambda n: None, pre=computed)


@dataclass
class Rel:
    """A SQL relation: its text, column names, and expressions computed by it."""

    sql: str
    names: list[str]
    exprmap: dict[Expr, str] = field(default_factory=dict)
    #: an ORDER BY (over ``sql``'s columns) not applied yet: the next SELECT applies it, so
    #: a Project or Limit above a Sort keeps the order within one statement
    order: str | None = None
    #: ``sql`` ends with ORDER BY: a LIMIT can be appended
    ordered: bool = False

    def materialized(self, alias: str) -> Rel:
        if self.order is None:
            return self
        return Rel(
            f"SELECT * FROM ({self.sql}) AS {alias} ORDER BY {self.order}",
            self.names,
            self.exprmap,
            ordered=True,
        )


class SqlBuilder:
    """Builds one DuckDB query; collects bound values and registered Arrow tables."""

    def __init__(self, params: Mapping[str, Any], now: dt.datetime):
        self.params = params
        self.now = now
        self.values: list[Any] = []
        self.tables: dict[str, pa.Table] = {}
        self._q = itertools.count()

    def bind(self, v: Any) -> str:
        if isinstance(v, dt.datetime) and v.tzinfo is None:
            v = v.replace(tzinfo=dt.UTC)
        if isinstance(v, CalendarInterval):  # '1 month 2 days': DuckDB reads the text
            self.values.append(str(v))
            return f"CAST(${len(self.values)} AS INTERVAL)"
        self.values.append(v)
        return f"${len(self.values)}"

    def table(self, t: pa.Table) -> Rel:
        name = f"__fabric_t{next(_ids)}"
        self.tables[name] = t
        return Rel(f"SELECT * FROM {quote(name)}", list(t.column_names))

    def alias(self) -> str:
        return f"q{next(self._q)}"

    # ------------------------------------------------------------ expressions
    def expr(self, e: Expr, rel: Rel) -> str:
        if e in rel.exprmap and not isinstance(e, Column):
            return quote(rel.exprmap[e])
        if isinstance(e, Column):
            return quote(resolve(e, rel.names, rel.exprmap))
        if isinstance(e, Star):
            return "*"
        if isinstance(e, Literal):
            if e.value is None or e.type == "null":
                return "NULL"
            if e.type == "bool":
                return "TRUE" if e.value else "FALSE"
            if e.type == "interval" and isinstance(e.value, str):
                return f"CAST({self.bind(e.value)} AS INTERVAL)"
            return self.bind(e.value)
        if isinstance(e, Param):
            if e.name not in self.params:
                raise KeyError(f"session value {e.name!r} is not bound")
            return self.bind(_plain(self.params[e.name]))
        if is_constant(e) and not uses_array_functions(e) and not isinstance(e, Call | InList):
            try:
                return self.bind(eval_constant(e, self.params, self.now))
            except (NotTranslatable, TypeError):
                pass
        if isinstance(e, Binary):
            op = {"!=": "<>", "and": "AND", "or": "OR"}.get(e.op, e.op)
            return f"({self.expr(e.left, rel)} {op} {self.expr(e.right, rel)})"
        if isinstance(e, Unary):
            return (
                f"(NOT {self.expr(e.operand, rel)})"
                if e.op == "not"
                else f"(-{self.expr(e.operand, rel)})"
            )
        if isinstance(e, InList):
            neg = "NOT IN" if e.negated else "IN"
            if isinstance(e.items, Param):
                return (
                    f"({self.expr(e.expr, rel)} {neg} (SELECT unnest({self.expr(e.items, rel)})))"
                )
            items = ", ".join(self.expr(i, rel) for i in e.items) or "NULL"
            return f"({self.expr(e.expr, rel)} {neg} ({items}))"
        if isinstance(e, Between):
            neg = "NOT BETWEEN" if e.negated else "BETWEEN"
            return f"({self.expr(e.expr, rel)} {neg} {self.expr(e.low, rel)} AND {self.expr(e.high, rel)})"
        if isinstance(e, Like):
            kw = ("NOT " if e.negated else "") + ("ILIKE" if e.case_insensitive else "LIKE")
            # backslash escapes % and _, as in pyarrow, PostgreSQL and MariaDB (DuckDB's
            # LIKE has no escape character unless one is named)
            return f"({self.expr(e.expr, rel)} {kw} {self.expr(e.pattern, rel)} ESCAPE '\\')"
        if isinstance(e, IsNull):
            return f"({self.expr(e.expr, rel)} IS {'NOT ' if e.negated else ''}NULL)"
        if isinstance(e, Call):
            return self.call(e, rel)
        raise NotTranslatable(f"cannot run {e} in DuckDB")

    def call(self, e: Call, rel: Rel) -> str:
        name, args = e.name, e.args
        if name == "now" and not args:
            return self.bind(self.now)
        f = REGISTRY.get(name)
        if f is None or f.duckdb is None:
            raise NotTranslatable(f"function {name}() is not available in joins and aggregates")

        def const(a: Expr) -> Any:
            if not is_constant(a):
                raise NotTranslatable(f"argument {a} of {name}() must be a constant")
            return eval_constant(a, self.params, self.now)

        texts = [
            "*" if isinstance(a, Star) else self.expr(a, rel)
            for i, a in enumerate(args)
            if i not in f.constant_args
        ]
        # constant arguments (units, digits) are validated by the form and written by it
        full: list[str] = []
        it = iter(texts)
        for i, _ in enumerate(args):
            full.append("" if i in f.constant_args else next(it))
        return f.duckdb(e, full, const)

    def sort_keys(self, keys: tuple[SortKey, ...], rel: Rel) -> str:
        out = []
        for k in keys:
            s = f"{self.expr(k.expr, rel)} {'DESC' if k.descending else 'ASC'}"
            if k.nulls_first is not None:
                s += " NULLS FIRST" if k.nulls_first else " NULLS LAST"
            out.append(s)
        return ", ".join(out)

    # ------------------------------------------------------------ running
    def run(self, sql: str) -> pa.Table:
        cur = cursor()
        try:
            for name, t in self.tables.items():
                cur.register(name, t)
            sql, values = used_params(sql, self.values)
            return cur.sql(sql, params=values or None).to_arrow_table()
        finally:
            cur.close()


_DUCK_TYPES = {pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.int32(): "INTEGER"}


def typed(sql: str, typ: pa.DataType) -> str:
    """Cast to the plan's declared type (DuckDB's sum of BIGINT is a 128-bit decimal)."""
    name = _DUCK_TYPES.get(typ)
    return f"CAST({sql} AS {name})" if name else sql


def aggregate_sql(b: SqlBuilder, agg: Any, rel: Rel, alias: str) -> str:
    """``SELECT <keys>, <aggregates> FROM (rel) GROUP BY ...`` for an ``Aggregation``
    (``connectors.base``): the same SQL the executor's DuckDB regions give an Aggregate,
    so an aggregate pushed into a DuckDB-read source answers exactly as it would above."""
    items = (*agg.group_by, *agg.aggregates)
    cols = ", ".join(f"{typed(b.expr(e, rel), t)} AS {quote(n)}" for n, e, t in items)
    group = ", ".join(str(i + 1) for i in range(len(agg.group_by)))
    return f"SELECT {cols} FROM ({rel.sql}) AS {alias}" + (f" GROUP BY {group}" if group else "")


def run_aggregate(
    table: pa.Table, agg: Any, params: Mapping[str, Any], now: dt.datetime
) -> pa.Table:
    """An ``Aggregation`` over an Arrow table whose columns are the source's, in DuckDB."""
    b = SqlBuilder(params, now)
    out = b.run(aggregate_sql(b, agg, b.table(table), "__fabric_agg"))
    return out if out.schema.equals(agg.schema) else out.cast(agg.schema)


_TOKENS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|\$(\d+)")


_PLACEHOLDER = re.compile(r"\$(\d+)")


def used_params(sql: str, values: list[Any]) -> tuple[str, list[Any]]:
    """Renumber the ``$n`` placeholders ``sql`` uses and keep only their values.

    A query built from part of a builder's plan (the per-join counts of explain analyze)
    references a subset of the bound values; DuckDB refuses a parameter list longer than
    the placeholders. Quoted strings and identifiers are skipped, not rewritten.

    A whole query uses every value once, as bound: that is checked by a scan for ``$``
    alone (``_PLACEHOLDER``, ~1 us) and the text is kept. Only otherwise is the text
    tokenized, quotes and all (``_TOKENS``, 0.2-5 ms for a TPC-H query's 0.3-8 KB on a
    loaded machine; it ran on every DuckDB query). A ``$n`` inside a quoted identifier can
    only make the quick check fail (then the exact path runs) or pass a parameter list
    DuckDB rejects by count, never bind a value to the wrong placeholder.
    """
    found = _PLACEHOLDER.findall(sql)
    if len(found) == len(values) and sorted(map(int, found)) == list(range(1, len(values) + 1)):
        return sql, values
    new: dict[int, int] = {}

    def sub(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return m.group(0)
        old = int(m.group(1))
        if old not in new:
            new[old] = len(new) + 1
        return f"${new[old]}"

    out = _TOKENS.sub(sub, sql)
    return out, [values[old - 1] for old in sorted(new, key=new.__getitem__)]


def _plain(v: Any) -> Any:
    """Session values as DuckDB parameters: numpy arrays and tuples become lists."""
    if hasattr(v, "tolist") and not isinstance(v, str | bytes):
        return v.tolist()
    if isinstance(v, tuple | set | frozenset):
        return list(v)
    return v
