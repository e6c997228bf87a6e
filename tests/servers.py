"""The one place that knows where the test servers are and how to ask them a question.

Addresses come from the environment (the names ``scripts/services up`` writes to
``.services/env``); when a variable is absent, from ``.services/env`` itself; failing
that, from the same defaults (and ``FABRIC_*_PORT`` overrides) the script uses.

    from tests.servers import load
    srv = load()
    srv.mariadb_url            # mysql+pymysql://fabric:fabric@127.0.0.1:3306/fabric
    srv.with_database(srv.pg_url, "other")
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
ENV_FILE = ROOT / ".services" / "env"
HINT = "run scripts/services up"


def _port(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def _defaults() -> dict[str, str]:
    host = "127.0.0.1"
    return {
        "FABRIC_MARIADB_URL": f"mysql+pymysql://fabric:fabric@{host}:{_port('FABRIC_MARIADB_PORT', 3306)}/fabric",
        "FABRIC_PG_URL": f"postgresql+psycopg://fabric:fabric@{host}:{_port('FABRIC_PG_PORT', 5432)}/fabric",
        "FABRIC_KAFKA_BOOTSTRAP": f"{host}:{_port('FABRIC_KAFKA_PORT', 9092)}",
        "FABRIC_TANSU_BOOTSTRAP": f"{host}:{_port('FABRIC_TANSU_PORT', 9094)}",
        "FABRIC_MONGO_URL": f"mongodb://{host}:{_port('FABRIC_MONGO_PORT', 27017)}/?directConnection=true",
        "FABRIC_S3_ENDPOINT": f"http://{host}:{_port('FABRIC_S3_PORT', 8333)}",
        "FABRIC_S3_ACCESS_KEY": "fabric",
        "FABRIC_S3_SECRET_KEY": "fabricsecret",
        "FABRIC_PROMETHEUS_BIN": shutil.which("prometheus") or "",
    }


def parse_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    """Read ``export NAME='value'`` lines as written by scripts/services."""
    values: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("export ") or "=" not in line:
            continue
        name, _, raw = line[len("export ") :].partition("=")
        parts = shlex.split(raw)
        values[name.strip()] = parts[0] if parts else ""
    return values


@dataclass(frozen=True)
class Servers:
    """Addresses of every test server."""

    mariadb_url: str  # SQLAlchemy URL, database `fabric`
    pg_url: str  # SQLAlchemy URL, database `fabric`
    kafka_bootstrap: str  # noida-db: exact offsets
    tansu_bootstrap: str  # Tansu: second broker, see docs/servers.md for its quirks
    mongo_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    prometheus_bin: str  # "" when not installed

    @staticmethod
    def with_database(url: str, database: str) -> str:
        """The same SQLAlchemy URL pointing at another database."""
        from sqlalchemy.engine import make_url

        return make_url(url).set(database=database).render_as_string(hide_password=False)


def load() -> Servers:
    file_values = parse_env_file()
    defaults = _defaults()

    def get(name: str) -> str:
        return os.environ.get(name) or file_values.get(name) or defaults[name]

    return Servers(
        mariadb_url=get("FABRIC_MARIADB_URL"),
        pg_url=get("FABRIC_PG_URL"),
        kafka_bootstrap=get("FABRIC_KAFKA_BOOTSTRAP"),
        tansu_bootstrap=get("FABRIC_TANSU_BOOTSTRAP"),
        mongo_url=get("FABRIC_MONGO_URL"),
        s3_endpoint=get("FABRIC_S3_ENDPOINT"),
        s3_access_key=get("FABRIC_S3_ACCESS_KEY"),
        s3_secret_key=get("FABRIC_S3_SECRET_KEY"),
        prometheus_bin=get("FABRIC_PROMETHEUS_BIN"),
    )


# --------------------------------------------------------------------------- reachability


class ServerUnreachable(Exception):
    """A test server did not answer; the message names it and says how to start it."""

    def __init__(self, server: str, address: str, reason: object):
        self.server = server
        super().__init__(f"{server} at {address} is not reachable ({reason}); {HINT}")


def _tcp_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require(server: str, address: str, probe: Callable[[], object]) -> None:
    """Run `probe` (a real protocol request); raise ServerUnreachable naming `server` if it fails."""
    first = address if "://" in address else f"tcp://{address.split(',')[0]}"
    try:
        host, port = urlsplit(first).hostname, urlsplit(first).port
    except ValueError:
        host, port = None, None
    if host and port and not _tcp_open(host, port):
        raise ServerUnreachable(server, address, "connection refused")
    try:
        probe()
    except Exception as exc:
        raise ServerUnreachable(server, address, f"{type(exc).__name__}: {exc}") from exc


def kafka_metadata(bootstrap: str, timeout: float = 10.0):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=timeout)


def run_id() -> str:
    """A short id unique to this test run; valid in database, topic and bucket names."""
    return f"{time.strftime('%m%d%H%M%S')}{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------- SQL tables


def sql_url(request: object, kind: str) -> str:
    """The per-run database URL of the server of ``kind`` (``mysql`` or ``postgres``),
    through its fixture, so the test is marked for that server."""
    name = "pg_url" if kind == "postgres" else "mariadb_url"
    return request.getfixturevalue(name)  # type: ignore[attr-defined, no-any-return]


@contextlib.contextmanager
def sql_source(
    url: str,
    kind: str,
    table: str,
    ddl: str,
    rows: list[dict[str, object]] | tuple = (),
    after: tuple[str, ...] = (),
) -> Iterator[object]:
    """A table made on a SQL test server (``ddl``, then ``rows`` inserted: dicts whose keys
    are in column order, then the ``after`` statements: indexes, ``ANALYZE``) as a fabric
    ``SqlSource``; the table is dropped afterwards."""
    import sqlalchemy as sa

    from connectors.sql import SqlConnection

    engine = sa.create_engine(url)
    try:
        with engine.begin() as c:
            c.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
            c.exec_driver_sql(ddl)
            if rows:
                names = ", ".join(f":{k}" for k in rows[0])
                c.execute(sa.text(f"INSERT INTO {table} VALUES ({names})"), list(rows))
            for stmt in after:
                c.exec_driver_sql(stmt)
        conn = SqlConnection("db", {"kind": kind, "url": url})
        try:
            yield conn.source(table)
        finally:
            conn.close()
    finally:
        with engine.begin() as c:
            c.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engine.dispose()


# --------------------------------------------------------------------------- topics


class TopicFactory:
    """Creates uniquely named topics on one broker and deletes them all in `cleanup()`.

    Usable at any fixture scope: ``f = TopicFactory(bootstrap, run_id); f(partitions=3)``.
    """

    def __init__(self, bootstrap: str, run: str):
        from confluent_kafka.admin import AdminClient

        self.bootstrap = bootstrap
        self.run = run
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.created: list[str] = []

    def __call__(self, partitions: int = 1, prefix: str = "t") -> str:
        from confluent_kafka.admin import NewTopic

        name = f"fabric_{prefix}_{self.run}_{len(self.created)}"
        futures = self.admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1)]
        )
        futures[name].result(timeout=30)
        self.created.append(name)
        # Wait until metadata shows every partition, so producers do not race creation.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            topic = self.admin.list_topics(topic=name, timeout=10).topics.get(name)
            if topic is not None and topic.error is None and len(topic.partitions) == partitions:
                return name
            time.sleep(0.1)
        raise TimeoutError(
            f"topic {name} on {self.bootstrap} did not show {partitions} partitions in 30s"
        )

    def cleanup(self) -> None:
        if not self.created:
            return
        futures = self.admin.delete_topics(self.created, operation_timeout=30)
        for fut in futures.values():
            with contextlib.suppress(Exception):  # best effort: the broker may be gone
                fut.result(timeout=30)
        self.created.clear()


# --------------------------------------------------------------------------- S3


@dataclass(frozen=True)
class S3Bucket:
    """A per-run bucket on the S3 server, with a pyarrow filesystem pointed at it."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    fs: object  # pyarrow.fs.S3FileSystem
    region: str = "us-east-1"

    def path(self, key: str = "") -> str:
        """`bucket/key`, the form pyarrow filesystems take."""
        return f"{self.bucket}/{key.lstrip('/')}" if key else self.bucket

    def uri(self, key: str = "") -> str:
        return f"s3://{self.path(key)}"

    def options(self, **extra: object) -> dict[str, object]:
        """The `kind: s3` connection options of this bucket (plus `extra`)."""
        return {
            "kind": "s3",
            "endpoint": self.endpoint,
            "bucket": self.bucket,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            **extra,
        }

    def connection(self, name: str = "lake", **extra: object):
        """A `connectors.s3.S3Connection` named `name` on this bucket."""
        from connectors.s3 import S3Connection

        return S3Connection(name, self.options(**extra))

    def boto3_client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )


def s3_filesystem(srv: Servers):
    from pyarrow import fs

    parsed = urlsplit(srv.s3_endpoint)
    return fs.S3FileSystem(
        access_key=srv.s3_access_key,
        secret_key=srv.s3_secret_key,
        endpoint_override=parsed.netloc,
        scheme=parsed.scheme or "http",
        region="us-east-1",
        allow_bucket_creation=True,
        allow_bucket_deletion=True,
    )
