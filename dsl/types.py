"""Value types of session parameters and declared schemas, and session binding.

Types are written ``int``, ``float``, ``str``, ``bool``, ``timestamp``, ``date``,
``bytes``, ``list[T]``, ``vector[N]`` (N float32 values) and, for session values only,
``encrypted[N]`` (a CKKS ciphertext of N slots, e.g. ``crypto.EncryptedVector``).

``bind_session(types, values)`` checks a session dict against the declared types and
returns the parameter dict the executor binds (vectors become ``np.float32`` arrays,
timestamps timezone-aware ``datetime`` in UTC). It never turns a value into query text.
"""

from __future__ import annotations

import datetime as dt
import decimal
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dsl.errors import Diagnostic, DslError, Span, did_you_mean

SCALAR_TYPES = ("int", "float", "decimal", "str", "bool", "timestamp", "date", "interval", "bytes")
PARAM_TYPES = (*SCALAR_TYPES, "list", "vector", "encrypted")
#: the types ``cast(x as T)`` converts to
CAST_TYPES = ("int", "float", "decimal", "str", "bool", "date", "timestamp")
DEFAULT_DECIMAL = (38, 9)
_ALIASES = {
    "integer": "int",
    "bigint": "int",
    "long": "int",
    "double": "float",
    "string": "str",
    "text": "str",
    "boolean": "bool",
    "datetime": "timestamp",
    "binary": "bytes",
    "numeric": "decimal",
    "varchar": "str",
}


def stage_param(stage: str, what: str) -> str:
    """The name of the bound parameter that carries a stage's result into an expression:
    ``stage:NAME.col`` (its one value), ``stage:NAME:list`` (its one column's values),
    ``stage:NAME:exists`` (whether it has rows). Session value names cannot hold ':'."""
    return f"stage:{stage}.{what}" if what not in ("list", "exists") else f"stage:{stage}:{what}"


def is_stage_param(name: str) -> bool:
    return name.startswith("stage:")


@dataclass(frozen=True)
class CalendarInterval:
    """An interval with months (``interval '3 months'``, ``'1 year 2 days'``): a month has no
    fixed length, so it is kept apart from the time part. ``date + interval`` adds the months
    first (the day is clamped to the month's end, as SQL), then the time part."""

    months: int
    delta: dt.timedelta = dt.timedelta(0)

    def __str__(self) -> str:
        y, m = divmod(abs(self.months), 12)
        sign = "-" if self.months < 0 else ""
        parts = [f"{sign}{y} year{'s' if y != 1 else ''}"] if y else []
        if m:
            parts.append(f"{sign}{m} month{'s' if m != 1 else ''}")
        days, secs = self.delta.days, self.delta.total_seconds() - self.delta.days * 86400
        if days:
            parts.append(f"{days} day{'s' if days != 1 else ''}")
        if secs:
            parts.append(f"{int(secs) if secs == int(secs) else secs} seconds")
        return " ".join(parts)

    def __neg__(self) -> CalendarInterval:
        return CalendarInterval(-self.months, -self.delta)

    def __add__(self, other: Any) -> Any:
        if isinstance(other, CalendarInterval):
            return CalendarInterval(self.months + other.months, self.delta + other.delta)
        if isinstance(other, dt.timedelta):
            return CalendarInterval(self.months, self.delta + other)
        if isinstance(other, dt.date):
            return self.shift(other)
        return NotImplemented

    __radd__ = __add__

    def __rsub__(self, other: Any) -> Any:
        if isinstance(other, dt.date):
            return (-self).shift(other)
        if isinstance(other, dt.timedelta):
            return CalendarInterval(-self.months, other - self.delta)
        return NotImplemented

    def shift(self, v: dt.date) -> dt.date:
        import calendar

        i = v.year * 12 + (v.month - 1) + self.months
        year, month = divmod(i, 12)
        day = min(v.day, calendar.monthrange(year, month + 1)[1])
        out = v.replace(year=year, month=month + 1, day=day)
        if not self.delta:
            return out
        if type(out) is dt.date and self.delta % dt.timedelta(days=1):
            out = dt.datetime(out.year, out.month, out.day)
        return out + self.delta


@dataclass(frozen=True)
class ValueType:
    """``kind`` is one of PARAM_TYPES; ``size`` for vector/encrypted (and a decimal's
    precision, with ``scale``); ``item`` for list."""

    kind: str
    size: int | None = None
    item: ValueType | None = None
    scale: int | None = None

    def __str__(self) -> str:
        if self.kind == "decimal" and self.size is not None:
            return f"decimal({self.size},{self.scale or 0})"
        if self.kind == "list":
            return f"list[{self.item}]"
        if self.kind in ("vector", "encrypted"):
            return f"{self.kind}[{self.size}]"
        return self.kind

    @property
    def encrypted(self) -> bool:
        return self.kind == "encrypted"

    def arrow(self) -> pa.DataType:
        """The Arrow type of a column or parameter of this type (encrypted: binary)."""
        k = self.kind
        if k == "int":
            return pa.int64()
        if k == "float":
            return pa.float64()
        if k == "decimal":
            p, s = (self.size, self.scale or 0) if self.size is not None else DEFAULT_DECIMAL
            return pa.decimal128(p, s)
        if k == "interval":
            return pa.duration("us")
        if k == "str":
            return pa.string()
        if k == "bool":
            return pa.bool_()
        if k == "timestamp":
            return pa.timestamp("us", tz="UTC")
        if k == "date":
            return pa.date32()
        if k in ("bytes", "encrypted"):
            return pa.binary()
        if k == "vector":
            return pa.list_(pa.float32(), self.size)
        assert self.item is not None
        return pa.list_(self.item.arrow())


def make_type(
    kind: str,
    arg: int | ValueType | tuple[int, ...] | None,
    span: Span | None,
    *,
    allow_encrypted: bool = True,
) -> ValueType:
    """Validate a parsed type (``name[arg]``); raises DslError at ``span``."""
    kind = _ALIASES.get(kind.lower(), kind.lower())
    kinds = PARAM_TYPES if allow_encrypted else tuple(k for k in PARAM_TYPES if k != "encrypted")
    if kind not in kinds:
        hint = did_you_mean(kind, kinds, "types")
        # 'integr' is closest to the alias 'integer': suggest what it stands for ('int')
        close = difflib.get_close_matches(kind, [*kinds, *_ALIASES], n=1, cutoff=0.6)
        if close and close[0] in _ALIASES and _ALIASES[close[0]] in kinds:
            listing = hint[hint.index("existing") :] if "existing" in hint else hint
            hint = f"did you mean '{_ALIASES[close[0]]}'? ({listing.rstrip(')')})"
        raise DslError.at(f"unknown type '{kind}'", span, hint)
    if kind == "decimal":
        if arg is None:
            return ValueType("decimal")
        raw = arg if isinstance(arg, tuple) else (arg,)
        args = [a for a in raw if isinstance(a, int) and not isinstance(a, bool)]
        if (
            len(args) != len(raw)
            or not 1 <= args[0] <= 38
            or len(args) > 2
            or (len(args) == 2 and not 0 <= args[1] <= args[0])
        ):
            raise DslError.at(
                "type 'decimal' takes (precision[, scale]) with 1 <= precision <= 38 and "
                "0 <= scale <= precision",
                span,
                "e.g. decimal(15,2)",
            )
        return ValueType("decimal", size=args[0], scale=args[1] if len(args) == 2 else 0)
    if isinstance(arg, tuple):
        raise DslError.at(f"type '{kind}' takes no (...) arguments", span, "only decimal(p,s) does")
    if kind in ("vector", "encrypted"):
        if not isinstance(arg, int) or isinstance(arg, bool) or arg <= 0:
            raise DslError.at(f"type '{kind}' needs a positive size, e.g. {kind}[384]", span)
        return ValueType(kind, size=arg)
    if kind == "list":
        if not isinstance(arg, ValueType) or arg.kind not in SCALAR_TYPES:
            raise DslError.at(
                "type 'list' needs a scalar item type, e.g. list[str]",
                span,
                f"item types: {', '.join(SCALAR_TYPES)}",
            )
        return ValueType("list", item=arg)
    if arg is not None:
        raise DslError.at(f"type '{kind}' takes no argument", span)
    return ValueType(kind)


def from_arrow(t: pa.DataType) -> str:
    """A short readable name of an Arrow type, as written in schemas (errors use it)."""
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    if pa.types.is_fixed_size_list(t):
        return f"vector[{t.list_size}]"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list[{from_arrow(t.value_type)}]"
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_duration(t):
        return "interval"
    return str(t)


# ------------------------------------------------------------------ binding


class SessionError(DslError, TypeError):
    """A session dict does not match the binding's declared session types."""


def _utc(v: dt.datetime) -> dt.datetime:
    return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)


_F32 = np.dtype(np.float32)


def coerce_value(t: ValueType, v: Any, name: str) -> Any:
    """Check and normalize one session value; raises ValueError naming what was expected."""
    k = t.kind
    if k == "int":
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"expected int, got {_describe(v)}")
        return int(v)
    if k == "float":
        if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
            raise ValueError(f"expected float, got {_describe(v)}")
        return float(v)
    if k == "decimal":
        if isinstance(v, bool) or not isinstance(
            v, int | float | str | decimal.Decimal | np.integer
        ):
            raise ValueError(f"expected decimal, got {_describe(v)}")
        try:
            d = decimal.Decimal(str(v)) if not isinstance(v, decimal.Decimal) else v
        except decimal.InvalidOperation:
            raise ValueError(f"expected a decimal number, got {v!r}") from None
        if not d.is_finite():
            raise ValueError(f"expected a finite decimal, got {v!r}")
        if t.size is not None:
            scale = t.scale or 0
            q = d.quantize(decimal.Decimal(1).scaleb(-scale))
            if q != d:  # never rounded quietly: the agent asked for a value we cannot hold
                raise ValueError(
                    f"{v!r} has more than {scale} decimal places, which {t} cannot hold; "
                    f"round it before sending it, or declare decimal({t.size},{_places(d)})"
                )
            if len(q.as_tuple().digits) > t.size:
                raise ValueError(f"{v!r} does not fit {t}")
            d = q
        return d
    if k == "interval":
        if isinstance(v, dt.timedelta | CalendarInterval):
            return v
        if isinstance(v, str):
            from dsl.parser import parse_interval

            try:
                return parse_interval(v, None)
            except DslError:
                raise ValueError(f"expected an interval such as '5 minutes', got {v!r}") from None
        raise ValueError(f"expected interval (timedelta or text like '3 days'), got {_describe(v)}")
    if k == "str":
        if not isinstance(v, str):
            raise ValueError(f"expected str, got {_describe(v)}")
        return v
    if k == "bool":
        if not isinstance(v, bool | np.bool_):
            raise ValueError(f"expected bool, got {_describe(v)}")
        return bool(v)
    if k == "timestamp":
        if isinstance(v, dt.datetime):
            return _utc(v)
        if isinstance(v, str):
            try:
                return _utc(dt.datetime.fromisoformat(v.replace("Z", "+00:00")))
            except ValueError:
                raise ValueError(f"expected an ISO-8601 timestamp, got {v!r}") from None
        raise ValueError(f"expected timestamp (datetime or ISO-8601 string), got {_describe(v)}")
    if k == "date":
        if isinstance(v, dt.datetime):
            return v.date()
        if isinstance(v, dt.date):
            return v
        if isinstance(v, str):
            try:
                return dt.date.fromisoformat(v)
            except ValueError:
                raise ValueError(f"expected an ISO-8601 date, got {v!r}") from None
        raise ValueError(f"expected date, got {_describe(v)}")
    if k == "bytes":
        if not isinstance(v, bytes | bytearray | memoryview):
            raise ValueError(f"expected bytes, got {_describe(v)}")
        return bytes(v)
    if k == "list":
        if isinstance(v, str | bytes) or not isinstance(
            v, list | tuple | set | frozenset | np.ndarray
        ):
            raise ValueError(f"expected {t} (a list), got {_describe(v)}")
        assert t.item is not None
        out = []
        for i, x in enumerate(v):
            try:
                out.append(coerce_value(t.item, x, name))
            except ValueError as e:
                raise ValueError(f"item {i}: {e}") from None
        return out
    if k == "vector":
        if isinstance(v, str | bytes) or not isinstance(v, list | tuple | np.ndarray):
            raise ValueError(
                f"expected {t} (a list or numpy array of {t.size} numbers), got {_describe(v)}"
            )
        try:
            arr = np.asarray(v, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"expected {t}: values must be numbers") from None
        if arr.ndim != 1 or arr.shape[0] != t.size:
            raise ValueError(f"expected {t}, got a vector of shape {tuple(arr.shape)}")
        return arr
    if k == "encrypted":
        size = getattr(v, "size", None)
        if size is None or not callable(getattr(v, "serialize", None)):
            raise ValueError(
                f"expected {t} (an encrypted vector, e.g. KeyRing.encrypt([...])), got {_describe(v)}"
            )
        if size != t.size:
            raise ValueError(f"expected {t}, got an encrypted vector of size {size}")
        return v
    raise ValueError(f"unsupported type {t}")


def _describe(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"numpy array of shape {v.shape}"
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def bind_session(
    types: Mapping[str, ValueType],
    values: Mapping[str, Any] | None,
    *,
    binding: str = "",
    spans: Mapping[str, Span] | None = None,
) -> dict[str, Any]:
    """Check ``values`` against ``types``: every declared value present, none extra, each of
    its type. Returns the normalized parameter dict. Raises SessionError listing every problem."""
    values = values or {}
    if not types and not values:
        return {}
    if len(values) == len(types):  # the common case, every value given and of its type
        fast: dict[str, Any] = {}
        try:
            for name, t in types.items():
                v = values[name]
                fast[name] = (
                    v  # a float32 vector of its size: what coerce_value returns, as it is
                    if t.kind == "vector"
                    and type(v) is np.ndarray
                    and v.dtype is _F32
                    and v.shape == (t.size,)
                    else coerce_value(t, v, name)
                )
        except (KeyError, ValueError):
            pass  # (the loop below says what is wrong)
        else:
            return fast
    where = f"binding '{binding}': " if binding else ""
    problems: list[Diagnostic] = []
    out: dict[str, Any] = {}
    for name, t in types.items():
        span = spans.get(name) if spans else None
        if name not in values:
            problems.append(
                Diagnostic(
                    f"{where}session value '{name}' ({t}) is missing",
                    span,
                    f"pass session={{'{name}': ...}}",
                )
            )
            continue
        try:
            out[name] = coerce_value(t, values[name], name)
        except ValueError as e:
            problems.append(
                Diagnostic(f"{where}session value '{name}': {e}", span, f"declared as {name}: {t}")
            )
    for name in values:
        if name not in types:
            declared = ", ".join(f"{n}: {t}" for n, t in types.items()) or "(none)"
            problems.append(
                Diagnostic(
                    f"{where}unexpected session value '{name}'",
                    None,
                    f"declared session values: {declared}",
                )
            )
    if problems:
        raise SessionError(problems)
    return out


def parse_cli_value(t: ValueType, text: str) -> Any:
    """A session value written on a command line (``--session user_id=42``)."""
    if t.kind == "str":
        return text
    if t.kind in ("int", "float", "bool", "list", "vector"):
        try:
            v = json.loads(text)
        except json.JSONDecodeError:
            if t.kind == "list":
                return (
                    [parse_cli_value(t.item, x.strip()) for x in text.split(",")]
                    if t.item
                    else text
                )
            return text
        if t.kind == "list" and t.item is not None and t.item.kind == "str" and isinstance(v, list):
            return [str(x) for x in v]
        return v
    return text


def infer_type(v: Any) -> ValueType:
    """The session type of a Python value (for ad-hoc text queries without declarations)."""
    if isinstance(v, bool | np.bool_):
        return ValueType("bool")
    if isinstance(v, int | np.integer):
        return ValueType("int")
    if isinstance(v, float | np.floating):
        return ValueType("float")
    if isinstance(v, str):
        return ValueType("str")
    if isinstance(v, dt.datetime):
        return ValueType("timestamp")
    if isinstance(v, dt.date):
        return ValueType("date")
    if isinstance(v, decimal.Decimal):
        return ValueType("decimal")
    if isinstance(v, dt.timedelta | CalendarInterval):
        return ValueType("interval")
    if isinstance(v, bytes):
        return ValueType("bytes")
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind == "f":
        return ValueType("vector", size=int(v.shape[0]))
    if isinstance(v, list | tuple) and v:
        items = {infer_type(x) for x in v}
        if len(items) == 1:
            it = items.pop()
            if it.kind in SCALAR_TYPES:
                return ValueType("list", item=it)
        if items <= {ValueType("int"), ValueType("float")}:
            return ValueType("list", item=ValueType("float"))
    if getattr(v, "size", None) is not None and callable(getattr(v, "serialize", None)):
        return ValueType("encrypted", size=int(v.size))
    raise TypeError(f"cannot infer a session type for {_describe(v)}; declare it (session x: type)")


def _places(d: decimal.Decimal) -> int:
    """Digits after the point in ``d`` once trailing zeros are dropped."""
    exp = d.normalize().as_tuple().exponent
    return max(0, -exp) if isinstance(exp, int) else 0
