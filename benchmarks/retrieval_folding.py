"""The background folder under a query pass: how fast it catches up, per setting.

Right after a bulk upsert the growing segment holds tens of thousands of rows that every
query scans exactly until the folder has inserted them into the HNSW graph. While
queries run the folder yields to them; this measures how fast it still catches up.

Per round, one fresh copy of the cached dataset (``benchmarks/retrieval.py``'s
``retrieval-v2-<n>``, loaded from disk: same graph every round), ``--m`` fresh rows
upserted in 10k batches, then a query pass of ``--queries`` searches (the optimizer,
guards on, cycling over four points: none, uncorr 1 %, anti 10 %, rnd10%&anti10%) issued
back to back from one thread while the folder works, then the rest folded with no
queries. Variants run in rotating order, round by round, in one process:

- ``nice5``: while a search ran in the last 50 ms the folder inserts chunks of
  ``fold_yield_ms`` = 2 ms (then rests half as long), its thread at nice +5 (the folder
  before a59d02c);
- ``yield10``: chunks of 10 ms while queries run (``fold_yield_ms = fold_lock_ms``), nice +5;
- ``nice0``: 2 ms chunks, the folder thread at nice 0 (``indexes.dataset.FOLDER_NICE``,
  the default now: the niceness counts against every process on the machine, not only
  this one's writers).

Printed per variant: the upsert's time, rows folded per second during the pass, growing
rows left after it, time to fold the rest (up to ``--rest-timeout``) and what is left, query p50 / p90 and recall@10 (numpy truth over all rows);
medians over the rounds and each variant / nice5.

    .venv/bin/python benchmarks/retrieval_folding.py                    # 20k + 30k rows, 3 rounds
    .venv/bin/python benchmarks/retrieval_folding.py --m 20000 --queries 600 --rounds 2 --rest-timeout 90
    .venv/bin/python benchmarks/retrieval_folding.py --n 50000 --m 50000 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import retrieval as rb  # benchmarks/retrieval.py: data, points, truth

from indexes import dataset as dataset_mod

POINTS = ("none (100%)", "uncorr 1.00%", "anti 10%", "rnd10%&anti10%")


VARIANTS = {  # name -> (fold_yield_ms, the folder thread's niceness)
    "nice5": (2.0, 5),
    "yield10": (10.0, 5),
    "nice0": (2.0, 0),
}


def one_round(variant: str, args: argparse.Namespace, fresh, qs, pts, gts) -> dict:
    yield_ms, nice = VARIANTS[variant]
    dataset_mod.FOLDER_NICE = nice  # read when the folder thread starts (first upsert)
    ds, _, _ = rb.build(args.n, args.cache)  # loaded from the cache: the same graph
    ds.fold_yield_ms = yield_ms
    for vi in ds.vectors.values():
        vi.fold_rows = 2048
    t = time.perf_counter()
    for s0 in range(0, args.m, 10_000):
        ds.upsert(fresh.slice(s0, 10_000))
    up_s = time.perf_counter() - t
    g0 = ds.growing()
    lat, rec = [], []
    t0 = time.perf_counter()
    for i in range(args.queries):
        j = i % len(pts)
        qi = (i // len(pts)) % len(qs)
        where = pts[j].where
        t = time.perf_counter()
        res, _ = ds.search("emb", qs[qi], rb.K, where, {}, columns=["id"])
        lat.append((time.perf_counter() - t) * 1e3)
        rec.append(rb.recall(res.column("id").to_numpy(), gts[j][qi]))
    pass_s = time.perf_counter() - t0
    g1 = ds.growing()
    t = time.perf_counter()
    ds.wait_folded(args.rest_timeout)
    rest_s = time.perf_counter() - t
    left = ds.growing()
    ds.close()
    return {
        "upsert_s": up_s,
        "growing0": g0,
        "growing1": g1,
        "pass_s": pass_s,
        "folded_per_s": (g0 - g1) / pass_s,
        "rest_s": rest_s,
        "left": left,
        "p50": float(np.median(lat)),
        "p90": float(np.percentile(lat, 90)),
        "recall": float(np.mean(rec)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="rows in the graph (cached dataset)")
    ap.add_argument("--m", type=int, default=30_000, help="fresh rows upserted before the pass")
    ap.add_argument("--queries", type=int, default=400, help="searches in the query pass")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per variant")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/fabric/bench"))
    ap.add_argument("--rest-timeout", type=float, default=900, help="s to wait for the rest")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = ap.parse_args()
    names = args.variants.split(",")
    ds, a, took = rb.build(args.n, args.cache)
    ds.close()
    print(f"dataset {args.n} rows ({'loaded in' if took < 0 else 'built in'} {abs(took):.1f} s)")
    b, fresh = rb.make_rows(args.m, start=args.n, seed=3)
    a2 = {c: np.concatenate([a[c], b[c]]) for c in a}
    x2 = a2["x"]
    sq = np.einsum("ij,ij->i", x2, x2)
    qs, _ = rb.mixture(50, 99, rb.QUERY_CLUSTERS)
    pts = [p for p in rb.points(a2, args.n) if p.name in POINTS]
    gts = [rb.truth(x2, sq, qs, p.mask) for p in pts]
    runs: dict[str, list[dict]] = {v: [] for v in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
        for v in order:
            load = os.getloadavg()[0]
            out = one_round(v, args, fresh, qs, pts, gts)
            out["load"] = load
            runs[v].append(out)
            print(
                f"round {r} {v:<14} load {load:5.1f} | upsert {out['upsert_s']:.1f} s | growing {out['growing0']}->{out['growing1']}"
                f" in a {out['pass_s']:.1f} s pass ({out['folded_per_s']:.0f} rows/s) | rest"
                f" {out['rest_s']:.1f} s ({out['left']} left) | query p50 {out['p50']:.2f} ms"
                f" p90 {out['p90']:.2f} ms recall {out['recall']:.3f}",
                flush=True,
            )
    keys = ("folded_per_s", "growing1", "rest_s", "left", "p50", "p90", "recall", "upsert_s")
    print(f"\nmedians over {args.rounds} rounds (n={args.n}, m={args.m}, {args.queries} queries):")
    print("| variant | rows folded/s during the pass | growing after it | then folding the rest, s "
          "| still growing | query p50 ms | p90 ms | recall@10 | upsert s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    med = {v: {k: float(np.median([o[k] for o in runs[v]])) for k in keys} for v in runs}
    for v in runs:
        m = med[v]
        print(
            f"| {v} | {m['folded_per_s']:.0f} | {m['growing1']:.0f} | {m['rest_s']:.1f} "
            f"| {m['left']:.0f} | {m['p50']:.2f} | {m['p90']:.2f} | {m['recall']:.3f} "
            f"| {m['upsert_s']:.1f} |"
        )
    if "nice5" in med:
        f = med["nice5"]
        for v in names:
            if v == "nice5":
                continue
            ad = med[v]
            print(
                f"| {v} / nice5 | {ad['folded_per_s'] / max(f['folded_per_s'], 1e-9):.2f}x "
                f"| {ad['growing1'] / max(f['growing1'], 1):.2f}x "
                f"| {ad['rest_s'] / max(f['rest_s'], 1e-9):.2f}x | "
                f"| {ad['p50'] / f['p50']:.2f}x | {ad['p90'] / f['p90']:.2f}x | "
                f"| {ad['upsert_s'] / max(f['upsert_s'], 1e-9):.2f}x |"
            )


if __name__ == "__main__":
    main()
