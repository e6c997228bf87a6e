"""With ``executor: ray`` a scan's metrics are still its own and reach its caller: each
Ray task scans its split with its own ``request.metrics`` and the driver merges them
into the query's (``fabric.ray.scan``), so the files an S3 scan read and the statements a
SQL scan sent are those of every split."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.base import ScanRequest
from dsl.ast import Binary, Column, Param
from fabric.ray.scan import RayScans
from tests import ray_support

pytestmark = pytest.mark.ray
ray_cluster = ray_support.ray_cluster  # the session's cluster


def test_a_ray_scan_reports_the_metrics_of_all_its_splits(ray_cluster, s3, test_run_id) -> None:
    t = pa.table({"k": pa.array(range(3000), pa.int64())})
    prefix = f"sm-ray-{test_run_id}"
    for i in range(3):  # 3 files of one row group each
        pq.write_table(
            t.slice(i * 1000, 1000), f"{s3.path(prefix)}/part-{i}.parquet", filesystem=s3.fs
        )
    src = s3.connection("lake").source(f"{prefix}/*.parquet")
    f = Binary(">=", Column("k"), Param("lo"))
    local, remote = (ScanRequest(filters=(f,), params={"lo": 1500}) for _ in range(2))
    rows = sum(b.num_rows for b in src.scan(local))
    got = RayScans(ray_cluster, min_rows=0, tasks=3).scan(src, remote)
    assert got is not None and got[1]["tasks"] == 3, "the scan ran as 3 Ray tasks"
    assert sum(b.num_rows for b in got[0]) == rows == 1500
    m, want = remote.metrics, local.metrics
    assert (m.files_total, m.files_read, m.rows) == (want.files_total, want.files_read, rows)
    assert (m.row_groups_total, m.row_groups_read) == (want.row_groups_total, want.row_groups_read)
    assert (m.files_total, m.row_groups_total, m.row_groups_read) == (3, 3, 2)  # k < 1000 pruned
    assert m.as_dict()["reader"] == want.as_dict()["reader"]
