"""A materialized, indexed dataset: Arrow segments + HNSW / B-tree / inverted indexes.

Rows get a monotonically increasing row id on arrival; row id == position, so rows sit in
arrival order (a time range over an append-mostly stream is a contiguous slice). Scalar
columns are kept as a list of Arrow record batches (combined when there are many);
vector columns with an ``hnsw`` index live in a growing float32 matrix next to the graph.
An upsert of an existing key tombstones the old row id (deletion bitmap + every index
updated) and appends the new version. ``compact()`` rewrites everything without
tombstones when they pile up.

Every public method takes the reader-writer lock: a query sees a batch entirely or not
at all.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from dsl.ast import Expr
from indexes.btree import BTreeIndex, array_of
from indexes.hnsw import VectorIndex, to_matrix, vector_dim
from indexes.inverted import InvertedIndex
from indexes.rwlock import RWLock
from indexes.spec import DatasetError, IndexSpec

FORMAT_VERSION = 1
log = logging.getLogger("indexes.dataset")
# niceness added to the background folder thread: 0. A per-thread nice counts against every
# process on the machine, not only this one's writers: at +5 the folder folded 19-72 rows/s
# under a query pass at load 25-46 against 71-100 at 0, and 90 s later had left 1.8-3.6x
# more rows unfolded (benchmarks/retrieval_folding.py, docs/indexes.md)
FOLDER_NICE = 0
QUERY_ACTIVE_S = 0.05  # a search this recent makes the folder yield (fold_yield_ms holds)


class Dataset:
    def __init__(
        self,
        name: str,
        schema: pa.Schema,
        key: str,
        indexes: Mapping[str, IndexSpec | str | dict],
        *,
        fold_rows: int = 2048,
        background_fold: bool = True,
        max_growing: int = 50_000,
        fold_lock_ms: float = 10.0,
        fold_yield_ms: float = 2.0,
    ):
        if key not in schema.names:
            raise DatasetError(
                f"dataset {name!r}: key column {key!r} is not in the schema; columns: {', '.join(schema.names)}"
            )
        self.name = name
        self.schema = schema
        self.key = key
        self.specs: dict[str, IndexSpec] = {}
        self.btrees: dict[str, BTreeIndex] = {}
        self.inverted: dict[str, InvertedIndex] = {}
        self.vectors: dict[str, VectorIndex] = {}
        for col, spec in indexes.items():
            if col not in schema.names:
                raise DatasetError(
                    f"dataset {name!r}: index on unknown column {col!r}; columns: {', '.join(schema.names)}"
                )
            spec = IndexSpec.parse(spec)
            self.specs[col] = spec
            t = schema.field(col).type
            if spec.kind == "btree":
                self.btrees[col] = BTreeIndex(col, t)
            elif spec.kind == "inverted":
                self.inverted[col] = InvertedIndex(col, t)
            else:
                self.vectors[col] = VectorIndex(col, vector_dim(col, t), spec, fold_rows)
        for col, vi in self.vectors.items():
            if vi.spec.partition is not None:
                self._attach_partitions(col, vi.spec.partition)
        self.scalar_names = [n for n in schema.names if n not in self.vectors]
        self.scalar_schema = pa.schema([schema.field(n) for n in self.scalar_names])
        self._batches: list[pa.RecordBatch] = []
        self._table: pa.Table | None = None
        # (the stored table, column -> numpy view or None, columns -> schema): ``_hits``
        self._hits_cache: tuple[pa.Table, dict[str, Any], dict[tuple[str, ...], pa.Schema]] | None
        self._hits_cache = None
        self.alive = np.zeros(0, dtype=bool)
        self.live = BitMap()
        self.n = 0  # row ids handed out
        self.rowid_of: dict[Any, int] = {}
        self.lock = RWLock()
        # the HNSW graphs, their ``folded``/``in_graph`` counters and graph deletes; taken
        # inside ``lock`` (reader: search; writer: delete, flush) or alone (the folder), so
        # the folder's inserts never block a write of fresh rows
        self.graph_lock = RWLock()
        self.directory: str | None = None
        self.cost_model: Any = None  # indexes.cost.CostModel, loaded lazily (costs())
        self.feedback: dict[str, dict[str, float]] = {}  # filter -> strategy -> guard fire rate
        # searches never change cost_model or feedback: each returns what it learned and
        # learn() applies it under this lock (indexes.retrieval.Feedback)
        self._learn_lock = threading.Lock()
        self.pred_cache: dict[tuple[str, int], Any] = {}  # (filter, version) -> compiled
        self.version = 0
        # growing segments are folded into the HNSW graphs by a background thread, in
        # chunks of about fold_lock_ms under the write lock; a write waits while a segment
        # holds more than max_growing rows (backpressure)
        self.background_fold = background_fold
        self.max_growing = max_growing
        self.fold_lock_ms = fold_lock_ms
        # while queries run (one started in the last QUERY_ACTIVE_S) the folder yields,
        # whatever the backlog: it takes the graph at a moment no search holds it (waiting
        # up to 2 ms for one), for about fold_yield_ms, then rests half as long; searches
        # that read no graph (pre-filter, exact) never wait for it
        self.fold_yield_ms = fold_yield_ms
        self.query_at = -1e9  # time.monotonic() of the last search
        self._fold_wake = threading.Event()
        self._fold_cond = threading.Condition()
        self._folder: threading.Thread | None = None
        self._closed = False
        self.fold_holds: deque[float] = deque(maxlen=1024)  # recent write-lock holds, ms
        #: rows -> rows computing declared columns before a write (fabric.embed.filler)
        self.computed: Callable[[Any], pa.Table] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        name: str,
        schema: pa.Schema,
        key: str,
        indexes: Mapping[str, IndexSpec | str | dict],
        **kw: Any,
    ) -> Dataset:
        return cls(name, schema, key, indexes, **kw)

    # ------------------------------------------------------------------ writes
    def _conform(self, table: pa.Table | pa.RecordBatch) -> pa.Table:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        missing = [n for n in self.schema.names if n not in table.column_names]
        extra = [n for n in table.column_names if n not in self.schema.names]
        if missing or extra:
            raise DatasetError(
                f"dataset {self.name!r}: rows do not match the schema"
                + (f"; missing column(s) {missing}" if missing else "")
                + (f"; unknown column(s) {extra}" if extra else "")
                + f"; expected {', '.join(self.schema.names)}"
            )
        table = table.select(self.schema.names)
        try:
            return table.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise DatasetError(
                f"dataset {self.name!r}: rows cannot be converted to the schema: {e}"
            ) from None

    def upsert(self, table: pa.Table | pa.RecordBatch) -> int:
        """Insert rows, replacing any existing row with the same key; returns rows written."""
        return self._write(table, replace=True)

    def insert(self, table: pa.Table | pa.RecordBatch) -> int:
        """Insert rows; a key that already exists is an error."""
        return self._write(table, replace=False)

    def _write(self, table: pa.Table | pa.RecordBatch, replace: bool) -> int:
        if self.computed is not None:
            table = self.computed(table)
        table = self._conform(table)
        if table.num_rows == 0:
            return 0
        if table.column(self.key).null_count:
            raise DatasetError(f"dataset {self.name!r}: key column {self.key!r} has null values")
        keys = table.column(self.key).to_pylist()
        if len(set(keys)) < len(keys):  # the last version of a key within one batch wins
            last = {k: i for i, k in enumerate(keys)}
            table = table.take(pa.array(sorted(last.values()), pa.int64()))
            keys = table.column(self.key).to_pylist()
        mats = {c: to_matrix(c, table.column(c), v.dim) for c, v in self.vectors.items()}
        for c, mat in mats.items():
            self._check_finite(c, mat, table)
        if mats and self.background_fold:
            self._backpressure()
        with self.lock.write():
            seen = self.rowid_of.keys() & keys if self.rowid_of else ()
            old = [self.rowid_of[k] for k in seen]
            if old and not replace:
                dup = [k for k in keys if k in self.rowid_of][:5]
                raise DatasetError(
                    f"dataset {self.name!r}: key(s) {dup} already exist; use upsert() to replace rows"
                )
            if old:
                self._delete_rowids(old)
            start, m = self.n, table.num_rows
            rowids = np.arange(start, start + m, dtype=np.int64)
            self._batches.extend(table.select(self.scalar_names).to_batches())
            self._table = None
            if len(self._batches) > 64:
                self._batches = (
                    pa.Table.from_batches(self._batches, self.scalar_schema)
                    .combine_chunks()
                    .to_batches()
                )
            if start + m > len(self.alive):
                a = np.zeros(max(start + m, 2 * len(self.alive), 1024), dtype=bool)
                a[: self.n] = self.alive[: self.n]
                self.alive = a
            self.alive[start : start + m] = True
            self.n = start + m
            self.live.add_range(start, start + m)
            self.rowid_of.update(zip(keys, rowids.tolist()))
            for c, bt in self.btrees.items():
                bt.add(rowids, table.column(c))
            for c, inv in self.inverted.items():
                inv.add(rowids, table.column(c))
            for c, vi in self.vectors.items():
                vi.append(start, mats[c])
                if not self.background_fold:
                    with self.graph_lock.write():  # bounded stall per write
                        vi.fold(self.alive, limit=max(vi.fold_chunk, m))
            self.version += 1
        if mats and self.background_fold:
            self._kick()
        return m

    def _check_finite(self, column: str, mat: np.ndarray, table: pa.Table) -> None:
        """Refuse a batch holding a vector with a NaN or an infinity, or whose squared
        length overflows float32 (as the search refuses such a query): no distance ranks
        it, and in the HNSW graph it broke the walk for every other row (5% NaN rows:
        the graph's top 10 held 0.4 of the true 10, no error)."""
        with np.errstate(over="ignore", invalid="ignore"):
            ok = np.isfinite(np.einsum("ij,ij->i", mat, mat))
        if ok.all():
            return
        bad = np.flatnonzero(~ok)
        keys = table.column(self.key).take(pa.array(bad[:5], pa.int64())).to_pylist()
        raise DatasetError(
            f"dataset {self.name!r}: vector column {column!r} holds NaN, infinite or too "
            f"large values (a squared length past float32's range) in {len(bad)} row(s), "
            f"key(s) {keys}{' ...' if len(bad) > 5 else ''}; nothing of this batch was "
            "written: fix or drop those rows"
        )

    def delete(self, keys: Iterable[Any]) -> int:
        """Delete rows by key; returns how many existed."""
        with self.lock.write():
            rowids = [self.rowid_of[k] for k in keys if k in self.rowid_of]
            self._delete_rowids(rowids)
            self.version += 1
        return len(rowids)

    def delete_where(self, where: Expr, params: Mapping[str, Any] | None = None) -> int:
        """Delete the live rows satisfying ``where`` in one write-locked step (a row
        rewritten meanwhile is judged by its new values); returns how many
        (``retention:``, fabric.datasets.expire_rows)."""
        from indexes.filters import compile_filter

        with self.lock.write():
            bm = compile_filter(self, where, params or {}).evaluate(None) & self.live
            rowids = array_of(bm).astype(np.int64).tolist()
            self._delete_rowids(rowids)
            if rowids:
                self.version += 1
        return len(rowids)

    def _delete_rowids(self, rowids: Sequence[int]) -> None:
        if not rowids:
            return
        rowids = sorted(set(rowids))
        ids = np.array(rowids, dtype=np.int64)
        if self.inverted:
            old = self._scalar_table().select(list(self.inverted)).take(pa.array(ids))
            for c, inv in self.inverted.items():
                inv.remove(rowids, old.column(c))
        for bt in self.btrees.values():
            bt.remove(rowids)
        keys = self._scalar_table().column(self.key).take(pa.array(ids)).to_pylist()
        for k, r in zip(keys, rowids):
            if self.rowid_of.get(k) == r:
                del self.rowid_of[k]
        self.alive[ids] = False  # before the graph: see _fold_some
        self.live.difference_update(BitMap(rowids))
        if self.vectors:
            with self.graph_lock.write():
                for vi in self.vectors.values():
                    for r in rowids:
                        vi.delete(r)

    def set_ef(self, column: str, ef: int) -> None:
        """Change the default HNSW search breadth of ``column`` (saved with the dataset)."""
        import dataclasses

        vi = self.vectors.get(column)
        if vi is None:
            raise DatasetError(f"dataset {self.name!r}: column {column!r} has no hnsw index")
        if ef < 1:
            raise DatasetError(f"ef must be positive, got {ef}")
        with self.lock.write():
            vi.spec = self.specs[column] = dataclasses.replace(vi.spec, ef=ef)

    def _attach_partitions(self, column: str, by: str) -> None:
        from indexes.partition import Partitions

        if by not in self.btrees:
            have = f"; btree columns: {', '.join(self.btrees)}" if self.btrees else ""
            raise DatasetError(
                f"dataset {self.name!r}: hnsw partition={by!r} on {column!r} needs a btree index on {by!r}{have}"
            )
        vi = self.vectors[column]
        vi.partitions = Partitions(vi, by, self.btrees[by])

    def partition(self, column: str, by: str) -> None:
        """Keep one HNSW graph per value of btree column ``by`` next to ``column``'s graph
        (built by the folder, or by ``flush``; see indexes.partition)."""
        import dataclasses

        vi = self.vectors.get(column)
        if vi is None:
            raise DatasetError(f"dataset {self.name!r}: column {column!r} has no hnsw index")
        with self.lock.write(), self.graph_lock.write():
            self._attach_partitions(column, by)
            vi.spec = self.specs[column] = dataclasses.replace(vi.spec, partition=by)
        self._kick()

    def flush(self) -> None:
        """Fold every growing segment into its HNSW graph now (in this thread)."""
        with self.lock.write(), self.graph_lock.write():
            for vi in self.vectors.values():
                vi.fold(self.alive, force=True)
                if vi.partitions is not None:
                    vi.partitions.catch_up(self.alive)
        with self._fold_cond:
            self._fold_cond.notify_all()

    # ------------------------------------------------------------------ background fold
    def growing(self) -> int:
        """Rows of the largest growing segment (searched exactly, not yet in a graph)."""
        return max((vi.pending() for vi in self.vectors.values()), default=0)

    def _due_at(self, vi: VectorIndex) -> int:
        return max(1, min(vi.fold_rows, self.max_growing))

    def _due(self) -> bool:
        return any(
            vi.pending() >= self._due_at(vi) or (vi.partitions is not None and vi.partitions.lag())
            for vi in self.vectors.values()
        )

    def _kick(self) -> None:
        """Wake the folder (started on first use) if a growing segment is due."""
        if self._closed or not self.background_fold or not self._due():
            return
        if self._folder is None or not self._folder.is_alive():
            self._folder = threading.Thread(
                target=_fold_loop,
                args=(weakref.ref(self), self._fold_wake),
                name=f"fabric-fold-{self.name}",
                daemon=True,
            )
            self._folder.start()
            _FOLDING.add(self)
        self._fold_wake.set()

    def _backpressure(self) -> None:
        """Block a write while a growing segment exceeds ``max_growing`` rows."""
        if self.growing() <= self.max_growing:
            return
        self._kick()
        with self._fold_cond:
            while self.growing() > self.max_growing and self.background_fold:
                self._fold_cond.wait(0.1)

    def _fold_some(self) -> int:
        """One bounded fold step on every due segment; returns row ids advanced.

        The chunk's vectors are copied under the dataset's read lock; the insert runs
        under ``graph_lock`` only, so writers append fresh rows meanwhile and only
        searches (and deletes of folded rows) wait. A row deleted after the copy is
        marked deleted in the graph before ``folded`` moves past it: writers clear
        ``alive`` before taking ``graph_lock``, and a delete of a row at or above
        ``folded`` leaves the graph alone.
        """
        done = 0
        held = 0.0
        # yield to running queries whatever the backlog (a search waits at most one short
        # chunk; one that reads no graph does not wait at all): issue 12 measured 14-48 ms
        # per query during folding while the folder held the graph for 10 ms chunks
        busy = time.monotonic() - self.query_at < QUERY_ACTIVE_S
        target = self.fold_yield_ms if busy else self.fold_lock_ms
        for vi in self.vectors.values():
            if vi.pending() < self._due_at(vi):
                continue
            with self.lock.read():
                start = vi.folded
                end = min(vi.n, start + vi.chunk_rows(target))
                ids = np.arange(start, end)[self.alive[start:end]]
                vecs = vi.vectors[ids]
            t0 = time.perf_counter()
            with self.graph_lock.write(polite=0.002 if busy else 0.0):
                if vi.folded != start:  # flush() folded meanwhile
                    continue
                vi.timed_insert(ids, vecs)
                for r in ids[~self.alive[ids]].tolist():
                    vi.graph.mark_deleted(r)
                    vi.in_graph -= 1
                vi.folded = end
            held += time.perf_counter() - t0
            done += end - start
        for vi in self.vectors.values():
            p = vi.partitions
            if p is None or not p.lag():
                continue
            with self.lock.read():
                start = p.done
                end, ids, keys = p.chunk(vi.folded, vi.chunk_rows(target), self.alive)
                vecs = vi.vectors[ids]
            t0 = time.perf_counter()
            with self.graph_lock.write(polite=0.002 if busy else 0.0):
                if p.done != start:  # flush() caught up meanwhile
                    continue
                p.add(end, ids, keys, vecs)
                for r in ids[~self.alive[ids]].tolist():
                    p.delete(r)
            held += time.perf_counter() - t0
            done += end - start
        self.fold_holds.append(held * 1e3)
        with self._fold_cond:
            self._fold_cond.notify_all()
        if done:  # the lock prefers writers: step aside so waiting queries get in
            time.sleep(held / 2 if busy else min(0.005, max(0.0005, held / 4)))
        return done

    def wait_folded(self, timeout: float = 30.0) -> bool:
        """Wait until no growing segment is due for folding; True if so within ``timeout``."""
        deadline = time.monotonic() + timeout
        self._kick()
        with self._fold_cond:
            while self._due() and self.background_fold:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._fold_cond.wait(min(left, 0.1))
        return not self._due()

    def close(self) -> None:
        """Stop the background folder (the dataset stays readable and writable; writes
        then fold on the write path)."""
        self._closed = True
        self.background_fold = False
        self._fold_wake.set()
        if self._folder is not None:
            self._folder.join(10)
            self._folder = None
        with self._fold_cond:
            self._fold_cond.notify_all()

    def compact(self) -> None:
        """Rewrite without tombstones (new row ids, indexes rebuilt). Costly; run when idle."""
        with self.lock.write():
            table = self._rows(array_of(self.live).astype(np.int64), None)
            fresh = Dataset(
                self.name,
                self.schema,
                self.key,
                self.specs,
                fold_rows=next(iter(self.vectors.values())).fold_rows if self.vectors else 2048,
                background_fold=False,
            )
            fresh.upsert(table)
            fresh.flush()
            keep = {"lock", "graph_lock", "directory", "cost_model", "feedback", "version"}
            keep.add("_learn_lock")
            keep.add("background_fold")
            keep |= {"max_growing", "fold_lock_ms", "fold_yield_ms", "_fold_wake", "_fold_cond"}
            keep |= {"_folder", "query_at"}
            keep.add("_closed")
            for k, v in vars(fresh).items():
                if k not in keep:
                    setattr(self, k, v)
            self.version += 1

    # ------------------------------------------------------------------ reads
    def count(self) -> int:
        return len(self.live)

    def _scalar_table(self) -> pa.Table:
        if self._table is None:
            self._table = pa.Table.from_batches(self._batches, self.scalar_schema)
        return self._table

    def _rows(self, rowids: np.ndarray | None, columns: Sequence[str] | None) -> pa.Table:
        """Rows by row id (None: every stored row), in the given order, as the dataset schema."""
        names = list(columns) if columns is not None else self.schema.names
        unknown = [c for c in names if c not in self.schema.names]
        if unknown:
            raise DatasetError(
                f"dataset {self.name!r}: unknown column(s) {unknown}; columns: {', '.join(self.schema.names)}"
            )
        scalars = [c for c in names if c not in self.vectors]
        t = self._scalar_table().select(scalars)
        if rowids is not None:
            t = t.take(pa.array(rowids, pa.int64()))
        arrays, fields = [], []
        for c in names:
            f = self.schema.field(c)
            if c in self.vectors:
                vi = self.vectors[c]
                m = vi.vectors[rowids] if rowids is not None else vi.vectors[: self.n]
                arr = pa.FixedSizeListArray.from_arrays(
                    pa.array(m.reshape(-1), pa.float32()), vi.dim
                )
                arrays.append(arr.cast(f.type) if arr.type != f.type else arr)
            else:
                arrays.append(t.column(c))
            fields.append(f)
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def rows(self, rowids: np.ndarray, columns: Sequence[str] | None = None) -> pa.Table:
        with self.lock.read():
            return self._rows(rowids, columns)

    def to_table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """Every live row, in arrival order."""
        with self.lock.read():
            return self._rows(array_of(self.live).astype(np.int64), columns)

    def get(self, key: Any, columns: Sequence[str] | None = None) -> dict | None:
        with self.lock.read():
            r = self.rowid_of.get(key)
            return None if r is None else self._rows(np.array([r]), columns).to_pylist()[0]

    # ------------------------------------------------------------------ queries
    def costs(self) -> Any:
        """The cost model searches plan with (``indexes.cost.CostModel``): the one set or
        calibrated, else the default (~/.cache/fabric's calibration or the built-in
        figures), loaded once."""
        cm = self.cost_model
        if cm is None:
            from indexes.cost import CostModel

            with self._learn_lock:
                if self.cost_model is None:
                    self.cost_model = CostModel.default()
                cm = self.cost_model
        return cm

    def learn(self, feedback: Any) -> None:
        """Apply what one search learned (``RetrievalExplain.feedback``: guard outcomes
        for its filter, actual/modelled cost of what ran) -- the one place the guard fire
        rates and the learned cost scales change, one search at a time."""
        if feedback is None:
            return
        from indexes.retrieval import learn

        with self._learn_lock:
            learn(self, feedback)

    def search(
        self,
        column: str,
        query: Any,
        k: int,
        where: Expr | None = None,
        params: Mapping[str, Any] | None = None,
        *,
        columns: Sequence[str] | None = None,
        strategy: str | None = None,
        ef: int | None = None,
        guards: bool = True,
    ) -> tuple[pa.Table, Any]:
        """k nearest live rows to ``query`` among rows satisfying ``where``.

        Returns (table with the requested columns + float32 ``_distance``, RetrievalExplain).
        ``strategy`` forces one of ``indexes.retrieval.STRATEGIES`` (the built-ins
        'postfilter', 'insearch', 'prefilter', 'exact', 'partition', and any registered).
        What the search learned is applied here (``learn``), not inside the search.
        """
        from indexes.retrieval import search

        self.query_at = time.monotonic()
        with self.lock.read():  # the graph lock only around a strategy that walks a graph
            rowids, dists, info = search(
                self,
                column,
                query,
                k,
                where,
                params or {},
                strategy=strategy,
                ef=ef,
                guards=guards,
                graph_lock=self.graph_lock,
            )
            self.learn(info.feedback)
            t0 = time.perf_counter()
            t = self._hits(rowids, dists, columns)
            info.materialize_ms = (time.perf_counter() - t0) * 1e3
        return t, info

    def _hits(
        self, rowids: np.ndarray, dists: np.ndarray, columns: Sequence[str] | None
    ) -> pa.Table:
        """``_rows(rowids, columns)`` plus the float32 ``_distance`` column, built in one
        step for the few rows of a search: the output schema is kept per column list, and
        a fixed-width column without nulls stored as one chunk is gathered with numpy
        from a zero-copy view (``pyarrow.compute.take`` and a second table for the
        distance cost more than the search's own Python), both kept while the stored
        table is the same object."""
        table = self._scalar_table()
        cache = self._hits_cache
        if cache is None or cache[0] is not table:
            cache = self._hits_cache = (table, {}, {})
        names = tuple(columns) if columns is not None else tuple(self.schema.names)
        schema = cache[2].get(names)
        if schema is None:
            self._rows(rowids[:0], names)  # an unknown column: the same error
            fields = [self.schema.field(c) for c in names]
            schema = cache[2][names] = pa.schema([*fields, pa.field("_distance", pa.float32())])
        views = cache[1]
        arrays: list[Any] = []
        idx = None
        for i, c in enumerate(names):
            if c in self.vectors:
                vi = self.vectors[c]
                arr = pa.FixedSizeListArray.from_arrays(
                    pa.array(vi.vectors[rowids].reshape(-1), pa.float32()), vi.dim
                )
                typ = schema.field(i).type
                arrays.append(arr.cast(typ) if arr.type != typ else arr)
                continue
            view = views.get(c, False)
            if view is False:
                view = views[c] = _fixed_width_view(table.column(c))
            if view is not None:
                arrays.append(pa.array(view[0][rowids], type=view[1]))
                continue
            if idx is None:
                idx = pa.array(rowids, pa.int64())
            arrays.append(table.column(c).take(idx))
        arrays.append(pa.array(dists.astype(np.float32)))
        return pa.Table.from_arrays(arrays, schema=schema)

    def filter_rows(self, where: Expr | None, params: Mapping[str, Any] | None = None) -> BitMap:
        """Row ids (a roaring bitmap) of live rows satisfying ``where``."""
        from indexes.filters import compile_filter

        with self.lock.read():
            if where is None:
                return self.live.copy()
            return compile_filter(self, where, params or {}).evaluate(None)

    def scan(
        self,
        where: Expr | None = None,
        params: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> pa.Table:
        from indexes.filters import compile_filter

        with self.lock.read():
            bm = (
                self.live
                if where is None
                else compile_filter(self, where, params or {}).evaluate(None)
            )
            ids = array_of(bm).astype(np.int64)
            if limit is not None:
                ids = ids[:limit]
            return self._rows(ids, columns)

    def statistics(self) -> dict[str, Any]:
        """Row count and per-index facts (exact)."""
        with self.lock.read():
            out: dict[str, Any] = {"rows": len(self.live), "stored_rows": self.n, "indexes": {}}
            for c, bt in self.btrees.items():
                lo, hi = bt.min_max()
                out["indexes"][c] = {
                    "kind": "btree",
                    "rows": bt.live,
                    "nulls": len(bt.nulls),
                    "min": lo,
                    "max": hi,
                }
            for c, inv in self.inverted.items():
                out["indexes"][c] = {"kind": "inverted", "terms": len(inv.postings)}
            for c, vi in self.vectors.items():
                out["indexes"][c] = {
                    "kind": "hnsw",
                    "metric": vi.metric,
                    "dim": vi.dim,
                    "in_graph": vi.in_graph,
                    "growing": vi.n - vi.folded,
                    **(
                        {
                            "partition": {
                                "by": vi.partitions.column,
                                "values": len(vi.partitions.graphs),
                                "lag": vi.partitions.lag(),
                            }
                        }
                        if vi.partitions is not None
                        else {}
                    ),
                }
            return out

    def nbytes(self) -> dict[str, int]:
        """Memory held, by part (rows, each index)."""
        with self.lock.read():
            out = {"rows": self._scalar_table().nbytes + len(self.alive) + len(self.rowid_of) * 100}
            for c, bt in self.btrees.items():
                out[f"btree.{c}"] = bt.nbytes()
            for c, inv in self.inverted.items():
                out[f"inverted.{c}"] = inv.nbytes()
            for c, vi in self.vectors.items():
                out[f"hnsw.{c}"] = vi.nbytes()
            return out

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str) -> None:
        """Write rows (Arrow IPC), vectors (.npy), graphs (hnswlib), B-trees and postings.

        Growing segments are not folded first: their vectors are saved with the others and
        the graph holds what it holds (``folded`` is saved), so a checkpoint costs disk I/O,
        not graph inserts; after ``load`` the folder resumes. Readers keep going meanwhile.
        """
        from indexes import store

        with self.lock.read(), self.graph_lock.read():
            store.save(self, directory)
            self.directory = directory

    @classmethod
    def load(cls, directory: str) -> Dataset:
        from indexes import store

        ds = store.load(cls, directory)
        ds._kick()
        return ds

    def __repr__(self) -> str:
        idx = ", ".join(f"{c}:{s.kind}" for c, s in self.specs.items())
        return f"Dataset({self.name!r}, rows={len(self.live)}, key={self.key!r}, indexes=[{idx}])"


_FOLDING: weakref.WeakSet[Dataset] = weakref.WeakSet()


@atexit.register
def _stop_folders() -> None:
    """Stop background folders before the interpreter finalizes: a daemon thread still
    inside hnswlib when Python tears threads down aborts the process (pybind11 re-taking
    the GIL during finalization: "terminate called without an active exception")."""
    for ds in list(_FOLDING):
        ds.close()


def _fold_loop(ref: weakref.ref[Dataset], wake: threading.Event) -> None:
    """The background folder: fold due growing segments chunk by chunk, sleep otherwise.
    Holds the dataset only weakly between steps, so an unused dataset can be collected.

    The thread inserts with one thread, at the process's priority unless ``FOLDER_NICE``
    says otherwise (Linux per-thread nice; it counts against every process on the
    machine, so a niced folder fell behind on a shared, loaded one); backpressure bounds
    the gap between the write path and the graph.
    """
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.setpriority(
            os.PRIO_PROCESS, threading.get_native_id(), FOLDER_NICE
        ) if FOLDER_NICE else None
    while True:
        ds = ref()
        if ds is None or ds._closed:
            return
        try:
            done = ds._fold_some()
        except Exception:  # never die silently with writes waiting on backpressure
            log.exception("dataset %s: background fold failed; folding on the write path", ds.name)
            ds.background_fold = False
            with ds._fold_cond:
                ds._fold_cond.notify_all()
            return
        del ds
        if not done:
            wake.wait(1.0)
            wake.clear()


def _fixed_width_view(col: pa.ChunkedArray) -> tuple[np.ndarray, pa.DataType] | None:
    """A zero-copy numpy view of an integer or floating column stored as one chunk
    without nulls (what ``Dataset._hits`` gathers with numpy), else None."""
    t = col.type
    if (
        col.num_chunks != 1
        or col.null_count
        or not (pa.types.is_integer(t) or pa.types.is_floating(t))
    ):
        return None
    try:
        return col.chunk(0).to_numpy(zero_copy_only=True), t
    except (pa.ArrowInvalid, NotImplementedError):
        return None


def sample_rowids(ds: Dataset, n: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Up to ``n`` live row ids drawn uniformly."""
    rng = rng or np.random.default_rng(0)
    if ds.n == 0:
        return np.empty(0, np.int64)
    cand = rng.integers(0, ds.n, size=min(4 * n, 4 * ds.n))
    cand = cand[ds.alive[cand]]
    _, first = np.unique(cand, return_index=True)
    return cand[np.sort(first)][:n]
