"""Property and fuzz tests of the binding language.

- Generated bindings written in YAML and in the compact text form give identical plans.
- Canonical expression text re-parses to the same expression.
- Any input (random text, mutated binding files) yields a plan or a DslError with a
  position: never another exception, never a hang.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dsl.errors import DslError
from dsl.loader import load_text
from dsl.parser import parse_binding_text, parse_expr
from fabric.catalog import Catalog
from fabric.config import load_config
from fabric.plan.builder import build

FIXTURES = Path(__file__).parent / "fixtures" / "dsl"
CATALOG = Catalog(load_config(FIXTURES / "fabric.yaml", env={}), offline=True)

# source alias -> (uri, join condition or None, {column: kind})
SOURCES = {
    "m": (
        "mysql://shop/merchants",
        None,
        {"id": "int", "name": "str", "status": "str", "category": "str", "rating": "float"},
    ),
    "o": (
        "mysql://shop/orders",
        "o.merchant_id = m.id",
        {"id": "int", "user_id": "int", "amount": "float", "sku": "str", "created_at": "ts"},
    ),
    "c": (
        "mongo://crm/coupons",
        "c.merchant_id = m.id",
        {"merchant_id": "int", "code": "str", "discount": "float", "expires_at": "ts"},
    ),
}

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _literal(kind: str) -> st.SearchStrategy[str]:
    if kind == "int":
        return st.integers(-1000, 1000).map(str)
    if kind == "float":
        return st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).map(
            lambda f: repr(round(f, 3))
        )
    if kind == "str":
        return st.text("abcxyz _%'", max_size=6).map(lambda s: "'" + s.replace("'", "''") + "'")
    return st.sampled_from(
        [
            "now()",
            "now() - interval '5 minutes'",
            "timestamp '2024-05-01T09:30:00Z'",
            "now() - interval '1 year 2 months'",
            "cast(date '2024-01-31' + interval '1 month' as timestamp)",
        ]
    )


@st.composite
def predicate(draw, alias: str, qualify: bool) -> str:
    cols = SOURCES[alias][2]
    col = draw(st.sampled_from(sorted(cols)))
    kind = cols[col]
    ref = f"{alias}.{col}" if qualify else col
    forms = ["cmp", "isnull", "case"]
    if kind in ("int", "float", "str"):
        forms += ["in", "between", "cast"]
    if kind == "str":
        forms.append("like")
    form = draw(st.sampled_from(forms))
    lit = _literal("float" if kind == "float" else kind)
    if form == "cmp":
        op = draw(st.sampled_from(["=", "!=", "<", "<=", ">", ">="]))
        out = f"{ref} {op} {draw(lit)}"
    elif form == "isnull":
        out = f"{ref} is {draw(st.sampled_from(['', 'not ']))}null"
    elif form == "in":
        items = draw(st.lists(lit, min_size=1, max_size=3))
        out = f"{ref} {draw(st.sampled_from(['in', 'not in']))} ({', '.join(items)})"
    elif form == "between":
        out = f"{ref} between {draw(lit)} and {draw(lit)}"
    elif form == "case":
        op = draw(st.sampled_from(["=", "<", ">="]))
        out = f"case when {ref} {op} {draw(lit)} then {draw(st.sampled_from(['true', 'false']))} else {ref} is null end"
    elif form == "cast":
        out = (
            f"cast({ref} as str) {draw(st.sampled_from(['=', '!=', '<']))} {draw(_literal('str'))}"
        )
    else:
        out = f"{ref} {draw(st.sampled_from(['like', 'not like', 'ilike']))} {draw(lit)}"
    if draw(st.booleans()) and draw(st.booleans()):
        out = f"not ({out})"
    return out


@st.composite
def condition(draw, alias: str, qualify: bool) -> str:
    parts = draw(st.lists(predicate(alias, qualify), min_size=1, max_size=3))
    out = parts[0]
    for p in parts[1:]:
        out = f"{out} {draw(st.sampled_from(['and', 'or']))} {p}"
    return out


@st.composite
def binding(draw) -> dict:
    n = draw(st.integers(1, 3))
    aliases = ["m", "o", "c"][:n]
    sources = []
    for a in aliases:
        where = draw(st.lists(condition(a, draw(st.booleans())), max_size=2))
        derive = []
        if draw(st.booleans()):
            num = "rating" if a == "m" else "amount" if a == "o" else "discount"
            derive.append(("d_" + a, f"{num} * 2 + 1"))
        sources.append((a, where, derive))
    aggregate = draw(st.booleans()) and n >= 1
    having = []
    if aggregate:
        key = draw(st.sampled_from(["m.category", "m.status"]))
        select = [key, "count(*) as n", "sum(m.rating) as total"]
        group_by = [key]
        having = draw(
            st.lists(st.sampled_from(["n > 2", "max(m.rating) < 4.5", "total >= 10"]), max_size=2)
        )
        order = draw(st.sampled_from(["n desc", "total asc nulls last", f"{key}"]))
        order_by = [order]
    else:
        cols = [f"{a}.{c}" for a in aliases for c in SOURCES[a][2]]
        chosen = draw(st.lists(st.sampled_from(cols), min_size=1, max_size=4, unique=True))
        names = {c.split(".")[1] for c in chosen}
        assume(len(names) == len(chosen))
        select = chosen
        group_by = []
        order_by = [
            f"{c} {draw(st.sampled_from(['asc', 'desc']))}"
            for c in draw(st.lists(st.sampled_from(chosen), max_size=2, unique=True))
        ]
    limit = draw(st.one_of(st.none(), st.integers(0, 100)))
    session = draw(st.booleans())
    # a stage, used in exists (correlated) or as a one-row value
    stage = draw(st.sampled_from([None, "exists", "value"]))
    if stage == "exists":
        sources[0][1].append("exists(big where big.merchant_id = m.id and big.amount > 10)")
    elif stage == "value":
        sources[0][1].append("rating > avg_amount.a")
    return dict(
        stage=stage,
        having=having,
        sources=sources,
        select=select,
        group_by=group_by,
        order_by=order_by,
        limit=limit,
        session=session,
    )


STAGES = {
    "exists": (
        "big",
        "mysql://shop/orders",
        "o9",
        "amount > 5",
        "o9.merchant_id, o9.amount",
        None,
    ),
    "value": ("avg_amount", "mysql://shop/orders", "o9", None, "avg(o9.amount) as a", None),
}


def _yaml(b: dict) -> str:
    out = ["binding: generated"]
    if b["session"]:
        out += ["session:", "  uid: int"]
    if b["stage"]:
        name, uri, alias, where, select, _ = STAGES[b["stage"]]
        out += ["stages:", f"  {name}:", "    sources:", f"      {alias}:", f"        from: {uri}"]
        if where:
            out.append(f"        where: {_quote(where)}")
        out.append(f"    select: {_quote(select)}")
    out.append("sources:")
    for i, (a, where, derive) in enumerate(b["sources"]):
        uri, join, _ = SOURCES[a]
        out += [f"  {a}:", f"    from: {uri}"]
        if i > 0:
            out.append(f"    join: {join}")
        w = list(where)
        if b["session"] and a == "m":
            w.append("id = {{session.uid}}")
        if w:
            out.append("    where:")
            out += [f"      - {_quote(x)}" for x in w]
        if derive:
            out.append("    derive:")
            out += [f"      {n}: {e}" for n, e in derive]
    out.append("select:")
    out += [f"  - {_quote(s)}" for s in b["select"]]
    if b["group_by"]:
        out.append(f"group_by: [{', '.join(b['group_by'])}]")
    if b["having"]:
        out.append("having: " + _quote(" and ".join(f"({h})" for h in b["having"])))
    if b["order_by"]:
        out.append("order_by:")
        out += [f"  - {_quote(s)}" for s in b["order_by"]]
    if b["limit"] is not None:
        out.append(f"limit: {b['limit']}")
    return "\n".join(out) + "\n"


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _text(b: dict) -> str:
    out = ["binding generated"]
    if b["session"]:
        out.append("session uid: int")
    if b["stage"]:
        name, uri, alias, where, select, _ = STAGES[b["stage"]]
        w = f" where {where}" if where else ""
        out.append(f"with {name} as (from {uri} as {alias}{w} select {select})")
    for i, (a, where, derive) in enumerate(b["sources"]):
        uri, join, _ = SOURCES[a]
        out.append(f"from {uri} as {a}" if i == 0 else f"join {uri} as {a} on {join}")
        for w in where:
            out.append(f"where {w}")
        if b["session"] and a == "m":
            out.append("where id = {{session.uid}}")
        if derive:
            out.append("derive " + ", ".join(f"{n} = {e}" for n, e in derive))
    out.append("select " + ", ".join(b["select"]))
    if b["group_by"]:
        out.append("group by " + ", ".join(b["group_by"]))
    if b["having"]:
        out.append("having " + " and ".join(f"({h})" for h in b["having"]))
    if b["order_by"]:
        out.append("order by " + ", ".join(b["order_by"]))
    if b["limit"] is not None:
        out.append(f"limit {b['limit']}")
    return " ".join(out)


@SETTINGS
@given(binding())
def test_yaml_and_text_forms_give_identical_plans(b: dict) -> None:
    y_spec = load_text(_yaml(b), "gen.yaml")[0]
    t_spec = parse_binding_text(_text(b), "gen.txt")
    assert y_spec == t_spec
    p1, p2 = build(y_spec, CATALOG), build(t_spec, CATALOG)
    assert p1 == p2
    assert p1.explain() == p2.explain()


@SETTINGS
@given(binding())
def test_canonical_expression_text_round_trips(b: dict) -> None:
    for _a, where, _d in b["sources"]:
        for w in where:
            e = parse_expr(w)
            again = parse_expr(str(e))
            assert again == e
            assert str(again) == str(e)


# ------------------------------------------------------------------ fuzz

TOKENS = [
    "with",
    "having",
    "exists",
    "case",
    "when",
    "then",
    "else",
    "end",
    "cast",
    "stage://x",
    "date '2024-01-01'",
    "interval '1 month'",
    "from",
    "join",
    "where",
    "select",
    "as",
    "on",
    "and",
    "or",
    "not",
    "in",
    "(",
    ")",
    ",",
    "=",
    "<",
    "'x'",
    "1",
    "2.5",
    "m",
    "m.name",
    "mysql://shop/merchants",
    "dataset://news",
    "{{session.x}}",
    "{{",
    "}}",
    "group",
    "by",
    "order",
    "limit",
    "nearest",
    "to",
    "k",
    "*",
    "-",
    "interval",
    "'5 minutes'",
    "timestamp",
    "between",
    "like",
    "is",
    "null",
    "[",
    "]",
    "derive",
    "latest_by",
    "session",
    "x:",
    "int",
    "freshness",
    "max_lag=5s",
    "pushdown",
    "python",
    "desc",
    "nulls",
    "first",
    "count(*)",
    "\n",
    "`q`",
]


def _assert_positioned(e: DslError) -> None:
    assert e.diagnostics
    for d in e.diagnostics:
        assert d.span is not None and d.span.line >= 1 and d.span.col >= 1, d


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=25).map(" ".join))
def test_fuzz_token_soup_text_form(text: str) -> None:
    try:
        spec = parse_binding_text(text)
    except DslError as e:
        _assert_positioned(e)
        return
    try:
        build(spec, CATALOG)
    except DslError as e:
        _assert_positioned(e)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_arbitrary_expression_text(text: str) -> None:
    try:
        parse_expr(text, "f.yaml", 3, 10)
    except DslError as e:
        _assert_positioned(e)


FIXTURE_TEXTS = [p.read_text() for p in sorted(FIXTURES.glob("*.yaml")) if p.name != "fabric.yaml"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(FIXTURE_TEXTS),
    st.integers(0, 10_000),
    st.integers(0, 3),
    st.sampled_from(["", " ", "x", ":", "{", "}", "'", "\n", "-", "[", "\t", "{{", "(", "="]),
)
def test_fuzz_mutated_binding_files(text: str, pos: int, delete: int, insert: str) -> None:
    i = pos % (len(text) + 1)
    mutated = text[:i] + insert + text[i + delete :]
    try:
        specs = load_text(mutated, "mutated.yaml")
    except DslError as e:
        _assert_positioned(e)
        return
    for spec in specs:
        try:
            build(spec, CATALOG)
        except DslError as e:
            _assert_positioned(e)


@pytest.mark.timeout(20)
def test_deeply_nested_input_parses_without_hitting_recursion_limits() -> None:
    text = "(" * 3000 + "a" + ")" * 3000
    assert parse_expr(text) == parse_expr("a")
    with pytest.raises(DslError) as e:  # unbalanced: a positioned error, not a crash
        parse_expr("(" * 3000 + "a" + ")" * 2999)
    _assert_positioned(e.value)
