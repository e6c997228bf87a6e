"""What ``fab.query`` adds on top of the work it runs (issue #5: end-to-end p50 < 1 ms).

Part 1, one indexed dataset (``--n`` 50,000 x 128-d, hnsw + btree + inverted, built and
cached by ``benchmarks/retrieval.py``'s ``build``): for a few predicate points, interleaved
per query, the p50 / p95 of

- ``search``:  ``DatasetSource.search(...)`` alone (the retrieval work);
- ``execute``: ``fabric.execute.execute(plan, params, catalog, binding=...)`` of the
  compiled binding (the executor's overhead on top of ``search``);
- ``query``:   ``fab.query(name, session=...)`` (binding lookup + session check + execute).

Part 2, a two-source join over in-memory tables (``memory://t/a`` join ``memory://t/b``,
order by, limit 10): the multi-source path (units on the shared scan pool, DuckDB join).

    .venv/bin/python benchmarks/query_overhead.py                  # 50k rows, 500 queries
    .venv/bin/python benchmarks/query_overhead.py --n 20000 --queries 200

``--tracing``: only part 3, what tracing (fabric.tracing, issue 18) adds per query on the
seed bindings (nearby_offers: Kafka + MariaDB + Mongo; top_category_last_week: MariaDB +
S3) against the real servers of ``scripts/services``: the same fabric, tracing on
(``fab.catalog.tracer`` set) and off (None) interleaved query by query, p50 / p95 per
binding and the on/off ratio (goal: < 5 % at p50):

    set -a && . .services/env && set +a
    .venv/bin/python benchmarks/query_overhead.py --tracing --queries 200

``--baseline FILE`` adds ``execute(old)``, the same plans run by another version of the
executor module, interleaved with the others (before/after in one run):

    git show 4f5e032~1:fabric/execute/__init__.py > /tmp/old_execute.py
    .venv/bin/python benchmarks/query_overhead.py --baseline /tmp/old_execute.py

``--side-by-side``: only part 4 (issue 12), a ``nearest:`` binding of k=10 over ``--n``
rows (200,000 for the issue's target; per-value graphs of ``cl`` built, so the
anti-correlated filter takes the posting-matrix path) at three points -- unfiltered, 10 %
uncorrelated (``rnd < 0.1``), 10 % anti-correlated (``cl in`` 7 clusters the queries never
come from) -- each query run every way in a random order (interleaved):

- ``hnswlib``: the dataset's own hnswlib graph, ``knn_query`` at ``--ef`` (a numpy mask
  as hnswlib's ``filter=`` callback when filtered);
- ``numpy``: exact distances over the point's candidates, gathered into one contiguous
  matrix before timing (the floor of an exact pre-filter);
- ``search``: ``DatasetSource.search(...)``; ``query``: ``fab.query(name, session=...)``.

p50 and recall@10 per way, ``query/search`` and the median of the per-query differences
``query - search``. ``--baseline-rev REV`` runs the same ``search`` and ``query`` in a
second process over ``git archive REV`` of this repository (its fabric, connectors,
indexes), steered query by query with this one, so before and after are measured in one
run on one machine state (``--rev REV``: ``now`` is ``git archive REV`` too, not this
working tree). ``--baseline FILE`` (an older fabric/execute/__init__.py) adds, in the same
process, ``query(old exec)``: fab.query's steps (binding, session check) with that
executor, interleaved with the rest:

    .venv/bin/python benchmarks/query_overhead.py --side-by-side --n 200000 --queries 300
    .venv/bin/python benchmarks/query_overhead.py --side-by-side --n 200000 --baseline-rev HEAD~3
    git show d61f3f7:fabric/execute/__init__.py > /tmp/old_execute.py
    .venv/bin/python benchmarks/query_overhead.py --side-by-side --n 200000 --baseline /tmp/old_execute.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
# the repo root first: benchmarks/connectors.py must not shadow the connectors package;
# a --baseline-rev worker puts the exported old tree there instead
ROOT = os.environ.get("QUERY_OVERHEAD_ROOT") or os.path.dirname(HERE)
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import fabric  # noqa: E402
from connectors.dataset import DatasetSource  # noqa: E402
from connectors.memory import MemoryConnection  # noqa: E402
from fabric.execute import execute  # noqa: E402

_spec = importlib.util.spec_from_file_location("retrieval", os.path.join(HERE, "retrieval.py"))
retrieval = importlib.util.module_from_spec(_spec)
sys.modules["retrieval"] = retrieval
_spec.loader.exec_module(retrieval)
DIM, K, build, mixture, points = (
    retrieval.DIM,
    retrieval.K,
    retrieval.build,
    retrieval.mixture,
    retrieval.points,
)

POINTS = ("none (100%)", "uncorr 1.00%", "keyword 10.00%", "time1%&kw10%")


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) * 1e3


def write_binding(d: str, name: str, body: str) -> None:
    with open(os.path.join(d, f"{name}.yaml"), "w") as f:
        f.write(body)


def load_baseline(path: str | None):
    """``execute`` of another version of fabric/execute/__init__.py (or None)."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("baseline_execute", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.execute


def dataset_part(n: int, nq: int, cache: str, old=None) -> list[tuple]:
    ds, attrs, took = build(n, cache)
    print(f"dataset: {n:,} x {DIM}-d ({'loaded' if took < 0 else 'built'} in {abs(took):.1f} s)")
    src = DatasetSource("dataset://bench", ds)
    qs, _ = mixture(nq, 7)
    pts = [p for p in points(attrs, n) if p.name in POINTS]
    d = tempfile.mkdtemp(prefix="overhead-bindings-")
    for i, p in enumerate(pts):
        where = f'\n    where: "{p.where}"' if p.where is not None else ""
        write_binding(
            d,
            f"p{i}",
            f"binding: p{i}\nsession:\n  q: vector[{DIM}]\nsources:\n  n:\n"
            f'    from: dataset://bench\n    nearest: {{column: emb, to: "{{{{session.q}}}}", k: {K}}}'
            f"{where}\nselect: [n.id]\n",
        )
    rows = []
    rng = np.random.default_rng(3)
    with fabric.open(
        {"bindings": [d]}, ingest=False, watch=False, dataset_sources={"bench": src}
    ) as fab:
        for i, p in enumerate(pts):
            name = f"p{i}"
            filters = () if p.where is None else (p.where,)
            compiled = fab.binding(name)
            for q in qs[:20]:  # warm up: plan compiled, caches hot
                fab.query(name, session={"q": q})
                src.search("emb", q, K, filters, {}, ["id"])
            lat: dict[str, list[float]] = {"search": [], "execute": [], "query": []}
            if old is not None:
                lat["execute(old)"] = []
            for q in qs:
                for way in rng.permutation(list(lat)):
                    t = time.perf_counter()
                    if way == "search":
                        src.search("emb", q, K, filters, {}, ["id"])
                    elif way == "execute(old)":
                        old(compiled.plan, {"q": q}, fab.catalog, binding=name)
                    elif way == "execute":
                        execute(compiled.plan, {"q": q}, fab.catalog, binding=name)
                    else:
                        fab.query(name, session={"q": q})
                    lat[str(way)].append(time.perf_counter() - t)
            rows.append((p.name, {w: (pct(v, 50), pct(v, 95)) for w, v in lat.items()}))
    return rows


def join_part(nq: int, n: int, old=None) -> dict[str, tuple[float, float]]:
    rng = np.random.default_rng(5)
    conn = MemoryConnection("t")
    conn.add(
        "a",
        pa.table(
            {
                "id": np.arange(n, dtype=np.int64),
                "score": rng.random(n),
                "grp": rng.integers(0, 100, n),
            }
        ),
    )
    conn.add(
        "b",
        pa.table({"a_id": rng.integers(0, n, n).astype(np.int64), "amount": rng.random(n) * 100}),
    )
    d = tempfile.mkdtemp(prefix="overhead-join-")
    write_binding(
        d,
        "join",
        "binding: join\nsession:\n  g: int\nsources:\n  a:\n    from: memory://t/a\n"
        "    where: grp = {{session.g}}\n  b:\n    from: memory://t/b\n"
        "    join: {on: b.a_id = a.id}\n    where: amount > 50\n"
        "select: [a.id, a.score, b.amount]\norder_by: [b.amount desc]\nlimit: 10\n",
    )
    lat: dict[str, list[float]] = {"execute": [], "query": []}
    if old is not None:
        lat["execute(old)"] = []
    with fabric.open({"bindings": [d]}, ingest=False, watch=False, connections={"t": conn}) as fab:
        compiled = fab.binding("join")
        for g in range(20):
            fab.query("join", session={"g": g})
        for i in range(nq):
            g = i % 100
            for way in rng.permutation(list(lat)):
                t = time.perf_counter()
                if way == "execute":
                    execute(compiled.plan, {"g": g}, fab.catalog, binding="join")
                elif way == "execute(old)":
                    old(compiled.plan, {"g": g}, fab.catalog, binding="join")
                else:
                    fab.query("join", session={"g": g})
                lat[str(way)].append(time.perf_counter() - t)
        print(fab.explain("join", {"g": 1}, analyze=True))
    return {w: (pct(v, 50), pct(v, 95)) for w, v in lat.items()}


def tracing_part(nq: int) -> None:
    """Part 3: tracing on vs off, interleaved, on the seed bindings (real servers)."""
    from pathlib import Path

    from crypto import KeyRing
    from examples.seed.data import generate
    from examples.seed.load import drop_loaded, environment, load_all

    spec = importlib.util.spec_from_file_location("bench_service", os.path.join(HERE, "service.py"))
    svc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(svc)
    prefix = f"bench_trace_{os.getpid()}"
    env = environment(prefix)
    env["FABRIC_LOCATION_TOPIC"] = f"{prefix}_locations"
    work = Path(tempfile.mkdtemp(prefix="fabric-bench-trace-"))
    (work / "agent.pub").write_bytes(KeyRing.generate().public_context())
    env["FABRIC_AGENT_PUBLIC_CONTEXT"] = str(work / "agent.pub")
    env["FABRIC_STATE_DIR"] = str(work / "state")
    env["FABRIC_GROUP"] = prefix
    t0 = time.perf_counter()
    load_all(env, generate(users=30, merchants=1000, coupons=3000, orders=5000, news=500))
    config = svc._config(work, env["FABRIC_LOCATION_TOPIC"], "cfg")
    os.environ.update(env)
    fab = fabric.open(config, watch=False)
    try:
        fab.catch_up(60)
        tracer = fab.tracer
        assert tracer is not None, "tracing is on by default"
        import fabric.tracing.spans as spans

        emit, worker = spans.emit, []  # the worker's time per query (spans, attributes, cost)

        def timed_emit(*a: object) -> None:
            w0 = time.thread_time()
            emit(*a)
            worker.append(time.thread_time() - w0)

        spans.emit = timed_emit
        print(f"seed data loaded and fabric opened in {time.perf_counter() - t0:.1f} s")
        bindings = ("nearby_offers", "top_category_last_week")
        lat: dict[str, dict[str, list[float]]] = {b: {"off": [], "on": []} for b in bindings}
        ratios: dict[str, list[float]] = {b: [] for b in bindings}  # on / off of each pair
        for name, session in svc.SESSIONS[:: len(svc.SESSIONS) // 8]:  # warm up
            fab.query(name, session)
        for i in range(nq):
            for name in bindings:
                session = {"user_id": 1 + i % 20}
                pair = {}
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    fab.catalog.tracer = tracer if mode == "on" else None
                    q0 = time.perf_counter()
                    fab.query(name, session, session_id=f"bench-{i % 50}")
                    pair[mode] = time.perf_counter() - q0
                    lat[name][mode].append(pair[mode])
                ratios[name].append(pair["on"] / pair["off"])
        fab.catalog.tracer = tracer
        tracer.flush()
        print(
            f"\ntracing on vs off, interleaved, {nq} queries per binding and mode, ms "
            f"(ring buffer: {len(tracer.ring)} spans, {tracer.errors} worker errors)"
        )
        print(
            f"{'binding':<24} {'off p50':>8} {'on p50':>8} {'ratio':>7} {'off p95':>8} "
            f"{'on p95':>8} {'ratio':>7} {'pairs p50':>10}"
        )
        for name in bindings:
            off, on = lat[name]["off"], lat[name]["on"]
            p50 = (pct(off, 50), pct(on, 50))
            p95 = (pct(off, 95), pct(on, 95))
            paired = float(np.median(ratios[name])) - 1
            print(
                f"{name:<24} {p50[0]:8.3f} {p50[1]:8.3f} {p50[1] / p50[0] - 1:+7.1%} "
                f"{p95[0]:8.3f} {p95[1]:8.3f} {p95[1] / p95[0] - 1:+7.1%} {paired:+10.1%}"
            )
        print(
            "pairs p50: the median of on/off over the interleaved pairs (robust to load drift)\n"
            f"span building CPU per query: p50 {pct(worker, 50):.3f} ms, "
            f"p95 {pct(worker, 95):.3f} ms over {len(worker)} queries (in batches, not while queries run)"
        )
    finally:
        fab.close()
        drop_loaded(env)


SIDE_POINTS = ("none (100%)", "uncorr 10.00%", "anti 10%")


class _Ways:
    """Part 4's measurements in one process (a worker steered by ``side_by_side``): the
    dataset with per-value graphs of ``cl``, one binding per point, the fabric."""

    def __init__(self, n: int, nq: int, cache: str, ef: int, baseline: str | None = None) -> None:
        self.old = load_baseline(baseline)
        ds, attrs, took = build(n, cache)
        ds.set_ef("emb", ef)
        t = time.perf_counter()
        ds.partition("emb", "cl")  # the posting matrices of the anti-correlated point
        ds.flush()
        log(
            f"[{ROOT}] dataset {'loaded' if took < 0 else 'built'} in {abs(took):.1f} s, "
            f"per-value graphs of cl in {time.perf_counter() - t:.1f} s"
        )
        self.ef, self.vi = ef, ds.vectors["emb"]
        self.src = DatasetSource("dataset://bench", ds)
        self.qs, _ = mixture(nq, 7, retrieval.QUERY_CLUSTERS)
        self.pts = [p for p in points(attrs, n) if p.name in SIDE_POINTS]
        x = attrs["x"]
        self.cands = []  # per point: candidate ids, their vectors (contiguous), squared norms
        for p in self.pts:
            ids = np.flatnonzero(p.mask)
            sub = np.ascontiguousarray(x[ids])
            self.cands.append((ids, sub, np.einsum("ij,ij->i", sub, sub)))
        d = tempfile.mkdtemp(prefix="overhead-side-")
        for i, p in enumerate(self.pts):
            where = f'\n    where: "{p.where}"' if p.where is not None else ""
            write_binding(
                d,
                f"p{i}",
                f"binding: p{i}\nsession:\n  q: vector[{DIM}]\nsources:\n  n:\n"
                f"    from: dataset://bench\n"
                f'    nearest: {{column: emb, to: "{{{{session.q}}}}", k: {K}}}'
                f"{where}\nselect: [n.id]\n",
            )
        self.fab = fabric.open(
            {"bindings": [d]}, ingest=False, watch=False, dataset_sources={"bench": self.src}
        )
        for i in range(len(self.pts)):  # warm up: plans compiled, caches hot
            for j in range(min(20, nq)):
                for way in ("hnswlib", "numpy", "search", "query"):
                    self.run(i, j, way)
                if self.old is not None:
                    self.run(i, j, "query(old exec)")

    def run(self, i: int, j: int, way: str) -> tuple[tuple[float, float], list[int]]:
        """((wall seconds, this thread's CPU seconds), the ids found)."""
        p, q = self.pts[i], self.qs[j]
        if way == "search":
            filters = () if p.where is None else (p.where,)
            t, c = time.perf_counter(), time.thread_time()
            table, _ = self.src.search("emb", q, K, filters, {}, ["id"])
            took = (time.perf_counter() - t, time.thread_time() - c)
            return took, table.column("id").to_pylist()
        if way == "query":
            t, c = time.perf_counter(), time.thread_time()
            res = self.fab.query(f"p{i}", session={"q": q})
            took = (time.perf_counter() - t, time.thread_time() - c)
            return took, res.table.column(0).to_pylist()
        if way == "query(old exec)":  # fab.query's steps with the --baseline executor
            t, c = time.perf_counter(), time.thread_time()
            compiled = self.fab.binding(f"p{i}")
            params = compiled.bind({"q": q})
            res = self.old(
                compiled.runnable,
                params,
                self.fab.catalog,
                binding=f"p{i}",
                version=compiled.content_hash,
            )
            took = (time.perf_counter() - t, time.thread_time() - c)
            return took, res.table.column(0).to_pylist()
        if way == "hnswlib":  # row ids are the ids here (one bulk load in id order)
            mask = p.mask
            cb = None if p.where is None else (lambda r: bool(mask[r]))
            self.vi.gate.enter(self.vi.graph, self.ef)  # the graph's ef, as the dataset keeps it
            try:
                t, c = time.perf_counter(), time.thread_time()
                labels, _ = self.vi.graph.knn_query(q, k=K, num_threads=1, filter=cb)
                took = (time.perf_counter() - t, time.thread_time() - c)
            finally:
                self.vi.gate.exit()
            return took, labels[0].tolist()
        ids, sub, sq = self.cands[i]
        t, c = time.perf_counter(), time.thread_time()
        dist = sq - 2.0 * (sub @ q)
        part = np.argpartition(dist, K - 1)[:K]
        top = ids[part[np.argsort(dist[part])]]
        took = (time.perf_counter() - t, time.thread_time() - c)
        return took, top.tolist()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def side_worker(n: int, nq: int, cache: str, ef: int, baseline: str | None) -> None:
    """``--worker``: answer ``[point, query, way]`` lines on stdin with ``[seconds, ids]``."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints of the fabric go to stderr, not into the protocol
    ways = _Ways(n, nq, cache, ef, baseline)
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        i, j, way = json.loads(line)
        out.write(json.dumps(ways.run(i, j, way)) + "\n")
        out.flush()
    ways.fab.close()


def _export(rev: str) -> str:
    """``git archive rev`` of this repository in a temporary directory."""
    d = tempfile.mkdtemp(prefix="overhead-baseline-")
    repo = os.path.dirname(HERE)
    archive = subprocess.run(
        ["git", "-C", repo, "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
    return d


class _Worker:
    def __init__(self, root: str | None, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        if root is not None:
            env["QUERY_OVERHEAD_ROOT"] = root
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--n", str(args.n)]
        cmd += ["--queries", str(args.queries), "--cache", args.cache, "--ef", str(args.ef)]
        if root is None and args.baseline:
            cmd += ["--baseline", os.path.abspath(args.baseline)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a worker failed to start (exit {self.proc.wait()})")

    def run(self, i: int, j: int, way: str) -> tuple[list[float], list[int]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([i, j, way]) + "\n")
        self.proc.stdin.flush()
        took, ids = json.loads(self.proc.stdout.readline())
        return took, ids

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def side_by_side(args: argparse.Namespace) -> None:
    """Part 4: raw hnswlib / numpy, DatasetSource.search and fab.query (and, with
    ``--baseline-rev``, search and query of the old tree) interleaved query by query."""
    attrs, _ = retrieval.make_rows(args.n)
    pts = [p for p in points(attrs, args.n) if p.name in SIDE_POINTS]
    qs, _ = mixture(args.queries, 7, retrieval.QUERY_CLUSTERS)
    x = attrs["x"]
    sq = np.einsum("ij,ij->i", x, x)
    gts = [retrieval.truth(x, sq, qs, p.mask) for p in pts]
    workers = {"now": _Worker(_export(args.rev) if args.rev else None, args)}
    if args.baseline_rev:
        workers["before"] = _Worker(_export(args.baseline_rev), args)
    for w in workers.values():  # one at a time: both load and build on a shared machine
        w.wait_ready()
    tasks = [("now", w) for w in ("hnswlib", "numpy", "search", "query")]
    if "before" in workers:
        tasks += [("before", "search"), ("before", "query")]
    if args.baseline:
        tasks.append(("now", "query(old exec)"))
    rng = np.random.default_rng(11)
    load0 = os.getloadavg()[0]
    res: list[dict[tuple[str, str], tuple[list[list[float]], list[float]]]] = []
    for i in range(len(pts)):
        got: dict[tuple[str, str], tuple[list[list[float]], list[float]]] = {
            t: ([], []) for t in tasks
        }
        for j in range(args.queries):
            for k in rng.permutation(len(tasks)):
                who, way = tasks[k]
                took, ids = workers[who].run(i, j, way)
                got[(who, way)][0].append(took)
                got[(who, way)][1].append(retrieval.recall(np.array(ids), gts[i][j]))
        res.append(got)
    load1 = os.getloadavg()[0]
    for w in workers.values():
        w.close()
    before = "before" in workers
    for col, label in ((0, "wall"), (1, "CPU time of the querying thread")):
        table = [{t: ([x[col] for x in v[0]], v[1]) for t, v in got.items()} for got in res]
        _side_table(args, pts, table, before, label, load0, load1)


def _side_table(
    args: argparse.Namespace,
    pts: list,
    res: list[dict[tuple[str, str], tuple[list[float], list[float]]]],
    before: bool,
    label: str,
    load0: float,
    load1: float,
) -> None:
    print(
        f"\nnearest k={K} over {args.n:,} x {DIM}-d (ef {args.ef}), {args.queries} queries per "
        f"point, every way interleaved per query; p50 ms ({label}) (recall@10); "
        f"load {load0:.1f}-{load1:.1f}" + (f"; before = {args.baseline_rev}" if before else "")
    )
    head = f"{'point':<15} {'hnswlib':>14} {'numpy':>14} {'search':>14} {'fab.query':>14}"
    head += f" {'query/search':>12} {'query-search':>12}"
    if before:
        head += f" | {'search before':>14} {'query before':>14} {'q-s before':>10} {'query now/before':>16}"
    if args.baseline:
        head += f" | {'query(old exec)':>15} {'q-s old exec':>12} {'query/old':>9}"
    print(head)

    def cell(v: tuple[list[float], list[float]]) -> str:
        return f"{np.median(v[0]) * 1e3:7.3f} ({np.mean(v[1]):.3f})"

    for p, got in zip(pts, res):

        def p50(who: str, way: str, got: dict = got) -> float:
            return float(np.median(got[(who, way)][0])) * 1e3

        def paired(who: str, got: dict = got) -> float:  # median over queries of query - search
            q, s = got[(who, "query")][0], got[(who, "search")][0]
            return float(np.median(np.subtract(q, s))) * 1e3

        line = f"{p.name:<15} " + " ".join(
            f"{cell(got[('now', w)]):>14}" for w in ("hnswlib", "numpy", "search", "query")
        )
        line += f" {p50('now', 'query') / p50('now', 'search'):11.2f}x {paired('now'):12.3f}"
        if before:
            line += (
                f" | {cell(got[('before', 'search')]):>14} {cell(got[('before', 'query')]):>14}"
                f" {paired('before'):10.3f} {p50('now', 'query') / p50('before', 'query'):15.2f}x"
            )
        if args.baseline:
            old_qs = float(
                np.median(
                    np.subtract(got[("now", "query(old exec)")][0], got[("now", "search")][0])
                )
            )
            line += (
                f" | {cell(got[('now', 'query(old exec)')]):>15} {old_qs * 1e3:12.3f}"
                f" {p50('now', 'query') / p50('now', 'query(old exec)'):8.2f}x"
            )
        print(line)
    print(
        "query-search: the median over queries of (fab.query - DatasetSource.search) in the "
        "same process; recall@10 against numpy brute force over the filtered rows"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--join-rows", type=int, default=5_000)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fabric/bench"))
    ap.add_argument(
        "--baseline", default=None, help="another fabric/execute/__init__.py to compare"
    )
    ap.add_argument(
        "--tracing", action="store_true", help="only part 3: tracing on vs off (seed bindings)"
    )
    ap.add_argument(
        "--side-by-side",
        action="store_true",
        help="only part 4: hnswlib / numpy / search / fab.query at three points (issue 12)",
    )
    ap.add_argument(
        "--baseline-rev", default=None, help="part 4: also the search and query of git rev REV"
    )
    ap.add_argument(
        "--rev", default=None, help="part 4: measure git rev REV as 'now' (default: this tree)"
    )
    ap.add_argument("--ef", type=int, default=128, help="part 4: HNSW search breadth")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        side_worker(args.n, args.queries, args.cache, args.ef, args.baseline)
        return
    if args.side_by_side:
        side_by_side(args)
        return
    if args.tracing:
        tracing_part(args.queries)
        return
    old = load_baseline(args.baseline)

    rows = dataset_part(args.n, args.queries, args.cache, old)
    print(f"\nsingle-source vector search, {args.queries} queries, k={K}, ms (p50 / p95)")
    print(
        f"{'point':<16} {'search p50':>10} {'p95':>7} {'execute p50':>12} {'p95':>7} "
        f"{'query p50':>10} {'p95':>7} {'query-search':>13} {'ratio':>6}"
        + (f" {'execute(old) p50':>17} {'p95':>7}" if old else "")
    )
    for name, r in rows:
        s, e, q = r["search"], r["execute"], r["query"]
        print(
            f"{name:<16} {s[0]:10.3f} {s[1]:7.3f} {e[0]:12.3f} {e[1]:7.3f} "
            f"{q[0]:10.3f} {q[1]:7.3f} {q[0] - s[0]:13.3f} {q[0] / s[0]:5.2f}x"
            + (f" {r['execute(old)'][0]:17.3f} {r['execute(old)'][1]:7.3f}" if old else "")
        )
    j = join_part(args.queries, args.join_rows, old)
    print(
        f"\ntwo-source join (memory://t/a {args.join_rows:,} rows x memory://t/b {args.join_rows:,} rows, "
        f"DuckDB join + order + limit 10), ms"
    )
    for way, (p50, p95) in j.items():
        print(f"{way:<13} p50 {p50:7.3f}  p95 {p95:7.3f}")


if __name__ == "__main__":
    main()
