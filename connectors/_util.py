"""Helpers shared by the server connectors: declared types, typed session values, timeouts.

Session values reach a connector as Python objects in ``ScanRequest.params``. Before a
value is bound (SQL bind parameter, typed Mongo value, Arrow scalar) it is checked
against the type of the column it is compared with (``typed_params``): a value that is
not of that type raises ``BadValueError`` naming the column and the session value, and a
dict or list compared with a string column is bound as its JSON text, so an operator
object such as ``{"$ne": null}`` is only ever a plain value.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
from collections.abc import Container, Iterator, Mapping
from typing import Any

import pyarrow as pa

from dsl.ast import Between, Binary, Call, Column, Expr, InList, Like, Param
from dsl.errors import FabricError

_SCALARS: dict[str, pa.DataType] = {
    "int": pa.int64(),
    "integer": pa.int64(),
    "bigint": pa.int64(),
    "float": pa.float64(),
    "double": pa.float64(),
    "str": pa.string(),
    "string": pa.string(),
    "text": pa.string(),
    "bool": pa.bool_(),
    "boolean": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "datetime": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
    "bytes": pa.binary(),
    "json": pa.string(),
}
_GENERIC = re.compile(r"^\s*(list|vector)\s*\[\s*(.+?)\s*\]\s*$", re.I)
JSON_META = b"fabric.type"  # field metadata key marking a column of JSON text


class BadValueError(FabricError, ValueError):
    """A session value does not fit the column it is compared with."""


def parse_type(spec: str) -> pa.DataType:
    """``int``, ``float``, ``str``, ``bool``, ``timestamp``, ``date``, ``bytes``, ``json``,
    ``list[T]``, ``vector[N]`` -> Arrow type (timestamps are ``timestamp[us, UTC]``)."""
    text = str(spec).strip()
    low = text.lower()
    if low in _SCALARS:
        return _SCALARS[low]
    m = _GENERIC.match(text)
    if m:
        kind, arg = m.group(1).lower(), m.group(2)
        if kind == "list":
            return pa.list_(parse_type(arg))
        if arg.isdigit() and int(arg) > 0:
            return pa.list_(pa.float32(), int(arg))
    known = "int, float, str, bool, timestamp, date, bytes, json, list[T], vector[N]"
    raise ValueError(f"unknown column type {spec!r}; known types: {known}")


def flat_options(
    options: Mapping[str, Any], aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Connection options with the keys of a nested ``options:`` mapping lifted to the top
    (top-level keys win) and alternative names (``query_timeout``) mapped to ours."""
    out = dict(options.get("options") or {}) if isinstance(options.get("options"), Mapping) else {}
    out.update({k: v for k, v in options.items() if k != "options"})
    for alt, ours in (aliases or {}).items():
        if alt in out and ours not in out:
            out[ours] = out[alt]
    return out


def schema_from_spec(spec: Mapping[str, str] | pa.Schema) -> pa.Schema:
    """A declared schema (``{column: type}``, or an Arrow schema) as an Arrow schema;
    json columns are tagged."""
    if isinstance(spec, pa.Schema):
        return spec
    fields = []
    for name, t in spec.items():
        meta = {JSON_META: b"json"} if str(t).strip().lower() == "json" else None
        fields.append(pa.field(name, parse_type(t), metadata=meta))
    return pa.schema(fields)


def is_json_field(f: pa.Field) -> bool:
    return bool(f.metadata) and f.metadata.get(JSON_META) == b"json"


# ----------------------------------------------------------------- typed session values


def _utc(v: dt.datetime) -> dt.datetime:
    return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)


def coerce_for(t: pa.DataType, v: Any, what: str) -> Any:
    """``v`` as a value comparable with a column of Arrow type ``t``; BadValueError otherwise."""
    if v is None:
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if isinstance(v, str):
            return v
        if isinstance(v, dict | list | tuple):
            return json.dumps(v, sort_keys=True, default=str)  # an operator object is just text
        raise BadValueError(f"{what}: expected a string, got {type(v).__name__} {v!r}")
    if pa.types.is_boolean(t):
        if isinstance(v, bool):
            return v
        raise BadValueError(f"{what}: expected a bool, got {type(v).__name__} {v!r}")
    if pa.types.is_integer(t):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return v  # 3.0 compares equal to 3
        if hasattr(v, "item") and not isinstance(v, dict | list):  # numpy scalars
            return coerce_for(t, v.item(), what)
        raise BadValueError(f"{what}: expected an int, got {type(v).__name__} {v!r}")
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        if isinstance(v, int | float | decimal.Decimal) and not isinstance(v, bool):
            return v  # a decimal session value (or a stage's decimal result) stays exact
        if hasattr(v, "item") and not isinstance(v, dict | list):
            return coerce_for(t, v.item(), what)
        raise BadValueError(f"{what}: expected a number, got {type(v).__name__} {v!r}")
    if pa.types.is_timestamp(t):
        if isinstance(v, dt.datetime):
            return _utc(v)
        if isinstance(v, str):
            try:
                return _utc(dt.datetime.fromisoformat(v))
            except ValueError:
                pass
        raise BadValueError(f"{what}: expected a timestamp, got {type(v).__name__} {v!r}")
    if pa.types.is_date(t):
        if isinstance(v, dt.date) and not isinstance(v, dt.datetime):
            return v
        if isinstance(v, str):
            try:
                return dt.date.fromisoformat(v)
            except ValueError:
                pass
        raise BadValueError(f"{what}: expected a date, got {type(v).__name__} {v!r}")
    return v


def _column_of(e: Expr) -> Column | None:
    """The column a comparison operand is typed by (``x``, ``lower(x)``, ``upper(x)``)."""
    if isinstance(e, Column):
        return e
    if isinstance(e, Call) and e.name in ("lower", "upper") and len(e.args) == 1:
        inner = _column_of(e.args[0])
        return inner
    return None


def compared_params(
    e: Expr, binary_ops: Container[str] | None = None
) -> Iterator[tuple[Column, Param, bool]]:
    """(column, session value, whether the value is a list for ``in``) for every session
    value compared with a column in ``e``: by a binary operator (any, or those in
    ``binary_ops``), ``in``, ``between`` or ``like``."""
    for x in e.walk():
        pairs: list[tuple[Expr, Expr, bool]] = []
        if isinstance(x, Binary):
            if binary_ops is None or x.op in binary_ops:
                pairs = [(x.left, x.right, False), (x.right, x.left, False)]
        elif isinstance(x, InList):
            if isinstance(x.items, Param):
                pairs = [(x.expr, x.items, True)]
            else:
                pairs = [(x.expr, i, False) for i in x.items]
        elif isinstance(x, Between):
            pairs = [(x.expr, x.low, False), (x.expr, x.high, False)]
        elif isinstance(x, Like):
            pairs = [(x.expr, x.pattern, False)]
        for a, b, many in pairs:
            c = _column_of(a)
            if c is not None and isinstance(b, Param):
                yield c, b, many


_COMPARISONS = frozenset({"=", "!=", "<", "<=", ">", ">="})


def typed_params(
    exprs: tuple[Expr, ...] | list[Expr], params: Mapping[str, Any], schema: pa.Schema, uri: str
) -> dict[str, Any]:
    """Check every session value compared with a column against that column's type.

    Returns a copy of ``params`` with values normalized (aware UTC datetimes, JSON text
    for objects compared with strings). Raises BadValueError naming the source, column
    and session value when a value cannot be of the column's type.
    """
    out = dict(params)

    def check(col: Column, p: Param, many: bool) -> None:
        if p.name not in params or col.name not in schema.names:
            return
        t = schema.field(col.name).type
        what = f"{uri}: session value '{p.name}' compared with column '{col.name}' ({t})"
        v = params[p.name]
        if many:
            if isinstance(v, str | bytes | dict) or not hasattr(v, "__iter__"):
                raise BadValueError(
                    f"{what}: expected a list for 'in', got {type(v).__name__} {v!r}"
                )
            out[p.name] = [coerce_for(t, x, what) for x in v]
        else:
            out[p.name] = coerce_for(t, v, what)

    for e in exprs:
        for col, p, many in compared_params(e, _COMPARISONS):
            check(col, p, many)
    return out


def apply_locally(
    batches: Iterator[pa.RecordBatch],
    filters: list[Expr],
    params: Mapping[str, Any],
    limit: int | None,
    columns: list[str],
) -> Iterator[pa.RecordBatch]:
    """Filters the source could not take, applied to its batches (then the limit, then the
    projection): used when a filter reaches ``scan`` without being offered first."""
    from connectors.arrow_expr import filter_table

    left = limit
    for b in batches:
        t = pa.Table.from_batches([b])
        for f in filters:
            t = filter_table(t, f, params)
        t = t.select(columns)
        if left is not None:
            t = t.slice(0, left)
            left -= t.num_rows
        yield from t.to_batches()
        if left is not None and left <= 0:
            return


def ms(seconds: float | None, default: float) -> int:
    return int(1000 * (default if seconds is None else seconds))
