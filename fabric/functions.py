"""Fabric scalar functions and expression evaluation over Arrow tables.

``connectors.arrow_expr.to_arrow`` translates the standard functions (lower, upper,
length, abs, coalesce, match, comparisons, arithmetic). Functions that pyarrow compute
lacks, such as ``geo_hash(lat, lon, precision)``, are computed here, vectorized with
numpy, and substituted as temporary columns before the rest of the expression goes to
``to_arrow``. The same functions are registered in DuckDB (``register_duckdb``) for
expressions evaluated above a join.

Column references are resolved by the caller (``resolve(Column) -> table column name``);
the executor's tables carry qualified names such as ``m.name``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from connectors.arrow_expr import eval_constant, is_constant, to_arrow
from dsl.ast import Call, Column, Expr, Literal, replace

_BASE32 = np.frombuffer(b"0123456789bcdefghjkmnpqrstuvwxyz", dtype=np.uint8)

#: functions computed by the fabric itself (not by pyarrow compute): name -> arity
FABRIC_FUNCTIONS: dict[str, int] = {"geo_hash": 3}


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


def uses_fabric_functions(e: Expr) -> bool:
    return any(isinstance(x, Call) and x.name in FABRIC_FUNCTIONS for x in e.walk())


Resolver = Callable[[Column], str]


def evaluate(
    e: Expr,
    table: pa.Table,
    params: Mapping[str, Any],
    *,
    resolve: Resolver,
    now: dt.datetime | None = None,
) -> pa.Array | pa.ChunkedArray:
    """Evaluate ``e`` on every row of ``table`` (constants are broadcast)."""
    if isinstance(e, Column):
        return table.column(resolve(e))
    if is_constant(e) and not uses_fabric_functions(e):
        v = eval_constant(e, params, now)
        return pa.array([v] * table.num_rows) if v is not None else pa.nulls(table.num_rows)
    table, rewritten = _substitute(e, table, params, resolve, now)
    if isinstance(rewritten, Column):
        return table.column(rewritten.name)
    expr = to_arrow(rewritten, params, column=lambda c: pc.field(c.name), now=now)
    return pads.dataset(table).to_table(columns={"__v": expr}).column("__v")


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
    extended, rewritten = _substitute(predicate, table, params, resolve, now)
    expr = to_arrow(rewritten, params, column=lambda c: pc.field(c.name), now=now)
    out = extended.filter(expr)
    return out.select(table.column_names) if extended is not table else out


def _substitute(
    e: Expr, table: pa.Table, params: Mapping[str, Any], resolve: Resolver, now: dt.datetime | None
) -> tuple[pa.Table, Expr]:
    """Replace fabric-only calls by temporary columns, columns by resolved names."""
    state = {"table": table, "n": 0}

    def fn(node: Expr) -> Expr | None:
        if isinstance(node, Column):
            return Column(resolve(node), None)
        if isinstance(node, Call) and node.name in FABRIC_FUNCTIONS:
            t = state["table"]
            args = [_arg_value(a, t, params, now) for a in node.args]
            if node.name == "geo_hash":
                if len(args) != 3:
                    raise ValueError(
                        f"geo_hash takes (lat, lon, precision), got {len(node.args)} arguments in {node}"
                    )
                values = geo_hash(args[0], args[1], int(_scalar(args[2])))
            else:  # pragma: no cover - FABRIC_FUNCTIONS and this branch change together
                raise ValueError(f"unknown fabric function {node.name}")
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
    if is_constant(a):
        return eval_constant(a, params, now)
    expr = to_arrow(a, params, column=lambda c: pc.field(c.name), now=now)
    return pads.dataset(table).to_table(columns={"__v": expr}).column("__v")


def _scalar(v: Any) -> Any:
    if isinstance(v, pa.ChunkedArray | pa.Array):
        if len(v) == 0:
            return 6
        return v[0].as_py()
    return v


# ---------------------------------------------------------------- DuckDB


def register_duckdb(con: Any, names: set[str]) -> None:
    """Register the fabric functions in ``names`` as vectorized DuckDB functions."""
    import duckdb

    if "geo_hash" in names:

        def _gh(lat: pa.Array, lon: pa.Array, precision: pa.Array) -> pa.Array:
            p = precision[0].as_py() if len(precision) else 6
            return geo_hash(lat, lon, p)

        with contextlib.suppress(duckdb.CatalogException):  # already registered on this connection
            con.create_function(
                "geo_hash",
                _gh,
                [duckdb.sqltype("DOUBLE"), duckdb.sqltype("DOUBLE"), duckdb.sqltype("BIGINT")],
                duckdb.sqltype("VARCHAR"),
                type="arrow",
            )


__all__ = ["FABRIC_FUNCTIONS", "evaluate", "filter_table", "geo_hash", "register_duckdb"]
