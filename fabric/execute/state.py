"""One query's run state, shared by the parts of the executor (fabric/execute/)."""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import threading
import time
from typing import Any

import pyarrow as pa

from dsl.ast import Expr
from fabric.execute.errors import QueryError
from fabric.execute.plans import plan_cache
from fabric.execute.search import TIMEOUT
from fabric.physical import planner as _planner
from fabric.physical.nodes import (
    Physical,
    PhysicalPlan,
)
from fabric.plan.nodes import (
    Plan,
)


class RunState:
    """What one query's run holds (its plan, session values, catalog, the stats and
    freshness it records) and the bookkeeping every part of the executor shares. The
    parts are mixins over it -- ``SourceUnits`` (fabric/execute/units.py),
    ``PyArrowOps`` (pyarrow_ops.py), ``DuckDBOps`` (duckdb_ops.py), ``Hooks`` (hooks.py),
    ``Explain`` (explain.py) -- and ``fabric.execute._Run``, the scheduler, is all of
    them; the methods below that raise are the scheduler's and the engines', for the
    parts that call each other."""

    def __init__(
        self,
        pp: PhysicalPlan,
        params: dict[str, Any],
        catalog: Any,
        binding: str,
        analyze: bool,
        now: dt.datetime,
        allow_partial: bool,
    ):
        self.pp = pp
        self.plan = pp.logical
        self.params = params
        self.catalog = catalog
        self.binding = binding
        self.analyze = analyze
        self.now = now
        self.allow_partial = allow_partial
        self.units = pp.units
        self.node_stats: dict[int, dict[str, Any]] = {}
        #: joins run as Ray tasks (fabric.ray.join): id(node) -> (explain label, info)
        self.ray_joins: dict[int, tuple[str, dict[str, Any]]] = {}
        self.sources: dict[str, dict[str, Any]] = {}
        self.freshness: dict[str, dict[str, Any]] = {}
        self.infos: dict[
            str, Any
        ] = {}  # alias -> the dataset's retrieval explain (rendered for analyze)
        self.queries: list[str] = []  # DuckDB statements run (placeholders only, no values)
        self.futures: dict[str, cf.Future[pa.Table]] = {}
        self.done: dict[str, pa.Table] = {}  # units run inline on the caller's thread
        self.lazy: set[str] = set()  # ready units to run inline when first waited for
        self.ran_inline: set[str] = set()  # those of them that ran (explain analyze says so)
        self.waited = 0.0
        self.waits: dict[str, tuple[float, float]] = {}  # alias -> freshness wait (perf_counter)
        self._dep_wait: dict[str, float] = {}  # seconds a unit waited for dynamic-filter keys
        self.partial = False
        self._cancelled = False
        self._inner: list[cf.Future[pa.Table]] = []  # pool futures of dependent units
        self._lock = threading.Lock()
        self.timeout = float(getattr(catalog, "scan_timeout", None) or TIMEOUT)
        self.stage_tables: dict[str, pa.Table] = {}  # results of the stages run so far
        self.conformed: pa.Table | None = None  # the answer, already of the plan's types

    def _in_process(self, alias: str) -> bool:
        known = plan_cache(self.pp).in_process
        key = (id(self.catalog), alias)
        hit = known.get(key)
        if hit is None:
            hit = known[key] = _planner._in_process(self.catalog, self.units[alias].leaf.uri)
        return hit

    def _names(self, node: Plan) -> list[str]:
        """``node.schema.names``, once per node of the plan (a StageRef builds its schema
        anew on every call)."""
        known = plan_cache(self.pp).names
        hit = known.get(id(node))
        if hit is None:
            hit = known[id(node)] = node.schema.names
        return hit

    def _exprmap(self, node: Plan) -> dict[Expr, str]:
        """``_planner.exprmap(node)``, once per node of the plan (it walks down to the
        Project or Aggregate below: a dict built per node and query otherwise)."""
        known = plan_cache(self.pp).exprmaps
        hit = known.get(id(node))
        if hit is None:
            hit = known[id(node)] = _planner.exprmap(node)
        return hit

    def _timed_out(self, alias: str) -> pa.Table:
        if self.allow_partial:
            return self._partial(alias, f"timed out after {self.timeout:g} s")
        raise QueryError(
            self.binding,
            f"timed out after {self.timeout:g} s",
            alias=alias,
            uri=self.units[alias].leaf.uri,
            hint="check that the server is up and reachable, or raise the scan timeout",
        ) from None

    def _partial(self, alias: str, why: str) -> pa.Table:
        self.partial = True
        self.sources.setdefault(alias, {})["error"] = why
        return self.units[alias].leaf.schema.empty_table()

    # ------------------------------------------------------------ stats and explain
    def _record(self, node: Plan, rows: int, t0: float, engine: str = "arrow") -> None:
        if self.ray_joins and id(node) in self.ray_joins:  # the region's root: ran on Ray
            engine = self.ray_joins[id(node)][0]
        header = self.pp.headers.get(id(node))
        if header is None:
            header = node.header()
        end = time.perf_counter()
        with self._lock:
            self.node_stats[id(node)] = {
                "op": header,
                "rows": rows,
                "time_ms": (end - t0) * 1000,
                "engine": engine,
                "end": end,  # for the spans' times (fabric.tracing)
            }

    def _header(self, node: Plan) -> str:
        header = self.pp.headers.get(id(node))
        return header if header is not None else node.header()

    # ---- implemented by the scheduler (fabric.execute._Run) and the engines' mixins
    def _run(self, p: Physical) -> pa.Table:
        raise NotImplementedError

    def _wait(self, alias: str) -> pa.Table:
        raise NotImplementedError

    def _apply_unary(self, node: Plan, table: pa.Table) -> pa.Table:
        raise NotImplementedError

    def _sql_over(self, node: Plan, table: pa.Table) -> pa.Table:
        raise NotImplementedError
