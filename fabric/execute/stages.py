"""Running stages: their results as bound parameters and as tables for DuckDB.

A binding's stages used in expressions (``fabric.plan.nodes.WithStages``) run first, in
order. Their results reach the rest of the plan in two ways:

- bound parameters (``dsl.types.stage_param``): ``stage:S.col`` the one value of a
  one-row stage, ``stage:S:list`` the values of its one column (``x in S``),
  ``stage:S:exists`` whether it has rows. Sources get them like session values, so a
  filter on them is pushed down;
- for a correlated ``exists(S where ...)``, the stage's table, which ``StageSql``
  registers in the DuckDB query as ``EXISTS (SELECT 1 FROM <table> WHERE ...)``.

A source unit whose filters use a stage's result is scheduled once that stage is done
(``fabric.physical.SourceUnit.requires``).
A stage's scan with a dynamic filter on the keys of a correlated ``exists`` starts once
the outer unit providing them is done (its filter with the ``exists`` runs above
that unit), so the stage reads only the rows that can match.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from connectors.arrow_expr import NotTranslatable
from dsl.ast import Exists, Expr
from dsl.types import is_stage_param
from fabric.execute.sql import Rel, SqlBuilder, quote
from fabric.physical.planner import parse_stage_param, stage_refs

_ids = itertools.count()


# what a stage's parameters name and which stages an expression uses: the physical
# planner's (it decides which units wait for which stages)
parse_param = parse_stage_param
refs = stage_refs


def has_exists(e: Expr) -> bool:
    return any(isinstance(x, Exists) for x in e.walk())


def bind(stage: str, table: pa.Table, names: set[str] | frozenset[str]) -> dict[str, Any]:
    """The parameters ``names`` (of any stage) that ``stage``'s result ``table`` gives;
    raises ValueError when a stage used as a value has several rows."""
    out: dict[str, Any] = {}
    for name, what in _wanted(frozenset(names)).get(stage, ()):
        if what == ":list":  # for x in S: each value once (a 20-row hop1 has 4 symbols)
            out[name] = _distinct(table.column(0))
        elif what == ":exists":
            out[name] = table.num_rows > 0
        else:
            if table.num_rows > 1:
                raise ValueError(
                    f"stage '{stage}' is used as a value ({stage}.{what}) but returned "
                    f"{table.num_rows} rows"
                )
            out[name] = table.column(what)[0].as_py() if table.num_rows else None
    return out


@functools.lru_cache(maxsize=1024)
def _wanted(names: frozenset[str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """Per stage, the parameters among ``names`` its result gives, as (name, what): a
    plan's names are the same frozenset on every query, parsed once."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name in sorted(names):
        if is_stage_param(name):
            stage, what = parse_param(name)
            out.setdefault(stage, []).append((name, what))
    return {stage: tuple(pairs) for stage, pairs in out.items()}


def _distinct(column: pa.ChunkedArray) -> list[Any]:
    """The distinct values of ``x in S``, sorted (NULL last) where they sort: the same set
    is then the same parameter whatever order the stage's rows came in, so the dataset's
    compiled-filter cache and the filter's guard history (both keyed by the bound values)
    find it again, as they do an agent's sorted session list (in arrival order, the
    two-hop binding of benchmarks/rag.py compiled its second hop's filter afresh for 0.77
    of its questions, the agent's glue for 0.47)."""
    t = column.type
    if len(column) <= 64 and (pa.types.is_string(t) or pa.types.is_integer(t)):
        values = list(dict.fromkeys(column.to_pylist()))  # a few rows: no compute call
    else:
        values = pc.unique(column).to_pylist()
    try:
        known = sorted(v for v in values if v is not None)
    except TypeError:  # values without an order (dicts of a struct): as they came
        return values  # type: ignore[no-any-return]
    return known + [None] * (len(known) < len(values))


class StageSql(SqlBuilder):
    """A SqlBuilder that also writes ``exists(S where ...)`` over the stage tables."""

    def __init__(self, params: Mapping[str, Any], now: Any, stages: Mapping[str, pa.Table]):
        super().__init__(params, now)
        self.stages = stages

    def expr(self, e: Expr, rel: Rel) -> str:
        if not isinstance(e, Exists):
            return super().expr(e, rel)
        table = self.stages.get(e.stage)
        if table is None:
            raise NotTranslatable(f"the result of stage '{e.stage}' is not computed here")
        # the stage's columns as S.col: they cannot clash with the enclosing sources' a.col
        table = table.rename_columns([f"{e.stage}.{c}" for c in table.column_names])
        name = f"__fabric_s{next(_ids)}"
        self.tables[name] = table
        if e.where is None:
            return f"(EXISTS (SELECT 1 FROM {quote(name)}))"
        inner = Rel("", [*table.column_names, *rel.names], rel.exprmap)
        return f"(EXISTS (SELECT 1 FROM {quote(name)} WHERE {self.expr(e.where, inner)}))"
