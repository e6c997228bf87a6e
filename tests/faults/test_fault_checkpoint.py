"""Issue 14 finding 4: a damaged checkpoint (bad offsets.json, truncated rows.arrow, a bad
live.roaring) no longer stops the fabric with a bare traceback: DatasetManager (what
``fabric serve`` runs) falls back to the previous checkpoint, else rebuilds from the topic,
names the file in the log and in freshness, and ends exact. Also issue 13 finding 13:
checkpoint files are 0600 in 0700 directories."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from connectors._util import schema_from_spec
from fabric.datasets import DatasetDecl, DatasetManager
from fabric.freshness import FreshnessTracker
from fabric.ingest import checkpoint
from tests.faults.helpers import (
    SCHEMA,
    Watch,
    assert_replica,
    docs,
    held,
    json_row,
    produce,
    replica,
    wait_for,
)


def manager(bootstrap, topic, state, tracker):
    decl = DatasetDecl(
        "docs",
        schema_from_spec(SCHEMA),
        "id",
        {"n": "btree", "body": "inverted"},
        f"kafka://bus/{topic}",
    )
    return DatasetManager(
        [decl], connections={"bus": {"kind": "kafka", "bootstrap": bootstrap}}, state_dir=state,
        tracker=tracker, config_name="faults", checkpoint_interval=0,
    )  # fmt: skip


def damage(path, how):
    if how == "offsets.json":
        (path / "offsets.json").write_text('{"offsets": {"0": ')
    elif how == "rows.arrow":
        f = path / "dataset" / "rows.arrow"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "live.roaring":
        f = path / "dataset" / "live.roaring"
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF  # one flipped byte: still deserializes, to the wrong rows
        f.write_bytes(bytes(b))


def two_checkpoints(bootstrap, topic, state):
    """Checkpoint after 1,000 messages, then after 2,000: returns (older, newer)."""
    tr = FreshnessTracker()
    produce(bootstrap, topic, docs(range(1000)))
    m = manager(bootstrap, topic, state, tr).start()
    wait_for(lambda: m.wait_caught_up(1), 60, "caught up")
    m.stop()
    produce(bootstrap, topic, docs(range(500, 1500), gen=1))
    m = manager(bootstrap, topic, state, tr).start()
    wait_for(lambda: m.wait_caught_up(1), 60, "caught up")
    m.stop()
    cks = sorted(p for p in state.joinpath("docs").iterdir() if p.name.startswith("ckpt-"))
    assert len(cks) == 2
    return cks[0], cks[1]


@pytest.mark.parametrize("how", ["offsets.json", "rows.arrow", "live.roaring"])
@pytest.mark.parametrize("both", [False, True], ids=["newest", "both"])
def test_a_damaged_checkpoint_falls_back_or_rebuilds_and_says_which(
    how, both, kafka_bootstrap, new_topic, tmp_path, caplog
):
    topic = new_topic(partitions=2, prefix="fault_ckpt")
    state = tmp_path / "state"
    older, newer = two_checkpoints(kafka_bootstrap, topic, state)
    damage(newer, how)
    if both:
        damage(older, how)
    produce(kafka_bootstrap, topic, docs(range(1200, 1300), gen=2))
    rep = replica(kafka_bootstrap, topic, json_row)

    tr = FreshnessTracker()
    m = manager(kafka_bootstrap, topic, state, tr)
    with caplog.at_level(logging.ERROR, "fabric"):
        m.start()  # no traceback: it starts
    ds = m.dataset("docs")
    try:
        with Watch(tr, "docs", lambda: held(ds) == {k: r["n"] for k, r in rep.rows.items()}) as w:
            wait_for(lambda: m.wait_caught_up(1), 60, f"caught up ({ds.count()} rows)")
    finally:
        m.stop()
    assert not w.lies, w.lies[:2]
    assert_replica(ds, rep)
    assert w.seen("rebuilding"), w.statuses
    f = tr.source("docs")
    assert f.status == "fresh"
    said = " ".join(n["message"] for n in f.notices)
    assert how in said and newer.name in said, said  # names the file
    assert ("no usable checkpoint" in said) if both else (f"fell back to {older.name}" in said)
    assert how in caplog.text
    # the next start uses the checkpoint written at stop, with nothing to report
    assert checkpoint.latest(state / "docs") is not None


def test_checkpoint_files_are_private(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=1, prefix="fault_perm")
    produce(kafka_bootstrap, topic, docs(range(100)))
    state = tmp_path / "state"
    m = manager(kafka_bootstrap, topic, state, FreshnessTracker()).start()
    wait_for(lambda: m.wait_caught_up(1), 60, "caught up")
    m.stop()
    ck = checkpoint.latest(state / "docs")
    assert stat.S_IMODE(os.stat(state / "docs").st_mode) == 0o700
    for dirpath, _dirs, files in os.walk(ck.path):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for name in files:
            mode = stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode)
            assert mode == 0o600, (os.path.join(dirpath, name), oct(mode))
    assert stat.S_IMODE(os.stat(state / "docs" / "CURRENT").st_mode) == 0o600
