"""Type inference and checking of binding expressions (Arrow types).

``infer(expr, columns, params)`` returns the Arrow type of an expression whose columns are
qualified (``m.status``), raising a positioned DslError for a type error: comparing a str
with an int, ``and`` over a number, an unknown function, a wrong argument count ...
Session values of type ``encrypted[N]`` have the marker type ``ENCRYPTED`` and may only
flow into the encrypted scoring functions.
"""

from __future__ import annotations

import decimal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyarrow as pa

from dsl import ast as A
from dsl.errors import DslError, did_you_mean
from dsl.types import ValueType, from_arrow

TIMESTAMP = pa.timestamp("us", tz="UTC")
DURATION = pa.duration("us")
#: marker type of an encrypted session value (a CKKS ciphertext); output columns of
#: EncryptedScore are plain binary (serialized ciphertexts)
ENCRYPTED = pa.struct([pa.field("__ckks_ciphertext__", pa.binary())])
ENCRYPTED_FUNCTIONS = ("dot", "weighted", "poly")


def name_of(t: pa.DataType) -> str:
    return from_arrow(t)


def is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t) or pa.types.is_date(t)


def is_vector(t: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(t) or (
        (pa.types.is_list(t) or pa.types.is_large_list(t)) and is_numeric(t.value_type)
    )


def _class(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if is_numeric(t):
        return "number"
    if is_text(t):
        return "str"
    if pa.types.is_boolean(t):
        return "bool"
    if is_temporal(t):
        return "time"
    if pa.types.is_duration(t):
        return "interval"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    if pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t):
        return "list"
    if pa.types.is_struct(t):
        return "struct"
    return str(t)


def comparable(a: pa.DataType, b: pa.DataType) -> bool:
    ca, cb = _class(a), _class(b)
    return ca == "null" or cb == "null" or ca == cb


def literal_type(lit: A.Literal) -> pa.DataType:
    t = lit.type
    if t == "int":
        return pa.int64()
    if t == "float":
        return pa.float64()
    if t == "decimal":
        return decimal_type(lit.value)
    if t == "str":
        return pa.string()
    if t == "bool":
        return pa.bool_()
    if t == "null":
        return pa.null()
    if t == "timestamp":
        return TIMESTAMP
    if t == "date":
        return pa.date32()
    if t == "interval":
        return DURATION
    if t == "list":
        vals = lit.value
        if all(isinstance(v, bool) for v in vals) and vals:
            return pa.list_(pa.bool_())
        if all(isinstance(v, str) for v in vals) and vals:
            return pa.list_(pa.string())
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            return pa.list_(pa.int64())
        return pa.list_(pa.float64())
    raise DslError.at(f"unknown literal type {t}", lit.span)


@dataclass(frozen=True)
class Env:
    """Types in scope: qualified column names -> Arrow type; session values -> declared type."""

    columns: Mapping[str, pa.DataType]
    params: Mapping[str, ValueType]


def _text(e: A.Expr) -> str:
    s = str(e)
    return s if len(s) <= 40 else s[:37] + "..."


def _err(msg: str, e: A.Expr, hint: str | None = None) -> DslError:
    return DslError.at(msg, e.span, hint)


def decimal_type(v: decimal.Decimal) -> pa.DataType:
    """The DECIMAL(p, s) of a decimal literal, as SQL types ``0.06`` (DECIMAL(3, 2))."""
    _, digits, exp = v.as_tuple()
    assert isinstance(exp, int)
    scale = max(0, -exp)
    precision = max(len(digits) + max(0, exp), scale + 1)
    return pa.decimal128(min(38, precision), min(38, scale))


def _as_decimal(t: pa.DataType, e: A.Expr | None = None) -> pa.DataType:
    """Integers in decimal arithmetic: an integer literal takes its own digits, an integer
    column DECIMAL(19, 0) (as SQL)."""
    if pa.types.is_decimal(t):
        return t
    if isinstance(e, A.Literal) and e.type == "int":
        return pa.decimal128(max(1, len(str(abs(e.value)))), 0)
    return pa.decimal128(19 if pa.types.is_integer(t) else 38, 0)


def common_numeric(
    a: pa.DataType,
    b: pa.DataType,
    op: str = "+",
    ea: A.Expr | None = None,
    eb: A.Expr | None = None,
) -> pa.DataType:
    """The type of ``a op b`` for numbers, as SQL: a float makes a float; decimals stay
    decimal (exact), integers stay integers; ``/`` is a float division."""
    if op == "/" or pa.types.is_floating(a) or pa.types.is_floating(b):
        return pa.float64()
    if pa.types.is_decimal(a) or pa.types.is_decimal(b):
        da, db = _as_decimal(a, ea), _as_decimal(b, eb)
        if op == "*":
            return pa.decimal128(min(38, da.precision + db.precision), min(38, da.scale + db.scale))
        scale = max(da.scale, db.scale)
        whole = max(da.precision - da.scale, db.precision - db.scale)
        return pa.decimal128(min(38, whole + scale + 1), scale)
    return pa.int64()


def infer(e: A.Expr, env: Env) -> pa.DataType:
    """The Arrow type of ``e``; raises DslError at the offending sub-expression."""
    if isinstance(e, A.Column):
        t = env.columns.get(e.qualified)
        if t is None:
            raise _err(f"unknown column '{e.qualified}'", e)
        return t
    if isinstance(e, A.Literal):
        return literal_type(e)
    if isinstance(e, A.Exists):  # its condition is checked by the builder, with the stage's columns
        return pa.bool_()
    if isinstance(e, A.Param):
        vt = env.params.get(e.name)
        if vt is None:
            raise _err(
                f"session value '{e.name}' is not declared",
                e,
                did_you_mean(e.name, env.params, "session values")
                if env.params
                else f"declare it: session: {{{e.name}: <type>}}",
            )
        return ENCRYPTED if vt.encrypted else vt.arrow()
    if isinstance(e, A.Star):
        raise _err("'*' is only allowed in count(*) and in select (m.*)", e)
    if isinstance(e, A.Unary):
        t = infer(e.operand, env)
        if e.op == "not":
            _bool(e.operand, t, "not")
            return pa.bool_()
        if not (is_numeric(t) or pa.types.is_duration(t) or pa.types.is_null(t)):
            raise _err(f"cannot negate {_text(e.operand)} ({name_of(t)})", e)
        return t
    if isinstance(e, A.Binary):
        return _binary(e, env)
    if isinstance(e, A.InList):
        t = infer(e.expr, env)
        if isinstance(e.items, A.Param):
            pt = infer(e.items, env)
            vt = env.params[e.items.name]
            if vt.kind != "list" or pt == ENCRYPTED:
                raise _err(
                    f"'in' needs a list session value; {{{{session.{e.items.name}}}}} is {vt}",
                    e.items,
                    f"declare it as list[{name_of(t)}]",
                )
            if not comparable(t, pt.value_type):
                raise _err(
                    f"cannot compare {_text(e.expr)} ({name_of(t)}) with items of "
                    f"{{{{session.{e.items.name}}}}} ({vt})",
                    e,
                )
        else:
            for it in e.items:
                it_t = infer(it, env)
                if not comparable(t, it_t):
                    raise _err(
                        f"cannot compare {_text(e.expr)} ({name_of(t)}) with {_text(it)} ({name_of(it_t)})",
                        it,
                        _cmp_hint(t, it),
                    )
        return pa.bool_()
    if isinstance(e, A.Between):
        t = infer(e.expr, env)
        for side in (e.low, e.high):
            st = infer(side, env)
            if not comparable(t, st):
                raise _err(
                    f"cannot compare {_text(e.expr)} ({name_of(t)}) with {_text(side)} ({name_of(st)})",
                    side,
                    _cmp_hint(t, side),
                )
        return pa.bool_()
    if isinstance(e, A.Like):
        for side in (e.expr, e.pattern):
            st = infer(side, env)
            if not (is_text(st) or pa.types.is_null(st)):
                raise _err(f"'like' needs text; {_text(side)} is {name_of(st)}", side)
        return pa.bool_()
    if isinstance(e, A.IsNull):
        infer(e.expr, env)
        return pa.bool_()
    if isinstance(e, A.Call):
        return _call(e, env)
    if isinstance(e, A.SortKey):
        return infer(e.expr, env)
    raise _err(f"unsupported expression {_text(e)}", e)


def _bool(e: A.Expr, t: pa.DataType, op: str) -> None:
    if not (pa.types.is_boolean(t) or pa.types.is_null(t)):
        raise _err(
            f"'{op}' needs true/false conditions; {_text(e)} is {name_of(t)}",
            e,
            "compare it, e.g. x > 0 or x = 'value'",
        )


def _cmp_hint(t: pa.DataType, other: A.Expr) -> str | None:
    if isinstance(other, A.Literal):
        if is_text(t) and other.type in ("int", "float", "decimal"):
            return f"quote the value: '{other.value}'"
        if is_temporal(t) and other.type == "str":
            return f"write a timestamp literal: timestamp '{other.value}'"
        if is_numeric(t) and other.type == "str":
            return "compare with a number (without quotes)"
    return None


def _binary(e: A.Binary, env: Env) -> pa.DataType:
    lt, rt = infer(e.left, env), infer(e.right, env)
    op = e.op
    if op in ("and", "or"):
        _bool(e.left, lt, op)
        _bool(e.right, rt, op)
        return pa.bool_()
    if lt == ENCRYPTED or rt == ENCRYPTED:
        raise _err(
            "an encrypted session value cannot be used here",
            e,
            f"encrypted values can only be scored in select with {', '.join(ENCRYPTED_FUNCTIONS)}()",
        )
    if op in A.COMPARISONS:
        if not comparable(lt, rt):
            hint = _cmp_hint(lt, e.right) or _cmp_hint(rt, e.left)
            raise _err(
                f"cannot compare {_text(e.left)} ({name_of(lt)}) with {_text(e.right)} ({name_of(rt)})",
                e,
                hint,
            )
        return pa.bool_()
    if op == "||":
        for side, t in ((e.left, lt), (e.right, rt)):
            if not (is_text(t) or pa.types.is_null(t)):
                raise _err(f"'||' joins text; {_text(side)} is {name_of(t)}", side)
        return pa.string()
    # arithmetic
    if is_numeric(lt) and is_numeric(rt):
        return common_numeric(lt, rt, op, e.left, e.right)
    if pa.types.is_null(lt):
        return rt
    if pa.types.is_null(rt):
        return lt
    if op in ("+", "-") and is_temporal(lt) and pa.types.is_duration(rt):
        return lt
    if op == "+" and pa.types.is_duration(lt) and is_temporal(rt):
        return rt
    if op == "-" and is_temporal(lt) and is_temporal(rt):
        return DURATION
    if op in ("+", "-") and pa.types.is_duration(lt) and pa.types.is_duration(rt):
        return DURATION
    raise _err(
        f"cannot apply '{op}' to {_text(e.left)} ({name_of(lt)}) and {_text(e.right)} ({name_of(rt)})",
        e,
    )


# ------------------------------------------------------------------ functions
# Each function's arity and type rule live in its entry of fabric.functions.REGISTRY.


def _arity(c: A.Call, lo: int, hi: int | None = None) -> None:
    hi = lo if hi is None else hi
    n = len(c.args)
    if not lo <= n <= hi:
        want = f"{lo}" if lo == hi else (f"{lo} to {hi}" if hi < 99 else f"at least {lo}")
        raise _err(f"{c.name}() takes {want} argument{'s' if hi != 1 else ''}, got {n}", c)


def _need(
    c: A.Call, i: int, t: pa.DataType, pred: Callable[[pa.DataType], bool], what: str
) -> None:
    if not (pred(t) or pa.types.is_null(t)):
        raise _err(
            f"argument {i + 1} of {c.name}() must be {what}; {_text(c.args[i])} is {name_of(t)}",
            c.args[i],
        )


def _functions():
    from fabric import functions

    return functions


def _call(c: A.Call, env: Env) -> pa.DataType:
    registry = _functions().REGISTRY
    fn = registry.get(c.name)
    if fn is None and c.name not in ENCRYPTED_FUNCTIONS:
        raise _err(
            f"unknown function {c.name}()",
            c,
            did_you_mean(c.name, set(registry) | set(ENCRYPTED_FUNCTIONS), "functions"),
        )
    if c.is_aggregate:
        for a in c.args:
            if any(isinstance(x, A.Call) and x.is_aggregate for x in a.walk()):
                raise _err(f"aggregate inside aggregate: {_text(c)}", a)
    if c.name == "count" and len(c.args) == 1 and isinstance(c.args[0], A.Star):
        return pa.int64()
    ts = [infer(a, env) for a in c.args]
    if any(t == ENCRYPTED for t in ts):
        return _encrypted_call(c, ts)
    if c.name in ("weighted", "poly"):
        raise _err(f"{c.name}() scores an encrypted session value; argument 1 must be one", c)
    if c.distinct and not c.is_aggregate:
        raise _err(f"'distinct' is only allowed in aggregates, not in {c.name}()", c)
    assert fn is not None
    return _functions().check_call(c, ts)


def _encrypted_call(c: A.Call, ts: list[pa.DataType]) -> pa.DataType:
    if c.name not in ENCRYPTED_FUNCTIONS:
        raise _err(
            f"{c.name}() cannot take an encrypted session value",
            c,
            f"encrypted values can only be scored with {', '.join(ENCRYPTED_FUNCTIONS)}()",
        )
    if ts[0] != ENCRYPTED:
        raise _err(f"the encrypted session value must be the first argument of {c.name}()", c)
    if any(t == ENCRYPTED for t in ts[1:]):
        raise _err(f"{c.name}() takes one encrypted value and plain values", c)
    if c.name == "dot":
        _arity(c, 2)
        _need(c, 1, ts[1], is_vector, "a vector column or a [..] list of numbers")
    elif c.name == "weighted":
        _arity(c, 2, 3)
        _need(c, 1, ts[1], is_vector, "a vector column or a [..] list of weights")
        if len(ts) == 3:
            _need(c, 2, ts[2], is_numeric, "a number (the bias)")
    else:  # poly(x, [c0, c1, ...]) elementwise polynomial
        _arity(c, 2)
        _need(c, 1, ts[1], is_vector, "a [..] list of coefficients")
    return ENCRYPTED


def vector_size(e: A.Expr, t: pa.DataType) -> int | None:
    """The length of a vector-typed expression, when known at plan time."""
    if pa.types.is_fixed_size_list(t):
        return t.list_size
    if isinstance(e, A.Literal) and e.type == "list":
        return len(e.value)
    return None
