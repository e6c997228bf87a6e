"""A third-party connector registered through the ``agent_data_fabric.connectors`` entry
point, from a throwaway package made here (not from inside this repository), is
validated by config with its own options, planned offline with its capabilities, and
queried through ``fabric.open``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fabric
from connectors import registry
from dsl.errors import DslError
from fabric.config import load_config

MODULE = '''
import pyarrow as pa

from connectors.base import Connection, UnknownObjectError
from connectors.memory import MemorySource

ROWS = pa.table({"id": [1, 2, 3, 4], "word": ["a", "bb", "ccc", "dddd"]})


class CountingConnection(Connection):
    """{kind: counting, upto: N}: one object, ``numbers``."""

    kind = "counting"
    options = ("upto",)
    capabilities = frozenset({"projection", "limit"})
    objects = "series"

    def source(self, obj, options=None):
        if obj != "numbers":
            raise UnknownObjectError(f"counting://{self.name}/{obj}", ["numbers"])
        n = int(self.options.get("upto", 4))
        return MemorySource(f"counting://{self.name}/numbers", ROWS.slice(0, n))

    def list_objects(self):
        return ["numbers"]
'''


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pkg = tmp_path / "site"
    pkg.mkdir()
    mod = f"fabric_counting_{tmp_path.name.replace('-', '_')}"
    (pkg / f"{mod}.py").write_text(MODULE)
    dist = pkg / f"{mod}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mod}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\ncounting = {mod}:CountingConnection\n"
    )
    monkeypatch.syspath_prepend(str(pkg))
    yield mod
    registry._KINDS.pop("counting", None)
    registry._CLASSES.pop("counting", None)
    sys.modules.pop(mod, None)


CONFIG = """\
connections:
  nums:
    kind: counting
    upto: 3
bindings: [agents/]
"""

BINDING = """\
binding: words
sources:
  n:
    from: counting://nums/numbers
    where: id >= 2
select: [n.id, n.word]
order_by: [n.id]
"""


def test_entry_point_connector_is_queried_through_fabric_open(
    third_party: str, tmp_path: Path
) -> None:
    assert "counting" in registry.kinds()
    root = tmp_path / "fab"
    (root / "agents").mkdir(parents=True)
    (root / "fabric.yaml").write_text(CONFIG)
    (root / "agents" / "words.yaml").write_text(BINDING)
    with fabric.open(root / "fabric.yaml", ingest=False, watch=False) as fab:
        out = fab.query("words", {})
    assert out.table.to_pylist() == [{"id": 2, "word": "bb"}, {"id": 3, "word": "ccc"}]
    s = registry.spec("counting")
    assert s.options == ("upto", "options") and s.objects == "series"
    assert s.capabilities == frozenset({"projection", "limit"})


def test_entry_point_connector_options_are_checked_with_positions(
    third_party: str, tmp_path: Path
) -> None:
    bad = CONFIG.replace("upto: 3", "up_to: 3")
    (tmp_path / "fabric.yaml").write_text(bad)
    with pytest.raises(DslError) as ei:
        load_config(tmp_path / "fabric.yaml")
    text = str(ei.value)
    assert "fabric.yaml:4:" in text and "up_to" in text and "upto" in text


def test_unknown_kind_lists_every_kind(tmp_path: Path) -> None:
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    with pytest.raises(DslError) as ei:
        load_config(tmp_path / "fabric.yaml")
    assert "unknown connection kind 'counting'" in str(ei.value)
    assert "kafka" in str(ei.value)


def test_register_connection_from_python(third_party: str) -> None:
    cls = registry.connection_class("counting")  # imports the entry point
    registry._KINDS.pop("counting")
    registry._CLASSES.pop("counting")
    registry.register_connection("counting", cls)
    assert registry.connection_class("counting") is cls
    with pytest.raises(ValueError, match="already registered"):
        registry.register_connection("counting", cls)


def test_builtin_offline_capabilities_are_the_sources_own() -> None:
    """The registry's offline capabilities are what the connector's Source declares."""
    from connectors.kafka import KafkaSource
    from connectors.memory import MemorySource
    from connectors.mongo import MongoSource
    from connectors.s3 import S3Source
    from connectors.sql import SqlSource

    by_kind = {
        "mysql": SqlSource,
        "postgres": SqlSource,
        "sql": SqlSource,
        "mongo": MongoSource,
        "s3": S3Source,
        "file": S3Source,
        "kafka": KafkaSource,
        "memory": MemorySource,
    }
    for kind, cls in by_kind.items():
        assert registry.spec(kind).capabilities == cls.capabilities, kind


def test_capabilities_are_the_enum_and_unknown_names_are_refused(third_party: str) -> None:
    """A class may name its capabilities as strings; the registry keeps them as Capability
    members, and a name the fabric does not know is refused naming the known ones."""
    from connectors.base import Capability, Connection

    caps = registry.spec("counting").capabilities  # the entry point declared strings
    assert caps == {Capability.PROJECTION, Capability.LIMIT}
    assert all(isinstance(c, Capability) for c in caps)

    class Vague(Connection):
        capabilities = frozenset({"projection", "vectors"})  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"capability 'vectors'.*known capabilities: projection"):
        registry.register_connection("vague", Vague)
    assert "vague" not in registry.kinds()


INLINE_MODULE = """
import pyarrow as pa

from connectors.base import Capability, Connection, Source


class Rows(Source):
    capabilities = frozenset({Capability.PROJECTION})

    def schema(self):
        return pa.schema([("id", pa.int64())])

    def scan(self, request):
        yield from pa.table({"id": [1, 2, 3]}).to_batches()


class LocalRows(Rows):
    capabilities = frozenset({Capability.PROJECTION, Capability.IN_PROCESS})


class Local(Connection):
    capabilities = LocalRows.capabilities  # what its sources do, planned offline

    def source(self, obj, options=None):
        return LocalRows(f"{self.kind}://{self.name}/{obj}")


class Remote(Connection):
    capabilities = Rows.capabilities

    def source(self, obj, options=None):
        return Rows(f"{self.kind}://{self.name}/{obj}")
"""


def test_inline_kinds_come_from_the_registry(tmp_path: Path) -> None:
    """The physical planner runs a lone unit on the caller's thread when its source has
    IN_PROCESS (built-in: memory, dataset), else on the scan pool; the registry's inline
    kinds are the classes declaring it."""
    assert {"memory", "dataset"} <= registry.inline_kinds()
    assert not {"kafka", "mysql", "s3", "mongo"} & registry.inline_kinds()
    mod = f"fabric_inline_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{mod}.py").write_text(INLINE_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        m = __import__(mod)
        registry.register_connection("localrows", m.Local)
        registry.register_connection("remoterows", m.Remote)
        assert "localrows" in registry.inline_kinds()
        assert "remoterows" not in registry.inline_kinds()
        (tmp_path / "agents").mkdir()
        (tmp_path / "fabric.yaml").write_text(
            "connections:\n  l: {kind: localrows}\n  r: {kind: remoterows}\nbindings: [agents/]\n"
        )
        for name, uri in (("loc", "localrows://l/t"), ("rem", "remoterows://r/t")):
            (tmp_path / "agents" / f"{name}.yaml").write_text(
                f"binding: {name}\nsources:\n  t:\n    from: {uri}\nselect: [t.id]\n"
            )
        with fabric.open(tmp_path / "fabric.yaml", ingest=False, watch=False) as fab:
            assert "inline on the caller's thread" in fab.explain("loc")
            assert "on the scan pool" in fab.explain("rem")
            assert fab.query("loc").table.column("id").to_pylist() == [1, 2, 3]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(mod, None)
        for kind in ("localrows", "remoterows"):
            registry._KINDS.pop(kind, None)
            registry._CLASSES.pop(kind, None)
