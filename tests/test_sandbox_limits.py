"""Operator limits (fabric.yaml ``sandbox:``) are ceilings a binding may only lower (issue 13,
finding 5): checked end to end through ``fabric.open`` and ``fab.query``."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest

import fabric
from fabric.sandbox import SandboxTimeout, SandboxViolation

CONFIG = """\
connections:
  mem:
    kind: memory
    schemas:
      items: {id: int}
sandbox: {cpu_seconds: 1, wall_seconds: 2, output_mb: 1, workers: 1}
bindings: [agents/]
"""

GREEDY = """\
binding: greedy
sources:
  i: {from: memory://mem/items}
select: [i.id]
pushdown:
  python: |
    def run(table):
        n = 0
        while True:
            n += 1
  limits: {cpu_seconds: 30, wall_seconds: 60}
"""

BIG_OUTPUT = """\
binding: big_output
sources:
  i: {from: memory://mem/items}
select: [i.id]
pushdown:
  python: |
    import pyarrow as pa
    def run(table):
        return pa.table({"x": [b"x" * (4 << 20)]})
  limits: {output_mb: 1024}
"""


@pytest.fixture
def fab(tmp_path: Path):
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    (tmp_path / "agents" / "greedy.yaml").write_text(GREEDY)
    (tmp_path / "agents" / "big_output.yaml").write_text(BIG_OUTPUT)
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.catalog.connection("mem").add("items", pa.table({"id": [1, 2, 3]}))
        f.catalog.refresh()
        yield f


def test_a_binding_cannot_raise_the_operators_cpu_and_wall_limits(fab, caplog):
    caplog.set_level(logging.WARNING, "fabric.sandbox")
    with pytest.raises(SandboxTimeout) as ei:
        fab.query("greedy")
    msg = str(ei.value)
    assert "binding 'greedy'" in msg and "limits: 1 s CPU, 2 s wall-clock" in msg, msg
    assert "asks for sandbox limit cpu_seconds=30, above the operator's ceiling of 1" in caplog.text
    assert "wall_seconds=60, above the operator's ceiling of 2" in caplog.text


def test_a_binding_cannot_raise_the_operators_output_limit(fab, caplog):
    caplog.set_level(logging.WARNING, "fabric.sandbox")
    with pytest.raises(SandboxViolation, match=f"over the output limit of {1 << 20}"):
        fab.query("big_output")
    assert f"output_bytes={1024 << 20}, above the operator's ceiling of {1 << 20}" in caplog.text
