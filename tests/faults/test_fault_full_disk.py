"""A full disk on the state directory (a small tmpfs mounted there; needs root, skipped
otherwise), and issue 14 finding 5: the checkpoint error (ENOSPC) stands in
``/v1/freshness`` and ``/metrics`` for as long as checkpoints fail -- successful watermark
queries every 0.5 s no longer clear it -- while the dataset keeps ingesting in memory;
it clears when a checkpoint succeeds, and a restart from that checkpoint is exact."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from fabric.freshness import FreshnessTracker
from fabric.ingest import IngestOptions, KafkaIngestor, checkpoint
from fabric.server import ServerThread, create_app
from indexes.dataset import Dataset
from tests.faults.helpers import (
    Watch,
    assert_replica,
    docs,
    held,
    json_row,
    new_dataset,
    produce,
    replica,
    wait_for,
)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def error_metric(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith('fabric_source_error{source="docs"}'):
            return float(line.split()[-1])
    return None


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "state"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_on_the_state_directory(kafka_bootstrap, new_topic, small_disk):
    topic = new_topic(partitions=2, prefix="fault_disk")
    produce(kafka_bootstrap, topic, docs(range(3000)))
    rep = replica(kafka_bootstrap, topic, json_row)
    expected = {k: r["n"] for k, r in rep.rows.items()}
    ds = new_dataset({"n": "btree", "body": "inverted"})
    tr = FreshnessTracker()
    opts = IngestOptions(kafka_bootstrap, topic, f"fabric.test.{topic}", checkpoint_interval=0.3)
    ing = KafkaIngestor("docs", ds, opts, tracker=tr, state_dir=small_disk)
    srv = ServerThread(create_app(tr)).start()
    try:
        with Watch(tr, "docs", lambda: held(ds) == expected) as w:
            ing.start()
            wait_for(lambda: "checkpoint" in ing.errors, 30, "a checkpoint to fail")
            assert "No space left" in ing.errors["checkpoint"], ing.errors
            wait_for(lambda: held(ds) == expected, 60, "every row in memory")
            # the error stands through many successful watermark queries (0.5 s apart)
            for _ in range(12):
                time.sleep(0.25)
                src = json.loads(get(srv.url + "/v1/freshness"))["sources"]["docs"]
                assert "No space left" in (src["last_error"] or ""), src
                assert src["status"] == "error" and "checkpoint" in src["errors"], src
                assert src["lag_messages"] == 0  # the data is all there, only not saved
                assert error_metric(get(srv.url + "/metrics")) == 1.0
            assert checkpoint.latest(small_disk) is None
            assert not [p for p in small_disk.iterdir() if p.name.startswith(".tmp")]

            subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
            wait_for(lambda: "checkpoint" not in ing.errors, 30, "a checkpoint to succeed")
            wait_for(lambda: tr.source("docs").status == "fresh", 10, "fresh again")
        assert error_metric(get(srv.url + "/metrics")) == 0.0
        assert not w.lies, w.lies[:2]
        assert w.seen("error"), w.statuses
    finally:
        ing.stop(checkpoint_now=True)
        srv.stop()
    ck = checkpoint.latest(small_disk)
    assert ck is not None
    assert_replica(Dataset.load(str(ck.dataset_dir)), rep)


@pytest.mark.slow
def test_a_batch_that_cannot_be_applied_is_retried_not_lost(kafka_bootstrap, new_topic, small_disk):
    """The dead-letter file is on the full disk: writing a dead letter raises inside the
    batch. The batch is read again until it applies (none lost, none skipped), the ``apply``
    error standing meanwhile, and the source never 'fresh'."""
    fill = small_disk / "fill"
    fd = os.open(fill, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to the last byte
        while os.write(fd, b"\0" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    topic = new_topic(partitions=1, prefix="fault_apply")
    items = [*docs(range(500)), ("bad", b"not json"), *docs(range(500, 1000))]
    where = produce(kafka_bootstrap, topic, items)
    rep = replica(kafka_bootstrap, topic, json_row)
    expected = {k: r["n"] for k, r in rep.rows.items()}
    ds = new_dataset({"n": "btree"})
    tr = FreshnessTracker()
    dead = small_disk / "dead.jsonl"
    opts = IngestOptions(
        kafka_bootstrap, topic, f"fabric.test.{topic}", batch_size=300, dead_letter=f"log:{dead}"
    )
    ing = KafkaIngestor("docs", ds, opts, tracker=tr)
    try:
        with Watch(tr, "docs", lambda: held(ds) == expected) as w:
            ing.start()
            wait_for(lambda: "apply" in ing.errors, 30, "the batch to fail")
            for _ in range(8):  # it stands through watermark queries and retries
                time.sleep(0.25)
                f = tr.source("docs")
                assert f.status == "error" and "No space left" in f.errors["apply"], f
            assert ds.count() < 1000 and ing.stats.applied < 1001
            fill.unlink()
            wait_for(ing.caught_up, 60, f"caught up ({ds.count()} rows, {ing.errors})")
        assert not w.lies, w.lies[:2]
        assert w.seen("error"), w.statuses
        assert_replica(ds, rep)
        assert tr.source("docs").errors == {}
        lines = [json.loads(x) for x in dead.read_text().splitlines()]
        assert {(x["partition"], x["offset"]) for x in lines} == {where[500]}
    finally:
        ing.stop(checkpoint_now=False)
