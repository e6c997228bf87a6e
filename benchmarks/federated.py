"""Federated execution on the real servers: the fabric versus fetching every source whole.

Scenarios (tests/fixtures/optimizer/scenario_data.py):
  nearby_offers  Kafka location stream + MariaDB merchants + Mongo coupons
  top_category   MariaDB orders + categories.csv in S3

For each scenario and each way of answering it, over many user sessions:
  p50 / p95 latency per query, and per source the rows fetched divided by the rows the
  answer needed (the rows of that source that survive its filters and every join).

  fabric  binding -> builder -> optimizer (pushdown, dynamic filters) -> executor
  naive   each source fetched whole through the same connectors, joined in pyarrow

Data (1M merchants / 1M coupons / 1M orders at --scale 1) is loaded once and kept:
MariaDB database fabric_bench_<n>, Mongo database fabric_bench_<n>, Kafka topic
fabric_bench_locations_<n>, S3 bucket fabric-bench; a later run checks row counts and
skips loading. Servers: `scripts/services up`.

    .venv/bin/python benchmarks/federated.py --scale 0.01       # quick (10k rows)
    .venv/bin/python benchmarks/federated.py                    # 1M rows
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.optimizer import scenario_data as sd  # noqa: E402

from connectors.base import ScanRequest  # noqa: E402
from connectors.kafka import KafkaConnection  # noqa: E402
from connectors.mongo import MongoConnection  # noqa: E402
from connectors.s3 import S3Connection  # noqa: E402
from connectors.sql import SqlConnection  # noqa: E402
from dsl.loader import load_text  # noqa: E402
from fabric.execute import execute, latest_per_key  # noqa: E402
from fabric.execute.local import LocalCatalog  # noqa: E402
from fabric.functions import geo_hash  # noqa: E402
from fabric.optimizer import optimize  # noqa: E402
from fabric.plan.builder import build  # noqa: E402
from tests.servers import Servers, load, s3_filesystem  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- setup


def setup(srv: Servers, sizes: sd.Sizes) -> tuple[LocalCatalog, dict[str, pa.Table], str, list]:
    import boto3
    import sqlalchemy as sa

    n = sizes.merchants
    t0 = time.perf_counter()
    tables = sd.generate(sizes)
    log(f"generated data in {time.perf_counter() - t0:.1f} s")

    db = f"fabric_bench_{n}"
    admin = sa.create_engine(srv.mariadb_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as con:
        con.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS {db}")
    admin.dispose()
    url = Servers.with_database(srv.mariadb_url, db)
    t0 = time.perf_counter()
    sd.load_mysql(url, tables)
    log(f"MariaDB ready ({db}) in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    sd.load_mongo(srv.mongo_url, db, tables["coupons"])
    log(f"Mongo ready ({db}.coupons) in {time.perf_counter() - t0:.1f} s")

    topic = f"fabric_bench_locations_{n}_{sizes.users}"
    t0 = time.perf_counter()
    sd.load_kafka(srv.kafka_bootstrap, topic, tables["locations"])
    log(f"Kafka ready ({topic}) in {time.perf_counter() - t0:.1f} s")

    bucket = "fabric-bench"
    client = boto3.client(
        "s3",
        endpoint_url=srv.s3_endpoint,
        aws_access_key_id=srv.s3_access_key,
        aws_secret_access_key=srv.s3_secret_key,
        region_name="us-east-1",
    )
    if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=bucket)
    key = f"categories_{n}.csv"
    sd.load_s3(s3_filesystem(srv), f"{bucket}/{key}", tables["categories"])
    log("S3 ready")

    conns = {
        "shop": SqlConnection("shop", {"kind": "mysql", "url": url}),
        "crm": MongoConnection(
            "crm",
            # declared, as in fabric.yaml: SecantusDB reads the whole collection to sample 100 documents
            {
                "kind": "mongo",
                "url": srv.mongo_url,
                "database": db,
                "schemas": {"coupons": sd.COUPON_SCHEMA},
                "read_timeout": 900,
                # SecantusDB answers one request at a time: while it streams a whole collection
                # (the naive way), pymongo's 5 s heartbeat would time out and cancel the read
                "timeout": 120,
            },
        ),
        "bus": KafkaConnection(
            "bus",
            {
                "kind": "kafka",
                "bootstrap": srv.kafka_bootstrap,
                "schemas": {topic: sd.LOCATION_SCHEMA},
            },
        ),
        "lake": S3Connection(
            "lake",
            {
                "kind": "s3",
                "endpoint": srv.s3_endpoint,
                "bucket": bucket,
                "access_key": srv.s3_access_key,
                "secret_key": srv.s3_secret_key,
            },
        ),
    }
    return LocalCatalog(conns, scan_timeout=900), tables, topic, [key]


# ---------------------------------------------------------------- the naive way


def fetch_whole(cat: LocalCatalog, uri: str) -> tuple[pa.Table, int]:
    src = cat.source(uri)
    batches = list(src.scan(ScanRequest(timeout=600)))
    t = pa.Table.from_batches(batches) if batches else src.schema().empty_table()
    return t, t.num_rows


def naive_nearby(cat: LocalCatalog, topic: str, user: int) -> tuple[pa.Table, dict[str, int]]:
    loc, n_loc = fetch_whole(cat, f"kafka://bus/{topic}")
    merchants, n_m = fetch_whole(cat, "mysql://shop/merchants")
    coupons, n_c = fetch_whole(cat, "mongo://crm/coupons")
    mine = latest_per_key(loc.filter(pc.equal(loc["user_id"], user)), ("user_id",))
    if mine.num_rows == 0:
        return pa.table({"name": [], "discount": [], "code": []}), {
            "loc": n_loc,
            "m": n_m,
            "c": n_c,
        }
    cell = geo_hash(mine["lat"], mine["lon"], 6)[0].as_py()
    m = merchants.filter(
        pc.and_(pc.equal(merchants["geo_hash"], cell), pc.equal(merchants["status"], "active"))
    )
    c = coupons.filter(pc.greater(coupons["expires_at"], pa.scalar(sd.NOW)))
    j = c.select(["merchant_id", "discount", "code"]).join(
        m.select(["id", "name"]), keys="merchant_id", right_keys="id", join_type="inner"
    )
    j = j.sort_by([("discount", "descending"), ("code", "ascending")]).slice(0, 10)
    return j.select(["name", "discount", "code"]), {"loc": n_loc, "m": n_m, "c": n_c}


def naive_top(cat: LocalCatalog, key: str, user: int) -> tuple[pa.Table, dict[str, int]]:
    orders, n_o = fetch_whole(cat, "mysql://shop/orders")
    cats, n_k = fetch_whole(cat, f"s3://lake/{key}")
    since = pa.scalar(sd.NOW - dt.timedelta(days=7))
    o = orders.filter(
        pc.and_(pc.equal(orders["user_id"], user), pc.greater_equal(orders["ordered_at"], since))
    )
    j = o.select(["sku", "amount"]).join(cats, keys="sku", join_type="inner")
    g = j.group_by("category").aggregate([("amount", "sum")]).rename_columns(["category", "spent"])
    g = g.sort_by([("spent", "descending"), ("category", "ascending")]).slice(0, 1)
    return g, {"o": n_o, "k": n_k}


# ---------------------------------------------------------------- measuring


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run(args: argparse.Namespace) -> None:
    srv = load()
    sizes = sd.Sizes.at(args.scale, users=args.users)
    log(f"sizes: {sizes}")
    cat, tables, topic, (csv_key,) = setup(srv, sizes)
    if args.load_only:
        return
    ref = sd.reference(tables)
    nearby = optimize(
        build(load_text(sd.NEARBY_OFFERS.format(topic=topic), "nearby.yaml")[0], cat), cat
    )
    top_text = sd.TOP_CATEGORY.replace("s3://lake/categories.csv", f"s3://lake/{csv_key}")
    top = optimize(build(load_text(top_text, "top.yaml")[0], cat), cat)
    log("plans:\n" + nearby.explain() + "\n" + top.explain())

    users = [1 + (i * 7919) % sizes.users for i in range(args.queries)]
    rows: list[tuple] = []
    for scenario, plan, refn, naive in (
        ("nearby_offers", nearby, sd.ref_nearby, lambda u: naive_nearby(cat, topic, u)),
        ("top_category", top, sd.ref_top, lambda u: naive_top(cat, csv_key, u)),
    ):
        ways = [("fabric", cat)]
        for way, catalog in ways:
            execute(plan, {"user_id": users[0]}, catalog, binding=scenario, now=sd.NOW)  # warm-up
            lat: list[float] = []
            fetched: dict[str, int] = {}
            needed: dict[str, int] = {}
            mismatches = 0
            start = time.monotonic()
            for u in users:
                if len(lat) >= 3 and time.monotonic() - start > args.budget:
                    break
                t0 = time.perf_counter()
                res = execute(plan, {"user_id": u}, catalog, binding=scenario, now=sd.NOW)
                lat.append((time.perf_counter() - t0) * 1000)
                expected, need = refn(ref, u)
                mismatches += _differs(res.table, expected)
                for alias, st in res.stats["sources"].items():
                    fetched[alias] = fetched.get(alias, 0) + st["rows"]
                    needed[alias] = needed.get(alias, 0) + need[alias]
            rows.append((scenario, way, len(lat), lat, fetched, needed, mismatches))
            log(
                f"{scenario} {way}: p50 {pct(lat, 0.5):.1f} ms, {len(lat)} queries, {mismatches} wrong"
            )
            log(
                "one query, analyzed:\n"
                + execute(
                    plan, {"user_id": users[1]}, catalog, binding=scenario, analyze=True, now=sd.NOW
                ).explain
            )

        nlat: list[float] = []
        nfetched: dict[str, int] = {}
        nneeded: dict[str, int] = {}
        nmis = 0
        start = time.monotonic()
        for u in users[: args.naive_queries]:
            if len(nlat) >= 2 and time.monotonic() - start > args.budget:
                break
            t0 = time.perf_counter()
            table, counts = naive(u)
            nlat.append((time.perf_counter() - t0) * 1000)
            expected, need = refn(ref, u)
            nmis += _differs(table, expected)
            for alias, n in counts.items():
                nfetched[alias] = nfetched.get(alias, 0) + n
                nneeded[alias] = nneeded.get(alias, 0) + need[alias]
        if nlat:
            rows.append((scenario, "naive", len(nlat), nlat, nfetched, nneeded, nmis))
            log(f"{scenario} naive: p50 {pct(nlat, 0.5):.1f} ms, {len(nlat)} queries, {nmis} wrong")

    print()
    print(
        f"federated benchmark: {sizes.merchants:,} merchants / {sizes.coupons:,} coupons / {sizes.orders:,} orders, "
        f"{sizes.users:,} users x {sizes.positions} positions on Kafka, {sizes.skus:,} skus in S3 CSV"
    )
    head = f"{'scenario':<14} {'way':<7} {'queries':>7} {'p50 ms':>9} {'p95 ms':>9} {'source':<6} {'fetched/q':>11} {'needed/q':>9} {'ratio':>9} {'wrong':>5}"
    print(head)
    print("-" * len(head))
    p50 = {}
    for scenario, way, nq, lat, fetched, needed, mis in rows:
        p50[(scenario, way)] = pct(lat, 0.5)
        for i, alias in enumerate(fetched):
            f, nd = fetched[alias] / nq, needed[alias] / nq
            ratio = f"{fetched[alias] / needed[alias]:.2f}x" if needed[alias] else "n/a"
            lead = (
                f"{scenario:<14} {way:<7} {nq:>7} {pct(lat, 0.5):>9.1f} {pct(lat, 0.95):>9.1f}"
                if i == 0
                else " " * 49
            )
            tail = f"{mis:>5}" if i == 0 else ""
            print(f"{lead} {alias:<6} {f:>11,.1f} {nd:>9,.1f} {ratio:>9} {tail}")
    print()
    for (scenario, way), v in p50.items():
        if way != "naive" and (scenario, "naive") in p50:
            speed = p50[(scenario, "naive")] / v
            print(f"{scenario}: {way} p50 is {speed:,.1f}x faster than fetching every source whole")
    print(
        "rows fetched = rows a source returned to the fabric. The Kafka source reads the whole topic "
        "and filters it client-side (it has no index); the S3 CSV is read whole and filtered in pyarrow."
    )


def _differs(table: pa.Table, expected: list) -> int:
    got = [tuple(r.values()) for r in table.to_pylist()]
    want = [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in expected]
    if len(got) != len(want):
        return 1
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            if isinstance(a, float) or isinstance(b, float):
                if abs(float(a) - float(b)) > 1e-6 * max(1.0, abs(float(b))):
                    return 1
            elif a != b:
                return 1
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--scale", type=float, default=1.0, help="1.0 = 1M merchants / coupons / orders"
    )
    ap.add_argument(
        "--users", type=int, default=2000, help="users on the location stream (3 positions each)"
    )
    ap.add_argument(
        "--queries", type=int, default=60, help="fabric queries per scenario (one session each)"
    )
    ap.add_argument(
        "--naive-queries",
        type=int,
        default=3,
        help="naive queries per scenario (each fetches everything)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=180,
        help="seconds per scenario and way before stopping early",
    )
    ap.add_argument("--load-only", action="store_true", help="load (or check) the data and stop")
    args = ap.parse_args()
    run(args)


if __name__ == "__main__":
    main()
