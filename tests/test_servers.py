"""One real round trip per test server, through the client libraries the fabric uses."""

from __future__ import annotations

import datetime as dt
import json
import socket
import subprocess
import time
import urllib.request
import uuid
from decimal import Decimal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition

from tests.servers import ServerUnreachable, require

# --------------------------------------------------------------------------- SQL


def _sql_round_trip(url: str) -> None:
    engine = sa.create_engine(url)
    meta = sa.MetaData()
    merchants = sa.Table(  # a name of its own: other tests share the per-run database
        "roundtrip_merchants",
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("rating", sa.Numeric(3, 1)),
        sa.Column("opened", sa.Date),
    )
    rows = [
        {"id": i, "name": f"shop-{i} «ü»", "status": "active" if i % 3 else "closed",
         "rating": Decimal(f"{i % 5}.{i % 10}"), "opened": dt.date(2024, 1, 1 + i % 28)}
        for i in range(1, 31)
    ]  # fmt: skip
    try:
        meta.create_all(engine)
        with engine.begin() as con:
            con.execute(merchants.insert(), rows)  # executemany with bound parameters
        with engine.connect() as con:
            # A value that would break a spliced query travels safely as a parameter.
            hostile = "active' OR '1'='1"
            assert (
                con.execute(sa.select(merchants).where(merchants.c.status == hostile)).all() == []
            )
            got = con.execute(
                sa.select(merchants.c.id, merchants.c.name, merchants.c.rating, merchants.c.opened)
                .where(merchants.c.status == sa.bindparam("st"))
                .order_by(merchants.c.id),
                {"st": "active"},
            ).all()
        expected = [
            (r["id"], r["name"], r["rating"], r["opened"]) for r in rows if r["status"] == "active"
        ]
        assert [tuple(g) for g in got] == expected
        assert len(got) == 20
    finally:
        meta.drop_all(engine)
        engine.dispose()


def test_mariadb_round_trip(mariadb_url: str) -> None:
    assert "fabric_t_" in mariadb_url  # the per-run database, not the shared one
    _sql_round_trip(mariadb_url)


def test_postgres_round_trip(pg_url: str) -> None:
    assert "fabric_t_" in pg_url
    _sql_round_trip(pg_url)


# --------------------------------------------------------------------------- Kafka


def _consume(consumer: Consumer, count: int, timeout: float = 60.0) -> list:
    """Poll until `count` messages arrived (or time runs out); errors fail the test."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        assert msg.error() is None, msg.error()
        got.append(msg)
    return got


def _produce(bootstrap: str, topic: str, partitions: int, n: int, start: int = 0) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    errors = []

    def on_delivery(err, _msg) -> None:
        if err is not None:
            errors.append(err)

    for i in range(start, start + n):
        value = json.dumps({"seq": i, "user_id": i % 7}).encode()
        producer.produce(topic, key=str(i).encode(), value=value, partition=i % partitions,
                         on_delivery=on_delivery)  # fmt: skip
    assert producer.flush(30) == 0
    assert errors == []


def _consumer(bootstrap: str, group: str, **extra) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **extra,
        }
    )


def test_kafka_produce_consume_commit_and_watermarks(kafka_bootstrap: str, new_topic) -> None:
    topic = new_topic(partitions=3)
    _produce(kafka_bootstrap, topic, partitions=3, n=30)
    group = f"g-{uuid.uuid4().hex[:8]}"

    consumer = _consumer(kafka_bootstrap, group)
    consumer.subscribe([topic])
    try:
        msgs = _consume(consumer, 30)
        assert sorted(json.loads(m.value())["seq"] for m in msgs) == list(range(30))
        for m in msgs:  # each message landed on the partition it was sent to
            assert m.partition() == int(m.key()) % 3
        consumer.commit(asynchronous=False)
        parts = [TopicPartition(topic, p) for p in range(3)]
        assert [tp.offset for tp in consumer.committed(parts, timeout=10)] == [10, 10, 10]
        for p in range(3):  # noida-db reports exact high watermarks
            assert consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) == (0, 10)
    finally:
        consumer.close()

    # A new member of the same group resumes after the committed offsets.
    _produce(kafka_bootstrap, topic, partitions=3, n=3, start=30)
    again = _consumer(kafka_bootstrap, group)
    again.subscribe([topic])
    try:
        resumed = _consume(again, 3)
        assert sorted(json.loads(m.value())["seq"] for m in resumed) == [30, 31, 32]
        assert _consume(again, 1, timeout=2.0) == []  # nothing delivered twice
    finally:
        again.close()


def test_tansu_produce_consume_round_trip(tansu_bootstrap: str, tansu_topic) -> None:
    topic = tansu_topic(partitions=2)
    _produce(tansu_bootstrap, topic, partitions=2, n=40)
    # Tansu's default session timeout makes a group join take ~23 s; 6000 ms gives ~3 s.
    consumer = _consumer(
        tansu_bootstrap, f"g-{uuid.uuid4().hex[:8]}", **{"session.timeout.ms": 6000}
    )
    consumer.subscribe([topic])
    try:
        msgs = _consume(consumer, 40)
        seqs = [json.loads(m.value())["seq"] for m in msgs]
        assert sorted(seqs) == list(range(40))
        for p in (0, 1):  # order is kept within a partition
            in_p = [s for m, s in zip(msgs, seqs) if m.partition() == p]
            assert in_p == sorted(in_p) and all(s % 2 == p for s in in_p)
        consumer.commit(asynchronous=False)
        committed = consumer.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=10)
        assert [tp.offset for tp in committed] == [20, 20]
    finally:
        consumer.close()


# --------------------------------------------------------------------------- MongoDB


def test_mongo_insert_find_filter_projection_sort(mongo_db) -> None:
    coupons = mongo_db["roundtrip_coupons"]  # other tests share the per-run database
    docs = [
        {"code": f"C{i:03d}", "merchant_id": i % 4, "discount": (i * 7) % 50, "tags": ["food"] if i % 2 else ["tech"]}
        for i in range(40)
    ]  # fmt: skip
    coupons.insert_many(docs)
    coupons.create_index([("merchant_id", 1), ("discount", -1)])
    got = list(
        coupons.find({"merchant_id": {"$in": [1, 2]}, "discount": {"$gte": 10}}, {"_id": 0, "code": 1, "discount": 1})
        .sort([("discount", -1), ("code", 1)])
        .limit(5)
    )  # fmt: skip
    expected = sorted(
        ({"code": d["code"], "discount": d["discount"]} for d in docs
         if d["merchant_id"] in (1, 2) and d["discount"] >= 10),
        key=lambda d: (-d["discount"], d["code"]),
    )[:5]  # fmt: skip
    assert got == expected
    assert coupons.count_documents({"tags": "food"}) == 20


# --------------------------------------------------------------------------- S3


def test_s3_parquet_round_trip_and_dataset(s3) -> None:
    table = pa.table(
        {
            "order_id": pa.array(range(100), pa.int64()),
            "category": pa.array([["books", "food", "tech"][i % 3] for i in range(100)]),
            "amount": pa.array([round(i * 1.25, 2) for i in range(100)], pa.float64()),
        }
    )
    pq.write_table(table, s3.path("one/orders.parquet"), filesystem=s3.fs)
    assert pq.read_table(s3.path("one/orders.parquet"), filesystem=s3.fs).equals(table)

    # Two files under a prefix, read as one dataset with a filter pushed into the scan.
    for part in range(2):
        chunk = table.slice(part * 50, 50)
        pq.write_table(chunk, s3.path(f"orders/part-{part}.parquet"), filesystem=s3.fs)
    dataset = pads.dataset(s3.path("orders/"), filesystem=s3.fs, format="parquet")
    assert len(dataset.files) == 2
    food = dataset.to_table(columns=["amount"], filter=pc.field("category") == "food")
    expected = [
        a for a, c in zip(table["amount"].to_pylist(), table["category"].to_pylist()) if c == "food"
    ]
    assert sorted(food["amount"].to_pylist()) == sorted(expected)

    listed = s3.boto3_client().list_objects_v2(Bucket=s3.bucket, Prefix="orders/")
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        "orders/part-0.parquet",
        "orders/part-1.parquet",
    ]


# --------------------------------------------------------------------------- Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_prometheus_scrapes_a_metrics_endpoint(prometheus_bin: str, tmp_path) -> None:
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    Gauge("fabric_test_lag_messages", "lag of a test source", registry=registry).set(1234)
    target_port = _free_port()
    server, _thread = start_http_server(target_port, addr="127.0.0.1", registry=registry)
    prom_port = _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: fabric\n    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?query=fabric_test_lag_messages"
        value = None
        deadline = time.monotonic() + 60
        while value is None and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                body = json.load(urllib.request.urlopen(url, timeout=2))
            except OSError:
                continue
            result = body["data"]["result"]
            if result:
                value = float(result[0]["value"][1])
        assert value == 1234.0
    finally:
        proc.terminate()
        proc.wait(10)
        server.shutdown()


# --------------------------------------------------------------------------- harness


def test_unreachable_server_fails_with_the_server_name_and_the_fix() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ServerUnreachable) as info:
            require("MariaDB", f"mysql+pymysql://u:p@127.0.0.1:{closed_port}/x", lambda: None)
    assert "MariaDB" in str(info.value) and "run scripts/services up" in str(info.value)
