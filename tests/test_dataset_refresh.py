"""Datasets materialized from tables, collections and files (issue 14, finding 10), against
the real servers: ``from: file://`` / ``s3://`` / ``mysql://`` / ``mongo://`` with ``refresh:``
(full, append by a cursor column, Mongo change streams, a schedule), checkpointed in the
dataset's state directory; upserted datasets persisted so another process (the CLI) sees
them; freshness of a refreshed dataset is its refresh watermark against the source's."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

import fabric


def write_fabric(tmp_path: Path, connections: str, datasets: str, bindings: str = "") -> Path:
    (tmp_path / "agents").mkdir(exist_ok=True)
    if bindings:
        (tmp_path / "agents" / "b.yaml").write_text(textwrap.dedent(bindings))
    body = (
        "connections:\n"
        + textwrap.indent(textwrap.dedent(connections).strip(), "  ")
        + "\ndatasets:\n"
        + textwrap.indent(textwrap.dedent(datasets).strip(), "  ")
        + "\nbindings: [agents/]\n"
    )
    cfg = tmp_path / "fabric.yaml"
    cfg.write_text(body)
    return cfg


def ids(fab, name: str) -> list:
    return sorted(fab.dataset(name).to_table(["id"]).column("id").to_pylist())


def test_file_csv_dataset_is_loaded_refreshed_and_checked(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    csv = data / "items.csv"
    pacsv.write_csv(pa.table({"id": [1, 2, 3], "name": ["a", "b", "c"]}), csv)
    cfg = write_fabric(
        tmp_path,
        f"files: {{kind: file, root: {data}}}",
        """
        items:
          from: file://files/items.csv
          key: id
          schema: {id: int, name: str}
        """,
        """
        binding: all_items
        sources:
          i: {from: "dataset://items", freshness: {max_lag: 1h, on_stale: flag}}
        select: [i.id, i.name]
        """,
    )
    with fabric.open(cfg, watch=False) as fab:
        assert ids(fab, "items") == [1, 2, 3]  # it used to stay empty
        res = fab.query("all_items")
        assert res.table.num_rows == 3
        assert res.freshness["i"]["status"] == "fresh"
        assert res.freshness["i"]["lag_seconds"] == 0.0  # the file is older than the refresh
        time.sleep(1.1)
        pacsv.write_csv(pa.table({"id": [2, 3, 4], "name": ["b", "C", "d"]}), csv)
        f = fab.query("all_items").freshness["i"]
        assert f["lag_seconds"] > 0  # the file changed after the last refresh
        out = fab.refresh("items")
        assert out["rows_read"] == 3 and out["deleted"] == 1
        assert ids(fab, "items") == [2, 3, 4]
        assert fab.dataset("items").get(3)["name"] == "C"
        assert fab.query("all_items").freshness["i"]["lag_seconds"] == 0.0
        served = fab.freshness()["sources"]["items"]  # /v1/freshness
        assert served["lag_seconds"] == 0.0 and served["last_error"] is None, served
    # a missing file is a positioned validate error (it used to pass and stay empty)
    cfg.write_text(cfg.read_text().replace("items.csv", "itemz.csv"))
    out = subprocess.run(
        [sys.executable, "-m", "fabric", "validate", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stdout
    assert "fabric.yaml:5:11:" in out.stdout and "existing files: items.csv" in out.stdout, (
        out.stdout
    )


def test_mariadb_append_by_cursor_survives_a_reopen(tmp_path, mariadb_url):
    import sqlalchemy as sa

    table = f"d_items_{int(time.time() * 1000) % 10**9}"
    eng = sa.create_engine(mariadb_url)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    with eng.begin() as c:
        c.execute(
            sa.text(f"create table {table} (id int primary key, v int, updated_at datetime(6))")
        )
        c.execute(
            sa.text(f"insert into {table} values (:i, :v, :t)"),
            [{"i": i, "v": i, "t": t0 + dt.timedelta(seconds=i)} for i in range(10)],
        )
    try:
        cfg = write_fabric(
            tmp_path,
            f'shop: {{kind: mysql, url: "{mariadb_url}"}}',
            f"""
            items:
              from: mysql://shop/{table}
              key: id
              schema: {{id: int, v: int, updated_at: timestamp}}
              refresh: {{mode: append, cursor: updated_at, every: 1h}}
            """,
        )
        with fabric.open(cfg, watch=False) as fab:
            assert ids(fab, "items") == list(range(10))
        with eng.begin() as c:
            c.execute(
                sa.text(f"insert into {table} values (:i, :v, :t)"),
                [{"i": i, "v": i, "t": t0 + dt.timedelta(seconds=i)} for i in range(10, 15)],
            )
            c.execute(sa.text(f"update {table} set v = 100, updated_at = :t where id = 3"),
                      {"t": t0 + dt.timedelta(seconds=20)})  # fmt: skip
        # reopen: the checkpoint holds the rows and the cursor (not due: every 1h)
        with fabric.open(cfg, watch=False) as fab:
            r = fab.service.manager.refreshers["items"]
            assert r.refreshes == 0 and ids(fab, "items") == list(range(10))
            out = fab.refresh("items")
            assert out["pushed_cursor"] is True
            assert out["rows_read"] == 7  # the boundary row 9, rows 10-14 and the updated row 3
            assert ids(fab, "items") == list(range(15))
            assert fab.dataset("items").get(3)["v"] == 100
    finally:
        with eng.begin() as c:
            c.execute(sa.text(f"drop table if exists {table}"))


def test_s3_parquet_full_refresh_on_a_schedule(tmp_path, s3):
    key = f"refresh/items-{time.time_ns()}.parquet"
    pq.write_table(
        pa.table({"id": [1, 2, 3], "v": [1.0, 2.0, 3.0]}), s3.path(key), filesystem=s3.fs
    )
    cfg = write_fabric(
        tmp_path,
        f"""
        lake: {{kind: s3, endpoint: "{s3.endpoint}", bucket: {s3.bucket},
                access_key: {s3.access_key}, secret_key: {s3.secret_key}, region: us-east-1}}
        """,
        f"""
        items:
          from: s3://lake/{key}
          key: id
          schema: {{id: int, v: float}}
          refresh: {{mode: full, every: 1s}}
        """,
    )
    with fabric.open(cfg, watch=False) as fab:
        assert ids(fab, "items") == [1, 2, 3]
        pq.write_table(pa.table({"id": [1, 5], "v": [10.0, 5.0]}), s3.path(key), filesystem=s3.fs)
        deadline = time.monotonic() + 30
        while ids(fab, "items") != [1, 5] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ids(fab, "items") == [1, 5]
        assert fab.dataset("items").get(1)["v"] == 10.0


def test_mongo_change_stream_applies_inserts_updates_deletes(tmp_path, mongo_url, mongo_db):
    coll = mongo_db[f"d_items_{time.time_ns()}"]
    coll.insert_many([{"_id": f"k{i}", "v": i} for i in range(3)])
    db = mongo_db.name
    cfg = write_fabric(
        tmp_path,
        f'crm: {{kind: mongo, url: "{mongo_url}", database: {db}}}',
        f"""
        items:
          from: mongo://crm/{coll.name}
          key: _id
          schema: {{_id: str, v: int}}
          refresh: {{mode: changes}}
        """,
    )

    def keys(fab) -> list:
        return sorted(fab.dataset("items").to_table(["_id"]).column("_id").to_pylist())

    def until(cond) -> bool:
        deadline = time.monotonic() + 30
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.1)
        return cond()

    with fabric.open(cfg, watch=False) as fab:
        assert keys(fab) == ["k0", "k1", "k2"]
        time.sleep(0.5)  # the change stream is open
        coll.insert_one({"_id": "k9", "v": 9})
        coll.update_one({"_id": "k1"}, {"$set": {"v": 100}})
        coll.delete_one({"_id": "k0"})
        assert until(lambda: keys(fab) == ["k1", "k2", "k9"]), keys(fab)
        assert until(lambda: fab.dataset("items").get("k1")["v"] == 100)


def test_upserts_are_persisted_and_the_cli_sees_them(tmp_path):
    cfg = write_fabric(
        tmp_path,
        "mem: {kind: memory}",
        """
        notes:
          key: id
          schema: {id: int, body: str}
        """,
        """
        binding: all_notes
        sources:
          n: {from: "dataset://notes"}
        select: [n.id, n.body]
        """,
    )
    with fabric.open(cfg, watch=False) as fab:
        fab.dataset("notes").upsert(pa.table({"id": [1, 2], "body": ["x", "y"]}))
    with fabric.open(cfg, watch=False) as fab:  # a reopen sees them
        assert ids(fab, "notes") == [1, 2]
        fab.dataset("notes").delete([1])
    out = subprocess.run(
        [sys.executable, "-m", "fabric", "query", "all_notes", "--format", "json",
         "--config", str(cfg)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"id": 2, "body": "y"}]  # it used to print []
