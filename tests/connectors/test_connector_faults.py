"""Faults: a source that is down or silent fails with a SourceError naming it, within the
configured timeout; a pooled SQL connection recovers after the server drops it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from connectors.base import ScanRequest, SourceError, UnknownObjectError
from connectors.sql_drivers import MYSQL_DRIVERS


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def _connections(port: int) -> dict[str, tuple[str, dict[str, Any], str]]:
    """kind -> (connection class path, options with a 1-2 s timeout, object)."""
    return {
        "mysql": (
            "connectors.sql:SqlConnection",
            {
                "kind": "mysql",
                "url": f"mysql+pymysql://u:p@127.0.0.1:{port}/db",
                "connect_timeout": 1,
                "read_timeout": 1,
            },
            "merchants",
        ),
        "postgres": (
            "connectors.sql:SqlConnection",
            {
                "kind": "postgres",
                "url": f"postgresql+psycopg://u:p@127.0.0.1:{port}/db",
                "connect_timeout": 1,
                "read_timeout": 1,
            },
            "merchants",
        ),
        "mongo": (
            "connectors.mongo:MongoConnection",
            {
                "kind": "mongo",
                "url": f"mongodb://127.0.0.1:{port}/?directConnection=true",
                "database": "crm",
                "timeout": 1,
                "read_timeout": 1,
            },
            "coupons",
        ),
        "s3": (
            "connectors.s3:S3Connection",
            {
                "kind": "s3",
                "endpoint": f"http://127.0.0.1:{port}",
                "bucket": "lake",
                "access_key": "a",
                "secret_key": "b",
                "connect_timeout": 1,
                "request_timeout": 1,
                "retries": 0,
            },
            "orders/*.parquet",
        ),
        "kafka": (
            "connectors.kafka:KafkaConnection",
            {"kind": "kafka", "bootstrap": f"127.0.0.1:{port}", "timeout": 1},
            "locations",
        ),
    }


def _open(path: str, options: dict[str, Any]) -> Any:
    import importlib

    mod, _, cls = path.partition(":")
    return getattr(importlib.import_module(mod), cls)("down", options)


KINDS = ["mysql", "postgres", "mongo", "s3", "kafka"]


@pytest.mark.parametrize("kind", KINDS)
def test_down_source_fails_fast_naming_it(kind: str) -> None:
    path, options, obj = _connections(_closed_port())[kind]
    conn = _open(path, options)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as err:
        src = conn.source(obj)
        list(src.scan(ScanRequest(timeout=1)))
    took = time.monotonic() - t0
    assert f"{kind}://down/" in str(err.value), str(err.value)
    assert "hint:" in str(err.value)
    assert took < 8, f"{kind}: took {took:.1f}s to report a closed port"


@pytest.mark.parametrize("kind", KINDS)
def test_silent_source_times_out_naming_it(kind: str, silent_port: int) -> None:
    path, options, obj = _connections(silent_port)[kind]
    conn = _open(path, options)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as err:
        src = conn.source(obj)
        list(src.scan(ScanRequest(timeout=1)))
    took = time.monotonic() - t0
    assert f"{kind}://down/" in str(err.value), str(err.value)
    assert took < 10, f"{kind}: took {took:.1f}s with a 1 s timeout"


def test_sql_pool_recovers_after_server_kills_connections(mariadb_url: str) -> None:
    import sqlalchemy as sa

    from connectors.sql import SqlConnection

    admin = sa.create_engine(mariadb_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql("CREATE TABLE IF NOT EXISTS recover_t (id INT PRIMARY KEY)")
        c.exec_driver_sql("REPLACE INTO recover_t VALUES (1), (2), (3)")
    conn = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url, "pool_size": 2})
    src = conn.source("recover_t")
    assert sum(b.num_rows for b in src.scan(ScanRequest())) == 3
    with conn.engine.connect() as c:
        pooled_id = c.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
    with admin.connect() as c:
        c.exec_driver_sql(
            f"KILL CONNECTION {int(pooled_id)}"
        )  # the server drops the pooled connection
    # pre_ping notices the dead connection and opens a new one: no error reaches the caller
    assert sum(b.num_rows for b in src.scan(ScanRequest())) == 3
    with conn.engine.connect() as c:
        assert c.exec_driver_sql("SELECT CONNECTION_ID()").scalar() != pooled_id
    conn.close()
    admin.dispose()


@pytest.mark.parametrize("driver", [d for d, _ in MYSQL_DRIVERS])
def test_sql_statement_timeout_is_a_source_error(mariadb_url: str, driver: str) -> None:
    """With every driver auto may choose: MariaDB Connector/C's unbuffered cursor ended
    quietly with a part of the rows here (connectors.sql_drivers.prepare_engine)."""
    import sqlalchemy as sa

    from connectors.sql import SqlConnection
    from dsl.ast import Binary, Call, Column, Literal

    admin = sa.create_engine(mariadb_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql("CREATE TABLE IF NOT EXISTS slow_t (id INT PRIMARY KEY)")
        c.exec_driver_sql("INSERT IGNORE INTO slow_t SELECT seq FROM seq_1_to_1000000")
    pytest.importorskip(dict(MYSQL_DRIVERS)[driver])
    conn = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url, "driver": driver})
    src = conn.source("slow_t")
    # a cross-join-free but slow filter: abs() over 1M rows under a 0.05 s statement limit
    f = Binary(">", Call("abs", (Binary("*", Column("id"), Column("id")),)), Literal(-1, "int"))
    with pytest.raises(SourceError, match="mysql://shop/slow_t"):
        list(src.scan(ScanRequest(filters=(f,), timeout=0.05)))
    conn.close()
    admin.dispose()


def test_unknown_objects_list_what_exists(mariadb_url: str, mongo_db: Any, mongo_url: str) -> None:
    from connectors.mongo import MongoConnection
    from connectors.sql import SqlConnection

    sql = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url})
    with pytest.raises(UnknownObjectError) as err:
        sql.source("no_such_table")
    assert err.value.uri == "mysql://shop/no_such_table"
    assert isinstance(err.value.existing, list)
    mongo_db.present.insert_one({"a": 1})
    mc = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name})
    with pytest.raises(UnknownObjectError) as err2:
        mc.source("presnt")
    assert "present" in err2.value.existing
