"""The pushed form of a per-branch dynamic filter (``fabric.optimizer.branch_keys``).

For each branch ``(when, rest)`` the keys are ``from_expr`` over the provider's rows
where ``when`` is true (Kleene: NULL keeps nothing), NULL keys dropped. The filter sent
is ``(column in $k0 and rest0) or (column in $k1 and rest1) ...`` over the branches that
have keys; a branch with more than ``max_keys`` keys takes their range when the source
accepts one, else its ``rest`` alone (a superset: the join re-checks every row).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dsl.ast import Binary, Column, Expr, InList, Literal, Param
from fabric import functions
from fabric.plan.nodes import DynamicFilter


def pushed(
    d: DynamicFilter,
    name: str,
    table: pa.Table,
    params: Mapping[str, Any],
    now: dt.datetime,
    resolve: Callable[[Column], str],
    out: dict[str, Any],
) -> tuple[Expr | None, dict[str, Any]]:
    """The filter to push (None: push nothing; ``Literal(False)``: no branch has a key,
    nothing can join), its bound values added to ``out``, and the stats entry."""

    def values(e: Expr) -> pa.Array:
        v = functions.evaluate(e, table, params, resolve=resolve, now=now)
        if isinstance(v, pa.ChunkedArray):
            v = v.combine_chunks()
        if not isinstance(v, pa.Array):  # a constant: one value for every row
            v = pa.array([v.as_py() if isinstance(v, pa.Scalar) else v] * table.num_rows)
        return v

    keys_all = values(d.from_expr)
    parts: list[Expr] = []
    counts: list[int] = []
    forms: list[str] = []
    for j, (when, rest) in enumerate(d.branches):
        keys = keys_all
        if when is not None:
            mask = pc.fill_null(values(when).cast(pa.bool_()), False)
            keys = pc.filter(keys_all, mask)
        keys = pc.unique(keys).drop_null()
        counts.append(len(keys))
        if len(keys) == 0:
            forms.append("none")
            continue
        col = Column(d.column)
        key = f"{name}_{j}"
        held: Expr | None
        if len(keys) <= d.max_keys:
            held = InList(col, Param(key))
            out[key] = keys.to_pylist()
            forms.append("in")
        elif d.range:
            bounds = pc.min_max(keys)
            held = Binary(
                "and",
                Binary(">=", col, Param(key + "_lo")),
                Binary("<=", col, Param(key + "_hi")),
            )
            out[key + "_lo"], out[key + "_hi"] = bounds["min"].as_py(), bounds["max"].as_py()
            forms.append("range")
        else:
            held = None
            forms.append("values only")
        if held is None:
            if rest is None:  # this branch lets every row through
                return None, _stats(d, counts, forms, pushed=False)
            parts.append(rest)
        else:
            parts.append(held if rest is None else Binary("and", held, rest))
    if not parts:
        return Literal(False, "bool"), _stats(d, counts, forms, pushed=True)
    expr = parts[0]
    for p in parts[1:]:
        expr = Binary("or", expr, p)
    return expr, _stats(d, counts, forms, pushed=True)


def _stats(d: DynamicFilter, counts: list[int], forms: list[str], pushed: bool) -> dict:
    return {
        "filter": str(d),
        "keys": sum(counts),
        "branch_keys": counts,
        "pushed": pushed,
        "form": "branches",
        "branch_forms": forms,
    }
