"""The physical plan: fixture files (binding in -> physical explain text out) and checks.

Each ``tests/fixtures/physical/<case>.yaml`` (or ``.txt``: the compact text form) holds a
binding over the in-memory tables of ``fixtures/optimizer/world.py``, a ``---- physical``
line and the expected ``explain`` text: which parts run in DuckDB, in pyarrow, at each
source and in parallel, before anything runs. The binding goes through the real loader,
plan builder, optimizer and physical planner.
"""

from __future__ import annotations

import pathlib

import pyarrow as pa
import pytest
from fixtures.optimizer import world

from dsl.ast import Call, Column, Literal
from dsl.loader import load_text
from dsl.parser import parse_binding_text
from fabric.optimizer import optimize
from fabric.physical import (
    DuckDBRegion,
    DuckDBStep,
    PhysicalError,
    PyArrowStep,
    SourceUnit,
    plan,
)
from fabric.physical.planner import pyarrow_lacks
from fabric.plan.builder import build
from fabric.plan.nodes import Derive, Filter, Scan

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "physical"
CASES = sorted([*FIXTURES.glob("*.yaml"), *FIXTURES.glob("*.txt")])
SEPARATOR = "---- physical\n"


def _physical(path: pathlib.Path, binding: str):  # type: ignore[no-untyped-def]
    cat = world.catalog()
    spec = (
        parse_binding_text(binding.strip(), str(path))
        if path.suffix == ".txt"
        else load_text(binding, str(path))[0]
    )
    return plan(optimize(build(spec, cat), cat), cat)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_fixture(path: pathlib.Path) -> None:
    binding, sep, expected = path.read_text().partition(SEPARATOR)
    assert sep, f"{path.name}: no '{SEPARATOR.strip()}' line"
    got = _physical(path, binding).explain()
    assert got == expected.strip(), f"{path.name}:\n{got}"


def test_engines_come_from_the_function_registry() -> None:
    # cast has no pyarrow form; lower has one; a constant cast is folded before pyarrow
    assert pyarrow_lacks(Call("lower", (Column("name", "m"),))) is None
    why = pyarrow_lacks(Call("cast", (Column("id", "m"), Literal("text", "str"))))
    assert why == "cast() has no pyarrow form"
    assert pyarrow_lacks(Call("cast", (Literal(1, "int"), Literal("text", "str")))) is None


def test_a_chain_step_without_pyarrow_form_runs_in_duckdb_in_its_unit() -> None:
    cat = world.catalog()
    text = "from memory://t/merchants as m derive s = cast(m.id as text) select m.name, s"
    pp = plan(optimize(build(parse_binding_text(text, "<t>"), cat), cat), cat)
    unit = pp.units["m"]
    assert unit.placement == "inline" and unit.engines == ("duckdb",)
    assert isinstance(pp.root, PyArrowStep)


def test_units_run_in_parallel_unless_they_wait_for_keys() -> None:
    path = FIXTURES / "nearby_offers.yaml"
    pp = _physical(path, path.read_text().partition(SEPARATOR)[0])
    assert pp.order == ("loc", "m", "c")
    assert pp.units["m"].deps == {"loc"} and pp.units["c"].deps == {"m"}
    assert pp.depth == 2
    assert all(u.placement == "pool" for u in pp.units.values())
    assert isinstance(pp.root, DuckDBRegion) and len(pp.root.inputs) == 3


def test_nodes_are_checked_when_built() -> None:
    cat = world.catalog()
    scan = world.scan(cat, "m", "merchants")
    f = Filter(scan, Column("status", "m"))
    unit = SourceUnit(f, "m", scan, (f,), ("pyarrow",), frozenset(), frozenset(), (), {})
    with pytest.raises(PhysicalError, match="placement"):
        SourceUnit(f, "m", scan, (f,), ("pyarrow",), frozenset(), frozenset(), (), {}, "gpu")
    with pytest.raises(PhysicalError, match="engines"):
        SourceUnit(f, "m", scan, (f,), (), frozenset(), frozenset(), (), {})
    with pytest.raises(PhysicalError, match="waits on itself"):
        SourceUnit(f, "m", scan, (f,), ("pyarrow",), frozenset({"m"}), frozenset(), (), {})
    other = Scan("c", "memory://t/coupons", cat.source("memory://t/coupons").schema())
    with pytest.raises(PhysicalError, match="input"):
        PyArrowStep(Filter(other, Column("code", "c")), unit)
    d = Derive(scan, (("m.x", Column("id", "m"), pa.int64()),))
    with pytest.raises(PhysicalError, match="cannot run"):
        DuckDBStep(scan, unit)
    with pytest.raises(PhysicalError, match="chain step"):
        SourceUnit(d, "m", scan, (d, f), ("pyarrow", "pyarrow"), frozenset(), frozenset(), (), {})


CONFIG = """\
connections:
  shop:
    kind: memory
    schemas:
      merchants: {id: int, name: str, status: str}
      orders: {id: int, merchant_id: int, amount: float}
bindings: [agents/]
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


def test_the_compiler_builds_the_physical_plan_once_and_explain_shows_it(
    tmp_path: pathlib.Path,
) -> None:
    import fabric
    from fabric.physical import PhysicalPlan

    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    (tmp_path / "agents" / "spend.yaml").write_text(SPEND)
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab:
        compiled = fab.binding("spend")
        assert isinstance(compiled.physical, PhysicalPlan)
        assert compiled.physical.logical is compiled.plan
        assert fab.binding("spend").physical is compiled.physical  # cached with the plan
        text = fab.explain("spend")  # before anything runs
        assert text.splitlines()[:2] == [
            "Physical plan: 2 source units on the scan pool (o, m in parallel)",
            "DuckDB query over 2 inputs:",
        ]
        assert "Source unit o [scan pool]:" in text
        # the logical plans stay available
        assert compiled.explain(physical=False) == compiled.plan.explain()
        assert fab.explain("spend", optimized=False) == compiled.logical_plan.explain()
        conn = fab.catalog.connection("shop")
        conn.add("merchants", pa.table({"id": [1], "name": ["a"], "status": ["x"]}))
        conn.add("orders", pa.table({"id": [1, 2], "merchant_id": [1, 1], "amount": [1.0, 2.0]}))
        fab.catalog.refresh()
        res = fab.query("spend")
        assert res.table.to_pylist() == [{"name": "a", "total": 3.0}]


def test_the_executor_runs_the_physical_plan_it_is_given() -> None:
    """execute() takes the physical plan (the compiler's) or builds it from a logical one
    (kept in a side table, never on the frozen node); a step the planner sent to DuckDB
    runs there, with the declared column types."""
    import duckdb

    from fabric.execute import execute

    tables = world.make_tables()
    cat = world.catalog(tables)
    text = (
        "from memory://t/merchants as m where m.status = 'active' "
        "derive label = cast(m.id as text) select m.name, label order by m.name limit 3"
    )
    logical = optimize(build(parse_binding_text(text, "<t>"), cat), cat)
    pp = plan(logical, cat)
    res = execute(pp, {}, cat, binding="b", analyze=True)
    ref = duckdb.sql(
        "SELECT name, CAST(id AS VARCHAR) AS label FROM m WHERE status = 'active' "
        "ORDER BY name LIMIT 3",
        connection=_con(m=tables["merchants"]),
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == ref
    assert res.table.schema.field("label").type == pa.string()
    assert res.explain is not None
    derive = next(ln for ln in res.explain.splitlines() if "Derive: m.label" in ln)
    assert derive.lstrip().startswith("DuckDB Derive") and "duckdb" in derive
    again = execute(logical, {}, cat, binding="b")
    assert again.table == res.table
    assert not {k for k in vars(logical) if k.startswith("_")}


def _con(**tables: pa.Table):  # type: ignore[no-untyped-def]
    import duckdb

    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con
