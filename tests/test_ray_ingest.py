"""The ingestion suite's cases with one consumer per shard on Ray (fabric.ray.shards).

tests/test_ingest.py's message streams (upserts, repeated keys, tombstones, bad
messages) go to a 4-partition topic on the real broker and are ingested twice: by one
local ``KafkaIngestor`` into one dataset, and by 2 shard actors (partitions 0, 2 and
1, 3; one consumer group). The sharded dataset must end with exactly the local
dataset's rows (and what the producer last wrote per key), and the bad messages must
be dead-lettered with the same reasons at the same offsets. (The shard killed while
ingesting is tests/test_ray_shards.py.)"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from connectors._util import schema_from_spec
from fabric.ingest import IngestOptions, KafkaIngestor
from fabric.ray.shards import ShardedDataset
from indexes.dataset import Dataset
from tests import ray_support
from tests.test_ingest import INDEXES, SCHEMA, Produced, doc

pytestmark = [pytest.mark.ray, pytest.mark.servers, pytest.mark.kafka, pytest.mark.slow]

ray_cluster = ray_support.ray_cluster


def ingest_locally(bootstrap: str, topic: str, **opts) -> Dataset:
    ds = Dataset.create("docs", schema_from_spec(SCHEMA), "id", INDEXES)
    ing = KafkaIngestor(
        "docs", ds, IngestOptions(bootstrap, topic, f"fabric.test.local.{topic}", **opts)
    ).start()
    try:
        assert ing.wait_caught_up(60)
    finally:
        ing.stop(checkpoint_now=False)
    return ds


def sharded(cluster, bootstrap: str, topic: str, state_dir, **kafka) -> ShardedDataset:
    return ShardedDataset(
        cluster,
        "docs",
        schema_from_spec(SCHEMA),
        "id",
        INDEXES,
        shards=2,
        state_dir=state_dir,
        kafka={
            "bootstrap": bootstrap,
            "topic": topic,
            "partitions": [0, 1, 2, 3],
            "group_id": f"fabric.test.shards.{topic}",
            "batch_size": 300,
            **kafka,
        },
    )


def rows(t: pa.Table) -> list[dict]:
    return t.sort_by("id").to_pylist()


def test_upserts_repeats_and_tombstones_end_as_local_ingestion_does(
    ray_cluster, kafka_bootstrap, new_topic, tmp_path
) -> None:
    topic = new_topic(partitions=4, prefix="ray_ingest_ops")
    prod = Produced(kafka_bootstrap, topic)
    for i in range(2000):
        prod.send(f"k{i}", doc(f"k{i}", i))
    for i in range(0, 2000, 3):  # a newer version of a third of the keys
        prod.send(f"k{i}", doc(f"k{i}", i + 10_000))
    for i in range(0, 2000, 5):  # tombstones for a fifth
        prod.send(f"k{i}", None)
    for i in range(0, 2000, 25):  # deleted, then written again
        prod.send(f"k{i}", doc(f"k{i}", i + 20_000))
    prod.send(None, None)  # a tombstone without a key: a dead letter, not a row
    prod.flush()
    local = ingest_locally(kafka_bootstrap, topic, dead_letter="none")
    ds = sharded(ray_cluster, kafka_bootstrap, topic, tmp_path, dead_letter="none")
    try:
        assert ds.wait_caught_up(120)
        got = ds.scan()
        keys = got.column("id").to_pylist()
        assert len(keys) == len(set(keys)), "a key is held by two shards or twice"
        assert rows(got) == rows(local.to_table())
        assert {r["id"]: r["n"] for r in got.to_pylist()} == {
            k: v["n"] for k, v in prod.expected.items()
        }
        assert ds.count() == local.count() == len(prod.expected)
        stats = ds.ingest_stats()
        assert sum(s["deleted"] for s in stats) > 0 and sum(s["dead_letters"] for s in stats) == 1
        for q in np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32):
            a = ds.search("vec", q, 10, columns=["id", "n"], strategy="exact")
            b, _ = local.search("vec", q, 10, columns=["id", "n"], strategy="exact")
            assert sorted(a["_distance"].to_pylist()) == sorted(b["_distance"].to_pylist())
        assert ds.freshness()["status"] == "fresh"
    finally:
        ds.close()


def test_bad_messages_are_dead_lettered_by_their_shard_as_locally(
    ray_cluster, kafka_bootstrap, new_topic, tmp_path
) -> None:
    topic = new_topic(partitions=4, prefix="ray_ingest_bad")
    prod = Produced(kafka_bootstrap, topic)
    bad = {
        prod.send("big", b'{"id": "big", "body": "' + b"x" * 5000 + b'"}'): "exceeds",
        prod.send("nokey", {"n": 3}): "missing key field 'id'",
        prod.send("v", {"id": "v", "vec": [1, 2]}): "vector of 4",
        prod.send("arr", b"[1, 2, 3]"): "expected a JSON object",
    }
    for i in range(400):
        prod.send(f"k{i}", doc(f"k{i}", i))
    prod.flush()
    log = tmp_path / "local-dead.jsonl"
    local = ingest_locally(kafka_bootstrap, topic, max_message_bytes=4096, dead_letter=f"log:{log}")
    ds = sharded(
        ray_cluster,
        kafka_bootstrap,
        topic,
        tmp_path / "s",
        max_message_bytes=4096,
        dead_letter="log",
    )
    try:
        assert ds.wait_caught_up(120)
        assert rows(ds.scan()) == rows(local.to_table())
        assert ds.count() == 400
        ds.close()  # the shards' logs are complete once their ingestors stopped
        shard_logs = sorted((tmp_path / "s").glob("shard-*/dead-letters.jsonl"))
        assert shard_logs, "each shard that met a bad message wrote its own log"

        def letters(paths) -> set[tuple[int, int, str]]:
            out = set()
            for p in paths:
                for line in p.read_text().splitlines():
                    x = json.loads(line)
                    out.add((x["partition"], x["offset"], x["error"]))
            return out

        mine, theirs = letters(shard_logs), letters([log])
        assert mine == theirs and len(mine) == len(bad)
        for i, reason in bad.items():
            part, off = prod.where[i]
            assert any(p == part and o == off and reason in e for p, o, e in mine), reason
    finally:
        ds.close()
