"""Source scans as Ray tasks, split by each source's natural unit.

``RayScans.scan(source, request, scan)`` is the one place the executor asks
(``fabric.execute._Run._scan``): it returns the scan's record batches read by Ray tasks,
or ``None`` when the scan should stay local. A scan goes to Ray only when it is coarse:

- its estimated rows (the plan's ``est_rows``, else the source's statistics) are at least
  ``min_rows``;
- it has no limit, order or latest-by pushed (those need the whole source in one place);
- it splits into two or more pieces:

  ============  ==========================================================================
  source        split
  ============  ==========================================================================
  s3            files (Parquet, CSV, JSON) in path order, in contiguous groups
  sql           ranges of a single integer primary key (``pk < b1``, ``b1 <= pk < b2``,
                ... ``pk >= bn``: open at both ends, so rows added after the statistics
                were taken are still read), sent as extra bound filters
  mongo         ranges of ``_id`` (ObjectId or integer; open at both ends) merged into
                the find filter
  kafka         partitions, in contiguous groups; each task reads its partitions from
                their low watermarks to their ends as the scan starts (``cache: false``
                in the worker: no tail cache per worker); rows come partition by
                partition: a local scan's rows, not its interleaving order
  ============  ==========================================================================

Each task opens the connection in its worker (``open_connection(name, options)``; kept
per worker process), runs the connector's own ``scan`` over its piece and returns Arrow
record batches through the object store; the driver concatenates them in split order,
so a scan gives the rows a local scan gives (in the order of the split key: the order
in which a local scan reads files, and the primary-key / ``_id`` order of the ranges;
Kafka partition by partition).
Tasks ask for one CPU each, so at most ``num_cpus`` run at once.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import pickle
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from connectors.base import ScanMetrics, ScanRequest
from dsl.ast import Binary, Column, Param

__all__ = ["DEFAULT_MIN_ROWS", "RayScans", "plan_splits"]

#: below this many estimated rows a scan stays in-process: a Ray task costs ~2 ms and
#: moving 1M rows x 2 columns (16 MB) through the object store ~34 ms here
DEFAULT_MIN_ROWS = 100_000


@dataclass(frozen=True)
class Split:
    """One piece of a scan: ``kind`` 'files' (paths), 'range' (extra filters + params),
    'mongo_id' (lo, hi) or 'partitions' (Kafka partitions)."""

    kind: str
    files: tuple[str, ...] = ()
    partitions: tuple[int, ...] = ()
    filters: tuple[Any, ...] = ()
    params: Mapping[str, Any] | None = None
    lo: Any = None
    hi: Any = None


def _identity(source: Any) -> tuple[str, dict[str, Any], str] | None:
    """(connection name, connection options, object) a worker reopens the source from."""
    conn = getattr(source, "conn", None)
    name, options = getattr(conn, "name", None), getattr(conn, "options", None)
    if not name or not isinstance(options, Mapping) or "kind" not in options:
        return None
    obj = source.uri.partition("://")[2].partition("/")[2]
    return name, dict(options), obj


def plan_splits(source: Any, request: ScanRequest, tasks: int) -> list[Split]:
    """The pieces of a scan of ``source`` (at most ``tasks``; [] when it does not split)."""
    kind = source.uri.partition("://")[0]
    if tasks < 2:  # one task: the whole scan, unsplit, in a worker
        whole = kind in ("s3", "mongo", "kafka") or hasattr(source, "table")
        return [Split("range")] if whole else []
    if kind == "s3":
        return _s3_splits(source, tasks)
    if hasattr(source, "table") and hasattr(source, "translate"):  # connectors.sql
        return _sql_splits(source, tasks)
    if kind == "mongo":
        return _mongo_splits(source, tasks)
    if kind == "kafka":
        parts = sorted(getattr(source, "partitions", ()))
        if len(parts) < 2:
            return []
        return [Split("partitions", partitions=tuple(g)) for g in _chunks(parts, tasks)]
    return []


def _chunks(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` in ``n`` contiguous groups as even as possible (order kept)."""
    n = max(1, min(n, len(items)))
    out, start = [], 0
    for i in range(n):
        end = start + (len(items) - start) // (n - i)
        out.append(items[start:end])
        start = end
    return [c for c in out if c]


def _s3_splits(source: Any, tasks: int) -> list[Split]:
    """Whole files, in the order a local scan reads them, in contiguous groups. (Row groups
    of one file are not split: a scan of a row-group fragment of a view read the whole
    file from the S3 server here, so a file is the unit.)"""
    source.refresh()
    frags = list(source.dataset.get_fragments())
    if len(frags) < 2:
        return []
    return [Split("files", tuple(f.path for f in group)) for group in _chunks(frags, tasks)]


def _bounds(lo: int, hi: int, n: int) -> list[int]:
    span = hi - lo + 1
    cuts = sorted({lo + span * i // n for i in range(1, n)})
    return [c for c in cuts if lo < c <= hi]


def _sql_splits(source: Any, tasks: int) -> list[Split]:
    pk = list(source.table.primary_key.columns)
    if len(pk) != 1:
        return []
    name = pk[0].name
    typ = source.schema().field(name).type
    if not pa.types.is_integer(typ):
        return []
    st = source.statistics().columns.get(name)
    if st is None or st.min is None or st.max is None:
        return []
    cuts = _bounds(int(st.min), int(st.max), tasks)
    return _range_splits(name, cuts)


def _range_splits(name: str, cuts: list[Any]) -> list[Split]:
    if not cuts:
        return []
    col, lo, hi = Column(name), Param("__ray_lo"), Param("__ray_hi")
    out = [Split("range", filters=(Binary("<", col, hi),), params={"__ray_hi": cuts[0]})]
    for a, b in itertools.pairwise(cuts):
        out.append(
            Split(
                "range",
                filters=(Binary(">=", col, lo), Binary("<", col, hi)),
                params={"__ray_lo": a, "__ray_hi": b},
            )
        )
    out.append(Split("range", filters=(Binary(">=", col, lo),), params={"__ray_lo": cuts[-1]}))
    return out


def _mongo_splits(source: Any, tasks: int) -> list[Split]:
    from bson import ObjectId

    coll = source.coll
    first = next(iter(coll.find({}, {"_id": 1}).sort("_id", 1).limit(1)), None)
    last = next(iter(coll.find({}, {"_id": 1}).sort("_id", -1).limit(1)), None)
    if first is None or last is None:
        return []
    lo, hi = first["_id"], last["_id"]
    if isinstance(lo, ObjectId) and isinstance(hi, ObjectId):
        a, b = int.from_bytes(lo.binary, "big"), int.from_bytes(hi.binary, "big")
        cuts: list[Any] = [ObjectId(c.to_bytes(12, "big")) for c in _bounds(a, b, tasks)]
    elif type(lo) is int and type(hi) is int:
        cuts = _bounds(lo, hi, tasks)
    else:
        return []
    if not cuts:
        return []
    edges: list[Any] = [None, *cuts, None]
    return [Split("mongo_id", lo=edges[i], hi=edges[i + 1]) for i in range(len(edges) - 1)]


# ---------------------------------------------------------------- worker side

_worker_conns: dict[str, Any] = {}  # connection key -> Connection, per worker process
_worker_sources: dict[tuple[str, str], Any] = {}
_worker_lock = threading.Lock()


def _worker_source(name: str, options: dict[str, Any], obj: str) -> Any:
    from connectors.base import open_connection

    key = hashlib.sha1(pickle.dumps((name, sorted(options.items(), key=str)))).hexdigest()
    with _worker_lock:
        src = _worker_sources.get((key, obj))
        if src is None:
            conn = _worker_conns.get(key)
            if conn is None:
                conn = _worker_conns[key] = open_connection(name, options)
            src = _worker_sources[(key, obj)] = conn.source(obj)
        return src


def run_split(
    name: str, options: dict[str, Any], obj: str, request: ScanRequest, split: Split
) -> tuple[list[pa.RecordBatch] | _Failure, float, ScanMetrics]:
    """Read one piece (in a Ray worker): the connector's scan over it, and what that
    scan measured (its own ``request.metrics``, merged into the query's by the driver)."""
    t0 = time.perf_counter()
    if options.get("kind") == "kafka":  # a bounded read of its partitions, not a tail cache
        options = {**options, "cache": False}
    src = _worker_source(name, options, obj)
    if split.kind == "range":
        request = replace(
            request,
            filters=(*request.filters, *split.filters),
            params={**request.params, **(split.params or {})},
        )
    elif split.kind == "files":
        src = _files_view(src, split)
    elif split.kind == "mongo_id":
        src = _mongo_view(src, split.lo, split.hi)
    elif split.kind == "partitions":
        src = copy.copy(src)  # the topic's source over some of its partitions
        src.partitions = list(split.partitions)
    try:
        batches = list(src.scan(request))
    except Exception as e:  # sent back as itself (the executor names source and binding)
        return _Failure.of(e, src.uri), time.perf_counter() - t0, request.metrics
    return batches, time.perf_counter() - t0, request.metrics


@dataclass(frozen=True)
class _Failure:
    """A connector's exception, carried across: many take their own arguments (``uri,
    columns, existing``) and cannot be unpickled from ``args`` alone, so the class, args
    and attributes travel and the driver rebuilds the same exception."""

    cls: type[BaseException]
    args: tuple[Any, ...]
    attrs: dict[str, Any]

    @staticmethod
    def of(e: Exception, uri: str) -> _Failure:
        f = _Failure(type(e), e.args, dict(vars(e)))
        try:
            pickle.loads(pickle.dumps(f))
        except Exception:  # not importable or not picklable: its text, as a SourceError
            from connectors.base import SourceError

            err = SourceError(uri, f"{type(e).__name__}: {e}", hint=getattr(e, "hint", None))
            f = _Failure(SourceError, err.args, dict(vars(err)))
        return f

    def exception(self) -> BaseException:
        e = self.cls.__new__(self.cls)
        e.args = self.args
        e.__dict__.update(self.attrs)
        return e


def _files_view(src: Any, split: Split) -> Any:
    """The S3 source over some of its files: the connector's scan, unchanged, on a dataset
    of those files' fragments (the source's schema, format and filesystem)."""
    import pyarrow.dataset as ds

    src.refresh()
    want = set(split.files)
    frags = [f for f in src.dataset.get_fragments() if f.path in want]
    view = copy.copy(src)
    view._dataset = ds.FileSystemDataset(
        frags, schema=src.dataset.schema, format=src._fmt, filesystem=src.conn.fs
    )
    view._files = [i for i in src._files if i.path in want]
    view.refresh = lambda: None  # listed above; the view keeps its files
    return view


def _mongo_view(src: Any, lo: Any, hi: Any) -> Any:
    """The Mongo source with ``lo <= _id < hi`` merged into every find."""
    from connectors.mongo import merge_and

    rng: dict[str, Any] = {}
    if lo is not None:
        rng["$gte"] = lo
    if hi is not None:
        rng["$lt"] = hi
    view = copy.copy(src)
    find = src._find

    def ranged(query: dict[str, Any], *args: Any, **kw: Any) -> Any:
        return find(merge_and([query, {"_id": rng}]) if query else {"_id": rng}, *args, **kw)

    view._find = ranged
    return view


# ---------------------------------------------------------------- driver side


class RayScans:
    """The executor's Ray hook: ``scan()`` per source scan (see the module docstring)."""

    def __init__(self, cluster: Any, *, min_rows: int = DEFAULT_MIN_ROWS, tasks: int = 0):
        """``tasks``: pieces per scan at most (0: the cluster's CPUs, at least 2; 1: the
        whole scan in one task, unsplit)."""
        import ray

        self.cluster = cluster
        self.min_rows = min_rows
        self.tasks = tasks or max(2, cluster.cpus())
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run_split)

    def estimate(self, source: Any, scan: Any) -> int | None:
        if scan is not None and getattr(scan, "estimated_rows", None) is not None:
            return int(scan.estimated_rows)
        try:
            return source.statistics().row_count
        except Exception:
            return None

    def scan(
        self, source: Any, request: ScanRequest, scan: Any = None
    ) -> tuple[list[pa.RecordBatch], dict[str, Any]] | None:
        """The batches of the scan read by Ray tasks, and what ran; None: run it locally."""
        if request.limit is not None or request.order_by or request.latest_by:
            return None
        if request.aggregate is not None:  # one answer over all rows: not split in tasks
            return None
        if request.time_range is not None:
            return None
        est = self.estimate(source, scan)
        if est is None or est < self.min_rows:
            return None
        ident = _identity(source)
        if ident is None:
            return None
        splits = plan_splits(source, request, self.tasks)
        if len(splits) < min(2, self.tasks):
            return None
        import ray

        name, options, obj = ident
        request = replace(request, params=dict(request.params))
        refs = [self._remote.remote(name, options, obj, request, s) for s in splits]
        try:
            results = ray.get(refs, timeout=request.timeout)
        except ray.exceptions.GetTimeoutError:
            for r in refs:
                ray.cancel(r, force=True)
            raise TimeoutError(f"{source.uri}: Ray scan tasks timed out") from None
        except ray.exceptions.RayTaskError as e:  # the connector's own error, re-raised
            cause = e.cause if isinstance(e.cause, BaseException) else e
            raise cause from None
        for part, _, _ in results:
            if isinstance(part, _Failure):
                raise part.exception()
        batches = [b for part, _, _ in results for b in part]
        for _, _, measured in results:  # each task's scan measured its split
            request.metrics.merge(measured)
        info = {
            "tasks": len(splits),
            "split": splits[0].kind,
            "task_ms": [round(s * 1000, 3) for _, s, _ in results],
        }
        return batches, info
