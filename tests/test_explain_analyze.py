"""explain(analyze=True) runs every plan that query() runs, and counts what each join made.

The per-join counts re-run part of the DuckDB query; they once sent the whole parameter list
to a query that used a subset of it (a literal in an aggregate, in order_by, in a session
filter above a join) and crashed on plans that ran fine."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

import fabric
from fabric.execute.sql import used_params

CONFIG = """\
connections:
  shop:
    kind: memory
    schemas:
      merchants: {id: int, name: str, tier: str}
      orders: {id: int, merchant_id: int, amount: float}
bindings: [agents/]
"""

BINDING = """\
binding: b
session: {min: float}
sources:
  o:
    from: memory://shop/orders
    where: amount > {{session.min}}
  m:
    from: memory://shop/merchants
    join: m.id = o.merchant_id
select: [m.name, sum(o.amount * 2) as total, count(*) as n]
group_by: [m.name, m.tier]
order_by: [m.tier = 'premium' desc, m.name]
"""

MERCHANTS = pa.table(
    {"id": [1, 2, 3], "name": ["a", "b", "c"], "tier": ["premium", "basic", "premium"]}
)
ORDERS = pa.table({"id": [1, 2, 3, 4], "merchant_id": [1, 2, 3, 1], "amount": [1.0, 5.0, 7.0, 9.0]})


@pytest.fixture
def fab(tmp_path: Path):
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    (tmp_path / "agents" / "b.yaml").write_text(BINDING)
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.catalog.connection("shop").add("merchants", MERCHANTS)
        f.catalog.connection("shop").add("orders", ORDERS)
        f.catalog.refresh()
        yield f


def test_analyze_of_a_join_with_literals_and_session_values(fab) -> None:
    ref = duckdb.sql(
        """SELECT m.name, sum(o.amount * 2) AS total, count(*) AS n
           FROM ORDERS o JOIN MERCHANTS m ON m.id = o.merchant_id WHERE o.amount > 2.0
           GROUP BY m.name, m.tier ORDER BY m.tier = 'premium' DESC, m.name"""
    ).fetchall()
    res = fab.query("b", session={"min": 2.0})
    assert [tuple(r.values()) for r in res.table.to_pylist()] == ref
    text = fab.explain("b", session={"min": 2.0}, analyze=True)
    # the join's actual row count is there: 3 orders above 2.0, each with its merchant
    join = next(line for line in text.splitlines() if "Join:" in line)
    assert "rows=3" in join, text


def test_used_params_renumbers_and_skips_quoted_text() -> None:
    sql = """SELECT "a$1", '$2' AS s, x + $3 FROM t WHERE y = $5 AND z = $3"""
    out, values = used_params(sql, ["v1", "v2", "v3", "v4", "v5"])
    assert out == """SELECT "a$1", '$2' AS s, x + $1 FROM t WHERE y = $2 AND z = $1"""
    assert values == ["v3", "v5"]


def test_used_params_keeps_a_whole_query_without_tokenizing_it(monkeypatch) -> None:
    """Every DuckDB query of the executor went through the quote-aware tokenizer (0.2-5 ms
    a TPC-H query on a loaded machine); a query using each bound value once is kept as
    is after a scan for ``$`` alone, and a subset query still gets renumbered."""
    import fabric.execute.sql as sqlmod

    whole = """SELECT "a.x" FROM t WHERE "a.y" = $2 AND "a.z" IN ($1, $3)"""

    class Boom:
        def sub(self, *a: object) -> str:
            raise AssertionError("tokenized a whole query")

    monkeypatch.setattr(sqlmod, "_TOKENS", Boom())
    out, values = used_params(whole, ["v1", "v2", "v3"])
    assert out is whole and values == ["v1", "v2", "v3"]
    monkeypatch.undo()
    out, values = used_params("SELECT $3 FROM t", ["v1", "v2", "v3"])
    assert out == "SELECT $1 FROM t" and values == ["v3"]
