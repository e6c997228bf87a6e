"""Issue 14 finding 1: a message larger than the dataset's limit (and than the dead-letter
producer's default 1,000,000 bytes) must not lose the batch it arrives in."""

from __future__ import annotations

import json

from fabric.freshness import FreshnessTracker
from fabric.ingest import IngestOptions, KafkaIngestor
from tests.faults.helpers import (
    Watch,
    assert_replica,
    create_topic,
    delete_topic,
    dlq,
    docs,
    held,
    json_row,
    new_dataset,
    produce,
    replica,
    wait_for,
)

BIG = 2 * 1024 * 1024


def test_an_oversized_message_is_dead_lettered_and_its_batch_ingested(
    kafka_bootstrap, test_run_id, tmp_path
):
    topic = f"fabric_big_{test_run_id}"
    create_topic(kafka_bootstrap, topic, 1, **{"max.message.bytes": str(16 * 1024 * 1024)})
    try:
        big = json.dumps({"id": "big", "n": 1, "body": "x" * BIG}).encode()
        where = produce(
            kafka_bootstrap,
            topic,
            [*docs(range(1000)), ("big", big), *docs(range(1000, 2000))],
            **{"message.max.bytes": 20 * 1024 * 1024},
        )
        big_at = where[1000]
        rep = replica(kafka_bootstrap, topic, lambda v: None if len(v) > BIG else json_row(v))
        assert len(rep.rows) == 2000 and rep.invalid == {big_at}

        ds = new_dataset({"n": "btree"})
        tr = FreshnessTracker()
        opts = IngestOptions(kafka_bootstrap, topic, f"fabric.test.{topic}")  # 1 MiB limit
        ing = KafkaIngestor("docs", ds, opts, tracker=tr, state_dir=tmp_path / "state")
        with Watch(tr, "docs", lambda: len(held(ds)) == 2000) as watch:
            ing.start()
            try:
                wait_for(ing.caught_up, 60, f"caught up (count {ds.count()}, {ing.last_error})")
            finally:
                ing.stop(checkpoint_now=False)
        assert not watch.lies, watch.lies[:2]
        assert_replica(ds, rep)
        f = tr.source("docs")
        assert f.lag_messages == 0 and f.status == "fresh" and f.dead_letter_total == 1
        last = f.last_dead_letter
        assert (last["partition"], last["offset"]) == big_at
        assert "exceeds max_message_bytes" in last["error"]
        (note,) = [n["message"] for n in f.notices]  # and the truncation is said
        assert f"@{big_at[1]}" in note and "truncated to 65,536 of" in note, note
        dead = dlq(kafka_bootstrap, topic, expect=1)
        assert set(dead) == {big_at}
        h = dead[big_at]
        assert h["fabric.truncated"] == str(len(big)) and h["_bytes"] == 65536
        assert "exceeds max_message_bytes" in h["fabric.error"] and h["fabric.topic"] == topic
    finally:
        delete_topic(kafka_bootstrap, topic, wait_gone=False)
        delete_topic(kafka_bootstrap, topic + ".dlq", wait_gone=False)


def test_a_dead_letter_the_topic_refuses_goes_to_the_state_directory(
    kafka_bootstrap, test_run_id, tmp_path, monkeypatch
):
    """Issue 13 finding 13: not ./.fabric of the working directory; 0600; and it stands as a
    ``dead_letter`` error (the rows are all there)."""
    import os
    import stat

    topic = f"fabric_refused_{test_run_id}"
    create_topic(kafka_bootstrap, topic, 1, **{"max.message.bytes": str(16 * 1024 * 1024)})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    try:
        big = json.dumps({"id": "big", "n": 1, "body": "x" * BIG}).encode()
        where = produce(
            kafka_bootstrap,
            topic,
            [*docs(range(10)), ("big", big), *docs(range(10, 20))],
            **{"message.max.bytes": 20 * 1024 * 1024},
        )
        ds = new_dataset({"n": "btree"})
        tr = FreshnessTracker()
        # sent whole: the producer refuses it (message.max.bytes 1,000,000)
        opts = IngestOptions(
            kafka_bootstrap, topic, f"fabric.test.{topic}", dead_letter_max_bytes=BIG * 2
        )
        state = tmp_path / "state"
        ing = KafkaIngestor("docs", ds, opts, tracker=tr, state_dir=state)
        ing.start()
        try:
            wait_for(ing.caught_up, 60, f"caught up ({ds.count()} rows, {ing.last_error})")
        finally:
            ing.stop(checkpoint_now=False)
        assert ds.count() == 20
        assert not (cwd / ".fabric").exists()
        path = state / "dead-letters.jsonl"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        (line,) = [json.loads(x) for x in path.read_text().splitlines()]
        assert (line["partition"], line["offset"]) == where[10] and line["dlq_error"]
        assert len(line["value"]) == 65536
        f = tr.source("docs")
        assert "dead_letter" in f.errors and str(path) in f.errors["dead_letter"], f.errors
    finally:
        delete_topic(kafka_bootstrap, topic, wait_gone=False)
        delete_topic(kafka_bootstrap, topic + ".dlq", wait_gone=False)
