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
   holding it was applied to every index (``upsert`` returned: fresh vectors are then
   searchable exactly in the growing segment), while a reader runs a top-10 vector
   search every 100 ms (its latency is reported too).

4. re-embedding (``--embed-texts``, no broker needed; alone with ``--embed-only``): texts/s
   of the built-in ``hash`` embedder (fabric.embed) by batch size and vector width, and an
   upsert into a dataset that declares ``embed:`` (vectors computed at ingest) next to the
   same rows carrying their vectors.

"before" rows run the same workload with the previous code paths, in the same run: the
row-by-row inverted index insert, and HNSW folding on the write path
(``Dataset(background_fold=False)``) instead of the background folder.

    .venv/bin/python benchmarks/ingest.py [--bootstrap 127.0.0.1:9092] [--docs 100000]
        [--vector-docs 20000] [--rate 5000] [--seconds 10] [--embed-texts 20000] [--embed-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import types
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from connectors._util import schema_from_spec
from fabric.ingest import IngestOptions, KafkaIngestor
from indexes.btree import bitmap_of
from indexes.dataset import Dataset
from indexes.inverted import InvertedIndex, doc_tokens

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


def rowwise_add(self: InvertedIndex, rowids: np.ndarray, values) -> None:
    """The inverted index insert before vectorization (per row, per token), for "before"."""
    acc: dict[str, list[int]] = defaultdict(list)
    for rid, v in zip(rowids.tolist(), values.to_pylist()):
        for t in doc_tokens(v):
            acc[t].append(rid)
    for t, ids in acc.items():
        bm = self.postings.get(t)
        new = bitmap_of(np.array(ids, dtype=np.uint32))
        if bm is None:
            self.postings[t] = new
        else:
            bm |= new


def new_dataset(name: str, schema: dict, indexes: dict, before: bool) -> Dataset:
    ds = Dataset.create(name, schema_from_spec(schema), "id", indexes, background_fold=not before)
    if before:
        for inv in ds.inverted.values():
            inv.add = types.MethodType(rowwise_add, inv)  # type: ignore[method-assign]
    return ds


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
    assert t0 is not None
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def fabric_ingest(
    bootstrap: str, topic: str, n: int, schema: dict, indexes: dict, before: bool
) -> tuple[float, Dataset, float]:
    """msgs/s until every message is in the dataset, and seconds after that until the
    HNSW graphs hold every row (0 without vectors)."""
    ds = new_dataset("bench", schema, indexes, before)
    ing = KafkaIngestor(
        "bench",
        ds,
        IngestOptions(
            bootstrap, topic, f"bench-fabric-{time.time()}", batch_size=5000, dead_letter="none"
        ),
    )
    ing._open()
    t0: float | None = None
    while ing.stats.applied < n:
        t_step = time.perf_counter()
        got = ing.step()
        if got and t0 is None:  # from the step that returned the first messages (same as raw)
            t0 = t_step
    assert t0 is not None
    dt = time.perf_counter() - t0
    ing.stop(checkpoint_now=False)
    assert ds.count() == n, (ds.count(), n)
    t1 = time.perf_counter()
    assert ds.wait_folded(600)
    graph = time.perf_counter() - t1
    ds.close()
    return n / dt, ds, graph


def latency(
    bootstrap: str, topic: str, rate: int, seconds: float, vecs: list[bytes] | None, before: bool
) -> tuple[list[float], float, list[float], int, list[float]]:
    """(produce->queryable seconds per message, achieved rate, query ms, max growing rows,
    produce->handed to the ingestor seconds per message: the broker + consumer share)"""
    if vecs is None:
        ds = new_dataset("lat", SCHEMA, INDEXES, before)
    else:
        ds = new_dataset("lat", {**SCHEMA, "embedding": "vector[384]"},
                         {**INDEXES, "embedding": "hnsw"}, before)  # fmt: skip
    ing = KafkaIngestor(
        "lat", ds, IngestOptions(bootstrap, topic, f"bench-lat-{time.time()}", dead_letter="none")
    )
    lat: list[float] = []
    apply = ing._apply

    fetch: list[float] = []

    def timed(msgs):  # the dataset holds the batch when _apply returns
        got = time.time()
        n = apply(msgs)
        done = time.time()
        lat.extend(done - m.timestamp()[1] / 1000.0 for m in msgs)
        fetch.extend(got - m.timestamp()[1] / 1000.0 for m in msgs)
        return n

    ing._apply = timed  # type: ignore[method-assign]
    ing.start()
    time.sleep(1.0)  # let it assign
    queries: list[float] = []
    growing = [0]
    stop = threading.Event()

    def reader() -> None:  # a query every 100 ms while ingesting
        q = np.random.default_rng(1).standard_normal(384).astype(np.float32)
        while not stop.wait(0.1):
            if ds.count() == 0:
                continue
            t = time.perf_counter()
            ds.search("embedding", q, 10)
            queries.append((time.perf_counter() - t) * 1e3)
            growing[0] = max(growing[0], ds.growing())

    rt = threading.Thread(target=reader, daemon=True)
    if vecs is not None:
        rt.start()
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
    stop.set()
    if vecs is not None:
        rt.join()
    ing.stop(checkpoint_now=False)
    ds.close()
    return lat, achieved, queries, growing[0], fetch


def drop(admin: AdminClient, topics: list[str]) -> None:
    if topics:
        for f in admin.delete_topics(topics).values():
            f.result(30)
        time.sleep(2.0)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def embed_throughput(n: int) -> None:
    """Texts/s of the hash embedder, batched, and upserts that embed at ingest."""
    import pyarrow as pa

    from fabric.embed import EmbedSpec, embed, filler

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(2000)]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(20, 60)))) for _ in range(n)]
    chars = sum(map(len, texts)) / n
    print(f"\nre-embedding {n:,} texts (~{chars:.0f} chars each), hash model (fabric.embed)\n")
    print(f"{'dim':>6}{'batch':>8}{'texts/s':>12}{'MB/s':>8}")
    for dim in (64, 384):
        for batch in (1, 64, 1024, 4096):
            m = min(n, 2000) if batch == 1 else n
            t0 = time.perf_counter()
            for i in range(0, m, batch):
                embed(texts[i : i + batch], dim)
            dt = time.perf_counter() - t0
            print(f"{dim:>6}{batch:>8}{m / dt:>12,.0f}{m * chars / dt / 1e6:>8.1f}")
    schema = pa.schema(
        [("id", pa.int64()), ("body", pa.string()), ("embedding", pa.list_(pa.float32(), 384))]
    )
    ids = pa.array(range(n), pa.int64())
    vecs = embed(texts, 384)
    given = pa.table(
        {
            "id": ids,
            "body": texts,
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), 384),
        },
        schema=schema,
    )
    bare = pa.table({"id": ids, "body": texts})
    print(f"\nupsert {n:,} rows in batches of 5000 into a dataset with a 384-d HNSW index")
    print(f"{'rows arrive':<28}{'rows/s':>10}")
    for label, table, embeds in (
        ("with their vectors", given, ()),
        ("text only, embed: at ingest", bare, (EmbedSpec("body", "embedding"),)),
    ):
        ds = Dataset.create("bench_embed", schema, "id", {"embedding": "hnsw"})
        ds.computed = filler(embeds, schema)
        t0 = time.perf_counter()
        for b in table.to_batches(5000):
            ds.upsert(b)
        dt = time.perf_counter() - t0
        ds.close()
        print(f"{label:<28}{n / dt:>10,.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default="127.0.0.1:9092")
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--vector-docs", type=int, default=20_000)
    ap.add_argument("--rate", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--no-before", action="store_true", help="skip the previous code paths")
    ap.add_argument("--embed-texts", type=int, default=20_000, help="texts re-embedded (4.)")
    ap.add_argument("--embed-only", action="store_true", help="only the re-embedding table")
    a = ap.parse_args(argv)
    if a.embed_only:
        embed_throughput(a.embed_texts)
        return 0
    run = f"{int(time.time())}"
    admin = AdminClient({"bootstrap.servers": a.bootstrap})
    topics: list[str] = []
    vecs = vec_pool()
    rows = []
    produced: dict[tuple[int, bool], tuple[str, float]] = {}
    vschema, vidx = {**SCHEMA, "embedding": "vector[384]"}, {**INDEXES, "embedding": "hnsw"}
    workloads = [
        ("docs, no indexes", a.docs, None, SCHEMA, {}, False),
        ("docs, no vectors", a.docs, None, SCHEMA, INDEXES, False),
        ("  before", a.docs, None, SCHEMA, INDEXES, True),
        ("docs + 384-d vector", a.vector_docs, vecs, vschema, vidx, False),
        ("  before", a.vector_docs, vecs, vschema, vidx, True),
    ]
    lat_runs = [
        ("no vectors", None, False),
        ("384-d vectors", vecs, False),
        ("  before", vecs, True),
    ]
    if a.no_before:
        workloads = [w for w in workloads if not w[-1]]
        lat_runs = [r for r in lat_runs if not r[-1]]
    try:
        for label, n, vs, schema, idx, before in workloads:
            if (n, vs is None) not in produced:  # the same documents share one topic
                topic = make_topic(a.bootstrap, f"bench_ingest_{run}_{len(topics)}", a.partitions)
                topics.append(topic)
                produce(a.bootstrap, topic, n, vs)
                raw = statistics.median(raw_consume(a.bootstrap, topic, n) for _ in range(3))
                produced[(n, vs is None)] = (topic, raw)
            topic, raw = produced[(n, vs is None)]
            fab, _ds, graph = fabric_ingest(a.bootstrap, topic, n, schema, idx, before)
            rows.append((label, n, raw, fab, graph))
        lats = []
        done = 0
        for label, vs, before in lat_runs:
            # topics already used are dropped first: the broker shares the 2 cores, and a
            # latency run should not pay for its housekeeping of earlier data
            drop(admin, topics[done:])
            done = len(topics)
            topic = make_topic(a.bootstrap, f"bench_ingest_{run}_lat{len(topics)}", a.partitions)
            topics.append(topic)
            lats.append((label, *latency(a.bootstrap, topic, a.rate, a.seconds, vs, before)))
    finally:
        left = [t for t in topics if t in admin.list_topics(timeout=10).topics]
        if left:
            admin.delete_topics(left)

    print(
        f"\nKafka -> indexed dataset (noida-db at {a.bootstrap}, {a.partitions} partitions, batch 5000)\n"
    )
    print(
        f"{'workload':<22}{'messages':>10}{'raw consume msg/s':>20}{'fabric msg/s':>15}{'fabric / raw':>14}{'graph done +s':>15}"
    )
    for label, n, raw, fab, graph in rows:
        print(f"{label:<22}{n:>10,}{raw:>20,.0f}{fab:>15,.0f}{fab / raw:>14.1%}{graph:>15.1f}")
    print(
        "(graph done +s: after the last message was queryable, seconds until the HNSW graph held every row)"
    )
    print(
        f"\nproduce -> queryable in every index (HNSW when vectors, B-tree, inverted), paced at {a.rate:,} msg/s for {a.seconds:g} s"
    )
    print(
        f"{'documents':<16}{'achieved msg/s':>16}{'messages':>10}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}"
        f"{'fetch p99':>11}{'query p50':>11}{'query p99':>11}{'max growing':>13}"
    )
    for label, lat, achieved, queries, growing, fetch in lats:
        ms = [x * 1000 for x in lat]
        qs = f"{pct(queries, 0.5):>11.2f}{pct(queries, 0.99):>11.2f}" if queries else f"{'':>22}"
        print(
            f"{label:<16}{achieved:>16,.0f}{len(ms):>10,}{pct(ms, 0.5):>10.1f}{pct(ms, 0.95):>10.1f}{pct(ms, 0.99):>10.1f}{max(ms):>10.1f}"
            f"{pct([x * 1000 for x in fetch], 0.99):>11.1f}{qs}{growing:>13,}"
        )
    print(
        "(fetch: produce -> the ingestor holds the message, i.e. broker + consumer; query: top-10\n"
        " vector search every 100 ms during ingestion, ms; max growing: rows in the exact segment)"
    )
    embed_throughput(a.embed_texts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
