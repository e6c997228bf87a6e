"""What only one connector does: S3 pruning, Kafka bounded/time-range/latest_by scans and
bad messages, JSON decoding, Mongo operator objects, SQL bound parameters."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from connectors.arrow_expr import filter_table
from connectors.base import ScanRequest, to_table
from connectors.json_decode import decode_json_messages, infer_schema
from connectors.testing import data
from dsl.ast import Binary, Column, InList, Literal, Param

# ------------------------------------------------------------------------------ JSON decoding

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("name", pa.string()),
        ("at", pa.timestamp("us", tz="UTC")),
        ("meta.city", pa.string()),
        ("v", pa.list_(pa.float32(), 2)),
    ]
)


def test_decode_json_messages_skips_and_reports_bad_rows() -> None:
    values = [
        b'{"id": 1, "name": "a", "at": "2024-01-01T00:00:00Z", "meta": {"city": "Paris"}, "v": [1, 2]}',
        b"not json",
        None,
        b"[1, 2]",
        b'{"id": "seven", "name": "b"}',
        b'{"id": 2, "at": 1704067200000, "v": [1, 2, 3]}',
        b'{"id": 3.0, "at": 1704067200, "extra": true}',
    ]
    batch, errors = decode_json_messages(values, SCHEMA)
    assert batch.schema == SCHEMA
    assert batch.column("id").to_pylist() == [1, 3]
    assert batch.column("meta.city").to_pylist() == ["Paris", None]
    assert batch.column("at").to_pylist()[1] == dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    assert [i for i, _ in errors] == [1, 2, 3, 4, 5]
    reasons = dict(errors)
    assert (
        "invalid JSON" in reasons[1] and "tombstone" in reasons[2] and "JSON object" in reasons[3]
    )
    assert "field 'id'" in reasons[4] and "vector of 2" in reasons[5]


def test_infer_schema_flattens_and_widens() -> None:
    s = infer_schema(
        [
            {"a": 1, "b": {"c": "x"}, "t": [1]},
            {"a": 2.5, "b": {"c": "y"}, "t": [2.0], "m": {"$x": 1}},
        ]
    )
    assert s.field("a").type == pa.float64()
    assert s.field("b.c").type == pa.string()
    assert s.field("t").type == pa.list_(pa.float64())
    assert s.field("m").type == pa.string() and s.field("m").metadata  # kept as JSON text


# ------------------------------------------------------------------------------ S3 pruning


@pytest.fixture(scope="module")
def lake(s3: Any) -> Any:

    t = data.table().append_column(
        "region", pa.array([["eu", "us", "apac"][r % 3] for r in range(data.N)])
    )
    ds.write_dataset(
        t.sort_by("id"),
        s3.path("pruning/merchants"),
        filesystem=s3.fs,
        format="parquet",
        partitioning=["region"],
        partitioning_flavor="hive",
        max_rows_per_group=20,
        min_rows_per_group=20,
        existing_data_behavior="overwrite_or_ignore",
    )
    return s3.connection("lake")


def test_s3_partition_and_row_group_pruning(lake: Any) -> None:
    src = lake.source("pruning/merchants/")
    assert "region" in src.schema().names
    f = (Binary("=", Column("region"), Param("r")), Binary("<", Column("id"), Literal(40, "int")))
    req = ScanRequest(filters=f, params={"r": "eu"}, columns=("id", "region"))
    out = to_table(
        src.scan(req), pa.schema([src.schema().field("id"), src.schema().field("region")])
    )
    want = [r["id"] for i, r in enumerate(data.rows()) if i % 3 == 0 and r["id"] < 40]
    assert sorted(out.column("id").to_pylist()) == want
    st = req.metrics  # the scan's own (connectors.base.ScanMetrics)
    assert st.files_total == 3 and st.files_read == 1  # partition pruning
    assert st.row_groups_read < st.row_groups_total  # statistics pruning (ids are sorted)
    assert st.rows == len(want)


def test_s3_statistics_exact_and_watermark(lake: Any) -> None:
    src = lake.source("pruning/merchants/")
    st = src.statistics()
    assert st.row_count == data.N and st.exact and st.total_bytes > 0
    assert st.columns["id"].min == 1 and st.columns["id"].max == data.N
    assert st.columns["score"].null_count == sum(r["score"] is None for r in data.rows())
    wm = src.watermark()
    assert wm.event_time is not None and abs(wm.event_time - time.time()) < 3600


def test_s3_unknown_object_lists_existing(lake: Any) -> None:
    from connectors.base import UnknownObjectError

    with pytest.raises(UnknownObjectError) as err:
        lake.source("prunning/*.parquet")
    assert "pruning/" in err.value.existing


# ------------------------------------------------------------------------------ Kafka


def _produce(
    bootstrap: str, topic: str, values: list[tuple[bytes | None, bytes | None, int]]
) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for key, value, ts in values:
        p.produce(topic, key=key, value=value, timestamp=ts)
    p.flush(30)


LOC = {"user_id": "int", "lat": "float", "lon": "float", "at": "timestamp"}


@pytest.mark.parametrize("broker", ["kafka", "tansu"])
def test_kafka_latest_by_time_range_and_bad_messages(
    broker: str, request: pytest.FixtureRequest
) -> None:
    from connectors.kafka import KafkaConnection

    bootstrap = request.getfixturevalue(
        "kafka_bootstrap" if broker == "kafka" else "tansu_bootstrap"
    )
    topic = request.getfixturevalue("new_topic" if broker == "kafka" else "tansu_topic")(
        partitions=3, prefix="loc"
    )
    base = int(time.time() * 1000) - 100_000
    msgs = []
    for i in range(90):
        user = i % 3
        body = {"user_id": user, "lat": float(i), "lon": -float(i), "at": base + i * 1000}
        msgs.append((str(user).encode(), json.dumps(body).encode(), base + i * 1000))
    msgs += [
        (b"0", b"{broken", base + 95_000),
        (b"1", b'{"user_id": "x"}', base + 96_000),
        (b"2", None, base + 97_000),
    ]
    _produce(bootstrap, topic, msgs)
    opts = {
        "bootstrap": bootstrap,
        "schemas": {topic: LOC},
        **({"end": "eof"} if broker == "tansu" else {}),
    }
    src = KafkaConnection("bus", opts).source(topic)

    req = ScanRequest()
    all_rows = to_table(src.scan(req), src.schema())
    assert all_rows.num_rows == 90
    assert req.metrics.bad_records == 3 and len(req.metrics.bad_samples) == 3

    # latest location of user 1: its newest message (i = 88)
    latest = to_table(
        src.scan(
            ScanRequest(
                filters=(Binary("=", Column("user_id"), Param("u")),),
                params={"u": 1},
                latest_by=("user_id",),
            )
        ),
        src.schema(),
    )
    assert latest.to_pylist() == [
        {
            "user_id": 1,
            "lat": 88.0,
            "lon": -88.0,
            "at": dt.datetime.fromtimestamp((base + 88_000) / 1000, dt.UTC),
        }
    ]
    every = to_table(src.scan(ScanRequest(latest_by=("user_id",))), src.schema())
    assert sorted(every.column("lat").to_pylist()) == [87.0, 88.0, 89.0]

    # a time range: messages 10..19 (by message timestamp)
    tr = ((base + 10_000) / 1000, (base + 19_000) / 1000)
    window = to_table(src.scan(ScanRequest(time_range=tr)), src.schema())
    assert sorted(window.column("lat").to_pylist()) == [float(i) for i in range(10, 20)]

    wm = src.watermark()
    assert wm.lag_messages == 0 and wm.event_time is not None


def test_kafka_filter_applied_on_every_batch_is_exact(kafka_bootstrap: str, new_topic: Any) -> None:
    from connectors.base import Pushdown
    from connectors.kafka import KafkaConnection

    topic = new_topic(partitions=2)
    now = int(time.time() * 1000)
    _produce(
        kafka_bootstrap,
        topic,
        [
            (None, json.dumps({"user_id": i, "lat": 0.0, "lon": 0.0, "at": now}).encode(), now)
            for i in range(500)
        ],
    )
    src = KafkaConnection("bus", {"bootstrap": kafka_bootstrap, "schemas": {topic: LOC}}).source(
        topic
    )
    f = InList(Column("user_id"), Param("ids"))
    assert src.supports_filter(f) is Pushdown.EXACT
    req = ScanRequest(filters=(f,), params={"ids": [1, 250, 499, 1000]}, batch_size=50)
    out = to_table(src.scan(req), src.schema())
    assert sorted(out.column("user_id").to_pylist()) == [1, 250, 499]
    assert req.metrics.records == 500


# ------------------------------------------------------------------------------ Mongo and SQL


def test_mongo_operator_objects_are_values(mongo_db: Any, mongo_url: str) -> None:
    """{"$ne": null} stored as a value is found by exactly that value, and never acts as an operator."""
    from connectors.mongo import MongoConnection

    mongo_db.ops.insert_many(
        [{"k": 1, "tag": "a"}, {"k": 2, "tag": "b"}, {"k": 3, "tag": '{"$ne": null}'}]
    )
    conn = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name})
    src = conn.source("ops")
    for hostile in ({"$ne": None}, {"$where": "sleep(1000)"}, {"$gt": ""}):
        req = ScanRequest(filters=(Binary("=", Column("tag"), Param("v")),), params={"v": hostile})
        out = to_table(src.scan(req), src.schema())
        expected = [3] if hostile == {"$ne": None} else []  # only the row holding that exact text
        assert out.column("k").to_pylist() == expected
        sent = json.loads(req.metrics.statement)  # the filter this scan sent
        assert sent == {"tag": json.dumps(hostile, sort_keys=True)}  # a plain string
    assert mongo_db.ops.count_documents({}) == 3


def test_sql_values_never_reach_the_statement_text(mariadb_url: str) -> None:
    import sqlalchemy as sa

    from connectors.sql import SqlConnection

    engine = sa.create_engine(mariadb_url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE IF NOT EXISTS x (id INT PRIMARY KEY, name VARCHAR(40))")
        c.exec_driver_sql("REPLACE INTO x VALUES (1, 'a'), (2, 'b')")
    src = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url}).source("x")
    hostile = "'; DROP TABLE x; --"
    req = ScanRequest(filters=(InList(Column("name"), Param("v")),), params={"v": [hostile, "a"]})
    out = to_table(src.scan(req), src.schema())
    assert out.column("id").to_pylist() == [1]
    sent = req.metrics.statement  # the text the driver was sent
    assert sent is not None and "name IN" in sent
    assert hostile not in sent and "DROP" not in sent
    with engine.connect() as c:
        assert c.exec_driver_sql("SELECT COUNT(*) FROM x").scalar() == 2
    engine.dispose()


def test_fabric_reapplies_a_filter_the_source_refuses(mongo_db: Any, mongo_url: str) -> None:
    """End to end fail-closed: Mongo cannot push `a + b > 5`; the residual filter still holds."""
    from connectors.base import Pushdown
    from connectors.mongo import MongoConnection

    mongo_db.arith.insert_many([{"a": i, "b": i} for i in range(6)])
    src = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name}).source("arith")
    f = Binary(">", Binary("+", Column("a"), Column("b")), Literal(5, "int"))
    assert src.supports_filter(f) is Pushdown.UNSUPPORTED
    raw = to_table(src.scan(ScanRequest()), src.schema())
    assert raw.num_rows == 6
    assert filter_table(raw, f, {}).column("a").to_pylist() == [3, 4, 5]


def test_decode_fast_path_agrees_with_careful_path() -> None:
    """Large clean batches go through pyarrow's JSON reader; the answer must not change."""
    from connectors import json_decode

    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("x", pa.float64()),
            ("ok", pa.bool_()),
            ("s", pa.string()),
            ("at", pa.timestamp("us", tz="UTC")),
        ]
    )
    values = [
        json.dumps(
            {
                "id": i,
                "x": i / 2 if i % 3 else i,
                "ok": i % 2 == 0,
                "s": f"é{i}" if i % 5 else None,
                "at": f"2024-01-01T00:00:{i % 60:02d}+00:00",
                "other": [i],
            }
        ).encode()
        for i in range(300)
    ]
    fast = json_decode._fast_decode(values, schema)
    assert fast is not None
    docs = [json.loads(v) for v in values]
    careful, errors = json_decode.rows_to_batch(docs, schema)
    assert not errors and fast.equals(careful)
    # two objects in one message plus an empty one must not pass as two good rows
    tricky = [*values[:100], b'{"id": 1} {"id": 2}', b""]
    batch, errs = decode_json_messages(tricky, schema)
    assert batch.num_rows == 100 and [i for i, _ in errs] == [100, 101]


def test_config_style_options_and_declared_arrow_schema(
    mongo_db: Any, mongo_url: str, s3: Any
) -> None:
    """The keys fabric.yaml accepts (query_timeout, nested options:, prefix, a pa.Schema from
    the catalog) reach the connectors."""
    from connectors.base import open_connection

    mongo_db.typed.insert_many([{"n": 1, "s": "a"}, {"n": "two", "s": "b"}])
    conn = open_connection(
        "crm",
        {
            "kind": "mongo",
            "url": mongo_url,
            "database": mongo_db.name,
            "connect_timeout": 2,
            "options": {"sample": 1},
        },
    )
    assert conn.timeout == 2 and conn.sample == 1
    declared = pa.schema([("n", pa.int64()), ("s", pa.string())])
    src = conn.source("typed", {"schema": declared})
    assert src.schema() == declared
    req = ScanRequest()
    out = to_table(src.scan(req), declared)
    assert out.to_pylist() == [{"n": 1, "s": "a"}, {"n": None, "s": "b"}]  # wrong type -> null
    assert req.metrics.bad_records == 1 and req.metrics.records == 2

    with s3.fs.open_output_stream(s3.path("pre/fix/cats.csv")) as f:
        f.write(b"id,name\n1,food\n2,toys\n")
    lake = open_connection(
        "lake",
        {
            "kind": "s3",
            "endpoint": s3.endpoint.split("://", 1)[1],
            "scheme": "http",
            "bucket": s3.bucket,
            "prefix": "pre/fix",
            "access_key": s3.access_key,
            "secret_key": s3.secret_key,
        },
    )
    assert lake.list_objects() == ["cats.csv"]
    cats = lake.source("cats.csv")
    assert to_table(cats.scan(ScanRequest()), cats.schema()).column("name").to_pylist() == [
        "food",
        "toys",
    ]


def test_json_lines_files_with_nested_values(tmp_path: Any) -> None:
    from connectors.base import Pushdown
    from connectors.s3 import S3Connection

    (tmp_path / "events").mkdir()
    lines = [
        json.dumps(
            {"id": i, "kind": ["click", "view"][i % 2], "at": f"2024-01-0{1 + i % 3}T00:00:00"}
        )
        for i in range(30)
    ]
    (tmp_path / "events" / "a.jsonl").write_text("\n".join(lines[:15]) + "\n")
    (tmp_path / "events" / "b.ndjson").write_text("\n".join(lines[15:]) + "\n")
    conn = S3Connection("files", {"kind": "file", "root": str(tmp_path)})
    src = conn.source("events/")
    assert src.format == "json" and src.schema().field("id").type == pa.int64()
    f = Binary("=", Column("kind"), Param("k"))
    assert src.supports_filter(f) is Pushdown.EXACT
    req = ScanRequest(filters=(f,), params={"k": "view"}, columns=("id",))
    out = to_table(src.scan(req), pa.schema([("id", pa.int64())]))
    assert sorted(out.column("id").to_pylist()) == list(range(1, 30, 2))
    assert req.metrics.files_read == 2 and req.metrics.rows == 15


def test_kafka_time_range_on_an_event_time_field(kafka_bootstrap: str, new_topic: Any) -> None:
    """With timestamp_field the window applies to the JSON field, not the broker's time."""
    from connectors.kafka import KafkaConnection

    topic = new_topic(partitions=2)
    now = int(time.time() * 1000)
    # broker timestamps are all 'now'; event times are one minute apart
    event0 = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
    msgs = [
        (
            None,
            json.dumps(
                {
                    "user_id": i,
                    "lat": 0.0,
                    "lon": 0.0,
                    "at": (event0 + dt.timedelta(minutes=i)).isoformat(),
                }
            ).encode(),
            now,
        )
        for i in range(20)
    ]
    _produce(kafka_bootstrap, topic, msgs)
    src = KafkaConnection(
        "bus", {"bootstrap": kafka_bootstrap, "schemas": {topic: LOC}, "timestamp_field": "at"}
    ).source(topic)
    lo = (event0 + dt.timedelta(minutes=5)).timestamp()
    hi = (event0 + dt.timedelta(minutes=9)).timestamp()
    out = to_table(src.scan(ScanRequest(time_range=(lo, hi))), src.schema())
    assert sorted(out.column("user_id").to_pylist()) == [5, 6, 7, 8, 9]


def test_filters_reaching_scan_unoffered_are_applied_by_the_connector(
    mongo_db: Any, mongo_url: str, tmp_path: Any
) -> None:
    """A dynamic join-key filter arrives without supports_filter; if it does not translate
    (SQLite string keys under a NOCASE collation, Mongo arithmetic) the connector applies
    it itself, before the limit."""
    import sqlalchemy as sa

    from connectors.base import Pushdown
    from connectors.mongo import MongoConnection
    from connectors.sql import SqlConnection

    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE m (id INTEGER PRIMARY KEY, code TEXT COLLATE NOCASE)")
        c.exec_driver_sql("INSERT INTO m VALUES (1, 'a'), (2, 'b'), (3, 'A'), (4, 'c')")
    src = SqlConnection("lite", {"kind": "sql", "url": url}).source("m")
    f = InList(Column("code"), Param("__dyn_0"))
    assert src.supports_filter(f) is Pushdown.UNSUPPORTED
    out = to_table(
        src.scan(
            ScanRequest(columns=("id",), filters=(f,), params={"__dyn_0": ["a", "c"]}, limit=1)
        ),
        pa.schema([("id", pa.int64())]),
    )
    assert out.column("id").to_pylist() == [1]
    out = to_table(
        src.scan(ScanRequest(columns=("id",), filters=(f,), params={"__dyn_0": ["a", "c"]})),
        pa.schema([("id", pa.int64())]),
    )
    assert sorted(out.column("id").to_pylist()) == [1, 4]

    mongo_db.dyn.insert_many([{"a": i, "b": 10 - i} for i in range(10)])
    msrc = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name}).source("dyn")
    g = Binary(
        ">", Binary("*", Column("a"), Column("b")), Literal(20, "int")
    )  # a*(10-a) > 20: a in 3..7
    assert msrc.supports_filter(g) is Pushdown.UNSUPPORTED
    both = (g, Binary(">=", Column("a"), Literal(5, "int")))
    req = ScanRequest(columns=("a",), filters=both, limit=2)
    out = to_table(msrc.scan(req), pa.schema([("a", pa.int64())]))
    assert out.column("a").to_pylist() == [5, 6]
    assert json.loads(req.metrics.statement) == {"a": {"$gte": 5}}


def test_zoneless_file_timestamps_read_as_utc_and_filterable(tmp_path: Any) -> None:
    """Parquet written with naive timestamp[ns]: the column is UTC, and a timestamp filter
    works (applied on the batches, since the file statistics are zoneless)."""
    import pyarrow.parquet as pq

    from connectors.base import Pushdown
    from connectors.s3 import S3Connection

    t0 = dt.datetime(2024, 1, 1)
    tab = pa.table(
        {
            "id": list(range(100)),
            "ts": pa.array([t0 + dt.timedelta(hours=i) for i in range(100)], pa.timestamp("ns")),
        }
    )
    pq.write_table(tab, tmp_path / "x.parquet", row_group_size=10)
    src = S3Connection("f", {"kind": "file", "root": str(tmp_path)}).source("x.parquet")
    assert src.schema().field("ts").type == pa.timestamp("ns", tz="UTC")
    f = Binary(">=", Column("ts"), Param("t"))
    assert src.supports_filter(f) is Pushdown.EXACT
    out = to_table(
        src.scan(
            ScanRequest(
                filters=(f, Binary("<", Column("id"), Literal(90, "int"))),
                params={"t": dt.datetime(2024, 1, 4, tzinfo=dt.UTC)},
                columns=("id",),
                limit=5,
            )
        ),
        pa.schema([("id", pa.int64())]),
    )
    assert out.column("id").to_pylist() == [72, 73, 74, 75, 76]
    assert src.statistics().columns["ts"].min == dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def test_empty_sources_need_a_declared_schema(
    mongo_db: Any, mongo_url: str, kafka_bootstrap: str, new_topic: Any
) -> None:
    from connectors.base import SourceError
    from connectors.kafka import KafkaConnection
    from connectors.mongo import MongoConnection

    mongo_db.create_collection("empty")
    mc = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name})
    with pytest.raises(
        SourceError, match=r"mongo://crm/empty: cannot infer a schema.*schemas\.empty"
    ):
        mc.source("empty")
    assert mc.source("empty", {"schema": {"a": "int"}}).schema().names == ["a"]
    topic = new_topic()
    kc = KafkaConnection("bus", {"bootstrap": kafka_bootstrap, "timeout": 2})
    with pytest.raises(SourceError, match=f"kafka://bus/{topic}: cannot infer a schema"):
        kc.source(topic)


def test_mongo_object_ids_compare_as_object_ids(mongo_db: Any, mongo_url: str) -> None:
    from connectors.mongo import MongoConnection

    ids = mongo_db.oids.insert_many([{"n": i} for i in range(3)]).inserted_ids
    src = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name}).source("oids")
    out = to_table(
        src.scan(
            ScanRequest(
                filters=(InList(Column("_id"), Param("ids")),),
                params={"ids": [str(ids[1]), "nothex"]},
            )
        ),
        src.schema(),
    )
    assert out.to_pylist() == [{"_id": str(ids[1]), "n": 1}]
