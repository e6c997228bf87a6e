"""Filtered vector retrieval: every fixed strategy vs the cost-based optimizer.

Data: ``--n`` (default 200,000) x 128-d float32 vectors from a 64-cluster Gaussian
mixture, l2 metric, with attributes

- ``rnd``   uniform in [0, 1): uncorrelated with the vectors (btree);
- ``corr``  cluster id + uniform in [0, 1): follows the cluster (btree);
- ``ts``    arrival time, one row per second (btree; a range is contiguous in row ids);
- ``body``  keywords: 'all' always, 'k10' in 10 % of rows, 'k1' 1 %, 'k01' 0.1 %,
            'k001' 0.01 % (inverted).

Queries: ``--queries`` (1,000) fresh points of the same mixture, k=10. For each predicate
point: p50/p95 latency and recall@10 (against exact brute force over the filtered rows)
of postfilter / insearch / prefilter / exact forced *without* run-time guards, and of the
optimizer (guards on), all measured through ``DatasetSource.search`` (the executor's
entry point; rows materialized, ``id`` projected). The in-search filter and the full scan
run on the first ``--slow-queries`` (50) queries only (marked in the table). faiss (HNSW,
``IDSelectorBitmap``) runs when installed (``pip install -e .[bench]``).

The built dataset is cached under ``--cache`` (the dataset's own save/load), so only the
first run pays for the HNSW build.

    .venv/bin/python benchmarks/retrieval.py                 # full run
    .venv/bin/python benchmarks/retrieval.py --n 20000 --queries 200   # quick
    .venv/bin/python benchmarks/retrieval.py --only anti --ab   # fab.query before / after
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from connectors.dataset import DatasetSource
from dsl.ast import Binary, Call, Column, Expr, InList, Literal
from indexes import Dataset, IndexSpec, calibrate

DIM, CLUSTERS, K = 128, 64, 10
QUERY_CLUSTERS = 32  # queries come from clusters 0-31; the anti-correlated filters select 32-63
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
KEYWORDS = {"k10": 0.1, "k1": 0.01, "k01": 0.001, "k001": 0.0001}


def mixture(n: int, seed: int, clusters: int = CLUSTERS) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points of the mixture; ``clusters`` < 64 draws only from the first clusters
    (the queries: the anti-correlated points select clusters they never come from)."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(12345).standard_normal((CLUSTERS, DIM)).astype(np.float32) * 2.0
    lab = rng.integers(0, clusters, n)
    x = centers[lab] + rng.standard_normal((n, DIM)).astype(np.float32)
    return x.astype(np.float32), lab


SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("rnd", pa.float64()),
        ("corr", pa.float64()),
        ("cl", pa.int64()),
        ("body", pa.string()),
        ("emb", pa.list_(pa.float32(), DIM)),
    ]
)


def make_rows(n: int, start: int = 0, seed: int = 1) -> tuple[dict[str, np.ndarray], pa.Table]:
    """``n`` rows with ids (and arrival seconds) from ``start``; attrs keep ``x``."""
    x, lab = mixture(n, seed)
    rng = np.random.default_rng(seed + 1)
    attrs = {
        "rnd": rng.random(n),
        "corr": lab + rng.random(n),
        "ts_s": np.arange(start, start + n, dtype=np.int64),
        "cl": lab.astype(np.int64),
    }
    kw = {w: rng.random(n) < p for w, p in KEYWORDS.items()}
    attrs.update({f"kw_{w}": m for w, m in kw.items()})
    body = [" ".join(["all"] + [w for w in KEYWORDS if kw[w][i]]) for i in range(n)]
    ts = pa.array(attrs["ts_s"] * 1_000_000 + int(T0.timestamp() * 1_000_000), pa.int64()).cast(
        pa.timestamp("us", tz="UTC")
    )
    table = pa.table(
        {
            "id": np.arange(start, start + n, dtype=np.int64),
            "ts": ts,
            "rnd": attrs["rnd"],
            "corr": attrs["corr"],
            "cl": attrs["cl"],
            "body": body,
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
        },
        schema=SCHEMA,
    )
    return attrs | {"x": x}, table


def build(n: int, cache: str) -> tuple[Dataset, dict[str, np.ndarray], float]:
    path = os.path.join(cache, f"retrieval-v2-{n}")
    attrs, table = make_rows(n)
    if os.path.exists(os.path.join(path, "meta.json")):
        t = time.perf_counter()
        ds = Dataset.load(path)
        if any(v.pending() for v in ds.vectors.values()):  # a graph rebuilt on load
            ds.flush()  # measured at rest, as a fresh build is
            ds.save(path)
        return ds, attrs, -(time.perf_counter() - t)
    ds = Dataset.create(
        "bench",
        SCHEMA,
        "id",
        {
            "emb": IndexSpec("hnsw", metric="l2", M=16, ef_construction=200, ef=128),
            "ts": "btree",
            "rnd": "btree",
            "corr": "btree",
            "cl": "btree",
            "body": "inverted",
        },
        fold_rows=n + 1,  # one graph build for the bulk load
    )
    t = time.perf_counter()
    ds.upsert(table)
    ds.flush()
    took = time.perf_counter() - t
    ds.save(path)
    return ds, attrs, took


@dataclass(frozen=True)
class Point:
    name: str
    where: Expr | None
    mask: np.ndarray


def points(a: dict[str, np.ndarray], n: int) -> list[Point]:
    def lt(col: str, v: float) -> Expr:
        return Binary("<", Column(col), Literal(float(v), "float"))

    def match(w: str) -> Expr:
        return Call("match", (Column("body"), Literal(w, "str")))

    def recent(frac: float) -> tuple[Expr, np.ndarray]:
        cut = int(n * (1 - frac))
        ts = T0 + dt.timedelta(seconds=cut)
        return Binary(">=", Column("ts"), Literal(ts, "timestamp")), a["ts_s"] >= cut

    out = [Point("none (100%)", None, np.ones(len(a["rnd"]), bool))]
    for s in (0.1, 0.01, 0.001, 0.0001):
        out.append(Point(f"uncorr {s:.2%}", lt("rnd", s), a["rnd"] < s))
    for s in (0.1, 0.01, 0.001, 0.0001):
        out.append(Point(f"corr {s:.2%}", lt("corr", s * CLUSTERS), a["corr"] < s * CLUSTERS))
    for s in (0.1, 0.01, 0.001, 0.0001):
        e, m = recent(s)
        out.append(Point(f"time {s:.2%}", e, m))
    for w, p in KEYWORDS.items():
        out.append(Point(f"keyword {p:.2%}", match(w), a[f"kw_{w}"]))
    e10, m10 = recent(0.1)
    e1, m1 = recent(0.01)
    out.append(Point("time10%&kw10%", Binary("and", e10, match("k10")), m10 & a["kw_k10"]))
    out.append(Point("time1%&kw10%", Binary("and", e1, match("k10")), m1 & a["kw_k10"]))
    out.append(
        Point(
            "uncorr10%&kw1%",
            Binary("and", lt("rnd", 0.1), match("k1")),
            (a["rnd"] < 0.1) & a["kw_k1"],
        )
    )
    out.append(
        Point(
            "corr10%&kw10%",
            Binary("and", lt("corr", 6.4), match("k10")),
            (a["corr"] < 6.4) & a["kw_k10"],
        )
    )

    # anti-correlated: whole clusters the queries never come from ('other sectors')
    def cl_in(values: list[int]) -> tuple[Expr, np.ndarray]:
        e = InList(Column("cl"), tuple(Literal(v, "int") for v in values))
        return e, np.isin(a["cl"], values)

    far10 = list(range(QUERY_CLUSTERS, QUERY_CLUSTERS + 7))  # 7 of 64 clusters: ~10.9 %
    for name, vals in (
        ("anti 100%", list(range(CLUSTERS))),  # a 64-value in that every row passes
        ("anti 10%", far10),
        ("anti 1.6%", [CLUSTERS - 1]),
    ):
        e, m = cl_in(vals)
        out.append(Point(name, e, m))
    e, m = cl_in(far10)
    for s in (0.5, 0.1, 0.01):
        out.append(Point(f"rnd{s:.0%}&anti10%", Binary("and", lt("rnd", s), e), (a["rnd"] < s) & m))
    et, mt = recent(0.1)
    out.append(Point("time10%&anti10%", Binary("and", et, e), mt & m))
    return out


def truth(x: np.ndarray, sq: np.ndarray, q: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    ids = np.flatnonzero(mask)
    out = []
    sub, subsq = x[ids], sq[ids]
    for i in range(0, len(q), 100):
        d = subsq[None, :] - 2.0 * (q[i : i + 100] @ sub.T)
        kk = min(K, len(ids))
        part = (
            np.argpartition(d, kk - 1, axis=1)[:, :kk]
            if len(ids) > kk
            else np.tile(np.arange(len(ids)), (len(d), 1))
        )
        for row, p in zip(d, part):
            out.append(ids[p[np.argsort(row[p])]])
    return out


def recall(found: np.ndarray, exp: np.ndarray) -> float:
    if not len(exp):
        return 1.0
    return len(np.intersect1d(found, exp)) / len(exp)


def run_point(
    src: DatasetSource,
    p: Point,
    qs: np.ndarray,
    gt: list[np.ndarray],
    slow: int,
    partition: bool = False,
) -> dict[str, dict]:
    """Every strategy on every query, interleaved per query in random order, so machine
    noise and the cache effects of the previous run hit every strategy alike."""
    names = ["postfilter", "insearch", "prefilter", "exact", "optimizer"]
    if partition:  # per-value graphs of `cl` (--partition): only the cl-pinning points
        names.insert(4, "partition")
    lat: dict[str, list[float]] = {s: [] for s in names}
    rec: dict[str, list[float]] = {s: [] for s in names}
    chosen: dict[str, int] = {}
    filters = () if p.where is None else (p.where,)
    order = np.random.default_rng(7)
    for i, (q, exp) in enumerate(zip(qs, gt)):
        active = [s for s in names if i < slow or s not in ("insearch", "exact")]
        for s in map(str, order.permutation(active)):
            strat = None if s == "optimizer" else s
            t = time.perf_counter()
            table, info = src.search(
                "emb", q, K, filters, {}, ["id"], strategy=strat, guards=strat is None
            )
            lat[s].append(time.perf_counter() - t)
            rec[s].append(recall(table.column("id").to_numpy(), exp))
            if strat is None:
                key = (
                    info.executed
                    if info.executed == info.chosen
                    else f"{info.chosen}>{info.executed}"
                )
                chosen[key] = chosen.get(key, 0) + 1
    out: dict[str, dict] = {}
    for s in names:
        ms = np.array(lat[s]) * 1e3
        out[s] = {
            "p50": float(np.median(ms)),
            "p95": float(np.percentile(ms, 95)),
            "recall": float(np.mean(rec[s])),
            "n": len(ms),
        }
    out["optimizer"]["chosen"] = chosen
    # the optimizer's p50 on exactly the queries each fixed strategy ran (the slow ones run
    # on the first `slow` queries only: compare like with like)
    opt = np.array(lat["optimizer"]) * 1e3
    for s in names[:-1]:
        out[s]["opt_p50_same_queries"] = float(np.median(opt[: len(lat[s])]))
    return out


def versus_best(res: dict[str, dict]) -> tuple[str | None, float]:
    """Best fixed strategy with recall >= 0.95, and the optimizer's p50 ratio to it (same queries)."""
    ok = {k: v for k, v in res.items() if k != "optimizer" and v["recall"] >= 0.95}
    if not ok:
        return None, float("nan")
    bk = min(ok, key=lambda k: ok[k]["p50"])
    return bk, ok[bk]["opt_p50_same_queries"] / ok[bk]["p50"]


def faiss_run(
    x: np.ndarray, qs: np.ndarray, pts: list[Point], gts: list[list[np.ndarray]], ef: int
) -> dict[str, dict] | str:
    try:
        import faiss
    except ImportError:
        return "faiss not installed (pip install faiss-cpu)"
    t = time.perf_counter()
    idx = faiss.IndexHNSWFlat(DIM, 16)
    idx.hnsw.efConstruction = 200
    idx.add(x)
    build = time.perf_counter() - t
    faiss.omp_set_num_threads(1)
    out: dict[str, dict] = {"_build_s": {"s": build}}
    for p, gt in zip(pts, gts):
        params = faiss.SearchParametersHNSW()
        params.efSearch = ef
        if p.where is not None:
            bits = np.packbits(p.mask.astype(np.uint8), bitorder="little")
            sel = faiss.IDSelectorBitmap(len(p.mask), faiss.swig_ptr(bits))
            params.sel = sel
        lat, rec = [], []
        for q, exp in zip(qs, gt):
            t = time.perf_counter()
            _, ids = idx.search(q[None, :], K, params=params)
            lat.append(time.perf_counter() - t)
            rec.append(recall(ids[0][ids[0] >= 0], exp))
        out[p.name] = {"p50": float(np.median(lat)) * 1e3, "recall": float(np.mean(rec))}
    return out


def lance_sql(e: Expr | None, n: int) -> str | None:
    """The same predicate for LanceDB (keywords as boolean columns, time as seconds)."""
    if e is None:
        return None
    if isinstance(e, Binary) and e.op == "and":
        return f"({lance_sql(e.left, n)}) AND ({lance_sql(e.right, n)})"
    if isinstance(e, Call):
        return f"kw_{e.args[1].value}"  # type: ignore[union-attr]
    if isinstance(e, InList):
        return f"cl IN ({', '.join(str(i.value) for i in e.items)})"  # type: ignore[union-attr]
    assert isinstance(e, Binary) and isinstance(e.left, Column) and isinstance(e.right, Literal)
    if e.left.name == "ts":
        return f"ts_s {e.op} {int((e.right.value - T0).total_seconds())}"
    return f"{e.left.name} {e.op} {e.right.value}"


def lancedb_run(
    x: np.ndarray,
    a: dict[str, np.ndarray],
    qs: np.ndarray,
    pts: list[Point],
    gts: list[list[np.ndarray]],
    cache: str,
    nq: int,
) -> dict[str, dict] | str:
    """LanceDB's own filtered search: IVF_PQ (256 lists, 16 sub-vectors, nprobes 20, refine 10),
    BTREE scalar indexes on rnd/corr/ts_s and BITMAP indexes on the keyword flags, prefilter."""
    try:
        import lancedb
    except ImportError:
        return "lancedb not installed (pip install -e .[bench])"
    n = len(x)
    db = lancedb.connect(os.path.join(cache, f"lancedb-{n}"))
    t = time.perf_counter()
    try:
        tbl = db.open_table("bench")
        build = -1.0
    except Exception:
        cols = {
            "id": np.arange(n, dtype=np.int64),
            "rnd": a["rnd"],
            "corr": a["corr"],
            "ts_s": a["ts_s"],
            "cl": a["cl"],
        }
        cols |= {f"kw_{w}": a[f"kw_{w}"] for w in KEYWORDS}
        cols["vector"] = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM)
        tbl = db.create_table("bench", pa.table(cols))
        tbl.create_index(
            metric="l2", num_partitions=256, num_sub_vectors=16, vector_column_name="vector"
        )
        for c in ("rnd", "corr", "ts_s"):
            tbl.create_scalar_index(c, index_type="BTREE")
        for w in KEYWORDS:
            tbl.create_scalar_index(f"kw_{w}", index_type="BITMAP")
        build = time.perf_counter() - t
    out: dict[str, dict] = {"_build_s": {"s": build}}
    for p, gt in zip(pts, gts):
        sql = lance_sql(p.where, n)
        lat, rec = [], []
        for q, exp in zip(qs[:nq], gt[:nq]):
            t = time.perf_counter()
            qb = tbl.search(q).limit(K).select(["id", "_distance"]).nprobes(20).refine_factor(10)
            if sql:
                qb = qb.where(sql, prefilter=True)
            ids = qb.to_arrow().column("id").to_numpy()
            lat.append(time.perf_counter() - t)
            rec.append(recall(ids, exp))
        out[p.name] = {"p50": float(np.median(lat)) * 1e3, "recall": float(np.mean(rec))}
    return out


def bindings(pts: list[Point]) -> tuple[str, list[str]]:
    """A directory with one binding file per point (``nearest`` over the dataset, the
    point's filter as ``where``), and the bindings' names."""
    import tempfile

    d = tempfile.mkdtemp(prefix="retrieval-bindings-")
    names = []
    for i, p in enumerate(pts):
        name = f"p{i}"
        where = f'\n    where: "{p.where}"' if p.where is not None else ""
        with open(os.path.join(d, f"{name}.yaml"), "w") as f:
            f.write(
                f"binding: {name}\nsession:\n  q: vector[{DIM}]\nsources:\n  n:\n"
                f'    from: dataset://bench\n    nearest: {{column: emb, to: "{{{{session.q}}}}", k: {K}}}'
                f"{where}\nselect: [n.id]\n"
            )
        names.append(name)
    return d, names


def api_run(
    src: DatasetSource, pts: list[Point], qs: np.ndarray, gts: list[list[np.ndarray]]
) -> list[tuple]:
    """The optimizer through the public API (``fabric.open`` + ``fab.query`` of a binding
    file per point) next to ``DatasetSource.search``, interleaved per query."""
    import fabric

    d, names = bindings(pts)
    out = []
    with fabric.open(
        {"bindings": [d]}, ingest=False, watch=False, dataset_sources={"bench": src}
    ) as fab:
        order = np.random.default_rng(3)
        for p, name, gt in zip(pts, names, gts):
            filters = () if p.where is None else (p.where,)
            lat: dict[str, list[float]] = {"source": [], "api": []}
            rec = []
            fab.query(name, session={"q": qs[0]})  # compile once (plans are cached)
            for q, exp in zip(qs, gt):
                for s in map(str, order.permutation(["source", "api"])):
                    t = time.perf_counter()
                    if s == "api":
                        ids = fab.query(name, session={"q": q}).table.column(0).to_numpy()
                        lat[s].append(time.perf_counter() - t)
                        rec.append(recall(ids, exp))
                    else:
                        src.search("emb", q, K, filters, {}, ["id"])
                        lat[s].append(time.perf_counter() - t)
            a_ms, s_ms = np.median(lat["api"]) * 1e3, np.median(lat["source"]) * 1e3
            out.append((p.name, s_ms, a_ms, float(np.mean(rec))))
            print(
                f"{p.name:<16} source {s_ms:7.3f} ms | api {a_ms:7.3f} ms | recall {np.mean(rec):.3f}",
                flush=True,
            )
    return out


def ab_run(
    ds: Dataset,
    src: DatasetSource,
    pts: list[Point],
    qs: np.ndarray,
    gts: list[list[np.ndarray]],
) -> list[tuple]:
    """``fab.query`` of each point's binding as the code was before the 8-bit first pass
    and the per-version candidate bitmaps (``before``: ``indexes.quantized.ENABLED`` off,
    every compiled filter's remembered bitmap dropped before each query) and as it is
    (``after``), interleaved per query in random order; the same optimizer and cost model
    otherwise. Returns (point, before p50, after p50, before recall, after recall,
    after's choices)."""
    import fabric
    from indexes import quantized

    d, names = bindings(pts)
    arms = ["before", "after"] + (["after_numpy"] if quantized.KERNEL == "numkong" else [])
    out = []
    with fabric.open(
        {"bindings": [d]}, ingest=False, watch=False, dataset_sources={"bench": src}
    ) as fab:
        order = np.random.default_rng(11)
        kernel = quantized.KERNEL
        for p, name, gt in zip(pts, names, gts):
            lat: dict[str, list[float]] = {a: [] for a in arms}
            rec: dict[str, list[float]] = {a: [] for a in arms}
            fab.query(name, session={"q": qs[0]})  # compile once (plans are cached)
            for q, exp in zip(qs, gt):
                for arm in map(str, order.permutation(arms)):
                    quantized.ENABLED = arm != "before"
                    quantized.set_kernel("numpy" if arm == "after_numpy" else kernel)
                    if arm == "before":
                        for pred in ds.pred_cache.values():
                            pred.__dict__.pop("_rows_memo", None)
                    t = time.perf_counter()
                    ids = fab.query(name, session={"q": q}).table.column(0).to_numpy()
                    lat[arm].append(time.perf_counter() - t)
                    rec[arm].append(recall(ids, exp))
            quantized.ENABLED = True
            quantized.set_kernel(kernel)
            p50 = {a: float(np.median(lat[a]) * 1e3) for a in arms}
            rc = {a: float(np.mean(rec[a])) for a in arms}
            out.append((p.name, p50, rc))
            print(
                f"{p.name:<16} "
                + " | ".join(
                    f"{a} {p50[a]:7.3f} ms r{rc[a]:.3f} ({p50[a] / p50['before']:.2f}x)"
                    for a in arms
                ),
                flush=True,
            )
    return out


def folding_run(
    ds: Dataset,
    src: DatasetSource,
    a: dict[str, np.ndarray],
    n: int,
    qs: np.ndarray,
    m: int,
    only: str | None,
    partition: bool = False,
) -> list[tuple]:
    """Queries issued while a bulk upsert of ``m`` fresh rows folds into the graph: the
    upsert (20k-row batches) returns once backpressure lets its last batch in (the
    growing segment then holds up to ``max_growing`` + a batch), and the background
    folder works through it while every point runs postfilter / prefilter (guards off)
    and the optimizer, interleaved per query; truth covers all n + m rows."""
    b, table = make_rows(m, start=n, seed=3)
    a2 = {c: np.concatenate([a[c], b[c]]) for c in a}
    x2 = a2["x"]
    sq = np.einsum("ij,ij->i", x2, x2)
    pts = [p for p in points(a2, n) if only is None or only in p.name]
    print(f"ground truth over {n + m} rows for {len(pts)} points ...", flush=True)
    gts = [truth(x2, sq, qs, p.mask) for p in pts]
    for vi in ds.vectors.values():
        vi.fold_rows = 2048
    ds.background_fold, ds._closed = True, False
    t = time.perf_counter()
    for s0 in range(0, m, 20_000):
        ds.upsert(table.slice(s0, 20_000))
    print(
        f"upserted {m} rows in {time.perf_counter() - t:.1f} s; growing {ds.growing()}", flush=True
    )
    t_fold = time.perf_counter()
    names = ["postfilter", "prefilter", "partition", "optimizer"]
    out = []
    order = np.random.default_rng(5)
    for p, gt in zip(pts, gts):
        g0 = ds.growing()
        lat: dict[str, list[float]] = {s: [] for s in names}
        rec: dict[str, list[float]] = {s: [] for s in names}
        filters = () if p.where is None else (p.where,)
        active = [s for s in names if s != "partition" or (partition and "anti" in p.name)]
        for q, exp in zip(qs, gt):
            for s in map(str, order.permutation(active)):
                strat = None if s == "optimizer" else s
                t = time.perf_counter()
                table_, _ = src.search(
                    "emb", q, K, filters, {}, ["id"], strategy=strat, guards=strat is None
                )
                lat[s].append(time.perf_counter() - t)
                rec[s].append(recall(table_.column("id").to_numpy(), exp))
        res = {
            s: {"p50": float(np.median(lat[s]) * 1e3), "recall": float(np.mean(rec[s]))}
            for s in active
        }
        ok = [v["p50"] for k, v in res.items() if k != "optimizer" and v["recall"] >= 0.95]
        ratio = res["optimizer"]["p50"] / min(ok) if ok else float("nan")
        out.append((p.name, float(p.mask.mean()), g0, ds.growing(), res, ratio))
        print(
            f"{p.name:<16} growing {g0:>6}->{ds.growing():>6} | "
            + " | ".join(f"{k[:6]} {v['p50']:7.3f}ms r{v['recall']:.3f}" for k, v in res.items())
            + f" | opt/best {ratio:5.2f}x",
            flush=True,
        )
    left, passed = ds.growing(), time.perf_counter() - t_fold
    ds.wait_folded(600)
    print(
        f"folder: {m} rows, {left} still growing after the query pass ({passed:.1f} s), "
        f"all folded {time.perf_counter() - t_fold:.1f} s after the upsert",
        flush=True,
    )
    return out


def _lancedb_version() -> str:
    import lancedb

    return str(getattr(lancedb, "__version__", "?"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--slow-queries", type=int, default=50, help="queries for insearch and exact")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fabric/bench"))
    ap.add_argument("--only", default=None, help="substring: run only matching points")
    ap.add_argument("--no-faiss", action="store_true")
    ap.add_argument(
        "--peers",
        action="store_true",
        help="also run the vector-database peers (benchmarks/retrieval_peers.py: faiss, usearch, "
        "LanceDB, Chroma, Milvus Lite, Qdrant local; pip install -e '.[bench]') on the same data "
        "and queries, interleaved",
    )
    ap.add_argument(
        "--peer-slow-queries",
        type=int,
        default=20,
        help="queries for the slow peers (Chroma, Milvus Lite, Qdrant local) with --peers",
    )
    ap.add_argument(
        "--api", action="store_true", help="also time the optimizer through fabric.open/fab.query"
    )
    ap.add_argument(
        "--lancedb",
        type=int,
        default=0,
        metavar="Q",
        help="also run LanceDB on the first Q queries",
    )
    ap.add_argument(
        "--ab",
        action="store_true",
        help="also time fab.query before / after the 8-bit first pass and the per-version "
        "candidate bitmaps, interleaved (issue 12)",
    )
    ap.add_argument("--calibrate", action="store_true", help="re-measure unit costs first")
    ap.add_argument(
        "--folding",
        type=int,
        default=0,
        metavar="M",
        help="then upsert M fresh rows and query every point while they fold (e.g. 100000)",
    )
    ap.add_argument(
        "--folding-queries", type=int, default=50, help="queries per point during folding"
    )
    ap.add_argument(
        "--partition",
        action="store_true",
        help="build per-value HNSW graphs of cl (IndexSpec partition=) and run that strategy too",
    )
    ap.add_argument(
        "--ef", type=int, default=128, help="HNSW search breadth (recall 0.977 at 128 here)"
    )
    args = ap.parse_args()

    ds, a, took = build(args.n, args.cache)
    print(f"dataset: {ds}  ({'loaded in' if took < 0 else 'built in'} {abs(took):.1f} s)")
    ds.set_ef("emb", args.ef)
    if args.calibrate or ds.cost_model is None:
        calibrate(ds)
        ds.save(os.path.join(args.cache, f"retrieval-v2-{args.n}"))
    if args.partition:
        t = time.perf_counter()
        ds.partition("emb", "cl")
        ds.flush()
        print(f"per-value graphs of cl built in {time.perf_counter() - t:.1f} s", flush=True)
    cm = ds.cost_model
    print(
        f"cost model: hnsw {cm.columns.get('emb')}, contig {cm.contig_ns_per_dim * DIM:.1f} ns/row, gather {cm.gather_ns_per_dim * DIM:.1f} ns/row, callback {cm.callback_ns:.0f} ns, visits/ef {cm.visits_per_ef:.1f}"
    )
    mem = ds.nbytes()
    total = sum(mem.values())
    print(
        f"memory: {total / ds.count():.0f} bytes/vector total ({', '.join(f'{k} {v / ds.count():.0f}' for k, v in mem.items())})"
    )
    x = a["x"]
    sq = np.einsum("ij,ij->i", x, x)
    qs, _ = mixture(args.queries, 99, QUERY_CLUSTERS)
    src = DatasetSource("dataset://bench", ds)
    pts = [p for p in points(a, args.n) if args.only is None or args.only in p.name]
    print(f"computing ground truth for {len(pts)} points x {len(qs)} queries ...", flush=True)
    gts = [truth(x, sq, qs, p.mask) for p in pts]
    for p, gt in zip(pts, gts):  # warm up (first pyarrow compute calls, caches)
        run_point(src, p, qs[:2], gt[:2], 1, args.partition and "anti" in p.name)
    rows = []
    for p, gt in zip(pts, gts):
        sel = p.mask.mean()
        res = run_point(src, p, qs, gt, args.slow_queries, args.partition and "anti" in p.name)
        rows.append((p, sel, res))
        bk, ratio = versus_best(res)
        o = res["optimizer"]
        print(
            f"{p.name:<16} sel {sel:8.4%} | "
            + " | ".join(f"{k[:6]} {v['p50']:7.3f}ms r{v['recall']:.3f}" for k, v in res.items())
            + f" | opt/best({bk}) {ratio:5.2f}x  chose {o['chosen']}",
            flush=True,
        )
    print()
    print(
        f"## Filtered retrieval, n={args.n}, {DIM}-d, k={K}, {len(qs)} queries (insearch/exact: first {args.slow_queries}); p50 ms (recall@10)"
    )
    print()
    print(
        "| point | selectivity | postfilter | insearch* | prefilter | exact* | partition | optimizer | best fixed (recall>=0.95) | opt / best (same queries) | optimizer chose |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for p, sel, res in rows:
        bk, ratio = versus_best(res)
        o = res["optimizer"]
        summary.append((o["recall"], ratio, o["p50"]))
        cells = [
            f"{res[s]['p50']:.3f} ({res[s]['recall']:.2f})" if s in res else "-"
            for s in ("postfilter", "insearch", "prefilter", "exact", "partition", "optimizer")
        ]
        chose = ", ".join(f"{k} {v}" for k, v in sorted(o["chosen"].items(), key=lambda kv: -kv[1]))
        print(
            f"| {p.name} | {sel:.4%} | " + " | ".join(cells) + f" | {bk} | {ratio:.2f}x | {chose} |"
        )
    print()
    print(
        f"optimizer: min recall@10 {min(s[0] for s in summary):.3f}, max p50 ratio to best fixed {max(s[1] for s in summary):.2f}x, max p50 {max(s[2] for s in summary):.3f} ms"
    )
    print(
        f"memory: {total / ds.count():.0f} bytes per vector with all indexes (float32 vector alone: {DIM * 4})"
    )
    if args.api:
        print()
        ar = api_run(src, pts, qs, gts)
        print()
        print(
            "## The optimizer through the public API (fab.query of a binding) vs DatasetSource.search, p50 ms"
        )
        print()
        print("| point | DatasetSource.search | fab.query | API overhead | recall@10 |")
        print("|---|---|---|---|---|")
        for name, s_ms, a_ms, r in ar:
            print(f"| {name} | {s_ms:.3f} | {a_ms:.3f} | {a_ms - s_ms:+.3f} | {r:.3f} |")
    if args.ab:
        print()
        ab = ab_run(ds, src, pts, qs, gts)
        print()
        print(
            "## fab.query before / after the 8-bit first pass and the per-version candidate "
            "bitmaps (interleaved per query), p50 ms"
        )
        print()
        arms = list(ab[0][1]) if ab else []
        print(
            "| point | "
            + " | ".join(arms)
            + " | after / before | recall "
            + " / ".join(arms)
            + " |"
        )
        print("|---|" + "---|" * (len(arms) + 2))
        for name, p50, rc in ab:
            print(
                f"| {name} | "
                + " | ".join(f"{p50[a]:.3f}" for a in arms)
                + f" | {p50['after'] / p50['before']:.2f}x | "
                + " / ".join(f"{rc[a]:.3f}" for a in arms)
                + " |"
            )
    if not args.no_faiss:
        fr = faiss_run(x, qs, pts, gts, args.ef)
        print()
        if isinstance(fr, str):
            print(f"faiss: skipped ({fr})")
        else:
            print(
                f"## faiss IndexHNSWFlat M=16 efC=200 efSearch={args.ef} with IDSelectorBitmap (build {fr['_build_s']['s']:.1f} s; library call only, no row materialization)"
            )
            print()
            print("| point | p50 ms | recall@10 |")
            print("|---|---|---|")
            for p in pts:
                r = fr[p.name]
                print(f"| {p.name} | {r['p50']:.3f} | {r['recall']:.2f} |")
    if args.peers:  # benchmarks/retrieval_peers.py: every peer's own filtered search
        import retrieval_peers

        print()
        retrieval_peers.compare(
            src, x, a, qs, pts, gts, ef=args.ef, slow_queries=args.peer_slow_queries
        )
    if args.lancedb:
        lr = lancedb_run(x, a, qs, pts, gts, args.cache, args.lancedb)
        print()
        if isinstance(lr, str):
            print(f"LanceDB: skipped ({lr})")
        else:
            b = lr["_build_s"]["s"]
            print(
                f"## LanceDB {_lancedb_version()} IVF_PQ + scalar indexes, prefilter ({'cached table' if b < 0 else f'build {b:.1f} s'}; first {args.lancedb} queries; library call only)"
            )
            print()
            print("| point | p50 ms | recall@10 |")
            print("|---|---|---|")
            for p in pts:
                r = lr[p.name]
                print(f"| {p.name} | {r['p50']:.3f} | {r['recall']:.2f} |")
    if args.folding:
        print()
        fr2 = folding_run(
            ds, src, a, args.n, qs[: args.folding_queries], args.folding, args.only, args.partition
        )
        print()
        print(
            f"## During folding: {args.folding} rows upserted (20k batches, default backpressure) into the {args.n}-row dataset, queried while the folder works ({args.folding_queries} queries per point); p50 ms (recall@10)"
        )
        print()
        print(
            "| point | selectivity | growing rows | postfilter | prefilter | partition | optimizer | opt / best fixed (recall>=0.95) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, sel, g0, g1, res, ratio in fr2:
            cells = [
                f"{res[s]['p50']:.3f} ({res[s]['recall']:.3f})" if s in res else "-"
                for s in ("postfilter", "prefilter", "partition", "optimizer")
            ]
            print(
                f"| {name} | {sel:.2%} | {g0}->{g1} | " + " | ".join(cells) + f" | {ratio:.2f}x |"
            )
        print(
            f"optimizer during folding: min recall@10 {min(r[4]['optimizer']['recall'] for r in fr2):.3f}, max p50 {max(r[4]['optimizer']['p50'] for r in fr2):.3f} ms"
        )


if __name__ == "__main__":
    main()
