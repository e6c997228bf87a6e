"""TPC-H on executor: ray: all 22 queries give DuckDB's answer and local mode's table.

The data and harness are tests/test_tpch.py's (benchmarks/tpch: lineitem as 4 Parquet
files in S3, orders + customer in MariaDB, part/partsupp/supplier in PostgreSQL, nation in
MongoDB, region in Kafka). The Ray fabric sends every scan it can split to Ray
(``min_rows: 0``): lineitem by files, orders / customer / part / partsupp / supplier by
primary-key ranges, nation by ``_id`` ranges (when its ids are ObjectIds or integers),
and every equi-join inside a DuckDB region as hash-partitioned Ray tasks
(``join_min_rows: 0``, fabric.ray.join)."""

from __future__ import annotations

import pytest

from benchmarks.tpch import harness as H
from benchmarks.tpch import load
from benchmarks.tpch.queries import QUERIES, Vocab
from tests import ray_support
from tests.test_tpch import SF

pytestmark = [pytest.mark.ray, pytest.mark.servers, pytest.mark.slow]

ray_cluster = ray_support.ray_cluster


@pytest.fixture(scope="module")
def tpch_ray(servers, mariadb_url, pg_url, mongo_url, kafka_bootstrap, s3, ray_cluster):
    import fabric

    data = load.prepare(SF, servers)
    local = H.open_fabric(data)
    on_ray = fabric.open(
        str(H.CONFIG),
        ingest=False,
        watch=False,
        executor={"kind": "ray", "min_rows": 0, "join_min_rows": 0},
    )
    try:
        assert on_ray.executor.cluster is ray_cluster
        yield data, local, on_ray, H.reference(data), Vocab.of(data.tables)
    finally:
        on_ray.close()
        local.close()


@pytest.mark.parametrize("name", H.all_queries())
def test_tpch_on_ray_equals_duckdb_and_local_mode(tpch_ray, name) -> None:
    _data, local, on_ray, ref, vocab = tpch_ray
    q = QUERIES[name]
    params = q.params(SF, None, vocab)
    session = H.session_values(name, params)
    got = H.run_binding(on_ray, H.compile_binding(on_ray, name), session)
    verdict, why = H.compare(H.run_reference(ref, q, params), got.table, q.order)
    assert verdict == "ok", f"{name} {params}: {verdict}: {why}"
    mine = H.run_binding(local, H.compile_binding(local, name), session)
    assert got.table.equals(mine.table), name
    for alias, s in got.stats["sources"].items():  # every lineitem scan that read rows
        if s["uri"].startswith("s3://") and s["rows"]:
            # an aggregate computed in the scan (push_aggregate) is one answer over all
            # files, never split into tasks; every other lineitem scan is split by file
            split = s.get("ray", {}).get("split")
            assert split == (None if s.get("aggregated") else "files"), (name, alias, s)


def test_lineitem_and_orders_scans_ran_as_tasks(tpch_ray) -> None:
    _data, _local, on_ray, _ref, vocab = tpch_ray
    q = QUERIES["q03"]
    got = H.run_binding(
        on_ray, H.compile_binding(on_ray, "q03"), H.session_values("q03", q.params(SF, None, vocab))
    )
    ray = {a: s.get("ray") for a, s in got.stats["sources"].items()}
    assert ray["l"]["split"] == "files" and ray["l"]["tasks"] == 2, ray
    assert ray["o"]["split"] == "range" and ray["o"]["tasks"] == 2, ray


def test_joins_ran_as_partitioned_tasks_and_explain_says_so(tpch_ray) -> None:
    """q03 (customer x orders x lineitem) and q10 on join_min_rows: 0: every join of
    their regions ran as hash-partitioned Ray tasks, and explain(analyze=True) names it
    at each join, with the keys."""
    _data, _local, on_ray, _ref, vocab = tpch_ray
    for name in ("q03", "q10"):
        q = QUERIES[name]
        session = H.session_values(name, q.params(SF, None, vocab))
        got = H.run_binding(on_ray, H.compile_binding(on_ray, name), session, analyze=True)
        joins = [ln for ln in got.explain.splitlines() if "Join" in ln.split("(")[0]]
        assert joins and all("ray: partitioned hash join" in ln for ln in joins), got.explain
        assert any("o.o_orderkey" in ln and "l.l_orderkey" in ln for ln in joins), joins
