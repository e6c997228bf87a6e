"""Dataset features on sharded datasets (issue 16), each compared with local mode on the
same data.

- ``embed:`` runs in every shard, on the shard's part of each write, and gives the
  vectors a local dataset computes;
- BM25 (``search:``) over shards gathers every shard's document count, token lengths and
  document frequencies first, so every row's score is the one a single dataset holding
  every row gives it, and the top-k over shards is the unsharded top-k (ties by key);
  with a filter, and fused with a vector arm (RRF, recency) as ``rank:`` does.
"""

from __future__ import annotations

import datetime as dt
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dsl.ast import Binary, Column, Literal
from fabric.ray.shards import ShardedDataset
from indexes.ranking import NOW_PARAM, Fusion, rank
from tests import ray_support
from tests.test_ranking import SCHEMA, docs, make

pytestmark = [pytest.mark.ray]

ray_cluster = ray_support.ray_cluster

INDEXES = {
    "emb": {"kind": "hnsw", "metric": "l2", "M": 16, "ef_construction": 100, "ef": 64},
    "ts": "btree",
    "cl": "btree",
    "body": "inverted",
}
QUERIES = ["fed rates", "gold", "oil OIL jobs ai", "zürich", "nothing here", "inflation bank chips"]
NOW = dt.datetime(2026, 1, 20, tzinfo=dt.UTC)


def by_key_then_score(table: pa.Table, score: str, k: int) -> list[tuple[int, float]]:
    """The unsharded top-k with ties broken by key (the sharded order)."""
    rows = sorted(
        zip(table.column("id").to_pylist(), table.column(score).to_pylist(), strict=True),
        key=lambda r: (-r[1], r[0]),
    )
    return rows[:k]


@pytest.fixture(scope="module")
def pair(ray_cluster, tmp_path_factory):
    """The same rows in one local dataset and in a dataset of 3 shards (no row written
    twice, so the local row ids are in key order and ties break the same way)."""
    rows = docs(np.arange(0, 1500), 21)
    gone = list(range(0, 1500, 7))
    local = make()
    local.upsert(rows)
    local.delete(gone)
    local.flush()
    shd = ShardedDataset(
        ray_cluster,
        "r",
        SCHEMA,
        "id",
        INDEXES,
        shards=3,
        state_dir=tmp_path_factory.mktemp("shards"),
    )
    shd.upsert(rows)
    assert shd.delete(gone) == len(gone)
    shd.flush()
    yield local, shd
    shd.close()
    local.close()


@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("filtered", [False, True])
def test_bm25_top_k_over_shards_is_the_unsharded_top_k(pair, query, filtered) -> None:
    local, shd = pair
    where = Binary("!=", Column("cl"), Literal(1, "int")) if filtered else None
    assert shd.count() == local.count()
    got, info = shd.rank(text=("body", query, 10), where=where, columns=["id", "cl"])
    # every row the local dataset scores, ranked by (score desc, key asc)
    every, _ = rank(local, text=("body", query, 100_000), where=where, columns=["id"])
    want = by_key_then_score(every, "_bm25", 10)
    assert [r[0] for r in want] == got.column("id").to_pylist(), str(info)
    assert [r[1] for r in want] == got.column("_bm25").to_pylist()  # exactly: same N, df, avgdl
    assert got.column("_score").to_pylist() == got.column("_bm25").to_pylist()
    # and the local top-k's scores (its ties by row id: here key order too)
    top, _ = rank(local, text=("body", query, 10), where=where, columns=["id"])
    assert top.column("id").to_pylist() == got.column("id").to_pylist()
    assert got.column_names == ["id", "cl", "_bm25", "_score"]
    if filtered:
        assert 1 not in got.column("cl").to_pylist()
    if got.num_rows:
        assert "bm25 statistics gathered from 3 shards" in str(info)


def test_a_shards_own_statistics_would_give_other_scores(pair) -> None:
    """The attack the gathering answers: each shard scoring with its own N and df
    ranks differently from one dataset (so a merge of per-shard BM25 is wrong)."""
    import ray

    local, shd = pair
    every, _ = rank(local, text=("body", "gold chips", 100_000), columns=["id"])
    want = dict(zip(every.column("id").to_pylist(), every.column("_bm25").to_pylist()))
    own = ray.get(
        [
            a.rank.remote(None, ("body", "gold chips", 10), None, {}, ["id"], None)
            for a in shd.actors
        ]
    )
    differs = sum(
        abs(s - want[k]) > 1e-9
        for _, t, *_ in own
        for k, s in zip(t.column("id").to_pylist(), t.column("_bm25").to_pylist())
    )
    assert differs > 0


@pytest.mark.parametrize("recency", [False, True])
def test_hybrid_rank_over_shards_equals_local(pair, recency) -> None:
    local, shd = pair
    v = np.random.default_rng(8).standard_normal(8).astype(np.float32)
    where = Binary("!=", Column("cl"), Literal(3, "int"))
    fusion = Fusion(rrf_k=30, limit=12, recency="ts" if recency else None, half_life_s=3 * 86400)
    params = {NOW_PARAM: NOW}
    kw = {"where": where, "params": params, "columns": ["id", "ts"], "strategy": "exact"}
    want, _ = rank(
        local, vector=("emb", v, 20), text=("body", "fed rates oil", 20), fusion=fusion, **kw
    )
    got, info = shd.rank(
        vector=("emb", v, 20), text=("body", "fed rates oil", 20), fusion=fusion, **kw
    )
    assert got.column_names == want.column_names
    assert got.column("id").to_pylist() == want.column("id").to_pylist(), str(info)
    for c in ("_distance", "_bm25", "_score"):  # null where the row is not in that arm
        g, w = got.column(c).to_pylist(), want.column(c).to_pylist()
        assert [x is None for x in g] == [x is None for x in w], c
        assert [x for x in g if x is not None] == pytest.approx(
            [x for x in w if x is not None], rel=1e-12
        ), c
    assert sum(x is None for x in got.column("_bm25").to_pylist()) > 0  # both arms count
    assert got.column("ts").equals(want.column("ts"))
    assert info.executed.startswith("vector exact + keyword") and info.executed.endswith("rrf")


YAML = """\
executor: ray
datasets:
  loc:
    schema: {id: int, ts: timestamp, cl: int, body: str, emb: 'vector[8]'}
    key: id
    indexes: {emb: hnsw, body: inverted, cl: btree}
    embed: {from: body, into: emb, model: hash}
  shd:
    schema: {id: int, ts: timestamp, cl: int, body: str, emb: 'vector[8]'}
    key: id
    indexes: {emb: hnsw, body: inverted, cl: btree}
    embed: {from: body, into: emb, model: hash}
    shards: 2
bindings: [agents/]
"""

KEYWORD = """\
binding: kw_{name}
session: {{q: str}}
sources:
  d:
    from: dataset://{name}
    search: {{column: body, query: "{{{{session.q}}}}", k: 8}}
    where: cl != 1
select: [d.id, d._score]
order_by: d._score desc
"""


@pytest.mark.slow
def test_embed_and_search_on_a_sharded_fabric_dataset_equal_local(ray_cluster, tmp_path) -> None:
    """One fabric, the same rows (without vectors) upserted into a local dataset and a
    dataset of 2 shards, both with ``embed:``: the shards compute the vectors the local
    one does, and a ``search:`` binding gives the same rows and scores."""
    import fabric

    (tmp_path / "agents").mkdir()
    for name in ("loc", "shd"):
        (tmp_path / "agents" / f"{name}.yaml").write_text(KEYWORD.format(name=name))
    (tmp_path / "fabric.yaml").write_text(textwrap.dedent(YAML))
    rows = docs(np.arange(0, 900), 5).drop_columns(["emb"])
    with fabric.open(str(tmp_path / "fabric.yaml"), watch=False) as fab:
        shd = fab.dataset("shd")
        assert isinstance(shd, ShardedDataset)
        assert fab.dataset("loc").upsert(rows) == 900
        assert shd.upsert(rows) == 900
        a = fab.dataset("loc").to_table()
        b = shd.scan()
        a = a.take(pc.sort_indices(a, [("id", "ascending")]))
        b = b.take(pc.sort_indices(b, [("id", "ascending")]))
        assert b.num_rows == 900 and b.column("emb").null_count == 0
        assert b.equals(a.select(b.column_names))
        q = np.asarray(a.column("emb")[17].as_py(), np.float32)
        near = shd.search("emb", q, 1, strategy="exact", columns=["id"])
        assert near.column("id").to_pylist() == [17]
        for q in ("fed rates", "gold chips", "nothing"):
            want = fab.query("kw_loc", session={"q": q}).table
            got = fab.query("kw_shd", session={"q": q})
            assert got.table.column("id").to_pylist() == want.column("id").to_pylist()
            assert got.table.column("_score").to_pylist() == want.column("_score").to_pylist()
            assert got.stats["sources"]["d"]["strategy"].startswith("keyword ")
