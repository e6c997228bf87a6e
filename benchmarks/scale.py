"""Past one machine: local mode vs Ray with 1, 2 and 4 workers / shards (issue 16).

Three parts, each printing a table (docs/scale.md explains them and the model built on
them):

1. **Ray's own costs** on this machine: cluster start, idle memory of its processes,
   task and actor round trips, a scatter/gather over 4 actors, and moving a 16 MB Arrow
   table through the object store.
2. **Retrieval**: ``--n`` vectors (``--dim``-d float32, l2, HNSW M=16) in one local
   dataset vs sharded over 1, 2 and 4 Ray actors (fabric.ray.shards); ``--queries`` top-10
   queries: p50 / p95 / p99 latency, throughput with one client and with ``--clients``
   threads, each shard's own search time (p50, p99), and memory per shard. Then the
   fan-out model's prediction of the sharded p50 / p99 (order statistics of the measured
   1-shard distribution, plus the measured scatter overhead) next to what was measured.
3. **Federated**: TPC-H queries (``--tpch``, SF ``--sf``; benchmarks/tpch) local vs
   ``executor: ray`` with 1, 2 and 4 scan tasks per scan: p50 latency and throughput.
4. **Joins** (``--joins``): a partitioned hash join on Ray (fabric.ray.join) in 2 and 4
   parts against DuckDB's one join of the same two tables, ``--join-rows`` rows a side:
   wall and driver CPU medians, and the driver's partitioning time.

    .venv/bin/python benchmarks/scale.py                       # everything (~5-10 min)
    .venv/bin/python benchmarks/scale.py --n 20000 --queries 100 --skip-tpch   # quick

Servers (part 3): `scripts/services up`; `set -a && . .services/env && set +a`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    print(f"\n{title}")
    cells = [header, *[[c if isinstance(c, str) else f"{c:,.3g}" for c in r] for r in rows]]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def ray_pids(cluster) -> list[int]:
    """The started node's processes and their children (workers)."""
    pids = set(cluster.pids)
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    parent = {}
    for line in out.splitlines()[1:]:
        a, b = line.split()
        parent[int(a)] = int(b)
    grown = True
    while grown:
        new = {p for p, pp in parent.items() if pp in pids and p not in pids}
        grown = bool(new)
        pids |= new
    return sorted(pids)


# ---------------------------------------------------------------- 1. Ray's own costs


def ray_costs(cluster) -> dict[str, float]:
    import ray

    @ray.remote(num_cpus=1)
    def echo(x):
        return x

    @ray.remote(num_cpus=0)
    class Echo:
        def f(self, x):
            return x

    ray.get(echo.remote(0))
    time.sleep(2)  # let pre-started workers settle
    idle = rss_mb(ray_pids(cluster))
    rt = []
    for i in range(100):
        t0 = time.perf_counter()
        ray.get(echo.remote(i))
        rt.append((time.perf_counter() - t0) * 1e3)
    actors = [Echo.remote() for _ in range(4)]
    ray.get([a.f.remote(0) for a in actors])
    art, sg = [], []
    for i in range(200):
        t0 = time.perf_counter()
        ray.get(actors[0].f.remote(i))
        art.append((time.perf_counter() - t0) * 1e3)
    for i in range(200):
        t0 = time.perf_counter()
        ray.get([a.f.remote(i) for a in actors])
        sg.append((time.perf_counter() - t0) * 1e3)
    t = pa.table({"a": np.arange(1_000_000), "b": np.random.default_rng(0).random(1_000_000)})
    mv = []
    for _ in range(10):
        t0 = time.perf_counter()
        ray.get(echo.remote(t))
        mv.append((time.perf_counter() - t0) * 1e3)
    for a in actors:
        ray.kill(a)
    out = {
        "start_s": cluster.start_seconds,
        "idle_mb": idle,
        "task_p50_ms": pct(rt, 50),
        "task_p99_ms": pct(rt, 99),
        "actor_p50_ms": pct(art, 50),
        "actor_p99_ms": pct(art, 99),
        "scatter4_p50_ms": pct(sg, 50),
        "scatter4_p99_ms": pct(sg, 99),
        "arrow16mb_p50_ms": pct(mv, 50),
    }
    table(
        "Ray's own costs (local cluster, 2 CPUs)",
        ["measure", "value"],
        [
            ["cluster start (s)", out["start_s"]],
            ["idle memory of its processes (MB RSS)", out["idle_mb"]],
            [
                "task round trip p50 / p99 (ms)",
                f"{out['task_p50_ms']:.2f} / {out['task_p99_ms']:.2f}",
            ],
            ["actor call p50 / p99 (ms)", f"{out['actor_p50_ms']:.2f} / {out['actor_p99_ms']:.2f}"],
            [
                "scatter/gather over 4 actors p50 / p99 (ms)",
                f"{out['scatter4_p50_ms']:.2f} / {out['scatter4_p99_ms']:.2f}",
            ],
            ["16 MB Arrow table there and back p50 (ms)", out["arrow16mb_p50_ms"]],
        ],
    )
    return out


# ---------------------------------------------------------------- 2. retrieval


def retrieval(args, cluster, costs) -> None:
    from fabric.ray.shards import ShardedDataset
    from indexes.dataset import Dataset

    rng = np.random.default_rng(7)
    centers = rng.standard_normal((32, args.dim)).astype(np.float32) * 3
    vecs = (centers[rng.integers(0, 32, args.n)] + rng.standard_normal((args.n, args.dim))).astype(
        np.float32
    )
    queries = (
        centers[rng.integers(0, 32, args.queries)] + rng.standard_normal((args.queries, args.dim))
    ).astype(np.float32)
    schema = pa.schema(
        [pa.field("id", pa.int64()), pa.field("vec", pa.list_(pa.float32(), args.dim))]
    )
    data = pa.table(
        {
            "id": pa.array(np.arange(args.n), pa.int64()),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), args.dim),
        },
        schema=schema,
    )
    indexes = {"vec": {"kind": "hnsw", "metric": "l2"}}
    k = 10
    rows: list[list[object]] = []
    parts: dict[int, dict[str, list[float]]] = {}
    lat: dict[str, list[float]] = {}

    def bench(name: str, search) -> None:
        for q in queries[:10]:
            search(q)  # warm
        xs = []
        for q in queries:
            t0 = time.perf_counter()
            search(q)
            xs.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(search, queries))
        conc = len(queries) / (time.perf_counter() - t0)
        lat[name] = xs
        rows.append([name, pct(xs, 50), pct(xs, 95), pct(xs, 99), 1e3 / np.mean(xs), conc])

    log(f"retrieval: local dataset, {args.n:,} x {args.dim}-d, building HNSW")
    t0 = time.perf_counter()
    local = Dataset.create("vecs", schema, "id", indexes, background_fold=False)
    local.upsert(data)
    local.flush()
    build = {"local": time.perf_counter() - t0}
    mem = {"local": sum(local.nbytes().values()) / 1e6}
    bench("local", lambda q: local.search("vec", q, k, columns=["id"]))
    truth = [local.search("vec", q, k, columns=["id"], strategy="exact")[0] for q in queries[:50]]
    recall: dict[str, float] = {}

    def recall_of(search) -> float:
        hit = 0
        for q, t in zip(queries[:50], truth):
            got = set(search(q)["id"].to_pylist())
            hit += len(got & set(t["id"].to_pylist()))
        return hit / (50 * k)

    recall["local"] = recall_of(lambda q: local.search("vec", q, k, columns=["id"])[0])
    local_p50 = pct(lat["local"], 50)
    local.close()
    for n in args.shards:
        log(f"retrieval: {n} shard(s), building")
        with tempfile.TemporaryDirectory(prefix="fabric-scale-") as tmp:
            ds = ShardedDataset(cluster, "vecs", schema, "id", indexes, shards=n, state_dir=tmp)
            t0 = time.perf_counter()
            ds.upsert(data)
            ds.flush()
            build[f"{n} shards"] = time.perf_counter() - t0
            mem[f"{n} shards"] = max(ds.nbytes()) / 1e6

            def search(q, ds=ds):
                return ds.search("vec", q, k, columns=["id"])

            bench(f"{n} shards", search)
            # the model's pass, interleaved query by query so all three see the same load:
            # the search (wall, each shard's own time), a no-op scatter/gather, and one
            # whose shards keep their CPU busy as long as the local search's median
            m = parts[n] = {"wall": [], "S": [], "maxS": [], "noop": [], "busy_o": []}
            for q in queries:
                t0 = time.perf_counter()
                ds.search("vec", q, k, columns=["id"])
                wall = (time.perf_counter() - t0) * 1e3
                m["wall"].append(wall)
                m["S"].extend(ds.last_shard_ms)
                m["maxS"].append(max(ds.last_shard_ms))
                t0 = time.perf_counter()
                ds.ping("vec", q, k, columns=["id"])
                m["noop"].append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                inner = ds.ping("vec", q, k, columns=["id"], busy_ms=local_p50)
                m["busy_o"].append((time.perf_counter() - t0) * 1e3 - max(inner))
            recall[f"{n} shards"] = recall_of(search)
            ds.close()
    base = rows[0]
    table(
        f"Retrieval: top-{k} of {args.n:,} x {args.dim}-d (HNSW, l2), {args.queries} queries",
        [
            "mode",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "qps 1 client",
            f"qps {args.clients} clients",
            "p50 / local",
            "recall@10",
            "build s",
            "MB per shard",
        ],
        [
            [*r, r[1] / base[1], recall[r[0]], build[r[0]], mem.get(r[0], float("nan"))]
            for r in rows
        ],
    )
    model(args, parts, cluster.cpus(), costs)


def model(args, parts, cores: int, costs: dict[str, float]) -> None:
    """The fan-out model (docs/scale.md), its two parts measured apart in one interleaved
    pass: a query's latency T(N) = o(N) + max(S_1 .. S_N), S_i a shard's own search time
    (timed inside the actor), o(N) the rest (wall - the slowest shard's S). Predicted
    from what does not contain the answer:

    - max S: the max of N draws from the 1-shard run's S, times the waves the N shards
      run in on ``cores`` CPUs (ceil(N / cores): shards beyond the cores wait for one);
    - o(N): the same scatter/gather over the same N actors with each shard only keeping
      its CPU busy as long as the local search's median (``ShardedDataset.ping``).
    """
    if 1 not in parts:
        return
    one = np.asarray(parts[1]["S"])
    sim = np.random.default_rng(1)

    def slowest(n: int) -> np.ndarray:
        return sim.choice(one, size=(20000, n)).max(axis=1)

    rows, pred = [], []
    for n in args.shards:
        m = parts[n]
        waves = -(-n // cores)
        o = np.asarray(m["wall"]) - np.asarray(m["maxS"])
        rows.append(
            [
                f"{n} shards",
                pct(m["S"], 50),
                pct(m["S"], 99),
                pct(m["maxS"], 50),
                float(np.median(slowest(n))),
                waves,
                float(np.median(o)),
                pct(m["noop"], 50),
                pct(m["busy_o"], 50),
            ]
        )
        draws = waves * slowest(n) + sim.choice(np.asarray(m["busy_o"]), size=20000)
        p50, p99 = np.percentile(draws, 50), np.percentile(draws, 99)
        m50, m99 = pct(m["wall"], 50), pct(m["wall"], 99)
        pred.append([f"{n} shards", p50, m50, 100 * (p50 - m50) / m50, p99, m99])
    table(
        "Fan-out parts (ms), one interleaved pass: S = a shard's own search time; "
        "o = wall - max S; no-op / busy = the same scatter/gather without a search "
        "(busy: each shard spins the local search's median)",
        [
            "mode",
            "S p50",
            "S p99",
            "max S p50",
            "max of N 1-shard S p50",
            "waves",
            "o p50",
            "no-op p50",
            "busy o p50",
        ],
        rows,
    )
    table(
        f"Fan-out model vs measured (ms): waves x max of N 1-shard S + busy o ({cores} CPUs)",
        ["mode", "pred p50", "meas p50", "error %", "pred p99", "meas p99"],
        pred,
    )
    # 10^9 vectors over N machines: a machine per shard (waves = 1), S scaled by the log of
    # the rows per shard, o(N) = a + b N fitted (least squares) on ping's overhead at the
    # shard counts measured here (b: the driver's cost per shard, sending a call and
    # decoding an answer, one after the other) + the network's round trip (not measured)
    ns = np.asarray(args.shards, float)
    b, a = np.polyfit(ns, [float(np.median(parts[n]["busy_o"])) for n in args.shards], 1)
    big = []
    for n in (16, 64, 256):
        scale = np.log(1e9 / n) / np.log(args.n)
        draws = scale * slowest(n) + sim.choice(np.asarray(parts[1]["busy_o"]), size=20000)
        draws += a + b * n - float(np.median(parts[1]["busy_o"]))
        big.append(
            [
                n,
                f"{1e9 / n / 1e6:.1f}M",
                scale,
                float(np.percentile(one, 100 * 0.5 ** (1 / n))),
                float(np.median(scale * slowest(n))),
                a + b * n,
                np.percentile(draws, 50),
                np.percentile(draws, 99),
            ]
        )
    table(
        f"10^9 vectors over N machines, predicted (ms): S from the 1-shard run x log(rows) "
        f"ratio, o(N) = {a:.2f} + {b:.2f} N (fitted on ping's overhead) + network round trip; "
        f"actor call p50 here {costs['actor_p50_ms']:.2f} ms",
        [
            "N",
            "rows/shard",
            "S scale",
            "shard's 0.5^(1/N) quantile",
            "max S p50",
            "o(N)",
            "pred p50",
            "pred p99",
        ],
        big,
    )


# ---------------------------------------------------------------- 3. federated


def federated(args, cluster) -> None:
    import fabric
    from benchmarks.tpch import harness as H
    from benchmarks.tpch import load
    from benchmarks.tpch.queries import QUERIES, Vocab
    from fabric.ray.join import RayJoins
    from fabric.ray.scan import RayScans

    data = load.prepare(args.sf)
    local = H.open_fabric(data)
    on_ray = fabric.open(
        str(H.CONFIG), ingest=False, watch=False, executor={"kind": "ray", "min_rows": 0}
    )
    vocab = Vocab.of(data.tables)
    rows = []
    try:
        for name in args.tpch.split(","):
            q = QUERIES[name]
            session = H.session_values(name, q.params(args.sf, None, vocab))
            cl, cr = H.compile_binding(local, name), H.compile_binding(on_ray, name)
            modes = [("local", local, cl, None, False)] + [
                (f"ray {w} task(s)", on_ray, cr, w, False) for w in args.workers
            ]
            if args.joins:  # and every eligible join as partitioned tasks (fabric.ray.join)
                modes += [(f"ray {w} + joins on ray", on_ray, cr, w, True) for w in args.workers]
            ref = None
            base = None
            default_joins = on_ray.catalog.executor.joins
            for label, fab, comp, w, on_joins in modes:
                if w is not None:
                    on_ray.catalog.executor.scans = RayScans(cluster, min_rows=0, tasks=w)
                    on_ray.catalog.executor.joins = (
                        RayJoins(cluster, min_rows=0, tasks=max(2, w))
                        if on_joins
                        else default_joins
                    )
                try:
                    res = H.run_binding(fab, comp, session)  # warm (and the answer)
                except Exception as e:  # a timeout on a loaded machine: say so, go on
                    rows.append([name, label, f"failed: {str(e)[:60]}", "", "", "", ""])
                    continue
                if ref is None:
                    ref = res.table
                elif not res.table.equals(ref):
                    raise AssertionError(f"{name} {label}: a different table than local mode")
                xs = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    H.run_binding(fab, comp, session)
                    xs.append((time.perf_counter() - t0) * 1e3)
                p50 = pct(xs, 50)
                base = base or p50
                tasks = sum(s.get("ray", {}).get("tasks", 0) for s in res.stats["sources"].values())
                on_ray_joins = ""
                if on_joins:
                    plan = H.run_binding(fab, comp, session, analyze=True).explain or ""
                    on_ray_joins = plan.count("ray: partitioned hash join")
                rows.append(
                    [
                        name,
                        label,
                        p50,
                        pct(xs, 95),
                        1e3 / np.mean(xs),
                        p50 / base,
                        tasks,
                        on_ray_joins,
                    ]
                )
    finally:
        on_ray.close()
        local.close()
    table(
        f"Federated: TPC-H SF {args.sf} (lineitem in S3, orders/customer in MariaDB, ...), "
        f"{args.repeat} runs each, tables equal to local mode",
        ["query", "mode", "p50 ms", "p95 ms", "qps", "p50 / local", "scan tasks", "joins on ray"],
        rows,
    )


def joins(args, cluster) -> None:
    """A partitioned hash join on Ray (fabric.ray.join) against DuckDB's one join of the
    same two Arrow tables, as a DuckDB region runs it; interleaved, ``--repeat`` rounds."""
    import duckdb

    from fabric.ray.join import RayJoins

    rng = np.random.default_rng(16)
    rows = []
    for n in args.join_rows:
        left = pa.table(
            {
                "l.k": pa.array(rng.integers(0, n, n), pa.int64()),
                "l.v": pa.array(rng.standard_normal(n)),
                "l.w": pa.array(rng.integers(0, 100, n), pa.int64()),
            }
        )
        right = pa.table(
            {"r.k": pa.array(rng.permutation(n), pa.int64()), "r.x": pa.array(rng.random(n))}
        )
        on = '"l.k" = "r.k"'
        ray_joins = {w: RayJoins(cluster, min_rows=0, tasks=w) for w in args.workers if w > 1}

        def local(left=left, right=right, on=on):
            con = duckdb.connect()
            con.register("__fabric_l", left)
            con.register("__fabric_r", right)
            out = con.sql(f"SELECT * FROM __fabric_l JOIN __fabric_r ON {on}").to_arrow_table()
            con.close()
            return out, None

        ways = [("duckdb, one join", local)] + [
            (
                f"ray, {w} parts",
                lambda j=j, left=left, right=right, on=on: j.join(
                    left, right, [("l.k", "r.k")], "inner", on, []
                ),
            )
            for w, j in ray_joins.items()
        ]
        wall: dict[str, list[float]] = {w: [] for w, _ in ways}
        cpu: dict[str, list[float]] = {w: [] for w, _ in ways}
        extra: dict[str, list[float]] = {w: [] for w, _ in ways}
        size = None
        for r in range(args.repeat + 1):  # the first round warms (workers, imports)
            for name, fn in ways[r % len(ways) :] + ways[: r % len(ways)]:
                c0, t0 = time.process_time(), time.perf_counter()
                out, info = fn()
                t, c = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
                if size is None:
                    size = out.num_rows
                assert out.num_rows == size, (name, out.num_rows, size)
                if r:
                    wall[name].append(t)
                    cpu[name].append(c)
                    if info is not None:
                        extra[name].append(info["partition_ms"])
        base = pct(wall["duckdb, one join"], 50)
        mb = (left.nbytes + right.nbytes) / 2**20
        for name, _ in ways:
            p50 = pct(wall[name], 50)
            part = pct(extra[name], 50) if extra[name] else 0.0
            rows.append([f"{n:,}", f"{mb:.0f}", name, p50, pct(cpu[name], 50), part, p50 / base])
    table(
        f"Join: {args.repeat} interleaved rounds, both sides n rows (int64 key), inner, "
        f"{size:,} rows out at the last n; load {os.getloadavg()[0]:.1f}",
        ["n", "MB in", "way", "p50 ms", "driver CPU ms", "partitioning ms", "p50 / duckdb"],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--shards", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--sf", type=float, default=0.01)
    ap.add_argument("--tpch", default="q01,q03,q06,q10,q12")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--skip-tpch", action="store_true")
    ap.add_argument("--skip-retrieval", action="store_true")
    ap.add_argument("--joins", action="store_true", help="the partitioned join part")
    ap.add_argument(
        "--join-rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[200_000, 1_000_000, 2_000_000],
    )
    ap.add_argument("--skip-costs", action="store_true")
    args = ap.parse_args()
    from fabric.ray import cluster as C

    log(f"starting a local Ray cluster ({args.num_cpus} CPUs); load {os.getloadavg()[0]:.1f}")
    cluster = C.acquire(ROOT / ".fabric" / "ray", num_cpus=args.num_cpus)
    try:
        costs = {} if args.skip_costs else ray_costs(cluster)
        if not args.skip_retrieval:
            retrieval(args, cluster, costs)
        if not args.skip_tpch:
            federated(args, cluster)
        if args.joins:
            joins(args, cluster)
    finally:
        C.release(cluster)
    log(f"done; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
