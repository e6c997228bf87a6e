"""Fixture tests (sqlglot / DataFusion style): binding in -> explain text of the logical plan.

``tests/fixtures/dsl/<name>.yaml`` (or ``.txt`` for the compact text form) is planned
against ``tests/fixtures/dsl/fabric.yaml`` (declared schemas, offline) and compared with
``<name>.plan``. ``tests/fixtures/dsl_errors/<name>.yaml|.txt`` must fail with exactly
the text of ``<name>.err`` (position and underline included).

Set ``FABRIC_UPDATE_FIXTURES=1`` to (re)write the expected files, then review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsl.errors import DslError
from dsl.loader import load_file
from dsl.parser import attach_source, parse_binding_text
from fabric.catalog import Catalog
from fabric.config import load_config
from fabric.plan import nodes as N
from fabric.plan.builder import build

HERE = Path(__file__).parent
PLANS = HERE / "fixtures" / "dsl"
ERRORS = HERE / "fixtures" / "dsl_errors"
UPDATE = os.environ.get("FABRIC_UPDATE_FIXTURES") == "1"


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog(load_config(PLANS / "fabric.yaml", env={}), offline=True)


def _specs(path: Path):
    if path.suffix == ".txt":
        return [parse_binding_text(path.read_text(), path.name)]
    return load_file(path, path.name)


def _cases(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if p.suffix in (".yaml", ".txt") and p.name != "fabric.yaml"
    )


def _check(expected_file: Path, actual: str) -> None:
    if UPDATE or not expected_file.exists():
        expected_file.write_text(actual + "\n")
        if not UPDATE:
            pytest.fail(f"wrote missing {expected_file.name}; review it and rerun")
    assert actual == expected_file.read_text().rstrip("\n")


@pytest.mark.parametrize("path", _cases(PLANS), ids=lambda p: p.name)
def test_plan_fixture(path: Path, catalog: Catalog) -> None:
    text = "\n\n".join(build(spec, catalog).explain() for spec in _specs(path))
    _check(path.with_suffix(".plan"), text)


@pytest.mark.parametrize("path", _cases(ERRORS), ids=lambda p: p.name)
def test_error_fixture(path: Path, catalog: Catalog) -> None:
    with pytest.raises(DslError) as info:
        for spec in _specs(path):
            build(spec, catalog)
    # as the compiler does: fill the underlined line from the file
    err = attach_source(info.value, {path.name: path.read_text()})
    assert err.diagnostics and all(d.span is not None for d in err.diagnostics), err.format()
    _check(path.with_suffix(".err"), err.format())


def test_at_least_forty_error_cases() -> None:
    assert len(_cases(ERRORS)) >= 40


@pytest.mark.parametrize(
    ("yaml_name", "text_name"),
    [
        ("nearby_offers.yaml", "nearby_offers_text.txt"),
        ("market_open_news.yaml", "market_open_news_text.txt"),
        ("top_category_last_week.yaml", "top_category_text.txt"),
        ("stages.yaml", "stages_text.txt"),
        ("case_cast_intervals.yaml", "case_cast_intervals_text.txt"),
    ],
)
def test_yaml_and_text_forms_give_the_same_plan(
    yaml_name: str, text_name: str, catalog: Catalog
) -> None:
    a = build(_specs(PLANS / yaml_name)[0], catalog)
    b = build(_specs(PLANS / text_name)[0], catalog)
    if isinstance(a, N.UserFunction):
        # the same code and limits; only the file/line it came from differ
        assert isinstance(b, N.UserFunction)
        assert (a.code.strip(), a.params) == (b.code.strip(), b.params)
        assert a.limits == b.limits
        a, b = a.input, b.input
    assert a == b
    assert a.explain() == b.explain()


def test_spans_point_into_the_file(catalog: Catalog) -> None:
    spec = _specs(PLANS / "nearby_offers.yaml")[0]
    where = spec.sources[0].where[0]
    # `    where: user_id = {{session.user_id}}` is line 9; the expression starts at column 12
    assert (where.span.line, where.span.col) == (9, 12)
    param = where.right
    assert (param.span.line, param.span.col, param.span.end_col) == (9, 22, 41)
    derive = spec.sources[0].derive[0].expr
    assert (derive.span.line, derive.span.col) == (12, 20)


@pytest.mark.parametrize(
    "path",
    sorted((HERE.parent / "examples" / "seed" / "agents").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_seed_example_bindings_parse(path: Path) -> None:
    specs = load_file(path, path.name)
    assert specs and all(s.sources for s in specs)
