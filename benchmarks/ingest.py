"""Kafka -> indexed dataset: throughput and produce-to-queryable latency, next to raw
confluent-kafka consumption of the same topic in the same run.

1. throughput, documents without vectors (id, symbol, published_at, body; B-tree on the
   time, inverted index on the body): fabric ingestion from offset 0 until every message
   is in the dataset, vs a bare ``Consumer.consume`` loop over the same topic; once more
   into a dataset without indexes (what the ingestion pipeline itself costs: consume,
   decode, batch bookkeeping, Arrow segments, commit);
2. the same with a 384-d vector per document (HNSW too);
3. latency: a producer paced at ``--rate`` msgs/s (with vectors) while the ingestor runs;
   per message, the time from ``produce()`` (Kafka CreateTime) to the moment the batch
   holding it was applied to every index (``upsert`` returned).

    .venv/bin/python benchmarks/ingest.py [--bootstrap 127.0.0.1:9092] [--docs 100000]
        [--vector-docs 20000] [--rate 5000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from connectors._util import schema_from_spec
from fabric.ingest import IngestOptions, KafkaIngestor
from indexes.dataset import Dataset

WORDS = [
    "market",
    "open",
    "rally",
    "futures",
    "yields",
    "tech",
    "energy",
    "earnings",
    "guidance",
    "bank",
    "oil",
    "chip",
]
SCHEMA = {"id": "str", "symbol": "str", "published_at": "timestamp", "body": "str"}
INDEXES = {"published_at": "btree", "body": "inverted"}


def make_topic(bootstrap: str, name: str, partitions: int) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    time.sleep(0.5)
    return name


def vec_pool(n: int = 1000, dim: int = 384) -> list[bytes]:
    rng = np.random.default_rng(0)
    m = rng.standard_normal((n, dim)).astype(np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return [json.dumps([round(float(x), 5) for x in row]).encode() for row in m]


def value(i: int, vecs: list[bytes] | None) -> bytes:
    body = " ".join(WORDS[(i * k) % len(WORDS)] for k in (1, 3, 7, 11))
    head = b'{"id":"d%d","symbol":"S%d","published_at":"2026-11-29T12:%02d:%02d.%03d+00:00","body":"%s %d"' % (
        i, i % 500, (i // 60000) % 60, (i // 1000) % 60, i % 1000, body.encode(), i,
    )  # fmt: skip
    if vecs is None:
        return head + b"}"
    return head + b',"embedding":' + vecs[i % len(vecs)] + b"}"


def produce(bootstrap: str, topic: str, n: int, vecs: list[bytes] | None) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000})
    for i in range(n):
        while True:
            try:
                p.produce(topic, key=b"d%d" % i, value=value(i, vecs))
                break
            except BufferError:
                p.poll(0.05)
        if i % 5000 == 0:
            p.poll(0)
    assert p.flush(60) == 0


def raw_consume(bootstrap: str, topic: str, n: int) -> float:
    """msgs/s of a bare consume loop (no decoding), every partition assigned at offset 0 like
    the ingestor does, batches of 5000; timed from the call that returned the first messages."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-raw-{time.time()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 52428800})  # fmt: skip
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    got, t0 = 0, None
    while got < n:
        before = time.perf_counter()
        msgs = c.consume(5000, 1.0)
        if msgs and t0 is None:
            t0 = before
        got += sum(1 for m in msgs if m.error() is None)
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def fabric_ingest(
    bootstrap: str, topic: str, n: int, schema: dict, indexes: dict
) -> tuple[float, Dataset]:
    ds = Dataset.create("bench", schema_from_spec(schema), "id", indexes)
    ing = KafkaIngestor(
        "bench",
        ds,
        IngestOptions(
            bootstrap, topic, f"bench-fabric-{time.time()}", batch_size=5000, dead_letter="none"
        ),
    )
    ing._open()
    t0 = None
    while ing.stats.applied < n:
        before = time.perf_counter()
        got = ing.step()
        if got and t0 is None:  # from the step that returned the first messages (same as raw)
            t0 = before
    dt = time.perf_counter() - t0
    ing.stop(checkpoint_now=False)
    assert ds.count() == n, (ds.count(), n)
    return n / dt, ds


def latency(
    bootstrap: str, topic: str, rate: int, seconds: float, vecs: list[bytes] | None
) -> tuple[list[float], float]:
    if vecs is None:
        ds = Dataset.create("lat", schema_from_spec(SCHEMA), "id", INDEXES)
    else:
        ds = Dataset.create("lat", schema_from_spec({**SCHEMA, "embedding": "vector[384]"}), "id",
                            {**INDEXES, "embedding": "hnsw"})  # fmt: skip
    ing = KafkaIngestor(
        "lat", ds, IngestOptions(bootstrap, topic, f"bench-lat-{time.time()}", dead_letter="none")
    )
    lat: list[float] = []
    apply = ing._apply

    def timed(msgs):  # the dataset holds the batch when _apply returns
        n = apply(msgs)
        done = time.time()
        lat.extend(done - m.timestamp()[1] / 1000.0 for m in msgs)
        return n

    ing._apply = timed
    ing.start()
    time.sleep(1.0)  # let it assign
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
    total = int(rate * seconds)
    t0 = time.perf_counter()
    chunk = max(1, rate // 200)  # every 5 ms
    for i in range(0, total, chunk):
        target = t0 + i / rate
        now = time.perf_counter()
        if target > now:
            time.sleep(target - now)
        for j in range(i, min(i + chunk, total)):
            p.produce(topic, key=b"d%d" % j, value=value(j, vecs))
        p.poll(0)
    p.flush(30)
    achieved = total / (time.perf_counter() - t0)
    deadline = time.monotonic() + 120
    while len(lat) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    ing.stop(checkpoint_now=False)
    return lat, achieved


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default="127.0.0.1:9092")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--vector-docs", type=int, default=20_000)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--partitions", type=int, default=3)
    a = ap.parse_args(argv)
    run = f"{int(time.time())}"
    admin = AdminClient({"bootstrap.servers": a.bootstrap})
    topics = []
    vecs = vec_pool()
    rows = []
    produced: dict[tuple[int, bool], tuple[str, float]] = {}
    try:
        for label, n, vs, schema, idx in (
            ("docs, no indexes", a.docs, None, SCHEMA, {}),
            ("docs, no vectors", a.docs, None, SCHEMA, INDEXES),
            ("docs + 384-d vector", a.vector_docs, vecs, {**SCHEMA, "embedding": "vector[384]"}, {**INDEXES, "embedding": "hnsw"}),
        ):  # fmt: skip
            if (n, vs is None) not in produced:  # the same documents share one topic
                topic = make_topic(a.bootstrap, f"bench_ingest_{run}_{len(topics)}", a.partitions)
                topics.append(topic)
                produce(a.bootstrap, topic, n, vs)
                raw = statistics.median(raw_consume(a.bootstrap, topic, n) for _ in range(3))
                produced[(n, vs is None)] = (topic, raw)
            topic, raw = produced[(n, vs is None)]
            fab, _ds = fabric_ingest(a.bootstrap, topic, n, schema, idx)
            rows.append((label, n, raw, fab))
        lats = []
        for label, vs in (("no vectors", None), ("384-d vectors", vecs)):
            topic = make_topic(a.bootstrap, f"bench_ingest_{run}_lat{len(topics)}", a.partitions)
            topics.append(topic)
            lats.append((label, *latency(a.bootstrap, topic, a.rate, a.seconds, vs)))
    finally:
        admin.delete_topics(topics)

    print(
        f"\nKafka -> indexed dataset (noida-db at {a.bootstrap}, {a.partitions} partitions, batch 5000)\n"
    )
    print(
        f"{'workload':<22}{'messages':>10}{'raw consume msg/s':>20}{'fabric msg/s':>15}{'fabric / raw':>14}"
    )
    for label, n, raw, fab in rows:
        print(f"{label:<22}{n:>10,}{raw:>20,.0f}{fab:>15,.0f}{fab / raw:>14.1%}")
    print(
        f"\nproduce -> queryable in every index (HNSW when vectors, B-tree, inverted), paced at {a.rate:,} msg/s for {a.seconds:g} s"
    )
    print(
        f"{'documents':<16}{'achieved msg/s':>16}{'messages':>10}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}"
    )
    for label, lat, achieved in lats:
        ms = [x * 1000 for x in lat]
        print(
            f"{label:<16}{achieved:>16,.0f}{len(ms):>10,}{pct(ms, 0.5):>10.1f}{pct(ms, 0.95):>10.1f}{pct(ms, 0.99):>10.1f}{max(ms):>10.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
