"""Partitioned hash joins as Ray tasks (``executor: ray``).

A join inside a DuckDB region (``fabric.execute._Run._compile``) whose two sides are
both estimated, and then counted, at ``join_min_rows`` rows or more runs as N Ray tasks
instead of inside the region's one DuckDB query:

1. each side is materialized as an Arrow table (a scan's table as it is; a side that is
   itself a join or a filter is run by DuckDB first);
2. the driver hash-partitions both sides by the join key into N parts (DuckDB's
   ``hash()`` of the key columns, integer keys cast to BIGINT first so an INTEGER and a
   BIGINT key of the same value land in the same part), one ``take`` per side;
3. task i joins part i of the left with part i of the right, in DuckDB, with the join's
   own ON text (equality on the keys plus any other condition) and kind (inner / left):
   rows with equal keys are in the same part, so every match is found in exactly one
   task, and a left row without a match is kept with nulls by the one task holding it;
4. the tasks' answers are concatenated and the rest of the region reads them as a table.

So the rows are the ones the local join gives (their order is not promised: a join's
order is not, locally either). Only equi-joins on plain columns whose types hash alike
(integers, strings, dates, timestamps of one unit and zone, booleans) are partitioned:
floats are not (``-0.0 = 0.0`` but they hash apart), nor decimals of different scales.

The threshold: a partitioned join moves both sides through the object store and pays a
task round trip per part, which costs more than DuckDB's own multithreaded hash join of
the same rows on one machine (benchmarks/scale.py --join measures both). It can only
pay when the parts run on other machines' cores and memory, for sides too large for
one, so the default (``DEFAULT_JOIN_MIN_ROWS``, 2,000,000 rows on each side) keeps every
join of the TPC-H suites at the scales run here local; ``join_min_rows: 0`` sends every
eligible join to Ray (the tests do).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["DEFAULT_JOIN_MIN_ROWS", "RayJoins", "equi_keys", "hashable"]

DEFAULT_JOIN_MIN_ROWS = 2_000_000


def hashable(a: pa.DataType, b: pa.DataType) -> str | None:
    """The DuckDB type both keys are hashed as, or None when equal values of ``a`` and
    ``b`` might hash apart (so the join stays in one piece)."""
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return "BIGINT" if not (pa.types.is_uint64(a) or pa.types.is_uint64(b)) else None
    if pa.types.is_string(a) or pa.types.is_large_string(a):
        return "VARCHAR" if pa.types.is_string(b) or pa.types.is_large_string(b) else None
    if a != b:
        return None
    if pa.types.is_boolean(a):
        return "BOOLEAN"
    if pa.types.is_date32(a):
        return "DATE"
    if pa.types.is_timestamp(a):
        return None if a.unit == "ns" else ("TIMESTAMPTZ" if a.tz else "TIMESTAMP")
    return None


def equi_keys(
    on: Any,
    left_names: Sequence[str],
    left_map: Mapping[Any, str],
    right_names: Sequence[str],
    right_map: Mapping[Any, str],
) -> list[tuple[str, str]] | None:
    """The (left column, right column) pairs of the plain-column equalities of ``on``'s
    conjunction; None when it has none."""
    from dsl.ast import Binary, Column
    from fabric.execute.sql import resolve

    def conjuncts(e: Any) -> list[Any]:
        if isinstance(e, Binary) and e.op == "and":
            return conjuncts(e.left) + conjuncts(e.right)
        return [e]

    def side(c: Any, names: Sequence[str], m: Mapping[Any, str]) -> str | None:
        try:
            return resolve(c, list(names), m)
        except Exception:
            return None

    out = []
    for e in conjuncts(on):
        if not (isinstance(e, Binary) and e.op == "=" and isinstance(e.left, Column)):
            continue
        if not isinstance(e.right, Column):
            continue
        for a, b in ((e.left, e.right), (e.right, e.left)):
            lc, rc = side(a, left_names, left_map), side(b, right_names, right_map)
            if lc is not None and rc is not None:
                out.append((lc, rc))
                break
    return out or None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _hash_sql(cols: Sequence[tuple[str, str]]) -> str:
    return "hash(" + ", ".join(f"CAST({_quote(c)} AS {t})" for c, t in cols) + ")"


def partition(table: pa.Table, cols: Sequence[tuple[str, str]], n: int) -> list[pa.Table]:
    """``table`` in ``n`` parts by the hash of ``cols`` ((column, DuckDB type) pairs)."""
    import duckdb

    con = duckdb.connect()
    try:
        con.register("__fabric_side", table)
        h = con.sql(f"SELECT {_hash_sql(cols)} % {n} AS p FROM __fabric_side").to_arrow_table()
    finally:
        con.close()
    # a small integer type: numpy's stable sort of 8/16-bit integers is a radix sort,
    # ~25x faster than of int64 (22 vs 627 ms for 2M rows here)
    p = np.asarray(h.column("p").to_numpy(zero_copy_only=False)).astype(
        np.uint8 if n <= 256 else np.uint16
    )
    order = np.argsort(p, kind="stable")
    counts = np.bincount(p, minlength=n)
    moved = table.take(pa.array(order))
    out, start = [], 0
    for c in counts:
        out.append(moved.slice(start, int(c)))
        start += int(c)
    return out


def join_part(
    left: pa.Table, right: pa.Table, sql: str, values: Sequence[Any]
) -> tuple[pa.Table, float]:
    """One part's join (a Ray task): ``sql`` over ``__fabric_l`` and ``__fabric_r``."""
    import duckdb

    t0 = time.perf_counter()
    con = duckdb.connect()
    try:
        con.execute("SET threads TO 1")  # one CPU per task: the others are other tasks'
        con.register("__fabric_l", left)
        con.register("__fabric_r", right)
        out = con.sql(sql, params=list(values) or None).to_arrow_table()
    finally:
        con.close()
    return out, (time.perf_counter() - t0) * 1000


class RayJoins:
    """The executor's join hook (``catalog.executor.joins``)."""

    def __init__(self, cluster: Any, *, min_rows: int = DEFAULT_JOIN_MIN_ROWS, tasks: int = 0):
        import ray

        self.cluster = cluster
        self.min_rows = min_rows
        self.tasks = tasks or max(2, cluster.cpus())
        self._remote = ray.remote(num_cpus=1, max_retries=0)(join_part)

    def wants(self, left_rows: int | None, right_rows: int | None) -> bool:
        """Both sides at ``min_rows`` or more (estimated, or counted)."""
        return self.min_rows <= 0 or (
            left_rows is not None
            and right_rows is not None
            and left_rows >= self.min_rows
            and right_rows >= self.min_rows
        )

    def join(
        self,
        left: pa.Table,
        right: pa.Table,
        keys: Sequence[tuple[str, str]],
        how: str,
        on_sql: str,
        values: Sequence[Any],
    ) -> tuple[pa.Table, dict[str, Any]] | None:
        """``left JOIN right ON on_sql`` in ``self.tasks`` hash partitions; None when the
        key types do not hash alike (the caller joins in one piece)."""
        import ray

        found = [hashable(left.schema.field(a).type, right.schema.field(b).type) for a, b in keys]
        types = [t for t in found if t is not None]
        if len(types) != len(found):
            return None
        n = self.tasks
        t0 = time.perf_counter()
        lparts = partition(left, [(a, t) for (a, _), t in zip(keys, types, strict=True)], n)
        rparts = partition(right, [(b, t) for (_, b), t in zip(keys, types, strict=True)], n)
        kind = "LEFT JOIN" if how == "left" else "JOIN"
        sql = f"SELECT * FROM __fabric_l {kind} __fabric_r ON {on_sql}"
        part_ms = (time.perf_counter() - t0) * 1000
        refs = [
            self._remote.remote(lp, rp, sql, list(values))
            for lp, rp in zip(lparts, rparts, strict=True)
            if lp.num_rows and (how == "left" or rp.num_rows)  # else nothing to give
        ]
        results = ray.get(refs) if refs else []
        tables = [t for t, _ in results]
        if not tables:  # nothing can match: an empty join of the right shape
            tables = [join_part(left.slice(0, 0), right.slice(0, 0), sql, values)[0]]
        out = pa.concat_tables(tables)
        info = {
            "tasks": len(refs),
            "partitions": n,
            "keys": [f"{a} = {b}" for a, b in keys],
            "partition_ms": round(part_ms, 3),
            "task_ms": [round(ms, 3) for _, ms in results],
            "rows": [left.num_rows, right.num_rows],
        }
        return out, info

    def region_join(
        self, run: Any, b: Any, node: Any, left: Any, right: Any
    ) -> tuple[Any, Any, Any]:
        """The executor's call for a ``Join`` inside a DuckDB region (``run``: the query's
        ``fabric.execute._Run``; ``b`` its SqlBuilder; ``left`` / ``right`` the sides'
        Rels): ``(rel, left, right)``. ``rel`` is the joined table as a Rel when the join
        ran as Ray tasks (else None), and the sides come back as tables when they had to
        be run to be counted, so the region does not run them twice."""
        from fabric.execute.sql import Rel, used_params

        if node.how not in ("inner", "left"):
            return None, left, right
        est = (
            getattr(node.left, "estimated_rows", None),
            getattr(node.right, "estimated_rows", None),
        )
        if not self.wants(*est):
            return None, left, right
        keys = equi_keys(node.on, left.names, left.exprmap, right.names, right.exprmap)
        if keys is None:
            return None, left, right
        both = Rel("", left.names + right.names, {**left.exprmap, **right.exprmap})
        on = run._expr_sql(b, node.on, both)
        if "__fabric_s" in on:  # reads a stage's table: not shipped to the tasks
            return None, left, right
        t0 = time.perf_counter()
        lt, rt = _table_of(b, left), _table_of(b, right)
        if lt.column_names != left.names or rt.column_names != right.names:
            return None, left, right
        left, right = _as_rel(b, lt, left), _as_rel(b, rt, right)
        if not self.wants(lt.num_rows, rt.num_rows):  # counted: smaller than estimated
            return None, left, right
        sql, values = used_params(on, b.values)
        done = self.join(lt, rt, keys, node.how, sql, values)
        if done is None:
            return None, left, right
        table, info = done
        table = table.rename_columns(both.names)
        rel = b.table(table)
        rel.exprmap = both.exprmap
        label = (
            f"ray: partitioned hash join, {info['tasks']} tasks of {info['partitions']} "
            f"hash partitions on {', '.join(info['keys'])} (both sides >= {self.min_rows} rows)"
        )
        run.ray_joins[id(node)] = (label, info)
        run._record(node, table.num_rows, t0, engine=label)
        return rel, left, right


def _registered(b: Any, rel: Any) -> pa.Table | None:
    """The table a side is, when it is one of the query's registered tables as it is."""
    from fabric.execute.sql import quote

    for name, t in b.tables.items():
        if rel.sql == f"SELECT * FROM {quote(name)}":
            return t
    return None


def _table_of(b: Any, rel: Any) -> pa.Table:
    """The Arrow table of a side: a registered table as it is, else run by DuckDB."""
    t = _registered(b, rel)
    return t if t is not None else b.run(rel.sql)


def _as_rel(b: Any, table: pa.Table, like: Any) -> Any:
    """``like`` when it is a registered table, else ``table`` registered in its place."""
    if _registered(b, like) is not None:
        return like
    rel = b.table(table)
    rel.exprmap = like.exprmap
    return rel
