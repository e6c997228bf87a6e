"""SQLite (the demo's stand-in for MySQL): string filters push down when the table compares
text bytewise, as Arrow does, and stay in the fabric when a collation says otherwise."""

from __future__ import annotations

import sqlalchemy as sa

import fabric


def _fabric(tmp_path, ddl: str):
    db = tmp_path / "t.db"
    eng = sa.create_engine(f"sqlite:///{db}")
    with eng.begin() as c:
        c.execute(sa.text(ddl))
        c.execute(sa.text("INSERT INTO t VALUES (1, 'a'), (2, 'A'), (3, 'b'), (4, 'a ')"))
    eng.dispose()
    (tmp_path / "fabric.yaml").write_text(
        f'connections:\n  db: {{kind: sql, url: "sqlite:///{db}"}}\n'
    )
    return fabric.open(tmp_path / "fabric.yaml")


def _ids(fab, where: str) -> tuple[list[int], int]:
    """The ids the fabric answers, and how many rows it fetched from SQLite."""
    res = fab.query_text(f"from mysql://db/t as t where {where} select t.id order by t.id")
    return res.table.column("id").to_pylist(), res.stats["sources"]["t"]["rows"]


def test_binary_text_equality_and_in(tmp_path):
    with _fabric(tmp_path, "CREATE TABLE t (id INTEGER PRIMARY KEY, s VARCHAR(8))") as fab:
        assert _ids(fab, "t.s = 'a'") == ([1], 1)  # pushed: one row fetched
        assert _ids(fab, "t.s in ('A', 'b')") == ([2, 3], 2)
        assert _ids(fab, "t.s > 'a'") == ([3, 4], 2)
        # SQLite's LIKE folds ASCII case: kept in the fabric, case-sensitive as documented
        assert _ids(fab, "t.s like 'a%'")[0] == [1, 4]


def test_nocase_collation_is_not_trusted(tmp_path):
    ddl = "CREATE TABLE t (id INTEGER PRIMARY KEY, s VARCHAR(8) COLLATE NOCASE)"
    with _fabric(tmp_path, ddl) as fab:
        assert _ids(fab, "t.s = 'a'") == ([1], 4)  # SQLite alone would say [1, 2]
        assert _ids(fab, "t.s in ('A')") == ([2], 4)
