"""Source units: fetching from a source (scan or search) and the chain above it."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from connectors._util import BadValueError
from connectors.arrow_expr import (
    NotTranslatable,
    canonical_floats,
    eval_constant,
)
from connectors.base import ScanRequest, SourceError
from dsl.ast import Binary, Column, Expr, InList, Literal, Param
from fabric import functions
from fabric.execute import bounds as _bounds
from fabric.execute import branch_keys as _branch_keys
from fabric.execute.errors import QueryError
from fabric.execute.search import (
    answer_bytes,
    check_freshness,
    ms3,
    no_search,
    unbound,
)
from fabric.execute.search import entry as _search_entry
from fabric.execute.sql import resolve
from fabric.execute.state import RunState
from fabric.physical.nodes import (
    PhysicalError,
)
from fabric.physical.planner import NOW_PARAM
from fabric.plan.nodes import (
    Scan,
    VectorSearch,
)


class SourceUnits(RunState):
    """One source unit, on a pool thread or the caller's: the source's freshness, its
    scan (dynamic filters' keys sent as a bound IN list, a range or a bound) or search,
    the stats of what it fetched, then the Filter / Derive chain above it."""

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

    @staticmethod
    def _prefixed(alias: str, table: pa.Table) -> pa.Table:
        return table.rename_columns([f"{alias}.{n}" for n in table.schema.names])


class _SourceFailed(Exception):
    """A connector call failed; carries the original error to the unit's handler."""

    def __init__(self, cause: Exception):
        self.cause = cause
        super().__init__(str(cause))


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


def latest_per_key(table: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Keep the last row (in arrival order) of each key: ``latest_by`` applied by the fabric
    for sources that cannot do it themselves."""
    if table.num_rows == 0:
        return table
    idx = pa.array(np.arange(table.num_rows, dtype=np.int64))
    # a float key as SQL compares it: -0.0 = 0.0, every NaN one key (canonical_floats)
    cols = [
        canonical_floats(table.column(k))
        if pa.types.is_floating(table.schema.field(k).type)
        else table.column(k)
        for k in keys
    ]
    names = [f"__k{i}" for i in range(len(keys))]
    g = (
        pa.table([*cols, idx], names=[*names, "__i"])
        .group_by(names, use_threads=False)
        .aggregate([("__i", "max")])
    )
    return table.take(np.sort(g.column("__i_max").to_numpy()))
