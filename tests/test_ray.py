"""executor: ray: scans as Ray tasks give the tables local mode gives (issue 16).

One local Ray cluster per session (tests/ray_support.py). Every scan here is sent to Ray
(``min_rows=0``) so the split of each source kind is exercised on small data; the
threshold itself has its own test."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa
import pytest
from fixtures.optimizer import scenario_data as sd

from connectors.base import ScanRequest
from fabric.execute import execute
from fabric.execute.local import LocalCatalog
from fabric.ray.scan import RayScans, plan_splits
from tests import ray_support, test_scenarios
from tests.test_scenarios import USERS, _compile

ray_cluster = ray_support.ray_cluster  # the session's cluster
world = test_scenarios.world  # the seed scenarios' data on the real servers

pytestmark = [pytest.mark.ray, pytest.mark.servers]


# ---------------------------------------------------------------- configuration


def test_executor_option_in_fabric_yaml_and_open() -> None:
    import fabric
    from dsl.errors import DslError
    from fabric.config import load_config

    assert load_config("bindings: []\n").executor.kind == "local"
    cfg = load_config("executor: {kind: ray, num_cpus: 2, min_rows: 5}\n")
    assert (cfg.executor.kind, cfg.executor.num_cpus, cfg.executor.min_rows) == ("ray", 2, 5)
    with pytest.raises(DslError, match=r"(?s)unknown executor 'rey'.*did you mean 'ray'"):
        load_config("executor: rey\n")
    with pytest.raises(ValueError, match="use 'local', 'ray'"):
        fabric.open("bindings: []\n", executor="spark", ingest=False, watch=False)
    fab = fabric.open("bindings: []\n", ingest=False, watch=False)  # local: no Ray at all
    try:
        assert fab.executor is None and getattr(fab.catalog, "executor", None) is None
    finally:
        fab.close()


def test_cluster_is_local_quiet_and_under_the_data_folder(ray_cluster, tmp_path) -> None:
    import ray

    assert ray.is_initialized()
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    nodes = ray.nodes()
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
    assert ray.cluster_resources()["CPU"] == 2
    if ray_cluster.started:
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        assert token.parent == ray_cluster.temp_dir.parent  # the data folder, not ~/.ray
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert ray_cluster.pids, "the started node's processes are known by PID"


def test_fabric_open_with_ray_shares_the_session_cluster(ray_cluster, tmp_path) -> None:
    import fabric

    fab = fabric.open("bindings: []\n", ingest=False, watch=False, executor="ray")
    try:
        assert fab.executor.cluster is ray_cluster
        assert fab.catalog.executor is fab.executor
        assert fab.executor.scans.min_rows == 100_000  # the default threshold
    finally:
        fab.close()
    fab = fabric.open("executor: ray\nbindings: []\n", ingest=False, watch=False)
    try:  # the same from fabric.yaml
        assert fab.executor.cluster is ray_cluster
    finally:
        fab.close()
    import ray

    assert ray.is_initialized(), "closing one fabric does not stop a cluster others use"


# ---------------------------------------------------------------- scans, source by source


def _local_and_ray(source, scans: RayScans, columns=None, filters=(), params=None):
    req = ScanRequest(columns=columns, filters=tuple(filters), params=params or {})
    local = pa.Table.from_batches(list(source.scan(req)))
    got = scans.scan(source, req)
    assert got is not None, f"{source.uri} was not sent to Ray"
    batches, info = got
    return local, pa.Table.from_batches(batches, schema=local.schema), info


def test_each_source_kind_splits_and_gives_the_local_rows_in_order(ray_cluster, world) -> None:
    cat, tables, _ = world
    scans = RayScans(ray_cluster, min_rows=0, tasks=3)
    kinds = {}
    for uri in ("mysql://shop/merchants", "mysql://shop/orders", "mongo://crm/coupons"):
        src = cat.source(uri)
        local, remote, info = _local_and_ray(src, scans)
        assert remote.equals(local), uri
        assert local.num_rows == tables[uri.rsplit("/", 1)[1]].num_rows
        assert info["tasks"] == 3, info
        kinds[uri] = info["split"]
    assert kinds == {
        "mysql://shop/merchants": "range",
        "mysql://shop/orders": "range",
        "mongo://crm/coupons": "mongo_id",
    }


def test_sql_ranges_are_open_at_both_ends(ray_cluster, world) -> None:
    """Rows beyond the statistics' min/max (added after they were taken) are still read."""
    cat, _, _ = world
    src = cat.source("mysql://shop/merchants")
    splits = plan_splits(src, ScanRequest(), 4)
    assert len(splits) == 4
    assert [str(f) for f in splits[0].filters] == ["id < {{session.__ray_hi}}"]
    assert [str(f) for f in splits[-1].filters] == ["id >= {{session.__ray_lo}}"]


def test_filters_and_projection_travel_with_the_splits(ray_cluster, world) -> None:
    from dsl.ast import Binary, Column, Param

    cat, _, _ = world
    scans = RayScans(ray_cluster, min_rows=0, tasks=2)
    for uri, col, value in (
        ("mysql://shop/merchants", "status", "active"),
        ("mongo://crm/coupons", "merchant_id", 7),
    ):
        src = cat.source(uri)
        f = Binary("=", Column(col), Param("v"))
        local, remote, _ = _local_and_ray(
            src, scans, columns=(col,), filters=[f], params={"v": value}
        )
        assert remote.equals(local) and local.num_rows > 0, uri


def test_s3_splits_by_files_in_path_order(ray_cluster, s3) -> None:
    import pyarrow.parquet as pq

    from dsl.ast import Binary, Column, Param

    t = pa.table({"k": pa.array(range(4000), pa.int64()), "v": [f"r{i}" for i in range(4000)]})
    for i in range(3):  # 3 files of 2 row groups each
        part = t.slice(i * 1000, 1000 if i < 2 else 2000)
        with s3.fs.open_output_stream(s3.path(f"raysplit/part-{i}.parquet")) as out:
            pq.write_table(part, out, row_group_size=part.num_rows // 2)
    conn = s3.connection("lake")
    src = conn.source("raysplit/*.parquet")
    for tasks, want in ((2, 2), (4, 3)):  # never more tasks than files
        local, remote, info = _local_and_ray(src, RayScans(ray_cluster, min_rows=0, tasks=tasks))
        assert remote.equals(local) and local.num_rows == 4000
        assert (info["split"], info["tasks"]) == ("files", want)
    ge = Binary(">=", Column("k"), Param("lo"))
    local, remote, _ = _local_and_ray(
        src, RayScans(ray_cluster, min_rows=0), filters=[ge], params={"lo": 3500}
    )
    assert remote.equals(local) and local.num_rows == 500


def test_small_limited_and_ordered_scans_stay_local(ray_cluster, world) -> None:
    from dsl.ast import Column, SortKey

    cat, _, _ = world
    src = cat.source("mysql://shop/merchants")
    assert RayScans(ray_cluster).scan(src, ScanRequest()) is None  # 4000 rows < 100k
    scans = RayScans(ray_cluster, min_rows=0)
    assert scans.scan(src, ScanRequest(limit=5)) is None
    assert scans.scan(src, ScanRequest(order_by=(SortKey(Column("id")),))) is None


def test_a_failing_task_raises_the_connectors_error(ray_cluster, world) -> None:
    from connectors.base import UnknownColumnError

    cat, _, _ = world
    src = cat.source("mysql://shop/merchants")
    with pytest.raises(UnknownColumnError, match="no column nope"):
        RayScans(ray_cluster, min_rows=0).scan(src, ScanRequest(columns=("nope",)))


# ---------------------------------------------------------------- the federated scenarios


@pytest.fixture(scope="module")
def ray_world(world, ray_cluster):
    cat, tables, topic = world
    rcat = LocalCatalog(cat.connections, executor=RayScans(ray_cluster, min_rows=0))
    return cat, rcat, tables, topic


def test_nearby_offers_on_ray_equals_local_mode(ray_world) -> None:
    cat, rcat, tables, topic = ray_world
    text = sd.NEARBY_OFFERS.format(topic=topic)
    plan, rplan = _compile(text, cat), _compile(text, rcat)
    ref = sd.reference(tables)
    sent = 0
    for user in USERS:
        local = execute(plan, {"user_id": user}, cat, binding="nearby_offers", now=sd.NOW)
        res = execute(rplan, {"user_id": user}, rcat, binding="nearby_offers", now=sd.NOW)
        assert res.table.equals(local.table), user
        assert res.table.to_pylist() == sd.ref_nearby(ref, user)[0], user
        sent += sum("ray" in s for s in res.stats["sources"].values())
    assert sent >= len(USERS), "the merchants and coupons scans ran as Ray tasks"


def test_top_category_on_ray_equals_local_mode(ray_world) -> None:
    cat, rcat, _, _ = ray_world
    plan, rplan = _compile(sd.TOP_CATEGORY, cat), _compile(sd.TOP_CATEGORY, rcat)
    sent = 0
    for user in USERS:
        local = execute(plan, {"user_id": user}, cat, binding="top_category_last_week", now=sd.NOW)
        res = execute(rplan, {"user_id": user}, rcat, binding="top_category_last_week", now=sd.NOW)
        assert res.table.equals(local.table), user
        sent += "ray" in res.stats["sources"]["o"]
    assert sent == len(USERS)


def test_sql_scan_keeps_a_doubles_digits_in_the_first_row(mariadb_url) -> None:
    """Found by the range splits (each split's first row differed from local mode): the
    first row of every MySQL/MariaDB scan went through SQLAlchemy's DOUBLE processing
    (Decimal, 10 digits) while the others came from the driver as they are."""
    import sqlalchemy as sa

    from connectors.sql import SqlConnection

    eng = sa.create_engine(mariadb_url)
    with eng.begin() as c:
        c.execute(sa.text("DROP TABLE IF EXISTS ray_first_double"))
        c.execute(sa.text("CREATE TABLE ray_first_double (id BIGINT PRIMARY KEY, x DOUBLE)"))
        c.execute(
            sa.text("INSERT INTO ray_first_double VALUES (:i, :x)"),
            [{"i": i, "x": 48.30336851093292 + i} for i in range(3)],
        )
    conn = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url})
    try:
        got = pa.Table.from_batches(list(conn.source("ray_first_double").scan(ScanRequest())))
        assert got["x"].to_pylist() == [48.30336851093292 + i for i in range(3)]
    finally:
        conn.close()
        with eng.begin() as c:
            c.execute(sa.text("DROP TABLE ray_first_double"))


def test_kafka_splits_by_partitions_and_gives_the_local_rows(
    ray_cluster, kafka_bootstrap, new_topic
) -> None:
    import json

    from confluent_kafka import Producer

    from connectors.kafka import KafkaConnection

    topic = new_topic(partitions=3, prefix="ray_scan")
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for i in range(900):
        p.produce(topic, key=f"k{i}".encode(), value=json.dumps({"id": i, "v": i * 0.5}).encode())
    assert p.flush(30) == 0
    conn = KafkaConnection(
        "bus",
        {
            "kind": "kafka",
            "bootstrap": kafka_bootstrap,
            "schemas": {topic: {"id": "int", "v": "float"}},
        },
    )
    try:
        src = conn.source(topic)
        local, remote, info = _local_and_ray(src, RayScans(ray_cluster, min_rows=0, tasks=2))
        assert (info["split"], info["tasks"]) == ("partitions", 2)
        assert local.num_rows == 900
        # the same rows; a local scan interleaves partitions as it consumed them
        assert remote.sort_by("id").equals(local.sort_by("id"))
    finally:
        conn.close()
