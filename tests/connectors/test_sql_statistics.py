"""MariaDB keeps distinct counts only for indexed columns; the SQL connector samples the
category-like columns so the optimizer can estimate ``status = 'F'`` (TPC-H Q21 read
orders first on a default 10 % guess where the filter keeps half the table)."""

from __future__ import annotations

import sqlalchemy as sa

from connectors.sql import SqlConnection
from fabric.optimizer.cardinality import Estimator


def test_mariadb_small_domains_get_distinct_counts(mariadb_url: str) -> None:
    engine = sa.create_engine(mariadb_url)
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS stat_orders")
        c.exec_driver_sql(
            "CREATE TABLE stat_orders (id INT PRIMARY KEY, status CHAR(1), comment VARCHAR(40))"
        )
        rows = [(i, "FOP"[i % 3], f"comment {i}") for i in range(30_000)]
        c.execute(
            sa.text("INSERT INTO stat_orders VALUES (:i, :s, :c)"),
            [{"i": i, "s": s, "c": t} for i, s, t in rows],
        )
        c.exec_driver_sql("ANALYZE TABLE stat_orders")
    try:
        src = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url}).source("stat_orders")
        st = src.statistics()
        assert st.columns["status"].distinct_count == 3
        assert "comment" not in st.columns or st.columns["comment"].distinct_count is None
        from dsl.ast import Binary, Column, Literal
        from fabric.plan.nodes import Scan

        scan = Scan("o", src.uri, src.schema())
        sel = Estimator(scan, _Catalog(src)).selectivity(
            Binary("=", Column("status"), Literal("F", "str")), scan, qualified=False
        )
        assert abs(sel - 1 / 3) < 1e-9
    finally:
        with engine.begin() as c:
            c.exec_driver_sql("DROP TABLE IF EXISTS stat_orders")
        engine.dispose()


class _Catalog:
    def __init__(self, src):
        self.src = src

    def source(self, uri: str):
        return self.src
