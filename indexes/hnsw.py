"""Vector storage and the HNSW graph for one vector column.

Vectors live in a growing float32 matrix indexed by row id (contiguous, so an exact scan
of a row-id range is a slice). The newest rows form a *growing segment* (row ids
``>= folded``) that is searched exactly; it is folded into the hnswlib graph in chunks
(``fold_step``, by the dataset's background folder; ``fold`` for the whole segment)
because inserting into the graph costs ~125 us per row at 128-d and more at 384-d, while
an exact scan of a few thousand fresh rows costs tens of microseconds. Deleted rows are
``mark_deleted`` in the graph and their slots reused by later inserts
(``allow_replace_deleted``).

Distances follow hnswlib: l2 is the squared Euclidean distance, ip is ``1 - x.q`` and
cosine is ``1 - cos(x, q)``; the exact paths compute the same numbers.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

import hnswlib
import numpy as np
import pyarrow as pa

from indexes.partition import EfGate, Partitions
from indexes.quantized import Codes
from indexes.spec import DatasetError, IndexSpec

GATHER_CHUNK = 2048
log = logging.getLogger("indexes.hnsw")


def vector_dim(column: str, t: pa.DataType) -> int:
    if pa.types.is_fixed_size_list(t) and pa.types.is_floating(t.value_type):
        return t.list_size
    raise DatasetError(
        f"an hnsw index needs a fixed-size float list column (pa.list_(pa.float32(), N)); {column!r} is {t}"
    )


def to_matrix(column: str, values: pa.Array | pa.ChunkedArray, dim: int) -> np.ndarray:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if values.null_count:
        raise DatasetError(
            f"vector column {column!r} has {values.null_count} null vector(s); every row needs a vector"
        )
    flat = values.flatten().to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(flat.astype(np.float32, copy=False).reshape(-1, dim))


class VectorIndex:
    def __init__(
        self, column: str, dim: int, spec: IndexSpec, fold_rows: int = 2048, fold_chunk: int = 512
    ):
        self.column = column
        self.dim = dim
        self.spec = spec
        self.metric = spec.metric or "cosine"
        self.fold_rows = fold_rows
        self.fold_chunk = fold_chunk
        self.vectors = np.zeros((0, dim), dtype=np.float32)
        self.aux = np.zeros(0, dtype=np.float32)  # squared norms (l2) or inverse norms (cosine)
        self.n = 0  # rows stored (row ids 0..n-1)
        self.folded = 0  # row ids < folded went to the graph (unless deleted before folding)
        self.in_graph = 0  # live elements in the graph
        self.graph = hnswlib.Index(space=self.metric, dim=dim)
        self.graph.init_index(
            max_elements=1024,
            M=spec.M,
            ef_construction=spec.ef_construction,
            allow_replace_deleted=True,
        )
        self.graph.set_ef(spec.ef)
        self.graph.set_num_threads(1)
        self.build_threads = max(1, os.cpu_count() or 1)
        self.fold_ms_per_row = 0.5  # measured graph insert cost (moving average)
        self._local = threading.local()
        self.gate = EfGate(spec.ef)  # one ef per hnswlib index: see EfGate
        self.partitions: Partitions | None = None  # per-value graphs (indexes.partition)
        self.codes = Codes(dim, self.metric)  # 8-bit copy for gathers (indexes.quantized)

    # ------------------------------------------------------------------ storage
    def _aux(self, m: np.ndarray) -> np.ndarray:
        if self.metric == "l2":
            return np.einsum("ij,ij->i", m, m).astype(np.float32)
        if self.metric == "cosine":  # norms in float64: a float32 sum of squares of a
            # vector of norm ~1e-21 underflows (and of one of norm ~1e20 overflows)
            nrm = np.sqrt(np.einsum("ij,ij->i", m, m, dtype=np.float64))
            with np.errstate(divide="ignore"):
                inv = np.where(nrm > 0, 1.0 / nrm, 0.0)
            return np.minimum(inv, np.finfo(np.float32).max).astype(np.float32)
        return np.zeros(len(m), dtype=np.float32)

    def append(self, start: int, m: np.ndarray) -> None:
        """Store vectors for row ids ``start..start+len(m)-1`` (they join the growing segment)."""
        end = start + len(m)
        if end > len(self.vectors):
            cap = max(end, 2 * len(self.vectors), 1024)
            v = np.zeros((cap, self.dim), dtype=np.float32)
            v[: self.n] = self.vectors[: self.n]
            a = np.zeros(cap, dtype=np.float32)
            a[: self.n] = self.aux[: self.n]
            self.vectors, self.aux = v, a
        self.vectors[start:end] = m
        self.aux[start:end] = self._aux(m)
        self.n = end
        self.codes.append(start, end, self.vectors, self.aux)

    def fold(
        self,
        alive: np.ndarray,
        force: bool = False,
        limit: int | None = None,
        threads: int | None = None,
    ) -> int:
        """Insert the growing segment into the graph once it holds ``fold_rows`` rows (or
        ``force``); at most ``limit`` of its oldest rows per call, so a writer holding the
        lock never stalls readers for a whole segment (hnswlib cannot search while it
        inserts) and the segment stays near ``fold_rows``."""
        pending = self.n - self.folded
        if pending <= 0 or (pending < self.fold_rows and not force):
            return 0
        end = self.n if limit is None else min(self.n, self.folded + limit)
        ids = np.arange(self.folded, end)
        ids = ids[alive[self.folded : end]]
        self.insert(ids, self.vectors[ids], threads)
        self.folded = end
        if self.partitions is not None:
            self.partitions.catch_up(alive)
        return len(ids)

    def insert(self, ids: np.ndarray, vecs: np.ndarray, threads: int | None = None) -> None:
        """Add rows to the graph (labels = row ids), growing it by doubling."""
        if not len(ids):
            return
        need = self.in_graph + len(ids)
        cap = self.graph.get_max_elements()
        if need > cap:
            self.graph.resize_index(max(need, 2 * cap))
        self.graph.add_items(
            vecs, ids, num_threads=threads or self.build_threads, replace_deleted=True
        )
        self.in_graph += len(ids)

    def pending(self) -> int:
        """Rows in the growing segment (not yet folded into the graph)."""
        return self.n - self.folded

    def chunk_rows(self, target_ms: float) -> int:
        """Rows one fold step should insert to take about ``target_ms`` (measured cost)."""
        return int(min(4096, max(2, target_ms / max(self.fold_ms_per_row, 1e-3))))

    def timed_insert(self, ids: np.ndarray, vecs: np.ndarray, threads: int = 1) -> None:
        """``insert`` that keeps the per-row cost estimate ``chunk_rows`` sizes from."""
        t0 = time.perf_counter()
        self.insert(ids, vecs, threads)
        if len(ids) >= 2:
            ms = (time.perf_counter() - t0) * 1e3 / len(ids)
            self.fold_ms_per_row = 0.7 * self.fold_ms_per_row + 0.3 * ms

    def delete(self, rowid: int) -> None:
        if self.partitions is not None:
            self.partitions.delete(rowid)
        if rowid < self.folded:
            try:
                self.graph.mark_deleted(int(rowid))
                self.in_graph -= 1
            except RuntimeError:
                pass  # deleted before it was folded: never entered the graph

    # ------------------------------------------------------------------ search
    def _dots(self, q: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
        """x . q for the given rows, single-threaded (einsum, not BLAS: a threaded matvec
        is slower on a busy machine) and gathered chunk by chunk into a reused buffer (a
        fresh multi-megabyte copy per query costs more in page faults than the math)."""
        if isinstance(rows, slice):
            return np.einsum("ij,j->i", self.vectors[rows], q)
        out = np.empty(len(rows), dtype=np.float32)
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.empty((GATHER_CHUNK, self.dim), dtype=np.float32)
        for s in range(0, len(rows), GATHER_CHUNK):
            c = rows[s : s + GATHER_CHUNK]
            b = buf[: len(c)]
            np.take(self.vectors, c, axis=0, out=b)
            out[s : s + len(c)] = np.einsum("ij,j->i", b, q)
        return out

    def distances(self, q: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
        """Exact distances from ``q`` to the given rows (a slice is contiguous: fastest)."""
        return self.dist_from_dots(q, self._dots(q, rows), self.aux[rows])

    def dist_from_dots(self, q: np.ndarray, dots: np.ndarray, aux: np.ndarray) -> np.ndarray:
        """The metric's distance from ``x . q`` and the rows' aux (squared / inverse norms)."""
        if self.metric == "l2":
            return aux - 2.0 * dots + float(q @ q)
        if self.metric == "cosine":  # |q| in float64 (a tiny query's q.q underflows)
            q64 = q.astype(np.float64)
            qn = math.sqrt(float(q64 @ q64))
            inv = 1.0 / qn if qn > 0 else 0.0
            return 1.0 - dots * aux * inv
        return 1.0 - dots

    def knn(
        self, q: np.ndarray, k: int, ef: int, filter: Callable[[int], bool] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Approximate k nearest over the graph (not the growing segment)."""
        k = min(k, self.in_graph)
        if k <= 0:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        ef = max(ef, k)
        self.gate.enter(self.graph, ef)
        try:
            labels, dists = self.graph.knn_query(q, k=k, num_threads=1, filter=filter)
        except RuntimeError:  # fewer than k reachable (filter too tight or many deletions)
            return np.empty(0, np.int64), np.empty(0, np.float32)
        finally:
            self.gate.exit()
        return labels[0].astype(np.int64), dists[0]

    def nbytes(self) -> int:
        M = self.spec.M
        graph = (
            self.graph.get_max_elements() * (self.dim * 4 + 2 * M * 4 + 8 + 8)
            + self.in_graph * M * 4 // 8
        )
        parts = self.partitions.nbytes() if self.partitions is not None else 0
        return self.n * (self.dim * 4 + 4) + graph + parts + self.codes.nbytes()

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str) -> None:
        self.graph.save_index(os.path.join(directory, f"hnsw.{self.column}.bin"))
        np.save(os.path.join(directory, f"vectors.{self.column}.npy"), self.vectors[: self.n])

    def load(self, directory: str, n: int, folded: int, in_graph: int) -> None:
        self.vectors = np.load(os.path.join(directory, f"vectors.{self.column}.npy"))
        self.n, self.folded, self.in_graph = n, folded, in_graph
        self.aux = self._aux(self.vectors) if n else np.zeros(0, np.float32)
        self.codes = Codes(self.dim, self.metric)
        self.codes.fit(self.vectors[:n], self.aux[:n])
        path = os.path.join(directory, f"hnsw.{self.column}.bin")
        g = hnswlib.Index(space=self.metric, dim=self.dim)
        try:
            g.load_index(path, allow_replace_deleted=True)
        except (RuntimeError, OSError) as e:
            # The graph is derived data: the vectors beside it are the truth. A graph file
            # that is truncated, corrupted or written by another hnswlib build is rebuilt
            # from them; until the folder has refolded it every row is in the growing
            # segment, searched exactly, so answers stay right (only slower meanwhile).
            log.warning(
                "%s: the HNSW graph of %r cannot be read (%s); rebuilding it from the %d "
                "stored vectors (searches are exact until it is refolded)",
                path,
                self.column,
                e,
                n,
            )
            self.folded, self.in_graph = 0, 0
            return
        g.set_ef(self.spec.ef)
        g.set_num_threads(1)
        self.graph = g
        self.gate.now = self.spec.ef
