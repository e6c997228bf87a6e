"""The declarative binding, as written (YAML or compact text), before any planning.

These dataclasses are the user layer (after ibis: kept apart from the plan layer). Spans
point into the binding file and are excluded from equality, so the YAML form and the
compact text form of the same binding give equal specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsl.ast import Expr, SortKey
from dsl.errors import Span
from dsl.types import ValueType


def _span() -> Any:
    return field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Name:
    """An identifier with its position (aliases, column names in latest_by / nearest)."""

    value: str
    span: Span | None = _span()  # noqa: RUF009

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SessionParam:
    name: str
    type: ValueType
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class FreshnessSpec:
    """``freshness: {max_lag: 5s, max_lag_messages: 1000, on_stale: wait, wait_timeout: 10s}``."""

    max_lag_seconds: float | None = None
    max_lag_messages: int | None = None
    on_stale: str = "flag"
    wait_timeout: float | None = None
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class NearestSpec:
    """``nearest: {column: embedding, to: "{{session.q}}", k: 20, metric: cosine}``."""

    column: Name
    to: Expr
    k: int
    metric: str | None = None
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class SearchSpec:
    """``search: {column: body, query: "{{session.q}}", k: 20}``: the k rows with the
    highest BM25 relevance of an inverted-indexed text column to the query text."""

    column: Name
    query: Expr
    k: int
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class RankSpec:
    """``rank: {k: 10, rrf_k: 60, recency: published_at, half_life: 7d}``: reciprocal-rank
    fusion of the source's ``nearest`` and ``search`` arms (``k`` rows kept, default the
    larger arm's k), optionally decayed by age."""

    k: int | None = None
    rrf_k: int = 60
    recency: Name | None = None
    half_life_seconds: float | None = None
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class JoinSpec:
    on: Expr
    how: str = "inner"
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class DeriveItem:
    name: Name
    expr: Expr


@dataclass(frozen=True)
class SourceSpec:
    alias: Name
    uri: str
    uri_span: Span | None = _span()  # noqa: RUF009
    where: tuple[Expr, ...] = ()
    join: JoinSpec | None = None
    latest_by: tuple[Name, ...] = ()
    freshness: FreshnessSpec | None = None
    derive: tuple[DeriveItem, ...] = ()
    nearest: NearestSpec | None = None
    search: SearchSpec | None = None
    rank: RankSpec | None = None
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class SelectItem:
    """``expr [as alias]``; ``m.*`` is a ``Star`` expression."""

    expr: Expr
    alias: str | None = None
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float | None = None
    wall_seconds: float | None = None
    memory_mb: int | None = None
    output_mb: int | None = None


@dataclass(frozen=True)
class PushdownSpec:
    """``pushdown: {python: |, limits: {...}, params: [session names]}``."""

    python: str
    limits: SandboxLimits = SandboxLimits()
    params: tuple[Name, ...] = ()
    file: str = field(default="<text>", compare=False)
    line: int = field(default=1, compare=False)
    col: int = field(default=1, compare=False)
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class CacheSpec:
    """``cache: {by: "{{session.q_vec}}", similarity: 0.92, ttl: {kafka: 30s, mysql: 10m}}``:
    a semantic cache of the binding's answers (``fabric/semantic_cache.py``). ``by`` names
    the session value whose vector keys it (``embed`` set: a ``str`` value embedded with
    ``model`` into ``dim`` values); ``ttl`` maps source kinds (and ``default``) to seconds."""

    by: str
    embed: bool = False
    model: str = "hash"
    dim: int = 256
    similarity: float = 0.92
    ttl: tuple[tuple[str, float], ...] = ()
    max_entries: int = 1024
    #: the bound of the cached answers' memory in bytes (``max_mb``), None: no bound
    max_bytes: int | None = None
    #: ``prewarm:`` a JSON Lines file of sessions, as written (relative to the binding file)
    prewarm: str | None = None
    prewarm_span: Span | None = field(default=None, compare=False)
    span: Span | None = _span()  # noqa: RUF009


@dataclass(frozen=True)
class BindingSpec:
    """A binding; also a stage inside one (``stages:``), which has no session, pushdown,
    description or stages of its own: it sees the binding's session and earlier stages."""

    name: str
    sources: tuple[SourceSpec, ...]
    session: tuple[SessionParam, ...] = ()
    select: tuple[SelectItem, ...] = ()
    group_by: tuple[Expr, ...] = ()
    having: tuple[Expr, ...] = ()
    stages: tuple[BindingSpec, ...] = ()
    order_by: tuple[SortKey, ...] = ()
    limit: int | None = None
    offset: int = 0
    pushdown: PushdownSpec | None = None
    description: str | None = None
    cache: CacheSpec | None = None
    file: str = field(default="<text>", compare=False)
    span: Span | None = _span()  # noqa: RUF009
    name_span: Span | None = _span()  # noqa: RUF009

    @property
    def session_types(self) -> dict[str, ValueType]:
        return {p.name: p.type for p in self.session}

    @property
    def session_spans(self) -> dict[str, Span]:
        return {p.name: p.span for p in self.session if p.span is not None}
