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


def test_mariadb_unindexed_ranges_get_min_max_and_the_sample_corrects_small_domains(
    mariadb_url: str,
) -> None:
    """A small MariaDB table gets min/max of its unindexed number and date columns (one
    pass), so a range on them has a width estimate (TPC-H Q10: a quarter of o_orderdate
    was estimated 13,356 orders for 5,677); an indexed category-like column takes the
    sample's distinct count when it is below InnoDB's estimate (c_nationkey: 50 for 25)."""
    import datetime as dt
    import decimal

    engine = sa.create_engine(mariadb_url)
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS stat_ranges")
        c.exec_driver_sql(
            "CREATE TABLE stat_ranges (id INT PRIMARY KEY, nation INT, day DATE, "
            "price DECIMAL(15,2), INDEX (nation))"
        )
        c.execute(
            sa.text("INSERT INTO stat_ranges VALUES (:i, :n, :d, :p)"),
            [
                {
                    "i": i,
                    "n": i % 25,
                    "d": dt.date(1992, 1, 1) + dt.timedelta(days=i % 2400),
                    "p": decimal.Decimal(i) / 4,
                }
                for i in range(20_000)
            ],
        )
        c.exec_driver_sql("ANALYZE TABLE stat_ranges")
    try:
        src = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url}).source("stat_ranges")
        st = src.statistics()
        assert (st.columns["day"].min, st.columns["day"].max) == (
            dt.date(1992, 1, 1),
            dt.date(1992, 1, 1) + dt.timedelta(days=2399),
        )
        assert (st.columns["price"].min, st.columns["price"].max) == (
            decimal.Decimal("0.00"),
            decimal.Decimal("4999.75"),
        )
        assert st.columns["nation"].distinct_count == 25
        from dsl.ast import Binary, Column, Literal, Param
        from fabric.plan.nodes import Scan

        scan = Scan("o", src.uri, src.schema())
        lo = Binary(">=", Column("day"), Param("d"))
        hi = Binary(
            "<", Column("day"), Binary("+", Param("d"), Literal(dt.timedelta(days=240), "interval"))
        )
        est = Estimator(scan, _Catalog(src)).scan_rows(
            Scan("o", src.uri, src.schema(), exact=(lo, hi))
        )
        assert 1_500 <= est <= 2_500  # 240 of 2,400 days: 2,000 rows
    finally:
        with engine.begin() as c:
            c.exec_driver_sql("DROP TABLE IF EXISTS stat_ranges")
        engine.dispose()
