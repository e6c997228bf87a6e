"""One ``nearest:`` search answered without the general scheduler (issue 12: the API
path's fixed cost over ``DatasetSource.search``).

A plan whose root is a select of plain columns straight over one inline vector search (a
``nearest:`` binding without order / limit / derived columns) has a ``SearchShape``,
found once per plan; ``SearchRun`` runs it: the freshness check, the search, one
select-and-rename of its columns from the search's table, and the ``Result`` with the
stats, freshness and guarantee flags the general path (``fabric.execute._Run``) gives.
What does not depend on the query -- the headers, the stats' filter texts, the output
names and types, the parameter the query vector is -- is computed with the shape. A
failing source, a timeout or an answer of other columns or types continues on the general
path from where it is (``SearchRun._general``), so every outcome is the general path's;
``tests/test_query_overhead.py`` checks that query by query."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from connectors.arrow_expr import eval_constant, utcnow
from connectors.base import ScanRequest
from dsl.ast import Call, Column, Expr, Param
from fabric.execute import freshness as _fresh
from fabric.execute.errors import QueryError
from fabric.execute.plans import _plan_caches, plan_cache
from fabric.execute.sql import UnresolvedColumn, resolve
from fabric.physical import planner as _planner
from fabric.physical.nodes import PhysicalPlan, PyArrowStep, SourceUnit
from fabric.physical.planner import NOW_PARAM
from fabric.plan.nodes import Project, VectorSearch
from fabric.result import Result

TIMEOUT = ScanRequest.timeout or 30.0
"""A source call's timeout when the catalog sets none (``scan_timeout``)."""

_F32 = np.dtype(np.float32)
_perf = time.perf_counter
_mono = time.monotonic


class SearchShape:
    """A plan that is one ``nearest:`` search run inline under a select of plain columns,
    with what ``SearchRun`` needs of it computed once. ``picked`` is the last schema of
    the search's answer and the positions to select from it (the same resolution as
    ``_Run._plain_project``'s), their types checked: an answer of that schema (one
    ``equals``, a pointer test when the source keeps its schema object, as
    ``Dataset._hits`` does) takes them as they are."""

    __slots__ = (
        "alias",
        "columns",
        "filter_text",
        "leaf",
        "leaf_header",
        "needs_now",
        "out_names",
        "param",
        "picked",
        "project",
        "project_header",
        "residual_text",
        "root_ok",
        "rows_out",
        "types",
        "unit",
    )

    def __init__(self, pp: PhysicalPlan, unit: SourceUnit, leaf: VectorSearch, project: Project):
        self.alias, self.unit, self.leaf, self.project = unit.alias, unit, leaf, project
        self.out_names = [n for n, _, _ in project.items]
        self.types = [t for _, _, t in project.items]
        self.columns = [e for _, e, _ in project.items if isinstance(e, Column)]
        schema = pp.schema
        self.root_ok = (schema.names, schema.types) == (self.out_names, self.types)
        self.leaf_header = _header(pp, leaf)
        self.project_header = _header(pp, project)
        self.filter_text = tuple(unit.text["filters"])
        self.residual_text = tuple(unit.text["residual"])
        self.rows_out = leaf.rows_out
        # the session value that is the query vector (None: an expression, evaluated)
        self.param = leaf.query.name if isinstance(leaf.query, Param) else None
        self.picked: tuple[pa.Schema, list[int] | None, bool, int | None] | None = None
        # whether the search needs the query's now() bound (``NOW_PARAM``)
        self.needs_now = any(NOW_PARAM in f.params() for f in unit.filters) or (
            self.param is None
            and leaf.query is not None
            and any(_is_now(e) for e in leaf.query.walk())
        )


def _is_now(e: Expr) -> bool:
    return isinstance(e, Call) and e.name == "now" and not e.args


def _header(pp: PhysicalPlan, node: Any) -> str:
    header = pp.headers.get(id(node))
    return header if header is not None else node.header()  # type: ignore[no-any-return]


def search_shape(pp: PhysicalPlan) -> SearchShape | None:
    """``pp``'s ``SearchShape`` (looked at once per plan), None if it has another shape."""
    hit = _plan_caches.get(id(pp))  # (plan_cache's lookup, one call less per query)
    cache = hit[1] if hit is not None and hit[0]() is pp else plan_cache(pp)
    shape = cache.search
    if shape is False:
        shape = cache.search = _find(pp)
    return shape  # type: ignore[no-any-return]


def _find(pp: PhysicalPlan) -> SearchShape | None:
    root = pp.root
    if not isinstance(root, PyArrowStep) or not isinstance(root.input, SourceUnit):
        return None
    node, unit = root.logical, root.input
    if len(pp.order) != 1 or unit.placement != "inline" or unit.chain or unit.deps:
        return None
    if unit.prescans:
        return None
    leaf = unit.leaf
    if not isinstance(leaf, VectorSearch) or leaf.text is not None or leaf.fusion is not None:
        return None
    if leaf.query is None or leaf.column is None or unit.requires:
        return None
    if not isinstance(node, Project) or node.input is not leaf or _planner.exprmap(leaf):
        return None
    if not all(isinstance(e, Column) for _, e, _ in node.items):
        return None
    return SearchShape(pp, unit, leaf, node)


# ---------------------------------------------------------------- shared with _Run


def check_params(pp: PhysicalPlan, params: Mapping[str, Any], binding: str) -> None:
    """Raise if a session value the plan uses is not bound (stage values come later)."""
    missing = sorted(p for p in pp.params.difference(params) if not p.startswith("stage:"))
    if missing:
        raise QueryError(
            binding,
            f"session value(s) {', '.join(repr(m) for m in missing)} not bound",
            hint=f"pass session={{{', '.join(repr(m) + ': ...' for m in missing)}}}",
        )


def check_freshness(run: Any, alias: str, leaf: Any, source: Any) -> None:
    """Read ``leaf``'s source freshness into ``run.freshness`` (and its wait into
    ``run.waits`` / ``run.waited``), applying its ``on_stale`` policy."""
    if leaf.freshness is None:  # nothing to enforce, nothing to wait for: as read
        wm = _fresh.read_watermark(run.catalog, source, leaf.uri)
        run.freshness[alias] = _fresh.describe(leaf.uri, wm, None, time.time())
        return
    w0 = _perf()
    try:
        info, waited = _fresh.check(
            run.catalog, source, leaf.uri, alias, leaf.freshness, run.binding
        )
    except QueryError:  # stale (fail), or still stale after waiting: the wait is kept
        run.waits[alias] = (w0, _perf())
        raise
    with run._lock:
        run.freshness[alias] = info
        run.waited += waited
        if waited:
            run.waits[alias] = (w0, _perf())


def no_search(binding: str, alias: str, vs: VectorSearch) -> QueryError:
    return QueryError(
        binding,
        "nearest: needs an indexed dataset source with search()",
        alias=alias,
        uri=vs.uri,
        hint="declare the source under datasets: with a vector index",
    )


def unbound(binding: str, name: str) -> QueryError:
    return QueryError(
        binding, f"session value {name!r} is not bound", hint=f"pass session={{'{name}': ...}}"
    )


def ms3(ms: float) -> float:
    """A time in ms rounded to the microsecond, for stats (``round(ms, 3)`` takes
    Python's float-to-decimal path: ~20 us on a cold cache, as after a search)."""
    return int(ms * 1000 + 0.5) / 1000


def entry(
    vs: VectorSearch,
    rows: int,
    nbytes: int,
    info: Any,
    ms: float,
    filters: tuple[str, ...],
    residual: tuple[str, ...],
    rows_out: int,
    analyze: bool,
) -> dict[str, Any]:
    """A search's ``res.stats['sources'][alias]``: ``rows`` and ``nbytes``
    (``answer_bytes``) of its answer, ``info`` its retrieval explain."""
    out = {
        "uri": vs.uri,
        "rows": rows,
        "bytes": nbytes,
        "batches": 1,
        "time_ms": int(ms * 1000 + 0.5) / 1000,  # (ms3, inlined: a call less per query)
        "estimated_rows": rows_out,
        "filters": list(filters),
        "residual": list(residual),
        "strategy": getattr(info, "executed", None) or getattr(info, "chosen", None),
        # exact | graph (the walk held the filtered top-k) | unverified: <why>
        "guarantee": getattr(info, "guarantee", None),
    }
    if analyze:  # the rendered retrieval explain only when asked for
        out["search"] = str(info)
    return out


def answer_bytes(table: pa.Table, width: int | None = None) -> int:
    """The bytes of a ``nearest:`` search's answer (a ranked one counts its buffers):
    its rows times its row width when every column is
    of a fixed-width type (``row_width``: what the buffers of fresh, unsliced arrays
    without NULLs hold; validity bitmaps are not counted), else the buffers' total
    (``get_total_buffer_size``, ~25 us of a fresh table right after a search). ``width``:
    ``row_width(table.schema)`` when known (``SearchRun`` keeps it with the schema)."""
    if width is None:
        width = row_width(table.schema)
    return table.num_rows * width if width is not None else table.get_total_buffer_size()


def row_width(schema: pa.Schema) -> int | None:
    """Bytes per row of ``schema`` when all of its columns are of fixed-width types."""
    total = 0
    for f in schema:
        w = _width(f.type)
        if w is None:
            return None
        total += w
    return total


def _width(t: pa.DataType) -> int | None:
    """Bytes per value of a fixed-width type, None for another (a bool's are bits)."""
    if pa.types.is_fixed_size_list(t):
        inner = _width(t.value_type)
        return None if inner is None else inner * t.list_size
    if pa.types.is_dictionary(t) or pa.types.is_boolean(t) or isinstance(t, pa.ExtensionType):
        return None
    try:
        bits = t.bit_width
    except ValueError:  # a variable-width type
        return None
    return bits // 8 if bits % 8 == 0 and bits > 0 else None


# ---------------------------------------------------------------- the run


_new = object.__new__


class SearchRun:
    """One query of a ``SearchShape`` plan. It has what ``fabric.tracing`` reads of a
    ``_Run`` (``node_stats``, ``sources``, ``freshness``, ``waits``, ``waited``,
    ``partial``, ``params``, ``pp``, ...), so a traced query records the same spans."""

    __slots__ = (
        "allow_partial",
        "binding",
        "catalog",
        "done",
        "freshness",
        "futures",
        "node_stats",
        "now",
        "params",
        "partial",
        "pp",
        "shape",
        "sources",
        "stage_tables",
        "waited",
        "waits",
    )

    analyze = False  # (an analyzed run takes the general path: its explain)
    #: guards the stats against the tracing worker's copy (all of a run's writes are on
    #: the caller's thread, before the worker reads: one lock for every run will do)
    _lock = threading.Lock()

    def __init__(
        self,
        pp: PhysicalPlan,
        shape: SearchShape,
        params: dict[str, Any],
        catalog: Any,
        binding: str,
        now: dt.datetime | None,
        allow_partial: bool,
    ) -> None:
        self.pp, self.shape, self.params, self.catalog = pp, shape, params, catalog
        self.binding, self.now, self.allow_partial = binding, now, allow_partial
        self.node_stats: dict[int, dict[str, Any]] = {}
        self.sources: dict[str, dict[str, Any]] = {}
        self.freshness: dict[str, dict[str, Any]] = {}
        self.waits: dict[str, tuple[float, float]] = {}
        self.waited = 0.0
        self.partial = False

    def run(self) -> Result:
        t0 = _perf()
        pp, shape, params = self.pp, self.shape, self.params
        if not pp.params <= params.keys():  # (bound by the caller: checked once)
            check_params(pp, params, self.binding)
        alias, leaf = shape.alias, shape.leaf
        t_unit = _mono()
        try:
            source = self.catalog.source(leaf.uri)
        except Exception as e:  # down, unknown connection, dropped table...
            return self._general(t0, "_fail", alias, leaf.uri, e)
        if leaf.freshness is not None:  # a bound to enforce: check before reading
            check_freshness(self, alias, leaf, source)
        search = getattr(source, "search", None)
        if not callable(search):
            raise no_search(self.binding, alias, leaf)
        name = shape.param
        t1 = _perf()
        try:
            if shape.needs_now:  # now() in a filter or in the query: one instant per query
                if self.now is None:
                    self.now = utcnow()
                bound = {**params, NOW_PARAM: self.now}
            else:
                bound = params
            if name is not None and name in params:
                q = params[name]
            elif isinstance(leaf.query, Param):
                raise unbound(self.binding, leaf.query.name)
            else:
                assert leaf.query is not None
                q = eval_constant(leaf.query, params, self.now)
            if type(q) is not np.ndarray or q.dtype is not _F32:  # (a bound vector is)
                q = np.asarray(q, dtype=np.float32)
            table, info = search(
                column=leaf.column,
                query=q,
                k=leaf.k,
                filters=shape.unit.filters,
                params=bound,
                columns=leaf.projection,
                analyze=False,
            )
        except QueryError:
            raise
        except Exception as e:
            return self._general(t0, "_fail", alias, leaf.uri, e)
        end = _perf()
        ms = (end - t1) * 1000
        schema = table.schema
        picked = shape.picked
        if picked is None or not schema.equals(picked[0]):
            picked = self._pick(schema)
        rows = table.num_rows
        nbytes = rows * picked[3] if picked is not None and picked[3] is not None else None
        src = self.sources[alias] = entry(
            leaf,
            rows,
            answer_bytes(table) if nbytes is None else nbytes,
            info,
            ms,
            shape.filter_text,
            shape.residual_text,
            shape.rows_out,
            False,
        )
        self.node_stats[id(leaf)] = {
            "op": shape.leaf_header,
            "rows": rows,
            "time_ms": ms,
            "engine": "arrow",
            "end": end,
        }
        if leaf.freshness is None:  # nothing to enforce: report the freshness as read
            check_freshness(self, alias, leaf, source)
        if _mono() - t_unit > float(getattr(self.catalog, "scan_timeout", None) or TIMEOUT):
            return self._general(t0, "_timed_out", alias)
        if picked is None:  # the general path says which column is missing, or casts
            return self._general(t0, "_prefixed", alias, table)
        t2 = _perf()
        out = table if picked[1] is None else table.select(picked[1])
        if picked[2]:
            out = out.rename_columns(shape.out_names)
        if not shape.root_ok:
            from fabric.execute.pyarrow_ops import _conform

            out = _conform(out, pp.schema)
        end = _perf()
        n = out.num_rows
        self.node_stats[id(shape.project)] = {
            "op": shape.project_header,
            "rows": n,
            "time_ms": (end - t2) * 1000,
            "engine": "arrow",
            "end": end,
        }
        res = _new(Result)  # Result(...) of a frozen dataclass: 7 object.__setattr__
        res.__dict__.update(
            table=out,
            freshness=self.freshness,
            stats={
                "sources": self.sources,
                "operators": [  # (ms3 of the times, inlined)
                    {"op": shape.leaf_header, "rows": rows, "time_ms": src["time_ms"]},
                    {
                        "op": shape.project_header,
                        "rows": n,
                        "time_ms": int((end - t2) * 1e6 + 0.5) / 1000,
                    },
                ],
                "total_ms": int((_perf() - t0) * 1e6 + 0.5) / 1000,
                "rows_fetched": rows,
                "bytes_fetched": src["bytes"],
            },
            explain=None,
            waited=self.waited,
            partial=False,
            binding=self.binding,
        )
        return res  # type: ignore[no-any-return]

    def _pick(
        self, schema: pa.Schema
    ) -> tuple[pa.Schema, list[int] | None, bool, int | None] | None:
        """What to take from an answer of ``schema``, kept in the shape: the positions of
        the select's columns (None: all, in order), whether they need the select's names,
        the answer's ``row_width``; None when a column is missing or of another type than
        declared (the general path resolves, casts or says which)."""
        shape = self.shape
        prefixed = [f"{shape.alias}.{n}" for n in schema.names]
        try:
            cols = [prefixed.index(resolve(c, prefixed, {})) for c in shape.columns]
        except UnresolvedColumn:
            return None
        if [schema.field(i).type for i in cols] != shape.types:
            return None
        rename = [schema.names[i] for i in cols] != shape.out_names
        every = cols == list(range(len(schema)))
        picked = (schema, None if every else cols, rename, row_width(schema))
        shape.picked = picked  # one assignment: concurrent runs see either
        return picked

    def _general(self, t0: float, unit: str, *args: Any) -> Result:
        """The rest of the query on the general path: a ``_Run`` holding what this run
        recorded so far, its unit's table given by its method ``unit(*args)`` (a failure's
        partial table, or its error raised), then the plan above it and the general
        epilogue."""
        from fabric.execute import _Run

        now = self.now or utcnow()
        run = _Run(self.pp, self.params, self.catalog, self.binding, False, now, self.allow_partial)
        run.node_stats, run.sources, run.freshness = self.node_stats, self.sources, self.freshness
        run.waits, run.waited = self.waits, self.waited
        try:
            run.deadline = _mono() + run.timeout * (1 + self.pp.depth)
            table = getattr(run, unit)(*args)
            return run.finish(run.run_from(self.shape.alias, table), t0)
        finally:
            self.waited, self.partial = run.waited, run.partial
