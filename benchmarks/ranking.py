"""BM25 and hybrid (RRF) ranking over an indexed dataset: what the statistics cost at
ingest, and query latency per strategy (issue 12).

    .venv/bin/python benchmarks/ranking.py [--n 100000] [--queries 200]

Corpus: n documents of 8-40 words drawn from a Zipf law over a 20,000-word vocabulary
(so query terms range from very common to rare), a 64-d vector per document from a
32-cluster mixture, a btree ``cl`` (cluster) and ``ts``. Prints:

* inverted-index build time for the corpus, with the BM25 statistics (this tree) and
  without them (the index as it was before, re-created from git for the comparison);
* p50 / p95 ms per query kind: keyword only, keyword + a 10 % filter (each strategy
  forced, and the optimizer's choice), the vector arm alone, hybrid RRF (+ recency),
  and the hybrid through ``fab.query``; every keyword answer is checked against an exact
  numpy BM25 over the same rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsl.ast import Column, InList, Literal
from indexes import Dataset, IndexSpec
from indexes.inverted import InvertedIndex
from indexes.ranking import Fusion, bm25, keyword_search, query_tokens, rank, top

DIM = 64
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def corpus(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(20_000)])
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    p /= p.sum()
    lens = rng.integers(8, 41, n)
    words = vocab[rng.choice(len(vocab), int(lens.sum()), p=p)]
    offs = np.concatenate([[0], np.cumsum(lens)])
    bodies = [" ".join(words[offs[i] : offs[i + 1]]) for i in range(n)]
    cl = rng.integers(0, 32, n)
    centers = rng.standard_normal((32, DIM)).astype(np.float32)
    x = centers[cl] + 0.3 * rng.standard_normal((n, DIM)).astype(np.float32)
    return pa.table(
        {
            "id": pa.array(np.arange(n), pa.int64()),
            "ts": pa.array(
                [T0 + dt.timedelta(seconds=int(i)) for i in range(n)], pa.timestamp("us", tz="UTC")
            ),
            "cl": pa.array(cl, pa.int64()),
            "body": pa.array(bodies),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
        }
    )


def old_inverted():
    """The inverted index before BM25 statistics (git), for the ingest comparison."""
    src = subprocess.run(
        ["git", "show", "6285447~1:indexes/inverted.py"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if src.returncode:
        return None
    path = os.path.join(tempfile.mkdtemp(), "old_inverted.py")
    with open(path, "w") as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location("old_inverted", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.InvertedIndex


def build_ms(cls, body: pa.ChunkedArray, batch: int) -> float:
    best = 1e18
    for _ in range(3):
        inv = cls("body", pa.string())
        t0 = time.perf_counter()
        for s in range(0, len(body), batch):
            inv.add(np.arange(s, min(s + batch, len(body))), body.slice(s, batch))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def pct(xs: list[float]) -> str:
    a = np.array(xs)
    return f"{np.percentile(a, 50):8.3f} {np.percentile(a, 95):8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=200)
    args = ap.parse_args()
    t = corpus(args.n)
    body = t.column("body")
    print(f"corpus: {args.n} docs, {sum(len(b.split()) for b in body.to_pylist())} tokens")
    old = old_inverted()
    for batch in (10_000, 500):
        new_ms = build_ms(InvertedIndex, body, batch)
        old_ms = build_ms(old, body, batch) if old is not None else float("nan")
        print(
            f"inverted build, batches of {batch}: {new_ms:.0f} ms with BM25 statistics, "
            f"{old_ms:.0f} ms without ({new_ms / old_ms:.2f}x)"
        )

    ds = Dataset(
        "bench",
        t.schema,
        "id",
        {
            "emb": IndexSpec("hnsw", metric="l2", ef=64),
            "body": "inverted",
            "cl": "btree",
            "ts": "btree",
        },
    )
    t0 = time.perf_counter()
    for s in range(0, args.n, 20_000):
        ds.upsert(t.slice(s, 20_000))
    ds.flush()
    print(f"dataset load + graph: {time.perf_counter() - t0:.1f} s")
    inv = ds.inverted["body"]
    rng = np.random.default_rng(1)
    vocab_by_df = sorted(inv.postings, key=lambda w: -len(inv.postings[w]))
    qs = []
    for _ in range(args.queries):
        nterms = int(rng.integers(1, 4))
        # one term from the 200 most common, the others from anywhere
        terms = [vocab_by_df[int(rng.integers(0, 200))]]
        terms += [vocab_by_df[int(rng.integers(0, len(vocab_by_df)))] for _ in range(nterms - 1)]
        qs.append(" ".join(terms))
    vecs = rng.standard_normal((args.queries, DIM)).astype(np.float32)
    filt = InList(Column("cl"), tuple(Literal(c, "int") for c in (1, 5, 9)), False)  # ~9 %
    allowed = np.isin(t.column("cl").to_numpy(), [1, 5, 9])

    # exactness: every answer equals numpy's BM25 over all scored rows
    for q in qs[:20]:
        _ids, scores, _ = keyword_search(ds, "body", q, 10, None, {})
        all_ids, all_s = bm25(inv, query_tokens(q))
        _ref_ids, ref_s = top(all_ids, all_s, 10)
        assert np.allclose(scores, ref_s), q
        _ids_f, s_f, _ = keyword_search(ds, "body", q, 10, filt, {})
        m = allowed[all_ids]
        assert np.allclose(s_f, top(all_ids[m], all_s[m], 10)[1]), q

    rows = []
    times: dict[str, list[float]] = {}
    chosen: dict[str, int] = {}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    fusion = Fusion(recency="ts", half_life_s=86400.0)
    for q, v in zip(qs, vecs):
        with ds.lock.read():
            timed("keyword, no filter", lambda q=q: keyword_search(ds, "body", q, 10, None, {}))
            for st in ("prefilter", "postfilter"):
                timed(
                    f"keyword + 9% filter, {st}",
                    lambda q=q, st=st: keyword_search(ds, "body", q, 10, filt, {}, strategy=st),
                )
            info = timed(
                "keyword + 9% filter, chosen",
                lambda q=q: keyword_search(ds, "body", q, 10, filt, {}),
            )[2]
            chosen[info.chosen] = chosen.get(info.chosen, 0) + 1
        timed("vector arm alone (k=20)", lambda v=v: ds.search("emb", v, 20, None, columns=["id"]))
        timed(
            "hybrid rrf (20 + 20 -> 10)",
            lambda q=q, v=v: rank(
                ds,
                vector=("emb", v, 20),
                text=("body", q, 20),
                fusion=Fusion(limit=10),
                columns=["id"],
            ),
        )
        timed(
            "hybrid rrf + recency + 9% filter",
            lambda q=q, v=v: rank(
                ds,
                vector=("emb", v, 20),
                text=("body", q, 20),
                fusion=Fusion(limit=10, recency=fusion.recency, half_life_s=fusion.half_life_s),
                where=filt,
                columns=["id"],
            ),
        )
    try:
        import fabric
        from connectors.dataset import DatasetSource

        d = tempfile.mkdtemp()
        with open(os.path.join(d, "b.yaml"), "w") as f:
            f.write(
                f"binding: hy\nsession: {{q: str, v: 'vector[{DIM}]'}}\nsources:\n  n:\n"
                "    from: dataset://bench\n"
                '    nearest: {column: emb, to: "{{session.v}}", k: 20}\n'
                '    search: {column: body, query: "{{session.q}}", k: 20}\n'
                "    rank: {k: 10}\n"
                "select: [n.id, n._score]\n"
            )
        with fabric.open(
            {"bindings": [d]},
            ingest=False,
            watch=False,
            dataset_sources={"bench": DatasetSource("dataset://bench", ds)},
        ) as fab:
            for q, v in zip(qs, vecs):
                timed(
                    "hybrid through fab.query", lambda q=q, v=v: fab.query("hy", {"q": q, "v": v})
                )
    except Exception as e:
        print(f"fab.query run failed: {e}")
    print()
    print(f"| query ({args.queries} queries, 1-3 terms, k=10) | p50 ms | p95 ms |")
    print("|---|---|---|")
    for name, xs in times.items():
        a, b = pct(xs).split()
        rows.append(name)
        print(f"| {name} | {a} | {b} |")
    print(f"\noptimizer's choice under the 9% filter: {chosen}")
    print(f"load average: {os.getloadavg()[0]:.1f}")
    ds.close()


if __name__ == "__main__":
    main()
