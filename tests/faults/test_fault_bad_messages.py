"""Issue 14 finding 2 under load: 20k messages, ~1 % invalid of varied kinds (two objects
in one message, empty, truncated, wrong type, extra nesting, not UTF-8), several of them
carrying the key and id of a valid row: every valid row applied, every invalid message in
the dead-letter topic with its offset, none applied."""

from __future__ import annotations

import json
import random

import pytest

from fabric.freshness import FreshnessTracker
from fabric.ingest import IngestOptions, KafkaIngestor
from tests.faults.helpers import (
    Watch,
    assert_replica,
    delete_topic,
    dlq,
    doc,
    held,
    json_row,
    new_dataset,
    produce,
    replica,
    wait_for,
)


def value(key: str, n: int) -> dict:
    """A document the fast (Arrow) path decodes: ISO time, not epoch seconds."""
    return doc(key, n) | {"ts": "2026-11-29T12:00:00+00:00"}


def invalid(kind: str, key: str) -> bytes:
    """An invalid message whose rows, if applied, would be visible: ids no valid message
    writes (``bad-...``)."""
    good = json.dumps(value(f"bad-{key}", 999_999)).encode()
    return {
        "two": good + b"\n" + json.dumps(value(f"bad2-{key}", 999_999)).encode(),
        "two_same_line": good + b" " + good,
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "wrong_type": json.dumps({"id": f"bad-{key}", "n": "seven"}).encode(),
        "nesting": json.dumps({"id": f"bad-{key}", "n": {"deep": [doc(key, 1)]}}).encode(),
        "not_utf8": good.replace(b'"body": "', b'"body": "\xff\xfe'),
    }[kind]


KINDS = ["two", "two_same_line", "empty", "truncated", "wrong_type", "nesting", "not_utf8"]


@pytest.mark.slow
def test_bad_messages_under_load_none_applied_all_dead_lettered(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=3, prefix="fault_bad")
    rng = random.Random(14)
    items: list[tuple[str | None, bytes | None]] = []
    bad_at: list[int] = []
    pending: list[tuple[int, str]] = []  # (when, key): an empty value after a 'two'
    for i in range(20_000):
        key = f"k{rng.randrange(8000)}"  # many keys updated several times
        if pending and pending[0][0] <= i:  # same key, so same partition and batch as the
            bad_at.append(len(items))  # two-object one: the row counts of the block agree
            items.append((pending.pop(0)[1], invalid("empty", key)))
        elif rng.random() < 0.01:
            kind = KINDS[len(bad_at) % len(KINDS)]
            bad_at.append(len(items))
            items.append((key, invalid(kind, key)))
            if kind.startswith("two"):
                pending.append((i + rng.randint(1, 5), key))
        else:
            items.append((key, json.dumps(value(key, i)).encode()))
    where = produce(kafka_bootstrap, topic, items)
    rep = replica(kafka_bootstrap, topic, json_row)
    assert rep.invalid == {where[i] for i in bad_at} and len(bad_at) > 150

    ds = new_dataset({"n": "btree", "body": "inverted"})
    tr = FreshnessTracker()
    expected = {k: r["n"] for k, r in rep.rows.items()}
    ing = KafkaIngestor(
        "docs",
        ds,
        IngestOptions(kafka_bootstrap, topic, f"fabric.test.{topic}", batch_size=2000),
        tracker=tr,
    )
    try:
        with Watch(tr, "docs", lambda: held(ds) == expected) as watch:
            ing.start()
            wait_for(ing.caught_up, 120, f"caught up ({ds.count()} rows, {ing.last_error})")
        ing.stop(checkpoint_now=False)
        assert not watch.lies, watch.lies[:2]
        assert_replica(ds, rep)  # every valid row, with its latest value; nothing from a bad one
        f = tr.source("docs")
        assert f.dead_letter_total == len(bad_at) and f.status == "fresh"
        dead = dlq(kafka_bootstrap, topic, expect=len(bad_at))
        assert set(dead) == rep.invalid  # each one, with its partition and offset
    finally:
        ing.stop(checkpoint_now=False)
        delete_topic(kafka_bootstrap, topic + ".dlq", wait_gone=False)
