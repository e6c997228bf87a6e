"""The CLI as a person meets it (issue 19): --version, examples in every --help, output
formats, JSON times in ISO 8601, --session JSON and @file, quiet closed pipes, one-line
errors without a traceback unless --debug, colours on a terminal only (a real pty), and
`fabric init` writing a scaffold that runs without any server."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from fabric.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path, **kw) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NO_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "fabric", *args], cwd=cwd, capture_output=True, env=env, **kw
    )


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("init") / "myfabric"
    assert main(["init", str(d)]) == 0
    return d


def test_init_writes_a_runnable_scaffold(scaffold, monkeypatch, capsys):
    assert sorted(p.name for p in scaffold.iterdir()) == [
        "README.md",
        "agents",
        "data",
        "fabric.yaml",
    ]
    monkeypatch.chdir(scaffold)
    assert main(["validate"]) == 0
    capsys.readouterr()
    assert main(["query", "top_products", "--session", "min_qty=2", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # reference: the same aggregation over the scaffold's files in DuckDB
    import duckdb

    ref = duckdb.sql(
        f"select p.name, p.category, sum(o.qty) as items, count(*) as orders "
        f"from '{scaffold}/data/orders.csv' o join '{scaffold}/data/products.parquet' p "
        "on p.id = o.product_id where o.qty >= 2 group by 1, 2 order by items desc limit 5"
    ).fetchall()
    assert [tuple(r.values()) for r in rows] == [tuple(r) for r in ref]
    assert main(["init", str(scaffold)]) == 2  # never overwrites without --force


def test_version_and_examples_in_every_help(tmp_path):
    out = _run("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.decode().startswith("fabric 0."), out
    for cmd in ([], ["validate"], ["explain"], ["query"], ["init"], ["demo"]):
        out = _run(*cmd, "--help", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "examples:" in out.stdout.decode(), cmd


@pytest.mark.parametrize("fmt", ["json", "ndjson", "csv", "arrow", "parquet"])
def test_output_formats(scaffold, fmt):
    out = _run("query", "top_products", "--session", "min_qty=2", "--format", fmt, cwd=scaffold)
    assert out.returncode == 0, out.stderr
    if fmt == "json":
        rows = json.loads(out.stdout)
    elif fmt == "ndjson":
        rows = [json.loads(line) for line in out.stdout.splitlines()]
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        rows = pacsv.read_csv(io.BytesIO(out.stdout)).to_pylist()
    elif fmt == "arrow":
        rows = ipc.open_stream(out.stdout).read_all().to_pylist()
    else:
        rows = pq.read_table(io.BytesIO(out.stdout)).to_pylist()
    assert len(rows) == 5 and rows[0]["name"] == "product 002", rows


def test_json_times_are_iso_8601_and_freshness_stats_on_request(scaffold):
    q = "from file://local/orders.csv as o where o.id = 1 select o.id, o.ordered_at"
    out = _run("query", "--text", q, "--format", "json", "--freshness", "--stats", cwd=scaffold)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    ts = doc["rows"][0]["ordered_at"]
    import datetime as dt

    assert dt.datetime.fromisoformat(ts).tzinfo is not None, ts
    assert "o" in doc["freshness"] and "sources" in doc["stats"]
    plain = json.loads(_run("query", "--text", q, "--format", "json", cwd=scaffold).stdout)
    assert isinstance(plain, list)  # without the flags: the rows alone


def test_session_json_and_at_file(scaffold, tmp_path):
    (scaffold / "agents" / "vec.yaml").write_text(
        "binding: vec_len\nsession:\n  v: vector[384]\n  ids: list[int]\n"
        "sources:\n  p:\n    from: file://local/products.parquet\n"
        "    where: id in {{session.ids}}\n"
        "select: [p.id, p.name]\norder_by: p.id\n"
    )
    try:
        vec = np.random.default_rng(1).standard_normal(384).astype(np.float32)
        np.save(tmp_path / "q.npy", vec)
        (tmp_path / "q.json").write_text(json.dumps(vec.tolist()))
        for ref in (f"@{tmp_path / 'q.npy'}", f"@{tmp_path / 'q.json'}"):
            out = _run(
                "query", "vec_len", "--session", f"v={ref}", "--session", "ids=[3, 1]",
                "--format", "json", cwd=scaffold,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            assert [r["id"] for r in json.loads(out.stdout)] == [1, 3]
        bad = _run("query", "vec_len", "--session", "v=@nope.npy", cwd=scaffold)
        assert bad.returncode != 0 and b"no such file" in bad.stderr
        assert b"Traceback" not in bad.stderr
    finally:
        (scaffold / "agents" / "vec.yaml").unlink()


def test_closed_pipe_exits_quietly(scaffold):
    q = "from file://local/orders.csv as o select o.id, o.qty"
    cmd = f"{sys.executable} -m fabric query --text '{q}' --format ndjson | head -2"
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        cwd=scaffold,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert len(out.stdout.splitlines()) == 2
    assert out.stderr == b"", out.stderr.decode()
    assert out.returncode == 0


def test_no_fabric_yaml_is_said_without_a_fake_position(tmp_path):
    out = _run("query", "anything", cwd=tmp_path)
    err = out.stderr.decode()
    assert out.returncode == 1
    assert "no fabric.yaml in" in err and "fabric.yaml:1:1" not in err, err
    assert "fabric init" in err


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(scaffold):
    (scaffold / "data" / "broken.parquet").write_bytes(b"not parquet at all")
    try:
        q = "from file://local/broken.parquet as b select b.x"
        out = _run("query", "--text", q, cwd=scaffold)
        assert out.returncode == 1
        assert b"Traceback" not in out.stderr, out.stderr.decode()
        dbg = _run("--debug", "query", "--text", q, cwd=scaffold)
        assert dbg.returncode != 0
    finally:
        (scaffold / "data" / "broken.parquet").unlink()


def _on_pty(args: list[str], cwd: Path) -> bytes:
    """Run the CLI with stdout and stderr on a pseudo-terminal; what the terminal shows."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", *args], cwd=cwd, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks)


def test_colours_on_a_terminal_and_none_in_a_pipe(scaffold):
    args = ["query", "top_products", "--session", "min_qty=2"]
    shown = _on_pty(args, scaffold)
    assert b"\x1b[1m" in shown and b"product 002" in shown, shown
    piped = _run(*args, cwd=scaffold)
    assert piped.returncode == 0 and b"\x1b[" not in piped.stdout + piped.stderr
    env_no = _run(*args, cwd=scaffold, input=None)
    assert b"\x1b[" not in env_no.stdout


def test_table_cells_show_times_in_iso_8601(scaffold, monkeypatch, capsys):
    monkeypatch.chdir(scaffold)
    q = "from file://local/orders.csv as o where o.id = 1 select o.ordered_at"
    assert main(["query", "--text", q]) == 0
    line = capsys.readouterr().out.splitlines()[2].strip()
    assert "T" in line and line.endswith("+00:00"), line
    assert pa  # imported for the readers above


def test_init_scaffold_can_be_moved(tmp_path):
    """`fabric init` writes a relative root (issue 19): the directory still runs after a
    move, from inside it and from elsewhere with --config."""
    first = tmp_path / "first"
    assert _run("init", str(first), cwd=tmp_path).returncode == 0
    assert str(tmp_path) not in (first / "fabric.yaml").read_text()
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    first.rename(moved)
    query = ("query", "top_products", "--session", "min_qty=2", "--format", "json")
    inside = _run(*query, cwd=moved)
    assert inside.returncode == 0, inside.stderr.decode()
    outside = _run(*query, "--config", str(moved / "fabric.yaml"), cwd=tmp_path)
    assert outside.returncode == 0, outside.stderr.decode()
    assert json.loads(inside.stdout) == json.loads(outside.stdout)
    assert len(json.loads(inside.stdout)) == 5
