"""A missing driver is a positioned diagnostic naming the extra; an import error inside the
fabric's own packages is a bug and is raised as such, never called "not installed"."""

from __future__ import annotations

from pathlib import Path

import pytest

import fabric
import fabric.catalog as catalog_mod
from dsl.errors import DslError

CONFIG = """\
connections:
  pg: {kind: postgres, url: "postgresql+psycopg://u:p@127.0.0.1:1/db"}
bindings: []
"""


def _raising(name: str):
    def open_connection(*_a, **_k):
        raise ImportError(f"No module named '{name}'", name=name)

    return open_connection


def test_missing_third_party_driver_is_a_positioned_diagnostic(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    monkeypatch.setattr(catalog_mod, "open_connection", _raising("psycopg"))
    with (
        fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab,
        pytest.raises(DslError, match=r"needs the Python module 'psycopg'") as err,
    ):
        fab.catalog.connection("pg")
    assert "fabric.yaml:2" in str(err.value)


def test_our_own_import_error_is_not_called_a_missing_driver(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    monkeypatch.setattr(catalog_mod, "open_connection", _raising("connectors.sql"))
    with (
        fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab,
        pytest.raises(ImportError) as err,
    ):
        fab.catalog.connection("pg")
    assert not isinstance(err.value, DslError) and err.value.name == "connectors.sql"
