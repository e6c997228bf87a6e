"""TPC-H data, generated reproducibly offline and split across the real servers.

    lineitem                  4 Parquet files in S3 (SeaweedFS), split by l_orderkey range
    orders, customer          MariaDB
    part, partsupp, supplier  PostgreSQL
    nation                    MongoDB
    region                    a Kafka topic (JSON messages)

The data comes from ``tpchgen-cli`` (PyPI, a Rust port of dbgen whose output is identical
to dbgen's), so every machine generates the same rows for a scale factor. Types are the
spec's: DECIMAL(15,2), DATE, CHAR(n) / VARCHAR(n) in the SQL databases.

Loading is cached by content: the names of the databases, the Mongo database and the S3
prefix carry a tag hashed from (scale factor, generator version, this loader's layout
version); each store keeps a marker with the row counts it was loaded with, checked on
the next run, so a rerun only checks and a changed layout loads again under a new tag.
Concurrent loaders of the same tag serialize on a MariaDB named lock.

    from benchmarks.tpch import load
    data = load.prepare(0.01)           # generate (cached under .services/tpch) + load
    data.tables["lineitem"]             # the same rows as pyarrow tables (for the reference)
    data.env                            # the variables benchmarks/tpch/fabric.yaml reads
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = ROOT / ".services" / "tpch"
LAYOUT_VERSION = 1  # bump when the split, the DDL or the file layout changes
LINEITEM_FILES = 4
REGION_TOPIC = "tpch_region"  # the same 5 rows at every scale factor
BUCKET = "tpch"

TABLES = ("lineitem", "orders", "customer", "part", "partsupp", "supplier", "nation", "region")
HOME = {
    "lineitem": "s3",
    "orders": "mariadb",
    "customer": "mariadb",
    "part": "postgres",
    "partsupp": "postgres",
    "supplier": "postgres",
    "nation": "mongo",
    "region": "kafka",
}

# The spec's column types (TPC-H 2.18, clause 1.4), as SQL DDL for both databases.
DDL = {
    "customer": """c_custkey INTEGER NOT NULL PRIMARY KEY, c_name VARCHAR(25) NOT NULL,
        c_address VARCHAR(40) NOT NULL, c_nationkey INTEGER NOT NULL, c_phone CHAR(15) NOT NULL,
        c_acctbal DECIMAL(15,2) NOT NULL, c_mktsegment CHAR(10) NOT NULL,
        c_comment VARCHAR(117) NOT NULL""",
    "orders": """o_orderkey INTEGER NOT NULL PRIMARY KEY, o_custkey INTEGER NOT NULL,
        o_orderstatus CHAR(1) NOT NULL, o_totalprice DECIMAL(15,2) NOT NULL,
        o_orderdate DATE NOT NULL, o_orderpriority CHAR(15) NOT NULL, o_clerk CHAR(15) NOT NULL,
        o_shippriority INTEGER NOT NULL, o_comment VARCHAR(79) NOT NULL""",
    "part": """p_partkey INTEGER NOT NULL PRIMARY KEY, p_name VARCHAR(55) NOT NULL,
        p_mfgr CHAR(25) NOT NULL, p_brand CHAR(10) NOT NULL, p_type VARCHAR(25) NOT NULL,
        p_size INTEGER NOT NULL, p_container CHAR(10) NOT NULL,
        p_retailprice DECIMAL(15,2) NOT NULL, p_comment VARCHAR(23) NOT NULL""",
    "supplier": """s_suppkey INTEGER NOT NULL PRIMARY KEY, s_name CHAR(25) NOT NULL,
        s_address VARCHAR(40) NOT NULL, s_nationkey INTEGER NOT NULL, s_phone CHAR(15) NOT NULL,
        s_acctbal DECIMAL(15,2) NOT NULL, s_comment VARCHAR(101) NOT NULL""",
    "partsupp": """ps_partkey INTEGER NOT NULL, ps_suppkey INTEGER NOT NULL,
        ps_availqty INTEGER NOT NULL, ps_supplycost DECIMAL(15,2) NOT NULL,
        ps_comment VARCHAR(199) NOT NULL, PRIMARY KEY (ps_partkey, ps_suppkey)""",
}
# Indexes on the foreign keys the queries join on (the primary keys are in the DDL).
INDEXES = {
    "orders": ["o_custkey"],
    "customer": ["c_nationkey"],
    "supplier": ["s_nationkey"],
    "partsupp": ["ps_suppkey"],
}
NATION_SCHEMA = {"n_nationkey": "int", "n_name": "str", "n_regionkey": "int", "n_comment": "str"}
REGION_SCHEMA = {"r_regionkey": "int", "r_name": "str", "r_comment": "str"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] tpch: {msg}", file=sys.stderr, flush=True)


def sf_name(sf: float) -> str:
    """0.1 -> 'sf0_1' (usable in database names)."""
    return "sf" + f"{sf:g}".replace(".", "_")


# ------------------------------------------------------------------ generation


def _tpchgen() -> str:
    for cand in (Path(sys.executable).parent / "tpchgen-cli", shutil.which("tpchgen-cli")):
        if cand and Path(cand).exists():
            return str(cand)
    raise RuntimeError(
        "tpchgen-cli is not installed; it is a dev dependency: "
        ".venv/bin/pip install -e '.[dev]' (or pip install tpchgen-cli)"
    )


def generator_version() -> str:
    out = subprocess.run([_tpchgen(), "-V"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _plain_strings(t: pa.Table) -> pa.Table:
    """tpchgen writes string_view columns; everything downstream wants plain strings."""
    fields = []
    for f in t.schema:
        typ = pa.string() if pa.types.is_string_view(f.type) else f.type
        fields.append(pa.field(f.name, typ, nullable=f.nullable))
    return t.cast(pa.schema(fields))


def generate(sf: float) -> dict[str, pa.Table]:
    """The 8 tables at scale factor ``sf`` (cached as Parquet under .services/tpch)."""
    out = CACHE / sf_name(sf) / "gen"
    if not (out / "_done").exists():
        # generate beside it and rename: concurrent runs never see (or delete) half a set
        tmp = out.with_name(f"gen.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.perf_counter()
        subprocess.run(
            [_tpchgen(), "parquet", "-s", f"{sf:g}", "-o", str(tmp)],
            check=True,
            capture_output=True,
        )
        (tmp / "_done").write_text(generator_version())
        if out.exists() and not (out / "_done").exists():
            shutil.rmtree(out, ignore_errors=True)  # an interrupted older layout
        try:
            tmp.rename(out)
        except OSError:  # another run renamed its complete copy first: use that one
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"generated SF {sf:g} in {time.perf_counter() - t0:.1f} s")
    return {name: _plain_strings(pq.read_table(out / f"{name}.parquet")) for name in TABLES}


# ------------------------------------------------------------------ loading


@dataclass(frozen=True)
class Data:
    sf: float
    tag: str
    tables: dict[str, pa.Table]
    env: dict[str, str]  # what benchmarks/tpch/fabric.yaml reads
    mariadb_url: str
    pg_url: str
    mongo_url: str
    mongo_db: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_prefix: str  # "<prefix>/" inside BUCKET; lineitem files are below "<prefix>/lineitem/"
    kafka_bootstrap: str
    region_topic: str

    def lineitem_keys(self) -> list[str]:
        return [f"{self.s3_prefix}lineitem/part-{i}.parquet" for i in range(LINEITEM_FILES)]


def content_tag(sf: float) -> str:
    h = hashlib.sha256(f"{generator_version()}|{sf:g}|layout{LAYOUT_VERSION}".encode())
    return h.hexdigest()[:8]


def prepare(sf: float, srv=None) -> Data:
    """Generate (or reuse) the data and make sure every server holds it."""
    if srv is None:
        sys.path.insert(0, str(ROOT))
        from tests.servers import load as load_servers

        srv = load_servers()
    from tests.servers import Servers

    tag = content_tag(sf)
    name = f"tpch_{sf_name(sf)}_{tag}"
    tables = generate(sf)
    counts = {t: tables[t].num_rows for t in TABLES}
    data = Data(
        sf=sf,
        tag=tag,
        tables=tables,
        env={},
        mariadb_url=Servers.with_database(srv.mariadb_url, name),
        pg_url=Servers.with_database(srv.pg_url, name),
        mongo_url=srv.mongo_url,
        mongo_db=name,
        s3_endpoint=srv.s3_endpoint,
        s3_access_key=srv.s3_access_key,
        s3_secret_key=srv.s3_secret_key,
        s3_prefix=f"{name}/",
        kafka_bootstrap=srv.kafka_bootstrap,
        region_topic=REGION_TOPIC,
    )
    data.env.update(
        {
            "TPCH_MARIADB_URL": data.mariadb_url,
            "TPCH_PG_URL": data.pg_url,
            "TPCH_MONGO_URL": data.mongo_url,
            "TPCH_MONGO_DB": data.mongo_db,
            "TPCH_S3_ENDPOINT": data.s3_endpoint,
            "TPCH_S3_ACCESS_KEY": data.s3_access_key,
            "TPCH_S3_SECRET_KEY": data.s3_secret_key,
            "TPCH_S3_BUCKET": BUCKET,
            "TPCH_S3_PREFIX": data.s3_prefix,
            "TPCH_KAFKA_BOOTSTRAP": data.kafka_bootstrap,
        }
    )
    with _load_lock(srv.mariadb_url, name):
        t0 = time.perf_counter()
        _load_mariadb(srv.mariadb_url, data, name, counts)
        _load_postgres(srv.pg_url, data, name, counts)
        _load_mongo(data, counts)
        _load_s3(data, counts)
    with _load_lock(srv.mariadb_url, REGION_TOPIC):
        _load_kafka(data)
    log(f"servers hold {name} (checked/loaded in {time.perf_counter() - t0:.1f} s)")
    return data


@contextlib.contextmanager
def _load_lock(admin_url: str, name: str) -> Iterator[None]:
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as con:
            got = con.exec_driver_sql(f"SELECT GET_LOCK('{name}', 1800)").scalar()
            if got != 1:
                raise RuntimeError(f"could not take the load lock {name} in 30 minutes")
            try:
                yield
            finally:
                con.exec_driver_sql(f"SELECT RELEASE_LOCK('{name}')")
    finally:
        engine.dispose()


def _marker(counts: Mapping[str, int], names: tuple[str, ...]) -> str:
    return json.dumps({t: counts[t] for t in names}, sort_keys=True)


def _rows(t: pa.Table) -> list[tuple]:
    cols = [c.to_pylist() for c in t.columns]
    return list(zip(*cols))


def _load_mariadb(admin_url: str, data: Data, name: str, counts: Mapping[str, int]) -> None:
    import sqlalchemy as sa

    want = _marker(counts, ("orders", "customer"))
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as con:
            con.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS {name}")
    finally:
        admin.dispose()
    engine = sa.create_engine(data.mariadb_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as con:
            if _has_marker(con, want):
                return
            t0 = time.perf_counter()
            con.exec_driver_sql("DROP TABLE IF EXISTS _tpch_loaded")
            for table in ("orders", "customer"):
                _create_and_fill(con, table, data.tables[table], "mariadb")
            con.exec_driver_sql("CREATE TABLE _tpch_loaded (marker TEXT)")
            con.exec_driver_sql("INSERT INTO _tpch_loaded VALUES (%s)", (want,))
            log(f"MariaDB {name}: orders, customer in {time.perf_counter() - t0:.1f} s")
    finally:
        engine.dispose()


def _load_postgres(admin_url: str, data: Data, name: str, counts: Mapping[str, int]) -> None:
    import sqlalchemy as sa

    want = _marker(counts, ("part", "partsupp", "supplier"))
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as con:
            exists = con.exec_driver_sql(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).scalar()
            if not exists:
                con.exec_driver_sql(f"CREATE DATABASE {name}")
    finally:
        admin.dispose()
    engine = sa.create_engine(data.pg_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as con:
            if _has_marker(con, want):
                return
            t0 = time.perf_counter()
            con.exec_driver_sql("DROP TABLE IF EXISTS _tpch_loaded")
            for table in ("part", "partsupp", "supplier"):
                _create_and_fill(con, table, data.tables[table], "postgres")
            con.exec_driver_sql("ANALYZE")
            con.exec_driver_sql("CREATE TABLE _tpch_loaded (marker TEXT)")
            con.exec_driver_sql("INSERT INTO _tpch_loaded VALUES (%s)", (want,))
            log(f"PostgreSQL {name}: part, partsupp, supplier in {time.perf_counter() - t0:.1f} s")
    finally:
        engine.dispose()


def _has_marker(con, want: str) -> bool:
    try:
        got = con.exec_driver_sql("SELECT marker FROM _tpch_loaded").scalar()
    except Exception:
        return False
    return got == want


def _create_and_fill(con, table: str, rows: pa.Table, dialect: str) -> None:
    con.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
    con.exec_driver_sql(f"CREATE TABLE {table} ({DDL[table]})")
    if dialect == "postgres":
        raw = con.connection.driver_connection  # psycopg 3: COPY is ~10x executemany
        with raw.cursor() as cur, cur.copy(f"COPY {table} FROM STDIN") as copy:
            for row in _rows(rows):
                copy.write_row(row)
    else:
        marks = ", ".join(["%s"] * rows.num_columns)
        sql = f"INSERT INTO {table} VALUES ({marks})"
        all_rows = _rows(rows)
        cur = con.connection.driver_connection.cursor()
        for i in range(0, len(all_rows), 5000):  # pymysql folds executemany into multi-row INSERTs
            cur.executemany(sql, all_rows[i : i + 5000])
        cur.close()
    for col in INDEXES.get(table, []):
        con.exec_driver_sql(f"CREATE INDEX {table}_{col} ON {table} ({col})")


def _load_mongo(data: Data, counts: Mapping[str, int]) -> None:
    import pymongo

    want = _marker(counts, ("nation",))
    client: pymongo.MongoClient = pymongo.MongoClient(
        data.mongo_url, serverSelectionTimeoutMS=10000
    )
    try:
        db = client[data.mongo_db]
        got = db["_tpch_loaded"].find_one({"_id": "marker"})
        if got and got.get("marker") == want:
            return
        db["nation"].drop()
        db["nation"].insert_many(data.tables["nation"].to_pylist())
        db["_tpch_loaded"].replace_one({"_id": "marker"}, {"marker": want}, upsert=True)
        log(f"MongoDB {data.mongo_db}: nation")
    finally:
        client.close()


def s3_filesystem(data: Data):
    from urllib.parse import urlsplit

    from pyarrow import fs

    parsed = urlsplit(data.s3_endpoint)
    return fs.S3FileSystem(
        access_key=data.s3_access_key,
        secret_key=data.s3_secret_key,
        endpoint_override=parsed.netloc,
        scheme=parsed.scheme or "http",
        region="us-east-1",
        allow_bucket_creation=True,
    )


def _load_s3(data: Data, counts: Mapping[str, int]) -> None:
    from pyarrow import fs

    want = _marker(counts, ("lineitem",))
    s3 = s3_filesystem(data)
    marker = f"{BUCKET}/{data.s3_prefix}loaded.json"
    with contextlib.suppress(Exception):
        if s3.get_file_info(marker).type == fs.FileType.File:
            with s3.open_input_stream(marker) as f:
                if f.read().decode() == want:
                    return
    with contextlib.suppress(Exception):
        s3.create_dir(BUCKET)
    t0 = time.perf_counter()
    li = data.tables["lineitem"]  # generated in l_orderkey order: each file is a key range
    n = li.num_rows
    step = -(-n // LINEITEM_FILES)
    for i, key in enumerate(data.lineitem_keys()):
        part = li.slice(i * step, step)
        pq.write_table(part, f"{BUCKET}/{key}", filesystem=s3, row_group_size=50_000)
    with s3.open_output_stream(marker) as f:
        f.write(want.encode())
    log(
        f"S3 {BUCKET}/{data.s3_prefix}lineitem/: {LINEITEM_FILES} files in {time.perf_counter() - t0:.1f} s"
    )


def _load_kafka(data: Data) -> None:
    """Region: 5 JSON messages. The topic is shared by every scale factor (same rows); it is
    checked each run and recreated when it does not hold exactly those rows."""
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    rows = data.tables["region"].to_pylist()
    want = sorted(json.dumps(r, sort_keys=True) for r in rows)
    admin = AdminClient({"bootstrap.servers": data.kafka_bootstrap})
    topic = data.region_topic
    meta = admin.list_topics(timeout=10)
    if topic in meta.topics:
        c = Consumer(
            {
                "bootstrap.servers": data.kafka_bootstrap,
                "group.id": f"tpch_check_{os.getpid()}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        try:
            parts = [TopicPartition(topic, p, 0) for p in meta.topics[topic].partitions]
            c.assign(parts)
            got: list[str] = []
            deadline = time.monotonic() + 10
            highs = sum(c.get_watermark_offsets(p, timeout=5)[1] for p in parts)
            while len(got) < highs and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is not None and not m.error():
                    got.append(json.dumps(json.loads(m.value()), sort_keys=True))
        finally:
            c.close()
        if sorted(got) == want and highs == len(want):
            return
        futs = admin.delete_topics([topic], operation_timeout=30)
        for f in futs.values():
            with contextlib.suppress(Exception):
                f.result(timeout=30)
        time.sleep(1.0)
    futs = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    for f in futs.values():
        with contextlib.suppress(Exception):  # exists: a concurrent loader made it
            f.result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        t = admin.list_topics(topic=topic, timeout=10).topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            break
        time.sleep(0.1)
    p = Producer({"bootstrap.servers": data.kafka_bootstrap})
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    for r in rows:
        p.produce(
            topic, json.dumps(r).encode(), key=str(r["r_regionkey"]).encode(), timestamp=now_ms
        )
    p.flush(30)
    log(f"Kafka {topic}: region")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sf", type=float, default=0.1)
    args = ap.parse_args()
    d = prepare(args.sf)
    for k, v in d.env.items():
        print(f"export {k}='{v}'")
