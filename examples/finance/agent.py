"""Finance: how did the US market open today?

The fabric ingests a news topic into a dataset it indexes itself (HNSW over the
embeddings, a B-tree over the publication time, an inverted index over the text). An
agent asks ``market_open_news`` with its question as a vector and its symbols: the 20
nearest headlines of the last day on those symbols, then a sandboxed Python snippet keeps
the closest one per symbol. The answer is checked against exact nearest neighbours
computed with numpy over the same generated documents.

    python examples/finance/agent.py [--seed 7] [--scale 1.0] [--symbols AAPL,NVDA,SPY]
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout (or site-packages) root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import pyarrow as pa

from examples.embedded import embedded, generate, parser

HERE = Path(__file__).resolve().parent
QUESTION = "how did the US market open today"


def wait_ingested(fab, n: int, timeout: float = 60.0) -> int:
    """Wait until the dataset holds the ``n`` documents produced to the topic."""
    ds = fab.dataset("news")
    deadline = time.monotonic() + timeout
    while ds.count() < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return ds.count()


def ask(fab, question_vec: np.ndarray, symbols: list[str]) -> pa.Table:
    """The agent's side: one query through the public API."""
    res = fab.query("market_open_news", session={"query_vec": question_vec, "symbols": symbols})
    return res.table


def reference(data: dict[str, pa.Table], q: np.ndarray, symbols: list[str]) -> list[float]:
    """Distances (1 - cosine) of the exact answer: the 20 nearest of the last day on the
    symbols, then the snippet's rule (the nearest one per symbol), computed with numpy."""
    news = data["news"]
    now = dt.datetime.now(dt.UTC)
    mask = np.array(
        [
            s in symbols and p > now - dt.timedelta(days=1)
            for s, p in zip(news["symbol"].to_pylist(), news["published_at"].to_pylist())
        ]
    )
    emb = np.asarray(news["embedding"].combine_chunks().values).reshape(-1, 384)
    dist = 1 - emb @ q
    idx = np.where(mask)[0]
    top = idx[np.argsort(dist[idx], kind="stable")[:20]]
    seen: set[str] = set()
    out = []
    for i in top:
        s = news["symbol"][int(i)].as_py()
        if s not in seen:
            seen.add(s)
            out.append(float(dist[i]))
    return sorted(out)


def distances(data: dict[str, pa.Table], q: np.ndarray, ids: list[str]) -> list[float]:
    """1 - cosine of the documents ``ids`` to ``q``, from the generated embeddings."""
    news = data["news"]
    pos = {v: i for i, v in enumerate(news["id"].to_pylist())}
    emb = np.asarray(news["embedding"].combine_chunks().values).reshape(-1, 384)
    return sorted(float(1 - emb[pos[i]] @ q) for i in ids)


def main(argv: list[str] | None = None) -> int:
    from examples.seed.data import hash_embed

    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--symbols", default="AAPL,NVDA,SPY", help="comma-separated (AAPL,NVDA,SPY)")
    args = ap.parse_args(argv)
    symbols = args.symbols.split(",")
    data = generate(args.seed, args.scale)
    q = hash_embed([QUESTION])[0]
    with embedded("finance", HERE, data) as (fab, _):
        held = wait_ingested(fab, data["news"].num_rows)
        got = ask(fab, q, symbols)
    print(f"the news dataset holds {held} documents, ingested from Kafka")
    print(f"{QUESTION!r} on {', '.join(symbols)}: {got.num_rows} headlines")
    for r in got.to_pylist():
        print(f"  {r['symbol']:<5} {r['published_at']:%H:%M}  {r['body']}")
    ok = held == data["news"].num_rows and np.allclose(
        distances(data, q, got["id"].to_pylist()), reference(data, q, symbols), atol=1e-5
    )
    print("[ok] matches exact nearest neighbours (numpy)" if ok else "[MISMATCH] vs numpy")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
