"""Property: whatever each source answers about pushdown (EXACT, INEXACT that filters
nothing, UNSUPPORTED), the optimized plan returns exactly the rows of a DuckDB reference
query over the same tables (fail closed: no filter is ever lost)."""

from __future__ import annotations

import duckdb
import pyarrow as pa
from fixtures.optimizer import world
from fixtures.optimizer.world import C, eq, lit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors.base import Pushdown
from dsl.ast import Binary, InList, IsNull, Like, Literal, Param, SortKey, and_all, to_text
from fabric.execute import execute
from fabric.optimizer import optimize
from fabric.plan.nodes import Filter, Join, Limit, Project, Sort

TABLES = world.make_tables(n_merchants=300, n_coupons=900)
REF = duckdb.connect()
for _name, _t in TABLES.items():
    REF.register(_name, _t)

ATOMS = [
    eq(C("m.status"), lit("active")),
    eq(C("m.status"), lit("closed")),
    Binary("<", C("m.id"), lit(120)),
    Binary(">=", C("m.id"), lit(40)),
    Binary(">", C("c.discount"), lit(30)),
    Binary("<=", C("c.discount"), lit(45)),
    Like(C("c.code"), lit("C0001%")),
    InList(C("c.merchant_id"), tuple(lit(i) for i in range(0, 300, 7))),
    eq(C("m.name"), Param("name")),
    InList(C("m.id"), Param("ids")),
    Binary(">", C("c.discount"), Binary("+", C("m.id"), lit(-100))),  # over both sources
    IsNull(C("m.name"), negated=True),
    Binary("or", eq(C("m.status"), lit("closed")), Binary(">", C("c.discount"), lit(55))),
]
ANSWERS = st.sampled_from(
    [("exact", False), ("inexact", True), ("inexact", False), ("unsupported", False)]
)


def _sql_value(v: object) -> str:
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, list):
        return "(" + ", ".join(_sql_value(x) for x in v) + ")"
    return str(v)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    atoms=st.lists(st.sampled_from(range(len(ATOMS))), min_size=1, max_size=4, unique=True),
    m_answer=ANSWERS,
    c_answer=ANSWERS,
    name=st.sampled_from(["merchant 5", "merchant 77", "x' OR 1=1 --", "merchant 250"]),
    ids=st.lists(st.integers(0, 320), max_size=30),
    limit=st.sampled_from([None, 3, 50]),
)
def test_any_pushdown_answers_give_the_reference_rows(
    atoms, m_answer, c_answer, name, ids, limit
) -> None:
    sources = {}
    for obj, (answer, drop) in (("merchants", m_answer), ("coupons", c_answer)):
        sources[obj] = world.Picky(f"memory://t/{obj}", TABLES[obj], Pushdown(answer), drop=drop)
    cat = world.catalog(TABLES, **sources)
    pred = and_all([ATOMS[i] for i in atoms])
    j = Filter(
        Join(
            world.scan(cat, "m", "merchants"),
            world.scan(cat, "c", "coupons"),
            eq(C("c.merchant_id"), C("m.id")),
        ),
        pred,
    )
    plan = Project(
        Sort(j, (SortKey(C("c.code")),)),
        (("code", C("c.code"), pa.string()), ("id", C("m.id"), pa.int64())),
    )
    if limit is not None:
        plan = Limit(plan, limit)
    params = {"name": name, "ids": ids}
    res = execute(optimize(plan, cat), params, cat, binding="prop")

    where = to_text(pred)
    where = where.replace("{{session.name}}", _sql_value(name))
    where = where.replace("in {{session.ids}}", "in " + (_sql_value(ids) if ids else "(NULL)"))
    sql = f"SELECT c.code, m.id FROM merchants m JOIN coupons c ON c.merchant_id = m.id WHERE {where} ORDER BY c.code"
    if limit is not None:
        sql += f" LIMIT {limit}"
    expected = REF.execute(sql).fetchall()
    assert [(r["code"], r["id"]) for r in res.table.to_pylist()] == expected, (
        where,
        m_answer,
        c_answer,
    )
    assert isinstance(Literal(1, "int"), Literal)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    common=st.lists(st.sampled_from(range(len(ATOMS))), max_size=2, unique=True),
    groups=st.lists(
        st.lists(st.sampled_from(range(len(ATOMS))), min_size=1, max_size=3, unique=True),
        min_size=2,
        max_size=3,
    ),
    m_answer=ANSWERS,
    c_answer=ANSWERS,
)
def test_or_of_and_groups_gives_the_reference_rows(common, groups, m_answer, c_answer) -> None:
    """factor_or moves common conjuncts out of an OR and pushes implied per-source ORs:
    whatever the sources answer, the rows are those of the unfactored filter in DuckDB."""
    sources = {}
    for obj, (answer, drop) in (("merchants", m_answer), ("coupons", c_answer)):
        sources[obj] = world.Picky(f"memory://t/{obj}", TABLES[obj], Pushdown(answer), drop=drop)
    cat = world.catalog(TABLES, **sources)
    branches = [and_all([ATOMS[i] for i in [*common, *g]]) for g in groups]
    pred = branches[0]
    for b in branches[1:]:
        pred = Binary("or", pred, b)
    plan = Project(
        Sort(
            Filter(
                Join(
                    world.scan(cat, "m", "merchants"),
                    world.scan(cat, "c", "coupons"),
                    eq(C("c.merchant_id"), C("m.id")),
                ),
                pred,
            ),
            (SortKey(C("c.code")),),
        ),
        (("code", C("c.code"), pa.string()), ("id", C("m.id"), pa.int64())),
    )
    params = {"name": "merchant 77", "ids": [1, 5, 77, 120]}
    res = execute(optimize(plan, cat), params, cat, binding="prop")
    where = to_text(pred).replace("{{session.name}}", "'merchant 77'")
    where = where.replace("in {{session.ids}}", "in (1, 5, 77, 120)")
    sql = f"SELECT c.code, m.id FROM merchants m JOIN coupons c ON c.merchant_id = m.id WHERE {where} ORDER BY c.code"
    assert [(r["code"], r["id"]) for r in res.table.to_pylist()] == REF.execute(sql).fetchall(), (
        where
    )
