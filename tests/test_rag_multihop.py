"""Multi-hop retrieval in one plan (issue 17): retrieve -> extract the entities -> a new
query vector -> retrieve again -> aggregate, as one binding of stages, equal to the same
steps computed by hand with numpy; explain(analyze=True) shows every hop's rows, index
path and time; a semantic cache over it is invalidated by an update of either hop's source.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import fabric

DIM = 32
SYMBOLS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOG", "META", "SPY"]
FABRIC = f"""\
datasets:
  news:
    key: id
    schema: {{id: str, symbol: str, body: str, embedding: "vector[{DIM}]"}}
    indexes: {{embedding: {{kind: hnsw, metric: cosine}}}}
  filings:
    key: id
    schema: {{id: str, symbol: str, body: str, embedding: "vector[{DIM}]"}}
    indexes: {{embedding: {{kind: hnsw, metric: cosine}}, symbol: inverted}}
bindings: [agents/]
"""
BINDING = f"""\
binding: two_hop
session: {{q: "vector[{DIM}]"}}
stages:
  hop1:                                   # retrieve the news nearest to the question
    sources:
      n: {{from: dataset://news, nearest: {{column: embedding, to: "{{{{session.q}}}}", k: 20}}}}
    select: [n.id, n.symbol, n.embedding, n._distance as d]
  seed:                                   # the new query vector: the nearest story's
    sources: {{s: {{from: stage://hop1}}}}
    select: [s.embedding]
    order_by: [s.d, s.id]
    limit: 1
  syms:                                   # the entities the first hop found
    sources: {{t: {{from: stage://hop1}}}}
    select: [t.symbol]
sources:
  f:                                      # the second hop, over another dataset
    from: dataset://filings
    where: f.symbol in syms
    nearest: {{column: embedding, to: seed.embedding, k: 10}}
select: [f.symbol, count(*) as n, min(f._distance) as best]
group_by: [f.symbol]
order_by: [f.symbol]
cache: {{by: "{{{{session.q}}}}", similarity: 0.95, ttl: {{dataset: 1h}}}}
"""


def unit(m: np.ndarray) -> np.ndarray:
    return (m / np.linalg.norm(m, axis=-1, keepdims=True)).astype(np.float32)


def table(n: int, prefix: str, seed: int) -> tuple[pa.Table, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = unit(rng.normal(size=(len(SYMBOLS), DIM)))
    sym = rng.integers(0, len(SYMBOLS), n)
    vecs = unit(centers[sym] + 0.8 * rng.normal(size=(n, DIM)))
    t = pa.table(
        {
            "id": [f"{prefix}{i:05d}" for i in range(n)],
            "symbol": [SYMBOLS[s] for s in sym],
            "body": [f"{prefix} {i}" for i in range(n)],
            "embedding": pa.array(vecs.tolist(), type=pa.list_(pa.float32(), DIM)),
        }
    )
    return t, vecs


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("multihop")
    (root / "agents").mkdir()
    (root / "fabric.yaml").write_text(FABRIC)
    (root / "agents" / "two_hop.yaml").write_text(BINDING)
    news, nv = table(2000, "n", 1)
    filings, fv = table(3000, "f", 2)
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.dataset("news").upsert(news)
        fab.dataset("filings").upsert(filings)
        yield fab, {"news": news, "nv": nv, "filings": filings, "fv": fv}


def by_hand(d: dict[str, Any], q: np.ndarray) -> list[tuple[str, int, float]]:
    """The agent's steps with numpy: exact top-20, its symbols, the nearest story's vector,
    exact top-10 of filings on those symbols, count and best distance per symbol."""
    dist1 = 1.0 - d["nv"].astype(np.float64) @ q.astype(np.float64)
    top1 = np.lexsort((np.arange(len(dist1)), dist1))[:20]
    syms = {d["news"]["symbol"][int(i)].as_py() for i in top1}
    seed = d["nv"][int(top1[0])].astype(np.float64)
    fsym = np.array(d["filings"]["symbol"].to_pylist())
    cand = np.where(np.isin(fsym, list(syms)))[0]
    dist2 = 1.0 - d["fv"][cand].astype(np.float64) @ seed
    top2 = cand[np.argsort(dist2, kind="stable")[:10]]
    out: dict[str, list[float]] = {}
    for i, dd in zip(top2, np.sort(dist2)[:10]):
        out.setdefault(str(fsym[i]), []).append(float(dd))
    return [(s, len(v), min(v)) for s, v in sorted(out.items())]


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_two_hops_equal_the_steps_by_hand(setup: tuple[Any, dict[str, Any]], seed: int) -> None:
    fab, d = setup
    q = unit(np.random.default_rng(seed).normal(size=DIM))
    res = fab.query("two_hop", {"q": q.tolist()})
    got = [(r["symbol"], r["n"], r["best"]) for r in res.table.to_pylist()]
    want = by_hand(d, q)
    assert [(s, n) for s, n, _ in got] == [(s, n) for s, n, _ in want]
    assert np.allclose([b for *_, b in got], [b for *_, b in want], atol=1e-5)


def test_explain_analyze_shows_each_hop(setup: tuple[Any, dict[str, Any]]) -> None:
    fab, _ = setup
    q = unit(np.random.default_rng(9).normal(size=DIM))
    text = fab.explain("two_hop", {"q": q.tolist()}, analyze=True)
    hop1 = next(ln for ln in text.splitlines() if "VectorSearch: n <- dataset://news" in ln)
    hop2 = next(ln for ln in text.splitlines() if "VectorSearch: f <- dataset://filings" in ln)
    assert "rows=20" in hop1 and "time=" in hop1, text
    assert "rows=10" in hop2 and "nearest(embedding, seed.embedding)" in hop2, text
    assert "filters=[symbol in syms]" in hop2, text
    for alias in ("n", "f"):  # the index path chosen for each hop
        block = text.split(f"VectorSearch {alias}:", 1)[1]
        assert "chosen: " in block.split("VectorSearch", 1)[0], text


def test_cache_over_two_hops_is_invalidated_by_either_hop(
    setup: tuple[Any, dict[str, Any]],
) -> None:
    fab, d = setup
    q = unit(np.random.default_rng(11).normal(size=DIM))
    first = fab.query("two_hop", {"q": q.tolist()})
    again = fab.query("two_hop", {"q": q.tolist()})
    assert again.stats["cache"]["status"] == "hit" and again.table.equals(first.table)
    for name, table_ in (("news", d["news"]), ("filings", d["filings"])):
        fab.dataset(name).upsert(table_.slice(0, 1))  # the same row again: a write all the same
        res = fab.query("two_hop", {"q": q.tolist()})
        assert res.stats["cache"]["reason"] == f"source advanced: dataset://{name}"
        assert res.table.equals(first.table)
