"""Binding files (YAML) -> ``BindingSpec``, validated strictly, with file positions.

A file holds one binding or several YAML documents (``---``), each a binding. All
problems of a document are collected (not just the first) so ``fabric validate`` can
print them together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dsl import parser as P
from dsl.errors import Diagnostic, DslError, Span, did_you_mean
from dsl.options import (
    RANK_KEYS,
    check_uri,
    duration_seconds,
    make_freshness,
    make_limits,
    make_nearest,
    make_rank,
    make_search,
)
from dsl.spec import (
    BindingSpec,
    CacheSpec,
    DeriveItem,
    JoinSpec,
    Name,
    PushdownSpec,
    SelectItem,
    SessionParam,
    SourceSpec,
)
from dsl.yamlpos import Container, Entry, YamlMap, YamlSeq, YamlText

BINDING_KEYS = (
    "binding",
    "description",
    "session",
    "sources",
    "stages",
    "select",
    "group_by",
    "having",
    "order_by",
    "limit",
    "offset",
    "pushdown",
    "cache",
)
#: a stage is a binding without session, pushdown, description or stages of its own
STAGE_KEYS = ("sources", "select", "group_by", "having", "order_by", "limit", "offset")
SOURCE_KEYS = (
    "from",
    "where",
    "join",
    "latest_by",
    "freshness",
    "derive",
    "nearest",
    "search",
    "rank",
)
JOIN_KEYS = ("on", "how")
NEAREST_KEYS = ("column", "to", "k", "metric")
SEARCH_KEYS = ("column", "query", "k")
FRESHNESS_KEYS = ("max_lag", "max_lag_messages", "on_stale", "wait_timeout")
PUSHDOWN_KEYS = ("python", "limits", "params")


def load_file(path: str | Path, display: str | None = None) -> list[BindingSpec]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise DslError.at(
            f"cannot read binding file: {e.strerror}", Span(display or str(p), 1, 1)
        ) from None
    return load_text(text, display or str(p))


def load_text(text: str, file: str = "<yaml>") -> list[BindingSpec]:
    """Every binding in a YAML text; raises DslError with all problems found."""
    y = YamlText(text, file)
    docs = y.documents()
    if not docs:
        raise y.error(
            "the binding file is empty", Span(file, 1, 1, 1, 2), "start with: binding: <name>"
        )
    specs, problems = [], []
    for doc in docs:
        try:
            specs.append(_binding(y, doc))
        except DslError as e:
            problems.extend(y.with_source(e).diagnostics)
    if problems:
        raise DslError(problems)
    seen: dict[str, BindingSpec] = {}
    for s in specs:
        if s.name in seen:
            raise y.error(f"binding '{s.name}' is defined twice in this file", s.name_span)
        seen[s.name] = s
    return specs


# ------------------------------------------------------------------ pieces


def _expr(y: YamlText, c: Container, key: Any, what: str):
    if isinstance(c[key], Container):
        kind = "mapping" if isinstance(c[key], YamlMap) else "list"
        span = y.value_span(c, key)
        hint = None
        if span is not None and "{{" in y.lines[span.line - 1]:
            hint = "quote it: a YAML value starting with '{' is a mapping, e.g. to: \"{{session.query_vec}}\""
        raise y.error(f"{what} must be an expression (text), got a {kind}", span, hint)
    text, ln, col, positions = y.scalar(c, key)
    return P.parse_expr(text, y.file, ln, col, positions=positions, what=what)


def _entry_parse(y: YamlText, e: Entry, fn, label: str, **kw):
    if e.container is not None or e.sub is not None or e.line == 0:
        raise y.error(f"{label} must be text", e.span)
    return fn(e.text, y.file, e.line, e.col, positions=e.positions, **kw)


def _parse_with(y: YamlText, c: Container, key: Any, fn, what: str):
    if isinstance(c[key], Container) or c[key] is None:
        raise y.error(f"{what} must be text", y.value_span(c, key))
    text, ln, col, positions = y.scalar(c, key)
    return fn(text, y.file, ln, col, positions=positions)


def _name(y: YamlText, c: Container, key: Any, what: str) -> Name:
    v = c[key]
    if not isinstance(v, str) or not v.strip():
        raise y.error(f"{what} must be a name", y.value_span(c, key))
    span = y.value_span(c, key)
    v = v.strip()
    if not v.replace("_", "a").replace(".", "a").isalnum() or v[0].isdigit():
        raise y.error(
            f"{what} '{v}' is not a valid name",
            span,
            "use letters, digits and _ (not starting with a digit)",
        )
    return Name(v, span)


def _key_name(y: YamlText, m: YamlMap, key: Any, what: str) -> Name:
    span = y.key_span(m, key)
    k = str(key)
    if not k.replace("_", "a").isalnum() or k[0].isdigit():
        raise y.error(
            f"{what} '{k}' is not a valid name",
            span,
            "use letters, digits and _ (not starting with a digit)",
        )
    return Name(k, span)


def _binding(y: YamlText, doc: Any) -> BindingSpec:
    if not isinstance(doc, YamlMap):
        raise y.error(
            "a binding file must be a mapping with 'binding:' and 'sources:'",
            y.node_span(doc) or Span(y.file, 1, 1),
        )
    problems: list[Diagnostic] = []

    def collect(fn, *args):
        try:
            return fn(*args)
        except DslError as e:
            problems.extend(y.with_source(e).diagnostics)
            return None

    collect(y.check_keys, doc, BINDING_KEYS, "binding", ("binding", "sources"))
    if "binding" not in doc:
        raise DslError(problems)
    name = _name(y, doc, "binding", "binding name")

    session = collect(_session, y, doc) or ()
    stages = collect(_stages, y, doc) or () if "stages" in doc else ()
    body = _body(y, doc, collect)
    pushdown = collect(_pushdown, y, doc) if "pushdown" in doc else None
    description = (
        collect(y.string, doc, "description", "description") if "description" in doc else None
    )
    cache = collect(_cache, y, doc, session) if "cache" in doc else None
    if problems:
        raise DslError(problems)
    return BindingSpec(
        name=name.value,
        session=session,
        stages=stages,
        pushdown=pushdown,
        description=description,
        cache=cache,
        file=y.file,
        span=y.node_span(doc),
        name_span=name.span,
        **body,
    )


def _stages(y: YamlText, doc: YamlMap) -> tuple[BindingSpec, ...]:
    m = y.mapping(doc, "stages", "stages")
    out, problems = [], []
    for key in m:
        try:
            name = _key_name(y, m, key, "stage name")
            sm = y.mapping(m, key, f"stage '{key}'")
            y.check_keys(sm, STAGE_KEYS, f"stage '{key}'", ("sources",))
            sub: list[Diagnostic] = []

            def collect(fn, *args, sub=sub):
                try:
                    return fn(*args)
                except DslError as e:
                    sub.extend(y.with_source(e).diagnostics)
                    return None

            body = _body(y, sm, collect)
            if sub:
                raise DslError(sub)
            out.append(
                BindingSpec(
                    name=name.value, file=y.file, span=name.span, name_span=name.span, **body
                )
            )
        except DslError as e:
            problems.extend(y.with_source(e).diagnostics)
    if problems:
        raise DslError(problems)
    return tuple(out)


def _body(y: YamlText, doc: YamlMap, collect: Any) -> dict[str, Any]:
    """sources, select, group_by, having, order_by, limit, offset of a binding or a stage."""
    sources = collect(_sources, y, doc) or () if "sources" in doc else ()
    select = collect(_select, y, doc) if "select" in doc else ()
    group_by: tuple = ()
    if "group_by" in doc:
        group_by = (
            collect(
                lambda: tuple(
                    x
                    for e in y.entries(doc, "group_by", mapping=False)
                    for x in _entry_parse(y, e, P.parse_exprs, "group_by", what="group_by")
                )
            )
            or ()
        )
    order_by: tuple = ()
    if "order_by" in doc:
        order_by = (
            collect(
                lambda: tuple(
                    x
                    for e in y.entries(doc, "order_by", mapping=False)
                    for x in _entry_parse(y, e, P.parse_order_by, "order_by")
                )
            )
            or ()
        )
    having: tuple = ()
    if "having" in doc:
        having = (
            collect(
                lambda: tuple(
                    _entry_parse(y, e, P.parse_expr, "having", what="having")
                    for e in y.entries(doc, "having", mapping=False)
                )
            )
            or ()
        )
    limit = collect(y.integer, doc, "limit", "limit") if "limit" in doc else None
    offset = collect(y.integer, doc, "offset", "offset") if "offset" in doc else 0
    return {
        "sources": sources,
        "select": select or (),
        "group_by": group_by,
        "having": having,
        "order_by": order_by,
        "limit": limit,
        "offset": offset or 0,
    }


def _session(y: YamlText, doc: YamlMap) -> tuple[SessionParam, ...]:
    if "session" not in doc or doc["session"] is None:
        return ()
    m = y.mapping(doc, "session", "session")
    out = []
    for key in m:
        n = _key_name(y, m, key, "session value")
        t = _parse_with(y, m, key, P.parse_type, f"type of session value '{key}'")
        out.append(SessionParam(n.value, t, span=n.span))
    return tuple(out)


def _sources(y: YamlText, doc: YamlMap) -> tuple[SourceSpec, ...]:
    m = y.mapping(doc, "sources", "sources")
    if not m:
        raise y.error("a binding needs at least one source", y.value_span(doc, "sources"))
    out, problems = [], []
    for key in m:
        try:
            out.append(_source(y, m, key))
        except DslError as e:
            problems.extend(y.with_source(e).diagnostics)
    if problems:
        raise DslError(problems)
    return tuple(out)


def _source(y: YamlText, parent: YamlMap, key: Any) -> SourceSpec:
    alias = _key_name(y, parent, key, "source alias")
    m = y.mapping(parent, key, f"source '{key}'")
    problems: list[Diagnostic] = []
    try:
        y.check_keys(m, SOURCE_KEYS, f"source '{key}'", required=("from",))
    except DslError as e:
        problems.extend(e.diagnostics)
        if "from" not in m:
            raise
    try:
        spec = _source_body(y, parent, key, alias, m)
    except DslError as e:
        raise DslError(problems + e.diagnostics) from None
    if problems:
        raise DslError(problems)
    return spec


def _source_body(
    y: YamlText,
    parent: YamlMap,
    key: Any,
    alias: Name,
    m: YamlMap,
) -> SourceSpec:
    uri = y.string(m, "from", "from")
    uri_span = y.value_span(m, "from")
    check_uri(uri.strip(), uri_span)
    where = (
        tuple(
            _entry_parse(y, e, P.parse_expr, "where", what="where")
            for e in y.entries(m, "where", mapping=False)
        )
        if "where" in m
        else ()
    )
    join = None
    if "join" in m:
        jv = m["join"]
        if isinstance(jv, YamlMap):
            y.check_keys(jv, JOIN_KEYS, "join", required=("on",))
            how = "inner"
            if "how" in jv:
                how = y.string(jv, "how", "join how")
                if how not in ("inner", "left"):
                    raise y.error(
                        f"join how must be inner or left, got {how!r}", y.value_span(jv, "how")
                    )
            join = JoinSpec(_expr(y, jv, "on", "join"), how, span=y.value_span(jv, "on"))
        else:
            join = JoinSpec(_expr(y, m, "join", "join"), "inner", span=y.value_span(m, "join"))
    latest_by = (
        tuple(_name(y, c, k, "latest_by column") for c, k in y.items(m, "latest_by"))
        if "latest_by" in m
        else ()
    )
    freshness = None
    if "freshness" in m:
        fm = y.mapping(m, "freshness", "freshness")
        y.check_keys(fm, FRESHNESS_KEYS, "freshness")
        freshness = make_freshness(
            [(str(k), fm[k], y.value_span(fm, k)) for k in fm], y.key_span(m, "freshness")
        )
    derive: tuple[DeriveItem, ...] = ()
    if "derive" in m:
        y.mapping(m, "derive", "derive")
        derive = tuple(
            DeriveItem(
                _entry_name(y, e, "derived column"),
                _entry_parse(y, e, P.parse_expr, f"derive {e.key}", what=f"derive {e.key}"),
            )
            for e in y.entries(m, "derive", mapping=True)
        )
    nearest = None
    if "nearest" in m:
        nm = y.mapping(m, "nearest", "nearest")
        y.check_keys(nm, NEAREST_KEYS, "nearest", required=("column", "to", "k"))
        nearest = make_nearest(
            _name(y, nm, "column", "nearest column"),
            _expr(y, nm, "to", "nearest to"),
            nm["k"],
            y.value_span(nm, "k"),
            nm.get("metric"),
            y.value_span(nm, "metric") if "metric" in nm else None,
            y.key_span(m, "nearest"),
        )
    search = None
    if "search" in m:
        sm = y.mapping(m, "search", "search")
        y.check_keys(sm, SEARCH_KEYS, "search", required=("column", "query", "k"))
        search = make_search(
            _name(y, sm, "column", "search column"),
            _expr(y, sm, "query", "search query"),
            sm["k"],
            y.value_span(sm, "k"),
            y.key_span(m, "search"),
        )
    rank = None
    if "rank" in m:
        rm = y.mapping(m, "rank", "rank")
        y.check_keys(rm, RANK_KEYS, "rank")
        rank = make_rank([(str(k), rm[k], y.value_span(rm, k)) for k in rm], y.key_span(m, "rank"))
    return SourceSpec(
        alias,
        uri.strip(),
        uri_span,
        where,
        join,
        latest_by,
        freshness,
        derive,
        nearest,
        search,
        rank,
        span=y.key_span(parent, key),
    )


def _entry_name(y: YamlText, e: Entry, what: str) -> Name:
    k = e.key or ""
    if not k.replace("_", "a").isalnum() or k[0].isdigit():
        raise y.error(
            f"{what} '{k}' is not a valid name",
            e.span,
            "use letters, digits and _ (not starting with a digit)",
        )
    return Name(k, e.span)


def _select(y: YamlText, doc: YamlMap) -> tuple[SelectItem, ...]:
    v = doc["select"]
    out: list[SelectItem] = []

    def aliased(entries: list[Entry]) -> None:
        for e in entries:
            n = _entry_name(y, e, "select alias")
            expr = _entry_parse(
                y, e, P.parse_expr, f"select item '{e.key}'", what=f"select item '{e.key}'"
            )
            out.append(SelectItem(expr, n.value, span=n.span))

    if isinstance(v, YamlMap):
        aliased(y.entries(doc, "select", mapping=True))
    elif isinstance(v, YamlSeq) and not v.fa.flow_style():
        for i, item in enumerate(v):
            if isinstance(item, YamlMap):
                aliased(y.entries(v, i, mapping=True))
            else:
                for e in y.entries(v, i, mapping=False):
                    out.extend(_entry_parse(y, e, P.parse_select, "select item"))
    else:
        for e in y.entries(doc, "select", mapping=False):
            if e.sub is not None:
                aliased(e.sub)
            else:
                out.extend(_entry_parse(y, e, P.parse_select, "select item"))
    return tuple(out)


def _pushdown(y: YamlText, doc: YamlMap) -> PushdownSpec:
    m = y.mapping(doc, "pushdown", "pushdown")
    y.check_keys(m, PUSHDOWN_KEYS, "pushdown", required=("python",))
    code = y.string(m, "python", "pushdown python")
    _, ln, col, positions = y.scalar(m, "python")
    if positions:
        ln, col = positions[0]
    limits = make_limits([])
    if "limits" in m:
        lm = y.mapping(m, "limits", "pushdown limits")
        limits = make_limits([(str(k), lm[k], y.value_span(lm, k)) for k in lm])
    params = (
        tuple(_name(y, c, k, "pushdown param") for c, k in y.items(m, "params"))
        if "params" in m
        else ()
    )
    return PushdownSpec(code, limits, params, y.file, ln, col, span=y.key_span(m, "python"))


CACHE_KEYS = ("by", "similarity", "ttl", "model", "dim", "max_entries", "max_mb", "prewarm")
_CACHE_BY = re.compile(
    r"^\s*\{\{\s*(?:(?P<embed>embed)\(\s*session\.(?P<t>\w+)\s*\)|session\.(?P<v>\w+))\s*\}\}\s*$"
)


def _cache(y: YamlText, doc: YamlMap, session: tuple[SessionParam, ...]) -> CacheSpec:
    """``cache: {by: "{{session.q_vec}}" | "{{embed(session.q)}}", similarity, ttl, ...}``."""
    m = y.mapping(doc, "cache", "cache")
    y.check_keys(m, CACHE_KEYS, "cache", required=("by",))
    by = y.string(m, "by", "cache by")
    match = _CACHE_BY.match(by)
    if match is None:
        raise y.error(
            f"cache by must be a session vector or an embedded session text, got {by!r}",
            y.value_span(m, "by"),
            'write by: "{{session.question_vec}}" or by: "{{embed(session.question)}}"',
        )
    embed = match["embed"] is not None
    pname = match["t"] if embed else match["v"]
    types = {p.name: p.type for p in session}
    if pname not in types:
        raise y.error(
            f"cache by names session.{pname}, which the binding's session does not declare",
            y.value_span(m, "by"),
            did_you_mean(pname, types, "session values"),
        )
    t = types[pname]
    if embed and t.kind != "str":
        raise y.error(
            f"cache by: embed() takes a str session value; session.{pname} is {t}",
            y.value_span(m, "by"),
            f'declare {pname}: str, or key the cache by a vector: by: "{{{{session.{pname}}}}}"',
        )
    if not embed and t.kind not in ("vector", "list"):
        raise y.error(
            f"cache by: session.{pname} is {t}, not a vector",
            y.value_span(m, "by"),
            f'declare {pname}: vector[N], or embed a text: by: "{{{{embed(session.{pname})}}}}"',
        )
    sim = m.get("similarity", 0.92)
    if isinstance(sim, bool) or not isinstance(sim, int | float) or not 0 < sim <= 1:
        raise y.error(
            f"cache similarity must be a number in (0, 1], got {sim!r}",
            y.value_span(m, "similarity"),
            "cosine similarity of the session's vector to a cached one, e.g. 0.92",
        )
    ttl: list[tuple[str, float]] = []
    if "ttl" in m:
        tv = m["ttl"]
        if isinstance(tv, YamlMap):
            for k in tv:
                ttl.append((str(k), duration_seconds(tv[k], y.value_span(tv, k), f"cache ttl {k}")))
        else:
            ttl.append(("default", duration_seconds(tv, y.value_span(m, "ttl"), "cache ttl")))
    ints = {}
    for key, default in (("dim", 256), ("max_entries", 1024)):
        v = m.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise y.error(
                f"cache {key} must be a positive integer, got {v!r}", y.value_span(m, key)
            )
        ints[key] = v
    model = str(m.get("model", "hash"))
    max_bytes = None
    if "max_mb" in m:
        mb = m["max_mb"]
        if isinstance(mb, bool) or not isinstance(mb, int | float) or mb <= 0:
            raise y.error(
                f"cache max_mb must be a positive number of megabytes, got {mb!r}",
                y.value_span(m, "max_mb"),
                "the memory the cached answers may take, e.g. max_mb: 64",
            )
        max_bytes = int(mb * 1024 * 1024)
    prewarm = None
    if "prewarm" in m:
        prewarm = m["prewarm"]
        if not isinstance(prewarm, str) or not prewarm.strip():
            raise y.error(
                f"cache prewarm must be the path of a JSON Lines file, got {prewarm!r}",
                y.value_span(m, "prewarm"),
                "write prewarm: sessions.jsonl (one session object a line, relative to "
                "this binding file)",
            )
    return CacheSpec(
        pname,
        embed,
        model,
        ints["dim"] if embed else (t.size or ints["dim"]),
        float(sim),
        tuple(ttl),
        ints["max_entries"],
        max_bytes,
        prewarm,
        y.value_span(m, "prewarm") if prewarm is not None else None,
        span=y.key_span(doc, "cache"),
    )
