"""Partitioned hash joins on Ray (fabric.ray.join): both sides hash-partitioned by the
join key into N parts, each part joined in its own Ray task; the rows equal DuckDB's one
join of the same tables (inner and left; integer keys of two widths, string keys,
multi-column keys, null keys, an extra non-equi condition), and keys whose equal values
could hash apart (floats: -0.0 = 0.0) are not partitioned. TPC-H's joins on
``join_min_rows: 0`` are in tests/test_ray_tpch.py."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from fabric.ray.join import RayJoins, hashable, partition
from tests import ray_support

pytestmark = [pytest.mark.ray]

ray_cluster = ray_support.ray_cluster

RNG = np.random.default_rng(16)


def sides(n: int = 4000) -> tuple[pa.Table, pa.Table]:
    k = RNG.integers(0, 900, n)
    left = pa.table(
        {
            "l.k": pa.array(k, pa.int32()),
            "l.s": pa.array([f"s{i % 37}" if i % 11 else None for i in k]),
            "l.v": pa.array(RNG.standard_normal(n)),
        }
    )
    rk = RNG.integers(0, 1200, n // 2)
    right = pa.table(
        {
            "r.k": pa.array([None if i % 97 == 0 else int(i) for i in rk], pa.int64()),
            "r.s": pa.array([f"s{i % 37}" for i in rk], pa.large_string()),
            "r.w": pa.array(RNG.integers(0, 10, n // 2), pa.int64()),
        }
    )
    return left, right


def reference(left: pa.Table, right: pa.Table, how: str, on: str) -> pa.Table:
    con = duckdb.connect()
    con.register("__fabric_l", left)
    con.register("__fabric_r", right)
    kind = "LEFT JOIN" if how == "left" else "JOIN"
    return con.sql(f"SELECT * FROM __fabric_l {kind} __fabric_r ON {on}").to_arrow_table()


def canonical(t: pa.Table) -> list[tuple]:
    rows = zip(*[t.column(c).to_pylist() for c in t.column_names], strict=True)
    return sorted(map(tuple, rows), key=repr)


@pytest.mark.parametrize("how", ["inner", "left"])
@pytest.mark.parametrize(
    ("keys", "on"),
    [
        ([("l.k", "r.k")], '"l.k" = "r.k"'),
        ([("l.s", "r.s")], '"l.s" = "r.s"'),
        ([("l.k", "r.k"), ("l.s", "r.s")], '"l.k" = "r.k" AND "l.s" = "r.s"'),
        ([("l.k", "r.k")], '"l.k" = "r.k" AND "r.w" > 4 AND "l.v" < 0.5'),
    ],
)
def test_a_partitioned_join_gives_duckdbs_rows(ray_cluster, how, keys, on) -> None:
    left, right = sides()
    joins = RayJoins(ray_cluster, min_rows=0, tasks=3)
    out, info = joins.join(left, right, keys, how, on, [])
    want = reference(left, right, how, on)
    assert out.column_names == want.column_names
    assert out.num_rows == want.num_rows > 0
    assert canonical(out) == canonical(want)
    assert info["partitions"] == 3 and info["tasks"] == 3, info


def test_equal_keys_of_two_integer_widths_land_in_one_part() -> None:
    a = pa.table({"k": pa.array([1, 5, 7, 1 << 20], pa.int32())})
    b = pa.table({"k": pa.array([1 << 20, 7, 5, 1], pa.int64())})
    pa_, pb = partition(a, [("k", "BIGINT")], 4), partition(b, [("k", "BIGINT")], 4)
    for x, y in zip(pa_, pb, strict=True):
        assert sorted(x.column("k").to_pylist()) == sorted(y.column("k").to_pylist())


def test_keys_that_could_hash_apart_are_not_partitioned(ray_cluster) -> None:
    assert hashable(pa.float64(), pa.float64()) is None  # -0.0 = 0.0, NaN
    assert hashable(pa.int32(), pa.string()) is None
    assert hashable(pa.timestamp("us", "UTC"), pa.timestamp("us")) is None
    assert hashable(pa.int32(), pa.int64()) == "BIGINT"
    left = pa.table({"l.x": pa.array([0.0, 1.0])})
    right = pa.table({"r.x": pa.array([-0.0, 1.0])})
    joins = RayJoins(ray_cluster, min_rows=0, tasks=2)
    assert joins.join(left, right, [("l.x", "r.x")], "inner", '"l.x" = "r.x"', []) is None


def test_an_empty_side_gives_the_join_of_the_right_shape(ray_cluster) -> None:
    left, right = sides(200)
    joins = RayJoins(ray_cluster, min_rows=0, tasks=2)
    out, _ = joins.join(left, right.slice(0, 0), [("l.k", "r.k")], "inner", '"l.k" = "r.k"', [])
    assert out.num_rows == 0 and out.column_names == left.column_names + right.column_names
    out, _ = joins.join(left, right.slice(0, 0), [("l.k", "r.k")], "left", '"l.k" = "r.k"', [])
    assert out.num_rows == 200 and pc.all(pc.is_null(out.column("r.w"))).as_py()
