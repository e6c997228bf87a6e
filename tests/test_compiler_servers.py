"""Bindings compiled against a live catalog: real MariaDB schemas, real errors."""

from __future__ import annotations

from pathlib import Path

import pytest

import fabric
from dsl.errors import DslError


@pytest.fixture
def shop(mariadb_url: str, tmp_path: Path) -> Path:
    import sqlalchemy as sa

    engine = sa.create_engine(mariadb_url)
    with engine.begin() as con:
        con.exec_driver_sql("DROP TABLE IF EXISTS bind_merchants")
        con.exec_driver_sql("DROP TABLE IF EXISTS bind_orders")
        con.exec_driver_sql(
            "CREATE TABLE bind_merchants (id INT PRIMARY KEY, name VARCHAR(50), status VARCHAR(10), rating DOUBLE)"
        )
        con.exec_driver_sql(
            "CREATE TABLE bind_orders (id INT PRIMARY KEY, merchant_id INT, amount DOUBLE)"
        )
        con.exec_driver_sql(
            "INSERT INTO bind_merchants VALUES (1, 'a', 'active', 4.5), (2, 'b', 'closed', 3.0), "
            "(3, 'c', 'active', 2.0)"
        )
        con.exec_driver_sql(
            "INSERT INTO bind_orders VALUES (10, 1, 5.0), (11, 1, 7.0), (12, 3, 1.0)"
        )
    engine.dispose()
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(
        f'connections:\n  shop: {{kind: mysql, url: "{mariadb_url}"}}\nbindings: [agents/]\n'
    )
    return tmp_path


def test_live_schema_errors_list_what_exists(shop: Path) -> None:
    with fabric.open(shop / "fabric.yaml", watch=False, ingest=False) as fab:
        with pytest.raises(DslError) as info:
            fab.compile_text("from mysql://shop/bind_merchant as m select m.name")
        text = info.value.format()
        assert "<text>:1:6: mysql://shop/bind_merchant does not exist" in text
        assert "did you mean 'bind_merchants'?" in text and "bind_orders" in text
        with pytest.raises(DslError, match=r"cannot compare m\.rating \(float\) with .x. \(str\)"):
            fab.compile_text(
                "from mysql://shop/bind_merchants as m where m.rating > 'x' select m.name"
            )


def test_live_binding_compiles_and_runs(shop: Path) -> None:
    (shop / "agents" / "spend.yaml").write_text("""\
binding: spend
session: {min_rating: float}
sources:
  m:
    from: mysql://shop/bind_merchants
    where: status = 'active' and rating >= {{session.min_rating}}
  o:
    from: mysql://shop/bind_orders
    join: o.merchant_id = m.id
select: [m.name, sum(o.amount) as total]
group_by: [m.name]
order_by: total desc
""")
    with fabric.open(shop / "fabric.yaml", watch=False, ingest=False) as fab:
        assert fab.validate() == []
        logical = fab.explain("spend", optimized=False)
        assert "Scan: m <- mysql://shop/bind_merchants" in logical
        res = fab.query("spend", session={"min_rating": 1.0})
        assert res.table.to_pylist() == [{"name": "a", "total": 12.0}, {"name": "c", "total": 1.0}]
