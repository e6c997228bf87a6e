"""Optimizer rules: fixture files (binding YAML in -> optimized explain text out) and properties.

Each ``tests/fixtures/optimizer/<rule>/<case>.yaml`` (or ``.txt``: the compact text form) holds ``# rules: a, b`` (the rules
applied, to a fixed point), a binding over the in-memory tables of
``fixtures/optimizer/world.py``, a ``---- optimized`` line and the expected explain
text. The binding goes through the real loader and plan builder.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pyarrow as pa
import pytest
from fixtures.optimizer import world

import fabric.optimizer as opt
from connectors.base import Pushdown
from dsl.ast import Binary, Column, Literal
from dsl.loader import load_text
from dsl.parser import parse_binding_text
from fabric.optimizer import RULES, OptimizerError, optimize
from fabric.plan.builder import build
from fabric.plan.nodes import Filter, Project, Scan

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "optimizer"
CASES = sorted([*FIXTURES.glob("*/*.yaml"), *FIXTURES.glob("*/*.txt")])
RULE_BY_NAME = {r.__name__: r for r in RULES}
SEPARATOR = "---- optimized\n"


def _read(path: pathlib.Path) -> tuple[list[str], str, str]:
    text = path.read_text()
    first, _, rest = text.partition("\n")
    rules = [r.strip() for r in first.removeprefix("# rules:").split(",") if r.strip()]
    binding, _, expected = rest.partition(SEPARATOR)
    return rules, binding, expected.strip()


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_fixture(path: pathlib.Path) -> None:
    rules, binding, expected = _read(path)
    cat = world.catalog()
    spec = (
        parse_binding_text(binding.strip(), str(path))
        if path.suffix == ".txt"
        else load_text(binding, str(path))[0]
    )
    plan = build(spec, cat)
    out = optimize(plan, cat, rules=[RULE_BY_NAME[r] for r in rules])
    assert out.explain().strip() == expected, f"{path.name}:\n{out.explain()}"


def test_every_rule_has_fixtures() -> None:
    assert {p.parent.name for p in CASES} >= {r.__name__ for r in RULES} | {"all"}


def test_fail_closed_never_drops_a_filter() -> None:
    """INEXACT keeps a Filter above the scan; UNSUPPORTED keeps it and pushes nothing."""
    tables = world.make_tables()
    for answer in (Pushdown.INEXACT, Pushdown.UNSUPPORTED):
        cat = world.catalog(
            tables, merchants=world.Picky("memory://t/merchants", tables["merchants"], answer)
        )
        out = optimize(world.single_source(cat), cat)
        scan = out.scans()[0]
        filters = [p for p in out.walk() if isinstance(p, Filter)]
        assert [str(f.predicate) for f in filters] == ["m.status = 'active'"]
        assert isinstance(filters[0].input, Scan)
        assert scan.exact == ()
        assert [str(e) for e in scan.inexact] == (
            ["status = 'active'"] if answer is Pushdown.INEXACT else []
        )
        assert scan.limit is None and scan.order_by == ()  # never a limit under a residual filter


def test_schema_change_is_reported_naming_the_rule() -> None:
    cat = world.catalog()

    def broken_rule(plan, catalog):
        if isinstance(plan, Project):
            return plan.input
        ch = plan.children()
        return plan.with_children(*(broken_rule(c, catalog) for c in ch)) if ch else plan

    with pytest.raises(OptimizerError, match="broken_rule changed the output schema"):
        optimize(world.single_source(cat), cat, rules=[broken_rule])


def test_fixed_point_and_idempotence() -> None:
    cat = world.catalog()
    for make in world.PLANS.values():
        once = optimize(make(cat), cat)
        assert optimize(once, cat) == once


def test_pass_limit_stops_a_rule_that_never_settles() -> None:
    cat = world.catalog()
    calls = []

    def restless(plan, catalog):
        calls.append(1)
        scan = plan.scans()[0]
        new = dataclasses.replace(scan, estimated_rows=(scan.estimated_rows or 0) + 1)
        return _replace(plan, scan, new)

    optimize(world.single_source(cat), cat, rules=[restless], max_passes=4)
    assert len(calls) == 4


def _replace(node, old, new):
    if node is old:
        return new
    ch = node.children()
    return node.with_children(*(_replace(c, old, new) for c in ch)) if ch else node


def test_join_order_keeps_every_join_connected_and_the_schema() -> None:
    cat = world.catalog()
    plan = world.bad_join_order(cat)
    out = optimize(plan, cat)
    assert out.schema.equals(plan.schema)
    order = [s.alias for s in out.scans()]
    assert order[0] == "loc"  # the one-row side goes first
    assert order.index("m") < order.index("c")  # c joins m, not loc: m must come before it


def test_dynamic_filter_needs_in_support() -> None:
    tables = world.make_tables()
    cat = world.catalog(
        tables, coupons=world.Picky("memory://t/coupons", tables["coupons"], Pushdown.UNSUPPORTED)
    )
    out = optimize(world.nearby_offers(cat), cat)
    by_alias = {s.alias: s for s in out.scans()}
    assert by_alias["m"].dynamic and not by_alias["c"].dynamic


def test_no_dynamic_filter_into_the_preserved_side_of_a_left_join() -> None:
    cat = world.catalog()
    out = optimize(world.left_join(cat), cat)
    by_alias = {s.alias: s for s in out.scans()}
    assert by_alias["m"].dynamic == ()
    # the right-side condition of the left join went into the coupons scan
    assert [str(e) for e in by_alias["c"].exact] == ["discount > 55"]


def test_without_statistics_no_dynamic_filter_is_guessed_small() -> None:
    tables = world.make_tables()
    no_stats = world.Picky("memory://t/locations", tables["locations"], Pushdown.EXACT, stats=False)
    cat = world.catalog(tables, locations=no_stats)
    out = optimize(world.nearby_offers(cat), cat)
    loc = next(s for s in out.scans() if s.alias == "loc")
    assert loc.estimated_rows == 1  # latest_by user_id pinned by the session equality
    assert next(s for s in out.scans() if s.alias == "m").dynamic


def test_constant_conjunct_stays_put() -> None:
    cat = world.catalog()
    plan = world.single_source(cat)
    flagged = Project(
        Filter(plan.input.input.input, Binary("=", Literal(1, "int"), Literal(1, "int"))),
        plan.input.input.items,
    )
    out = optimize(flagged, cat)
    assert any(isinstance(p, Filter) and str(p.predicate) == "1 = 1" for p in out.walk())


def test_rules_have_docstrings() -> None:
    for r in RULES:
        assert r.__doc__ and len(r.__doc__) > 20, r.__name__
    assert opt.__doc__


def test_projection_keeps_source_order_and_types() -> None:
    cat = world.catalog()
    out = optimize(world.nearby_offers(cat), cat)
    m = next(s for s in out.scans() if s.alias == "m")
    assert m.projection == ("id", "name", "geo_hash")
    assert m.schema == pa.schema(
        [("m.id", pa.int64()), ("m.name", pa.string()), ("m.geo_hash", pa.string())]
    )
    assert isinstance(Column("x"), Column)
