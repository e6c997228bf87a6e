"""A long integer key list (a dynamic filter's keys, a session list) goes to MariaDB as
one JSON parameter, ``x IN (SELECT k FROM JSON_TABLE(...))``, not as one placeholder per
key (TPC-H Q9's 29,020 order keys: 1.6-2.8 s as placeholders, ~0.7-1.1 s so); the rows
are the same as the fabric's own ``in`` over the same table, with NULLs in the column
and the list, duplicates, negative and 64-bit keys, and ``not in``."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import sqlalchemy as sa

from connectors.base import ScanRequest
from connectors.sql import JSON_KEYS, SqlConnection
from dsl.ast import Column, InList, Param

BIG = (1 << 62) + 7


@pytest.fixture
def keyed(mariadb_url: str):
    engine = sa.create_engine(mariadb_url)
    rng = random.Random(5)
    ids = [rng.randrange(-5000, 5000) for _ in range(6000)] + [BIG, -BIG]
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS key_lists")
        c.exec_driver_sql("CREATE TABLE key_lists (n INT PRIMARY KEY, id BIGINT, v VARCHAR(8))")
        c.execute(
            sa.text("INSERT INTO key_lists VALUES (:n, :i, :v)"),
            [{"n": n, "i": None if n % 17 == 0 else i, "v": f"v{n}"} for n, i in enumerate(ids)],
        )
    conn = SqlConnection("shop", {"kind": "mysql", "url": mariadb_url})
    yield conn.source("key_lists")
    conn.close()
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE IF EXISTS key_lists")
    engine.dispose()


@pytest.mark.parametrize("negated", [False, True], ids=["in", "not in"])
@pytest.mark.parametrize("with_null", [False, True], ids=["keys", "keys and NULL"])
def test_a_long_key_list_gives_the_rows_of_the_fabrics_own_in(keyed, negated, with_null) -> None:
    rng = random.Random(7)
    keys = [rng.randrange(-6000, 6000) for _ in range(3 * JSON_KEYS)] + [BIG, BIG, 3, 3]
    if with_null:
        keys.append(None)
    req = ScanRequest(
        columns=("n", "id"),
        filters=(InList(Column("id"), Param("ks"), negated=negated),),
        params={"ks": keys},
    )
    batches = list(keyed.scan(req))
    got = pa.Table.from_batches(batches) if batches else pa.table({"n": pa.array([], pa.int32())})
    sent = req.metrics.as_dict().get("statement", "")
    assert "JSON_TABLE" in sent, sent
    every = pa.Table.from_batches(list(keyed.scan(ScanRequest(columns=("n", "id")))))
    mask = pc.is_in(every.column("id"), value_set=pa.array([k for k in keys if k is not None]))
    if negated:
        mask = pc.invert(mask)
        if with_null:  # x not in (..., NULL) is never true
            mask = pc.and_(mask, pa.scalar(False))
    want = every.filter(pc.and_(mask, pc.is_valid(every.column("id"))))
    assert sorted(got.column("n").to_pylist()) == sorted(want.column("n").to_pylist())


def test_a_short_list_stays_placeholders(keyed) -> None:
    req = ScanRequest(
        columns=("n",), filters=(InList(Column("id"), Param("ks")),), params={"ks": [1, 2, 3]}
    )
    list(keyed.scan(req))
    assert "JSON_TABLE" not in req.metrics.as_dict().get("statement", "")
