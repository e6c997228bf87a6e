"""The retrieval suite's cases on a dataset sharded over Ray actors (fabric.ray.shards).

tests/test_retrieval.py's data (5,000 x 32-d in 16 clusters, B-tree / inverted indexes)
and its filters are put in one local dataset and in 2 shards (rows by key hash). For
every filter and strategy the sharded answer is checked against numpy brute force as
the local suite checks the local one: identical ids and distances whenever every shard
answered exactly, the same recall floor otherwise; and the same cases through a
``nearest:`` binding on ``fabric.open(..., executor="ray")`` give local mode's table.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from connectors.base import ScanRequest
from connectors.dataset import DatasetSource
from fabric.ray.shards import ShardedDataset, ShardedSource
from indexes import STRATEGIES, Dataset, IndexSpec
from tests import ray_support
from tests.test_retrieval import DIM, FILTERS, PARAMS, SCHEMA, K, data, lt, queries, truth

pytestmark = [pytest.mark.ray]

ray_cluster = ray_support.ray_cluster

INDEXES = {
    "emb": IndexSpec("hnsw", metric="l2", ef=64),
    "ts": "btree",
    "rnd": "btree",
    "corr": "btree",
    "cat": "btree",
    "body": "inverted",
}


@pytest.fixture(scope="module")
def sharded(ray_cluster, tmp_path_factory):
    t, x = data()
    local = Dataset.create("news", SCHEMA, "id", INDEXES, fold_rows=1000)
    local.upsert(t)
    local.flush()
    ds = ShardedDataset(
        ray_cluster,
        "news",
        SCHEMA,
        "id",
        INDEXES,
        shards=2,
        state_dir=tmp_path_factory.mktemp("shards"),
    )
    try:
        assert ds.upsert(t) == t.num_rows
        ds.flush()
        yield ds, local, x, t
    finally:
        ds.close()


def test_rows_split_by_key_and_statistics_add_up(sharded) -> None:
    ds, local, _x, t = sharded
    keys = ds.keys_per_shard()
    assert all(keys) and not set(keys[0]) & set(keys[1])
    assert sorted(keys[0] + keys[1]) == t.column("id").to_pylist()
    mine, theirs = ds.statistics(), local.statistics()
    assert mine["rows"] == theirs["rows"] == t.num_rows
    for c in ("ts", "rnd", "corr", "cat"):
        a, b = mine["indexes"][c], theirs["indexes"][c]
        assert (a["min"], a["max"], a["nulls"], a["rows"]) == (
            b["min"],
            b["max"],
            b["nulls"],
            b["rows"],
        ), c
    assert [s["rows"] for s in mine["shards"]] == [len(k) for k in keys]


@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.parametrize("strategy", [*STRATEGIES, None])
def test_every_strategy_on_shards_matches_exact_brute_force(sharded, name, strategy) -> None:
    ds, local, x, t = sharded
    where = FILTERS[name]
    recalls = []
    for q in queries(10):
        exp = truth(x, t, q, where)
        res, info = ds.search_explained(
            "emb", q, K, where, PARAMS, strategy=strategy, columns=["id"]
        )
        assert res.column_names == ["id", "_distance"]
        assert res.schema.field("_distance").type == pa.float32()
        got = np.array(res.column("id").to_pylist(), dtype=np.int64)
        d = res.column("_distance").to_numpy()
        assert np.all(np.diff(d) >= -1e-5), "distances ascend"
        assert len(info.shards) == 2 and len(info.shard_ms) == 2
        if info.guarantee == "exact":
            assert got.tolist() == exp.tolist(), str(info)
            want, _ = local.search("emb", q, K, where, PARAMS, strategy="exact", columns=["id"])
            np.testing.assert_allclose(d, want.column("_distance").to_numpy(), rtol=1e-5)
        if info.executed in ("prefilter", "exact"):  # every shard exact: exact overall
            assert info.guarantee == "exact", str(info)
        recalls.append(
            len(np.intersect1d(got, exp)) / max(len(exp), 1) if len(exp) else float(len(got) == 0)
        )
        assert (
            len(got) == min(K, len(exp))
            or "postfilter" in info.executed
            or ("insearch" in info.executed)
        )
    assert np.mean(recalls) >= (0.9 if strategy in ("postfilter", "insearch") else 0.99), (
        name,
        strategy,
        np.mean(recalls),
    )


def test_the_weakest_shard_decides_the_guarantee() -> None:
    from fabric.ray.shards import _weakest

    assert _weakest(["exact", "exact"]) == "exact"
    assert _weakest(["exact", "graph"]) == "graph"
    assert _weakest(["graph", "unverified: walk cut"]) == "unverified: walk cut"


def test_scans_through_the_sharded_source_give_the_local_rows(sharded) -> None:
    ds, local, _x, _t = sharded
    src, lsrc = ShardedSource("dataset://news", ds), DatasetSource("dataset://news", local)
    where = lt("rnd", 0.3)
    req = ScanRequest(columns=("id", "rnd", "cat"), filters=(where,))
    got = pa.Table.from_batches(list(src.scan(req))).sort_by("id")
    want = pa.Table.from_batches(list(lsrc.scan(req))).sort_by("id")
    assert got.equals(want) and want.num_rows > 0
    limited = pa.Table.from_batches(list(src.scan(ScanRequest(columns=("id",), limit=7))))
    assert limited.num_rows == 7
    assert src.statistics().row_count == lsrc.statistics().row_count
    assert src.statistics().columns["rnd"] == lsrc.statistics().columns["rnd"]
    for e in FILTERS.values():
        if e is not None:
            assert src.supports_filter(e) == lsrc.supports_filter(e), e


NEAREST = (
    "binding: near\nsession:\n  q: vector[{dim}]\n  cats: list[str]\nsources:\n  n:\n"
    "    from: dataset://news\n"
    '    nearest: {{column: emb, to: "{{{{session.q}}}}", k: 10}}\n'
    '    where: "{where}"\n'
    "select: [n.id, n.cat, n._distance]\n"
    "order_by: [n._distance, n.id]\n"
)


@pytest.mark.parametrize(
    "where",
    ["rnd < 0.2", "corr < 1.6", "cat in {{session.cats}}", "match(body, 'rare') or corr < 0.3"],
)
def test_a_nearest_binding_on_ray_over_shards_equals_local_mode(sharded, tmp_path, where) -> None:
    import fabric

    ds, local, _x, _t = sharded
    (tmp_path / "b.yaml").write_text(NEAREST.format(dim=DIM, where=where))
    cfg = {"bindings": [str(tmp_path)]}
    with (
        fabric.open(
            cfg,
            ingest=False,
            watch=False,
            dataset_sources={"news": DatasetSource("dataset://news", local)},
        ) as here,
        fabric.open(
            cfg,
            ingest=False,
            watch=False,
            executor="ray",
            dataset_sources={"news": ShardedSource("dataset://news", ds)},
        ) as on_ray,
    ):
        assert on_ray.executor is not None and here.executor is None
        for q in queries(5):
            session = {"q": q, "cats": PARAMS["cats"]}
            mine = here.query("near", session=session)
            got = on_ray.query("near", session=session)
            entry = got.stats["sources"]["n"]
            assert entry["guarantee"] in ("exact", "graph"), entry
            assert got.table.column_names == mine.table.column_names == ["id", "cat", "_distance"]
            if entry["guarantee"] == "exact" and mine.stats["sources"]["n"]["guarantee"] == "exact":
                assert got.table.select(["id", "cat"]).equals(mine.table.select(["id", "cat"]))
                np.testing.assert_allclose(
                    got.table.column("_distance").to_numpy(),
                    mine.table.column("_distance").to_numpy(),
                    rtol=1e-5,
                )
            else:  # a graph answer on either side: the recall floor of the local suite
                a, b = got.table.column("id").to_pylist(), mine.table.column("id").to_pylist()
                assert len(set(a) & set(b)) >= 0.8 * len(b), (a, b)


def test_ranked_retrieval_through_the_sharded_source_equals_the_local_source(sharded) -> None:
    """``search:`` over the shards (was refused): BM25 with the whole dataset's
    statistics, so keys and scores are the local dataset's (ties by key)."""
    from connectors.dataset import DatasetSource

    ds, local, _x, _t = sharded
    for q in ("fed", "rare", "oil chips rare", "nothing"):
        got, info = ShardedSource("dataset://news", ds).rank(text=("body", q, 10))
        every, _ = DatasetSource("dataset://news", local).rank(text=("body", q, 10**6))
        want = sorted(
            zip(every.column("id").to_pylist(), every.column("_bm25").to_pylist(), strict=True),
            key=lambda r: (-r[1], r[0]),
        )[:10]
        assert got.column("id").to_pylist() == [k for k, _ in want], (q, str(info))
        assert got.column("_bm25").to_pylist() == [s for _, s in want], q


def test_a_delete_by_numpy_keys_reaches_the_shard_that_holds_each_row(sharded) -> None:
    """Rows are routed by their key as the key column gives it (a Python int); a delete
    with the keys as numpy integers (``np.arange``, a column's ``to_numpy``) was routed
    by ``repr(np.int64(k))``, another shard for most keys: it deleted nothing there and
    said so only in its count, leaving rows the caller believed gone."""
    ds, _local, _x, t = sharded
    fresh = t.slice(0, 40).set_column(
        0, "id", pa.array(np.arange(10**6, 10**6 + 40, dtype=np.int64))
    )
    assert ds.upsert(fresh) == 40
    ids = np.arange(10**6, 10**6 + 40, dtype=np.int64)
    assert ds.delete(list(ids)) == 40
    assert not set(ids.tolist()) & {k for ks in ds.keys_per_shard() for k in ks}
