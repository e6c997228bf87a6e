"""The executor's DuckDB steps: regions of joins / aggregates, and unary nodes."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pyarrow as pa

from connectors.arrow_expr import (
    NotTranslatable,
)
from dsl.ast import Expr
from fabric.execute import stages as _stages
from fabric.execute.errors import QueryError
from fabric.execute.pyarrow_ops import _conform
from fabric.execute.sql import Rel, SqlBuilder, UnresolvedColumn, quote
from fabric.execute.sql import typed as _typed
from fabric.execute.state import RunState
from fabric.physical import planner as _planner
from fabric.physical.nodes import (
    DuckDBRegion,
    Physical,
)
from fabric.plan.nodes import (
    Aggregate,
    Derive,
    Filter,
    Join,
    Limit,
    Plan,
    Project,
    Sort,
)


class DuckDBOps(RunState):
    """A DuckDB region (one query over its inputs' Arrow tables, registered zero-copy,
    every value a bound parameter) and a unary node run in DuckDB."""

    def _sql_over(self, node: Plan, table: pa.Table) -> pa.Table:
        """One unary node over an Arrow table, in DuckDB (expressions pyarrow lacks), with
        the plan's declared column types."""
        b = _stages.StageSql(self.params, self.now, self.stage_tables)
        rel = b.table(table)
        rel.exprmap = _planner.exprmap(node.children()[0])
        out = self._compile_unary(b, node, rel).materialized(b.alias())
        try:
            return _conform(b.run(out.sql), node.schema)
        except Exception as e:
            raise QueryError(self.binding, f"{node.header()} failed in DuckDB: {e}") from e

    # ------------------------------------------------------------ DuckDB regions
    def _sql(self, region: DuckDBRegion) -> pa.Table:
        """A DuckDB region: one query over its inputs' Arrow tables."""
        b = _stages.StageSql(self.params, self.now, self.stage_tables)
        joins: list[tuple[Plan, Rel]] = []
        node = region.logical
        inputs = {id(i.logical): i for i in region.inputs}
        rel = self._compile(b, node, joins, inputs).materialized(b.alias())  # runs the inputs
        if self.analyze:
            self.queries.append(rel.sql)
        t0 = time.perf_counter()  # the DuckDB query alone
        try:
            table = b.run(rel.sql)
        except Exception as e:
            raise QueryError(self.binding, f"join/aggregate step failed in DuckDB: {e}") from e
        self._record(node, table.num_rows, t0, engine="duckdb")
        if self.analyze:
            for j, jrel in joins:
                if j is node:
                    continue
                n = b.run(f"SELECT count(*) AS n FROM ({jrel.sql}) AS c").column("n")[0].as_py()
                self.node_stats[id(j)] = {
                    "op": j.header(),
                    "rows": n,
                    "engine": "duckdb (counted for analyze)",
                }
        return table

    def _compile(
        self, b: SqlBuilder, node: Plan, joins: list, inputs: Mapping[int, Physical]
    ) -> Rel:
        inp = inputs.get(id(node))
        if inp is not None:
            t0 = time.perf_counter()
            table = self._run(inp)
            if id(node) not in self.node_stats:
                self._record(node, table.num_rows, t0)
            rel = b.table(table)
            rel.exprmap = _planner.exprmap(node)
            return rel
        if isinstance(node, Join):
            left = self._compile(b, node.left, joins, inputs).materialized(b.alias())
            right = self._compile(b, node.right, joins, inputs).materialized(b.alias())
            hook = getattr(getattr(self.catalog, "executor", None), "joins", None)
            if hook is not None:  # executor: ray: a large join as hash-partitioned tasks
                done, left, right = hook.region_join(self, b, node, left, right)
                if done is not None:  # counted and labelled there (not "counted for analyze")
                    return done
            both = Rel("", left.names + right.names, {**left.exprmap, **right.exprmap})
            on = self._expr_sql(b, node.on, both)
            kind = "LEFT JOIN" if node.how == "left" else "JOIN"
            rel = Rel(
                f"SELECT * FROM ({left.sql}) AS {b.alias()} {kind} ({right.sql}) AS {b.alias()} ON {on}",
                both.names,
            )
            joins.append((node, rel))
            self.node_stats.setdefault(id(node), {"op": self._header(node), "engine": "duckdb"})
            return rel
        child = self._compile(b, node.children()[0], joins, inputs)
        self.node_stats.setdefault(id(node), {"op": self._header(node), "engine": "duckdb"})
        return self._compile_unary(b, node, child)

    def _compile_unary(self, b: SqlBuilder, node: Plan, child: Rel) -> Rel:
        q = b.alias()
        if isinstance(node, Project):
            items = ", ".join(
                f"{self._expr_sql(b, e, child)} AS {quote(n)}" for n, e, _ in node.items
            )
            order = f" ORDER BY {child.order}" if child.order else ""
            return Rel(
                f"SELECT {items} FROM ({child.sql}) AS {q}{order}",
                [n for n, _, _ in node.items],
                _planner.exprmap(node),
                ordered=bool(order),
            )
        if isinstance(node, Limit):
            tail = f"LIMIT {int(node.n)} OFFSET {int(node.offset)}"
            if child.order:
                return Rel(
                    f"SELECT * FROM ({child.sql}) AS {q} ORDER BY {child.order} {tail}",
                    child.names,
                    child.exprmap,
                )
            if child.ordered:
                return Rel(f"{child.sql} {tail}", child.names, child.exprmap)
            return Rel(f"SELECT * FROM ({child.sql}) AS {q} {tail}", child.names, child.exprmap)
        child = child.materialized(b.alias())
        if isinstance(node, Sort):
            return Rel(child.sql, child.names, child.exprmap, order=self._sort_sql(b, node, child))
        if isinstance(node, Filter):
            return Rel(
                f"SELECT * FROM ({child.sql}) AS {q} WHERE {self._expr_sql(b, node.predicate, child)}",
                child.names,
                child.exprmap,
            )
        if isinstance(node, Aggregate):
            cols = [
                f"{_typed(self._expr_sql(b, e, child), t)} AS {quote(n)}"
                for n, e, t in (*node.group_by, *node.aggregates)
            ]
            group = (
                f" GROUP BY {', '.join(str(i + 1) for i in range(len(node.group_by)))}"
                if node.group_by
                else ""
            )
            names = [n for n, _, _ in (*node.group_by, *node.aggregates)]
            return Rel(
                f"SELECT {', '.join(cols)} FROM ({child.sql}) AS {q}{group}",
                names,
                _planner.exprmap(node),
            )
        if isinstance(node, Derive):
            items = ", ".join(
                f"{self._expr_sql(b, e, child)} AS {quote(n)}" for n, e, _ in node.items
            )
            return Rel(
                f"SELECT *, {items} FROM ({child.sql}) AS {q}",
                child.names + [n for n, _, _ in node.items],
                child.exprmap,
            )
        raise QueryError(self.binding, f"cannot run {type(node).__name__} in DuckDB")

    def _sort_sql(self, b: SqlBuilder, node: Sort, child: Rel) -> str:
        try:
            return b.sort_keys(node.keys, child)
        except UnresolvedColumn as e:
            raise QueryError(self.binding, f"sort key: {e}") from None

    def _expr_sql(self, b: SqlBuilder, e: Expr, rel: Rel) -> str:
        try:
            return b.expr(e, rel)
        except UnresolvedColumn as err:
            raise QueryError(self.binding, str(err)) from None
        except NotTranslatable as err:
            raise QueryError(self.binding, str(err)) from None
        except KeyError as err:
            raise QueryError(
                self.binding,
                str(err).strip('"'),
                hint="pass every session value the binding declares",
            ) from None
