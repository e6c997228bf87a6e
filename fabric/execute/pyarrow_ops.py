"""The executor's local operators in pyarrow (one unary node over an Arrow table)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors.arrow_expr import (
    canonical_floats,
    sort_indices,
)
from dsl.ast import Column, Expr, Star
from fabric import functions
from fabric.execute.errors import QueryError
from fabric.execute.plans import plan_cache
from fabric.execute.sql import UnresolvedColumn, resolve, substitute
from fabric.execute.state import RunState
from fabric.physical import planner as _planner
from fabric.plan.nodes import (
    Aggregate,
    Derive,
    Filter,
    Limit,
    Plan,
    Project,
    Sort,
)

_UNARY = (Filter, Derive, Project, Sort, Limit)

_ONE_INPUT = (*_UNARY, Aggregate)  # nodes with an .input


class PyArrowOps(RunState):
    """Filter / Derive / Project / Sort / Limit / Aggregate over an Arrow table in
    pyarrow (a small sort or aggregate in Python), as the physical planner placed them;
    a case pyarrow would answer otherwise than DuckDB goes to DuckDB (``_NotInArrow``)."""

    def _resolver(self, node: Plan, table: pa.Table, exprmap: dict[Expr, str] | None = None) -> Any:
        if exprmap is None:
            exprmap = _planner.exprmap(node)
        names = table.schema.names

        def res(c: Column) -> str:
            try:
                return resolve(c, names, exprmap)
            except UnresolvedColumn as e:
                raise QueryError(self.binding, str(e)) from None

        return res

    def _apply_unary(self, node: Plan, table: pa.Table) -> pa.Table:
        """Filter / Derive / Project / Sort / Limit in pyarrow (the physical planner sends
        the nodes with an expression pyarrow has no form for to DuckDB instead)."""
        child = node.input if isinstance(node, _ONE_INPUT) else node.children()[0]
        exprmap = self._exprmap(child)
        if isinstance(node, Project):
            picked = self._plain_project(node, table, exprmap)
            if picked is not None:
                return picked
        res = self._resolver(child, table, exprmap)
        try:
            if isinstance(node, Filter):
                return functions.filter_table(
                    table,
                    substitute(node.predicate, exprmap),
                    self.params,
                    resolve=res,
                    now=self.now,
                )
            if isinstance(node, Derive):
                for name, e, typ in node.items:
                    col = self._values(e, table, res, exprmap)
                    table = table.append_column(pa.field(name, typ), _cast(col, typ))
                return table
            if isinstance(node, Project):
                cols = [_cast(self._values(e, table, res, exprmap), t) for _, e, t in node.items]
                return pa.table(
                    cols,
                    schema=pa.schema(
                        [pa.field(n, c.type) for (n, _, _), c in zip(node.items, cols)]
                    ),
                )
            if isinstance(node, Sort):
                keyed = table
                sort_keys = []
                names = table.schema.names
                for i, k in enumerate(node.keys):
                    key = _plain_column(k.expr, names, res)
                    if key is None:  # an expression: its values as a column of their own
                        key = f"__k{i}"
                        keyed = keyed.append_column(key, self._values(k.expr, table, res, exprmap))
                    nulls = "at_start" if k.nulls_first else "at_end"
                    sort_keys.append((key, "descending" if k.descending else "ascending", nulls))
                if table.num_rows <= SMALL_ROWS:
                    order = _small_sort_indices(keyed, sort_keys)
                    if order is not None:  # (rows already in order, as a search's are: as is)
                        same = order == list(range(len(order)))
                        return table if same else table.take(np.array(order, np.int64))
                return table.take(sort_indices(keyed, sort_keys))  # NaN as DuckDB orders it
            if isinstance(node, Limit):
                return table.slice(node.offset, node.n)
            if isinstance(node, Aggregate):
                return self._aggregate(node, table, res, exprmap)
        except (pa.ArrowNotImplementedError, _NotInArrow):
            # a kernel pyarrow lacks for these types (e.g. sorting a struct column): known
            # only from the data, so decided here
            return self._sql_over(node, table)
        raise QueryError(self.binding, f"cannot execute plan node {type(node).__name__}")

    def _aggregate(
        self, node: Aggregate, table: pa.Table, res: Any, exprmap: dict[Expr, str]
    ) -> pa.Table:
        """count / count_distinct / min / max per group with pyarrow's hash aggregation
        (the planner sends no other aggregate here: ``PYARROW_AGGREGATES``). DuckDB's
        answer, typed as the plan declares; a case where the two differ (a NaN under
        min / max, a value that is not a column) goes to DuckDB."""
        cols: dict[str, Any] = {}
        keys = []
        for i, (_, e, _) in enumerate(node.group_by):
            keys.append(f"__g{i}")
            cols[keys[-1]] = self._values(e, table, res, exprmap)
        aggs: list[tuple[Any, str]] = []
        for j, (_, call, _) in enumerate(node.aggregates):
            if call.name == "count" and (not call.args or isinstance(call.args[0], Star)):
                aggs.append(([], "count_all"))
                continue
            name = f"__a{j}"
            cols[name] = self._values(call.args[0], table, res, exprmap)
            aggs.append((name, call.name))
        if not all(isinstance(c, pa.ChunkedArray | pa.Array) for c in cols.values()):
            raise _NotInArrow("a constant argument")
        for c in [*keys, *(a for a, fn in aggs if fn == "count_distinct")]:
            if pa.types.is_floating(cols[c].type):  # DuckDB's groups: one NaN, -0.0 = 0.0
                cols[c] = canonical_floats(cols[c])
        got = None
        if table.num_rows <= SMALL_ROWS:  # None: a type or a NaN it leaves
            got = _small_aggregate(keys, aggs, cols, table.num_rows)
        if got is None:
            for a, fn in aggs:
                if fn not in ("min", "max") or not pa.types.is_floating(cols[a].type):
                    continue
                if pc.any(pc.is_nan(cols[a])).as_py():  # DuckDB orders NaN above all
                    raise _NotInArrow("NaN under min / max")
            inp = pa.table(cols) if cols else pa.table({"__n": pa.nulls(table.num_rows)})
            try:
                out = inp.group_by(keys, use_threads=False).aggregate(aggs)
            except pa.ArrowTypeError as e:  # no hash kernel for the type (a list, a struct)
                raise _NotInArrow(str(e)) from e
            got = [out.column(k) for k in keys]
            got += [out.column(f"{a}_{fn}" if a else fn) for a, fn in aggs]
        items = (*node.group_by, *node.aggregates)
        return pa.table(
            [_cast(c, t) for c, (_, _, t) in zip(got, items)], names=[n for n, _, _ in items]
        )

    def _plain_project(
        self, node: Project, table: pa.Table, exprmap: dict[Expr, str]
    ) -> pa.Table | None:
        """A Project of plain columns of the declared types: select and rename (no
        per-expression evaluation). The column positions are resolved once per plan and
        input column names (``_PlanCache``); None: evaluate the items instead."""
        names = table.schema.names
        cache = plan_cache(self.pp).projects
        hit = cache.get(id(node))
        if hit is None or hit[0] != names:
            cols = None
            if all(isinstance(e, Column) for _, e, _ in node.items):  # (as _values resolves)
                res = self._resolver(node.input, table, exprmap)
                cols = [names.index(res(e)) for _, e, _ in node.items]
            out_names, types = [n for n, _, _ in node.items], [t for _, _, t in node.items]
            schema = self.pp.schema  # the root's answer needs no _conform when it has these
            root = self.pp.root.logical is node and (schema.names, schema.types) == (
                out_names,
                types,
            )
            hit = cache[id(node)] = (names, cols, out_names, types, root)
        if hit[1] is None:
            return None
        out = table.select(hit[1]).rename_columns(hit[2])
        if out.schema.types != hit[3]:
            return None
        if hit[4]:
            self.conformed = out
        return out

    def _values(self, e: Expr, table: pa.Table, res: Any, exprmap: dict[Expr, str]) -> Any:
        return functions.evaluate(
            substitute(e, exprmap), table, self.params, resolve=res, now=self.now
        )


#: an Aggregate or Sort over at most this many rows is computed in Python
#: (``_small_aggregate``, ``_small_sort_indices``), not by pyarrow's hash aggregation and
#: sort kernels, whose set-up per call (an Acero plan: 0.15-0.3 ms on these machines) is
#: most of a multi-hop answer's aggregate and sorts over a 20-row hop; 0 turns it off
SMALL_ROWS = 64


def _small_kind(t: pa.DataType) -> str | None:
    """How ``_small_aggregate`` and ``_small_sort_indices`` may use a column of type
    ``t``: "key" (compared, sorted, counted distinct: values whose Python equality and
    order are Arrow's and DuckDB's), "ordered" (sorted, min / max, count: floats, a NaN
    sends the node to the general path), or None (a type left to pyarrow)."""
    if pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return "key"
    if pa.types.is_decimal(t) or pa.types.is_date32(t):
        return "key"
    if pa.types.is_timestamp(t) and t.unit != "ns":  # ns values do not fit a datetime
        return "key"
    if pa.types.is_floating(t) and not pa.types.is_float16(t):
        return "ordered"
    return None


def _small_aggregate(
    keys: list[str], aggs: list[tuple[Any, str]], cols: Mapping[str, Any], n: int
) -> list[pa.Array] | None:
    """The columns ``group_by(keys).aggregate(aggs)`` gives over ``cols`` (``n`` rows),
    computed in Python, for one string key or none: groups in the order of their first row
    (as pyarrow's, so the answer is the same table), a NULL key a group of its own, NULLs skipped by count /
    count_distinct / min / max, no groups: one row, even over no rows. None when a
    column's type is not one it handles (``_small_kind``) or a NaN is under min / max:
    the general path computes it then (DuckDB, for the NaN)."""
    if len(keys) > 1:  # pyarrow orders the groups of several keys otherwise (NULLs),
        return None  # and those of an integer key (sorted, in some cases)
    for k in keys:
        if not (pa.types.is_string(cols[k].type) or pa.types.is_large_string(cols[k].type)):
            return None
    for a, fn in aggs:
        kind = None if not a else _small_kind(cols[a].type)
        if a and (kind is None or (fn == "count_distinct" and kind != "key")):
            return None
    values = {name: c.to_pylist() for name, c in cols.items()}
    groups: dict[tuple[Any, ...], list[int]] = {}
    if keys:
        for i, g in enumerate(zip(*(values[k] for k in keys))):
            rows = groups.get(g)
            if rows is None:
                groups[g] = [i]
            else:
                rows.append(i)
    else:
        groups[()] = list(range(n))
    out = [pa.array([g[j] for g in groups], cols[k].type) for j, k in enumerate(keys)]
    for a, fn in aggs:
        if fn == "count_all":
            out.append(pa.array([len(rows) for rows in groups.values()], pa.int64()))
            continue
        v = values[a]
        present = [[v[i] for i in rows if v[i] is not None] for rows in groups.values()]
        if fn == "count":
            out.append(pa.array([len(p) for p in present], pa.int64()))
        elif fn == "count_distinct":
            out.append(pa.array([len(set(p)) for p in present], pa.int64()))
        else:
            if pa.types.is_floating(cols[a].type) and any(map(math.isnan, chain(*present))):
                return None  # a NaN: DuckDB's order, not Python's
            # of equal values (-0.0 and 0.0) the first, as pyarrow's grouped min / max
            pick = min if fn == "min" else max
            out.append(pa.array([pick(p) if p else None for p in present], cols[a].type))
    return out


def _small_sort_indices(table: pa.Table, sort_keys: list[tuple[str, str, str]]) -> list[int] | None:
    """``pc.sort_indices(table, sort_keys=sort_keys)`` computed in Python, the same
    permutation: stable, each key ascending or descending with its NULLs first or last.
    None when a key's type is not one whose Python order is Arrow's (``_small_kind``), or
    holds a NaN (Arrow orders it above every number)."""
    order = list(range(table.num_rows))
    keys = []
    for name, direction, nulls in sort_keys:
        col = table.column(name)
        kind = _small_kind(col.type)
        if kind is None:
            return None
        v = col.to_pylist()
        nulls_in = col.null_count > 0
        if kind == "ordered" and any(
            map(math.isnan, (x for x in v if x is not None) if nulls_in else v)
        ):
            return None
        keys.append((v, direction == "descending", nulls == "at_start", nulls_in))
    for v, desc, nulls_first, nulls_in in reversed(keys):  # stable sorts, the last key first
        if not nulls_in:  # (reverse=True keeps ties in order)
            order.sort(key=v.__getitem__, reverse=desc)
            continue
        null = (0,) if nulls_first != desc else (2,)
        order.sort(key=partial(_sort_key, v, null), reverse=desc)
    return order


def _sort_key(values: list[Any], null: tuple[int], i: int) -> tuple[Any, ...]:
    """Row ``i``'s key: NULLs as ``null`` (below or above every value), values after 1."""
    v = values[i]
    return null if v is None else (1, v)


class _NotInArrow(Exception):
    """pyarrow would not give DuckDB's answer here: the node runs in DuckDB instead."""


def _plain_column(e: Expr, names: list[str], res: Any) -> str | None:
    """The name of the one column of the table (``names``) that a plain column ``e``
    denotes, so a sort reads it as it is (what ``functions.evaluate`` of the column would
    return); None: evaluate ``e``."""
    if not isinstance(e, Column):
        return None
    try:
        name: str = res(e)
    except QueryError:
        return None
    return name if names.count(name) == 1 and not name.startswith("__k") else None


def _cast(values: Any, typ: pa.DataType) -> Any:
    if isinstance(values, pa.ChunkedArray | pa.Array) and values.type != typ:
        try:
            return values.cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return values
    return values


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Give the answer the plan's declared column types where a safe cast exists."""
    have = table.schema
    if have.names != schema.names:
        return table
    if have.equals(schema) or all(f.type == t.type for f, t in zip(have, schema)):
        return table
    cols = [_cast(table.column(i), schema.field(i).type) for i in range(table.num_columns)]
    return pa.table(cols, names=schema.names)
