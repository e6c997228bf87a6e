"""A binding's own consistency, checked without a catalog (``fabric validate`` always runs it).

What a binding file can get wrong by itself, before any source is looked at: a session
value used (``{{session.customer}}``) but not declared, a column qualified with an alias
no source (or stage) of the binding has (``x.name`` in ``select``, ``order_by``,
``group_by``, ``where``, ``join``, ...), and ``pushdown.params`` naming an undeclared
session value. Each problem carries the expression's position and a did-you-mean.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsl import ast as A
from dsl.errors import Diagnostic, Span, did_you_mean
from dsl.spec import BindingSpec


def _exprs(spec: BindingSpec) -> Iterator[A.Expr]:
    for s in spec.sources:
        yield from s.where
        if s.join is not None:
            yield s.join.on
        for d in s.derive:
            yield d.expr
        if s.nearest is not None:
            yield s.nearest.to
        if s.search is not None:
            yield s.search.query
    for item in spec.select:
        yield item.expr
    yield from spec.group_by
    yield from spec.having
    yield from spec.order_by


def _aliases(spec: BindingSpec) -> set[str]:
    out = {s.alias.value for s in spec.sources} | {st.name for st in spec.stages}
    for st in spec.stages:
        out |= {s.alias.value for s in st.sources}
    return out


def check(spec: BindingSpec) -> list[Diagnostic]:
    """Every self-inconsistency of ``spec`` (and its stages), in file order."""
    declared = spec.session_types
    aliases = _aliases(spec)
    out: list[Diagnostic] = []
    seen: set[tuple[str, int, int]] = set()

    def add(msg: str, span: Span | None, hint: str | None) -> None:
        key = (msg, span.line if span else 0, span.col if span else 0)
        if key not in seen:
            seen.add(key)
            out.append(Diagnostic(msg, span or spec.span, hint))

    def session_hint(name: str) -> str:
        if declared:
            return did_you_mean(name, declared, "session values") or (
                f"declare it: session: {{{name}: <type>}}"
            )
        return f"declare it: session: {{{name}: <type>}}"

    for part in (spec, *spec.stages):
        for e in _exprs(part):
            for sub in e.walk():
                # ("stage:NAME:..." params are the parser's references to stages)
                if isinstance(sub, A.Param) and sub.name not in declared and ":" not in sub.name:
                    add(
                        f"session value '{sub.name}' is not declared",
                        sub.span or e.span,
                        session_hint(sub.name),
                    )
                elif (
                    isinstance(sub, A.Column)
                    and sub.source is not None
                    and sub.source not in aliases
                ):
                    add(
                        f"unknown alias '{sub.source}' in {sub.source}.{sub.name}",
                        sub.span or e.span,
                        did_you_mean(sub.source, aliases, "sources")
                        or f"the binding's sources are {', '.join(sorted(aliases))}",
                    )
    if spec.pushdown is not None:
        for p in spec.pushdown.params:
            if p.value not in declared:
                add(
                    f"pushdown parameter '{p.value}' is not a declared session value",
                    p.span or spec.pushdown.span,
                    session_hint(p.value),
                )
    out.sort(key=lambda d: (d.span.line, d.span.col) if d.span else (0, 0))
    return out
