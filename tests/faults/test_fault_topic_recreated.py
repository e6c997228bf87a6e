"""Issue 14 finding 3: offsets are trusted only for the topic they came from. A topic
deleted and re-created (same name, new messages at the old offsets) under a checkpoint,
or under a running ingestor, is detected, the dataset rebuilt from the new topic, and
freshness says so (status ``rebuilding``, a notice) instead of 'fresh' with rows missing.

noida-db gives no topic ids (all zeros), so detection there rests on the watermarks and on
the fingerprint of the last message applied per partition; Tansu's ids are checked too."""

from __future__ import annotations

import time

import pytest

from fabric.freshness import FreshnessTracker
from fabric.ingest import IngestOptions, KafkaIngestor, checkpoint
from indexes.dataset import Dataset
from tests.faults.helpers import (
    Watch,
    assert_replica,
    create_topic,
    delete_topic,
    docs,
    held,
    json_row,
    new_dataset,
    produce,
    replica,
    wait_for,
)


def _ingestor(bootstrap, topic, state, tr, **kw):
    loaded = checkpoint.load(state, lambda c: Dataset.load(str(c.dataset_dir)))
    ck = loaded.checkpoint
    ds = loaded.value if ck else new_dataset({"n": "btree"})
    opts = IngestOptions(bootstrap, topic, f"fabric.test.{topic}", verify_interval=1.0, **kw)
    ing = KafkaIngestor(
        "docs",
        ds,
        opts,
        tracker=tr,
        state_dir=state,
        start_offsets=ck.offsets if ck else None,
        resume=ck.meta if ck else None,
    )
    return ing, ds


@pytest.mark.parametrize("server", ["noida", "tansu"])
def test_topic_recreated_under_a_checkpoint_is_rebuilt_on_restart(
    server, request, test_run_id, tmp_path
):
    bootstrap = request.getfixturevalue(
        "kafka_bootstrap" if server == "noida" else "tansu_bootstrap"
    )
    extra = {} if server == "noida" else {"consumer_config": {"session.timeout.ms": 6000}}
    topic = f"fabric_recreate_{server}_{test_run_id}"
    state = tmp_path / "state"
    create_topic(bootstrap, topic, 2)
    try:
        produce(bootstrap, topic, docs(range(1000), gen=0))
        tr = FreshnessTracker()
        ing, ds = _ingestor(bootstrap, topic, state, tr, **extra)
        ing.start()
        wait_for(ing.caught_up, 60, "first pass caught up")
        ing.stop(checkpoint_now=True)
        assert ds.count() == 1000

        delete_topic(bootstrap, topic)
        create_topic(bootstrap, topic, 2)
        produce(bootstrap, topic, docs(range(500, 2000), gen=1))  # 1,500: past the old offsets
        rep = replica(bootstrap, topic, json_row)
        assert len(rep.rows) == 1500

        tr = FreshnessTracker()
        ing, ds = _ingestor(bootstrap, topic, state, tr, **extra)
        assert ds.count() == 1000  # the old topic's rows, from the checkpoint
        with Watch(tr, "docs", lambda: held(ds) == {k: r["n"] for k, r in rep.rows.items()}) as w:
            ing.start()
            wait_for(ing.caught_up, 90, f"caught up after the rebuild ({ds.count()} rows)")
        ing.stop(checkpoint_now=True)
        assert not w.lies, w.lies[:2]
        assert_replica(ds, rep)  # none of the old topic's rows, none of the new one's skipped
        assert w.seen("rebuilding"), w.statuses
        f = tr.source("docs")
        assert f.status == "fresh" and ing.stats.rebuilds == 1
        assert any("recreated" in n["message"] for n in f.notices), f.notices
        # and the rebuilt checkpoint resumes without another rebuild
        tr = FreshnessTracker()
        ing, ds = _ingestor(bootstrap, topic, state, tr, **extra)
        ing.start()
        wait_for(ing.caught_up, 60, "resumed")
        ing.stop(checkpoint_now=False)
        assert ing.stats.rebuilds == 0 and ing.stats.applied == 0
        assert_replica(ds, rep)
    finally:
        delete_topic(bootstrap, topic, wait_gone=False)


@pytest.mark.slow
def test_topic_recreated_under_a_running_ingestor_is_rebuilt(
    kafka_bootstrap, test_run_id, tmp_path
):
    topic = f"fabric_recreate_live_{test_run_id}"
    create_topic(kafka_bootstrap, topic, 2)
    try:
        produce(kafka_bootstrap, topic, docs(range(1000), gen=0))
        tr = FreshnessTracker()
        ing, ds = _ingestor(kafka_bootstrap, topic, tmp_path / "state", tr)
        expected = {f"k{i}": i for i in range(1000)}
        changed_at = [float("inf")]
        with Watch(tr, "docs", lambda: held(ds) == expected) as w:
            ing.start()
            wait_for(ing.caught_up, 60, "first pass caught up")
            changed_at[0] = time.monotonic()
            expected = {f"k{i}": 1_000_000 + i for i in range(500, 2000)}
            delete_topic(kafka_bootstrap, topic)
            create_topic(kafka_bootstrap, topic, 2)
            produce(kafka_bootstrap, topic, docs(range(500, 2000), gen=1))
            wait_for(
                lambda: ing.stats.rebuilds >= 1 and ing.caught_up(),
                90,
                f"rebuilt ({ds.count()} rows, {ing.stats}, {ing.errors}, {tr.source('docs').to_dict()})",
            )
        ing.stop(checkpoint_now=False)
        rep = replica(kafka_bootstrap, topic, json_row)
        assert_replica(ds, rep)
        assert w.seen("rebuilding"), w.statuses
        # detection takes up to a lag interval plus verify_interval: no 'fresh' past that
        late = [x for x in w.lies if x["t"] > changed_at[0] + 3.0]
        assert not late, late[:2]
    finally:
        delete_topic(kafka_bootstrap, topic, wait_gone=False)
