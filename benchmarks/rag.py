"""Agent RAG on the finance scenario: multi-hop in one plan vs the agent's usual glue,
a semantic cache replaying a query log, and a rate-limited HTTP API under 8 callers.

Data: the seed scenario's news (``examples.seed.data.generate``: ``--news`` headlines over
8 symbols, published over two days, each tagged with its id) and a second dataset,
``history`` (``--history`` analyst notes per symbol), embedded with the fabric's built-in
``hash`` model (character n-grams, 384-d, fabric/embed.py), both materialized
and indexed by the fabric (HNSW; ``symbol`` inverted). The request (issue 17):

    retrieve the 20 news nearest the question (last day) -> extract their symbols and the
    nearest story's vector -> retrieve the 20 notes nearest that vector on those symbols
    -> aggregate (notes and best distance per symbol)

Three ways, interleaved per question (``--questions``, after ``--warmup``):

- ``fabric, one binding``: one ``fab.query`` of a binding with stages (the hops are
  stages; the second hop's ``nearest.to`` is the first hop's vector);
- ``agent glue, fab.query per hop``: two ``fab.query`` calls with the Python glue
  between them (symbols, seed vector, aggregation in Python);
- ``agent glue, vector DB per hop``: the same steps against a vector database served over
  HTTP by another process (JSON in and out, vectors returned for the first hop, exact
  search in numpy), one round trip per hop, as agents run RAG today.

Every answer is compared with the same steps done exactly in numpy ("answers equal to
exact": symbols, counts and best distances), on the questions where no hop has a tie at
its k-th distance (a top-k cut among ties has no single answer).

Cache replay: a log of ``--log`` questions of which 30 % are near-repeats (cosine 0.97 to
an earlier question) runs through the two-hop binding with ``cache: {similarity: 0.95}``
and without a cache: latency, hit rate, source searches and rows read.

Rate limit: 8 threads call a REST endpoint (``tests/rest_api.py``, a real local HTTP
server) through a connection with ``rate_limit: {per_second: R, burst: 5}`` for
``--seconds``; requests per second as counted by the server, with and without the limit.

    .venv/bin/python benchmarks/rag.py                      # defaults: 2k news, 5k notes
    .venv/bin/python benchmarks/rag.py --news 20000 --history 50000 --questions 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fabric
from examples.seed.data import DIM, SYMBOLS, generate, vector_array
from fabric.embed import hash_embed as _fabric_hash


def hash_embed(texts: list[str]) -> np.ndarray:
    """The fabric's built-in ``hash`` model (character n-grams; fabric/embed.py), 384-d."""
    return np.asarray(_fabric_hash(texts, DIM), dtype=np.float32)


K1, K2 = 20, 20
NOTES = [
    "{s} analyst note: margins expand as cloud revenue grows",
    "{s} guidance cut; supply chain constraints persist",
    "{s} upgraded to buy on AI demand and strong earnings",
    "{s} downgrade: valuation stretched after the rally",
    "{s} buyback and dividend raise signal confidence",
    "{s} faces regulatory probe in the EU; shares under pressure",
    "{s} quarterly earnings beat; market open reaction muted",
    "{s} bond yields weigh on growth names like {s}",
]
WORDS = [
    *("open", "market", "rally", "futures", "fed", "yields"),
    *("dollar", "guidance", "earnings", "tech", "energy", "bell"),
]

FABRIC = """\
datasets:
  news:
    key: id
    schema: {id: str, published_at: timestamp, symbol: str, body: str, embedding: "vector[384]"}
    indexes: {embedding: hnsw, published_at: btree}
  history:
    key: id
    schema: {id: str, symbol: str, body: str, embedding: "vector[384]"}
    indexes: {embedding: hnsw, symbol: inverted}
bindings: [agents/]
"""
TWO_HOP = """\
binding: %(name)s
session: {q: "vector[384]"}
stages:
  hop1:
    sources:
      n:
        from: dataset://news
        nearest: {column: embedding, to: "{{session.q}}", k: 20}
        where: n.published_at > now() - interval '1 day'
    select: [n.id, n.symbol, n.embedding, n._distance as d]
  seed:
    sources: {s: {from: stage://hop1}}
    select: [s.embedding]
    order_by: [s.d, s.id]
    limit: 1
  syms:
    sources: {t: {from: stage://hop1}}
    select: [t.symbol]
sources:
  h:
    from: dataset://history
    where: h.symbol in syms
    nearest: {column: embedding, to: seed.embedding, k: 20}
select: [h.symbol, count(*) as notes, min(h._distance) as best]
group_by: [h.symbol]
order_by: [h.symbol]
%(cache)s
"""
HOP1 = """\
binding: hop1
session: {q: "vector[384]"}
sources:
  n:
    from: dataset://news
    nearest: {column: embedding, to: "{{session.q}}", k: 20}
    where: n.published_at > now() - interval '1 day'
select: [n.id, n.symbol, n.embedding, n._distance as d]
"""
HOP2 = """\
binding: hop2
session: {v: "vector[384]", syms: "list[str]"}
sources:
  h:
    from: dataset://history
    where: h.symbol in {{session.syms}}
    nearest: {column: embedding, to: "{{session.v}}", k: 20}
select: [h.id, h.symbol, h._distance as d]
"""


# ---------------------------------------------------------------- data


def news_table(n: int, seed: int) -> pa.Table:
    """The seed scenario's news, each headline tagged with its id and embedded with the
    fabric's ``hash`` model (the generator's 64 distinct headlines and bag-of-words vectors
    make most distances exact ties, and a top-k cut among ties has no single answer)."""
    news = generate(seed, news=n)["news"]
    bodies = [f"{b} [{i}]" for b, i in zip(news["body"].to_pylist(), news["id"].to_pylist())]
    news = news.set_column(news.schema.get_field_index("body"), "body", pa.array(bodies))
    return news.set_column(
        news.schema.get_field_index("embedding"), "embedding", vector_array(hash_embed(bodies))
    )


def history_table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    syms = rng.choice(SYMBOLS, n)
    bodies = [
        NOTES[int(t)].format(s=s) + " " + " ".join(rng.choice(WORDS, 3)) + f" [h{i}]"
        for i, (t, s) in enumerate(zip(rng.integers(0, len(NOTES), n), syms))
    ]
    return pa.table(
        {
            "id": [f"h{i:07d}" for i in range(n)],
            "symbol": syms,
            "body": bodies,
            "embedding": vector_array(hash_embed(bodies)),
        }
    )


def questions(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    texts = [
        f"how did {rng.choice(SYMBOLS)} trade at the {' '.join(rng.choice(WORDS, 3))}"
        for _ in range(n)
    ]
    return list(hash_embed(texts))


def at_cosine(q: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    r = rng.normal(size=q.shape)
    u = r - (r @ q) * q
    u /= np.linalg.norm(u)
    v = c * q + np.sqrt(1 - c * c) * u
    return (v / np.linalg.norm(v)).astype(np.float32)


# ---------------------------------------------------------------- the vector DB peer


def _vdb_serve(port_q: Any, news: dict[str, Any], hist: dict[str, Any]) -> None:
    """A vector database over HTTP (in its own process): POST /search {collection, vector,
    k, filter: {field: [values]}, since, with_vectors} -> JSON hits, exact in numpy."""
    cols = {"news": news, "history": hist}
    for c in cols.values():
        c["emb"] = np.asarray(c["emb"], dtype=np.float32)
        c["symbol"] = np.asarray(c["symbol"])
        if "ts" in c:
            c["ts"] = np.asarray(c["ts"], dtype=np.float64)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            c = cols[body["collection"]]
            mask = np.ones(len(c["ids"]), dtype=bool)
            for f, vals in (body.get("filter") or {}).items():
                mask &= np.isin(c[f], vals)
            if body.get("since") is not None:
                mask &= c["ts"] > body["since"]
            idx = np.where(mask)[0]
            d = 1.0 - c["emb"][idx] @ np.asarray(body["vector"], dtype=np.float32)
            top = np.lexsort((idx, d))[: body["k"]]
            hits = []
            for j in top:
                i = int(idx[j])
                h = {"id": c["ids"][i], "symbol": str(c["symbol"][i]), "d": float(d[j])}
                if body.get("with_vectors"):
                    h["vector"] = c["emb"][i].tolist()
                hits.append(h)
            raw = json.dumps({"hits": hits}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    port_q.put(srv.server_address[1])
    srv.serve_forever()


class VectorDB:
    def __init__(self, news: pa.Table, hist: pa.Table):
        def cols(t: pa.Table, ts: bool) -> dict[str, Any]:
            out = {
                "ids": t["id"].to_pylist(),
                "symbol": t["symbol"].to_pylist(),
                "emb": np.asarray(t["embedding"].combine_chunks().values).reshape(-1, DIM).tolist(),
            }
            if ts:
                out["ts"] = [x.timestamp() for x in t["published_at"].to_pylist()]
            return out

        q: Any = mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(
            target=_vdb_serve, args=(q, cols(news, True), cols(hist, False)), daemon=True
        )
        self.proc.start()
        port = q.get(timeout=120)
        import http.client

        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def search(self, **body: Any) -> list[dict[str, Any]]:
        raw = json.dumps(body).encode()
        self.conn.request("POST", "/search", raw, {"Content-Type": "application/json"})
        return json.loads(self.conn.getresponse().read())["hits"]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.proc.terminate()


# ---------------------------------------------------------------- the three ways


def answer(rows: list[dict[str, Any]]) -> list[tuple[str, int, float]]:
    return [(r["symbol"], int(r["notes"]), round(float(r["best"]), 5)) for r in rows]


def glue(hop2_rows: list[dict[str, Any]]) -> list[tuple[str, int, float]]:
    notes: Counter[str] = Counter()
    best: dict[str, float] = {}
    for r in hop2_rows:
        notes[r["symbol"]] += 1
        best[r["symbol"]] = min(best.get(r["symbol"], 2.0), float(r["d"]))
    return [(s, notes[s], round(best[s], 5)) for s in sorted(notes)]


def by_fabric(fab: Any, q: np.ndarray) -> list[tuple[str, int, float]]:
    return answer(fab.query("two_hop", {"q": q}).table.to_pylist())


def by_fab_glue(fab: Any, q: np.ndarray) -> list[tuple[str, int, float]]:
    hop1 = fab.query("hop1", {"q": q}).table.to_pylist()
    first = min(hop1, key=lambda r: (r["d"], r["id"]))
    syms = sorted({r["symbol"] for r in hop1})
    hop2 = fab.query("hop2", {"v": np.asarray(first["embedding"]), "syms": syms})
    return glue(hop2.table.to_pylist())


def by_vdb(db: VectorDB, q: np.ndarray) -> list[tuple[str, int, float]]:
    since = time.time() - 86_400
    hop1 = db.search(collection="news", vector=q.tolist(), k=K1, since=since, with_vectors=True)
    first = min(hop1, key=lambda r: (r["d"], r["id"]))
    syms = sorted({r["symbol"] for r in hop1})
    hop2 = db.search(collection="history", vector=first["vector"], k=K2, filter={"symbol": syms})
    return glue(hop2)


class Exact:
    """The same steps exactly, in numpy in this process (the oracle of "exact answers")."""

    def __init__(self, news: pa.Table, hist: pa.Table):
        self.nv = np.asarray(news["embedding"].combine_chunks().values).reshape(-1, DIM)
        self.nid = np.asarray(news["id"].to_pylist())
        self.nsym = np.asarray(news["symbol"].to_pylist())
        self.nts = np.asarray([x.timestamp() for x in news["published_at"].to_pylist()])
        self.hv = np.asarray(hist["embedding"].combine_chunks().values).reshape(-1, DIM)
        self.hsym = np.asarray(hist["symbol"].to_pylist())

    def __call__(self, q: np.ndarray) -> tuple[list[tuple[str, int, float]], bool]:
        """(the answer, whether a hop's k-th and (k+1)-th distances tie: then the k cut,
        and so the answer, is not unique)."""
        idx = np.where(self.nts > time.time() - 86_400)[0]
        d = 1.0 - self.nv[idx].astype(np.float64) @ q.astype(np.float64)
        o1 = np.lexsort((self.nid[idx], d))
        top = idx[o1[:K1]]
        seed = self.nv[top[0]].astype(np.float64)
        cand = np.where(np.isin(self.hsym, list(set(self.nsym[top]))))[0]
        d2 = 1.0 - self.hv[cand].astype(np.float64) @ seed
        o2 = np.argsort(d2, kind="stable")
        tie = bool(
            (len(o1) > K1 and abs(d[o1[K1 - 1]] - d[o1[K1]]) < 1e-5)
            or abs(d[o1[0]] - d[o1[1]]) < 1e-5  # the seed vector itself
            or (len(o2) > K2 and abs(d2[o2[K2 - 1]] - d2[o2[K2]]) < 1e-5)
        )
        return glue([{"symbol": self.hsym[cand[j]], "d": d2[j]} for j in o2[:K2]]), tie


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p)) if xs else float("nan")


def same(a: list[tuple[str, int, float]], b: list[tuple[str, int, float]]) -> bool:
    return [x[:2] for x in a] == [x[:2] for x in b] and np.allclose(
        [x[2] for x in a], [x[2] for x in b], atol=1e-4
    )


# ---------------------------------------------------------------- parts


def multihop(fab: Any, db: VectorDB, exact: Exact, qs: list[np.ndarray], warmup: int) -> None:
    ways = {
        "fabric, one binding": lambda q: by_fabric(fab, q),
        "agent glue, fab.query per hop": lambda q: by_fab_glue(fab, q),
        "agent glue, vector DB per hop": lambda q: by_vdb(db, q),
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, float] = dict.fromkeys(ways, 0.0)  # this process's CPU, all its threads
    own: dict[str, float] = dict.fromkeys(ways, 0.0)  # the calling thread's CPU alone
    agree: dict[str, int] = dict.fromkeys(ways, 0)
    untied = 0
    # each way runs first, second, third, and right after each other way, equally often
    # (all 6 orders in turn): none always follows the same other way
    orders = list(itertools.permutations(ways))
    refs = [exact(q) for q in qs]  # the oracle first, never between the timed calls
    for i, q in enumerate(qs):
        ref, tie = refs[i]
        untied += i >= warmup and not tie
        for w in orders[i % len(orders)]:
            fn = ways[w]
            c0, h0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
            got = fn(q)
            ms = (time.perf_counter() - t0) * 1000
            if i >= warmup:
                times[w].append(ms)
                cpu[w] += time.process_time() - c0
                own[w] += time.thread_time() - h0
                agree[w] += not tie and same(got, ref)
    n = len(qs) - warmup
    print(f"\nMulti-hop RAG (2 hops + aggregate), {n} questions, interleaved")
    print(f"({n - untied} questions have a tie at a k cut: not compared)")
    print("(CPU: this process's CPU time per question, all threads (the dataset folder's and")
    print("the tracing worker's too); thread: the calling thread's alone; the vector DB's own")
    print(f"process is not counted; load average {os.getloadavg()[0]:.1f} at the end)")
    print("| way | p50 ms | p95 ms | CPU ms | thread CPU ms | answers equal to exact (numpy) |")
    print("|---|---|---|---|---|---|")
    for w in ways:
        print(
            f"| {w} | {pct(times[w], 50):.2f} | {pct(times[w], 95):.2f} "
            f"| {cpu[w] / max(n, 1) * 1000:.2f} | {own[w] / max(n, 1) * 1000:.2f} "
            f"| {agree[w]}/{untied} |"
        )
    glue = "agent glue, fab.query per hop"
    one = "fabric, one binding"
    print(
        f"one binding / fab.query glue: p50 {pct(times[one], 50) / pct(times[glue], 50):.3f}x, "
        f"CPU {cpu[one] / cpu[glue]:.3f}x, thread CPU {own[one] / own[glue]:.3f}x"
    )


def cache_replay(fab: Any, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = questions(n, seed + 100)
    log: list[np.ndarray] = []
    for i in range(n):
        if i > 5 and rng.random() < 0.3:
            log.append(at_cosine(log[int(rng.integers(0, len(log)))], 0.97, rng))
        else:
            log.append(base[i])
    repeats = sum(1 for i in range(n) if not np.array_equal(log[i], base[i]))
    print(f"\nCache replay: {n} questions, {repeats} near-repeats (cosine 0.97), similarity 0.95")
    print("| run | p50 ms | p95 ms | mean ms | hits | source reads | rows read |")
    print("|---|---|---|---|---|---|---|")
    names = ("two_hop", "two_hop_cached")
    times: dict[str, list[float]] = {n: [] for n in names}
    reads = dict.fromkeys(names, 0)
    rows = dict.fromkeys(names, 0)
    hits = dict.fromkeys(names, 0)
    hit_ms: list[float] = []
    for i, q in enumerate(log):  # interleaved: both runs see the same machine load
        for name in names if i % 2 else names[::-1]:  # each first in turn
            t0 = time.perf_counter()
            res = fab.query(name, {"q": q})
            times[name].append((time.perf_counter() - t0) * 1000)
            src = res.stats.get("sources", {})
            reads[name] += len(src)  # the searches of both hops (none on a hit)
            rows[name] += sum(int(s.get("rows", 0)) for s in src.values())
            hit = res.stats.get("cache", {}).get("status") == "hit"
            hits[name] += hit
            if hit:
                hit_ms.append(times[name][-1])
    for name in names:
        label = "with cache" if name.endswith("cached") else "no cache"
        t = times[name]
        print(
            f"| {label} | {pct(t, 50):.2f} | {pct(t, 95):.2f} | {np.mean(t):.2f} "
            f"| {hits[name]} | {reads[name]} | {rows[name]} |"
        )
    print(f"hits alone: p50 {pct(hit_ms, 50):.3f} ms, p95 {pct(hit_ms, 95):.3f} ms")
    print(f"cache counters: {fab.cache_metrics('two_hop_cached')}")


def rate_limits(seconds: float, per_second: float) -> None:
    from connectors.base import ScanRequest
    from connectors.rest import RestConnection
    from tests.rest_api import ENDPOINT, running

    print(
        f"\nRate limit: 8 threads for {seconds:g} s against a local HTTP API (server-side counts)"
    )
    print("| connection | requests | req/s (mean) | max in any 1 s | p50 scan ms |")
    print("|---|---|---|---|---|")
    with running() as api:
        for limit in (None, {"per_second": per_second, "burst": 5}):
            opts: dict[str, Any] = {
                "kind": "rest",
                "base_url": api.url,
                "endpoints": {"m": ENDPOINT},
            }
            if limit:
                opts["rate_limit"] = limit
            src = RestConnection("bench", opts).source(
                "m", {"schema": {"id": "int", "city": "str"}}
            )
            before = len(api.requests())
            stop = time.monotonic() + seconds
            lat: list[float] = []

            def caller(src: Any = src, stop: float = stop, lat: list[float] = lat) -> None:
                while time.monotonic() < stop:
                    t0 = time.perf_counter()
                    list(src.scan(ScanRequest(columns=("id",), limit=10)))
                    lat.append((time.perf_counter() - t0) * 1000)

            threads = [threading.Thread(target=caller) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ts = sorted(t for t, _ in api.requests()[before:])
            peak = max(sum(1 for u in ts[i:] if u - t < 1.0) for i, t in enumerate(ts))
            span = ts[-1] - ts[0] if len(ts) > 1 else 1.0
            label = f"rate_limit {per_second:g}/s burst 5" if limit else "no limit"
            print(
                f"| {label} | {len(ts)} | {(len(ts) - 1) / span:.1f} | {peak} | {pct(lat, 50):.2f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--news", type=int, default=2000)
    ap.add_argument("--history", type=int, default=5000)
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--log", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--per-second", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: multihop,cache,rate")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    news = news_table(args.news, args.seed)
    hist = history_table(args.history, args.seed)
    print(f"news {news.num_rows} x {DIM}-d, history {hist.num_rows} x {DIM}-d, 2 cores shared")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "agents").mkdir()
        (root / "fabric.yaml").write_text(FABRIC)
        (root / "agents" / "two_hop.yaml").write_text(TWO_HOP % {"name": "two_hop", "cache": ""})
        (root / "agents" / "two_hop_cached.yaml").write_text(
            TWO_HOP
            % {
                "name": "two_hop_cached",
                "cache": 'cache: {by: "{{session.q}}", similarity: 0.95, ttl: {dataset: 1h}}',
            }
        )
        (root / "agents" / "hop1.yaml").write_text(HOP1)
        (root / "agents" / "hop2.yaml").write_text(HOP2)
        with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
            fab.dataset("news").upsert(news)
            fab.dataset("history").upsert(hist)
            if "multihop" not in skip:
                db = VectorDB(news, hist)
                try:
                    qs = questions(args.questions, args.seed)
                    multihop(fab, db, Exact(news, hist), qs, args.warmup)
                finally:
                    db.close()
            if "cache" not in skip:
                cache_replay(fab, args.log, args.seed)
    if "rate" not in skip:
        rate_limits(args.seconds, args.per_second)


if __name__ == "__main__":
    main()
