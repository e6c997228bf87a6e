"""A driver that is not installed is a positioned diagnostic at the connection's line of
fabric.yaml naming the extra to install, not the import's traceback (issue 19)."""

from __future__ import annotations

import sys

import pytest

import fabric
from dsl.errors import DslError


@pytest.mark.parametrize(
    ("module", "kind", "url", "extra"),
    [
        ("psycopg", "postgres", "postgresql+psycopg://u:p@127.0.0.1:1/db", "postgres"),
        ("pymongo", "mongo", 'mongodb://127.0.0.1:1/", database: "crm', "mongo"),
    ],
)
def test_missing_driver_names_the_extra(tmp_path, monkeypatch, module, kind, url, extra):
    cfg = tmp_path / "fabric.yaml"
    cfg.write_text(f'# a comment line\nconnections:\n  wh: {{kind: {kind}, url: "{url}"}}\n')
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with fabric.open(cfg) as fab, pytest.raises(DslError) as err:
        fab.query_text(f"from {kind}://wh/t as t select t.a")
    d = err.value.diagnostics[0]
    assert d.span is not None and d.span.file.endswith("fabric.yaml") and d.span.line == 3
    assert f"'{module}'" in d.message and "not installed" in d.message
    assert d.hint == f"pip install 'agent-data-fabric[{extra}]'"
