"""Keyword relevance (BM25 over the inverted index) and hybrid ranking (RRF + recency).

Every score is checked against an independent reference computed here with numpy from
the live rows' text (Python's ``re`` tokenizer, ``collections.Counter`` term frequencies,
the BM25 formula with k1 = 1.2, b = 0.75 written out again), after inserts, upserts
(which change lengths and term frequencies) and deletes, and after save/load. Fusion is
checked against RRF computed from the two arms' ranked lists.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dsl.ast import Binary, Column, Literal
from indexes import Dataset, DatasetError, IndexSpec
from indexes.ranking import Fusion, keyword_search, rank, rrf

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
DIM = 8
VOCAB = ["fed", "rates", "oil", "chips", "bank", "earnings", "inflation", "jobs", "ai", "gold"]
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("cl", pa.int64()),
        ("body", pa.string()),
        ("emb", pa.list_(pa.float32(), DIM)),
    ]
)


def docs(ids, seed: int, rng_len=(0, 12)) -> pa.Table:
    rng = np.random.default_rng(seed)
    # Zipf-like word choice so frequent and rare terms, repeats within a document, and
    # a few empty / null / non-ASCII documents
    p = 1.0 / np.arange(1, len(VOCAB) + 1)
    p /= p.sum()
    bodies: list[str | None] = []
    for i in ids:
        n = int(rng.integers(*rng_len))
        words = list(rng.choice(VOCAB, n, p=p))
        if i % 17 == 0:
            words.append("Zürich")
        if i % 23 == 0:
            bodies.append(None)
            continue
        bodies.append(" ".join(w.upper() if rng.random() < 0.2 else w for w in words) + ".")
    x = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "ts": pa.array(
                [T0 + dt.timedelta(hours=int(i)) for i in ids], pa.timestamp("us", tz="UTC")
            ),
            "cl": pa.array([int(i) % 5 for i in ids], pa.int64()),
            "body": pa.array(bodies, pa.string()),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
        },
        schema=SCHEMA,
    )


def make(background_fold: bool = False) -> Dataset:
    return Dataset(
        "r",
        SCHEMA,
        "id",
        {
            "emb": IndexSpec("hnsw", metric="l2", M=16, ef_construction=100, ef=64),
            "ts": "btree",
            "cl": "btree",
            "body": "inverted",
        },
        background_fold=background_fold,
    )


def reference(ds: Dataset, query: str, where=None) -> dict[int, float]:
    """BM25 of every live row for ``query``, from the text alone (numpy)."""
    t = ds.to_table(["id", "cl", "body"]).to_pylist()
    toks = [re.findall(r"\w+", (r["body"] or "").lower()) for r in t]
    n = len(t)
    lens = np.array([len(x) for x in toks], dtype=np.float64)
    avgdl = lens.sum() / n
    q = list(dict.fromkeys(re.findall(r"\w+", query.lower())))
    tfs = [Counter(x) for x in toks]
    score = np.zeros(n)
    held = np.zeros(n, dtype=bool)
    for term in q:
        tf = np.array([c[term] for c in tfs], dtype=np.float64)
        df = float((tf > 0).sum())
        if not df:
            continue
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        score += idf * tf * 2.2 / (tf + 1.2 * (1 - 0.75 + 0.75 * lens / avgdl))
        held |= tf > 0
    return {
        r["id"]: float(s) for r, s, h in zip(t, score, held) if h and (where is None or where(r))
    }


def check_top(ds: Dataset, query: str, k: int = 10, where=None, pred=None, strategy=None):
    ref = reference(ds, query, pred)
    ids, scores, info = keyword_search(ds, "body", query, k, where, {}, strategy=strategy)
    keys = ds._scalar_table().column("id").take(pa.array(ids)).to_pylist()
    best = sorted(ref.items(), key=lambda kv: -kv[1])[:k]
    assert len(keys) == len(best), info
    for key, s in zip(keys, scores):
        assert s == pytest.approx(ref[key], rel=1e-12, abs=1e-12)
    # the same score multiset as the reference's top k (ties may order either way)
    assert np.allclose(sorted(scores), sorted(s for _, s in best), rtol=1e-12)
    assert list(scores) == sorted(scores, reverse=True)
    return info


QUERIES = ["fed rates", "gold", "oil OIL jobs ai", "zürich", "nothing here", "inflation bank chips"]


def test_bm25_matches_reference_through_upserts_and_deletes(tmp_path) -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 600), 1))
    ds.upsert(docs(np.arange(600, 1000), 2))
    for q in QUERIES:
        check_top(ds, q)
    # upserts change lengths and term frequencies of existing rows; deletes remove rows
    ds.upsert(docs(np.arange(300, 700), 3, rng_len=(5, 30)))
    ds.delete(list(range(0, 1000, 7)))
    ds.upsert(docs(np.arange(990, 1100), 4))
    inv = ds.inverted["body"]
    texts = ds.to_table(["body"]).column("body").to_pylist()
    assert inv.docs == len(texts) == ds.count()
    assert inv.total_len == sum(len(re.findall(r"\w+", (t or "").lower())) for t in texts)
    for q in QUERIES:
        check_top(ds, q, k=25)
    # a delete of everything holding a term leaves no score for it
    gone = [
        r["id"]
        for r in ds.to_table(["id", "body"]).to_pylist()
        if "gold" in (r["body"] or "").lower()
    ]
    ds.delete(gone)
    ids, _, _ = keyword_search(ds, "body", "gold", 5, None, {})
    assert len(ids) == 0
    check_top(ds, "fed gold")
    # statistics survive save / load (recomputed from the rows, exactly)
    ds.save(str(tmp_path / "r"))
    back = Dataset.load(str(tmp_path / "r"))
    assert back.inverted["body"].docs == inv.docs
    assert back.inverted["body"].total_len == inv.total_len
    for q in QUERIES:
        check_top(back, q, k=25)
    back.close()
    ds.close()


def test_bm25_with_filters_both_strategies() -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 2000), 5))
    ds.delete(list(range(0, 2000, 11)))
    cl2 = Binary("=", Column("cl"), Literal(2, "int"))
    late = Binary(">", Column("ts"), Literal(T0 + dt.timedelta(hours=1500), "timestamp"))
    # a few rows at the top of the id range: the sparse (sort) path of the sum per row
    last = Binary(">", Column("ts"), Literal(T0 + dt.timedelta(hours=1985), "timestamp"))
    residual = Binary("!=", Column("body"), Literal("fed.", "str"))
    for where, pred in (
        (cl2, lambda r: r["cl"] == 2),
        (Binary("and", cl2, residual), lambda r: r["cl"] == 2 and r["body"] != "fed."),
        (last, lambda r: r["id"] > 1985),
    ):
        for strategy in (None, "prefilter", "postfilter"):
            for q in ("fed", "rates oil", "gold jobs"):
                info = check_top(ds, q, 10, where, pred, strategy)
                assert info.chosen in ("prefilter", "postfilter")
    ts = ds._scalar_table()
    info = keyword_search(ds, "body", "fed", 10, late, {})[2]
    assert "alternatives:" in str(info) and "chosen:" in str(info)
    assert ts.num_rows


def test_keyword_errors() -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 10), 1))
    with pytest.raises(DatasetError, match=r"no inverted index.*declare indexes: \{cl: inverted\}"):
        keyword_search(ds, "cl", "x", 5, None, {})
    with pytest.raises(DatasetError, match="k must be positive"):
        keyword_search(ds, "body", "x", 0, None, {})


def test_rrf_matches_reference_and_recency() -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 1500), 7))
    ds.flush()
    q = np.random.default_rng(3).standard_normal(DIM).astype(np.float32)
    where = Binary("!=", Column("cl"), Literal(3, "int"))
    t, info = rank(
        ds, vector=("emb", q, 30), text=("body", "fed oil", 20), where=where, columns=["id"]
    )
    # the two arms on their own
    vt, _ = ds.search("emb", q, 30, where, columns=["id"])
    kids, kscores, _ = keyword_search(ds, "body", "fed oil", 20, where, {})
    kkeys = ds._scalar_table().column("id").take(pa.array(kids)).to_pylist()
    vkeys = vt.column("id").to_pylist()
    ref: dict[int, float] = {}
    for lst in (vkeys, kkeys):
        for r, key in enumerate(lst, start=1):
            ref[key] = ref.get(key, 0.0) + 1 / (60 + r)
    best = sorted(ref.items(), key=lambda kv: -kv[1])[:30]
    got = dict(zip(t.column("id").to_pylist(), t.column("_score").to_pylist()))
    assert len(got) == 30
    for key, s in got.items():
        assert s == pytest.approx(ref[key], rel=1e-12)
    assert sorted(got.values(), reverse=True) == pytest.approx([s for _, s in best], rel=1e-12)
    # _distance / _bm25 are the arms' values, null where an arm did not return the row
    dist = dict(zip(vkeys, vt.column("_distance").to_pylist()))
    bm = dict(zip(kkeys, kscores.tolist()))
    for row in t.to_pylist():
        assert row["_distance"] == (pytest.approx(dist[row["id"]]) if row["id"] in dist else None)
        assert row["_bm25"] == (pytest.approx(bm[row["id"]]) if row["id"] in bm else None)
    assert "RankFusion: rrf k=60" in str(info) and "VectorRetrieval" in str(info)
    assert "KeywordRetrieval" in str(info)
    # rrf_k and recency: score = rrf * 0.5 ** (age / half_life)
    now = T0 + dt.timedelta(hours=2000)
    f = Fusion(rrf_k=10, limit=15, recency="ts", half_life_s=86400.0 * 7)
    t2, _ = rank(
        ds,
        vector=("emb", q, 30),
        text=("body", "fed oil", 20),
        fusion=f,
        where=where,
        columns=["id", "ts"],
        params={"__now": now},
    )
    ref2 = {}
    for lst in (vkeys, kkeys):
        for r, key in enumerate(lst, start=1):
            ref2[key] = ref2.get(key, 0.0) + 1 / (10 + r)
    ts = dict(
        zip(
            ds.to_table(["id", "ts"]).column("id").to_pylist(),
            ds.to_table(["ts"]).column("ts").to_pylist(),
        )
    )
    for key in ref2:
        ref2[key] *= 0.5 ** ((now - ts[key]).total_seconds() / (86400.0 * 7))
    best2 = sorted(ref2.values(), reverse=True)[:15]
    assert t2.num_rows == 15
    assert t2.column("_score").to_pylist() == pytest.approx(best2, rel=1e-12)
    for key, s in zip(t2.column("id").to_pylist(), t2.column("_score").to_pylist()):
        assert s == pytest.approx(ref2[key], rel=1e-12)
    ds.close()


def test_rrf_function() -> None:
    ids, s = rrf([np.array([5, 3, 9]), np.array([3, 7])], 60)
    assert ids.tolist() == [3, 5, 7, 9]  # 3: 1/62 + 1/61; 5: 1/61; 7: 1/62; 9: 1/63
    assert s[0] == pytest.approx(1 / 62 + 1 / 61)


# ---------------------------------------------------------------- through bindings


def _fab(tmp_path, ds: Dataset, text: str):
    import fabric
    from connectors.dataset import DatasetSource

    (tmp_path / "b.yaml").write_text(text)
    return fabric.open(
        {"bindings": [str(tmp_path)]},
        ingest=False,
        watch=False,
        dataset_sources={"r": DatasetSource("dataset://r", ds)},
    )


KEYWORD_BINDING = """\
binding: kw
session: {q: str, c: int}
sources:
  d:
    from: dataset://r
    search: {column: body, query: "{{session.q}}", k: 8}
    where: cl != {{session.c}}
select: [d.id, d._score, d._bm25]
order_by: d._score desc
"""


def test_search_binding_returns_the_bm25_top_k(tmp_path) -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 800), 11))
    ds.upsert(docs(np.arange(400, 500), 12))  # upserted rows change the statistics
    ds.delete(list(range(0, 800, 9)))
    with _fab(tmp_path, ds, KEYWORD_BINDING) as fab:
        # a quote, a comment and SQL in the text stay a bound value: only its words count
        for q in ("fed rates", "gold' or 1=1 --", "OIL"):
            res = fab.query("kw", session={"q": q, "c": 1})
            ref = reference(ds, q, lambda r: r["cl"] != 1)
            best = sorted(ref.values(), reverse=True)[:8]
            got = res.table.to_pylist()
            assert [r["_score"] for r in got] == pytest.approx(best, rel=1e-12)
            for r in got:
                assert r["_score"] == pytest.approx(ref[r["id"]], rel=1e-12)
                assert r["_bm25"] == r["_score"]
            assert res.stats["sources"]["d"]["strategy"].startswith("keyword ")
        plan = fab.explain("kw", session={"q": "fed", "c": 1})
        assert "search(body, {{session.q}}) k=8" in plan
        text = fab.explain("kw", session={"q": "fed", "c": 1}, analyze=True)
        assert "KeywordRetrieval: bm25(body, 'fed') k=8" in text and "chosen: " in text
        # the text form gives the same rows
        t = fab.query_text(
            "from dataset://r as d search body query {{session.q}} k 8 where cl != 1 "
            "select d.id, d._score order by d._score desc",
            session={"q": "fed rates"},
        )
        ref = reference(ds, "fed rates", lambda r: r["cl"] != 1)
        assert t.table.column("_score").to_pylist() == pytest.approx(
            sorted(ref.values(), reverse=True)[:8], rel=1e-12
        )
    ds.close()


HYBRID_BINDING = """\
binding: hy
session: {q: str, v: "vector[8]"}
sources:
  d:
    from: dataset://r
    nearest: {column: emb, to: "{{session.v}}", k: 20}
    search: {column: body, query: "{{session.q}}", k: 20}
    rank: {k: 12, rrf_k: 30, recency: ts, half_life: 3d}
    where: cl in (0, 1, 2)
select: [d.id, d.ts, d._score, d._distance, d._bm25]
order_by: d._score desc
"""


def test_hybrid_binding_fuses_both_arms(tmp_path) -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 1200), 13))
    ds.flush()
    v = np.random.default_rng(8).standard_normal(DIM).astype(np.float32)
    where = Binary(
        "or",
        Binary(
            "or",
            Binary("=", Column("cl"), Literal(0, "int")),
            Binary("=", Column("cl"), Literal(1, "int")),
        ),
        Binary("=", Column("cl"), Literal(2, "int")),
    )
    with _fab(tmp_path, ds, HYBRID_BINDING) as fab:
        res = fab.query("hy", session={"q": "fed oil gold", "v": v})
        vt, _ = ds.search("emb", v, 20, where, columns=["id", "ts"])
        kids, _, _ = keyword_search(ds, "body", "fed oil gold", 20, where, {})
        kkeys = ds._scalar_table().column("id").take(pa.array(kids)).to_pylist()
        ts = dict(
            zip(
                ds.to_table(["id"]).column("id").to_pylist(),
                ds.to_table(["ts"]).column("ts").to_pylist(),
            )
        )
        ref: dict[int, float] = {}
        for lst in (vt.column("id").to_pylist(), kkeys):
            for r, key in enumerate(lst, start=1):
                ref[key] = ref.get(key, 0.0) + 1 / (30 + r)
        got = res.table.to_pylist()
        assert len(got) == 12
        # now() of the query lies between these two: the decay of a 3-day half-life moves
        # by < 1e-9 relative in the few ms between them
        for r in got:
            age = (dt.datetime.now(dt.UTC) - ts[r["id"]]).total_seconds()
            assert r["_score"] == pytest.approx(ref[r["id"]] * 0.5 ** (age / 259200), rel=1e-6)
        assert [r["_score"] for r in got] == sorted((r["_score"] for r in got), reverse=True)
        text = fab.explain("hy", session={"q": "fed oil gold", "v": v}, analyze=True)
        assert "Ranking d:" in text and "RankFusion: rrf k=30 limit=12, recency ts" in text
        assert "VectorRetrieval: nearest(emb) k=20" in text and "KeywordRetrieval" in text
        assert text.count("chosen: ") >= 2  # one per arm
        entry = res.stats["sources"]["d"]
        assert entry["strategy"].startswith("vector ") and "+ keyword " in entry["strategy"]
        assert entry["strategy"].endswith("-> rrf")
    ds.close()


EXPLAIN_FIXTURE = Path(__file__).parent / "fixtures" / "ranking" / "explain_hybrid.txt"


def _masked(text: str) -> str:
    """Explain text without what varies from run to run (times, the total's line)."""
    text = re.sub(r"\d+\.\d+ ?ms", "# ms", text)
    text = re.sub(r"(?m)^(\s*observed: ).*$", r"\1...", text)  # the graph walk's pass rate
    text = re.sub(r"(?m)^Result: .*$", "Result: ...", text)
    return text


def test_explain_analyze_of_a_hybrid_binding_fixture(tmp_path) -> None:
    """The explain text (times masked) of a hybrid query on a fresh dataset: the plan,
    then one Ranking block with each arm's alternatives and choice."""
    from indexes.cost import CostModel

    ds = make()
    ds.cost_model = CostModel()  # the built-in unit costs, not this machine's calibration
    ds.upsert(docs(np.arange(0, 3000), 21))
    ds.flush()
    v = np.random.default_rng(2).standard_normal(DIM).astype(np.float32)
    with _fab(tmp_path, ds, HYBRID_BINDING) as fab:
        text = _masked(fab.explain("hy", session={"q": "fed oil", "v": v}, analyze=True))
    ds.close()
    if os.environ.get("FABRIC_UPDATE_FIXTURES") == "1" or not EXPLAIN_FIXTURE.exists():
        EXPLAIN_FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        EXPLAIN_FIXTURE.write_text(text + "\n")
    assert text == EXPLAIN_FIXTURE.read_text().rstrip("\n")


def test_rank_with_one_arm_and_registered_dataset_errors(tmp_path) -> None:
    ds = make()
    ds.upsert(docs(np.arange(0, 500), 31))
    ds.flush()
    now = dt.datetime.now(dt.UTC)
    # rank: on the keyword arm alone: RRF of the BM25 order, decayed by age
    t, _info = rank(
        ds,
        text=("body", "fed", 15),
        fusion=Fusion(recency="ts", half_life_s=3600.0 * 24),
        columns=["id", "ts"],
        params={"__now": now},
    )
    kids, _, _ = keyword_search(ds, "body", "fed", 15, None, {})
    keys = ds._scalar_table().column("id").take(pa.array(kids)).to_pylist()
    ts = dict(zip(t.column("id").to_pylist(), t.column("ts").to_pylist()))
    ref = sorted(
        (1 / (60 + r) * 0.5 ** ((now - ts[key]).total_seconds() / 86400.0))
        for r, key in enumerate(keys, start=1)
    )[::-1]
    assert t.column("_score").to_pylist() == pytest.approx(ref, rel=1e-12)
    assert "_distance" not in t.column_names and "_bm25" in t.column_names
    # a where on _score applies to the rows the search returned
    binding = KEYWORD_BINDING.replace(
        "    where: cl != {{session.c}}\n",
        "    where:\n      - cl != {{session.c}}\n      - _score > 2.0\n",
    )
    with _fab(tmp_path, ds, binding) as fab:
        res = fab.query("kw", session={"q": "fed rates", "c": 1})
        ref2 = sorted(reference(ds, "fed rates", lambda r: r["cl"] != 1).values(), reverse=True)[:8]
        assert res.table.column("_score").to_pylist() == pytest.approx(
            [s for s in ref2 if s > 2.0], rel=1e-12
        )
    # a registered dataset (no fabric.yaml declaration) without an inverted index on the
    # column: the binding's error names the index to declare, at the column's position
    (tmp_path / "b.yaml").unlink()
    bad = KEYWORD_BINDING.replace("column: body", "column: cl").replace(
        "binding: kw", "binding: bad"
    )
    with _fab(tmp_path, ds, bad) as fab:
        diags = fab.validate()
    msg = "\n".join(d.format() for d in diags)
    assert (
        "b.yaml:6:22: search column 'cl' has no inverted index in dataset://r (it has a btree index)"
        in msg
    )
    assert "indexes: {cl: inverted}" in msg and "inverted columns now: body" in msg
    ds.close()


def test_recency_decay_of_a_null_timestamp_is_zero() -> None:
    ds = make()
    t = docs(np.arange(0, 40), 41)
    ts = t.column("ts").to_pylist()
    ts[3] = None
    t = t.set_column(1, "ts", pa.array(ts, pa.timestamp("us", tz="UTC")))
    bodies = t.column("body").to_pylist()
    bodies[3] = "fed rates"
    t = t.set_column(3, "body", pa.array(bodies, pa.string()))
    ds.upsert(t)
    now = T0 + dt.timedelta(hours=50)
    rows, _ = rank(
        ds,
        text=("body", "fed rates oil chips bank", 40),
        fusion=Fusion(recency="ts", half_life_s=3600.0),
        columns=["id", "ts"],
        params={"__now": now},
    )
    got = {r["id"]: r for r in rows.to_pylist()}
    assert got[3]["_score"] == 0.0 and got[3]["_bm25"] > 0.0
    for r in got.values():
        if r["ts"] is not None:
            assert r["_score"] > 0.0
    ds.close()


def test_rrf_small_and_large_paths_agree() -> None:
    rng = np.random.default_rng(9)
    for n in (5, 40, 300, 2000):  # 2000 + 2000 entries take the numpy path
        a = rng.choice(5 * n, n, replace=False)
        b = np.concatenate([rng.choice(5 * n, n - 3, replace=False), a[:3]])
        ids, s = rrf([a, b], 60)
        ref: dict[int, float] = {}
        for lst in (a, b):
            seen = set()
            for r, key in enumerate(lst.tolist(), start=1):
                if key not in seen:
                    seen.add(key)
                    ref[key] = ref.get(key, 0.0) + 1 / (60 + r)
        assert sorted(ref) == sorted(ids.tolist())
        assert s.tolist() == pytest.approx(sorted(ref.values(), reverse=True), rel=1e-12)
        for key, v in zip(ids.tolist(), s.tolist()):
            assert v == pytest.approx(ref[key], rel=1e-12)
