"""Load the seed data (``data.generate``) into the real servers.

    python -m examples.seed.load            # uses the addresses in .services/env

Creates (replacing what was there) the MySQL database ``shop`` (merchants, orders),
the Mongo database ``crm`` (coupons), the S3 bucket ``lake`` (categories.csv) and the
Kafka topics ``location_stream`` and the news topic, and prints what it loaded. The
names can be changed with the FABRIC_* variables that ``environment()`` returns.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

ROOT = Path(__file__).resolve().parents[2]


def environment(prefix: str = "fabric_demo") -> dict[str, str]:
    """Server addresses from .services/env (or the environment) plus the demo's names."""
    env: dict[str, str] = {}
    path = ROOT / ".services" / "env"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.startswith("export ") and "=" in line:
                k, _, v = line[7:].partition("=")
                env[k] = (shlex.split(v) or [""])[0]
    env.update({k: v for k, v in os.environ.items() if k.startswith("FABRIC_")})
    base = env.get("FABRIC_MARIADB_URL", "mysql+pymysql://fabric:fabric@127.0.0.1:3306/fabric")
    env.setdefault("FABRIC_SHOP_URL", base.rsplit("/", 1)[0] + f"/{prefix}_shop")
    env.setdefault("FABRIC_CRM_DB", f"{prefix}_crm")
    env.setdefault("FABRIC_LAKE_BUCKET", f"{prefix.replace('_', '-')}-lake")
    env.setdefault("FABRIC_NEWS_TOPIC", f"{prefix}_news")
    env.setdefault("FABRIC_LOCATION_TOPIC", "location_stream")
    return env


def load_mysql(url: str, tables: Mapping[str, pa.Table]) -> None:
    import sqlalchemy as sa

    server, _, db = url.rpartition("/")
    admin = sa.create_engine(server + "/")
    with admin.begin() as c:
        c.execute(sa.text(f"DROP DATABASE IF EXISTS `{db}`"))
        c.execute(sa.text(f"CREATE DATABASE `{db}`"))
    admin.dispose()
    eng = sa.create_engine(url)
    ddl = {
        "merchants": "CREATE TABLE merchants (id BIGINT PRIMARY KEY, name VARCHAR(64) NOT NULL, "
        "status VARCHAR(16) NOT NULL, lat DOUBLE, lon DOUBLE, geo_hash VARCHAR(12), INDEX (geo_hash))",
        "orders": "CREATE TABLE orders (id BIGINT PRIMARY KEY, user_id BIGINT NOT NULL, product_id BIGINT NOT NULL, "
        "amount DOUBLE NOT NULL, ordered_at DATETIME(6) NOT NULL, INDEX (user_id, ordered_at))",
    }
    with eng.begin() as c:
        for name, table in tables.items():
            c.execute(sa.text(ddl[name]))
            rows = table.to_pylist()
            for r in rows:
                for k, v in r.items():
                    if isinstance(v, dt.datetime):
                        r[k] = v.astimezone(dt.UTC).replace(tzinfo=None)
            cols = table.column_names
            stmt = sa.text(
                f"INSERT INTO {name} ({', '.join(cols)}) VALUES ({', '.join(':' + c for c in cols)})"
            )
            for i in range(0, len(rows), 5_000):
                c.execute(stmt, rows[i : i + 5_000])
    eng.dispose()


def load_mongo(url: str, db: str, coupons: pa.Table) -> None:
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(url, tz_aware=True)
    client.drop_database(db)
    coll = client[db]["coupons"]
    coll.insert_many(coupons.to_pylist(), ordered=False)
    coll.create_index("merchant_id")
    client.close()


def s3_filesystem(env: Mapping[str, str], *, allow_bucket_deletion: bool = False):
    from pyarrow import fs

    endpoint = env["FABRIC_S3_ENDPOINT"]
    scheme, _, host = endpoint.partition("://")
    return fs.S3FileSystem(
        access_key=env["FABRIC_S3_ACCESS_KEY"],
        secret_key=env["FABRIC_S3_SECRET_KEY"],
        endpoint_override=host,
        scheme=scheme,
        region="us-east-1",
        allow_bucket_deletion=allow_bucket_deletion,
    )


def load_s3(
    env: Mapping[str, str], bucket: str, categories: pa.Table | None, policies: pa.Table | None
) -> None:
    import pyarrow.parquet as pq

    s3 = s3_filesystem(env)
    with contextlib.suppress(OSError):  # the bucket exists already
        s3.create_dir(bucket)
    if categories is not None:
        with s3.open_output_stream(f"{bucket}/categories.csv") as out:
            pacsv.write_csv(categories, out)
    if policies is not None:
        pq.write_table(policies, f"{bucket}/risk_policies.parquet", filesystem=s3)


def _json_default(v: object) -> object:
    if isinstance(v, dt.datetime):
        return v.isoformat()
    raise TypeError(type(v))


def produce(
    bootstrap: str,
    topic: str,
    table: pa.Table,
    key: str,
    *,
    recreate: bool = True,
    partitions: int = 2,
    flush_every: int = 10_000,
) -> int:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    if recreate:
        existing = admin.list_topics(timeout=10).topics
        if topic in existing:
            for f in admin.delete_topics([topic], operation_timeout=10).values():
                f.result()
        for _ in range(50):
            try:
                for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
                    f.result()
                break
            except Exception as exc:  # deletion may still be in flight
                if "exists" not in str(exc).lower():
                    raise
                import time

                time.sleep(0.1)
    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 5,
            "queue.buffering.max.messages": max(100_000, flush_every + 1),
        }
    )
    n = 0
    for row in table.to_pylist():
        p.produce(
            topic, key=str(row[key]).encode(), value=json.dumps(row, default=_json_default).encode()
        )
        n += 1
        if n % flush_every == 0:
            p.flush()
        p.poll(0)
    p.flush()
    return n


def load_all(env: Mapping[str, str], data: Mapping[str, pa.Table]) -> dict[str, int]:
    load_mysql(env["FABRIC_SHOP_URL"], {"merchants": data["merchants"], "orders": data["orders"]})
    load_mongo(env["FABRIC_MONGO_URL"], env["FABRIC_CRM_DB"], data["coupons"])
    load_s3(env, env["FABRIC_LAKE_BUCKET"], data["categories"], data["risk_policies"])
    produce(
        env["FABRIC_KAFKA_BOOTSTRAP"],
        env["FABRIC_LOCATION_TOPIC"],
        data["location_stream"],
        "user_id",
    )
    produce(env["FABRIC_KAFKA_BOOTSTRAP"], env["FABRIC_NEWS_TOPIC"], data["news"], "id")
    return {k: v.num_rows for k, v in data.items()}


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from examples.seed.data import generate

    env = environment()
    counts = load_all(env, generate())
    print("loaded:", ", ".join(f"{k}={v}" for k, v in counts.items()))


def drop_loaded(env: dict[str, str]) -> None:
    """Drop what a run loaded under its own names (the ``FABRIC_*`` database, collection,
    topics and bucket in ``env``); what is already gone is skipped. Used by the service
    benchmark and its tests."""
    import contextlib

    import sqlalchemy as sa
    from confluent_kafka.admin import AdminClient
    from pymongo import MongoClient

    with contextlib.suppress(Exception):
        server, _, db = env["FABRIC_SHOP_URL"].rpartition("/")
        eng = sa.create_engine(server + "/")
        with eng.begin() as c:
            c.execute(sa.text(f"DROP DATABASE IF EXISTS `{db}`"))
        eng.dispose()
    with contextlib.suppress(Exception):
        MongoClient(env["FABRIC_MONGO_URL"]).drop_database(env["FABRIC_CRM_DB"])
    with contextlib.suppress(Exception):
        admin = AdminClient({"bootstrap.servers": env["FABRIC_KAFKA_BOOTSTRAP"]})
        admin.delete_topics([env["FABRIC_LOCATION_TOPIC"], env["FABRIC_NEWS_TOPIC"]])
    with contextlib.suppress(Exception):  # each bucket holds a SeaweedFS volume until dropped
        s3_filesystem(env, allow_bucket_deletion=True).delete_dir(env["FABRIC_LAKE_BUCKET"])


if __name__ == "__main__":
    main()
