"""Session fixtures that connect to the real test servers (started by scripts/services).

Each fixture gives a namespace of its own to this test run (a database, a bucket, topics)
and removes it at the end. A test that uses one of them is marked `servers` (and the
server's own marker) automatically, so `pytest -m "not servers"` runs everything else.

If a server is down, the fixture FAILS naming the server and saying how to start it;
set FABRIC_SKIP_MISSING_SERVERS=1 to skip such tests instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.servers import (
    S3Bucket,
    Servers,
    ServerUnreachable,
    TopicFactory,
    kafka_metadata,
    load,
    require,
    run_id,
    s3_filesystem,
)

# fixture name -> marker of the server it needs
SERVER_FIXTURES = {
    "mariadb_url": "mariadb",
    "pg_url": "postgres",
    "kafka_bootstrap": "kafka",
    "new_topic": "kafka",
    "tansu_bootstrap": "tansu",
    "tansu_topic": "tansu",
    "mongo_url": "mongo",
    "mongo_db": "mongo",
    "s3": "s3",
    "prometheus_bin": "prometheus",
}
# parameter values of fixtures parametrized by server -> the server's marker
SERVER_ALIASES = {
    "noida": "kafka",
    "kafka": "kafka",
    "tansu": "tansu",
    "mariadb": "mariadb",
    "mysql": "mariadb",
    "postgres": "postgres",
    "mongo": "mongo",
    "s3": "s3",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        # fixtures reached through getfixturevalue: a conformance class names its server's
        # fixture in a class attribute; a fixture parametrized by server passes the name
        # of that server as its parameter
        cls = getattr(item, "cls", None)
        names |= {getattr(cls, a) for a in ("url_fixture", "bootstrap_fixture") if hasattr(cls, a)}
        callspec = getattr(item, "callspec", None)
        for value in callspec.params.values() if callspec is not None else ():
            if isinstance(value, str):
                names |= {
                    f for f in SERVER_FIXTURES if SERVER_FIXTURES[f] == SERVER_ALIASES.get(value)
                }
        needed = {SERVER_FIXTURES[f] for f in names if f in SERVER_FIXTURES}
        if needed:
            item.add_marker(pytest.mark.servers)
            for marker in sorted(needed):
                item.add_marker(getattr(pytest.mark, marker))


def _unreachable(exc: ServerUnreachable) -> None:
    if os.environ.get("FABRIC_SKIP_MISSING_SERVERS") == "1":
        pytest.skip(f"{exc} (skipped: FABRIC_SKIP_MISSING_SERVERS=1)")
    pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def servers() -> Servers:
    """Addresses of every test server (no connection is made)."""
    return load()


@pytest.fixture(scope="session")
def test_run_id() -> str:
    """Unique per pytest run; used in database, bucket and topic names."""
    return run_id()


def _sql_database(server: str, url: str, name: str, drop_sql: str) -> Iterator[str]:
    import sqlalchemy as sa

    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        require(server, url, lambda: engine.connect().close())
    except ServerUnreachable as exc:
        engine.dispose()
        _unreachable(exc)
    with engine.connect() as con:
        con.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield Servers.with_database(url, name)
    finally:
        with engine.connect() as con:
            con.exec_driver_sql(drop_sql.format(name=name))
        engine.dispose()


@pytest.fixture(scope="session")
def mariadb_url(servers: Servers, test_run_id: str) -> Iterator[str]:
    """SQLAlchemy URL of a MariaDB database created for this run (dropped at the end)."""
    yield from _sql_database(
        "MariaDB", servers.mariadb_url, f"fabric_t_{test_run_id}", "DROP DATABASE IF EXISTS {name}"
    )


@pytest.fixture(scope="session")
def pg_url(servers: Servers, test_run_id: str) -> Iterator[str]:
    """SQLAlchemy URL of a PostgreSQL database created for this run (dropped at the end)."""
    yield from _sql_database(
        "PostgreSQL",
        servers.pg_url,
        f"fabric_t_{test_run_id}",
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)",
    )


def _broker(server: str, bootstrap: str) -> str:
    def probe() -> None:
        if not kafka_metadata(bootstrap, timeout=10).brokers:
            raise RuntimeError("metadata lists no brokers")

    try:
        require(server, bootstrap, probe)
    except ServerUnreachable as exc:
        _unreachable(exc)
    return bootstrap


@pytest.fixture(scope="session")
def kafka_bootstrap(servers: Servers) -> str:
    """bootstrap.servers of the noida-db broker (exact offsets and watermarks)."""
    return _broker("Kafka broker (noida-db)", servers.kafka_bootstrap)


@pytest.fixture(scope="session")
def tansu_bootstrap(servers: Servers) -> str:
    """bootstrap.servers of the Tansu broker (see docs/servers.md for its quirks)."""
    return _broker("Kafka broker (Tansu)", servers.tansu_bootstrap)


@pytest.fixture
def new_topic(kafka_bootstrap: str, test_run_id: str) -> Iterator[Callable[..., str]]:
    """Factory: ``new_topic(partitions=1, prefix="t") -> name`` on noida; deleted after the test."""
    factory = TopicFactory(kafka_bootstrap, test_run_id)
    yield factory
    factory.cleanup()


@pytest.fixture
def tansu_topic(tansu_bootstrap: str, test_run_id: str) -> Iterator[Callable[..., str]]:
    """Like `new_topic`, on the Tansu broker."""
    factory = TopicFactory(tansu_bootstrap, test_run_id)
    yield factory
    factory.cleanup()


@pytest.fixture(scope="session")
def mongo_url(servers: Servers) -> str:
    """URL of the MongoDB-protocol server (SecantusDB)."""
    import pymongo

    def probe() -> None:
        with pymongo.MongoClient(servers.mongo_url, serverSelectionTimeoutMS=5000) as client:
            client.admin.command("ping")

    try:
        require("MongoDB server (SecantusDB)", servers.mongo_url, probe)
    except ServerUnreachable as exc:
        _unreachable(exc)
    return servers.mongo_url


@pytest.fixture(scope="session")
def mongo_db(mongo_url: str, test_run_id: str):
    """A pymongo Database named for this run (`.name`, `.client`); dropped at the end."""
    import pymongo

    client = pymongo.MongoClient(mongo_url)
    name = f"fabric_t_{test_run_id}"
    try:
        yield client[name]
    finally:
        client.drop_database(name)
        client.close()


@pytest.fixture(scope="session")
def s3(servers: Servers, test_run_id: str) -> Iterator[S3Bucket]:
    """A bucket for this run on the S3 server, with `.fs` (pyarrow S3FileSystem); removed at the end."""
    bucket = S3Bucket(
        endpoint=servers.s3_endpoint,
        access_key=servers.s3_access_key,
        secret_key=servers.s3_secret_key,
        bucket=f"fabric-t-{test_run_id}",
        fs=s3_filesystem(servers),
    )
    client = bucket.boto3_client()
    try:
        require("S3 server (SeaweedFS)", servers.s3_endpoint, client.list_buckets)
    except ServerUnreachable as exc:
        _unreachable(exc)
    client.create_bucket(Bucket=bucket.bucket)
    try:
        yield bucket
    finally:
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket.bucket):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket.bucket, Delete={"Objects": keys})
        client.delete_bucket(Bucket=bucket.bucket)


@pytest.fixture(scope="session")
def prometheus_bin(servers: Servers) -> str:
    """Path of the Prometheus binary (not started: each test runs its own instance)."""
    if not servers.prometheus_bin or not os.access(servers.prometheus_bin, os.X_OK):
        _unreachable(
            ServerUnreachable(
                "Prometheus", servers.prometheus_bin or "PATH", "binary not installed"
            )
        )
    return servers.prometheus_bin
