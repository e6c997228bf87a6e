"""A join bound's filter at run time (``fabric.optimizer.join_bounds``).

``pushed(op, values, column_type)`` turns the values a scan's column is compared with
(``c < y`` for every ``y``) into one filter the source can apply: ``c <= hi`` with ``hi``
the largest value, or ``c >= lo`` with the smallest, rounded outwards to the column's
type. Outwards and never strict, so that the pushed filter keeps every row the join can
keep, whatever engine computed ``y`` (a double from an ``avg``, a DECIMAL with another
scale) and however the join compares the two types: the bound is widened by a relative
``SLACK`` (far above a double's rounding error, far below anything that changes which
rows are read) before it is rounded to the column's scale.

No filter (None) when nothing safe can be said: a NaN or an infinity among the values
(DuckDB orders NaN above every number: ``c < NaN`` holds for every ``c``), a value that
is not a number, or a bound outside the column type's range.
"""

from __future__ import annotations

import decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SLACK = decimal.Decimal("1e-9")


def pushed(op: str, values: pa.Array, column_type: pa.DataType) -> tuple[str, Any] | None:
    """``(op, value)`` of the filter ``column op value`` to push, or None (module docstring).
    ``values`` holds no NULL and at least one value."""
    upper = op in ("<", "<=")
    if pa.types.is_floating(values.type) and (
        pc.any(pc.is_nan(values)).as_py() or pc.any(pc.is_inf(values)).as_py()
    ):
        return None
    mm = pc.min_max(values)
    v = mm["max" if upper else "min"].as_py()
    if isinstance(v, bool) or not isinstance(v, int | float | decimal.Decimal):
        return None
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        d = decimal.Decimal(v) if not isinstance(v, float) else decimal.Decimal.from_float(v)
        if not d.is_finite():
            return None
        widen = max(abs(d) * SLACK, SLACK)
        d = d + widen if upper else d - widen
        rounding = decimal.ROUND_CEILING if upper else decimal.ROUND_FLOOR
        if pa.types.is_integer(column_type):
            out: Any = int(d.to_integral_value(rounding=rounding))
            info = _int_range(column_type)
            if not info[0] <= out <= info[1]:
                return None
        elif pa.types.is_decimal(column_type):
            scale = column_type.scale
            out = d.quantize(decimal.Decimal(1).scaleb(-scale), rounding=rounding)
            if abs(out) >= decimal.Decimal(10) ** (column_type.precision - scale):
                return None
        else:
            return None
    return ("<=" if upper else ">=", out)


def _int_range(t: pa.DataType) -> tuple[int, int]:
    bits = t.bit_width
    if pa.types.is_unsigned_integer(t):
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


__all__ = ["SLACK", "pushed"]
