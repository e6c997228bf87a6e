"""DatasetManager: datasets from declarations, restart from checkpoints, schema changes."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from connectors._util import schema_from_spec
from fabric.datasets import DatasetDecl, DatasetManager
from fabric.freshness import FreshnessTracker
from fabric.ingest import checkpoint

SCHEMA = schema_from_spec({"id": "str", "n": "int", "body": "str"})


def produce(bootstrap: str, topic: str, start: int, stop: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(start, stop):
        p.produce(
            topic,
            key=f"k{i}",
            value=json.dumps({"id": f"k{i}", "n": i, "body": f"w{i % 9}"}).encode(),
        )
    assert p.flush(30) == 0


def manager(bootstrap: str, topic: str, state, schema=SCHEMA, tracker=None) -> DatasetManager:
    decls = [
        DatasetDecl(
            "docs", schema, "id", {"n": "btree", "body": "inverted"}, f"kafka://bus/{topic}"
        ),
        DatasetDecl("notes", pa.schema([("id", pa.string()), ("text", pa.string())]), "id"),
    ]
    return DatasetManager(
        decls, connections={"bus": {"kind": "kafka", "bootstrap": bootstrap}}, state_dir=state, tracker=tracker,
        config_name="proj", checkpoint_interval=0,
    )  # fmt: skip


def test_restart_resumes_from_the_checkpoint_without_reconsuming(
    kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=2, prefix="mgr")
    produce(kafka_bootstrap, topic, 0, 300)
    tr = FreshnessTracker()
    m = manager(kafka_bootstrap, topic, tmp_path, tracker=tr).start()
    assert m.wait_caught_up(30)
    assert m.group_id("docs") == "fabric.proj.docs"
    assert m.ingestors["docs"].options.group_id == "fabric.proj.docs"
    assert "notes" not in m.ingestors and m.dataset("notes").count() == 0
    m.dataset("notes").upsert(pa.table({"id": ["a"], "text": ["hello"]}))
    m.save("notes")
    m.stop()  # final checkpoint

    produce(kafka_bootstrap, topic, 300, 350)
    m2 = manager(kafka_bootstrap, topic, tmp_path).start()
    assert m2.dataset("docs").count() == 300  # loaded before consuming anything
    assert m2.wait_caught_up(30)
    assert m2.dataset("docs").count() == 350
    assert m2.ingestors["docs"].stats.applied == 50  # only the new messages
    assert m2.dataset("notes").get("a")["text"] == "hello"
    m2.stop()


def test_schema_change_rebuilds_a_kafka_dataset_but_refuses_for_an_upsert_only_one(
    kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=1, prefix="mgr_schema")
    produce(kafka_bootstrap, topic, 0, 20)
    m = manager(kafka_bootstrap, topic, tmp_path).start()
    assert m.wait_caught_up(30)
    m.dataset("notes").upsert(pa.table({"id": ["a"], "text": ["hello"]}))
    m.save("notes")
    m.stop()
    wider = schema_from_spec({"id": "str", "n": "int", "body": "str", "extra": "str"})
    m2 = manager(kafka_bootstrap, topic, tmp_path, schema=wider).start()
    assert m2.wait_caught_up(30) and m2.dataset("docs").count() == 20  # rebuilt from the topic
    assert m2.dataset("docs").schema.names[-1] == "extra"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("docs.replaced-")]
    m2.stop()

    changed = [DatasetDecl("notes", pa.schema([("id", pa.string()), ("body", pa.string())]), "id")]
    with pytest.raises(ValueError, match=r"notes: the saved copy .* cannot be rebuilt"):
        DatasetManager(changed, state_dir=tmp_path).open()


def test_declaration_errors_name_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match=r"unknown connection 'bsu'.*did you mean 'bus'"):
        DatasetManager(
            [DatasetDecl("docs", SCHEMA, "id", {}, "kafka://bsu/t")],
            connections={"bus": {"kind": "kafka", "bootstrap": "x:1"}},
            state_dir=tmp_path,
        )
    m = DatasetManager([], state_dir=tmp_path)
    with pytest.raises(KeyError, match="unknown dataset 'nope'"):
        m.dataset("nope")


def test_ingests_from_the_second_broker_too(tansu_bootstrap, tansu_topic, tmp_path):
    """Tansu (a different Kafka-protocol implementation): same final state. Its high
    watermark is approximate for batched produce, so only the data is compared."""
    topic = tansu_topic(partitions=2, prefix="mgr_tansu")
    produce(tansu_bootstrap, topic, 0, 2000)
    m = manager(tansu_bootstrap, topic, tmp_path).start()
    try:
        ds = m.dataset("docs")
        deadline = time.monotonic() + 60
        while ds.count() < 2000 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ds.count() == 2000
        assert ds.get("k1999")["n"] == 1999
    finally:
        m.stop()
    assert sum(checkpoint.latest(tmp_path / "docs").offsets.values()) >= 2000


def test_a_second_process_on_the_same_state_ingests_in_memory_only(
    kafka_bootstrap, new_topic, tmp_path
):
    topic = new_topic(partitions=1, prefix="mgr_lock")
    produce(kafka_bootstrap, topic, 0, 100)
    first = manager(kafka_bootstrap, topic, tmp_path).start()
    second = manager(
        kafka_bootstrap, topic, tmp_path
    ).start()  # e.g. fabric serve + an agent's fabric.open()
    try:
        assert first.wait_caught_up(30) and second.wait_caught_up(30)
        assert first.dataset("docs").count() == second.dataset("docs").count() == 100
        assert first.ingestors["docs"].state_dir is not None
        assert second.ingestors["docs"].state_dir is None  # only one checkpoint writer
    finally:
        second.stop()
        first.stop()
    assert checkpoint.latest(tmp_path / "docs").offsets == {0: 100}
