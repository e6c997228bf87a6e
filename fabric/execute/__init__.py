"""Run a physical plan over Arrow: federated execution.

``execute(plan, params, catalog, binding=...)`` schedules the nodes of a
``fabric.physical.PhysicalPlan`` (given, or built from an optimized logical plan on first
use); which engine runs what is the physical planner's decision, not this module's:

1. **Source units in parallel.** Each ``SourceUnit`` (a Scan or VectorSearch plus the
   Filter/Derive chain right above it) runs on the process-wide scan pool
   (``scan_pool()``, ``POOL_THREADS`` threads), or on the caller's thread when the plan
   says ``inline``: check freshness, build a ``ScanRequest`` (projection, exact + inexact
   filters, bound params, limit, order, latest_by), stream the batches, then apply the
   chain's residual filters and derived columns (pyarrow, or DuckDB for a step the plan
   sends there). A unit with dynamic filters is submitted once the units that provide
   its keys are done, then sends the distinct keys as a bound ``IN`` list parameter
   (``__dyn_<n>``); past ``max_keys`` keys, the range ``[min, max]`` of the keys when the
   source accepts it, else nothing.
2. **Above the units.** A ``DuckDBRegion`` is one DuckDB query over its inputs' Arrow
   tables, registered zero-copy, with every value bound as a ``$n`` parameter;
   ``PyArrowStep`` / ``DuckDBStep`` run one unary node in their engine.
3. **Hooks.** ``SandboxCall`` runs through ``catalog.sandbox().run(...)``,
   ``CkksScore`` through ``catalog.crypto_score(node, table, params)``.

The ``Result`` carries per-source freshness, stats (rows and bytes fetched per source,
time per operator) and, with ``analyze=True``, the plan annotated with actual rows and
times (see docs/execution.md).

This module is the scheduler (``_Run``); the parts it schedules are mixins over the run's
state (``state.RunState``): ``units`` (source units), ``pyarrow_ops`` and ``duckdb_ops``
(the engines' operators), ``hooks`` (sandbox, CKKS), ``explain``; ``plans`` keeps what is
derived once per plan, ``pool`` the scan pool, and ``search`` runs a plan that is one
``nearest:`` search without the scheduler.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import pyarrow as pa

from connectors.arrow_expr import utcnow
from fabric.execute import search as _search
from fabric.execute import stages as _stages
from fabric.execute.duckdb_ops import DuckDBOps
from fabric.execute.errors import QueryError
from fabric.execute.explain import Explain
from fabric.execute.hooks import Hooks
from fabric.execute.plans import physical
from fabric.execute.pool import POOL_THREADS, scan_pool
from fabric.execute.pyarrow_ops import PyArrowOps, _conform
from fabric.execute.search import (
    SearchRun,
    check_params,
    ms3,
    search_shape,
)
from fabric.execute.units import SourceUnits, latest_per_key
from fabric.physical.nodes import (
    CkksScore,
    DuckDBRegion,
    DuckDBStep,
    Physical,
    PhysicalPlan,
    PyArrowStep,
    SandboxCall,
    SourceUnit,
    StagesFirst,
    StageTable,
)
from fabric.plan.nodes import (
    EncryptedScore,
    Plan,
    Stage,
    StageRef,
    UserFunction,
)
from fabric.result import Result

__all__ = [
    "DEFAULT_TIMEOUT",
    "POOL_THREADS",
    "QueryError",
    "execute",
    "latest_per_key",
    "physical",
    "scan_pool",
]

_search_shape = search_shape  # (tests replace it to run every plan on the general path)

DEFAULT_TIMEOUT = _search.TIMEOUT


def execute(
    plan: Plan | PhysicalPlan,
    params: Mapping[str, Any] | None,
    catalog: Any,
    *,
    binding: str,
    analyze: bool = False,
    now: dt.datetime | None = None,
    allow_partial: bool = False,
    session_id: str | None = None,
    version: str | None = None,
) -> Result:
    """Run ``plan`` with the session values ``params``; see the module docstring.

    ``allow_partial``: a failing source yields an empty table and ``Result.partial``
    instead of an error (for bindings that accept partial answers). ``session_id`` and
    ``version`` (the binding's content hash) label the run's spans when the catalog has a
    ``tracer`` (fabric.tracing); without one nothing is recorded."""
    pp = plan if isinstance(plan, PhysicalPlan) else physical(plan, catalog, binding)
    shape = None if analyze else _search_shape(pp)
    run: _Run | SearchRun
    if shape is not None:  # one nearest: search under a plain select (fabric.execute.search)
        run = SearchRun(pp, shape, dict(params or {}), catalog, binding, now, allow_partial)
    else:
        run = _Run(
            pp, dict(params or {}), catalog, binding, analyze, now or utcnow(), allow_partial
        )
    tracer = getattr(catalog, "tracer", None)
    if tracer is None:
        return run.run()
    return tracer.run(run, session_id, version)  # type: ignore[no-any-return]


class _Run(SourceUnits, PyArrowOps, DuckDBOps, Hooks, Explain):
    """The scheduler: one query over the physical plan's nodes."""

    # ------------------------------------------------------------ driver
    def run(self) -> Result:
        t0 = time.perf_counter()
        if not self.pp.params <= self.params.keys():  # (bound by the caller: checked once)
            check_params(self.pp, self.params, self.binding)
        self.deadline = time.monotonic() + self.timeout * (1 + self.pp.depth)
        order = self.pp.order
        root = self.pp.root
        if isinstance(root, StagesFirst):
            try:
                table = self._run_stages(root)
            finally:
                self._cancelled = True
                for fut in (*self.futures.values(), *self._inner):
                    fut.cancel()
        elif len(order) == 1 and self.units[order[0]].placement == "inline":
            self._run_inline(order[0])
            table = self._run(root)
        else:
            try:
                for alias in order:
                    self._schedule(alias)
                table = self._run(root)
            finally:
                self._cancelled = True  # units not yet started never start
                for fut in (*self.futures.values(), *self._inner):
                    fut.cancel()
        return self.finish(table, t0)

    def finish(self, table: pa.Table, t0: float) -> Result:
        """The ``Result`` of the answer ``table`` of a run started at ``t0``."""
        if table is not self.conformed:
            table = _conform(table, self.pp.schema)
        total_ms = (time.perf_counter() - t0) * 1000
        stats = {
            "sources": self.sources,
            "operators": [
                {"op": s["op"], "rows": s.get("rows"), "time_ms": ms3(s.get("time_ms", 0.0))}
                for s in self.node_stats.values()
            ],
            "total_ms": ms3(total_ms),
            "rows_fetched": sum(s.get("rows", 0) for s in self.sources.values()),
            "bytes_fetched": sum(s.get("bytes", 0) for s in self.sources.values()),
        }
        explain = self._explain(table, total_ms) if self.analyze else None
        return Result(
            table, self.freshness, stats, explain, self.waited, self.partial, self.binding
        )

    def _run_stages(self, root: StagesFirst) -> pa.Table:
        """The stages first, in order, then the plan: a source unit starts as soon as the
        stages its filters use are done (the others start at once). A unit that becomes
        ready alone, with nothing running on the pool, over an in-process source, and that
        no unit takes keys from, runs on the caller's thread when it is first needed (a
        pool handoff there only adds a thread switch: 29 ms a query at load 20 for the
        two-hop binding of benchmarks/rag.py); one becoming ready beside another goes to
        the pool with it."""
        done: set[str] = set()
        providers = {d for u in self.units.values() for d in u.deps}

        def start_ready() -> None:
            while True:  # a unit scheduled makes the units taking its keys ready
                ready = [
                    alias
                    for alias in self.pp.order
                    if alias not in self.futures
                    and alias not in self.lazy
                    and alias not in self.done
                    and self.units[alias].requires <= done
                    and all(d in self.futures for d in self.units[alias].deps)
                ]
                if not ready:
                    return
                if (
                    len(ready) == 1
                    and not self.lazy
                    and not self.units[ready[0]].deps
                    and ready[0] not in providers
                    and not any(not f.done() for f in self.futures.values())
                    and self._in_process(ready[0])
                ):
                    self.lazy.add(ready[0])
                    return
                for alias in (*sorted(self.lazy), *ready):
                    self.lazy.discard(alias)
                    self._schedule(alias)

        start_ready()
        for phys in root.stages:
            st = phys.logical
            assert isinstance(st, Stage) and isinstance(phys, PyArrowStep)
            t0 = time.perf_counter()
            table = self._run(phys.input)
            self.stage_tables[st.name] = table
            try:
                # a new dict, never mutated: units already running keep reading theirs
                self.params = {**self.params, **_stages.bind(st.name, table, self.pp.params)}
            except ValueError as e:
                raise QueryError(
                    self.binding,
                    str(e),
                    hint="give the stage one row (an aggregate without group_by, or limit: 1)",
                ) from None
            self._record(st, table.num_rows, t0)
            done.add(st.name)
            start_ready()
        return self._run(root.input)

    def run_from(self, alias: str, table: pa.Table) -> pa.Table:
        """The rest of the plan after its unit ``alias`` gave ``table`` (general path)."""
        self.done[alias] = table
        return self._run(self.pp.root)

    def _run_inline(self, alias: str) -> None:
        """In-process work cannot be abandoned: a unit past the scan timeout still gives
        the timeout error, once it returns."""
        t0 = time.monotonic()
        table = self._unit(alias)
        if time.monotonic() - t0 > self.timeout:
            table = self._timed_out(alias)
        self.done[alias] = table

    def _schedule(self, alias: str) -> None:
        """Submit a unit to the shared pool once the units providing its dynamic-filter
        keys are done, so no pool thread ever blocks waiting for another unit."""
        deps = [self.futures[d] for d in sorted(self.units[alias].deps)]
        if not deps:
            self.futures[alias] = scan_pool().submit(self._unit, alias)
            return
        out: cf.Future[pa.Table] = cf.Future()
        self.futures[alias] = out
        pending = [len(deps)]

        def dep_done(_: cf.Future[Any]) -> None:
            with self._lock:
                pending[0] -= 1
                if pending[0]:
                    return
            if self._cancelled or not out.set_running_or_notify_cancel():
                return
            try:
                inner = scan_pool().submit(self._unit, alias)
            except RuntimeError as e:  # interpreter shutting down
                out.set_exception(e)
                return
            self._inner.append(inner)
            inner.add_done_callback(partial(_relay, out))

        for d in deps:
            d.add_done_callback(dep_done)

    def _wait(self, alias: str) -> pa.Table:
        table = self.done.get(alias)
        if table is not None:
            return table
        if alias in self.lazy:  # a lone ready unit (see _run_stages): run it here, now
            self.lazy.discard(alias)
            self.ran_inline.add(alias)
            self._run_inline(alias)
            return self.done[alias]
        fut = self.futures[alias]
        try:
            return fut.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except cf.TimeoutError:
            return self._timed_out(alias)

    # ------------------------------------------------------------ above the units (main thread)
    def _run(self, p: Physical) -> pa.Table:
        """Compute one physical node (its inputs first) on the caller's thread; source
        units are waited for (they run on the pool, or ran inline)."""
        if isinstance(p, SourceUnit):
            return self._wait(p.alias)
        if isinstance(p, DuckDBRegion):
            return self._sql(p)
        node = p.logical
        t0 = time.perf_counter()
        engine = "arrow"
        if isinstance(p, PyArrowStep) and isinstance(node, StageRef):
            table = self._run(p.input).rename_columns(self._names(node))
        elif isinstance(p, PyArrowStep) and isinstance(node, Stage):
            table = self._run(p.input)
        elif isinstance(p, PyArrowStep):
            table = self._apply_unary(node, self._run(p.input))
        elif isinstance(p, DuckDBStep):
            table = self._sql_over(node, self._run(p.input))
            engine = "duckdb"
        elif isinstance(p, StageTable):
            table = self.stage_tables[p.name]
        elif isinstance(p, SandboxCall):
            assert isinstance(node, UserFunction)
            table = self._user_function(node, self._run(p.input))
        elif isinstance(p, CkksScore):
            assert isinstance(node, EncryptedScore)
            table = self._encrypted(node, self._run(p.input))
        else:
            raise QueryError(self.binding, f"cannot execute plan node {type(node).__name__}")
        self._record(node, table.num_rows, t0, engine=engine)
        return table


def _relay(out: cf.Future[Any], inner: cf.Future[Any]) -> None:
    """Copy a finished pool future's outcome into the unit's own future."""
    if inner.cancelled():
        out.set_exception(cf.CancelledError())
    elif inner.exception() is not None:
        out.set_exception(inner.exception())
    else:
        out.set_result(inner.result())
