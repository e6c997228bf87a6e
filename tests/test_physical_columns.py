"""Logical plan nodes check their columns when built: an expression naming a column its
input does not have fails at construction (PlanError naming the column and the existing
ones), not at execution."""

from __future__ import annotations

import pyarrow as pa
import pytest
from fixtures.optimizer import world

from dsl.ast import Binary, Call, Column, Exists, Literal, SortKey
from fabric.plan.nodes import Aggregate, Derive, Filter, Join, PlanError, Project, Sort


def _scans():  # type: ignore[no-untyped-def]
    cat = world.catalog()
    return world.scan(cat, "m", "merchants"), world.scan(cat, "c", "coupons")


def test_filter_project_sort_join_derive_aggregate_name_the_missing_column() -> None:
    m, c = _scans()
    with pytest.raises(PlanError, match=r"Filter: column m\.nope is not among .*m\.status"):
        Filter(m, Binary("=", Column("nope", "m"), Literal(1, "int")))
    with pytest.raises(PlanError, match=r"Project: column c\.code"):
        Project(m, (("code", Column("code", "c"), pa.string()),))
    with pytest.raises(PlanError, match=r"Sort: column m\.rank"):
        Sort(m, (SortKey(Column("rank", "m")),))
    with pytest.raises(PlanError, match=r"Join: column x\.id"):
        Join(m, c, Binary("=", Column("id", "x"), Column("merchant_id", "c")))
    with pytest.raises(PlanError, match=r"Derive: column m\.lat2"):
        Derive(m, (("m.x", Column("lat2", "m"), pa.float64()),))
    with pytest.raises(PlanError, match=r"Aggregate: column c\.discount"):
        Aggregate(m, (), (("s", Call("sum", (Column("discount", "c"),)), pa.int64()),))


def test_what_the_executor_resolves_is_accepted() -> None:
    m, c = _scans()
    j = Join(m, c, Binary("=", Column("id", "m"), Column("merchant_id", "c")))
    # a bare name, an earlier derived item, an expression a Project below computes
    Filter(j, Binary(">", Column("discount"), Literal(5, "int")))
    Derive(m, (("m.a", Column("id", "m"), pa.int64()), ("m.b", Column("m.a"), pa.int64())))
    total = Call("sum", (Column("discount", "c"),))
    agg = Aggregate(j, (("m.name", Column("name", "m"), pa.string()),), (("t", total, pa.int64()),))
    Sort(agg, (SortKey(total, descending=True), SortKey(Column("t"))))
    # a stage's columns inside exists(S where ...) are the stage's
    Filter(m, Exists("late", Binary("=", Column("k", "late"), Column("id", "m"))))
