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
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
# the repo root first: benchmarks/connectors.py must not shadow the connectors package
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

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
    args = ap.parse_args()
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
