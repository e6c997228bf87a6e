"""The fabric CLI: validate output format and exit codes, explain, query."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from fabric.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "dsl"

CONFIG = """\
connections:
  shop:
    kind: memory
    schemas:
      merchants: {id: int, name: str, status: str}
bindings: [agents/]
"""
GOOD = """\
binding: active
session: {min_id: int}
sources:
  m:
    from: memory://shop/merchants
    where: status = 'active' and id >= {{session.min_id}}
select: [m.name]
"""
BAD = """\
binding: broken
sources:
  m:
    from: memory://shop/merchants
    where: stauts = 'active'
select: [m.name]
"""


@pytest.fixture
def root(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    (tmp_path / "agents" / "active.yaml").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_validate_ok(root: Path, capsys) -> None:
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 1 binding valid")


def test_validate_reports_file_line_col_with_underline(root: Path, capsys) -> None:
    (root / "agents" / "broken.yaml").write_text(BAD)
    assert main(["validate"]) == 1
    out = capsys.readouterr().out.splitlines()
    i = out.index("agents/broken.yaml:5:12: unknown column 'stauts' in source 'm'")
    assert out[i + 1] == "        where: stauts = 'active'"
    assert out[i + 2] == "               ^^^^^^"
    assert out[i + 3].startswith("  hint: did you mean 'status'?")


def test_validate_given_paths_without_config_checks_syntax(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(
        GOOD.replace("binding: active", "binding: b").replace("= 'active'", "= = 'x'")
    )
    assert main(["validate", "a.yaml"]) == 0
    assert "syntax only" in capsys.readouterr().out
    assert main(["validate", "a.yaml", "b.yaml"]) == 1
    out = capsys.readouterr().out
    assert "b.yaml:6:21: unexpected '=' in where" in out


def test_validate_offline_fixture_catalog(capsys) -> None:
    rc = main(["validate", "--offline", "--config", str(FIXTURES / "fabric.yaml")])
    assert rc == 0, capsys.readouterr().out
    assert "offline (declared schemas)" in capsys.readouterr().out


def test_validate_broken_config(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fabric.yaml").write_text("conections: {}\n")
    assert main(["validate"]) == 1
    assert "fabric.yaml:1:1: unknown key 'conections'" in capsys.readouterr().out


def test_explain_with_session(root: Path, capsys) -> None:
    assert main(["explain", "active", "--session", "min_id=3", "--logical"]) == 0
    out = capsys.readouterr().out
    assert "Filter: m.status = 'active' and m.id >= {{session.min_id}}" in out
    assert main(["explain", "active", "--session", "min_id=abc"]) == 1
    assert "expected int, got str 'abc'" in capsys.readouterr().err
    assert main(["explain", "nope"]) == 1
    assert "unknown binding 'nope'" in capsys.readouterr().err


def test_query_json_and_table(root: Path, capsys, monkeypatch) -> None:
    import fabric.api as api

    real_open = api.open

    def open_with_data(*a, **kw):
        fab = real_open(*a, **kw)
        fab.catalog.connection("shop").add(
            "merchants",
            pa.table({"id": [1, 5], "name": ["low", "high"], "status": ["active", "active"]}),
        )
        fab.catalog.refresh()
        return fab

    monkeypatch.setattr("fabric.open", open_with_data)
    assert main(["query", "active", "--session", "min_id=2", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "high"}]
    assert (
        main(["query", "--text", "from memory://shop/merchants as m select m.name order by m.name"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0].strip() == "name" and "(2 rows)" in out


def test_python_dash_m_exit_codes(root: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "fabric", "validate"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert ok.returncode == 0, ok.stderr
    (root / "agents" / "broken.yaml").write_text(BAD)
    bad = subprocess.run(
        [sys.executable, "-m", "fabric", "validate"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert bad.returncode == 1
    assert "agents/broken.yaml:5:12: unknown column 'stauts'" in bad.stdout
