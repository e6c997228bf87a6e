"""Dataset features on sharded datasets (issue 16), each compared with local mode on the
same data.

- ``embed:`` runs in every shard, on the shard's part of each write, and gives the
  vectors a local dataset computes;
- BM25 (``search:``) over shards gathers every shard's document count, token lengths and
  document frequencies first, so every row's score is the one a single dataset holding
  every row gives it, and the top-k over shards is the unsharded top-k (ties by key);
  with a filter, and fused with a vector arm (RRF, recency) as ``rank:`` does;
- ``refresh:`` from a table (full and append) writes to the shards by key and
  checkpoints in every shard, holding the rows local mode holds, also after a reopen;
- ``retention:`` is applied by every shard on its own timer, deleting the rows a local
  dataset's manager deletes.
"""

from __future__ import annotations

import datetime as dt
import textwrap
import time

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


REFRESH_YAML = """\
connections:
  shop: {{kind: mysql, url: "{url}"}}
executor: ray
datasets:
{datasets}
bindings: [agents/]
"""

REFRESH_DATASET = """\
  {name}:
    from: mysql://shop/{table}
    key: id
    schema: {{id: int, v: int, body: str, updated_at: timestamp}}
    indexes: {{v: btree, body: inverted}}
    refresh: {refresh}
"""

ALL_ROWS = """\
binding: all_{name}
sources:
  d: {{from: "dataset://{name}", freshness: {{max_lag: 1h, on_stale: flag}}}}
select: [d.id, d.v]
"""


def _sorted(t: pa.Table) -> pa.Table:
    return t.take(pc.sort_indices(t, [("id", "ascending")]))


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.mariadb
def test_refresh_on_shards_equals_local_and_resumes_from_the_shards_checkpoints(
    ray_cluster, tmp_path, mariadb_url
) -> None:
    """The same MariaDB table refreshed into local datasets and into datasets of 2
    shards, ``mode: full`` (rows gone from the table are deleted) and ``mode: append``
    (by a cursor): after the first refresh, after updates, deletes and inserts and a
    refresh, and after a reopen (rows and cursor from the shards' checkpoints) the
    sharded rows equal the local ones, and so do what each refresh read and deleted."""
    import sqlalchemy as sa

    import fabric

    table = f"r_items_{int(time.time() * 1000) % 10**9}"
    eng = sa.create_engine(mariadb_url)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    words = ["fed rates", "gold", "oil jobs", "chips ai", "bank"]

    def rows(lo: int, hi: int, v: int = 0, at: int = 0) -> list[dict]:
        return [
            {"i": i, "v": i + v, "b": words[i % 5], "t": t0 + dt.timedelta(seconds=i + at)}
            for i in range(lo, hi)
        ]

    insert = sa.text(f"insert into {table} values (:i, :v, :b, :t)")
    with eng.begin() as c:
        c.execute(
            sa.text(
                f"create table {table} (id int primary key, v int, body varchar(64), "
                "updated_at datetime(6))"
            )
        )
        c.execute(insert, rows(0, 400))
    (tmp_path / "agents").mkdir()
    modes = {
        "full": "{mode: full, every: 1h}",
        "app": "{mode: append, cursor: updated_at, every: 1h}",
    }
    blocks = []
    for mode, refresh in modes.items():
        for name in (f"loc_{mode}", f"shd_{mode}"):
            blocks.append(REFRESH_DATASET.format(name=name, table=table, refresh=refresh))
            if name.startswith("shd"):
                blocks.append("    shards: 2\n")
            (tmp_path / "agents" / f"{name}.yaml").write_text(ALL_ROWS.format(name=name))
    cfg = tmp_path / "fabric.yaml"
    cfg.write_text(REFRESH_YAML.format(url=mariadb_url, datasets="".join(blocks)))

    def same(fab, mode: str) -> pa.Table:
        loc = _sorted(fab.dataset(f"loc_{mode}").to_table())
        shd = _sorted(fab.dataset(f"shd_{mode}").scan())
        assert shd.equals(loc.select(shd.column_names)), mode
        return shd

    try:
        with fabric.open(str(cfg), watch=False) as fab:
            assert isinstance(fab.dataset("shd_full"), ShardedDataset)
            for mode in modes:
                assert same(fab, mode).num_rows == 400
                res = fab.query(f"all_shd_{mode}")
                assert res.table.num_rows == 400
                assert res.freshness["d"]["status"] == "fresh", res.freshness
            keys = fab.dataset("shd_full").keys_per_shard()
            assert all(keys) and sum(map(len, keys)) == 400  # split by key
            with eng.begin() as c:
                c.execute(sa.text(f"delete from {table} where id < 30"))
                c.execute(
                    sa.text(f"update {table} set v = -v, updated_at = :t where id % 10 = 3"),
                    {"t": t0 + dt.timedelta(seconds=1000)},
                )
                c.execute(insert, rows(400, 450, at=500))
            for mode in modes:
                want = fab.refresh(f"loc_{mode}")
                got = fab.refresh(f"shd_{mode}")
                assert (got["rows_read"], got["deleted"], got["mode"]) == (
                    want["rows_read"],
                    want["deleted"],
                    want["mode"],
                ), mode
                same(fab, mode)
            assert same(fab, "full").num_rows == 420  # 30 deleted, 50 added
            assert same(fab, "app").num_rows == 450  # append keeps deleted rows
        with eng.begin() as c:
            c.execute(insert, rows(450, 460, at=600))
        with fabric.open(str(cfg), watch=False) as fab:  # not due (every: 1h): checkpoints
            for mode in modes:
                assert fab.service.manager.refreshers[f"shd_{mode}"].refreshes == 0
                same(fab, mode)
                want = fab.refresh(f"loc_{mode}")
                got = fab.refresh(f"shd_{mode}")
                assert got["rows_read"] == want["rows_read"], mode  # append: past the cursor
                same(fab, mode)
            assert fab.refresh("shd_app")["rows_read"] == 1  # the boundary row only
    finally:
        with eng.begin() as c:
            c.execute(sa.text(f"drop table if exists {table}"))


RETAIN_DATASET = """\
  {name}:
    schema: {{id: int, ts: timestamp, v: int}}
    key: id
    indexes: {{ts: btree}}
    retention: 1h
    time_column: ts
"""


@pytest.mark.slow
def test_retention_is_applied_by_every_shard_as_by_a_local_dataset(ray_cluster, tmp_path) -> None:
    """``retention: 1h`` by ``time_column: ts`` on a local dataset and on one of 2
    shards, the same rows written to both (ages 0-299 minutes, one null time): the
    background pass of each (the manager's, every shard's own) removes the rows older
    than an hour and keeps the null one, so both hold the same rows; an explicit pass at
    a later time removes the same rows from both."""
    import fabric

    (tmp_path / "fabric.yaml").write_text(
        "executor: ray\ndatasets:\n"
        + RETAIN_DATASET.format(name="loc")
        + RETAIN_DATASET.format(name="shd")
        + "    shards: 2\n"
    )
    now = dt.datetime.now(dt.UTC)
    ts = [now - dt.timedelta(minutes=i) for i in range(300)] + [None]
    rows = pa.table(
        {
            "id": pa.array(range(301), pa.int64()),
            "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
            "v": pa.array(range(301), pa.int64()),
        }
    )

    def ids(fab, name: str) -> list[int]:
        t = fab.dataset(name).to_table(["id"])
        return sorted(t.column("id").to_pylist())

    with fabric.open(str(tmp_path / "fabric.yaml"), watch=False) as fab:
        assert fab.dataset("loc").upsert(rows) == fab.dataset("shd").upsert(rows) == 301
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            len(ids(fab, "loc")) > 61 or len(ids(fab, "shd")) > 61
        ):
            time.sleep(0.5)
        kept = ids(fab, "loc")
        assert kept == ids(fab, "shd")
        assert kept == [*range(60), 300] or kept == [*range(61), 300], kept
        later = now + dt.timedelta(minutes=30, seconds=30)
        gone_local = fab.service.manager.expire(now=later)["loc"]
        gone_shards = fab.dataset("shd").expire(now=later)
        assert gone_local == gone_shards == len(kept) - 31
        assert ids(fab, "loc") == ids(fab, "shd") == [*range(30), 300]
