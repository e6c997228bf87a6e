"""Indexed datasets sharded across Ray actors (fabric.ray.shards), on the real Kafka broker.

A 4-partition topic feeds 2 shard actors (partitions 0, 2 and 1, 3), one consumer each in
one group, each with its own HNSW / B-tree indexes and its own checkpoints. Checked:
every key in exactly one shard; scatter/gather top-k equals one local dataset holding
every row (exact strategy); freshness is fresh only when every shard is; a shard actor
killed while ingesting is restarted by Ray from its checkpoint and ends with every key
exactly once, holding each key's latest value."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import Producer

from connectors._util import schema_from_spec
from fabric.ray.shards import ShardedDataset, aggregate_freshness
from indexes.dataset import Dataset
from tests import ray_support

pytestmark = [pytest.mark.ray, pytest.mark.servers, pytest.mark.kafka]

ray_cluster = ray_support.ray_cluster

SCHEMA = schema_from_spec({"id": "str", "n": "int", "vec": "vector[8]"})
INDEXES = {"vec": "hnsw", "n": "btree"}
RNG = np.random.default_rng(16)
VECS = RNG.standard_normal((2, 6000, 8)).astype(np.float32)  # [version][key]


def doc(i: int, version: int = 0) -> dict:
    return {"id": f"k{i}", "n": i * 10 + version, "vec": VECS[version][i].tolist()}


def produce(bootstrap: str, topic: str, docs: list[dict]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for d in docs:
        p.produce(topic, key=d["id"].encode(), value=json.dumps(d).encode())
        p.poll(0)
    assert p.flush(30) == 0


def sharded(cluster, bootstrap, topic, state_dir, interval=10.0) -> ShardedDataset:
    return ShardedDataset(
        cluster,
        "docs",
        SCHEMA,
        "id",
        INDEXES,
        shards=2,
        state_dir=state_dir,
        kafka={
            "bootstrap": bootstrap,
            "topic": topic,
            "partitions": [0, 1, 2, 3],
            "group_id": f"fabric.test.{topic}",
            "checkpoint_interval": interval,
            "batch_size": 500,
        },
    )


def test_every_key_in_one_shard_and_top_k_equals_one_local_dataset(
    ray_cluster, kafka_bootstrap, new_topic, tmp_path
) -> None:
    topic = new_topic(partitions=4, prefix="ray_shards")
    docs = [doc(i) for i in range(3000)]
    produce(kafka_bootstrap, topic, docs)
    ds = sharded(ray_cluster, kafka_bootstrap, topic, tmp_path)
    try:
        assert ds.wait_caught_up(120)
        info = ds.info()
        assert [i["partitions"] for i in info] == [[0, 2], [1, 3]]
        keys = ds.keys_per_shard()
        assert all(keys) and not set(keys[0]) & set(keys[1])
        assert sorted(keys[0] + keys[1]) == sorted(d["id"] for d in docs)
        assert ds.count() == 3000
        local = Dataset.create("docs", SCHEMA, "id", INDEXES)
        local.upsert(pa.Table.from_pylist(docs, schema=SCHEMA))
        for q in RNG.standard_normal((5, 8)).astype(np.float32):
            got = ds.search("vec", q, 10, columns=["id", "n"], strategy="exact")
            want, _ = local.search("vec", q, 10, columns=["id", "n"], strategy="exact")
            assert got["id"].to_pylist() == want["id"].to_pylist()
            np.testing.assert_allclose(
                got["_distance"].to_numpy(), want["_distance"].to_numpy(), rtol=1e-6
            )
        assert len(ds.last_shard_ms) == 2
        assert ds.freshness()["status"] == "fresh"
    finally:
        ds.close()


def test_freshness_is_fresh_only_when_every_shard_is() -> None:
    ok = {"caught_up": True, "lag_messages": 0}
    assert aggregate_freshness([ok, ok], 1000)["status"] == "fresh"
    behind = {"caught_up": False, "lag_messages": 5000}
    agg = aggregate_freshness([ok, behind], 1000)
    assert (agg["status"], agg["lag_messages"]) == ("stale", 5000)
    unknown = {"caught_up": False, "lag_messages": None}
    assert aggregate_freshness([ok, unknown], 1000)["status"] == "stale"


@pytest.mark.slow
def test_a_killed_shard_restarts_from_its_checkpoint_with_every_key_once(
    ray_cluster, kafka_bootstrap, new_topic, tmp_path
) -> None:
    topic = new_topic(partitions=4, prefix="ray_kill")
    first = [doc(i) for i in range(3000)]
    produce(kafka_bootstrap, topic, first)
    ds = sharded(ray_cluster, kafka_bootstrap, topic, tmp_path, interval=0.2)
    try:
        assert ds.wait_caught_up(120)
        before = ds.info()
        # new keys and new versions of old ones, then shard 0 dies while they arrive
        second = [doc(i) for i in range(3000, 6000)] + [doc(i, 1) for i in range(0, 3000, 3)]
        produce(kafka_bootstrap, topic, second)
        ds.kill_shard(0)
        deadline = time.monotonic() + 120
        while True:
            try:
                after = ds.info()
                if after[0]["pid"] != before[0]["pid"]:
                    break
            except Exception:  # the actor is being restarted
                pass
            assert time.monotonic() < deadline, "shard 0 was not restarted"
            time.sleep(0.5)
        assert after[0]["resumed_offsets"], "restarted from a checkpoint, not from scratch"
        assert after[0]["loaded_rows"] > 0
        assert ds.wait_caught_up(120)
        keys = ds.keys_per_shard()
        assert not set(keys[0]) & set(keys[1])
        flat = keys[0] + keys[1]
        assert len(flat) == len(set(flat)) == 6000  # nothing lost, nothing doubled
        assert ds.count() == 6000
        latest = {d["id"]: d for d in first + second}
        for k in ("k0", "k3", "k2999", "k1", "k5999"):
            q = np.asarray(latest[k]["vec"], np.float32)
            got = ds.search("vec", q, 1, columns=["id", "n"], strategy="exact")
            assert (got["id"][0].as_py(), got["n"][0].as_py()) == (k, latest[k]["n"]), k
    finally:
        ds.close()
