"""Red team, Kafka: ``latest_by`` a float key, on the real broker (noida-db).

The newest record per key: keys equal as SQL (and DuckDB) compares them, -0.0 = 0.0 and
NaN = NaN (whatever its bits). Found here: pyarrow's hash grouping kept a record for
0.0 and another for -0.0 (two "newest" rows of one key, the older one a stale answer),
no error."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import duckdb
import pytest

from connectors.base import ScanRequest, to_table
from connectors.kafka import KafkaConnection

pytestmark = pytest.mark.kafka


def test_latest_by_a_float_key_keeps_one_row_per_sql_key(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    from confluent_kafka import Producer

    topic = new_topic(partitions=2, prefix="rtf")
    keys = [0.0, -0.0, 1.5, float("nan"), 0.0, -0.0, float("nan"), 1.5, -0.0, None]
    base = int(time.time() * 1000) - 100_000
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for i, k in enumerate(keys):  # json.dumps writes NaN as the token NaN
        p.produce(topic, value=json.dumps({"i": i, "k": k}).encode(), timestamp=base + i * 1000)
    p.flush(30)
    conn = KafkaConnection(
        "bus", {"bootstrap": kafka_bootstrap, "schemas": {topic: {"i": "int", "k": "float"}}}
    )
    try:
        src = conn.source(topic)
        every = to_table(src.scan(ScanRequest()), src.schema())
        assert every.num_rows == len(keys)
        got = to_table(src.scan(ScanRequest(latest_by=("k",))), src.schema())
    finally:
        conn.close()
    con = duckdb.connect()
    con.register("t", every)
    want = con.sql("SELECT max(i) FROM t GROUP BY k").fetchall()  # i grows with the time
    assert sorted(got["i"].to_pylist()) == sorted(r[0] for r in want), got.to_pylist()


def test_the_fabrics_own_latest_by_keeps_one_row_per_sql_key() -> None:
    """latest_by applied by the fabric, for a source that cannot: the same keys."""
    import pyarrow as pa

    from fabric.execute.units import latest_per_key

    keys = [0.0, -0.0, 1.5, float("nan"), 0.0, -0.0, float("nan"), 1.5, -0.0, None]
    t = pa.table({"i": pa.array(range(len(keys)), pa.int64()), "k": pa.array(keys)})
    got = latest_per_key(t, ("k",))
    con = duckdb.connect()
    con.register("t", t)
    want = con.sql("SELECT max(i) FROM t GROUP BY k").fetchall()
    assert sorted(got["i"].to_pylist()) == sorted(r[0] for r in want)
