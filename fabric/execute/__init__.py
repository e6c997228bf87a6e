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
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import math
import os
import threading
import time
from collections.abc import Mapping
from functools import partial
from itertools import chain
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors._util import BadValueError
from connectors.arrow_expr import (
    NotTranslatable,
    canonical_floats,
    eval_constant,
    sort_indices,
    utcnow,
)
from connectors.base import ScanRequest, SourceError
from dsl.ast import Binary, Column, Expr, InList, Literal, Param, Star
from fabric import functions
from fabric.execute import bounds as _bounds
from fabric.execute import branch_keys as _branch_keys
from fabric.execute import search as _search
from fabric.execute import stages as _stages
from fabric.execute.errors import QueryError
from fabric.execute.plans import physical, plan_cache
from fabric.execute.search import (
    SearchRun,
    answer_bytes,
    check_freshness,
    check_params,
    ms3,
    no_search,
    search_shape,
    unbound,
)
from fabric.execute.search import entry as _search_entry
from fabric.execute.sql import Rel, SqlBuilder, UnresolvedColumn, quote, resolve, substitute
from fabric.execute.sql import typed as _typed
from fabric.physical import planner as _planner
from fabric.physical.nodes import (
    CkksScore,
    DuckDBRegion,
    DuckDBStep,
    Physical,
    PhysicalError,
    PhysicalPlan,
    PyArrowStep,
    SandboxCall,
    SourceUnit,
    StagesFirst,
    StageTable,
)
from fabric.physical.planner import NOW_PARAM
from fabric.plan.nodes import (
    Aggregate,
    Derive,
    EncryptedScore,
    Filter,
    Join,
    Limit,
    Plan,
    Project,
    Scan,
    Sort,
    Stage,
    StageRef,
    UserFunction,
    VectorSearch,
)
from fabric.result import Result

__all__ = ["QueryError", "execute", "physical", "scan_pool"]

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


# ---------------------------------------------------------------- the shared scan pool

POOL_THREADS = int(os.environ.get("FABRIC_SCAN_THREADS", "16"))
"""Threads of the process-wide pool that runs the source units of multi-source plans.
Scans are I/O-bound (they wait on servers), so more threads than cores pay off; a query
never blocks a pool thread waiting for another unit (dependent units are submitted when
their keys are ready), so a busy pool queues work but cannot deadlock."""

_pool: cf.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def scan_pool() -> cf.ThreadPoolExecutor:
    """The process-wide pool for source units (created on first use, recreated after fork)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = cf.ThreadPoolExecutor(
                    max_workers=max(1, POOL_THREADS), thread_name_prefix="fabric-scan"
                )
    return _pool


def _forget_pool() -> None:  # a forked child has the pool object but not its threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


_UNARY = (Filter, Derive, Project, Sort, Limit)
_ONE_INPUT = (*_UNARY, Aggregate)  # nodes with an .input


class _Run:
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
        self.timeout = float(getattr(catalog, "scan_timeout", None) or DEFAULT_TIMEOUT)
        self.stage_tables: dict[str, pa.Table] = {}  # results of the stages run so far
        self.conformed: pa.Table | None = None  # the answer, already of the plan's types

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

    @staticmethod
    def _prefixed(alias: str, table: pa.Table) -> pa.Table:
        return table.rename_columns([f"{alias}.{n}" for n in table.schema.names])

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

    # ------------------------------------------------------------ one source unit (in a thread)
    def _unit(self, alias: str) -> pa.Table:
        unit = self.units[alias]
        leaf = unit.leaf
        try:
            source = self.catalog.source(leaf.uri)
        except Exception as e:  # down, unknown connection, dropped table...
            return self._fail(alias, leaf.uri, e)
        if leaf.freshness is not None:  # a bound to enforce: check before reading
            check_freshness(self, alias, leaf, source)
        t0 = time.perf_counter()
        try:
            if isinstance(leaf, Scan):
                table = self._scan(alias, leaf, source)
            else:
                table = self._search(alias, leaf, source)
        except _SourceFailed as e:
            return self._fail(alias, leaf.uri, e.cause)
        self._record(leaf, table.num_rows, t0 + self._dep_wait.get(alias, 0.0))
        if leaf.freshness is None:  # nothing to enforce: report the freshness as read
            check_freshness(self, alias, leaf, source)
        for node, engine in reversed(tuple(zip(unit.chain, unit.engines))) if unit.chain else ():
            t0 = time.perf_counter()
            if engine == "duckdb":
                table = self._sql_over(node, table)
            else:
                table = self._apply_unary(node, table)
            self._record(
                node, table.num_rows, t0, engine="duckdb" if engine == "duckdb" else "arrow"
            )
        return table

    def _fail(self, alias: str, uri: str, e: Exception) -> pa.Table:
        if self.allow_partial:
            return self._partial(alias, str(e))
        msg = str(e) if isinstance(e, SourceError) else f"{type(e).__name__}: {e}"
        hint = getattr(e, "hint", None)
        if hint is None and isinstance(e, BadValueError):
            hint = "pass a session value of the column's type (see the binding's session:)"
        if hint is None and isinstance(e, NotTranslatable | TypeError):
            # not the server: the source accepted a filter at planning it cannot apply now
            filters = "; ".join(self.units[alias].text.get("exact", ()))
            hint = (
                f"{uri} accepted a filter it could not apply when scanning ({filters}); "
                "this is a connector bug: report the binding (the filter is never dropped)"
            )
        hint = hint or "check that the server is up and the source exists"
        raise QueryError(self.binding, msg, alias=alias, uri=uri, hint=hint) from e

    def _scan(self, alias: str, scan: Scan, source: Any) -> pa.Table:
        # now() is one instant per query, bound like a session value for every source
        filters: list[Expr] = list(self.units[alias].filters)
        params = dict(self.params)
        params[NOW_PARAM] = self.now
        dyn_stats = []
        for i, d in enumerate(scan.dynamic):
            dep = d.provider
            if dep is None:
                raise PhysicalError(f"dynamic filter {d} names no source unit")
            w0 = time.perf_counter()
            keys_table = self._wait(dep)
            self._dep_wait[alias] = self._dep_wait.get(alias, 0.0) + time.perf_counter() - w0
            if d.op == "or":  # keyed per branch of an OR (fabric.optimizer.branch_keys)
                resolver = partial(_resolve_in, keys_table.column_names)
                expr, st = _branch_keys.pushed(
                    d, f"__dyn_{i}", keys_table, self.params, self.now, resolver, params
                )
                dyn_stats.append(st)
                if expr == Literal(False, "bool"):  # no branch has a key: nothing joins
                    self._source_stats(alias, scan, 0, 0, 0, 0.0, dyn_stats, skipped=True)
                    return scan.schema.empty_table()
                if expr is not None:
                    filters.append(expr)
                continue
            keys = functions.evaluate(
                d.from_expr,
                keys_table,
                self.params,
                resolve=partial(_resolve_in, keys_table.column_names),
                now=self.now,
            )
            keys = pc.unique(
                keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
            ).drop_null()
            if d.op != "in":  # a join bound (fabric.optimizer.join_bounds)
                bound = _bounds.pushed(d.op, keys, scan.source_schema.field(d.column).type)
                dyn_stats.append({"filter": str(d), "keys": len(keys), "pushed": bool(bound)})
                if len(keys) == 0:
                    self._source_stats(alias, scan, 0, 0, 0, 0.0, dyn_stats, skipped=True)
                    return scan.schema.empty_table()
                if bound is not None:
                    filters.append(Binary(bound[0], Column(d.column), Param(f"__dyn_{i}")))
                    params[f"__dyn_{i}"] = bound[1]
                    dyn_stats[-1].update(form="bound", bound=[bound[0], str(bound[1])])
                continue
            form = "in" if len(keys) <= d.max_keys else "range" if d.range else None
            dyn_stats.append(
                {"filter": str(d), "keys": len(keys), "pushed": form is not None, "form": form}
            )
            if len(keys) == 0:
                self._source_stats(alias, scan, 0, 0, 0, 0.0, dyn_stats, skipped=True)
                return scan.schema.empty_table()
            name = f"__dyn_{i}"
            if form == "in":
                filters.append(InList(Column(d.column), Param(name)))
                params[name] = keys.to_pylist()
            elif form == "range":
                bounds = pc.min_max(keys)
                lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
                filters.append(Binary(">=", Column(d.column), Param(name + "_lo")))
                filters.append(Binary("<=", Column(d.column), Param(name + "_hi")))
                params[name + "_lo"], params[name + "_hi"] = lo, hi
                dyn_stats[-1]["range"] = [lo, hi]
        own_latest = bool(scan.latest_by) and "latest_by" not in getattr(source, "capabilities", ())
        columns = scan.projection
        if own_latest and columns is not None:
            columns = (*columns, *(k for k in scan.latest_by if k not in columns))
        request = ScanRequest(
            columns=columns,
            filters=tuple(filters),
            params=params,
            limit=scan.limit,
            order_by=scan.order_by,
            latest_by=scan.latest_by,
            timeout=self.timeout,
            aggregate=self.units[alias].aggregate,
        )
        t0 = time.perf_counter()
        ray_info = None
        try:
            # executor: ray reads coarse scans as Ray tasks (fabric.ray.scan); None: here
            hook = getattr(self.catalog, "executor", None)
            remote = hook.scan(source, request, scan) if hook is not None else None
            if remote is None:
                batches = list(source.scan(request))
            else:
                batches, ray_info = remote
        except Exception as e:  # SourceError, or a driver error the connector did not wrap
            raise _SourceFailed(e) from e
        ms = (time.perf_counter() - t0) * 1000
        rows = sum(b.num_rows for b in batches)
        nbytes = sum(b.nbytes for b in batches)
        if request.aggregate is not None:  # grouped at the source: the aggregate's columns
            table = _aggregated(scan, request.aggregate, batches)
        elif batches:
            table = pa.Table.from_batches(batches)
        else:
            src_schema = scan.source_schema
            cols = scan.projection if scan.projection is not None else src_schema.names
            table = pa.schema([src_schema.field(c) for c in cols]).empty_table()
        if own_latest:
            table = latest_per_key(table, scan.latest_by)
        grouped = request.aggregate is not None
        if (
            not grouped
            and scan.projection is not None
            and table.column_names != list(scan.projection)
        ):
            missing = [c for c in scan.projection if c not in table.column_names]
            if missing:
                raise SourceError(scan.uri, f"scan returned no column(s) {', '.join(missing)}")
            table = table.select(list(scan.projection))
        if not grouped:
            table = table.rename_columns([f"{alias}.{n}" for n in table.column_names])
        self._source_stats(alias, scan, rows, nbytes, len(batches), ms, dyn_stats)
        if grouped:  # the source answered with the aggregate's rows (push_aggregate)
            with self._lock:
                self.sources[alias]["aggregated"] = True
        if ray_info is not None:
            with self._lock:
                self.sources[alias]["ray"] = ray_info
        # what this scan cost and found at the source (connectors.base.ScanMetrics): its
        # statement, requests, retries and waits, records and bad records, files read
        measured = request.metrics.as_dict()
        if measured:
            with self._lock:
                self.sources[alias]["source"] = measured
        return table

    def _source_stats(
        self,
        alias: str,
        scan: Scan,
        rows: int,
        nbytes: int,
        batches: int,
        ms: float,
        dyn: list,
        skipped: bool = False,
    ) -> None:
        text = self.units[alias].text
        entry = {
            "uri": scan.uri,
            "rows": rows,
            "bytes": nbytes,
            "batches": batches,
            "time_ms": ms3(ms),
            "estimated_rows": scan.estimated_rows,
            "exact": list(text["exact"]),
            "inexact": list(text["inexact"]),
            "residual": list(text["residual"]),
            "dynamic": dyn,
        }
        if skipped:
            entry["skipped"] = "no dynamic-filter keys: nothing can join"
        with self._lock:
            self.sources[alias] = entry

    def _search(self, alias: str, vs: VectorSearch, source: Any) -> pa.Table:
        """The search's rows as ``alias.column`` and its stats entry."""
        search = getattr(source, "search", None)
        if not callable(search):
            raise no_search(self.binding, alias, vs)
        t0 = time.perf_counter()
        try:
            if vs.text is not None or vs.fusion is not None:  # search: / rank:
                table, info = self._ranked(alias, vs, source)
            else:
                assert vs.query is not None and vs.column is not None
                table, info = search(
                    column=vs.column,
                    query=np.asarray(self._constant(vs.query), dtype=np.float32),
                    k=vs.k,
                    filters=self.units[alias].filters,
                    params={**self.params, NOW_PARAM: self.now},
                    columns=vs.projection,
                    analyze=self.analyze,
                )
        except QueryError:
            raise
        except Exception as e:
            raise _SourceFailed(e) from e
        ms = (time.perf_counter() - t0) * 1000
        text = self.units[alias].text
        ranked = vs.text is not None or vs.fusion is not None  # (its buffers, bitmaps too)
        entry = _search_entry(
            vs,
            table.num_rows,
            table.get_total_buffer_size() if ranked else answer_bytes(table),
            info,
            ms,
            text["filters"],
            text["residual"],
            vs.rows_out,
            self.analyze,
        )
        table = self._prefixed(alias, table)
        with self._lock:
            self.infos[alias] = info
            self.sources[alias] = entry
        return table

    def _ranked(self, alias: str, vs: VectorSearch, source: Any) -> tuple[pa.Table, Any]:
        """BM25 keyword arm and/or RRF fusion (indexes.ranking), through the source's
        ``rank()``; the query text and vector are bound session values."""
        rank = getattr(source, "rank", None)
        if not callable(rank):
            raise QueryError(
                self.binding,
                "search: / rank: need an indexed dataset source with rank()",
                alias=alias,
                uri=vs.uri,
                hint="declare the source under datasets: with an inverted index",
            )
        vector = text = None
        if vs.column is not None and vs.query is not None:
            q = np.asarray(self._constant(vs.query), dtype=np.float32)
            vector = (vs.column, q, vs.k)
        if vs.text is not None:
            text = (vs.text.column, self._constant(vs.text.query), vs.text.k)
        f = vs.fusion
        return rank(
            vector=vector,
            text=text,
            fusion=None if f is None else (f.rrf_k, f.k, f.recency, f.half_life_seconds),
            filters=self.units[alias].filters,
            params={**self.params, NOW_PARAM: self.now},
            columns=vs.projection,
        )

    def _constant(self, e: Expr) -> Any:
        if isinstance(e, Param) and e.name not in self.params:
            raise unbound(self.binding, e.name)
        return eval_constant(e, self.params, self.now)

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

    # ------------------------------------------------------------ hooks
    def _user_function(self, node: UserFunction, table: pa.Table) -> pa.Table:
        factory = getattr(self.catalog, "sandbox", None)
        if not callable(factory):
            raise QueryError(
                self.binding,
                "pushdown.python needs a sandbox, and this catalog has none",
                hint="open the fabric with fabric.open(...) so the sandbox pool is configured",
            )
        sandbox = factory()
        missing = [p for p in node.params if p not in self.params]
        if missing:
            raise QueryError(
                self.binding,
                f"session value(s) {', '.join(missing)} needed by pushdown.python are not bound",
            )
        out = sandbox.run(
            node.code,
            table,
            params={p: self.params[p] for p in node.params},
            limits=node.limits,
            binding=self.binding,
            snippet_origin=(node.file, node.line, node.col),
        )
        return out if isinstance(out, pa.Table) else out.table

    def _encrypted(self, node: EncryptedScore, table: pa.Table) -> pa.Table:
        hook = getattr(self.catalog, "crypto_score", None)
        if not callable(hook):
            raise QueryError(
                self.binding,
                "encrypted scoring needs the CKKS public context, and this catalog has none",
                hint="configure crypto: {public_context: agent.pub} in fabric.yaml",
            )
        try:
            out = hook(node, table, self.params)
        except SourceError as e:
            raise QueryError(self.binding, str(e), uri=e.uri, hint=e.hint) from e
        if isinstance(out, pa.Table):
            return out
        return table.append_column(pa.field(node.name, pa.binary()), pa.array(out, pa.binary()))

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

    def _explain(self, table: pa.Table, total_ms: float) -> str:
        scan_alias = {id(u.leaf): alias for alias, u in self.units.items()}

        def annotate(node: Plan) -> str | None:
            s = self.node_stats.get(id(node))
            parts = []
            if s is None:
                return None
            if s.get("rows") is not None:
                parts.append(f"rows={s['rows']}")
            est = getattr(node, "estimated_rows", None)
            if est is not None:
                parts.append(f"est={est}")
            if "time_ms" in s:
                parts.append(f"time={s['time_ms']:.2f}ms")
            if s.get("engine") and s["engine"] != "arrow":
                parts.append(s["engine"])
            alias = scan_alias.get(id(node))
            if alias is not None and alias in self.sources:
                src = self.sources[alias]
                parts.append(f"fetched={src.get('rows', 0)} rows/{_kib(src.get('bytes', 0))}")
                if isinstance(node, Scan):
                    parts.append(
                        f"pushed exact=[{', '.join(src['exact'])}] inexact=[{', '.join(src['inexact'])}]"
                    )
                if src.get("residual"):
                    parts.append(f"residual=[{', '.join(src['residual'])}]")
                for d in src.get("dynamic", ()):
                    how = {
                        "in": "pushed",
                        "range": f"pushed as range [{d.get('range', ['?', '?'])[0]}, {d.get('range', ['?', '?'])[1]}]",
                        "bound": " ".join(["pushed as", *d.get("bound", ())]),
                    }.get(d.get("form") or "", "NOT pushed (over max)")
                    parts.append(f"dynamic {d['filter']}: {d['keys']} keys {how}")
                if src.get("skipped"):
                    parts.append("scan skipped (no keys)")
                if alias in self.ran_inline:
                    parts.append("ran inline (ready alone)")
                parts.extend(_measured(src.get("source") or {}))
                f = self.freshness.get(alias)
                if f is not None:
                    parts.append(f"freshness={f['status']}")
            return " ".join(parts)

        lines = [f"Result: {table.num_rows} rows in {total_ms:.2f} ms (binding {self.binding})"]
        lines.append(self.pp.explain(annotate))
        for q in self.queries:
            lines.append(f"DuckDB: {q}")
        for alias, src in self.sources.items():  # what each scan sent to its server
            statement = (src.get("source") or {}).get("statement")
            if statement is not None:  # on one line (SQLAlchemy breaks before FROM, WHERE)
                lines.append(f"Sent {alias} <- {src['uri']}: {' '.join(statement.split())}")
        for alias, info in self.infos.items():
            kind = "Ranking" if type(info).__name__ == "RankExplain" else "VectorSearch"
            lines.append(f"{kind} {alias}:")
            lines.extend("  " + ln for ln in str(info).splitlines())
        if self.freshness:
            lines.append("Freshness:")
            for alias, f in self.freshness.items():
                extra = "".join(
                    f" {k}={f[k]}"
                    for k in ("lag_messages", "lag_seconds", "watermark")
                    if f.get(k) is not None
                )
                lines.append(f"  {alias} <- {f['uri']}: {f['status']}{extra}")
        return "\n".join(lines)


# ---------------------------------------------------------------- helpers


def _relay(out: cf.Future[Any], inner: cf.Future[Any]) -> None:
    """Copy a finished pool future's outcome into the unit's own future."""
    if inner.cancelled():
        out.set_exception(cf.CancelledError())
    elif inner.exception() is not None:
        out.set_exception(inner.exception())
    else:
        out.set_result(inner.result())


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


class _SourceFailed(Exception):
    """A connector call failed; carries the original error to the unit's handler."""

    def __init__(self, cause: Exception):
        self.cause = cause
        super().__init__(str(cause))


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


def _resolve_in(names: list[str], col: Column) -> str:
    return resolve(col, names, {})


def _aggregated(scan: Scan, agg: Any, batches: list) -> pa.Table:
    """A source's aggregated answer with the aggregate's names and declared types."""
    want = agg.schema
    table = pa.Table.from_batches(batches) if batches else want.empty_table()
    if table.column_names != want.names:
        raise SourceError(
            scan.uri,
            f"an aggregated scan returned columns [{', '.join(table.column_names)}], "
            f"not [{', '.join(want.names)}]",
            hint="this is a connector bug (Capability.AGGREGATE): report the binding",
        )
    if not agg.group_by and table.num_rows != 1:
        raise SourceError(scan.uri, f"an aggregate without groups returned {table.num_rows} rows")
    return table if table.schema.equals(want) else table.cast(want)


def _measured(m: Mapping[str, Any]) -> list[str]:
    """A scan's ScanMetrics (``as_dict()``) on its line of explain(analyze=True)."""
    parts = []
    if "requests" in m:  # the connection's budget: REST pages, rate-limited scans
        parts.append(
            f"requests={m['requests']} retries={m.get('retries', 0)}"
            f" throttled={m.get('throttle_wait_ms', 0):.1f}ms"
            f" backoff={m.get('backoff_wait_ms', 0):.1f}ms"
        )
    if "records" in m:
        parts.append(f"records={m['records']} bad_records={m.get('bad_records', 0)}")
    if "files_read" in m:
        parts.append(f"files={m['files_read']}/{m.get('files_total', '?')}")
    if "row_groups_read" in m:
        parts.append(f"row_groups={m['row_groups_read']}/{m.get('row_groups_total', '?')}")
    if "cache" in m:
        parts.append(f"cache={m['cache']}")
    return parts


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}KiB" if n >= 1024 else f"{n}B"


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


def latest_per_key(table: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Keep the last row (in arrival order) of each key: ``latest_by`` applied by the fabric
    for sources that cannot do it themselves."""
    if table.num_rows == 0:
        return table
    idx = pa.array(np.arange(table.num_rows, dtype=np.int64))
    g = (
        table.select(list(keys))
        .append_column("__i", idx)
        .group_by(list(keys), use_threads=False)
        .aggregate([("__i", "max")])
    )
    return table.take(np.sort(g.column("__i_max").to_numpy()))
