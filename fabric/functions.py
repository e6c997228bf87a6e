"""The one home of the fabric's functions: what each is, how each engine computes it.

Every scalar and aggregate function of the binding language is a ``Function`` in
``REGISTRY``. An entry declares its arity, its type rule (argument checks and result
type, used by ``fabric.plan.types``), and its form in each engine, ``None`` where the
engine cannot compute it:

- ``arrow``: a ``pyarrow.compute`` expression (residual filters, derived columns, S3 /
  file datasets, Kafka batches, indexed datasets: ``connectors.arrow_expr``);
- ``array``: computed by the fabric on whole Arrow arrays (``geo_hash``, vectorized with
  numpy), substituted as a temporary column before the rest goes to pyarrow;
- ``duckdb``: DuckDB SQL (joins and aggregates, and whatever pyarrow lacks:
  ``fabric.execute.sql``);
- ``sql``: a SQLAlchemy clause pushed to a SQL source, per dialect (``connectors.sql``);
- ``mongo``: an aggregation expression pushed to MongoDB (``connectors.mongo``).

A source answers UNSUPPORTED for a filter using a function it has no form for, so the
fabric evaluates it itself: ``evaluate`` / ``filter_table`` use the pyarrow form when
there is one and DuckDB over the same Arrow table otherwise. ``tests/test_functions.py``
runs every registered function in every engine against DuckDB SQL as the reference, so a
function that cannot run cannot be registered.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from connectors import arrow_expr as _ax
from dsl import ast as A
from dsl.ast import Call, Column, Expr, Literal, replace
from fabric.plan import types as T

# ---------------------------------------------------------------- the registry

#: (call, argument types) -> result type; raises a positioned DslError
TypeRule = Callable[[A.Call, list[pa.DataType]], pa.DataType]
#: (call, translate an argument, evaluate a constant argument) -> pyarrow expression
ArrowForm = Callable[[A.Call, Callable[[Expr], Any], Callable[[Expr], Any]], Any]
#: (call, argument SQL texts, evaluate a constant argument) -> DuckDB SQL text
DuckForm = Callable[[A.Call, list[str], Callable[[Expr], Any]], str]
#: (dialect, [(clause, arrow type, argument)], evaluate a constant argument) -> (clause, arrow type);
#: raises connectors.arrow_expr.NotTranslatable where the dialect cannot
SqlForm = Callable[[str, list[tuple[Any, Any, Expr]], Callable[[Expr], Any]], tuple[Any, Any]]
#: (argument column paths, evaluate a constant argument) -> Mongo aggregation expression
MongoForm = Callable[[list[Any], Callable[[Expr], Any]], Any]
#: (argument values: Arrow arrays or Python constants) -> Arrow array
ArrayForm = Callable[[list[Any]], pa.Array]


@dataclass(frozen=True)
class Function:
    name: str
    min_args: int
    max_args: int
    type_rule: TypeRule
    arrow: ArrowForm | None = None
    array: ArrayForm | None = None
    duckdb: DuckForm | None = None
    sql: SqlForm | None = None
    mongo: MongoForm | None = None
    aggregate: bool = False
    #: argument positions that must be constants (a unit, a number of digits)
    constant_args: tuple[int, ...] = ()
    doc: str = ""


REGISTRY: dict[str, Function] = {}


def register(f: Function) -> Function:
    if f.name in REGISTRY:
        raise ValueError(f"function {f.name}() is registered twice")
    REGISTRY[f.name] = f
    return f


def lookup(name: str) -> Function | None:
    return REGISTRY.get(name)


# ---------------------------------------------------------------- type rules


_arity = T._arity
_need = T._need


def _const_arg(c: A.Call, i: int, what: str, allowed: Any = None) -> Any:
    """The value of constant argument ``i`` (a literal), checked against ``allowed``."""
    a = c.args[i]
    if isinstance(a, A.Unary) and a.op == "-" and isinstance(a.operand, A.Literal):
        a = A.Literal(-a.operand.value, a.operand.type, span=a.span)
    if not isinstance(a, A.Literal) or a.value is None:
        raise T._err(f"argument {i + 1} of {c.name}() must be a constant {what}", c.args[i])
    v = a.value
    if allowed is not None:
        ok = allowed(v) if callable(allowed) else (str(v).lower() in allowed)
        if not ok:
            hint = f"one of {', '.join(sorted(allowed))}" if not callable(allowed) else None
            raise T.DslError.at(
                f"argument {i + 1} of {c.name}() must be {what}; got {a}", a.span, hint
            )
    return v


def _t_now(c, ts):
    return T.TIMESTAMP


def _t_text(c, ts):
    _need(c, 0, ts[0], T.is_text, "text")
    return pa.string()


def _t_length(c, ts):
    _need(c, 0, ts[0], lambda t: T.is_text(t) or T._class(t) == "list", "text or a list")
    return pa.int64()


def _t_abs(c, ts):
    _need(c, 0, ts[0], T.is_numeric, "a number")
    return pa.int64() if pa.types.is_integer(ts[0]) else ts[0]


def _t_round(c, ts):
    _need(c, 0, ts[0], T.is_numeric, "a number")
    digits = 0
    if len(ts) == 2:
        _need(c, 1, ts[1], pa.types.is_integer, "an integer")
        digits = int(_const_arg(c, 1, "number of digits", lambda v: isinstance(v, int)))
    t = ts[0]
    if pa.types.is_decimal(t):
        return pa.decimal128(t.precision, max(0, min(t.scale, digits)))
    if pa.types.is_integer(t):
        return pa.int64()
    return pa.float64()


def _t_floor(c, ts):
    _need(c, 0, ts[0], T.is_numeric, "a number")
    t = ts[0]
    if pa.types.is_decimal(t):
        return pa.decimal128(t.precision, 0)
    return pa.float64()


def _t_coalesce(c, ts):
    first = next((t for t in ts if not pa.types.is_null(t)), pa.null())
    for i, t in enumerate(ts):
        if not T.comparable(first, t):
            raise T._err(
                f"coalesce() arguments must have one type; {T._text(c.args[i])} is {T.name_of(t)}, "
                f"expected {T.name_of(first)}",
                c.args[i],
            )
    out = first
    for t in ts:  # numbers: the widest (int and decimal and float -> float)
        if T.is_numeric(out) and T.is_numeric(t) and t != out:
            out = T.common_numeric(out, t)
    return out


def _t_geo_hash(c, ts):
    _need(c, 0, ts[0], T.is_numeric, "a latitude (number)")
    _need(c, 1, ts[1], T.is_numeric, "a longitude (number)")
    if len(ts) == 3:
        _need(c, 2, ts[2], pa.types.is_integer, "a precision (integer)")
        _const_arg(
            c, 2, "precision between 1 and 12", lambda v: isinstance(v, int) and 1 <= v <= 12
        )
    return pa.string()


def _t_match(c, ts):
    _need(c, 0, ts[0], lambda t: T.is_text(t) or T._class(t) == "list", "a text column")
    _need(c, 1, ts[1], T.is_text, "the query text")
    return pa.bool_()


TRUNC_UNITS = {
    "microsecond": "microsecond",
    "millisecond": "millisecond",
    "second": "second",
    "minute": "minute",
    "hour": "hour",
    "day": "day",
    "week": "week",
    "month": "month",
    "quarter": "quarter",
    "year": "year",
}
#: date_part / extract fields -> pyarrow compute function (with its options)
PART_UNITS: dict[str, tuple[str, dict[str, Any]]] = {
    "year": ("year", {}),
    "quarter": ("quarter", {}),
    "month": ("month", {}),
    "week": ("iso_week", {}),
    "day": ("day", {}),
    "dow": ("day_of_week", {"count_from_zero": True, "week_start": 7}),
    "isodow": ("day_of_week", {"count_from_zero": False, "week_start": 1}),
    "doy": ("day_of_year", {}),
    "hour": ("hour", {}),
    "minute": ("minute", {}),
    "second": ("second", {}),
}


def _t_date_trunc(c, ts):
    _need(c, 0, ts[0], T.is_text, "a unit such as 'day'")
    _need(c, 1, ts[1], T.is_temporal, "a timestamp")
    _const_arg(c, 0, "unit", TRUNC_UNITS)
    return ts[1]


def _t_date_part(c, ts):
    _need(c, 0, ts[0], T.is_text, "a field such as 'year'")
    _need(c, 1, ts[1], T.is_temporal, "a timestamp or a date")
    _const_arg(c, 0, "field", PART_UNITS)
    return pa.int64()


def _t_substring(c, ts):
    _need(c, 0, ts[0], T.is_text, "text")
    _need(c, 1, ts[1], pa.types.is_integer, "an integer (the first character, from 1)")
    _const_arg(c, 1, "start position of 1 or more", lambda v: isinstance(v, int) and v >= 1)
    if len(ts) == 3:
        _need(c, 2, ts[2], pa.types.is_integer, "an integer (the number of characters)")
        _const_arg(c, 2, "length of 0 or more", lambda v: isinstance(v, int) and v >= 0)
    return pa.string()


def _t_distance(c, ts):
    for i in range(2):
        _need(c, i, ts[i], T.is_vector, "a vector")
    return pa.float64()


def _t_contains(c, ts):
    _need(c, 0, ts[0], lambda t: T._class(t) == "list", "a list")
    if not pa.types.is_null(ts[0]) and not T.comparable(ts[0].value_type, ts[1]):
        raise T._err(
            f"contains() looks for {T.name_of(ts[0].value_type)} items; "
            f"{T._text(c.args[1])} is {T.name_of(ts[1])}",
            c.args[1],
        )
    return pa.bool_()


def _t_count(c, ts):
    return pa.int64()


def _t_sum(c, ts):
    _need(c, 0, ts[0], T.is_numeric, "a number")
    t = ts[0]
    if pa.types.is_decimal(t):
        return pa.decimal128(38, t.scale)  # as SQL: sum(decimal(p, s)) is decimal(38, s)
    if pa.types.is_integer(t) or pa.types.is_null(t):
        return pa.int64()
    return pa.float64()


def _t_avg(c, ts):
    _need(c, 0, ts[0], T.is_numeric, "a number")
    return pa.float64()


def _t_minmax(c, ts):
    _need(
        c,
        0,
        ts[0],
        lambda t: T._class(t) in ("number", "str", "time", "bool", "interval"),
        "an ordered value",
    )
    return ts[0]


# ---------------------------------------------------------------- engine forms

_NT = _ax.NotTranslatable


def _unary_sql(fn: str, accept: Callable[[Any], bool], result: Any = None) -> SqlForm:
    def form(dialect, args, const):
        import sqlalchemy as sa

        a, ta, _ = args[0]
        if accept is _text_t:
            _text_arg(fn, dialect, ta)
        elif not accept(ta):
            raise _NT(f"{fn}() of {ta} is not pushed")
        return getattr(sa.func, fn)(a), (result(ta) if callable(result) else result or ta)

    return form


def _text_t(t: Any) -> bool:
    return t is None or T.is_text(t) or pa.types.is_null(t)


#: dialects whose string semantics (case, trailing spaces, character counts) are known:
#: the SQL connector compares their strings exactly
TEXT_DIALECTS = ("mysql", "mariadb", "postgresql")


def _text_arg(fn: str, dialect: str, t: Any) -> None:
    if not _text_t(t):
        raise _NT(f"{fn}() of a non-string")
    if dialect not in TEXT_DIALECTS:
        raise _NT(f"{fn}(): string semantics of {dialect} are not known")


def _exact_num(t: Any) -> bool:
    """Integers and decimals: SQL rounds them half away from zero everywhere (floats are
    rounded half to even by PostgreSQL and by MariaDB's C library)."""
    return t is not None and (pa.types.is_integer(t) or pa.types.is_decimal(t))


def _num(t: Any) -> bool:
    return t is not None and T.is_numeric(t)


def _arrow_round(c, go, const):
    digits = int(const(c.args[1])) if len(c.args) == 2 else 0
    return pc.round(go(c.args[0]), digits, round_mode="half_towards_infinity")


def _sql_round(dialect, args, const):
    import sqlalchemy as sa

    a, ta, _ = args[0]
    if not _exact_num(ta):
        raise _NT("round() of a float differs between databases (half to even); not pushed")
    digits = int(const(args[1][2])) if len(args) == 2 else 0
    return sa.func.round(a, digits), ta


def _duck_round(c, args, const):
    digits = int(const(c.args[1])) if len(c.args) == 2 else 0
    return f"round({args[0]}, {digits})"


def _unit(const: Callable[[Expr], Any], e: Expr, allowed: Mapping[str, Any]) -> str:
    u = str(const(e)).lower()
    if u not in allowed:
        raise _NT(f"unknown unit {u!r}; one of {', '.join(allowed)}")
    return u


def _arrow_trunc(c, go, const):
    u = _unit(const, c.args[0], TRUNC_UNITS)
    return pc.floor_temporal(go(c.args[1]), unit=u, week_starts_monday=True)


def _duck_trunc(c, args, const):
    u = _unit(const, c.args[0], TRUNC_UNITS)
    return f"date_trunc('{u}', {args[1]})"


def _sql_trunc(dialect, args, const):
    import sqlalchemy as sa

    if dialect != "postgresql":
        raise _NT(f"date_trunc() has no {dialect} form")
    a, ta, _ = args[1]
    u = _unit(const, args[0][2], TRUNC_UNITS)
    if u in ("millisecond", "microsecond"):
        raise _NT("sub-second date_trunc() is not pushed")
    if pa.types.is_date(ta):
        raise _NT("date_trunc() of a date is a timestamp in PostgreSQL; not pushed")
    return sa.func.date_trunc(u, a), ta


def _arrow_part(c, go, const):
    u = _unit(const, c.args[0], PART_UNITS)
    fn, opts = PART_UNITS[u]
    return getattr(pc, fn)(go(c.args[1]), **opts).cast(pa.int64())


def _duck_part(c, args, const):
    u = _unit(const, c.args[0], PART_UNITS)
    return f"CAST(date_part('{u}', {args[1]}) AS BIGINT)"


_SQL_PARTS = {
    "postgresql": (
        "year",
        "quarter",
        "month",
        "day",
        "hour",
        "minute",
        "week",
        "dow",
        "isodow",
        "doy",
    ),
    "mysql": ("year", "quarter", "month", "day", "hour", "minute", "second"),
}


def _sql_part(dialect, args, const):
    import sqlalchemy as sa

    u = _unit(const, args[0][2], PART_UNITS)
    key = "mysql" if dialect in ("mysql", "mariadb") else dialect
    if u not in _SQL_PARTS.get(key, ()):
        raise _NT(f"date_part('{u}') has no {dialect} form here")
    a = args[1][0]
    return sa.cast(sa.extract(u, a), sa.BigInteger()), pa.int64()


def _arrow_substring(c, go, const):
    start = int(const(c.args[1])) - 1
    if len(c.args) == 3:
        return pc.utf8_slice_codeunits(go(c.args[0]), start, start + int(const(c.args[2])))
    return pc.utf8_slice_codeunits(go(c.args[0]), start)


def _duck_substring(c, args, const):
    start = int(const(c.args[1]))
    if len(c.args) == 3:
        return f"substring({args[0]}, {start}, {int(const(c.args[2]))})"
    return f"substring({args[0]}, {start})"


def _sql_substring(dialect, args, const):
    import sqlalchemy as sa

    a, ta, _ = args[0]
    _text_arg("substring", dialect, ta)
    start = int(const(args[1][2]))
    if len(args) == 3:
        return sa.func.substr(a, start, int(const(args[2][2]))), pa.string()
    return sa.func.substr(a, start), pa.string()


def _sql_trim(dialect, args, const):
    import sqlalchemy as sa

    a, ta, _ = args[0]
    _text_arg("trim", dialect, ta)
    return sa.func.trim(a), pa.string()


def _sql_coalesce(dialect, args, const):
    import sqlalchemy as sa

    types = {str(t) for _, t, _ in args if t is not None}
    if len(types) > 1:
        raise _NT("coalesce() over different types")
    return sa.func.coalesce(*[v for v, _, _ in args]), next(
        (t for _, t, _ in args if t is not None), None
    )


def _sql_length(dialect, args, const):
    import sqlalchemy as sa

    a, ta, _ = args[0]
    _text_arg("length", dialect, ta)
    return sa.func.char_length(a), pa.int64()


def _arrow_match(c, go, const):
    import re

    tokens = _ax.match_tokens(str(const(c.args[1])))
    if not tokens:
        return pc.scalar(False)
    target = go(c.args[0])
    r = None
    for t in tokens:  # every token of the query is a word of the column (case-insensitive)
        m = pc.match_substring_regex(target, rf"(?i)(^|\W){re.escape(t)}($|\W)")
        r = m if r is None else r & m
    return r


def _duck_match(c, args, const):
    import re

    tokens = _ax.match_tokens(str(const(c.args[1])))
    if not tokens:
        return "FALSE"
    for t in tokens:  # a token is \w+ only: safe inside a quoted literal
        assert "'" not in t
    parts = [f"regexp_matches({args[0]}, '(?i)(^|\\W){re.escape(t)}($|\\W)')" for t in tokens]
    return "(" + " AND ".join(parts) + ")"


def _arrow_geo(values: list[Any]) -> pa.Array:
    p = values[2] if len(values) == 3 else 6
    return geo_hash(values[0], values[1], int(_first(p)))


def _duck_geo(c, args, const):
    p = int(const(c.args[2])) if len(c.args) == 3 else 6
    return f"geo_hash(CAST({args[0]} AS DOUBLE), CAST({args[1]} AS DOUBLE), {p})"


def _first(v: Any) -> Any:
    if isinstance(v, pa.ChunkedArray | pa.Array):
        return v[0].as_py() if len(v) else 6
    return v


def _fn(name: str) -> DuckForm:
    return lambda c, args, const: f"{name}({', '.join(args)})"


def _arrow_fn(fn: Callable[..., Any]) -> ArrowForm:
    return lambda c, go, const: fn(*[go(a) for a in c.args])


def _duck_agg(name: str) -> DuckForm:
    def form(c, args, const):
        if name == "count" and (not c.args or isinstance(c.args[0], A.Star)):
            return "count(*)"
        if name == "count_distinct":
            return f"count(DISTINCT {args[0]})"
        return f"{name}({'DISTINCT ' if c.distinct else ''}{', '.join(args)})"

    return form


for _f in (
    Function("now", 0, 0, _t_now, doc="the query's one instant (UTC)"),
    Function(
        "lower",
        1,
        1,
        _t_text,
        arrow=_arrow_fn(pc.utf8_lower),
        duckdb=_fn("lower"),
        # no SQL form: MariaDB and PostgreSQL map case by their collation ('ß' stays or
        # becomes 'SS' where pyarrow and DuckDB give 'ẞ'), so a pushed filter dropped rows
        # (tests/connectors/test_sql_collation.py); the fabric evaluates it
    ),
    Function(
        "upper",
        1,
        1,
        _t_text,
        arrow=_arrow_fn(pc.utf8_upper),
        duckdb=_fn("upper"),
        # no SQL form: MariaDB and PostgreSQL map case by their collation ('ß' stays or
        # becomes 'SS' where pyarrow and DuckDB give 'ẞ'), so a pushed filter dropped rows
        # (tests/connectors/test_sql_collation.py); the fabric evaluates it
    ),
    Function(
        "trim",
        1,
        1,
        _t_text,
        arrow=lambda c, go, const: pc.utf8_trim(go(c.args[0]), characters=" "),
        duckdb=_fn("trim"),
        sql=_sql_trim,
        doc="leading and trailing spaces removed (spaces only, as SQL)",
    ),
    Function(
        "length",
        1,
        1,
        _t_length,
        arrow=_arrow_fn(pc.utf8_length),
        duckdb=_fn("length"),
        sql=_sql_length,
        doc="characters of a text (items of a list)",
    ),
    Function(
        "abs",
        1,
        1,
        _t_abs,
        arrow=_arrow_fn(pc.abs_checked),
        duckdb=_fn("abs"),
        sql=_unary_sql("abs", _num),
    ),
    Function(
        "round",
        1,
        2,
        _t_round,
        arrow=_arrow_round,
        duckdb=_duck_round,
        sql=_sql_round,
        constant_args=(1,),
        doc="half away from zero, to a constant number of digits",
    ),
    Function(
        "floor",
        1,
        1,
        _t_floor,
        arrow=_arrow_fn(pc.floor),
        duckdb=_fn("floor"),
        sql=_unary_sql("floor", _num),
    ),
    Function(
        "ceil",
        1,
        1,
        _t_floor,
        arrow=_arrow_fn(pc.ceil),
        duckdb=_fn("ceil"),
        sql=_unary_sql("ceil", _num),
    ),
    Function(
        "coalesce",
        1,
        99,
        _t_coalesce,
        arrow=_arrow_fn(pc.coalesce),
        duckdb=_fn("coalesce"),
        sql=_sql_coalesce,
    ),
    Function(
        "geo_hash",
        2,
        3,
        _t_geo_hash,
        array=_arrow_geo,
        duckdb=_duck_geo,
        constant_args=(2,),
        doc="base32 geohash of (lat, lon), precision 1-12 (6)",
    ),
    Function(
        "match",
        2,
        2,
        _t_match,
        arrow=_arrow_match,
        duckdb=_duck_match,
        constant_args=(1,),
        doc="every word of the query is a word of the text (case-insensitive)",
    ),
    Function(
        "date_trunc",
        2,
        2,
        _t_date_trunc,
        arrow=_arrow_trunc,
        duckdb=_duck_trunc,
        sql=_sql_trunc,
        constant_args=(0,),
        doc="the timestamp truncated to a unit (weeks start on Monday)",
    ),
    Function(
        "date_part",
        2,
        2,
        _t_date_part,
        arrow=_arrow_part,
        duckdb=_duck_part,
        sql=_sql_part,
        constant_args=(0,),
        doc="a field of a timestamp or date as an integer (dow: Sunday = 0)",
    ),
    Function(
        "extract",
        2,
        2,
        _t_date_part,
        arrow=_arrow_part,
        duckdb=_duck_part,
        sql=_sql_part,
        constant_args=(0,),
        doc="extract(field, ts): the same as date_part",
    ),
    Function(
        "substring",
        2,
        3,
        _t_substring,
        arrow=_arrow_substring,
        duckdb=_duck_substring,
        sql=_sql_substring,
        constant_args=(1, 2),
        doc="substring(text, start[, length]); characters counted from 1",
    ),
    Function(
        "contains",
        2,
        2,
        _t_contains,
        duckdb=_fn("list_contains"),
        doc="whether a list holds a value",
    ),
    Function(
        "cosine", 2, 2, _t_distance, duckdb=_fn("list_cosine_distance"), doc="1 - cosine similarity"
    ),
    Function("l2", 2, 2, _t_distance, duckdb=_fn("list_distance"), doc="Euclidean distance"),
    Function("dot", 2, 2, _t_distance, duckdb=_fn("list_inner_product"), doc="inner product"),
    Function("count", 0, 1, _t_count, duckdb=_duck_agg("count"), aggregate=True),
    Function("count_distinct", 1, 1, _t_count, duckdb=_duck_agg("count_distinct"), aggregate=True),
    Function("sum", 1, 1, _t_sum, duckdb=_duck_agg("sum"), aggregate=True),
    Function("avg", 1, 1, _t_avg, duckdb=_duck_agg("avg"), aggregate=True),
    Function("min", 1, 1, _t_minmax, duckdb=_duck_agg("min"), aggregate=True),
    Function("max", 1, 1, _t_minmax, duckdb=_duck_agg("max"), aggregate=True),
):
    register(_f)

# ---------------------------------------------------------------- case and cast
# ``case when c1 then r1 ... [else d] end`` parses to case(c1, r1, ..., [d]) (an odd count
# has an else); ``cast(x as T)`` to cast(x, 'T'). Neither is pushed to SQL or Mongo
# sources (no form: the source answers UNSUPPORTED and the fabric computes it).


def _t_case(c, ts):
    n = len(ts)
    if n < 2:
        raise T._err("case needs at least one 'when ... then ...'", c)
    results = [ts[i + 1] for i in range(0, n - 1, 2)] + ([ts[-1]] if n % 2 else [])
    exprs = [c.args[i + 1] for i in range(0, n - 1, 2)] + ([c.args[-1]] if n % 2 else [])
    for i in range(0, n - 1, 2):
        if not (pa.types.is_boolean(ts[i]) or pa.types.is_null(ts[i])):
            raise T._err(
                f"a 'when' of case must be a true/false condition; {T._text(c.args[i])} is "
                f"{T.name_of(ts[i])}",
                c.args[i],
                "compare it, e.g. when x > 0 then ...",
            )
    out = next((t for t in results if not pa.types.is_null(t)), pa.null())
    for t, e in zip(results, exprs, strict=True):
        if not T.comparable(out, t):
            raise T._err(
                f"the results of case must have one type; {T._text(e)} is {T.name_of(t)}, "
                f"expected {T.name_of(out)}",
                e,
            )
        if T.is_numeric(out) and T.is_numeric(t) and t != out:
            out = T.common_numeric(out, t)
    return out


def _arrow_case(c, go, const):
    a = c.args
    n = len(a)
    conds = [go(a[i]) for i in range(0, n - 1, 2)]
    results = [go(a[i + 1]) for i in range(0, n - 1, 2)] + ([go(a[-1])] if n % 2 else [])
    return pc.case_when(pc.make_struct(*conds), *results)  # a null condition is false


def _duck_case(c, args, const):
    n = len(args)
    whens = " ".join(f"WHEN {args[i]} THEN {args[i + 1]}" for i in range(0, n - 1, 2))
    return f"(CASE {whens}{f' ELSE {args[-1]}' if n % 2 else ''} END)"


def _cast_target(c: A.Call) -> pa.DataType:
    from dsl.parser import parse_type

    t = c.args[1]
    if not (isinstance(t, A.Literal) and isinstance(t.value, str)):
        raise T._err("the type of cast() must be written: cast(x as int)", c)
    return parse_type(t.value).arrow()


def _t_cast(c, ts):
    if T._class(ts[0]) in ("list", "struct"):
        raise T._err(f"cannot cast {T._text(c.args[0])} ({T.name_of(ts[0])})", c.args[0])
    return _cast_target(c)


_DUCK_CAST = {"int": "BIGINT", "float": "DOUBLE", "str": "VARCHAR", "bool": "BOOLEAN"}


def _duck_cast(c, args, const):
    t = _cast_target(c)
    if pa.types.is_decimal(t):
        name = f"DECIMAL({t.precision}, {t.scale})"
    elif pa.types.is_timestamp(t):
        name = "TIMESTAMPTZ"
    elif pa.types.is_date(t):
        name = "DATE"
    else:
        name = _DUCK_CAST[str(const(c.args[1]))]
    return f"CAST({args[0]} AS {name})"


for _f in (
    Function(
        "case",
        2,
        99,
        _t_case,
        arrow=_arrow_case,
        duckdb=_duck_case,
        doc="case when c then r ... [else d] end: the first r whose c is true (null: false)",
    ),
    Function(
        "cast",
        2,
        2,
        _t_cast,
        duckdb=_duck_cast,
        constant_args=(1,),
        doc="cast(x as T), T one of int, float, decimal(p,s), str, bool, date, timestamp (as SQL: "
        "float to int rounds)",
    ),
):
    register(_f)

if {f.name for f in REGISTRY.values() if f.aggregate} != set(A.AGGREGATES):  # pragma: no cover
    raise AssertionError("dsl.ast.AGGREGATES and the aggregates of the registry differ")


def check_call(c: A.Call, ts: list[pa.DataType]) -> pa.DataType:
    """The registered type rule of ``c`` (arity first); raises a positioned DslError."""
    f = REGISTRY[c.name]
    _arity(c, f.min_args, f.max_args)
    return f.type_rule(c, ts)


# ---------------------------------------------------------------- geo_hash

_BASE32 = np.frombuffer(b"0123456789bcdefghjkmnpqrstuvwxyz", dtype=np.uint8)


def geo_hash(lat: Any, lon: Any, precision: int = 6) -> pa.Array:
    """Standard base32 geohash of each (lat, lon) pair; null where either is null.

    Bits alternate longitude, latitude (longitude first); each bit halves the interval
    and is 1 when the value is >= the midpoint. Vectorized with numpy: 5 * precision
    comparisons over the whole column.

    >>> geo_hash(pa.array([57.64911]), pa.array([10.40744]), 11).to_pylist()
    ['u4pruydqqvj']
    """
    if not 1 <= int(precision) <= 12:
        raise ValueError(f"geo_hash precision must be between 1 and 12, got {precision}")
    precision = int(precision)
    lat_a = _as_float_array(lat)
    lon_a = _as_float_array(lon)
    valid = ~(np.isnan(lat_a) | np.isnan(lon_a))
    n = len(lat_a)
    bits = np.zeros((n, 5 * precision), dtype=np.uint8)
    lat_lo, lat_hi = np.full(n, -90.0), np.full(n, 90.0)
    lon_lo, lon_hi = np.full(n, -180.0), np.full(n, 180.0)
    for i in range(5 * precision):
        if i % 2 == 0:
            mid = (lon_lo + lon_hi) / 2
            up = lon_a >= mid
            lon_lo = np.where(up, mid, lon_lo)
            lon_hi = np.where(up, lon_hi, mid)
        else:
            mid = (lat_lo + lat_hi) / 2
            up = lat_a >= mid
            lat_lo = np.where(up, mid, lat_lo)
            lat_hi = np.where(up, lat_hi, mid)
        bits[:, i] = up
    groups = bits.reshape(n, precision, 5)
    codes = (groups * np.array([16, 8, 4, 2, 1], dtype=np.uint8)).sum(axis=2).astype(np.uint8)
    chars = _BASE32[codes].reshape(-1)
    offsets = np.arange(0, (n + 1) * precision, precision, dtype=np.int32)
    out = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes()))
    if not valid.all():
        out = pc.if_else(pa.array(valid), out, pa.scalar(None, pa.string()))
    return out


def _as_float_array(v: Any) -> np.ndarray:
    if isinstance(v, pa.ChunkedArray):
        v = v.combine_chunks()
    if isinstance(v, pa.Array):
        return pc.cast(v, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
    return np.asarray(v, dtype=np.float64)


# ---------------------------------------------------------------- evaluation over tables


def uses_array_functions(e: Expr) -> bool:
    """Whether ``e`` calls a function the fabric computes on arrays (not pyarrow compute)."""
    return any(
        isinstance(x, Call) and (f := REGISTRY.get(x.name)) is not None and f.array is not None
        for x in e.walk()
    )


uses_fabric_functions = uses_array_functions  # the older name


Resolver = Callable[[Column], str]
#: what pyarrow raises when it has no kernel for the types at hand
_ARROW_LACKS = (_ax.NotTranslatable, pa.ArrowNotImplementedError, pa.ArrowTypeError)


def evaluate(
    e: Expr,
    table: pa.Table,
    params: Mapping[str, Any],
    *,
    resolve: Resolver,
    now: dt.datetime | None = None,
) -> pa.Array | pa.ChunkedArray:
    """Evaluate ``e`` on every row of ``table`` (constants are broadcast): with pyarrow
    where every function has a pyarrow form, else with DuckDB over the same table."""
    if isinstance(e, Column):
        return table.column(resolve(e))
    if _ax.is_constant(e) and not uses_array_functions(e):
        with contextlib.suppress(_ax.NotTranslatable):
            v = _ax.eval_constant(e, params, now)
            return pa.array([v] * table.num_rows) if v is not None else pa.nulls(table.num_rows)
    try:
        ext, rewritten = _substitute(e, table, params, resolve, now)
        if isinstance(rewritten, Column):
            return ext.column(rewritten.name)
        expr = _ax.to_arrow(
            rewritten, params, column=lambda c: pc.field(c.name), now=now, schema=ext.schema
        )
        return pads.dataset(ext).to_table(columns={"__v": expr}).column("__v")
    except _ARROW_LACKS:
        return _duckdb_over(e, table, params, resolve, now, select=True).column(0)


def filter_table(
    table: pa.Table,
    predicate: Expr,
    params: Mapping[str, Any],
    *,
    resolve: Resolver,
    now: dt.datetime | None = None,
) -> pa.Table:
    """Rows of ``table`` where ``predicate`` is true (null counts as false)."""
    if table.num_rows == 0:
        return table
    try:
        extended, rewritten = _substitute(predicate, table, params, resolve, now)
        expr = _ax.to_arrow(
            rewritten, params, column=lambda c: pc.field(c.name), now=now, schema=extended.schema
        )
        out = extended.filter(expr)
        return out.select(table.column_names) if extended is not table else out
    except _ARROW_LACKS:
        return _duckdb_over(predicate, table, params, resolve, now, select=False)


def _duckdb_over(
    e: Expr,
    table: pa.Table,
    params: Mapping[str, Any],
    resolve: Resolver,
    now: dt.datetime | None,
    *,
    select: bool,
) -> pa.Table:
    """``e`` computed (select) or applied as a filter by DuckDB over ``table``."""
    from fabric.execute.sql import SqlBuilder

    b = SqlBuilder(params, now or _ax.utcnow())
    rel = b.table(table)
    bound = replace(e, lambda n: Column(resolve(n), None) if isinstance(n, Column) else None)
    sql = b.expr(bound, rel)
    if select:
        return b.run(f"SELECT {sql} AS __v FROM ({rel.sql}) AS q")
    out = b.run(f"SELECT * FROM ({rel.sql}) AS q WHERE {sql}")
    return out.cast(table.schema) if out.schema != table.schema else out


def _substitute(
    e: Expr, table: pa.Table, params: Mapping[str, Any], resolve: Resolver, now: dt.datetime | None
) -> tuple[pa.Table, Expr]:
    """Replace calls of array functions by temporary columns, columns by resolved names."""
    state = {"table": table, "n": 0}

    def fn(node: Expr) -> Expr | None:
        if isinstance(node, Column):
            return Column(resolve(node), None)
        f = REGISTRY.get(node.name) if isinstance(node, Call) else None
        if f is not None and f.array is not None:
            assert isinstance(node, Call)
            t = state["table"]
            values = f.array([_arg_value(a, t, params, now) for a in node.args])
            name = f"__fn{state['n']}"
            state["n"] += 1
            state["table"] = t.append_column(name, values)
            return Column(name, None)
        return None

    rewritten = replace(e, fn)
    return state["table"], rewritten


def _arg_value(a: Expr, table: pa.Table, params: Mapping[str, Any], now: dt.datetime | None) -> Any:
    # ``a`` was already rewritten bottom-up: columns carry resolved names.
    if isinstance(a, Column):
        return table.column(a.name)
    if isinstance(a, Literal):
        return a.value
    if _ax.is_constant(a):
        return _ax.eval_constant(a, params, now)
    expr = _ax.to_arrow(a, params, column=lambda c: pc.field(c.name), now=now, schema=table.schema)
    return pads.dataset(table).to_table(columns={"__v": expr}).column("__v")


# ---------------------------------------------------------------- DuckDB


def _duck_geo_hash(lat: pa.Array, lon: pa.Array, precision: pa.Array) -> pa.Array:
    p = precision[0].as_py() if len(precision) else 6
    return geo_hash(lat, lon, p)


def register_duckdb(con: Any) -> None:
    """Register the array functions as vectorized DuckDB functions on a connection (not
    on a cursor: the connection must outlive every query that calls them)."""
    import duckdb

    with contextlib.suppress(duckdb.CatalogException):  # already registered on this connection
        con.create_function(
            "geo_hash",
            _duck_geo_hash,
            [duckdb.sqltype("DOUBLE"), duckdb.sqltype("DOUBLE"), duckdb.sqltype("BIGINT")],
            duckdb.sqltype("VARCHAR"),
            type="arrow",
        )


#: functions computed by the fabric itself on arrays (not by pyarrow compute)
FABRIC_FUNCTIONS: dict[str, int] = {
    f.name: f.max_args for f in REGISTRY.values() if f.array is not None
}

__all__ = [
    "FABRIC_FUNCTIONS",
    "REGISTRY",
    "Function",
    "check_call",
    "evaluate",
    "filter_table",
    "geo_hash",
    "lookup",
    "register",
    "register_duckdb",
]
