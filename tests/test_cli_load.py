"""`fabric load` / `fabric materialize` (issue 19): a dataset filled from a Parquet, CSV or
JSON-lines file (vectors from .npy), from a source on the real servers, or from a binding;
every row is checked against the declared schema before anything is written (errors name
the column, the file and its line), and a failure leaves the dataset as it was."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

import fabric
from fabric.cli import main

N = 2_500


def orders(n: int = N) -> pa.Table:
    rng = np.random.default_rng(3)
    return pa.table(
        {
            "id": pa.array(range(1, n + 1), pa.int64()),
            "sku": [f"{i % 97:03d}" for i in range(n)],  # leading zeros: a str, not an int
            "qty": pa.array(rng.integers(1, 9, n), pa.int64()),
        }
    )


DATASETS = """\
  orders:
    key: id
    schema: {id: int, sku: str, qty: int}
    indexes: {qty: btree}
  docs:
    key: id
    schema:
      id: int
      title: str
      embedding: vector[4]
    indexes: {embedding: hnsw}
"""


def write_fabric(d: Path, connections: str = "", extra: str = "") -> Path:
    """fabric.yaml in ``d``: a file connection on data/, ``connections`` and ``extra``
    (lines at the indentation of connections: and datasets: entries)."""
    (d / "agents").mkdir(parents=True, exist_ok=True)
    (d / "data").mkdir(exist_ok=True)
    (d / "fabric.yaml").write_text(
        "connections:\n  local: {kind: file, root: data}\n"
        + (f"  {connections}\n" if connections else "")
        + "datasets:\n"
        + DATASETS
        + textwrap.indent(textwrap.dedent(extra).strip() + "\n", "  ")
        + "bindings: [agents/]\n"
    )
    return d / "fabric.yaml"


def table_of(cfg: Path, name: str, cols: list[str]) -> pa.Table:
    """The dataset as a new process sees it (from its checkpoint)."""
    with fabric.open(cfg, ingest=False, watch=False) as fab:
        return fab.dataset(name).to_table(cols).sort_by("id")


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    write_fabric(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_load_parquet_then_csv_upserts_and_persists(here, capsys):
    t = orders()
    pq.write_table(t, here / "data" / "orders.parquet")
    assert main(["load", "orders", "data/orders.parquet"]) == 0
    out = capsys.readouterr().out
    assert f"loaded {N:,} rows into dataset orders from data/orders.parquet" in out
    assert table_of(here / "fabric.yaml", "orders", ["id", "sku", "qty"]).equals(t)
    # a CSV of new versions of 100 rows: upserted by the key; "007" stays a string
    upd = t.slice(0, 100).set_column(2, "qty", pa.array([100] * 100, pa.int64()))
    pacsv.write_csv(upd, here / "new.csv")
    assert main(["load", "orders", "new.csv"]) == 0
    got = table_of(here / "fabric.yaml", "orders", ["id", "sku", "qty"])
    assert got.num_rows == N
    assert got.column("qty").to_pylist()[:100] == [100] * 100
    assert got.column("sku").to_pylist() == t.column("sku").to_pylist()


def test_a_bad_row_loads_nothing_and_names_file_line_column(here, capsys):
    pq.write_table(orders(10), here / "data" / "orders.parquet")
    assert main(["load", "orders", "data/orders.parquet"]) == 0
    lines = ["id,sku,qty"] + [f"{i},s{i},{i % 5}" for i in range(100, 1600)]
    lines[1234] = "1333,s1333,three"  # data row 1234 (line 1235 of the file)
    (here / "bad.csv").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["load", "orders", "bad.csv", "--batch-rows", "100"]) == 1
    err = capsys.readouterr().err
    assert "bad.csv:1235:12: row 1,234, column 'qty': 'three' is not an int" in err, err
    assert "1333,s1333,three" in err  # the line, underlined
    assert "nothing was loaded" in err and "schema (fabric.yaml:4:3)" in err
    assert table_of(here / "fabric.yaml", "orders", ["id"]).num_rows == 10  # as before


def test_columns_that_do_not_match_the_schema(here, capsys):
    pacsv.write_csv(pa.table({"id": [1], "qty": [2], "note": ["x"]}), here / "odd.csv")
    assert main(["load", "orders", "odd.csv"]) == 1
    err = capsys.readouterr().err
    assert "odd.csv has no column 'sku' (str), declared in the schema of dataset orders" in err
    assert "odd.csv has column 'note', which is not in the schema of dataset orders" in err
    assert "fabric.yaml:" in err  # where the dataset is declared
    pacsv.write_csv(pa.table({"id": [1], "sku": ["a"], "qty": [2], "note": ["x"]}), here / "x.csv")
    assert main(["load", "orders", "x.csv"]) == 1
    assert main(["load", "orders", "x.csv", "--ignore-extra"]) == 0
    assert table_of(here / "fabric.yaml", "orders", ["id"]).num_rows == 1


def test_jsonl_with_vectors_from_npy(here, capsys):
    rows = [{"id": i, "title": f"doc {i}"} for i in range(50)]
    (here / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vecs = np.random.default_rng(1).random((50, 4), dtype=np.float32)
    np.save(here / "emb.npy", vecs)
    assert main(["load", "docs", "docs.jsonl", "--vectors", "embedding=emb.npy"]) == 0
    cfg = here / "fabric.yaml"
    with fabric.open(cfg, ingest=False, watch=False) as fab:
        ds = fab.dataset("docs")
        assert ds.count() == 50
        got = np.array(ds.to_table(["id", "embedding"]).sort_by("id").column(1).to_pylist())
        assert np.allclose(got, vecs)
    np.save(here / "short.npy", vecs[:49])
    capsys.readouterr()
    assert main(["load", "docs", "docs.jsonl", "--vectors", "embedding=short.npy"]) == 1
    assert "a 49 x 4 array; docs.jsonl has 50 rows" in capsys.readouterr().err
    # a vector of the wrong size inline: its line and column
    bad = [*rows[:7], {"id": 7, "title": "t", "embedding": [1, 2, 3]}]
    good = [{**r, "embedding": [0.0, 1.0, 2.0, 3.0]} for r in rows[:7]]
    (here / "inline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*good, bad[-1]]))
    assert main(["load", "docs", "inline.jsonl"]) == 1
    err = capsys.readouterr().err
    assert (
        "inline.jsonl:8:" in err and "column 'embedding': [1.0, 2.0, 3.0] is 3 values, not 4" in err
    )
    assert table_of(cfg, "docs", ["id"]).num_rows == 50


def test_load_refuses_a_dataset_fed_from_a_source(tmp_path, monkeypatch, capsys):
    pq.write_table(orders(5), tmp_path / "o.parquet")
    write_fabric(
        tmp_path,
        extra="""
        mirrored:
          from: file://local/o.parquet
          key: id
          schema: {id: int, sku: str, qty: int}
        """,
    )
    pq.write_table(orders(5), tmp_path / "data" / "o.parquet")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["load", "mirrored", "o.parquet"])
    assert "fabric materialize mirrored" in str(info.value)
    assert main(["load", "nope", "o.parquet"]) == 1
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    # materialize refreshes it from its file
    pq.write_table(orders(8), tmp_path / "data" / "o.parquet")
    assert main(["materialize", "mirrored"]) == 0
    assert "refreshed dataset mirrored from file://local/o.parquet: 8 rows read" in (
        capsys.readouterr().out
    )


def test_load_and_materialize_from_mariadb(tmp_path, monkeypatch, capsys, mariadb_url):
    import sqlalchemy as sa

    eng = sa.create_engine(mariadb_url)
    t = orders(1_200)
    with eng.begin() as con:
        con.exec_driver_sql("DROP TABLE IF EXISTS load_orders")
        con.exec_driver_sql(
            "CREATE TABLE load_orders (id BIGINT PRIMARY KEY, sku VARCHAR(8), qty BIGINT)"
        )
        con.execute(sa.text("INSERT INTO load_orders VALUES (:id, :sku, :qty)"), t.to_pylist())
    eng.dispose()
    write_fabric(tmp_path, connections=f'shop: {{kind: mysql, url: "{mariadb_url}"}}')
    (tmp_path / "agents" / "big.yaml").write_text(
        textwrap.dedent(
            """
            binding: big_orders
            session: {min_qty: int}
            sources:
              o: {from: mysql://shop/load_orders, where: "qty >= {{session.min_qty}}"}
            select: [o.id, o.sku, o.qty]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    assert main(["load", "orders", "mysql://shop/load_orders"]) == 0
    assert "loaded 1,200 rows into dataset orders from mysql://shop/load_orders" in (
        capsys.readouterr().out
    )
    assert table_of(tmp_path / "fabric.yaml", "orders", ["id", "sku", "qty"]).equals(t)
    # a binding's rows into a dataset: the same rows as the filter over the table
    (tmp_path / "fabric.yaml").write_text(
        (tmp_path / "fabric.yaml")
        .read_text()
        .replace(
            "bindings:", "  big:\n    key: id\n    schema: {id: int, sku: str, qty: int}\nbindings:"
        )
    )
    argv = ["materialize", "big", "--binding", "big_orders", "--session", "min_qty=7"]
    assert main(argv) == 0
    got = table_of(tmp_path / "fabric.yaml", "big", ["id", "qty"])
    ref = t.filter(pa.compute.greater_equal(t["qty"], 7)).select(["id", "qty"])
    assert got.equals(ref) and got.num_rows > 0


def test_help_has_examples(capsys):
    for cmd in ("load", "materialize"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "examples:" in out and f"fabric {cmd} " in out


def test_materialize_catches_a_kafka_dataset_up(
    tmp_path, monkeypatch, capsys, kafka_bootstrap, new_topic
):
    from confluent_kafka import Producer

    topic = new_topic(partitions=2, prefix="load")
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3_000):
        p.produce(topic, key=str(i), value=json.dumps({"id": i, "sku": f"s{i}", "qty": i % 4}))
    assert p.flush(30) == 0
    write_fabric(
        tmp_path,
        connections=f'bus: {{kind: kafka, bootstrap: "{kafka_bootstrap}"}}',
        extra=f"""
        feed:
          from: kafka://bus/{topic}
          key: id
          schema: {{id: int, sku: str, qty: int}}
        """,
    )
    monkeypatch.chdir(tmp_path)
    assert main(["materialize", "feed", "--catch-up", "60"]) == 0
    out = capsys.readouterr().out
    assert f"dataset feed caught up with kafka://bus/{topic}: 3,000 rows, lag 0 messages" in out
    assert table_of(tmp_path / "fabric.yaml", "feed", ["id"]).num_rows == 3_000  # checkpointed
    with pytest.raises(SystemExit) as info:
        main(["load", "feed", "x.csv"])
    assert "fed continuously" in str(info.value)


def test_progress_is_rich_on_a_terminal_and_plain_in_a_pipe(here):
    import os
    import pty
    import select
    import subprocess
    import sys

    pq.write_table(orders(), here / "o.parquet")
    cmd = [sys.executable, "-m", "fabric", "load", "orders", "o.parquet", "--batch-rows", "50"]
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120", "PYTHONUNBUFFERED": "1"}
    env.pop("NO_COLOR", None)
    piped = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b[" not in piped.stderr + piped.stdout
    assert "... loading orders from o.parquet" in piped.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=here, env=env, stdin=follower, stdout=follower,
                            stderr=follower)  # fmt: skip
    os.close(follower)
    chunks = []
    while select.select([leader], [], [], 120)[0]:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the command closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in text and f"/{N}" in text  # rich's bar with its count of rows
    assert "... loading" not in text


def test_a_failed_checkpoint_keeps_nothing(here, capsys):
    """Another process holds the dataset's state directory (fabric serve): the rows are
    written in memory, the checkpoint is refused, and nothing is saved."""
    pq.write_table(orders(10), here / "o.parquet")
    assert main(["load", "orders", "o.parquet"]) == 0
    pq.write_table(orders(), here / "more.parquet")
    with fabric.open(here / "fabric.yaml", ingest=False, watch=False) as holder:
        holder.service.manager.save("orders")  # takes the state directory's lock
        capsys.readouterr()
        assert main(["load", "orders", "more.parquet", "--batch-rows", "500"]) == 1
        err = capsys.readouterr().err
        assert "another process holds" in err
        assert f"{N:,} of {N:,} rows had been written when it failed; nothing was saved" in err
    assert table_of(here / "fabric.yaml", "orders", ["id"]).num_rows == 10
