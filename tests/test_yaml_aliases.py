"""Binding files and fabric.yaml refuse YAML anchors, aliases and merge keys (issue 13,
finding 11): a 458-byte 'billion laughs' binding hung ``fabric.open()`` for > 20 s and a
self-referencing alias raised a bare RecursionError that stopped the whole fabric.

They are refused from the event stream, before any node is built, with a positioned
error; a bad binding file becomes a diagnostic of that file and the others keep working.
(The error texts themselves are fixtures: ``tests/fixtures/dsl_errors/yaml_*.yaml``.)
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

import fabric
from dsl.errors import DslError
from dsl.loader import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "dsl_errors"

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
sources:
  m:
    from: memory://shop/merchants
    where: status = 'active'
select: [m.name]
"""


def _bomb(levels: int) -> str:
    text = 'binding: laughs\nl0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels):
        text += f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]\n"
    return text + "sources:\n  m:\n    from: memory://shop/merchants\nselect: [m.name]\n"


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_billion_laughs_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    for levels in (6, 9):  # 9^6 = 531,441 and 9^9 = 387,420,489 strings if expanded
        path = tmp_path / f"laughs{levels}.yaml"
        path.write_text(_bomb(levels))
        caught: list[DslError] = []

        def load(path: Path = path, caught: list[DslError] = caught) -> None:
            with pytest.raises(DslError) as info:
                load_file(path, path.name)
            caught.append(info.value)

        peak = _peak_bytes(load)
        assert peak < 2_000_000, f"{peak} bytes allocated: the aliases were expanded"
        (d,) = caught[0].diagnostics
        assert (d.span.file, d.span.line, d.span.col) == (path.name, 2, 5)
        assert "anchors and aliases are not supported" in d.message
        assert "^^^" in caught[0].format()


def test_self_referencing_alias_is_a_positioned_error(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("binding: loop\nsources:\n  m: &m\n    derive: *m\nselect: [m.name]\n")
    with pytest.raises(DslError) as info:  # not RecursionError
        load_file(path, path.name)
    assert (info.value.span.line, info.value.span.col) == (3, 6)


def test_a_bad_binding_file_does_not_stop_the_fabric(tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    agents.mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    (agents / "active.yaml").write_text(GOOD)
    for name in ("yaml_billion_laughs.yaml", "yaml_self_alias.yaml", "yaml_merge_key.yaml"):
        (agents / name).write_text((FIXTURES / name).read_text())
    with fabric.open(tmp_path / "fabric.yaml", ingest=False, watch=False) as fab:
        assert fab.query("active").table.num_rows == 0  # the good binding works
        diags = fab.validate()
        where = sorted((Path(d.span.file).name, d.span.line, d.span.col) for d in diags)
        assert where == [
            ("yaml_billion_laughs.yaml", 2, 6),
            ("yaml_merge_key.yaml", 4, 5),
            ("yaml_self_alias.yaml", 3, 6),
        ]


def test_fabric_yaml_refuses_aliases(tmp_path: Path) -> None:
    (tmp_path / "fabric.yaml").write_text(
        "connections:\n  a: &c {kind: memory}\n  b: *c\nbindings: []\n"
    )
    with pytest.raises(DslError) as info:
        fabric.open(tmp_path / "fabric.yaml", ingest=False, watch=False)
    d = info.value.diagnostics[0]
    assert (Path(d.span.file).name, d.span.line, d.span.col) == ("fabric.yaml", 2, 6)


def test_stars_and_ampersands_in_values_are_not_aliases(tmp_path: Path) -> None:
    path = tmp_path / "globs.yaml"
    path.write_text(
        "binding: globs\nsources:\n  o:\n    from: s3://lake/orders/*.parquet\n"
        "    where: \"name like 'a&b*'\"\nselect: [o.name]\n"
    )
    (spec,) = load_file(path, path.name)
    assert spec.name == "globs"


def test_python_tags_are_inert(tmp_path: Path) -> None:
    """What held must keep holding: ``!!python/...`` tags construct nothing."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "tags.yaml"
    path.write_text(
        "binding: tags\n"
        f'description: !!python/object/apply:os.system ["touch {marker}"]\n'
        "sources:\n  m:\n    from: !!python/name:os.system memory://shop/merchants\n"
        "select: [m.name]\n"
    )
    with pytest.raises(DslError) as info:
        load_file(path, path.name)
    assert (info.value.span.line, info.value.span.col) == (2, 14)
    assert not marker.exists()
