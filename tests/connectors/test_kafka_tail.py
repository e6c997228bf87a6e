"""The Kafka tail cache (connectors/kafka.py): a cached scan returns exactly what a fresh
uncached scan (``cache: false``) returns, after new messages, bad messages and tombstones,
deleted records, added partitions, topic recreation, and while other threads scan and
produce. Real brokers (noida-db, Tansu with ``end: eof``); no mocks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pytest

from connectors.base import ScanMetrics, ScanRequest, SourceError
from dsl.ast import Binary, Column, Literal, Param

SCHEMA = {"user_id": "int", "seq": "int", "lat": "float"}
T0 = int(time.time() * 1000) - 60_000  # default message time: T0 + seq (rises with seq)


def _producer(bootstrap: str) -> Any:
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})


def produce(
    bootstrap: str,
    topic: str,
    rows: list[dict[str, Any] | bytes | None],
    *,
    ts: list[int] | None = None,
    partition: int | None = None,
) -> list[tuple[int, int]]:
    """Produce JSON rows (or raw bytes / None tombstones); returns (partition, offset) of each."""
    p = _producer(bootstrap)
    where: list[tuple[int, int] | None] = [None] * len(rows)

    def cb(i: int) -> Any:
        def done(err: Any, msg: Any) -> None:
            assert err is None, err
            where[i] = (msg.partition(), msg.offset())

        return done

    for i, r in enumerate(rows):
        value = json.dumps(r).encode() if isinstance(r, dict) else r
        kw: dict[str, Any] = {"partition": partition} if partition is not None else {}
        key = str(r["user_id"]).encode() if isinstance(r, dict) else b"x"
        p.produce(
            topic,
            key=key,
            value=value,
            timestamp=ts[i] if ts else T0 + (r["seq"] if isinstance(r, dict) else 0),
            on_delivery=cb(i),
            **kw,
        )
    assert p.flush(30) == 0
    assert all(w is not None for w in where)
    return [w for w in where if w is not None]


def rows(n: int, start: int = 0, users: int = 7) -> list[dict[str, Any] | bytes | None]:
    return [{"user_id": i % users, "seq": i, "lat": float(i)} for i in range(start, start + n)]


_LAST: dict[int, dict[str, Any]] = {}  # id(source) -> its latest scan's metrics (this test's)


def scanned(
    src: Any, req: ScanRequest | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, the scan's own metrics as res.stats reports them)."""
    req = replace(req or ScanRequest(), metrics=ScanMetrics())
    out = pa.Table.from_batches(list(src.scan(req))).to_pylist()
    return sorted(out, key=lambda r: (r["seq"], r.get("user_id"))), req.metrics.as_dict()


def scan(src: Any, req: ScanRequest | None = None) -> list[dict[str, Any]]:
    out, _LAST[id(src)] = scanned(src, req)
    return out


def last(src: Any) -> dict[str, Any]:
    return _LAST[id(src)]


def bad(src: Any) -> list[tuple[int, int, str]]:
    return sorted(
        (b["partition"], b["offset"], b["reason"]) for b in last(src).get("bad_samples", [])
    )


@pytest.fixture(params=["noida", "tansu"])
def broker(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """(bootstrap, topic factory, connection options) for each broker."""
    if request.param == "noida":
        yield (
            request.getfixturevalue("kafka_bootstrap"),
            request.getfixturevalue("new_topic"),
            {},
        )
    else:
        yield (
            request.getfixturevalue("tansu_bootstrap"),
            request.getfixturevalue("tansu_topic"),
            {"end": "eof"},
        )


def pair(bootstrap: str, topic: str, **options: Any) -> tuple[Any, Any]:
    """A cached and an uncached source over the same topic."""
    from connectors.kafka import KafkaConnection

    base = {"bootstrap": bootstrap, "schemas": {topic: SCHEMA}, **options}
    cached = KafkaConnection("bus", base).source(topic)
    fresh = KafkaConnection("bus", {**base, "cache": False}).source(topic)
    return cached, fresh


def same(cached: Any, fresh: Any, req: ScanRequest | None = None) -> list[dict[str, Any]]:
    a, b = scan(cached, req), scan(fresh, req)
    assert a == b, (last(cached), last(fresh))
    assert last(cached)["bad_records"] == last(fresh)["bad_records"]
    assert bad(cached) == bad(fresh)
    return a


LATEST_U3 = ScanRequest(
    filters=(Binary("=", Column("user_id"), Param("u")),), params={"u": 3}, latest_by=("user_id",)
)


def test_repeated_scans_match_a_fresh_scan_as_the_topic_grows(broker: Any) -> None:
    bootstrap, new_topic, opts = broker
    topic = new_topic(partitions=3, prefix="tail")
    produce(bootstrap, topic, rows(150))
    cached, fresh = pair(bootstrap, topic, **opts)

    assert len(same(cached, fresh)) == 150
    assert last(cached)["cache"] == "caught up" and last(cached)["cache_read"] == 150
    assert last(fresh)["cache"].startswith("off")
    assert same(cached, fresh, LATEST_U3) == [{"user_id": 3, "seq": 143, "lat": 143.0}]
    assert last(cached)["cache"] == "hit"  # nothing new: no message was read again

    produce(bootstrap, topic, rows(20, start=150))
    assert same(cached, fresh, LATEST_U3) == [{"user_id": 3, "seq": 164, "lat": 164.0}]
    assert last(cached)["cache_read"] == 20  # only the new messages were decoded
    assert len(same(cached, fresh)) == 170

    # bad messages and tombstones between good ones: skipped and reported the same way
    produce(bootstrap, topic, [b"{broken", None, b'{"user_id": "x"}', *rows(5, start=170)])
    assert len(same(cached, fresh)) == 175
    assert last(cached)["bad_records"] == 3
    assert last(cached)["records"] == last(fresh)["records"] == 178

    # projection, limit, filter and time range are applied to the cached data
    some = ScanRequest(
        columns=("seq",),
        filters=(Binary(">=", Column("seq"), Literal(100, "int")),),
    )
    assert [r["seq"] for r in scan(cached, some)] == list(range(100, 175))
    assert len(scan(cached, ScanRequest(limit=4))) == 4


def test_latest_by_is_the_newest_message_time_not_the_newest_offset(
    kafka_bootstrap: str, new_topic: Any
) -> None:
    topic = new_topic(partitions=2, prefix="latest")
    base = int(time.time() * 1000) - 60_000
    body = rows(60, users=5)
    # timestamps run backwards for the second half: the newest message per user is early
    stamps = [base + i * 100 for i in range(30)] + [base - (i + 1) * 100 for i in range(30)]
    where = produce(kafka_bootstrap, topic, body, ts=stamps)
    cached, fresh = pair(kafka_bootstrap, topic)
    got = same(cached, fresh, ScanRequest(latest_by=("user_id",)))
    newest: dict[int, tuple[Any, ...]] = {}
    for r, t, (p, off) in zip(body, stamps, where, strict=True):
        assert isinstance(r, dict)
        k = (t, p, off)
        if r["user_id"] not in newest or k > newest[r["user_id"]][0]:
            newest[r["user_id"]] = (k, r)
    assert got == sorted((v[1] for v in newest.values()), key=lambda r: r["seq"])
    assert {r["seq"] for r in got} == {25, 26, 27, 28, 29}


def test_deleted_records_and_added_partitions(kafka_bootstrap: str, new_topic: Any) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = new_topic(partitions=1, prefix="gap")
    produce(kafka_bootstrap, topic, rows(40), partition=0)
    cached, fresh = pair(kafka_bootstrap, topic)
    assert len(same(cached, fresh)) == 40
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # the low watermark jumps (retention, delete_records): the cache drops what is gone
    low = admin.delete_records([TopicPartition(topic, 0, 25)])
    assert next(iter(low.values())).result(10).low_watermark == 25
    assert [r["seq"] for r in same(cached, fresh)] == list(range(25, 40))
    assert last(cached)["cache_resets"] == 0 and last(cached)["cache_read"] == 0

    admin.create_partitions([NewPartitions(topic, 3)])[topic].result(10)
    deadline = time.monotonic() + 10
    while len(admin.list_topics(topic, timeout=5).topics[topic].partitions) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    produce(kafka_bootstrap, topic, rows(6, start=40), partition=2)
    fresh_now = pair(kafka_bootstrap, topic)[1]  # an uncached source opened after the change
    got = [r["seq"] for r in same(cached, fresh_now)]
    assert got == list(range(25, 46))
    assert last(cached)["partitions"] == 3


def test_topic_recreated_with_fewer_messages_resets_the_cache(broker: Any) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    bootstrap, new_topic, opts = broker
    topic = new_topic(partitions=2, prefix="again")
    produce(bootstrap, topic, rows(30))
    cached, _ = pair(bootstrap, topic, **opts)
    assert len(scan(cached)) == 30
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(30)
    deadline = time.monotonic() + 30
    while True:  # the broker may take a moment before the name can be reused
        try:
            admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[
                topic
            ].result(30)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    time.sleep(0.5)
    produce(bootstrap, topic, rows(4, start=500))
    fresh = pair(bootstrap, topic, **opts)[1]
    got = [r["seq"] for r in scan(cached)]
    assert got == [r["seq"] for r in scan(fresh)] == [500, 501, 502, 503]
    assert last(cached)["cache_resets"] >= 1


def test_a_deleted_topic_is_a_source_error_naming_it(kafka_bootstrap: str, new_topic: Any) -> None:
    from confluent_kafka.admin import AdminClient

    topic = new_topic(partitions=1, prefix="gone")
    produce(kafka_bootstrap, topic, rows(3))
    cached, _ = pair(kafka_bootstrap, topic)
    assert len(scan(cached)) == 3
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_topics([topic])[topic].result(30)
    with pytest.raises(SourceError, match=f"kafka://bus/{topic}: the topic no longer exists"):
        scan(cached)


def test_a_broker_error_keeps_the_cache_for_the_next_try(
    kafka_bootstrap: str, new_topic: Any
) -> None:
    from confluent_kafka.admin import AdminClient

    topic = new_topic(partitions=2, prefix="err")
    produce(kafka_bootstrap, topic, rows(50))
    cached, _ = pair(kafka_bootstrap, topic)
    assert len(scan(cached)) == 50
    conn = cached.conn
    good = conn.admin()
    # the broker becomes unreachable: the metadata request fails, naming the source
    conn._admin = AdminClient(
        {"bootstrap.servers": "127.0.0.1:1", "socket.connection.setup.timeout.ms": 1000}
    )
    with pytest.raises(SourceError, match=f"kafka://bus/{topic}") as err:
        list(cached.scan(ScanRequest(timeout=1)))
    assert "hint:" in str(err.value)
    conn._admin = good  # reachable again: the cache answers without re-reading anything
    assert len(scan(cached)) == 50
    assert last(cached)["cache"] == "hit"


def test_over_the_bounds_the_scan_streams_and_says_so(broker: Any) -> None:
    bootstrap, new_topic, opts = broker
    topic = new_topic(partitions=2, prefix="big")
    produce(bootstrap, topic, rows(120))
    by_count, fresh = pair(bootstrap, topic, cache_max_messages=100, **opts)
    assert len(same(by_count, fresh)) == 120
    assert last(by_count)["cache"].startswith("off (") and "cache_max_messages" in str(
        last(by_count)["cache"]
    )
    by_bytes, _ = pair(bootstrap, topic, cache_max_bytes=2000, **opts)
    assert same(by_bytes, fresh, LATEST_U3) == [{"user_id": 3, "seq": 115, "lat": 115.0}]
    assert "cache_max_bytes" in last(by_bytes)["cache"]
    assert by_bytes.conn._tails[next(iter(by_bytes.conn._tails))].rows == 0  # dropped


def test_a_compacted_topic_is_not_cached(kafka_bootstrap: str, test_run_id: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = f"fabric_compacted_{test_run_id}"
    spec = NewTopic(
        topic, num_partitions=1, replication_factor=1, config={"cleanup.policy": "compact"}
    )
    admin.create_topics([spec])[topic].result(30)
    try:
        time.sleep(0.3)
        produce(kafka_bootstrap, topic, rows(12))
        cached, fresh = pair(kafka_bootstrap, topic)
        assert same(cached, fresh, LATEST_U3) == [{"user_id": 3, "seq": 10, "lat": 10.0}]
        assert last(cached)["cache"].startswith("off (cleanup.policy=compact")
    finally:
        admin.delete_topics([topic])[topic].result(30)


def test_watermark_uses_the_tail_and_close_stops_it(kafka_bootstrap: str, new_topic: Any) -> None:
    topic = new_topic(partitions=2, prefix="wm")
    base = int(time.time() * 1000) - 5_000
    produce(kafka_bootstrap, topic, rows(10), ts=[base + i for i in range(10)])
    cached, _ = pair(kafka_bootstrap, topic)
    wm = cached.watermark()
    assert wm.lag_messages == 0 and wm.event_time == pytest.approx((base + 9) / 1000)
    assert wm.detail["kind"] == "tail cache"
    produce(kafka_bootstrap, topic, rows(1, start=10), ts=[base + 1000])
    assert cached.watermark().event_time == pytest.approx((base + 1000) / 1000)
    tail = next(iter(cached.conn._tails.values()))
    assert tail.consumer is not None
    cached.conn.close()
    assert tail.consumer is None and tail.closed
    assert len(scan(cached)) == 11  # still answers after close, uncached
    assert last(cached)["cache"].startswith("off")


def test_concurrent_scans_while_producing_are_exact(kafka_bootstrap: str, new_topic: Any) -> None:
    """Several threads scan (each its own source, one shared tail) while a producer
    writes; every scan returns exactly the messages below the offsets it reports."""
    from connectors.kafka import KafkaConnection

    topic = new_topic(partitions=3, prefix="conc")
    where: dict[int, tuple[int, int]] = {}
    t0 = int(time.time() * 1000) - 10_000  # message time = t0 + seq: rises with seq
    first = produce(kafka_bootstrap, topic, rows(200), ts=[t0 + i for i in range(200)])
    where.update({i: w for i, w in enumerate(first)})
    conn = KafkaConnection("bus", {"bootstrap": kafka_bootstrap, "schemas": {topic: SCHEMA}})
    seen: list[tuple[dict[int, int], list[int] | None, list[dict[str, Any]] | None]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def scanner() -> None:
        src = conn.source(topic)
        try:
            while not stop.is_set():
                got, m = scanned(src)
                seen.append((dict(m["end_offsets"]), [r["seq"] for r in got], None))
                latest, m = scanned(src, ScanRequest(latest_by=("user_id",)))
                seen.append((dict(m["end_offsets"]), None, latest))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=scanner) for _ in range(3)]
    for t in threads:
        t.start()
    for k in range(5):
        start = 200 + 40 * k
        more = produce(
            kafka_bootstrap, topic, rows(40, start=start), ts=[t0 + start + i for i in range(40)]
        )
        where.update({start + i: w for i, w in enumerate(more)})
        time.sleep(0.05)
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(seen) >= 6
    for end, seqs, latest in seen:
        expected = sorted(s for s, (p, off) in where.items() if off < end.get(p, 0))
        if seqs is not None:
            assert seqs == expected
            continue
        newest: dict[int, int] = {}
        for s in expected:  # timestamps rise with seq
            newest[s % 7] = max(newest.get(s % 7, -1), s)
        assert latest is not None
        assert sorted(r["seq"] for r in latest) == sorted(newest.values())
    assert max(len(s) for _, s, _ in seen if s is not None) == 400
    conn.close()
