"""Translate ``dsl.ast`` expressions to pyarrow compute.

Used wherever the fabric itself applies a filter or a derived column on Arrow data:
residual filters above a scan, S3 dataset pushdown (``pyarrow.dataset`` expressions),
Kafka-scanned batches, and indexed datasets. Constant sub-trees (``now() - interval
'5 minutes'``, session parameters) are folded to scalars first, with the session values
bound as Arrow scalars, never as text.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

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
    Unary,
)
from dsl.errors import FabricError
from dsl.types import CalendarInterval


class NotTranslatable(FabricError, ValueError):
    """The expression uses something pyarrow compute cannot evaluate here."""


_CMP = {
    "=": "equal",
    "!=": "not_equal",
    "<": "less",
    "<=": "less_equal",
    ">": "greater",
    ">=": "greater_equal",
}
_ARITH = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}
_TOKEN = re.compile(r"\w+", re.UNICODE)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def is_constant(e: Expr) -> bool:
    """True when the expression refers to no column (params and now() are constants per query)."""
    return not e.columns() and not any(isinstance(x, Call) and x.is_aggregate for x in e.walk())


_is_constant = is_constant  # (to_arrow memoizes it per node)


def eval_constant(e: Expr, params: Mapping[str, Any], now: dt.datetime | None = None) -> Any:
    """Evaluate a column-free expression to a Python value."""
    if isinstance(e, Literal):
        return e.value
    if isinstance(e, Param):
        if e.name not in params:
            raise KeyError(f"session value {e.name!r} is not bound")
        return params[e.name]
    if isinstance(e, Call) and e.name == "now" and not e.args:
        return now or utcnow()
    if isinstance(e, Call) and e.name == "embed" and len(e.args) == 3:
        from fabric.embed import embed_one  # embed(session.q, 'model', dim): fabric.plan.builder

        model, dim = (eval_constant(a, params, now) for a in e.args[1:])
        return embed_one(eval_constant(e.args[0], params, now), model, dim)
    if isinstance(e, Unary):
        v = eval_constant(e.operand, params, now)
        if v is None:
            return None
        if e.op == "not":
            return not v
        return v.copy_negate() if isinstance(v, decimal.Decimal) else -v  # exact, no rounding
    if isinstance(e, Binary) and e.op in _ARITH:
        a, b = eval_constant(e.left, params, now), eval_constant(e.right, params, now)
        return arith(e.op, a, b)
    if isinstance(e, Binary) and e.op == "||":  # '%' || {{session.word}} || '%'
        a, b = eval_constant(e.left, params, now), eval_constant(e.right, params, now)
        return None if a is None or b is None else f"{a}{b}"
    if isinstance(e, Call):
        return _constant_call(e, params, now)
    if isinstance(e, Binary | IsNull | InList | Between | Like):
        return _constant_condition(e, params, now)
    raise NotTranslatable(f"cannot evaluate {e} as a constant")


def _constant_condition(e: Expr, params: Mapping[str, Any], now: dt.datetime | None) -> Any:
    """A condition on session values and literals alone (``{{session.n}} > 1``), with
    SQL's three-valued logic (None is unknown), computed once by pyarrow."""
    if isinstance(e, Binary) and e.op in ("and", "or"):
        a, b = eval_constant(e.left, params, now), eval_constant(e.right, params, now)
        if e.op == "and":
            return False if a is False or b is False else None if a is None or b is None else True
        return True if a is True or b is True else None if a is None or b is None else False
    if isinstance(e, IsNull):
        v = eval_constant(e.expr, params, now)
        return (v is not None) if e.negated else (v is None)
    const = partial(eval_constant, params=params, now=now)

    def arr(v: Any) -> pa.Array:
        return pa.array([_scalar(v)])

    def cmp(op: str, x: Any, y: Any) -> Any:
        if x is None or y is None:
            return None
        if isinstance(x, float) or isinstance(y, float):  # a decimal meets a float in floats
            x, y = _num_float(x), _num_float(y)
        if _is_nan_value(x) or _is_nan_value(y):  # DuckDB's order: NaN = NaN, above all
            rank = {"=": (0,), "!=": (-1, 1), "<": (-1,), "<=": (-1, 0), ">": (1,), ">=": (1, 0)}
            nx, ny = _is_nan_value(x), _is_nan_value(y)
            return (nx - ny if nx != ny else 0) in rank[op]
        return getattr(pc, _CMP[op])(arr(x), arr(y))[0].as_py()

    try:
        if isinstance(e, Binary) and e.op in _CMP:
            return cmp(e.op, const(e.left), const(e.right))
        if isinstance(e, Between):
            v = const(e.expr)
            lo, hi = cmp(">=", v, const(e.low)), cmp("<=", v, const(e.high))
            r = False if lo is False or hi is False else None if lo is None or hi is None else True
            return r if not e.negated or r is None else not r
        if isinstance(e, InList):
            v = const(e.expr)
            items = (
                list(params[e.items.name])
                if isinstance(e.items, Param)
                else [const(i) for i in e.items]
            )
            if not items:
                return e.negated
            hits = [cmp("=", v, i) for i in items]
            r = True if True in hits else None if None in hits else False
            return r if not e.negated or r is None else not r
        if isinstance(e, Like):
            v, pattern = const(e.expr), const(e.pattern)
            if v is None or pattern is None:
                return None
            r = match_like(arr(str(v)), str(pattern), e.case_insensitive)[0].as_py()
            return not r if e.negated else r
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise NotTranslatable(f"cannot evaluate {e} as a constant: {err}") from None
    raise NotTranslatable(f"cannot evaluate {e} as a constant")


_ONE_ROW = pa.table({"__one": [0]})


def _constant_call(e: Call, params: Mapping[str, Any], now: dt.datetime | None) -> Any:
    """A function of constants (``lower({{session.q}})``, ``date_trunc('month', now())``),
    computed once by its registered pyarrow form."""
    from fabric.functions import REGISTRY

    f = REGISTRY.get(e.name)
    if f is None or f.arrow is None or f.aggregate:
        raise NotTranslatable(f"cannot evaluate {e} as a constant")
    import pyarrow.dataset as pads

    expr = f.arrow(
        e,
        lambda a: pc.scalar(scalar(eval_constant(a, params, now))),
        lambda a: eval_constant(a, params, now),
    )
    try:
        return pads.dataset(_ONE_ROW).to_table(columns={"v": expr}).column(0)[0].as_py()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise NotTranslatable(f"cannot evaluate {e} as a constant: {err}") from None


_EXACT = decimal.Context(prec=200, Emax=999999, Emin=-999999)  # + - * of DECIMALs: exact


def arith(op: str, a: Any, b: Any) -> Any:
    """``a op b`` on constants with SQL's number semantics: decimals stay exact (with
    integers), a float makes the result a float, ``/`` divides as floats, null is null."""
    if a is None or b is None:
        return None
    if (isinstance(a, decimal.Decimal) or isinstance(b, decimal.Decimal)) and (
        isinstance(a, float) or isinstance(b, float) or op == "/"
    ):
        a, b = _num_float(a), _num_float(b)
    if isinstance(a, decimal.Decimal) or isinstance(b, decimal.Decimal):
        # exact, as SQL's DECIMAL: the default context rounds to 28 digits, fewer than a
        # DECIMAL(38, x) holds (9999999999999999999999999999.9 + 0 gave 1.000...E+28)
        fn = {"+": _EXACT.add, "-": _EXACT.subtract, "*": _EXACT.multiply}.get(op)
        if fn is not None:
            return fn(a, b)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if isinstance(a, int | float | decimal.Decimal) and isinstance(
        b, int | float | decimal.Decimal
    ):
        if b == 0:  # IEEE, as DuckDB: 1 / 0 is inf, 0 / 0 is nan
            return float("nan") if a == 0 else math.copysign(math.inf, a) * math.copysign(1, b)
        return float(a) / float(b)
    return a / b


def _num_float(v: Any) -> Any:
    return float(v) if isinstance(v, decimal.Decimal) else v


def _scalar(v: Any) -> Any:
    if isinstance(v, dt.datetime) and v.tzinfo is None:
        v = v.replace(tzinfo=dt.UTC)
    elif isinstance(v, dt.datetime) and v.utcoffset() != dt.timedelta(0):
        v = v.astimezone(dt.UTC)  # the same instant: pyarrow compares no two other zones
    if isinstance(v, CalendarInterval):  # pyarrow adds no months to a column
        raise NotTranslatable(f"an interval with months ({v}) over a column")
    return v


def scalar(v: Any) -> pa.Scalar:
    """A constant as an Arrow scalar of the narrowest type: an integer takes the smallest
    integer type holding it, so that next to a DECIMAL(15, 2) column it widens the
    decimal by its own digits only (an int64 would ask for DECIMAL(21, 2) and pyarrow
    raises 'Precision is not great enough'); a Decimal keeps its own precision."""
    v = _scalar(v)
    if isinstance(v, int) and not isinstance(v, bool):
        for t in (pa.int8(), pa.int16(), pa.int32()):
            bits = t.bit_width - 1
            if -(1 << bits) <= v < (1 << bits):
                return pa.scalar(v, t)
        return pa.scalar(v, pa.int64())
    if isinstance(v, decimal.Decimal):
        from fabric.plan.types import decimal_type

        if not v.is_finite():
            return pa.scalar(float(v))
        return pa.scalar(v, decimal_type(v))
    return pa.scalar(v)


def match_tokens(query: str) -> list[str]:
    return [t.lower() for t in _TOKEN.findall(query)]


ColumnResolver = Callable[[Column], pc.Expression]


def to_arrow(
    e: Expr,
    params: Mapping[str, Any],
    *,
    column: ColumnResolver | None = None,
    now: dt.datetime | None = None,
    schema: pa.Schema | None = None,
) -> pc.Expression:
    """A ``pyarrow.compute.Expression`` for ``e``; raises NotTranslatable.

    ``schema`` (the types of the columns) lets comparisons between a DECIMAL and a float
    be made as SQL makes them, in floats: pyarrow casts the float to the decimal's type
    instead (``decimal(15, 2) -4.77 = -4.77`` is false there). Without it, a comparison
    with a decimal or float constant is made in floats (exact for up to 15 digits)."""
    col = column or (lambda c: pc.field(*c.name.split(".")) if "." in c.name else pc.field(c.name))
    # per node of this translation (each walks the tree): is_constant, kind
    constants: dict[int, bool] = {}
    kinds: dict[int, str | None] = {}

    def is_constant(x: Expr) -> bool:
        r = constants.get(id(x))
        if r is None:
            r = constants[id(x)] = _is_constant(x)
        return r

    def kind(x: Expr) -> str | None:
        """'float', 'decimal', 'int' or None (not a number, or not known)."""
        if id(x) not in kinds:
            kinds[id(x)] = kind_of(x)
        return kinds[id(x)]

    def kind_of(x: Expr) -> str | None:
        if is_constant(x):
            try:
                v = eval_constant(x, params, now)
            except (NotTranslatable, KeyError, TypeError):
                return None
            if isinstance(v, bool):
                return None
            return (
                "decimal"
                if isinstance(v, decimal.Decimal)
                else "float"
                if isinstance(v, float)
                else "int"
                if isinstance(v, int)
                else None
            )
        if isinstance(x, Column):
            if schema is None:
                return None
            name = x.name
            if name not in schema.names:
                return None
            t = schema.field(name).type
            if pa.types.is_floating(t):
                return "float"
            if pa.types.is_decimal(t):
                return "decimal"
            return "int" if pa.types.is_integer(t) else None
        if isinstance(x, Binary) and x.op in _ARITH:
            if x.op == "/":
                return "float"
            ks = {kind(x.left), kind(x.right)}
            if None in ks:
                return None
            return "float" if "float" in ks else "decimal" if "decimal" in ks else "int"
        if isinstance(x, Unary) and x.op == "-":
            return kind(x.operand)
        if isinstance(x, Call) and x.name in ("abs", "round", "coalesce") and x.args:
            return kind(x.args[0])
        if isinstance(x, Call) and x.name in ("floor", "ceil") and x.args:
            k = kind(x.args[0])
            return "float" if k == "int" else k
        if isinstance(x, Call) and x.name in ("length", "date_part", "extract"):
            return "int"
        if isinstance(x, Call) and schema is not None:  # the function's own type rule
            return _kind_of_type(_call_type(x, schema))
        return None

    def const_as(x: Expr, want: str) -> Any:
        v = eval_constant(x, params, now)
        if v is None:
            return pc.scalar(None)
        if want == "float":
            return pc.scalar(float(v))
        return pc.scalar(scalar(decimal.Decimal(repr(v)) if isinstance(v, float) else v))

    def pair(a: Expr, b: Expr) -> tuple[Any, Any]:
        """Comparison operands as SQL compares a DECIMAL with a float. pyarrow would cast
        the float to the decimal's type, and its decimal-to-float cast is not correctly
        rounded (-4.77 becomes -4.7700000000000005), so: a float constant next to a
        decimal becomes a decimal of its shortest digits; a decimal constant next to a
        float, a float; two expressions meet in floats through the decimal's text."""
        ka, kb = kind(a), kind(b)
        if {ka, kb} == {"decimal", "float"}:
            dec, flt = (a, b) if ka == "decimal" else (b, a)
            if is_constant(flt):
                out = {id(dec): go(dec), id(flt): const_as(flt, "decimal")}
            elif is_constant(dec):
                out = {id(dec): const_as(dec, "float"), id(flt): go(flt)}
            else:
                out = {id(dec): _decimal_to_float(go(dec)), id(flt): go(flt)}
            return out[id(a)], out[id(b)]
        if {ka, kb} == {"int", "float"}:  # as DuckDB: the integer as a double, rounded
            # (pyarrow's implicit cast refused an integer past 2^53: 'Integer value
            # 9007199254740993 not in range', from f = 9007199254740993)
            num, flt = (a, b) if ka == "int" else (b, a)
            as_float = const_as(num, "float") if is_constant(num) else _int_to_float(go(num))
            out = {id(num): as_float, id(flt): go(flt)}
            return out[id(a)], out[id(b)]
        if schema is None:  # types unknown: a decimal or float constant meets in floats
            for c, o, kc, ko in ((a, b, ka, kb), (b, a, kb, ka)):
                if is_constant(c) and kc in ("decimal", "float") and ko is None:
                    ea, eo = const_as(c, "float"), _decimal_to_float(go(o))
                    return (ea, eo) if c is a else (eo, ea)
        return go(a), go(b)

    def constant(x: Expr) -> Any:
        """The value of a constant side (``_NOT_CONSTANT`` for an expression of columns)."""
        if not is_constant(x):
            return _NOT_CONSTANT
        try:
            return eval_constant(x, params, now)
        except (NotTranslatable, KeyError, TypeError):
            return _NOT_CONSTANT

    def compare(op: str, a: Expr, b: Expr) -> Any:
        """``a op b`` as DuckDB (and PostgreSQL) compare floats: NaN equals NaN and is
        greater than every other number (pyarrow's IEEE comparisons make NaN unordered:
        ``f > 1`` dropped NaN rows that the same filter above a join, run by DuckDB, kept)."""
        ea, eb = pair(a, b)
        plain = getattr(pc, _CMP[op])(ea, eb)
        ka, kb = kind(a), kind(b)
        va, vb = constant(a), constant(b)
        if va is None or vb is None:
            return plain  # a comparison with null is null
        numeric = ("int", "float", "decimal")
        nan_a, nan_b = _is_nan_value(va), _is_nan_value(vb)
        maybe_float = (
            "float" in (ka, kb)
            or nan_a
            or nan_b
            # a side of unknown type (no schema) next to a number may be a float
            or (ka is None and va is _NOT_CONSTANT and kb in numeric)
            or (kb is None and vb is _NOT_CONSTANT and ka in numeric)
        )
        if not maybe_float:
            return plain
        if va is not _NOT_CONSTANT and vb is _NOT_CONSTANT:  # the constant on the right
            op, ea, eb, ka, kb, va, vb, nan_a, nan_b = (
                _FLIP[op],
                eb,
                ea,
                kb,
                ka,
                vb,
                va,
                nan_b,
                nan_a,
            )
            plain = getattr(pc, _CMP[op])(ea, eb)
        na = _nan_test(ea, ka)
        if vb is not _NOT_CONSTANT:
            if not nan_b:  # NaN is never below a number, and above every one
                if ka in ("int", "decimal"):
                    return plain
                # NaN-ness stated either way, not left to IEEE: a Parquet row group's
                # statistics leave NaN out, and pyarrow pruned by them the group of
                # [0.5, NaN, 2.0] for not (v < 3), as if no value of it could pass
                return plain | na if op in (">", ">=", "!=") else plain & ~na
            # x op NaN: true or false by x's NaN-ness; null for a null x
            return {
                "=": na,
                ">=": na,
                "!=": ~na,
                "<": ~na,
                "<=": na | ~na,
                ">": na & ~na,
            }[op]
        nb = _nan_test(eb, kb)
        # either side NaN (null when either is null, as the comparison): DuckDB's answer
        either = _strict("or", na, nb)
        outcome = {
            "=": _strict("and", na, nb),
            "!=": _strict("xor", na, nb),
            "<": _strict("and", ~na, nb),
            "<=": nb,
            ">": _strict("and", na, ~nb),
            ">=": na,
        }[op]
        return pc.if_else(either, outcome, plain)

    def go(x: Expr) -> Any:
        if is_constant(x):
            v = eval_constant(x, params, now)
            if v is None and _is_condition(x):  # unknown: a null of type bool, so that
                return pc.scalar(pa.scalar(None, pa.bool_()))  # a filter of it keeps no row
            return pc.scalar(scalar(v))
        if isinstance(x, Column):
            t = _arg_type(x, schema) if schema is not None else None
            if t is not None and pa.types.is_timestamp(t) and t.tz != "UTC":
                # times are UTC in the fabric (and in DuckDB's session): pyarrow reads the
                # hour, day, ... of a zoned timestamp in its zone, refuses to compare a
                # zoneless one with a zoned value, or two zones of other units
                return col(x).cast(pa.timestamp(t.unit, "UTC"))
            return col(x)
        if isinstance(x, Binary):
            if x.op == "and":
                return go(x.left) & go(x.right)
            if x.op == "or":
                return go(x.left) | go(x.right)
            if x.op in _CMP:
                return compare(x.op, x.left, x.right)
            if x.op == "/":  # as DuckDB: a float division (7 / 2 is 3.5; 1 / 0 is inf)
                return pc.divide(go(x.left).cast(pa.float64()), go(x.right).cast(pa.float64()))
            if x.op in _ARITH:
                a, b = go(x.left), go(x.right)
                if {kind(x.left), kind(x.right)} == {"int", "float"}:
                    a, b = pair(x.left, x.right)  # the integer as a double (past 2^53)
                return getattr(pc, _ARITH[x.op] + "_checked")(a, b)
            if x.op == "||":
                return pc.binary_join_element_wise(go(x.left), go(x.right), "")
        if isinstance(x, Unary):
            return ~go(x.operand) if x.op == "not" else pc.negate(go(x.operand))
        if isinstance(x, IsNull):
            r = pc.is_null(go(x.expr))
            return ~r if x.negated else r
        if isinstance(x, InList):
            if isinstance(x.items, Param):
                values = list(params[x.items.name])
            else:
                if not all(is_constant(i) for i in x.items):
                    raise NotTranslatable(f"'in' list with column references: {x}")
                values = [eval_constant(i, params, now) for i in x.items]
            target = go(x.expr)
            nonnull = [_scalar(v) for v in values if v is not None]
            kt = kind(x.expr)
            has_dec = any(isinstance(v, decimal.Decimal) for v in nonnull)
            has_flt = any(isinstance(v, float) for v in nonnull)
            if kt == "float" or (kt is None and schema is None and (has_dec or has_flt)):
                if kt is None:
                    target = _decimal_to_float(target)
                nonnull = [
                    float(v)
                    if isinstance(v, decimal.Decimal | int) and not isinstance(v, bool)
                    else v
                    for v in nonnull
                ]  # an integer as a double, as DuckDB compares them (2^53 + 1 is 2^53)
                if any(isinstance(v, float) and math.isnan(v) for v in nonnull):
                    # pc.is_in tells NaNs apart by their bits (inf - inf is a negative
                    # NaN): one NaN on both sides, as DuckDB's joins and 'in' match them
                    target = pc.if_else(pc.is_nan(target), pa.scalar(math.nan), target)
                    nonnull = [math.nan if v != v else v for v in nonnull]
                if any(isinstance(v, int | float) and v == 0 for v in nonnull):  # 0 or 0.0
                    # pc.is_in tells -0.0 from 0.0; SQL and DuckDB's joins do not (a
                    # dynamic filter's keys -0.0 dropped the rows of 0.0 the join kept)
                    nonnull = [*nonnull, 0.0, -0.0]
            elif kt == "int" and any(isinstance(v, decimal.Decimal) for v in nonnull):
                # an integer equals only an integral decimal (1 = 1.0; 1.5 matches none):
                # pc.is_in of integers in a decimal value set raised ArrowInvalid
                nonnull = [
                    int(v) if isinstance(v, decimal.Decimal) else v
                    for v in nonnull
                    if not isinstance(v, decimal.Decimal) or v == v.to_integral_value()
                ]
            elif kt == "decimal" and all(
                isinstance(v, int | float | decimal.Decimal) and not isinstance(v, bool)
                for v in nonnull
            ):
                nonnull = [
                    decimal.Decimal(repr(v)) if isinstance(v, float) else decimal.Decimal(v)
                    for v in nonnull
                ]
            if not values:
                r = pc.scalar(False)
                return ~r if x.negated else r
            r = pc.is_in(target, value_set=pa.array(nonnull)) if nonnull else pc.scalar(False)
            # SQL: a null operand, or no match in a list holding a null, is unknown (null)
            listed_null = any(v is None for v in values)
            unknown = pc.is_null(target) | ~r if listed_null else pc.is_null(target)
            r = pc.if_else(unknown, pa.scalar(None, pa.bool_()), r)
            return ~r if x.negated else r
        if isinstance(x, Between):
            r = compare(">=", x.expr, x.low) & compare("<=", x.expr, x.high)
            return ~r if x.negated else r
        if isinstance(x, Like):
            if not is_constant(x.pattern):
                raise NotTranslatable(f"'like' with a non-constant pattern: {x}")
            pattern = str(eval_constant(x.pattern, params, now))
            r = match_like(go(x.expr), pattern, x.case_insensitive)
            return ~r if x.negated else r
        if isinstance(x, Call):
            return _call(x, go, params, now)
        raise NotTranslatable(f"cannot apply {x} with pyarrow")

    return go(e)


ANY, ONE = "%", "_"  # LIKE wildcard tokens; literal text is a (text,) tuple


def like_tokens(pattern: str) -> list[str | tuple[str]]:
    """SQL LIKE pattern (``%``, ``_``, backslash escapes) -> tokens: ``ANY``, ``ONE`` or a
    literal ``(text,)``; a run of ``%`` is one ``ANY``.

    >>> like_tokens("a%%b_c")
    [('a',), '%', ('b',), '_', ('c',)]
    """
    out: list[str | tuple[str]] = []
    lit: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            lit.append(pattern[i + 1])
            i += 2
            continue
        if ch in (ANY, ONE):
            if lit:
                out.append(("".join(lit),))
                lit = []
            if not (ch == ANY and out and out[-1] == ANY):
                out.append(ch)
        else:
            lit.append(ch)
        i += 1
    if lit:
        out.append(("".join(lit),))
    return out


def _re2_literal(text: str) -> str:
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def match_like(values: Any, pattern: str, ignore_case: bool = False) -> Any:
    """``values LIKE pattern`` (an array or expression): pyarrow's own ``match_like``
    rewrites ``'%\\\\'`` (ends with a backslash) to an ends-with test of two backslashes
    (pyarrow 26: 'a\\' did not match, 'a\\\\' did), so the pattern is tokenized here
    and becomes a plain string test or an anchored RE2 regex (linear time).

    ``ilike`` is DuckDB's: both sides lowered character by character (``lower``), then
    ``like``. RE2's case-insensitive match folds by Unicode case orbits instead: 'ſ'
    matched 's' and 'İ' did not match 'i', where DuckDB answers the other way."""
    if ignore_case:
        values = pc.utf8_lower(values)
        pattern = pc.utf8_lower(pa.scalar(pattern, pa.string())).as_py()
    toks = like_tokens(pattern)
    lit = [t[0] for t in toks if isinstance(t, tuple)]
    if ONE not in toks and len(lit) == 1:
        (text,) = lit
        shape = tuple(t if t == ANY else "x" for t in toks)
        if shape == ("x",):
            return pc.equal(values, pa.scalar(text))
        if shape == ("x", ANY):
            return pc.starts_with(values, pattern=text)
        if shape == (ANY, "x"):
            return pc.ends_with(values, pattern=text)
        if shape == (ANY, "x", ANY):
            return pc.match_substring(values, pattern=text)
    body = "".join(".*" if t == ANY else "." if t == ONE else _re2_literal(t[0]) for t in toks)
    rx = "(?s)^" + body + "$"
    return pc.match_substring_regex(values, pattern=rx)


def canonical_floats(values: Any) -> Any:
    """Float values (an array or an expression) as keys compare in SQL: every NaN one NaN
    (pyarrow's hashing, so ``group_by``, ``unique`` and ``is_in``, tells NaNs apart by
    their bits: ``inf - inf`` gives the negative NaN 0xfff8..., ``float('nan')`` the
    positive one) and -0.0 as 0.0 (x + 0.0); DuckDB groups, joins and matches them as one."""
    return pc.if_else(pc.is_nan(values), pa.scalar(math.nan), pc.add(values, 0.0))


def sort_indices(table: pa.Table, sort_keys: Sequence[tuple[str, ...]]) -> pa.Array:
    """``pc.sort_indices(table, sort_keys=...)`` (keys ``(name, order[, null_placement])``)
    in DuckDB's order: NaN above every number, so first when descending. pyarrow places
    NaN with the nulls' placement, last in both directions (``order_by: f desc, limit: 3``
    answered [inf, 2.0, 1.5] for DuckDB's [NaN, NaN, inf])."""
    keys: list[tuple[str, str, str]] = []
    for k in sort_keys:
        name, order = k[0], k[1]
        placement = k[2] if len(k) > 2 else "at_end"
        col = table.column(name)
        if pa.types.is_floating(col.type) and pc.any(pc.is_nan(col)).as_py():
            aux = f"__nan{len(keys)}"
            while aux in table.column_names:
                aux += "_"
            table = table.append_column(aux, pc.is_nan(col))  # NaN: true, above false
            keys.append((aux, order, placement))
        keys.append((name, order, placement))
    return pc.sort_indices(table, sort_keys=keys)


_NOT_CONSTANT = object()
_FLIP = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _is_nan_value(v: Any) -> bool:
    return (isinstance(v, float) and math.isnan(v)) or (
        isinstance(v, decimal.Decimal) and v.is_nan()
    )


def _is_condition(e: Expr) -> bool:
    return isinstance(e, IsNull | InList | Between | Like) or (
        (isinstance(e, Binary) and (e.op in _CMP or e.op in ("and", "or")))
        or (isinstance(e, Unary) and e.op == "not")
    )


def _strict(fn: str, a: Any, b: Any) -> Any:
    """``a fn b`` ('and', 'or', 'xor') null when either is null (not Kleene's logic).
    ``pc.and_`` / ``pc.or_`` over expressions name the functions 'and_' / 'or_', which
    pyarrow does not have."""
    return pc.Expression._call(fn, [a, b])


def _nan_test(e: Any, k: str | None) -> Any:
    """Whether ``e`` is NaN, null where ``e`` is null: ``is_nan`` for a float, ``e != e``
    for a side of unknown type (true exactly for NaN), false (or null) for other numbers."""
    return pc.is_nan(e) if k == "float" else pc.not_equal(e, e)


def _arg_type(e: Expr, schema: pa.Schema) -> pa.DataType | None:
    if isinstance(e, Column):
        return schema.field(e.name).type if e.name in schema.names else None
    return _call_type(e, schema) if isinstance(e, Call) else None


_ENVS: dict[int, tuple[pa.Schema, Any]] = {}


def _call_type(x: Call, schema: pa.Schema) -> pa.DataType | None:
    """The type of a function call over ``schema``'s columns by the registry's type rules
    (None: not known here, e.g. it takes a session value)."""
    from fabric.plan import types as T

    hit = _ENVS.get(id(schema))
    if hit is None or hit[0] is not schema:
        if len(_ENVS) > 256:
            _ENVS.clear()
        hit = _ENVS[id(schema)] = (schema, T.Env({f.name: f.type for f in schema}, {}))
    try:
        return T.infer(x, hit[1])
    except Exception:  # an unknown column, a session value, a rule that refuses: not known
        return None


def _kind_of_type(t: pa.DataType | None) -> str | None:
    if t is None:
        return None
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_decimal(t):
        return "decimal"
    return "int" if pa.types.is_integer(t) else None


def _int_to_float(e: Any) -> Any:
    """An integer expression as float64, rounded to the nearest double (past 2^53 too)."""
    return e.cast(pa.float64(), safe=False)


def _decimal_to_float(e: Any) -> Any:
    """A decimal (or any number) expression as float64, correctly rounded: through its
    text, since pyarrow's decimal-to-float cast is not (-4.77 -> -4.7700000000000005)."""
    return e.cast(pa.string()).cast(pa.float64())


def _call(
    x: Call, go: Callable[[Expr], Any], params: Mapping[str, Any], now: dt.datetime | None
) -> Any:
    from fabric.functions import REGISTRY

    f = REGISTRY.get(x.name)
    if f is None or f.arrow is None:
        raise NotTranslatable(f"function {x.name}() cannot be applied with pyarrow")

    def const(a: Expr) -> Any:
        if not is_constant(a):
            raise NotTranslatable(f"argument {a} of {x.name}() must be a constant here")
        return eval_constant(a, params, now)

    return f.arrow(x, go, const)


def translatable(e: Expr, params: Mapping[str, Any] | None = None) -> bool:
    """Whether ``to_arrow`` can translate ``e`` (params may be unbound at plan time)."""
    probe = dict(params or {})
    for p in e.params():
        probe.setdefault(p, [0] if param_is_list(e, p) else 0)
    try:
        to_arrow(e, probe)
        return True
    except (NotTranslatable, TypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


def param_is_list(e: Expr, name: str) -> bool:
    return any(
        isinstance(x, InList) and isinstance(x.items, Param) and x.items.name == name
        for x in e.walk()
    )


def filter_table(
    table: pa.Table,
    predicate: Expr | None,
    params: Mapping[str, Any],
    now: dt.datetime | None = None,
) -> pa.Table:
    """Apply a (residual) predicate to an Arrow table; null counts as false (SQL semantics)."""
    if predicate is None or table.num_rows == 0:
        return table
    return table.filter(to_arrow(predicate, params, now=now, schema=table.schema))
