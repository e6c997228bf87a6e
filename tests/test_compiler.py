"""JIT compile + cache, hot reload, and the Python API over an in-memory catalog (no servers)."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest

import fabric
from dsl.errors import DslError
from dsl.types import SessionError
from fabric.api import UnknownBindingError

CONFIG = """\
connections:
  shop:
    kind: memory
    schemas:
      merchants: {id: int, name: str, status: str, rating: float}
      orders: {id: int, merchant_id: int, amount: float}
bindings: [agents/]
"""

ACTIVE = """\
binding: active
session: {min_id: int}
sources:
  m:
    from: memory://shop/merchants
    where: status = 'active' and id >= {{session.min_id}}
select: [m.name]
limit: 5
"""

SPEND = """\
binding: spend
sources:
  o:
    from: memory://shop/orders
  m:
    from: memory://shop/merchants
    join: m.id = o.merchant_id
select: [m.name, sum(o.amount) as total]
group_by: [m.name]
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    (tmp_path / "agents" / "active.yaml").write_text(ACTIVE)
    (tmp_path / "agents" / "spend.yaml").write_text(SPEND)
    return tmp_path


def _write(path: Path, text: str) -> None:
    """Rewrite a file so the watcher sees a new mtime even on coarse clocks."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    if path.stat().st_mtime_ns == before:
        import os

        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached within the timeout")


def test_compile_on_first_use_and_cache(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        assert fab.compiler.compilations == 0  # nothing compiled at open
        a = fab.binding("active")
        assert fab.compiler.compilations == 1
        assert fab.binding("active") is a  # cached
        assert a.session["min_id"].kind == "int"
        assert "Scan: m <- memory://shop/merchants" in a.explain(optimized=False)
        assert a.bind({"min_id": 3}) == {"min_id": 3}
        assert a.source_file == "agents/active.yaml"
        # a schema change bumps the catalog version: the next lookup recompiles
        conn = fab.catalog.connection("shop")
        conn.add(
            "merchants",
            pa.table(
                {"id": [1], "name": ["x"], "status": ["active"], "rating": [1.0], "extra": [1]}
            ),
        )
        assert fab.catalog.refresh()
        b = fab.binding("active")
        assert b is not a and b.catalog_version > a.catalog_version


def test_unknown_binding_lists_existing(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        with pytest.raises(UnknownBindingError) as info:
            fab.binding("activ")
        assert "did you mean 'active'?" in str(info.value) and "spend" in str(info.value)


def test_explain_and_session_errors(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        logical = fab.explain("spend", optimized=False)
        assert logical.splitlines()[0] == "Project: m.name, total"
        assert "Aggregate: group_by=[m.name] aggregates=[sum(o.amount) as total]" in logical
        with pytest.raises(SessionError, match="session value 'min_id' \\(int\\) is missing"):
            fab.explain("active", session={})
        with pytest.raises(SessionError, match="expected int, got str"):
            fab.binding("active").bind({"min_id": "3"})


def test_hot_reload_uses_the_new_plan_and_keeps_the_last_good_one(root: Path, caplog) -> None:
    path = root / "agents" / "active.yaml"
    with fabric.open(root / "fabric.yaml", ingest=False) as fab:
        old = fab.binding("active")
        assert "Limit: 5" in fab.explain("active", optimized=False)

        # a good edit: recompiled without a restart
        _write(path, ACTIVE.replace("limit: 5", "limit: 7"))
        _wait(lambda: "Limit: 7" in fab.explain("active", optimized=False))
        new = fab.binding("active")
        assert new is not old and new.content_hash != old.content_hash
        # the object a running query holds is immutable and still the old plan
        assert "Limit: 5" in old.explain(optimized=False)
        assert fab.diagnostics == []

        # a broken edit (unknown column): the last good plan keeps serving, the problem is exposed
        _write(path, ACTIVE.replace("limit: 5", "limit: 9").replace("status =", "stauts ="))
        _wait(lambda: fab.diagnostics != [])
        assert fab.binding("active") is new
        assert "Limit: 7" in fab.explain("active", optimized=False)
        diag = fab.diagnostics[0]
        assert "unknown column 'stauts'" in diag.message
        assert (diag.span.file, diag.span.line, diag.span.col) == ("agents/active.yaml", 6, 12)
        assert "still serving its last good plan" in caplog.text

        # a syntax error is handled the same way
        _write(path, ACTIVE.replace("limit: 5", "limit: [oops"))
        _wait(lambda: any("invalid YAML" in d.message for d in fab.diagnostics))
        assert "Limit: 7" in fab.explain("active", optimized=False)

        # fixing it clears the diagnostic
        _write(path, ACTIVE.replace("limit: 5", "limit: 3"))
        _wait(lambda: "Limit: 3" in fab.explain("active", optimized=False))
        assert fab.diagnostics == []


def test_new_and_deleted_binding_files(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", ingest=False) as fab:
        _write(root / "agents" / "late.yaml", ACTIVE.replace("binding: active", "binding: late"))
        _wait(lambda: "late" in fab.bindings.names())
        assert fab.binding("late").name == "late"
        (root / "agents" / "late.yaml").unlink()
        _wait(lambda: "late" not in fab.bindings.names())
        with pytest.raises(UnknownBindingError):
            fab.binding("late")


def test_validate_reports_every_binding_problem(root: Path) -> None:
    _write(
        root / "agents" / "bad.yaml",
        "binding: bad\nsources:\n  m: {from: memory://shop/merchant}\n",
    )
    _write(root / "agents" / "dup.yaml", ACTIVE)
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        diags = fab.validate()
        text = "\n".join(d.format() for d in diags)
        assert "agents/bad.yaml:3:13: memory://shop/merchant does not exist" in text
        assert "did you mean 'merchants'?" in text
        assert "binding 'active' is also defined in" in text


def test_query_text_compiles_and_caches(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        text = (
            "from memory://shop/merchants as m where m.rating > {{session.r}} select m.name limit 2"
        )
        a = fab.compile_text(text, {"r": 4.5})
        assert a.session["r"].kind == "float"  # inferred from the value
        assert fab.compile_text(text, {"r": 3.0}) is a
        assert "Filter: m.rating > {{session.r}}" in a.explain(optimized=False)
        with pytest.raises(DslError, match="unknown column 'ratin'"):
            fab.compile_text("from memory://shop/merchants as m select m.ratin")


def test_query_runs_through_the_executor(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.catalog.connection("shop").add(
            "merchants",
            pa.table(
                {
                    "id": [1, 2, 3, 4],
                    "name": ["a", "b", "c", "d"],
                    "status": ["active", "closed", "active", "active"],
                    "rating": [4.0, 3.0, 5.0, 1.0],
                }
            ),
        )
        fab.catalog.refresh()
        res = fab.query("active", session={"min_id": 2})
        assert sorted(res.table.column("name").to_pylist()) == ["c", "d"]
        res = fab.query_text(
            "from memory://shop/merchants as m where m.rating >= 4.0 select m.name order by m.name"
        )
        assert res.table.column("name").to_pylist() == ["a", "c"]


def test_pushdown_python_runs_in_the_sandbox(root: Path) -> None:
    _write(
        root / "agents" / "top.yaml",
        """\
binding: top
session: {n: int}
sources:
  m: {from: memory://shop/merchants}
select: [m.name, m.rating]
pushdown:
  python: |
    def run(table, n):
        import pyarrow.compute as pc
        idx = pc.sort_indices(table, sort_keys=[("rating", "descending")])
        return table.take(idx[:n])
  params: [n]
""",
    )
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.catalog.connection("shop").add(
            "merchants",
            pa.table(
                {
                    "id": [1, 2, 3],
                    "name": ["a", "b", "c"],
                    "status": ["x", "x", "x"],
                    "rating": [1.0, 5.0, 3.0],
                }
            ),
        )
        fab.catalog.refresh()
        res = fab.query("top", session={"n": 2})
        assert res.table.column("name").to_pylist() == ["b", "c"]


def test_encrypted_score_end_to_end(tmp_path: Path) -> None:
    import crypto

    ring = crypto.KeyRing.generate()
    (tmp_path / "agent.pub").write_bytes(ring.public_context())
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text("""\
connections:
  risk: {kind: memory, schemas: {policies: {name: str, weights: "vector[3]"}}}
bindings: [agents/]
crypto: {public_context: agent.pub}
""")
    (tmp_path / "agents" / "risk.yaml").write_text("""\
binding: risk_check
session: {ctx: "encrypted[3]"}
sources:
  p: {from: memory://risk/policies}
select:
  - p.name
  - risk: weighted({{session.ctx}}, [0.5, 0.3, 0.2], 0.1)
  - score: dot({{session.ctx}}, p.weights)
""")
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.catalog.connection("risk").add(
            "policies",
            pa.table(
                {
                    "name": ["strict", "lax"],
                    "weights": pa.array(
                        [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], pa.list_(pa.float32(), 3)
                    ),
                }
            ),
        )
        fab.catalog.refresh()
        res = fab.query("risk_check", session={"ctx": ring.encrypt([0.7, 0.2, 0.9])})
        assert res.table.column("name").to_pylist() == ["strict", "lax"]
        risk = [ring.decrypt(x) for x in res.table.column("risk")]
        score = [ring.decrypt(x) for x in res.table.column("score")]
        assert risk == pytest.approx([0.5 * 0.7 + 0.3 * 0.2 + 0.2 * 0.9 + 0.1] * 2, abs=1e-3)
        assert score == pytest.approx([0.7, 0.2 + 0.9], abs=1e-3)


def test_nested_document_fields_resolve_against_struct_columns() -> None:
    from connectors.memory import MemoryConnection
    from dsl.parser import parse_binding_text
    from fabric.catalog import Catalog
    from fabric.config import load_config
    from fabric.plan.builder import build

    conn = MemoryConnection("crm")
    conn.add("docs", pa.table({"id": [1], "meta": pa.array([{"city": "x", "geo": {"lat": 1.0}}])}))
    cat = Catalog(
        load_config({"connections": {"crm": {"kind": "memory"}}}), connections={"crm": conn}
    )
    plan = build(
        parse_binding_text(
            "from memory://crm/docs as c where meta.city = 'x' and c.meta.geo.lat > 0 select c.id, c.meta.city, c.*"
        ),
        cat,
    )
    assert plan.explain().splitlines() == [
        "Project: c.id, c.meta.city as city, c.meta",
        "  Filter: c.meta.city = 'x' and c.meta.geo.lat > 0",
        "    Scan: c <- memory://crm/docs",
    ]
    with pytest.raises(DslError, match=r"cannot compare c\.meta\.geo\.lat"):
        build(parse_binding_text("from memory://crm/docs as c where c.meta.geo.lat = 'x'"), cat)


def test_explain_analyze_runs_the_plan(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.catalog.connection("shop").add(
            "merchants",
            pa.table(
                {
                    "id": [1, 2],
                    "name": ["a", "b"],
                    "status": ["active", "active"],
                    "rating": [1.0, 2.0],
                }
            ),
        )
        fab.catalog.refresh()
        text = fab.explain("active", session={"min_id": 2}, analyze=True)
        assert "Scan: m <- memory://shop/merchants" in text
        assert text != fab.explain("active")  # annotated with what actually ran
