"""BindingSpec + catalog -> the UNOPTIMIZED logical plan, with every semantic check.

Shape (bottom-up), for sources declared in order s1, s2, ...:

    Scan s1 (or VectorSearch for ``nearest``; its filters go inside)
    Filter   where-conjuncts of s1 over its own columns
    Derive   derive: of s1;  Filter  conjuncts over s1's derived columns
    Join     left-deep with s2 (same per-source stack), on s2's join:, ...
    Filter   conjuncts mentioning several sources, as soon as all are joined
    Aggregate  group_by / aggregates in select
    Sort     order_by (select aliases resolve to their expressions)
    EncryptedScore  select items scoring an encrypted session value
    Project  select
    Limit    limit / offset
    UserFunction  pushdown.python

Columns in the plan are qualified by source alias (``m.status``); filters inside a
``VectorSearch`` use the dataset's own names. Errors point into the binding file and
list what exists (sources, columns, session values, functions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from dsl import ast as A
from dsl.errors import Diagnostic, DslError, Span, did_you_mean
from dsl.spec import BindingSpec, SourceSpec
from dsl.types import ValueType, is_stage_param, stage_param
from fabric.plan import nodes as N
from fabric.plan.types import (
    ENCRYPTED,
    ENCRYPTED_FUNCTIONS,
    Env,
    comparable,
    infer,
    name_of,
    vector_size,
)

# the column a source with ``nearest:`` adds: the index's distance of each row to the query
# (float32; smaller is nearer), the VectorSearch node's ``distance_column``
DISTANCE = "_distance"
# the columns a ranked source adds (search: / rank:, docs/indexes.md "Ranking"): the
# keyword arm's BM25 relevance, and the ranking score (fused, or BM25 without rank:)
BM25 = "_bm25"
SCORE = "_score"
RANKED = (DISTANCE, BM25, SCORE)


def build(spec: BindingSpec, catalog: Any) -> N.Plan:
    """The logical plan of ``spec``; raises DslError with every problem found.

    Stages are built first, in order, each seeing the binding's session and the stages
    before it. A stage used as a source becomes a ``StageRef`` subtree; the stages used in
    expressions (exists, in, values) are computed first under a ``WithStages`` root."""
    stages: dict[str, _StageInfo] = {}
    used: list[str] = []  # stages used in expressions, then also those read more than once
    problems: list[Diagnostic] = []
    _check_names(spec, problems)
    if problems:
        raise DslError(problems)
    for st in spec.stages:
        sub = dataclasses.replace(st, session=spec.session, file=spec.file)
        try:
            plan = _Builder(sub, catalog, stages, used).build()
        except DslError as e:
            problems.extend(e.diagnostics)
            continue
        stages[st.name] = _StageInfo(st, plan, _one_row(st))
    if problems:
        raise DslError(problems)
    plan = _Builder(spec, catalog, stages, used).build()
    reads: dict[str, int] = {}
    for p in (plan, *(stages[n].plan for n in used)):
        for node in p.walk():
            if isinstance(node, N.StageRef):
                reads[node.stage] = reads.get(node.stage, 0) + 1
    shared = {n for n in stages if n in used or reads.get(n, 0) > 1}
    if not shared:
        return plan

    # a stage computed once: every stage:// source of it reads its result
    def once(p: N.Plan) -> N.Plan:
        if isinstance(p, N.StageRef) and p.stage in shared:
            return dataclasses.replace(p, input=N.StageResult(p.stage, p.input.schema))
        ch = p.children()
        return p.with_children(*(once(c) for c in ch)) if ch else p

    return N.WithStages(
        once(plan), tuple(N.Stage(once(stages[n].plan), n) for n in stages if n in shared)
    )


@dataclass(frozen=True)
class _StageInfo:
    spec: BindingSpec
    plan: N.Plan
    one_row: bool

    @property
    def columns(self) -> dict[str, pa.DataType]:
        return {f.name: f.type for f in self.plan.schema}


def _one_row(st: BindingSpec) -> bool:
    """A stage that returns at most one row: aggregates without group_by, or limit <= 1."""
    if st.limit is not None and st.limit <= 1:
        return True
    return not st.group_by and any(_has_agg(i.expr) for i in st.select)


def _check_names(spec: BindingSpec, problems: list[Diagnostic]) -> None:
    """Stage names and source aliases are unique across the whole binding."""
    seen: dict[str, str] = {}
    for st in spec.stages:
        if st.name in seen:
            problems.append(
                Diagnostic(f"stage '{st.name}' is declared twice", st.name_span, "rename one")
            )
        seen[st.name] = "a stage"
    for owner in (*spec.stages, spec):
        where = f"stage '{owner.name}'" if owner is not spec else "the binding"
        for s in owner.sources:
            a = s.alias.value
            if a in seen and seen[a] != f"a source of {where}":
                problems.append(
                    Diagnostic(
                        f"source alias '{a}' in {where} is already {seen[a]}",
                        s.alias.span,
                        "aliases are unique across the binding and its stages: rename it (as x)",
                    )
                )
            seen.setdefault(a, f"a source of {where}")


class _StageValue(ValueType):
    """The type of a stage result bound as a parameter (its arrow type as computed)."""

    def __init__(self, kind: str, arrow_type: pa.DataType):
        super().__init__(kind)
        object.__setattr__(self, "_arrow", arrow_type)

    def arrow(self) -> pa.DataType:
        return self._arrow  # type: ignore[attr-defined,no-any-return]


@dataclass(frozen=True)
class _StageView:
    """What a ``stage://NAME`` source looks like to the builder (a catalog view's shape)."""

    uri: str
    schema: pa.Schema
    kind: str = "stage"
    capabilities: frozenset[str] = frozenset()
    is_dataset: bool = False
    dataset: Any = None


def _agg_calls(e: A.Expr) -> list[A.Call]:
    out: list[A.Call] = []

    def go(x: A.Expr) -> None:
        if isinstance(x, A.Call) and x.is_aggregate:
            out.append(x)
            return
        for ch in x.children():
            go(ch)

    go(e)
    return out


def _has_agg(e: A.Expr) -> bool:
    return any(isinstance(x, A.Call) and x.is_aggregate for x in e.walk())


def _encrypted_params(e: A.Expr, params: dict[str, ValueType]) -> list[A.Param]:
    return [
        x
        for x in e.walk()
        if isinstance(x, A.Param) and x.name in params and params[x.name].encrypted
    ]


class _Builder:
    def __init__(
        self,
        spec: BindingSpec,
        catalog: Any,
        stages: dict[str, _StageInfo] | None = None,
        used: list[str] | None = None,
    ):
        self.spec = spec
        self.catalog = catalog
        self.stages: dict[str, _StageInfo] = stages if stages is not None else {}
        self.used: list[str] = used if used is not None else []  # stages used in expressions
        self.params: dict[str, ValueType] = spec.session_types
        self.problems: list[Diagnostic] = []
        # alias -> {column name -> type}, in declaration order (derived columns included)
        self.cols: dict[str, dict[str, pa.DataType]] = {}
        self.views: dict[str, Any] = {}
        self.nested: set[str] = set()  # dotted names of struct fields (not expanded by m.*)

    # ---- error collection
    def attempt(self, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except DslError as e:
            self.problems.extend(e.diagnostics)
            return default

    def fail_if_problems(self) -> None:
        if self.problems:
            raise DslError(self.problems)

    def env(self, aliases: list[str] | None = None) -> Env:
        cols: dict[str, pa.DataType] = {}
        for a in aliases if aliases is not None else list(self.cols):
            for n, t in self.cols[a].items():
                cols[f"{a}.{n}"] = t
        return Env(cols, self.params)

    # ---- column resolution
    def qualify(self, e: A.Expr, scope: list[str], local: str | None, what: str) -> A.Expr:
        """Qualify every column of ``e`` against the sources in ``scope`` (``local`` first)."""

        def fix(n: A.Expr) -> A.Expr | None:
            if isinstance(n, A.Column):
                return self._column(n, scope, local, what)
            if isinstance(n, A.Star) and n.source is not None and n.source not in scope:
                raise DslError.at(
                    f"unknown source '{n.source}' in {what}",
                    n.span,
                    did_you_mean(n.source, scope, "sources"),
                )
            return None

        return A.replace(e, fix, pre=partial(self._subquery, scope=scope, local=local, what=what))

    # ---- stages in expressions
    def _stage(self, name: str, span: Span | None) -> _StageInfo:
        info = self.stages.get(name)
        if info is None:
            raise DslError.at(
                f"unknown stage '{name}'",
                span,
                did_you_mean(name, self.stages, "stages")
                if self.stages
                else "declare it under stages: (before the stage or binding that uses it)",
            )
        if name not in self.used:
            self.used.append(name)
        return info

    def _subquery(
        self, n: A.Expr, *, scope: list[str], local: str | None, what: str
    ) -> A.Expr | None:
        """Stage references (top-down, before columns are qualified): ``exists(S ...)``,
        ``x in S`` and the value ``S.col`` of a one-row stage."""
        if isinstance(n, A.Exists):
            if not what.startswith(("where", "having")):
                raise DslError.at(
                    f"exists() is not allowed in {what}",
                    n.span,
                    "use exists() in where or having",
                )
            info = self._stage(n.stage, n.span)
            if n.where is None:
                name = stage_param(n.stage, "exists")
                self.params[name] = _StageValue("bool", pa.bool_())
                return A.Param(name, span=n.span)
            cond = self._correlated(n, info, scope, local, what)
            return A.Exists(n.stage, cond, span=n.span)
        if isinstance(n, A.Param) and is_stage_param(n.name):
            stage = n.name[6:].partition(":")[0]
            info = self._stage(stage, n.span)
            cols = info.columns
            if len(cols) != 1:
                raise DslError.at(
                    f"'in {stage}' needs a stage with one column; '{stage}' has {len(cols)} "
                    f"({', '.join(cols)})",
                    n.span,
                    f"select one column in stage '{stage}', or use exists({stage} where ...)",
                )
            t = next(iter(cols.values()))
            self.params[n.name] = _StageValue("list", pa.list_(t))
            return None
        if (
            isinstance(n, A.Column)
            and n.source in self.stages
            and n.source not in scope
            and not (local and self._has(local, f"{n.source}.{n.name}"))
        ):
            info = self._stage(n.source, n.span)
            cols = info.columns
            if n.name not in cols:
                raise DslError.at(
                    f"stage '{n.source}' has no column '{n.name}'",
                    n.span,
                    did_you_mean(n.name, cols, "columns"),
                )
            if not info.one_row:
                raise DslError.at(
                    f"stage '{n.source}' is used as a value, but it can return several rows",
                    n.span,
                    f"make it one row (an aggregate without group_by, or limit: 1), or join it: "
                    f"from: stage://{n.source}",
                )
            name = stage_param(n.source, n.name)
            self.params[name] = _StageValue(name_of(cols[n.name]), cols[n.name])
            return A.Param(name, span=n.span)
        return None

    def _correlated(
        self, n: A.Exists, info: _StageInfo, scope: list[str], local: str | None, what: str
    ) -> A.Expr:
        """The condition of ``exists(S where COND)``: ``S.col`` (or an unqualified column
        the stage has) is the stage's; other columns are the enclosing sources'."""
        cols = info.columns
        assert n.where is not None

        def fix(c: A.Expr) -> A.Expr | None:
            if not isinstance(c, A.Column):
                return None
            if c.source == n.stage or (c.source is None and c.name in cols):
                if c.name not in cols:
                    raise DslError.at(
                        f"stage '{n.stage}' has no column '{c.name}'",
                        c.span,
                        did_you_mean(c.name, cols, "columns"),
                    )
                return A.Column(c.name, n.stage, span=c.span)
            return self._column(c, scope, local if c.source is None else None, what)

        def pre(c: A.Expr) -> A.Expr | None:
            if isinstance(c, A.Column) and c.source == n.stage:
                return fix(c)
            return self._subquery(c, scope=scope, local=local, what=what)

        cond = A.replace(n.where, fix, pre=pre)
        env = self.env([a for a in scope if a in self.cols])
        env = Env({**env.columns, **{f"{n.stage}.{c}": t for c, t in cols.items()}}, self.params)
        self.check_bool(cond, env, f"the condition of exists({n.stage})")
        return cond

    def _column(self, c: A.Column, scope: list[str], local: str | None, what: str) -> A.Column:
        if c.source is not None:
            if c.source in scope:
                return self._in_source(c, c.source, c.name)
            # ``meta.city`` where meta is a (struct) column, not a source alias
            dotted = f"{c.source}.{c.name}"
            owners = [a for a in ([local] if local else scope) if a and self._has(a, dotted)]
            if len(owners) == 1:
                return A.Column(dotted, owners[0], span=c.span)
            later = [a for a in self.spec_aliases() if a not in scope]
            if c.source in later:
                raise DslError.at(
                    f"source '{c.source}' is not available in {what}",
                    c.span,
                    f"'{c.source}' is joined later; here you can use: {', '.join(scope)}",
                )
            raise DslError.at(
                f"unknown source '{c.source}' in {what}",
                c.span,
                did_you_mean(c.source, scope, "sources"),
            )
        if local is not None:
            if self._has(local, c.name):
                return A.Column(c.name, local, span=c.span)
            raise DslError.at(
                f"unknown column '{c.name}' in source '{local}'",
                c.span,
                self._hint(local, c.name),
            )
        owners = [a for a in scope if self._has(a, c.name)]
        if len(owners) == 1:
            return A.Column(c.name, owners[0], span=c.span)
        if len(owners) > 1:
            raise DslError.at(
                f"column '{c.name}' is ambiguous",
                c.span,
                f"qualify it: {' or '.join(f'{a}.{c.name}' for a in owners)}",
            )
        every = sorted({f"{a}.{n}" for a in scope for n in self.cols[a]})
        close = did_you_mean(c.name, {n.split(".", 1)[1] for n in every}, "columns")
        raise DslError.at(
            f"unknown column '{c.name}'",
            c.span,
            close if close.startswith("did") else f"existing columns: {', '.join(every)}",
        )

    def _has(self, alias: str, name: str) -> bool:
        return name in self.cols.get(alias, {})

    def _hint(self, alias: str, name: str) -> str:
        if name == DISTANCE:
            return f"_distance exists only on a source with nearest:; add nearest: to '{alias}'"
        if name == BM25:
            return f"_bm25 exists only on a source with search:; add search: to '{alias}'"
        if name == SCORE:
            return (
                f"_score exists only on a source with search: or rank:; add search: "
                f"{{column, query, k}} to '{alias}'"
            )
        return did_you_mean(name, self.cols[alias], "columns")

    def _in_source(self, c: A.Column, alias: str, name: str) -> A.Column:
        if not self._has(alias, name):
            raise DslError.at(
                f"unknown column '{name}' in source '{alias}' ({self.views[alias].uri})",
                c.span,
                self._hint(alias, name),
            )
        return A.Column(name, alias, span=c.span)

    def resolve(self, uri: str, span: Span | None) -> Any:
        """The planning view of a source: the catalog's, or a stage's output."""
        if uri.startswith("stage://"):
            name = uri[len("stage://") :]
            info = self._stage_source(name, span)
            return _StageView(uri, info.plan.schema)
        return self.catalog.resolve(uri, span)

    def _stage_source(self, name: str, span: Span | None) -> _StageInfo:
        info = self.stages.get(name)
        if info is None:
            raise DslError.at(
                f"unknown stage '{name}'",
                span,
                did_you_mean(name, self.stages, "stages")
                if self.stages
                else "declare it under stages: (before the stage or binding that uses it)",
            )
        return info

    def spec_aliases(self) -> list[str]:
        return [s.alias.value for s in self.spec.sources]

    def check_no_agg(self, e: A.Expr, what: str) -> None:
        for x in e.walk():
            if isinstance(x, A.Call) and x.is_aggregate:
                raise DslError.at(
                    f"aggregate {x.name}() is not allowed in {what}",
                    x.span,
                    "aggregates belong in select (with group_by)",
                )

    def check_not_encrypted(self, e: A.Expr, what: str) -> None:
        for p in _encrypted_params(e, self.params):
            raise DslError.at(
                f"encrypted session value '{p.name}' cannot be used in {what}",
                p.span,
                f"the fabric never sees its plain value; score it in select with "
                f"{', '.join(f'{f}()' for f in ENCRYPTED_FUNCTIONS)}",
            )

    def check_bool(self, e: A.Expr, env: Env, what: str) -> None:
        t = infer(e, env)
        if not (pa.types.is_boolean(t) or pa.types.is_null(t)):
            raise DslError.at(
                f"{what} must be a true/false condition; {e} is {name_of(t)}",
                e.span,
                "compare it, e.g. x > 0 or x = 'value'",
            )

    # ---- the plan
    def build(self) -> N.Plan:
        spec = self.spec
        if not spec.sources:
            raise DslError.at(
                f"binding '{spec.name}' has no sources",
                spec.span,
                "add sources: (or from ... in text)",
            )
        seen: dict[str, SourceSpec] = {}
        for s in spec.sources:
            if s.alias.value in seen:
                self.problems.append(
                    Diagnostic(
                        f"source alias '{s.alias.value}' is used twice",
                        s.alias.span,
                        "give each source its own alias (as x)",
                    )
                )
            seen[s.alias.value] = s
            view = self.attempt(partial(self.resolve, s.uri, s.uri_span))
            if view is not None:
                self.views[s.alias.value] = view
                self.cols[s.alias.value] = _columns(view.schema, self.nested, s.alias.value)
                if s.nearest is not None:  # the search's distance to the query, per row
                    self.cols[s.alias.value][DISTANCE] = pa.float32()
                if s.search is not None:  # BM25 relevance to the query text, per row
                    self.cols[s.alias.value][BM25] = pa.float64()
                if s.search is not None or s.rank is not None:
                    self.cols[s.alias.value][SCORE] = pa.float64()
        self.fail_if_problems()

        plan: N.Plan | None = None
        joined: list[str] = []
        failed: set[str] = set()  # sources whose own plan failed (their problem is recorded)
        deferred: list[tuple[A.Expr, set[str]]] = []
        for s in spec.sources:
            alias = s.alias.value
            leaf, cross = self.attempt(partial(self.source_plan, s), (None, []))
            deferred.extend(cross)
            if leaf is None:
                joined.append(alias)
                failed.add(alias)
                continue
            if plan is None:
                if s.join is not None and joined == []:
                    self.problems.append(
                        Diagnostic(
                            f"the first source '{alias}' cannot have join:",
                            s.join.span,
                            "join: belongs to the sources that follow",
                        )
                    )
                plan = leaf
            else:
                on = self.attempt(partial(self.join_condition, s, joined))
                if on is not None and not A.sources_of(on) & failed:
                    plan = N.Join(plan, leaf, on, s.join.how if s.join else "inner")
                else:  # its join failed, or joins a source that did (recorded): not joined
                    failed.add(alias)
            joined.append(alias)
            if plan is not None:
                # a condition over a source that failed is not placed: the plan lacks it
                placed = [a for a in joined if a not in failed]
                plan = self.apply_deferred(plan, deferred, placed)
        self.fail_if_problems()
        assert plan is not None
        for e, _aliases in deferred:
            self.problems.append(
                Diagnostic(f"condition {e} refers to sources that are never joined", e.span)
            )
        self.fail_if_problems()
        return self.finish(plan, joined)

    def apply_deferred(
        self, plan: N.Plan, deferred: list[tuple[A.Expr, set[str]]], joined: list[str]
    ) -> N.Plan:
        ready = [e for e, al in deferred if al <= set(joined)]
        if ready:
            deferred[:] = [(e, al) for e, al in deferred if not al <= set(joined)]
            plan = N.Filter(plan, A.and_all(ready))  # type: ignore[arg-type]
        return plan

    def source_plan(self, s: SourceSpec) -> tuple[N.Plan, list[tuple[A.Expr, set[str]]]]:
        alias = s.alias.value
        view = self.views[alias]
        # _distance / _bm25 / _score exist only after the search: a where on them is
        # applied above it
        base_cols = set(self.cols[alias]) - set(RANKED)
        fresh = None
        if s.freshness is not None:
            f = s.freshness
            fresh = N.Freshness(f.max_lag_seconds, f.max_lag_messages, f.on_stale, f.wait_timeout)
        # derived columns first, so where-conjuncts may use them
        derived: list[tuple[str, A.Expr, pa.DataType]] = []
        for d in s.derive:
            name = d.name.value
            if name in self.cols[alias]:
                raise DslError.at(
                    f"derived column '{name}' already exists in source '{alias}'",
                    d.name.span,
                    "pick another name",
                )
            e = self.qualify(d.expr, [alias], alias, f"derive of '{alias}'")
            self.check_no_agg(e, "derive")
            self.check_not_encrypted(e, "derive")
            t = infer(e, self.env([alias]))
            derived.append((f"{alias}.{name}", e, t))
            self.cols[alias][name] = t
        scope = [a for a in self.spec_aliases() if a in self.cols]
        local: list[A.Expr] = []
        local_derived: list[A.Expr] = []
        cross: list[tuple[A.Expr, set[str]]] = []
        for w in s.where:
            for conj in A.conjuncts(w):
                e = self._qualify_where(conj, alias, scope)
                self.check_no_agg(e, "where")
                self.check_not_encrypted(e, "where")
                self.check_bool(e, self.env(), "where")
                refs = A.sources_of(e) - set(self.stages)
                if refs <= {alias}:
                    uses_derived = any(
                        c.name not in base_cols for c in e.columns() if c.source == alias
                    )
                    (local_derived if uses_derived else local).append(e)
                else:
                    cross.append((e, refs | {alias}))
        if s.latest_by:
            if "latest_by" not in view.capabilities:
                raise DslError.at(
                    f"latest_by needs a source that keeps the newest record per key; {view.uri} "
                    f"({view.kind}) cannot",
                    s.latest_by[0].span,
                    "use latest_by on a kafka:// stream or a dataset, or aggregate with max()",
                )
            for n in s.latest_by:
                if n.value not in base_cols:
                    raise DslError.at(
                        f"unknown latest_by column '{n.value}' in source '{alias}'",
                        n.span,
                        did_you_mean(n.value, base_cols, "columns"),
                    )
        if s.nearest is not None or s.search is not None or s.rank is not None:
            leaf: N.Plan = self.vector_search(s, view, local, fresh)
        elif isinstance(view, _StageView):
            if fresh is not None:
                raise DslError.at(
                    "freshness applies to the stage's own sources, not to stage://",
                    s.freshness.span if s.freshness else s.span,
                    "move freshness: to the sources inside the stage",
                )
            leaf = N.StageRef(self.stages[view.uri[len("stage://") :]].plan, alias, view.uri[8:])
            if local:
                leaf = N.Filter(leaf, A.and_all(local))  # type: ignore[arg-type]
        else:
            leaf = N.Scan(
                alias,
                view.uri,
                view.schema,
                latest_by=tuple(n.value for n in s.latest_by),
                freshness=fresh,
            )
            if local:
                leaf = N.Filter(leaf, A.and_all(local))  # type: ignore[arg-type]
        if derived:
            leaf = N.Derive(leaf, tuple(derived))
        if local_derived:
            leaf = N.Filter(leaf, A.and_all(local_derived))  # type: ignore[arg-type]
        return leaf, cross

    def _qualify_where(self, e: A.Expr, alias: str, scope: list[str]) -> A.Expr:
        """Unqualified columns in a source's where belong to that source; qualified ones may
        name other sources (the condition then applies after the join)."""

        def fix(n: A.Expr) -> A.Expr | None:
            if isinstance(n, A.Column):
                if n.source is None:
                    return self._column(n, scope, alias, f"where of '{alias}'")
                return self._column(n, scope, None, f"where of '{alias}'")
            return None

        return A.replace(
            e,
            fix,
            pre=partial(self._subquery, scope=scope, local=alias, what=f"where of '{alias}'"),
        )

    def vector_search(
        self, s: SourceSpec, view: Any, local: list[A.Expr], fresh: N.Freshness | None
    ) -> N.Plan:
        if s.nearest is None:
            return self.ranked(s, view, local, fresh, None)
        nr = s.nearest
        alias = s.alias.value
        if not view.is_dataset:
            raise DslError.at(
                f"nearest needs an indexed dataset (dataset://<name>); {view.uri} is a {view.kind} source",
                nr.span,
                "declare a dataset in fabric.yaml with an hnsw index and read from dataset://",
            )
        col = nr.column.value
        schema: pa.Schema = view.schema
        if col not in schema.names:
            raise DslError.at(
                f"unknown column '{col}' in dataset {view.uri}",
                nr.column.span,
                did_you_mean(col, schema.names, "columns"),
            )
        ct = schema.field(col).type
        if not pa.types.is_fixed_size_list(ct):
            vecs = [f.name for f in schema if pa.types.is_fixed_size_list(f.type)]
            raise DslError.at(
                f"nearest column '{col}' is {name_of(ct)}, not a vector",
                nr.column.span,
                f"vector columns: {', '.join(vecs)}"
                if vecs
                else "this dataset has no vector[N] column",
            )
        # a one-row stage's value may be the query vector (a step feeding the next)
        to = A.replace(
            nr.to, lambda _: None, pre=partial(self._subquery, scope=[], local=None, what="nearest")
        )
        nr = dataclasses.replace(nr, to=to)
        embedded = isinstance(nr.to, A.Call) and nr.to.name == "embed"
        if isinstance(nr.to, A.Call) and embedded:  # typed by embed_query: vector[N]
            nr = dataclasses.replace(nr, to=self.embed_query(nr.to, view, col, ct.list_size))
        elif nr.to.columns():
            raise DslError.at(
                "nearest to: must be a session value or a constant vector, not a column",
                nr.to.span,
                'e.g. to: "{{session.query_vec}}"',
            )
        self.check_not_encrypted(nr.to, "nearest")
        tt = ct if embedded else infer(nr.to, self.env([alias]))
        size = vector_size(nr.to, tt)
        if not (
            pa.types.is_fixed_size_list(tt)
            or (isinstance(nr.to, A.Literal) and nr.to.type == "list")
        ):
            from_stage = isinstance(nr.to, A.Param) and is_stage_param(nr.to.name)
            raise DslError.at(
                f"nearest to: must be a vector; {nr.to} is {name_of(tt)}",
                nr.to.span,
                f"select a vector[{ct.list_size}] column in that stage (e.g. its embedding)"
                if from_stage
                else f"declare the session value as vector[{ct.list_size}]",
            )
        if size is not None and size != ct.list_size:
            raise DslError.at(
                f"vector size mismatch: {nr.to} has {size} values, column '{col}' is "
                f"vector[{ct.list_size}]",
                nr.to.span,
                f"declare the session value as vector[{ct.list_size}]",
            )
        metric = nr.metric
        idx = view.dataset.index(col) if view.dataset is not None else None
        if metric is None and idx is not None:
            metric = idx.metric
        # the search always ranks by the index's metric (hnsw defaults to cosine), and
        # _distance is that metric's number: another metric here would be a quiet lie
        built = (idx.metric or "cosine") if idx is not None and idx.kind == "hnsw" else None
        live = getattr(getattr(view, "source", None), "dataset", None)
        spec = getattr(live, "specs", {}).get(col) if live is not None else None
        built = getattr(spec, "metric", None) or built
        if nr.metric is not None and built is not None and nr.metric != built:
            raise DslError.at(
                f"nearest metric {nr.metric} differs from the {built} index on '{col}' "
                f"in {view.uri}; the search ranks by the index's metric",
                nr.span,
                f"drop metric: (or write metric: {built}), or index '{col}' with "
                f"metric: {nr.metric}",
            )
        filters = tuple(A.unqualify(e) for e in local)
        vs = N.VectorSearch(
            alias, view.uri, schema, col, nr.to, nr.k, filters, metric=metric, freshness=fresh
        )
        if s.search is not None or s.rank is not None:
            return self.ranked(s, view, local, fresh, vs)
        return vs

    def ranked(
        self,
        s: SourceSpec,
        view: Any,
        local: list[A.Expr],
        fresh: N.Freshness | None,
        vs: N.VectorSearch | None,
    ) -> N.VectorSearch:
        """A source with ``search:`` (BM25 over an inverted index) and/or ``rank:`` (RRF
        of its arms, optional recency decay): the VectorSearch ``vs`` of its ``nearest:``
        (if any) with the keyword arm and the fusion added."""
        alias = s.alias.value
        what = "search" if s.search is not None else "rank"
        span = s.search.span if s.search is not None else s.rank.span if s.rank else s.span
        if not view.is_dataset:
            raise DslError.at(
                f"{what} needs an indexed dataset (dataset://<name>); {view.uri} is a "
                f"{view.kind} source",
                span,
                "declare a dataset in fabric.yaml with an inverted index and read from dataset://",
            )
        schema: pa.Schema = view.schema
        text = None
        if s.search is not None:
            text = self.text_arm(s, view, schema)
        fusion = None
        if s.rank is not None:
            r = s.rank
            if s.nearest is None and s.search is None:
                raise DslError.at(
                    "rank fuses the source's nearest: and search: results; it has neither",
                    r.span,
                    "add search: {column, query, k} and/or nearest: {column, to, k}",
                )
            recency = None
            if r.recency is not None:
                recency = r.recency.value
                if recency not in schema.names:
                    raise DslError.at(
                        f"unknown recency column '{recency}' in dataset {view.uri}",
                        r.recency.span,
                        did_you_mean(recency, schema.names, "columns"),
                    )
                if not pa.types.is_timestamp(schema.field(recency).type):
                    stamps = [f.name for f in schema if pa.types.is_timestamp(f.type)]
                    raise DslError.at(
                        f"rank recency column '{recency}' is "
                        f"{name_of(schema.field(recency).type)}, not a timestamp",
                        r.recency.span,
                        f"timestamp columns: {', '.join(stamps)}"
                        if stamps
                        else "this dataset has no timestamp column",
                    )
            fusion = N.RankFusion(r.rrf_k, r.k, recency, r.half_life_seconds)
        if vs is not None:
            return dataclasses.replace(vs, text=text, fusion=fusion)
        assert text is not None  # rank without either arm was refused above
        return N.VectorSearch(
            alias,
            view.uri,
            schema,
            None,
            None,
            text.k,
            tuple(A.unqualify(e) for e in local),
            freshness=fresh,
            text=text,
            fusion=fusion,
        )

    def text_arm(self, s: SourceSpec, view: Any, schema: pa.Schema) -> N.TextArm:
        sr = s.search
        assert sr is not None
        alias = s.alias.value
        col = sr.column.value
        if col not in schema.names:
            raise DslError.at(
                f"unknown column '{col}' in dataset {view.uri}",
                sr.column.span,
                did_you_mean(col, schema.names, "columns"),
            )
        # the index the dataset declares (fabric.yaml) or holds (a registered dataset)
        idx = view.dataset.index(col) if view.dataset is not None else None
        live = getattr(getattr(view, "source", None), "dataset", None)
        specs = getattr(live, "specs", None) or {}
        inverted = sorted(c for c, sp in specs.items() if getattr(sp, "kind", None) == "inverted")
        if view.dataset is not None:
            inverted = sorted(
                set(inverted) | {i.column for i in view.dataset.indexes if i.kind == "inverted"}
            )
        kind = getattr(specs.get(col), "kind", None) or (idx.kind if idx is not None else None)
        if kind != "inverted":
            name = view.uri[len("dataset://") :]
            raise DslError.at(
                f"search column '{col}' has no inverted index in {view.uri}"
                + (f" (it has a {kind} index)" if kind else ""),
                sr.column.span,
                f"declare one in fabric.yaml: datasets: {{{name}: {{indexes: {{{col}: inverted}}}}}}"
                + (f" (inverted columns now: {', '.join(inverted)})" if inverted else ""),
            )
        q = A.replace(
            sr.query,
            lambda _: None,
            pre=partial(self._subquery, scope=[], local=None, what="search"),
        )
        if q.columns():
            raise DslError.at(
                "search query: must be a session value or a constant text, not a column",
                q.span,
                'e.g. query: "{{session.question}}"',
            )
        self.check_not_encrypted(q, "search")
        qt = infer(q, self.env([alias]))
        if not (pa.types.is_string(qt) or pa.types.is_large_string(qt)):
            raise DslError.at(
                f"search query: must be text; {q} is {name_of(qt)}",
                q.span,
                "declare the session value as str",
            )
        return N.TextArm(col, q, sr.k)

    def embed_query(self, call: A.Call, view: Any, col: str, dim: int) -> A.Call:
        """``{{embed(session.q)}}``: the text ``q`` embedded at run time by the model the
        dataset declared for ``col`` (``embed: {into: col, model: ...}``), else ``hash``;
        becomes ``embed(q, '<model>', <dim>)``, typed vector[dim]."""
        from fabric.embed import DEFAULT_MODEL

        arg = call.args[0] if len(call.args) == 1 else None
        if not isinstance(arg, A.Param):
            raise DslError.at(
                "embed() takes one session value", call.span, "write {{embed(session.question)}}"
            )
        if arg.name not in self.params:
            raise DslError.at(
                f"unknown session value '{arg.name}' in embed()",
                call.span,
                did_you_mean(arg.name, self.params, "session values"),
            )
        at = infer(arg, self.env([]))
        if not (pa.types.is_string(at) or pa.types.is_large_string(at)):
            raise DslError.at(
                f"embed() needs text; session value '{arg.name}' is {name_of(at)}",
                call.span,
                f"declare {arg.name}: str",
            )
        specs = getattr(view.dataset, "embed", ()) if view.dataset is not None else ()
        model = next((e.model for e in specs if e.into == col), DEFAULT_MODEL)
        return A.Call(
            "embed",
            (arg, A.Literal(model, "str"), A.Literal(dim, "int")),
            span=call.span,
        )

    def join_condition(self, s: SourceSpec, joined: list[str]) -> A.Expr:
        alias = s.alias.value
        if s.join is None:
            raise DslError.at(
                f"source '{alias}' needs a join: condition",
                s.span or s.alias.span,
                f"e.g. join: {alias}.<column> = {joined[-1]}.<column>",
            )
        scope = [*joined, alias]
        on = self.qualify(s.join.on, scope, None, f"join of '{alias}'")
        self.check_no_agg(on, "join")
        self.check_not_encrypted(on, "join")
        env = self.env(scope)
        for conj in A.conjuncts(on):
            if isinstance(conj, A.Binary) and conj.op == "=":
                lt, rt = infer(conj.left, env), infer(conj.right, env)
                if not comparable(lt, rt):
                    raise DslError.at(
                        f"join between incompatible types: {conj.left} is {name_of(lt)}, "
                        f"{conj.right} is {name_of(rt)}",
                        conj.span,
                        "join columns of the same kind (convert one in derive: if needed)",
                    )
        self.check_bool(on, env, "join")
        refs = A.sources_of(on)
        if alias not in refs or not refs - {alias}:
            raise DslError.at(
                f"join of '{alias}' must relate '{alias}' to an earlier source",
                s.join.span,
                f"e.g. join: {alias}.<column> = {joined[-1]}.<column>",
            )
        return on

    # ---- select / group / order / limit / pushdown
    def finish(self, plan: N.Plan, joined: list[str]) -> N.Plan:
        spec = self.spec
        env = self.env(joined)
        items = self.attempt(lambda: self.select_items(joined), [])
        group = []
        for g in spec.group_by:
            ge = self.attempt(partial(self._group_key, g, joined))
            if ge is not None:
                group.append(ge)
        having = []
        for h in spec.having:
            hq = self.attempt(partial(self._having, h, joined, items, env))
            if hq is not None:
                having.append(hq)
        self.fail_if_problems()
        aggregating = bool(group) or bool(having) or any(_has_agg(e) for _, e, _s in items)
        encrypted = {n for n, e, _s in items if _encrypted_params(e, self.params)}
        if aggregating:
            plan, items, post_env, key_map = self.aggregate(plan, items, group, env, having)
        else:
            post_env, key_map = env, {}
        sort_keys = []
        for k in spec.order_by:
            sk = self.attempt(
                partial(self.sort_key, k, joined, items, post_env, key_map, aggregating, encrypted)
            )
            if sk is not None:
                sort_keys.append(sk)
        self.fail_if_problems()
        if sort_keys:
            plan = N.Sort(plan, tuple(sort_keys))
        proj: list[tuple[str, A.Expr, pa.DataType]] = []
        for name, e, span in items:
            if name in encrypted:
                score = self.attempt(partial(self.encrypted_score, e, span, post_env))
                if score is not None:
                    plan = N.EncryptedScore(plan, name, score[0], score[1])
                    proj.append((name, A.Column(name, span=e.span), pa.binary()))
                continue
            t = self.attempt(partial(infer, e, post_env))
            if t is not None:
                proj.append((name, e, t))
        self.fail_if_problems()
        plan = N.Project(plan, tuple(proj))
        if spec.limit is not None or spec.offset:
            plan = N.Limit(plan, spec.limit if spec.limit is not None else 2**63 - 1, spec.offset)
        if spec.pushdown is not None:
            plan = self.user_function(plan)
        return plan

    def select_items(self, joined: list[str]) -> list[tuple[str, A.Expr, Span | None]]:
        """(output name, qualified expression, span) per select item; ``m.*`` expanded."""
        out: list[tuple[str, A.Expr, Span | None]] = []
        names: dict[str, Span | None] = {}
        explicit: set[str] = set()
        items = self.spec.select or tuple(_star_item(None))
        for it in items:
            e = it.expr
            if isinstance(e, A.Star):
                aliases = [e.source] if e.source else joined
                for a in aliases:
                    if a not in joined:
                        raise DslError.at(
                            f"unknown source '{a}' in select",
                            e.span,
                            did_you_mean(a, joined, "sources"),
                        )
                    for col in [c for c in self.cols[a] if f"{a}.{c}" not in self.nested]:
                        expr = A.Column(col, a, span=e.span)
                        if any(x == expr for _, x, _s in out):
                            continue  # already selected explicitly
                        name = col if col not in names else f"{a}.{col}"
                        if name in names:
                            continue
                        names[name] = it.span
                        out.append((name, expr, it.span))
                continue
            q = self.attempt(partial(self.qualify, e, joined, None, "select"))
            if q is None:
                continue
            if it.alias:
                name = it.alias
            elif isinstance(q, A.Column):
                name = q.name.rsplit(".", 1)[-1]  # nested c.meta.city -> city
            else:
                name = str(e)
            if name in names:
                if name in explicit or it.alias:
                    self.problems.append(
                        Diagnostic(
                            f"output column '{name}' is selected twice",
                            it.span or e.span,
                            f"rename one: {e} as <other_name>",
                        )
                    )
                    continue
                # a plain column colliding with a star expansion: qualify the later one
                name = f"{q.source}.{q.name}" if isinstance(q, A.Column) and q.source else name
            names[name] = it.span
            explicit.add(name)
            out.append((name, q, it.span or e.span))
        return out

    def _having(
        self,
        h: A.Expr,
        joined: list[str],
        items: list[tuple[str, A.Expr, Span | None]],
        env: Env,
    ) -> A.Expr:
        """A having condition over the sources' columns; a bare select alias stands for
        its expression (``having: revenue > 100`` with ``sum(...) as revenue``)."""
        outputs = {name: e for name, e, _ in items}

        def alias(n: A.Expr) -> A.Expr | None:
            if isinstance(n, A.Column) and n.source is None and n.name in outputs:
                return outputs[n.name]
            return None

        q = self.qualify(A.replace(h, lambda _: None, pre=alias), joined, None, "having")
        self.check_not_encrypted(q, "having")
        self.check_bool(q, Env({**env.columns}, self.params), "having")
        return q

    def _group_key(self, g: A.Expr, joined: list[str]) -> A.Expr:
        e = self.qualify(g, joined, None, "group_by")
        self.check_no_agg(e, "group_by")
        self.check_not_encrypted(e, "group_by")
        infer(e, self.env(joined))
        return e

    def aggregate(
        self,
        plan: N.Plan,
        items: list[tuple[str, A.Expr, Span | None]],
        group: list[A.Expr],
        env: Env,
        having: list[A.Expr] | None = None,
    ):
        """Aggregate node (with a Filter of ``having`` above it) + the select items
        rewritten over its output."""
        keys: list[tuple[str, A.Expr, pa.DataType]] = []
        key_map: dict[A.Expr, A.Expr] = {}
        for g in group:
            if g in key_map:
                continue
            name = g.qualified if isinstance(g, A.Column) else str(g)
            keys.append((name, g, infer(g, env)))
            key_map[g] = g if isinstance(g, A.Column) else A.Column(name, span=g.span)
        aggs: list[tuple[str, A.Call, pa.DataType]] = []
        agg_names: dict[A.Call, str] = {}

        def add_agg(c: A.Call, preferred: str | None) -> None:
            if c in agg_names:
                return
            self.check_not_encrypted(c, "an aggregate")
            t = infer(c, env)
            name = preferred or str(c)
            taken = {n for n, _, _ in keys} | set(agg_names.values())
            if name in taken:
                name = str(c)
            agg_names[c] = name
            aggs.append((name, c, t))

        for name, e, _span in items:
            if isinstance(e, A.Call) and e.is_aggregate:
                self.attempt(partial(add_agg, e, name))
            else:
                for c in _agg_calls(e):
                    self.attempt(partial(add_agg, c, None))
        for h in having or ():
            for c in _agg_calls(h):
                self.attempt(partial(add_agg, c, None))
        for k in self.spec.order_by:
            for c in _agg_calls(k.expr):
                q = self.attempt(partial(self.qualify, c, list(self.cols), None, "order_by"))
                if q is not None:
                    self.attempt(partial(add_agg, q, None))
        self.fail_if_problems()
        agg_map: dict[A.Expr, A.Expr] = {c: A.Column(n, span=c.span) for c, n in agg_names.items()}
        new_items = []
        for name, e, span in items:
            r = self.attempt(partial(self.over_aggregate, e, key_map, agg_map))
            if r is not None:
                new_items.append((name, r, span))
        self.fail_if_problems()
        node: N.Plan = N.Aggregate(plan, tuple(keys), tuple(aggs))
        conds = [
            r
            for h in having or ()
            if (r := self.attempt(partial(self.over_aggregate, h, key_map, agg_map))) is not None
        ]
        self.fail_if_problems()
        if conds:
            node = N.Filter(node, A.and_all(conds))  # type: ignore[arg-type]
        post = Env({n: t for n, _, t in keys} | {n: t for n, _, t in aggs}, self.params)
        key_map.update(agg_map)
        return node, new_items, post, key_map

    def over_aggregate(
        self, e: A.Expr, key_map: dict[A.Expr, A.Expr], agg_map: dict[A.Expr, A.Expr]
    ) -> A.Expr:
        """Rewrite ``e`` over the Aggregate's output; a bare column must be a group key."""

        def over(x: A.Expr) -> A.Expr | None:
            hit = key_map.get(x, agg_map.get(x))
            if hit is not None:
                return hit
            if isinstance(x, A.Column) and x.source in self.stages:
                return x  # a stage's column inside exists(...): not the aggregate's input
            if isinstance(x, A.Column):
                raise DslError.at(
                    f"column '{x.qualified}' must appear in group_by or inside an aggregate",
                    x.span,
                    f"add it to group_by, or use e.g. max({x.qualified})",
                )
            if isinstance(x, A.Call) and x.is_aggregate:
                raise DslError.at(f"aggregate {x} is not computed here", x.span)
            return None

        return A.replace(e, lambda _: None, pre=over)

    def sort_key(
        self,
        k: A.SortKey,
        joined: list[str],
        items: list[tuple[str, A.Expr, Span | None]],
        env: Env,
        key_map: dict[A.Expr, A.Expr],
        aggregating: bool,
        encrypted: set[str],
    ) -> A.SortKey:
        e = k.expr
        outputs = {name: ex for name, ex, _ in items}
        if isinstance(e, A.Column) and e.source is None and e.name in outputs:
            if e.name in encrypted:
                raise DslError.at(
                    f"cannot order by encrypted column '{e.name}'",
                    e.span,
                    "the fabric cannot see encrypted scores; order on the agent side",
                )
            return A.SortKey(outputs[e.name], k.descending, k.nulls_first, span=k.span)
        q = self.qualify(e, joined, None, "order_by")
        self.check_not_encrypted(q, "order_by")
        if aggregating:
            agg_only: dict[A.Expr, A.Expr] = {
                x: y for x, y in key_map.items() if isinstance(x, A.Call) and x.is_aggregate
            }
            q = self.over_aggregate(
                q, {x: y for x, y in key_map.items() if x not in agg_only}, agg_only
            )
        else:
            self.check_no_agg(q, "order_by without group_by or aggregates in select")
        infer(q, env)
        return A.SortKey(q, k.descending, k.nulls_first, span=k.span)

    def encrypted_score(self, e: A.Expr, span: Span | None, env: Env) -> tuple[A.Call, int]:
        if not isinstance(e, A.Call) or e.name not in ENCRYPTED_FUNCTIONS:
            raise DslError.at(
                "an encrypted session value can only be scored directly: "
                + ", ".join(f"{f}(...)" for f in ENCRYPTED_FUNCTIONS),
                e.span or span,
                "e.g. risk: weighted({{session.ctx}}, [0.5, 0.3, 0.2])",
            )
        infer(e, env)
        p = _encrypted_params(e, self.params)[0]
        size = self.params[p.name].size
        other = e.args[1]
        ot = infer(other, env)
        n = vector_size(other, ot)
        if n is not None and n != size:
            raise DslError.at(
                f"size mismatch: {{{{session.{p.name}}}}} is encrypted[{size}], {other} has {n} values",
                other.span or e.span,
                f"give {size} values",
            )
        from crypto.ops import depth_of

        degree = None
        if e.name == "poly" and isinstance(other, A.Literal):
            degree = max(len(other.value) - 1, 1)
        return e, depth_of(e.name, degree)

    def user_function(self, plan: N.Plan) -> N.Plan:
        pd = self.spec.pushdown
        assert pd is not None
        # the sandbox's static layer (syntax, `def run(table)`, forbidden imports, dunder
        # access, ...) at compile time
        from fabric.sandbox import check_snippet

        diags = check_snippet(pd.python, file=pd.file, line=pd.line, col=pd.col)
        if diags:
            raise DslError(diags)
        params = []
        for n in pd.params:
            if n.value not in self.params:
                raise DslError.at(
                    f"pushdown param '{n.value}' is not a declared session value",
                    n.span,
                    did_you_mean(n.value, self.params, "session values"),
                )
            if self.params[n.value].encrypted:
                raise DslError.at(
                    f"encrypted session value '{n.value}' cannot be passed to python", n.span
                )
            params.append(n.value)
        return N.UserFunction(plan, pd.python, pd.file, pd.line, pd.col, tuple(params), pd.limits)


def _columns(schema: pa.Schema, nested: set[str], alias: str) -> dict[str, pa.DataType]:
    """Column name -> type; fields of struct columns (Mongo documents) also as ``a.b``."""
    out: dict[str, pa.DataType] = {}

    def add(prefix: str, t: pa.DataType) -> None:
        for i in range(t.num_fields):
            f = t.field(i)
            name = f"{prefix}.{f.name}"
            out.setdefault(name, f.type)
            nested.add(f"{alias}.{name}")
            if pa.types.is_struct(f.type):
                add(name, f.type)

    for f in schema:
        out[f.name] = f.type
    for f in schema:
        if pa.types.is_struct(f.type):
            add(f.name, f.type)
    return out


def _star_item(source: str | None):
    from dsl.spec import SelectItem

    yield SelectItem(A.Star(source))


__all__ = ["ENCRYPTED", "build"]
