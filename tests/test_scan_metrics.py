"""Per-scan metrics come back with each scan (issue 20): ``ScanRequest.metrics``, a
``connectors.base.ScanMetrics`` the source fills while it scans and the executor reports
under the source in ``res.stats["sources"][alias]["source"]``. Nothing per scan lives on
the Source object, which the catalog caches per URI and every concurrent query shares.

Two threads query the SAME catalog-cached source with different filters on the real
servers (MariaDB, PostgreSQL, SeaweedFS S3, noida-db Kafka, SecantusDB Mongo). The race is
made certain, not likely: each scan is held (a ``threading.Barrier``) after it produced
its first batch until the other scan has too, so both have started, and written whatever
they keep, before either finishes. Before, the statement, file counts, documents and bad
messages were kept on the shared source (``last_scan``, ``_last_stmt``, ``last_stats``),
where the second scan overwrote the first's, and none of them reached ``res.stats``.
"""

from __future__ import annotations

import json
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fabric
from connectors.base import ScanMetrics, ScanRequest

pytestmark = pytest.mark.timeout(120)


def open_fab(tmp_path: Path, connection: str, bindings: dict[str, str], extra: str = "") -> Any:
    (tmp_path / "agents").mkdir(exist_ok=True)
    (tmp_path / "fabric.yaml").write_text(
        "connections:\n"
        + textwrap.indent(textwrap.dedent(connection).strip(), "  ")
        + "\nbindings: [agents/]\n"
        + extra
    )
    for name, body in bindings.items():
        (tmp_path / "agents" / f"{name}.yaml").write_text(textwrap.dedent(body))
    return fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False)


def held(source: Any, barrier: threading.Barrier) -> Callable[[ScanRequest], Iterator[Any]]:
    """``source.scan`` holding each scan after its first batch until the other's has one."""
    scan = source.scan

    def wrapper(request: ScanRequest) -> Iterator[Any]:
        batches = iter(scan(request))
        first = next(batches, None)
        barrier.wait()
        if first is not None:
            yield first
        yield from batches

    return wrapper


def concurrently(fab: Any, uri: str, names: list[str]) -> dict[str, Any]:
    """``fab.query(name)`` for each name at once, scans held together; name -> result."""
    source = fab.catalog.source(uri)  # the one object every query of this URI scans
    barrier = threading.Barrier(len(names), timeout=60)
    source.scan = held(source, barrier)
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            results[name] = fab.query(name)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del source.scan  # the class's scan again
    assert not errors, errors
    assert fab.catalog.source(uri) is source  # both scanned the same object
    return results


def metrics(res: Any, alias: str) -> dict[str, Any]:
    return res.stats["sources"][alias]["source"]


def binding(name: str, uri: str, where: str, select: str = "t.id") -> str:
    return f"""\
    binding: {name}
    sources:
      t: {{from: "{uri}", where: "{where}"}}
    select: [{select}]
    """


# ---------------------------------------------------------------- SQL


@pytest.mark.parametrize("server", ["mariadb", "postgres"])
def test_sql_scans_report_their_own_statement(
    tmp_path: Path, request: Any, server: str, test_run_id: str
) -> None:
    import sqlalchemy as sa

    url = request.getfixturevalue("mariadb_url" if server == "mariadb" else "pg_url")
    table = f"sm_{test_run_id}"
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text(f"CREATE TABLE {table} (id INT PRIMARY KEY, city VARCHAR(20), n INT)"))
        c.execute(
            sa.text(f"INSERT INTO {table} VALUES (:id, :city, :n)"),
            [{"id": i, "city": "Paris" if i % 2 else "Lyon", "n": i} for i in range(40)],
        )
    engine.dispose()
    kind = "mysql" if server == "mariadb" else "postgres"
    uri = f"{kind}://db/{table}"
    with open_fab(
        tmp_path,
        f'db: {{kind: {kind}, url: "{url}"}}',
        {
            "by_city": binding("by_city", uri, "t.city = 'Paris'"),
            "by_n": binding("by_n", uri, "t.n < 10"),
        },
    ) as fab:
        res = concurrently(fab, uri, ["by_city", "by_n"])
        assert res["by_city"].table.num_rows == 20 and res["by_n"].table.num_rows == 10
        city = metrics(res["by_city"], "t")["statement"].split("WHERE")[1]
        n = metrics(res["by_n"], "t")["statement"].split("WHERE")[1]
        # each names its own filter's column after WHERE, and not the other's
        assert ".city =" in city and ".n <" not in city, city
        assert ".n <" in n and "city" not in n, n
        text = fab.explain("by_n", analyze=True)
        sent = next(ln for ln in text.splitlines() if ln.startswith(f"Sent t <- {uri}: SELECT "))
        assert "WHERE" in sent and ".n <" in sent, text  # the statement on one line


# ---------------------------------------------------------------- S3


def test_s3_scans_report_their_own_file_counts(tmp_path: Path, s3: Any, test_run_id: str) -> None:
    prefix = f"sm-{test_run_id}"
    for region in ("eu", "us", "asia", "af"):
        t = pa.table({"id": list(range(10)), "v": [1.5] * 10})
        pq.write_table(t, f"{s3.path(prefix)}/region={region}/part.parquet", filesystem=s3.fs)
    o = s3.options()
    conn = (
        f'lake: {{kind: s3, endpoint: "{o["endpoint"]}", bucket: "{o["bucket"]}", '
        f'access_key: "{o["access_key"]}", secret_key: "{o["secret_key"]}"}}'
    )
    uri = f"s3://lake/{prefix}/"
    with open_fab(
        tmp_path,
        conn,
        {
            "one": binding("one", uri, "t.region = 'eu'"),
            "three": binding("three", uri, "t.region != 'eu'"),
        },
    ) as fab:
        res = concurrently(fab, uri, ["one", "three"])
        assert res["one"].table.num_rows == 10 and res["three"].table.num_rows == 30
        one, three = metrics(res["one"], "t"), metrics(res["three"], "t")
        assert (one["files_read"], one["files_total"]) == (1, 4), one
        assert (three["files_read"], three["files_total"]) == (3, 4), three
        assert "files=1/4" in fab.explain("one", analyze=True)


# ---------------------------------------------------------------- Mongo


def test_mongo_scans_report_their_own_filter_and_documents(
    tmp_path: Path, mongo_url: str, mongo_db: Any, test_run_id: str
) -> None:
    coll = f"sm_{test_run_id}"
    mongo_db[coll].insert_many(
        [{"id": i, "city": "Paris" if i % 2 else "Lyon", "n": i} for i in range(40)]
    )
    uri = f"mongo://m/{coll}"
    conn = f"""\
    m:
      kind: mongo
      url: "{mongo_url}"
      database: {mongo_db.name}
      schemas: {{{coll}: {{id: int, city: str, n: int}}}}
    """
    with open_fab(
        tmp_path,
        conn,
        {
            "by_city": binding("by_city", uri, "t.city = 'Paris'"),
            "by_n": binding("by_n", uri, "t.n < 10"),
        },
    ) as fab:
        res = concurrently(fab, uri, ["by_city", "by_n"])
        city, n = metrics(res["by_city"], "t"), metrics(res["by_n"], "t")
        assert json.loads(city["statement"]) == {"city": "Paris"}, city
        assert json.loads(n["statement"]) == {"n": {"$lt": 10}}, n
        assert city["records"] == 20 and n["records"] == 10


# ---------------------------------------------------------------- Kafka


@pytest.mark.kafka
@pytest.mark.parametrize("cache", [True, False])
def test_kafka_bad_messages_reach_res_stats(
    tmp_path: Path, kafka_bootstrap: str, new_topic: Any, cache: bool
) -> None:
    """The exact count of malformed messages, in each of two concurrent results."""
    from confluent_kafka import Producer

    topic = new_topic(2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(30):
        p.produce(topic, key=str(i).encode(), value=json.dumps({"id": i, "n": i}).encode())
    for bad in (b"{broken", b'{"id": "x", "n": 1}', b"[1, 2]", None):
        p.produce(topic, key=b"bad", value=bad)
    assert p.flush(10) == 0
    uri = f"kafka://bus/{topic}"
    conn = f"""\
    bus:
      kind: kafka
      bootstrap: "{kafka_bootstrap}"
      cache: {str(cache).lower()}
      schemas: {{{topic}: {{id: int, n: int}}}}
    """
    with open_fab(
        tmp_path,
        conn,
        {
            "low": binding("low", uri, "t.n < 10"),
            "high": binding("high", uri, "t.n >= 25"),
        },
    ) as fab:
        res = concurrently(fab, uri, ["low", "high"])
        assert res["low"].table.num_rows == 10 and res["high"].table.num_rows == 5
        for r in res.values():
            m = metrics(r, "t")
            assert m["bad_records"] == 4 and m["records"] == 34, m
            assert len(m["bad_samples"]) == 4 and all(
                s["partition"] in (0, 1) for s in m["bad_samples"]
            )
        single = fab.query("low")
        assert metrics(single, "t")["bad_records"] == 4
        assert "bad_records=4" in fab.explain("low", analyze=True)


@pytest.mark.kafka
def test_kafka_bad_messages_reach_the_scan_span(
    tmp_path: Path, kafka_bootstrap: str, new_topic: Any
) -> None:
    from confluent_kafka import Producer

    topic = new_topic(1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for value in [json.dumps({"id": i, "n": i}).encode() for i in range(5)] + [b"{", b"[]"]:
        p.produce(topic, value=value)
    assert p.flush(10) == 0
    uri = f"kafka://bus/{topic}"
    conn = f"""\
    bus: {{kind: kafka, bootstrap: "{kafka_bootstrap}", schemas: {{{topic}: {{id: int, n: int}}}}}}
    """
    with open_fab(
        tmp_path, conn, {"all": binding("all", uri, "t.n >= 0")}, "tracing: {ring_spans: 100}\n"
    ) as fab:
        res = fab.query("all")
        assert res.table.num_rows == 5 and metrics(res, "t")["bad_records"] == 2
        fab.tracer.flush()
        scan = next(s for s in fab.tracer.spans() if s.name == "Scan t")
        assert scan.attributes["fabric.source.bad_records"] == 2
        assert scan.attributes["fabric.source.records"] == 7


# ---------------------------------------------------------------- the record itself


def test_a_request_gets_its_own_metrics() -> None:
    a, b = ScanRequest(), ScanRequest()
    assert isinstance(a.metrics, ScanMetrics) and a.metrics is not b.metrics
    assert a.metrics.as_dict() == {}  # nothing measured: nothing reported
    a.metrics.statement, a.metrics.files_total, a.metrics.files_read = "SELECT 1", 4, 1
    a.metrics.extra["reader"] = "duckdb"
    assert a.metrics.as_dict() == {
        "statement": "SELECT 1",
        "files_total": 4,
        "files_read": 1,
        "reader": "duckdb",
    }
    assert a == ScanRequest()  # metrics are not part of what a request asks


def test_the_metrics_of_a_scans_pieces_add_up() -> None:
    """What the Ray tasks of one scan measured (fabric.ray.scan merges them)."""
    a = ScanMetrics(statement="S WHERE id < ?", records=3, files_read=1, files_total=2)
    a.extra.update(reader="duckdb", partitions=1, end_offsets={0: 5}, exact=True)
    a.bad(1, [{"partition": 0, "offset": 4, "reason": "invalid JSON"}])
    b = ScanMetrics(statement="S WHERE id >= ?", records=4, files_read=2, files_total=2)
    b.bad_records = 0
    b.extra.update(reader="duckdb", partitions=2, end_offsets={1: 7}, exact=True)
    whole = ScanMetrics()
    for part in (a, b, ScanMetrics(statement="S WHERE id < ?")):
        whole.merge(part)
    assert whole.as_dict() == {
        "statement": "S WHERE id < ?; S WHERE id >= ?",
        "records": 7,
        "bad_records": 1,
        "bad_samples": [{"partition": 0, "offset": 4, "reason": "invalid JSON"}],
        "files_total": 4,
        "files_read": 3,
        "reader": "duckdb",
        "partitions": 3,
        "end_offsets": {0: 5, 1: 7},
        "exact": True,
    }
