"""Filtered vector search: the fabric next to the vector databases a user would pick instead.

Same data, same queries, one process, every system's own filtered-search API, queries
interleaved per query in random order across systems (machine noise hits all alike):

- ``fabric fab.query``  -- ``fabric.open`` + ``fab.query`` of a ``nearest:`` binding per
  point (the optimizer, guards on; per-value graphs of ``cl`` unless ``--no-partition``;
  tracing off unless ``--tracing``)
- ``fabric search``     -- the same optimizer through ``DatasetSource.search``
- ``faiss``      IndexHNSWFlat (M 16, efC 200, efSearch = ef) + ``IDSelectorBitmap``
- ``usearch``    HNSW (connectivity 16, expansion 200 / ef); its Python API has no filter,
                 so k' = 1.5 k / selectivity + k (cap 4,096) is post-filtered
- ``lancedb``    IVF_PQ (nlist sqrt(n)-ish, 16 sub-vectors, nprobes 20, refine 10) +
                 BTREE / BITMAP scalar indexes, ``where(..., prefilter=True)``
- ``chroma``     local persistent client, HNSW (M 16, efC 200, ef_search = ef), ``where=``
- ``milvus-lite`` ``MilvusClient(<file>.db)``, HNSW (M 16, efC 200, ef) + a filter expression
- ``qdrant-local`` ``QdrantClient(':memory:')`` (the local mode: pure Python), ``Filter`` of
                 ``FieldCondition`` s

A peer that is not installed or fails to build/run is reported as such in the table, never
dropped. Slow peers (``--slow-peers``: chroma, milvus-lite, qdrant-local by default) run on
the first ``--slow-queries`` queries only. Recall@10 is against numpy brute force over the
filtered rows; p50 is per point per system. The last column is the fabric's ``fab.query``
p50 over the fastest *other* system reaching recall 0.95 at that point.

    .venv/bin/python benchmarks/retrieval_peers.py                     # 50k rows (default)
    .venv/bin/python benchmarks/retrieval_peers.py --n 200000          # the issue's scale
    .venv/bin/python benchmarks/retrieval.py --peers ...               # same, from there

Install the peers with ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrieval as rb  # benchmarks/retrieval.py: data, points, truth

from dsl.ast import Binary, Call, Column, Expr, InList, Literal

DEFAULT_POINTS = (
    "none (100%)",
    "uncorr 10.00%",
    "uncorr 1.00%",
    "uncorr 0.01%",
    "corr 1.00%",
    "time 1.00%",
    "keyword 1.00%",
    "anti 100%",
    "anti 10%",
    "anti 1.6%",
    "rnd10%&anti10%",
    "time10%&anti10%",
)
SLOW_PEERS = ("chroma", "milvus-lite", "qdrant-local")
Cond = tuple  # ("lt", col, v) | ("ge", col, v) | ("in", col, [v..]) | ("flag", col)


def conds(e: Expr | None) -> list[Cond]:
    """The benchmark's predicate as conjuncts over plain attribute columns (keywords as
    boolean ``kw_*`` columns, time as integer seconds ``ts_s``) every peer can store."""
    if e is None:
        return []
    if isinstance(e, Binary) and e.op == "and":
        return conds(e.left) + conds(e.right)
    if isinstance(e, Call):
        return [("flag", f"kw_{e.args[1].value}")]  # type: ignore[union-attr]
    if isinstance(e, InList):
        return [("in", "cl", [int(i.value) for i in e.items])]  # type: ignore[union-attr]
    assert isinstance(e, Binary) and isinstance(e.left, Column) and isinstance(e.right, Literal)
    op = {"<": "lt", ">=": "ge"}[e.op]
    if e.left.name == "ts":
        return [(op, "ts_s", int((e.right.value - rb.T0).total_seconds()))]
    return [(op, e.left.name, float(e.right.value))]


ATTRS = ("rnd", "corr", "ts_s", "cl")


def attr_columns(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    cols = {c: a[c] for c in ATTRS}
    cols |= {f"kw_{w}": a[f"kw_{w}"] for w in rb.KEYWORDS}
    return cols


class Peer:
    """One system: ``build`` once, ``prepare`` per point, ``search`` per query -> row ids."""

    name = "?"
    note = ""

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        raise NotImplementedError

    def prepare(self, p: rb.Point) -> None:
        self.point = p

    def search(self, q: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FabricQuery(Peer):
    """The optimizer through the public API: one ``nearest:`` binding per point."""

    name = "fabric fab.query"

    def __init__(self, src: Any, pts: list[rb.Point], tracing: bool = False):
        import fabric

        d = tempfile.mkdtemp(prefix="retrieval-peers-bindings-")
        self.names = {}
        for i, p in enumerate(pts):
            name = f"p{i}"
            where = f'\n    where: "{p.where}"' if p.where is not None else ""
            with open(os.path.join(d, f"{name}.yaml"), "w") as f:
                f.write(
                    f"binding: {name}\nsession:\n  q: vector[{rb.DIM}]\nsources:\n  n:\n"
                    f"    from: dataset://bench\n"
                    f'    nearest: {{column: emb, to: "{{{{session.q}}}}", k: {rb.K}}}'
                    f"{where}\nselect: [n.id]\n"
                )
            self.names[p.name] = name
        self.fab = fabric.open(
            {"bindings": [d], "tracing": {"enabled": tracing}},
            ingest=False,
            watch=False,
            dataset_sources={"bench": src},
        )
        self.unverified = 0

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        pass

    def prepare(self, p: rb.Point) -> None:
        self.binding = self.names[p.name]
        self.fab.query(self.binding, session={"q": np.zeros(rb.DIM, np.float32)})  # plan once

    def search(self, q: np.ndarray) -> np.ndarray:
        res = self.fab.query(self.binding, session={"q": q})
        if res.unverified:
            self.unverified += 1
        return res.table.column(0).to_numpy()

    def close(self) -> None:
        self.fab.close()


class FabricSearch(Peer):
    name = "fabric search"

    def __init__(self, src: Any):
        self.src = src

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        pass

    def prepare(self, p: rb.Point) -> None:
        self.filters = () if p.where is None else (p.where,)

    def search(self, q: np.ndarray) -> np.ndarray:
        t, _ = self.src.search("emb", q, rb.K, self.filters, {}, ["id"])
        return t.column("id").to_numpy()


class Faiss(Peer):
    name = "faiss"

    def __init__(self, ef: int):
        self.ef = ef

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        import faiss

        self.faiss = faiss
        faiss.omp_set_num_threads(os.cpu_count() or 1)
        self.idx = faiss.IndexHNSWFlat(rb.DIM, 16)
        self.idx.hnsw.efConstruction = 200
        self.idx.add(x)
        faiss.omp_set_num_threads(1)
        self.note = f"IndexHNSWFlat M16 efC200 efSearch {self.ef} + IDSelectorBitmap"

    def prepare(self, p: rb.Point) -> None:
        params = self.faiss.SearchParametersHNSW()
        params.efSearch = self.ef
        if p.where is not None:
            self.bits = np.packbits(p.mask.astype(np.uint8), bitorder="little")
            self.sel = self.faiss.IDSelectorBitmap(len(p.mask), self.faiss.swig_ptr(self.bits))
            params.sel = self.sel
        self.params = params

    def search(self, q: np.ndarray) -> np.ndarray:
        _, ids = self.idx.search(q[None, :], rb.K, params=self.params)
        return ids[0][ids[0] >= 0]


class Usearch(Peer):
    name = "usearch"

    def __init__(self, ef: int):
        self.ef = ef

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        from usearch.index import Index

        self.idx = Index(
            ndim=rb.DIM,
            metric="l2sq",
            dtype="f32",
            connectivity=16,
            expansion_add=200,
            expansion_search=self.ef,
        )
        self.idx.add(np.arange(len(x)), x, threads=os.cpu_count() or 1)
        self.note = f"HNSW conn 16 expansion {self.ef}, post-filter k'=1.5k/sel+k (no filter API)"

    def prepare(self, p: rb.Point) -> None:
        self.mask = p.mask
        sel = max(float(p.mask.mean()), 1e-9)
        self.kp = rb.K if p.where is None else min(4096, int(np.ceil(rb.K * 1.5 / sel)) + rb.K)

    def search(self, q: np.ndarray) -> np.ndarray:
        m = self.idx.search(q, self.kp, threads=1)
        keys = np.asarray(m.keys, dtype=np.int64)
        return keys[self.mask[keys]][: rb.K]


class Lance(Peer):
    name = "lancedb"

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        import lancedb
        import pyarrow as pa

        n = len(x)
        db = lancedb.connect(os.path.join(work, "lancedb"))
        cols: dict[str, Any] = {"id": np.arange(n, dtype=np.int64)} | attr_columns(a)
        cols["vector"] = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), rb.DIM)
        tbl = db.create_table("bench", pa.table(cols), mode="overwrite")
        nlist = int(min(256, max(16, np.sqrt(n))))
        tbl.create_index(
            metric="l2", num_partitions=nlist, num_sub_vectors=16, vector_column_name="vector"
        )
        for c in ("rnd", "corr", "ts_s"):
            tbl.create_scalar_index(c, index_type="BTREE")
        tbl.create_scalar_index("cl", index_type="BITMAP")
        for w in rb.KEYWORDS:
            tbl.create_scalar_index(f"kw_{w}", index_type="BITMAP")
        self.tbl = tbl
        self.note = (
            f"{lancedb.__version__} IVF_PQ {nlist} lists x 16 sub-vectors, nprobes 20, "
            "refine 10, BTREE/BITMAP scalar indexes, prefilter"
        )

    def prepare(self, p: rb.Point) -> None:
        parts = []
        for c in conds(p.where):
            if c[0] == "flag":
                parts.append(c[1])
            elif c[0] == "in":
                parts.append(f"{c[1]} IN ({', '.join(map(str, c[2]))})")
            else:
                parts.append(f"{c[1]} {'<' if c[0] == 'lt' else '>='} {c[2]}")
        self.sql = " AND ".join(f"({s})" for s in parts) or None

    def search(self, q: np.ndarray) -> np.ndarray:
        qb = (
            self.tbl.search(q).limit(rb.K).select(["id", "_distance"]).nprobes(20).refine_factor(10)
        )
        if self.sql:
            qb = qb.where(self.sql, prefilter=True)
        return qb.to_arrow().column("id").to_numpy()


class Chroma(Peer):
    name = "chroma"

    def __init__(self, ef: int):
        self.ef = ef

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        import chromadb

        client = chromadb.PersistentClient(path=os.path.join(work, "chroma"))
        col = client.create_collection(
            "bench",
            configuration={
                "hnsw": {
                    "space": "l2",
                    "ef_construction": 200,
                    "ef_search": self.ef,
                    "max_neighbors": 16,
                }
            },
        )
        cols = attr_columns(a)
        step = min(5000, client.get_max_batch_size())
        for s in range(0, len(x), step):
            e = min(len(x), s + step)
            metas = [
                {c: (bool(v[i]) if v.dtype == bool else v[i].item()) for c, v in cols.items()}
                for i in range(s, e)
            ]
            col.add(ids=[str(i) for i in range(s, e)], embeddings=x[s:e], metadatas=metas)
        self.client, self.col = client, col
        self.note = f"{chromadb.__version__} PersistentClient, HNSW M16 efC200 ef_search {self.ef}"

    def prepare(self, p: rb.Point) -> None:
        ws = []
        for c in conds(p.where):
            if c[0] == "flag":
                ws.append({c[1]: {"$eq": True}})
            elif c[0] == "in":
                ws.append({c[1]: {"$in": c[2]}})
            else:
                ws.append({c[1]: {"$lt" if c[0] == "lt" else "$gte": c[2]}})
        self.where = None if not ws else ws[0] if len(ws) == 1 else {"$and": ws}

    def search(self, q: np.ndarray) -> np.ndarray:
        r = self.col.query(query_embeddings=[q], n_results=rb.K, where=self.where, include=[])
        return np.array([int(i) for i in r["ids"][0]], dtype=np.int64)


class Milvus(Peer):
    name = "milvus-lite"

    def __init__(self, ef: int):
        self.ef = ef

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        import pymilvus
        from pymilvus import DataType, MilvusClient

        c = MilvusClient(os.path.join(work, "milvus.db"))
        schema = MilvusClient.create_schema(auto_id=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=rb.DIM)
        for f in ("rnd", "corr"):
            schema.add_field(f, DataType.DOUBLE)
        for f in ("ts_s", "cl"):
            schema.add_field(f, DataType.INT64)
        for w in rb.KEYWORDS:
            schema.add_field(f"kw_{w}", DataType.BOOL)
        ip = c.prepare_index_params()
        kind = "HNSW"
        ip.add_index(
            "vector", index_type=kind, metric_type="L2", params={"M": 16, "efConstruction": 200}
        )
        c.create_collection("bench", schema=schema, index_params=ip)
        cols = attr_columns(a)
        step = 5000
        for s in range(0, len(x), step):
            e = min(len(x), s + step)
            rows = []
            for i in range(s, e):
                r: dict[str, Any] = {"id": i, "vector": x[i].tolist()}
                for k, v in cols.items():
                    r[k] = bool(v[i]) if v.dtype == bool else v[i].item()
                rows.append(r)
            c.insert("bench", rows)
        c.flush("bench")
        c.load_collection("bench")
        self.c = c
        self.note = f"pymilvus {pymilvus.__version__}, {kind} M16 efC200 ef {self.ef}, filter expr"

    def prepare(self, p: rb.Point) -> None:
        parts = []
        for c in conds(p.where):
            if c[0] == "flag":
                parts.append(f"{c[1]} == true")
            elif c[0] == "in":
                parts.append(f"{c[1]} in [{', '.join(map(str, c[2]))}]")
            else:
                parts.append(f"{c[1]} {'<' if c[0] == 'lt' else '>='} {c[2]}")
        self.expr = " and ".join(f"({s})" for s in parts)

    def search(self, q: np.ndarray) -> np.ndarray:
        r = self.c.search(
            "bench",
            data=[q.tolist()],
            filter=self.expr,
            limit=rb.K,
            search_params={"params": {"ef": self.ef}},
        )
        return np.array([h["id"] for h in r[0]], dtype=np.int64)

    def close(self) -> None:
        self.c.close()


class Qdrant(Peer):
    name = "qdrant-local"

    def build(self, x: np.ndarray, a: dict[str, np.ndarray], work: str) -> None:
        from qdrant_client import QdrantClient, models

        self.m = models
        c = QdrantClient(":memory:")  # local mode; path= persists every point (5k: 57 s)
        c.create_collection(
            "bench",
            vectors_config=models.VectorParams(size=rb.DIM, distance=models.Distance.EUCLID),
        )
        cols = attr_columns(a)
        payload = [
            {k: (bool(v[i]) if v.dtype == bool else v[i].item()) for k, v in cols.items()}
            for i in range(len(x))
        ]
        c.upload_collection("bench", vectors=x, payload=payload, ids=list(range(len(x))))
        self.c = c
        self.note = "QdrantClient(':memory:') local mode (pure Python, exact), Filter(must=...)"

    def prepare(self, p: rb.Point) -> None:
        m = self.m
        must = []
        for c in conds(p.where):
            if c[0] == "flag":
                must.append(m.FieldCondition(key=c[1], match=m.MatchValue(value=True)))
            elif c[0] == "in":
                must.append(m.FieldCondition(key=c[1], match=m.MatchAny(any=c[2])))
            else:
                rng = m.Range(lt=c[2]) if c[0] == "lt" else m.Range(gte=c[2])
                must.append(m.FieldCondition(key=c[1], range=rng))
        self.filter = m.Filter(must=must) if must else None

    def search(self, q: np.ndarray) -> np.ndarray:
        r = self.c.query_points("bench", query=q, query_filter=self.filter, limit=rb.K)
        return np.array([pt.id for pt in r.points], dtype=np.int64)

    def close(self) -> None:
        self.c.close()


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s[:160]


def compare(
    src: Any,
    x: np.ndarray,
    a: dict[str, np.ndarray],
    qs: np.ndarray,
    pts: list[rb.Point],
    gts: list[list[np.ndarray]],
    *,
    ef: int,
    slow_queries: int,
    systems: list[str] | None = None,
    slow_peers: tuple[str, ...] = SLOW_PEERS,
    work: str | None = None,
    tracing: bool = False,
) -> None:
    """Build every peer, then per point run every system on every query (random order per
    query); print one table of recall@10 / p50 ms per point per system."""
    work = work or tempfile.mkdtemp(prefix="retrieval-peers-")
    makers: list[tuple[str, Callable[[], Peer]]] = [
        ("fabric fab.query", lambda: FabricQuery(src, pts, tracing)),
        ("fabric search", lambda: FabricSearch(src)),
        ("faiss", lambda: Faiss(ef)),
        ("usearch", lambda: Usearch(ef)),
        ("lancedb", lambda: Lance()),
        ("chroma", lambda: Chroma(ef)),
        ("milvus-lite", lambda: Milvus(ef)),
        ("qdrant-local", lambda: Qdrant()),
    ]
    peers: list[Peer] = []
    failed: dict[str, str] = {}
    built: dict[str, float] = {}
    for name, make in makers:
        if systems is not None and name not in systems and not name.startswith("fabric"):
            continue
        t = time.perf_counter()
        try:
            peer = make()
            peer.build(x, a, work)
        except ImportError as e:
            failed[name] = f"not installed ({_short(e)}; pip install -e '.[bench]')"
            print(f"{name}: {failed[name]}", flush=True)
            continue
        except Exception as e:
            failed[name] = f"build failed: {_short(e)}"
            print(f"{name}: {failed[name]}", flush=True)
            traceback.print_exc(limit=3)
            continue
        built[name] = time.perf_counter() - t
        peers.append(peer)
        print(f"{name}: built in {built[name]:.1f} s  {peer.note}", flush=True)
    res: dict[str, dict[str, tuple[float, float, int] | str]] = {}
    order = np.random.default_rng(11)
    for p, gt in zip(pts, gts):
        row: dict[str, tuple[float, float, int] | str] = {}
        live = []
        for peer in peers:
            try:
                peer.prepare(p)
                live.append(peer)
            except Exception as e:
                row[peer.name] = f"failed: {_short(e)}"
        lat: dict[str, list[float]] = {pe.name: [] for pe in live}
        rec: dict[str, list[float]] = {pe.name: [] for pe in live}
        for i, (q, exp) in enumerate(zip(qs, gt)):
            now = [
                pe
                for pe in live
                if pe.name not in row and (i < slow_queries or pe.name not in slow_peers)
            ]
            for j in order.permutation(len(now)):
                pe = now[int(j)]
                t = time.perf_counter()
                try:
                    ids = pe.search(q)
                except Exception as e:
                    row[pe.name] = f"failed: {_short(e)}"
                    continue
                lat[pe.name].append(time.perf_counter() - t)
                rec[pe.name].append(rb.recall(np.asarray(ids, dtype=np.int64), exp))
        for pe in live:
            if pe.name not in row and lat[pe.name]:
                row[pe.name] = (
                    float(np.mean(rec[pe.name])),
                    float(np.median(lat[pe.name])) * 1e3,
                    len(lat[pe.name]),
                )
        res[p.name] = row
        print(
            f"{p.name:<16} "
            + " | ".join(
                f"{k} {v[0]:.3f}/{v[1]:.2f}ms" if isinstance(v, tuple) else f"{k} {v}"
                for k, v in row.items()
            ),
            flush=True,
        )
    names = [pe.name for pe in peers] + list(failed)
    print()
    print(
        f"## Filtered search: the fabric and its peers, n={len(x)}, {rb.DIM}-d, k={rb.K}, "
        f"{len(qs)} queries ({', '.join(s for s in slow_peers if s in names)}: first "
        f"{slow_queries}); recall@10 / p50 ms"
    )
    print()
    print("| system | " + " | ".join(p.name for p in pts) + " |")
    print("|---|" + "---|" * len(pts))
    for name in names:
        cells = []
        for p in pts:
            v = res[p.name].get(name) if name not in failed else failed[name]
            if isinstance(v, tuple):
                cells.append(f"{v[0]:.3f} / {v[1]:.2f}")
            else:
                cells.append(str(v) if v else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    ratios = []
    cells = []
    for p in pts:
        row = res[p.name]
        fab = row.get("fabric fab.query")
        ok = [
            (v[1], k)
            for k, v in row.items()
            if isinstance(v, tuple) and not k.startswith("fabric") and v[0] >= 0.95
        ]
        if not isinstance(fab, tuple) or not ok:
            cells.append("no peer reaches 0.95" if isinstance(fab, tuple) else "-")
            continue
        best, who = min(ok)
        ratios.append(fab[1] / best)
        cells.append(f"{fab[1] / best:.3g}x ({who})")
    print("| fab.query / fastest peer at recall >= 0.95 | " + " | ".join(cells) + " |")
    print()
    fq = [
        v
        for r in res.values()
        for k, v in r.items()
        if k == "fabric fab.query" and isinstance(v, tuple)
    ]
    if fq:
        print(
            f"fabric fab.query: min recall@10 {min(v[0] for v in fq):.3f}, max p50 {max(v[1] for v in fq):.3f} ms"
            + (f", max ratio to the fastest peer at 0.95 {max(ratios):.2f}x" if ratios else "")
        )
    for name, s in built.items():
        print(f"built {name} in {s:.1f} s")
    for pe in peers:
        with contextlib.suppress(Exception):
            pe.close()
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50_000, help="rows (the issue's scale: 200000)")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument(
        "--slow-queries", type=int, default=20, help="queries for chroma, milvus-lite, qdrant-local"
    )
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fabric/bench"))
    ap.add_argument("--only", default=None, help="substring: run only matching points")
    ap.add_argument("--all-points", action="store_true", help="every point of retrieval.py")
    ap.add_argument("--systems", default=None, help="comma-separated peers (fabric always runs)")
    ap.add_argument("--ef", type=int, default=128)
    ap.add_argument(
        "--no-partition", action="store_true", help="no per-value graphs of cl in the fabric"
    )
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="fab.query with tracing on (fabric.yaml's default; off here: its worker thread "
        "formatted the 128-d session vector per query and held the GIL, 1 -> 15-35 ms)",
    )
    args = ap.parse_args()
    from connectors.dataset import DatasetSource
    from indexes import calibrate

    ds, a, took = rb.build(args.n, args.cache)
    print(f"dataset: {ds}  ({'loaded in' if took < 0 else 'built in'} {abs(took):.1f} s)")
    ds.set_ef("emb", args.ef)
    if ds.cost_model is None:
        calibrate(ds)
        ds.save(os.path.join(args.cache, f"retrieval-v2-{args.n}"))
    if not args.no_partition:
        t = time.perf_counter()
        ds.partition("emb", "cl")
        ds.flush()
        print(f"per-value graphs of cl built in {time.perf_counter() - t:.1f} s", flush=True)
    x = a["x"]
    sq = np.einsum("ij,ij->i", x, x)
    qs, _ = rb.mixture(args.queries, 99, rb.QUERY_CLUSTERS)
    pts = [
        p
        for p in rb.points(a, args.n)
        if (args.all_points or p.name in DEFAULT_POINTS)
        and (args.only is None or args.only in p.name)
    ]
    print(f"ground truth for {len(pts)} points x {len(qs)} queries ...", flush=True)
    gts = [rb.truth(x, sq, qs, p.mask) for p in pts]
    src = DatasetSource("dataset://bench", ds)
    for p in pts:  # warm the optimizer's caches and feedback
        for q in qs[:5]:
            src.search("emb", q, rb.K, () if p.where is None else (p.where,), {}, ["id"])
    compare(
        src,
        x,
        a,
        qs,
        pts,
        gts,
        ef=args.ef,
        slow_queries=args.slow_queries,
        systems=None if args.systems is None else args.systems.split(","),
        tracing=args.tracing,
    )
    ds.close()


if __name__ == "__main__":
    main()
