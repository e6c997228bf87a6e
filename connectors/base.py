"""The connector contract (after DataFusion's TableProvider and fsspec's small core).

A *connection* (one entry under ``connections:`` in fabric.yaml: a MySQL server, a Mongo
database, an S3 bucket, a Kafka cluster) opens *sources* (a table, a collection, a path
glob, a topic). A source has a planning view, ``schema()``, ``supports_filter()``,
``capabilities``, ``statistics()``, which the planner uses without moving data, and
``scan(request)`` which streams Arrow record batches.

Filters reach a source as ``dsl.ast`` expressions over the source's own (unqualified)
column names, with ``Param`` nodes for session values; ``request.params`` holds their
bound values. A source answers per filter:

- ``EXACT``: the source applies it fully; the fabric trusts the result.
- ``INEXACT``: the source may return extra rows (e.g. row-group pruning only); the fabric
  re-applies the filter above the scan.
- ``UNSUPPORTED``: the fabric applies it above the scan.

A limit or order is pushed only when every filter of that source is EXACT.

What else a source can do is a set of ``Capability`` members (``Source.capabilities``);
the planner asks only for those. ``SourceLike``, ``ConnectionLike`` and ``Searchable`` are
the typed protocols the catalog, planner and executor rely on: a third-party source need
not subclass ``Source``, only have that shape (``connectors.testing`` checks it).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import pyarrow as pa

from connectors.credentials import mask, remember
from dsl.ast import Expr, SortKey
from dsl.errors import FabricError


class Pushdown(enum.Enum):
    EXACT = "exact"
    INEXACT = "inexact"
    UNSUPPORTED = "unsupported"


class Capability(enum.StrEnum):
    """What a source can do beyond ``schema()``, filters and ``scan()``. The planner asks a
    source only for what its ``capabilities`` hold; a str-valued enum, so ``"limit" in caps``
    still reads (fabric.yaml and third-party classes may give the names)."""

    #: returns only ``ScanRequest.columns`` (else the fabric drops the others)
    PROJECTION = "projection"
    #: stops after ``ScanRequest.limit`` rows (asked only when every filter is EXACT)
    LIMIT = "limit"
    #: returns rows in ``ScanRequest.order_by`` order (with ``limit``: a top-k at the source)
    ORDER_BY = "order_by"
    #: keeps the newest record per ``ScanRequest.latest_by`` key (logs: ``latest_by:``)
    LATEST_BY = "latest_by"
    #: reads only records in ``ScanRequest.time_range`` (logs; not yet asked by the planner)
    TIME_RANGE = "time_range"
    #: answers ``search(...)`` over a vector index (``Searchable``; datasets)
    VECTOR_SEARCH = "vector_search"
    #: scans in this process without network I/O: a plan over it alone runs on the
    #: caller's thread (``fabric.physical.planner``; memory tables, datasets)
    IN_PROCESS = "in_process"
    #: computes ``ScanRequest.aggregate`` (GROUP BY + aggregates over the filtered rows)
    #: when ``supports_aggregate`` accepts it (``fabric.optimizer.push_aggregate``)
    AGGREGATE = "aggregate"


def as_capabilities(values: Iterable[Any], where: str = "a source") -> frozenset[Capability]:
    """``values`` (members or their names) as Capability members; an unknown name is a
    ValueError naming ``where`` and the known ones."""
    out = set()
    for v in values:
        try:
            out.add(v if isinstance(v, Capability) else Capability(v))
        except ValueError:
            known = ", ".join(c.value for c in Capability)
            raise ValueError(
                f"{where} declares capability {v!r}, which the fabric does not know; "
                f"known capabilities: {known} (connectors.base.Capability)"
            ) from None
    return frozenset(out)


class SourceError(FabricError):
    """A source failed (down, timed out, refused). Names the source; the executor adds the binding.
    Credentials in the message and the hint are masked (``connectors.credentials``)."""

    def __init__(self, uri: str, message: str, *, hint: str | None = None, retriable: bool = False):
        self.uri = uri
        message, hint = mask(message), None if hint is None else mask(hint)
        self.hint = hint
        self.retriable = retriable
        super().__init__(f"source {uri}: {message}" + (f" (hint: {hint})" if hint else ""))


class UnknownObjectError(FabricError, LookupError):
    """The connection has no such table / collection / path / topic."""

    def __init__(self, uri: str, existing: list[str]):
        self.uri = uri
        self.existing = existing
        super().__init__(f"{uri} does not exist; existing: {', '.join(existing) or '(none)'}")


class UnknownColumnError(FabricError, KeyError):
    """A scan asked a source for columns it does not have; names them and the existing ones."""

    def __init__(self, uri: str, columns: Sequence[str], existing: Sequence[str]):
        self.uri = uri
        self.columns = list(columns)
        self.existing = list(existing)
        self.message = (
            f"{uri} has no column {', '.join(self.columns)}; existing: {', '.join(self.existing)}"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


def check_columns(uri: str, wanted: Sequence[str] | None, existing: Sequence[str]) -> None:
    """Raise ``UnknownColumnError`` if ``wanted`` names a column not in ``existing``."""
    if wanted is None:
        return
    have = set(existing)
    missing = [c for c in wanted if c not in have]
    if missing:
        raise UnknownColumnError(uri, missing, existing)


def typed_params(
    filters: Sequence[Expr], params: Mapping[str, Any], schema: pa.Schema, uri: str
) -> dict[str, Any]:
    """The session values ``filters`` compare with columns, checked against those columns'
    types and normalized (what a source applying a filter itself calls first); a value
    that cannot be of its column's type raises ``BadValueError`` naming the source, the
    column and the session value (``connectors._util.typed_params``)."""
    from connectors._util import typed_params as check

    return check(list(filters), params, schema, uri)


@dataclass(frozen=True)
class ColumnStats:
    distinct_count: int | None = None
    null_count: int | None = None
    min: Any = None
    max: Any = None


@dataclass(frozen=True)
class Statistics:
    """What a source can tell cheaply. ``exact`` says whether row_count is exact."""

    row_count: int | None = None
    exact: bool = False
    total_bytes: int | None = None
    columns: Mapping[str, ColumnStats] = field(default_factory=dict)


@dataclass(frozen=True)
class Watermark:
    """Freshness of a source as of a scan or now.

    ``event_time``: newest event applied/visible (UTC, None if unknown);
    ``lag_messages``: for logs, messages not yet visible; ``observed_at``: when measured.
    """

    observed_at: float = field(default_factory=time.time)
    event_time: float | None = None
    lag_messages: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Aggregation:
    """A GROUP BY pushed into a scan: ``group_by`` (output name, column, type) and
    ``aggregates`` (output name, ``sum``/``count``/``avg``/``min``/``max`` call, type),
    over the rows that pass the request's filters. The source returns one row per group
    (one row in all when ``group_by`` is empty) with exactly these columns and types. In a
    ``ScanRequest`` the expressions use the source's own column names; in a plan's Scan
    they are qualified by its alias, as in the Aggregate they replace."""

    group_by: tuple[tuple[str, Expr, pa.DataType], ...]
    aggregates: tuple[tuple[str, Expr, pa.DataType], ...]

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, t) for n, _, t in (*self.group_by, *self.aggregates)])

    def __str__(self) -> str:
        g = ", ".join(str(e) for _, e, _ in self.group_by)
        a = ", ".join(f"{e} as {n}" for n, e, _ in self.aggregates)
        return f"group_by=[{g}] aggregates=[{a}]"


@dataclass
class ScanMetrics:
    """What one scan cost at its source and what it found there.

    Each ``ScanRequest`` carries its own (``request.metrics``), which the source fills
    while it scans; the executor reports it under the source in
    ``res.stats["sources"][alias]["source"]`` (``as_dict()``) and on the scan's line of
    ``explain(analyze=True)``. A source keeps nothing per scan on itself: the catalog
    caches one Source per URI and every concurrent query scans that one object.

    The rows and Arrow bytes a scan returned are counted by the executor from the batches
    (``res.stats["sources"][alias]["rows"]`` / ``["bytes"]``); ``rows`` here is the
    source's own count, which the conformance kit checks against them. What no field
    holds goes in ``extra`` (reported as is, so JSON-like values only).

    >>> m = ScanMetrics(statement="SELECT id FROM t WHERE n < %s", records=40)
    >>> m.extra["reader"] = "duckdb"
    >>> m.as_dict()
    {'statement': 'SELECT id FROM t WHERE n < %s', 'records': 40, 'reader': 'duckdb'}
    """

    #: what was sent to the server: the SQL text (with placeholders), a Mongo filter (JSON)
    statement: str | None = None
    #: requests against the connection's budget (REST pages; scans of a connection with
    #: ``rate_limit`` / ``retries``), the retries among them and the seconds waited for a
    #: rate-limit token and between retries (``connectors.ratelimit``)
    requests: int = 0
    retries: int = 0
    throttle_wait_s: float = 0.0
    backoff_wait_s: float = 0.0
    #: HTTP status -> responses (REST)
    statuses: dict[int, int] = field(default_factory=dict)
    #: records read at the source before its own filters (Kafka messages, Mongo
    #: documents, REST records)
    records: int | None = None
    #: records that did not fit the schema: skipped (Kafka) or with bad cells set null
    #: (Mongo, REST ``on_error: null``); ``bad_samples`` says where and why for the first 100
    bad_records: int | None = None
    bad_samples: list[dict[str, Any]] = field(default_factory=list)
    #: files and Parquet row groups in the object set, and those left to read after
    #: partition and statistics pruning (S3, file)
    files_total: int | None = None
    files_read: int | None = None
    row_groups_total: int | None = None
    row_groups_read: int | None = None
    #: a source-side cache: Kafka's tail cache ``hit``, ``caught up`` or ``off (why)``
    cache: str | None = None
    #: rows the source returned (its own count)
    rows: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    #: the cap on ``bad_samples``
    MAX_SAMPLES: ClassVar[int] = 100

    def bad(self, count: int, samples: Iterable[Mapping[str, Any]] = ()) -> None:
        """Count ``count`` more bad records, keeping the first ``MAX_SAMPLES`` samples."""
        self.bad_records = (self.bad_records or 0) + count
        room = self.MAX_SAMPLES - len(self.bad_samples)
        if room > 0:
            self.bad_samples.extend(dict(s) for s, _ in zip(samples, range(room)))

    def merge(self, part: ScanMetrics) -> None:
        """Add what a piece of this scan measured (a Ray task's split of it): counts add
        up, distinct statements are kept in order (``; ``-separated); in ``extra``
        numbers add up (a split's partitions), mappings merge (its end offsets) and
        anything else is the piece's."""
        if part.statement is not None:
            sent = self.statement.split("; ") if self.statement else []
            if part.statement not in sent:
                self.statement = "; ".join([*sent, part.statement])
        self.requests += part.requests
        self.retries += part.retries
        self.throttle_wait_s += part.throttle_wait_s
        self.backoff_wait_s += part.backoff_wait_s
        for status, n in part.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + n
        for name in (
            "records",
            "files_total",
            "files_read",
            "row_groups_total",
            "row_groups_read",
            "rows",
        ):
            v = getattr(part, name)
            if v is not None:
                setattr(self, name, (getattr(self, name) or 0) + v)
        if part.bad_records is not None:
            self.bad(part.bad_records, part.bad_samples)
        if part.cache is not None:
            self.cache = part.cache
        for k, v in part.extra.items():
            have = self.extra.get(k)
            if _number(v) and _number(have):
                self.extra[k] = have + v
            elif isinstance(v, Mapping) and isinstance(have, Mapping):
                self.extra[k] = {**have, **v}
            else:
                self.extra[k] = v

    def as_dict(self) -> dict[str, Any]:
        """What was measured, for ``res.stats`` (nothing measured: ``{}``)."""
        out: dict[str, Any] = {}
        if self.statement is not None:
            out["statement"] = self.statement
        if self.requests:
            out["requests"] = self.requests
            out["retries"] = self.retries
            out["throttle_wait_ms"] = round(self.throttle_wait_s * 1000, 3)
            out["backoff_wait_ms"] = round(self.backoff_wait_s * 1000, 3)
            if self.statuses:
                out["statuses"] = {str(k): v for k, v in sorted(self.statuses.items())}
        for name in (
            "records",
            "bad_records",
            "files_total",
            "files_read",
            "row_groups_total",
            "row_groups_read",
            "cache",
        ):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        if self.bad_samples:
            out["bad_samples"] = list(self.bad_samples)
        out.update(self.extra)
        return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class ScanRequest:
    """What the planner asks of one source.

    ``columns``: the source columns needed (None: all). ``filters``: conjuncts this source
    said it supports (EXACT or INEXACT), unqualified. ``params``: bound session values for
    the ``Param`` nodes inside ``filters`` (and dynamic-filter key lists). ``limit`` and
    ``order_by`` are set only when every filter is EXACT. ``latest_by``: keep only the
    newest record per key (logs). ``time_range``: (start, end) epoch seconds for logs.
    ``aggregate``: the source groups and aggregates the filtered rows itself
    (``Capability.AGGREGATE``); ``columns`` then lists the columns it reads.
    """

    columns: tuple[str, ...] | None = None
    filters: tuple[Expr, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    limit: int | None = None
    order_by: tuple[SortKey, ...] = ()
    latest_by: tuple[str, ...] = ()
    time_range: tuple[float | None, float | None] | None = None
    batch_size: int = 65_536
    timeout: float | None = 30.0
    aggregate: Aggregation | None = None
    #: what this scan cost and found at its source, filled by the source while it scans
    #: (one per request: two scans of one source never share it); the executor reports
    #: it under the source in ``res.stats`` and ``explain(analyze=True)``
    metrics: ScanMetrics = field(default_factory=ScanMetrics, compare=False, hash=False)


class Source:
    """One table / collection / object set / topic. Subclasses implement schema() and scan()."""

    #: what the planner may ask of this source beyond filters (``Capability``)
    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.PROJECTION})

    def __init__(self, uri: str):
        self.uri = uri

    def schema(self) -> pa.Schema:
        raise NotImplementedError

    def supports_filter(self, expr: Expr) -> Pushdown:
        return Pushdown.UNSUPPORTED

    def statistics(self) -> Statistics:
        return Statistics()

    def watermark(self) -> Watermark | None:
        return None

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri})"


class Connection:
    """One entry of ``connections:``; opens sources by object name."""

    kind: ClassVar[str] = ""

    def __init__(self, name: str, options: Mapping[str, Any]):
        self.name = name
        self.options = dict(options)
        remember(self.options)  # its secrets are masked in every error from now on

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> Source:
        """Open ``<kind>://<name>/<obj>``; raise UnknownObjectError listing what exists."""
        raise NotImplementedError

    def list_objects(self) -> list[str]:
        return []

    def ping(self) -> None:
        """Raise SourceError if the server does not answer."""

    def close(self) -> None:
        pass


@runtime_checkable
class SourceLike(Protocol):
    """What the catalog, planner and executor need of a source (``Source`` has it)."""

    uri: str
    capabilities: frozenset[Capability]

    def schema(self) -> pa.Schema: ...

    def supports_filter(self, expr: Expr) -> Pushdown: ...

    def statistics(self) -> Statistics: ...

    def watermark(self) -> Watermark | None: ...

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]: ...


@runtime_checkable
class Searchable(Protocol):
    """A source with ``Capability.VECTOR_SEARCH``: ``nearest:`` calls its ``search``."""

    def search(self, *args: Any, **kwargs: Any) -> pa.Table: ...


@runtime_checkable
class ConnectionLike(Protocol):
    """What the catalog needs of a connection (``Connection`` has it)."""

    name: str

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> SourceLike: ...

    def list_objects(self) -> list[str]: ...

    def ping(self) -> None: ...

    def close(self) -> None: ...


def connection_class(kind: str) -> type[Connection]:
    """The Connection class of ``kind`` (``connectors.registry``, imported lazily)."""
    from connectors.registry import connection_class as lookup

    return lookup(kind)


def open_connection(name: str, options: Mapping[str, Any]) -> Connection:
    remember(options)
    try:
        return connection_class(options["kind"])(name, options)
    except Exception as exc:  # e.g. a URL that does not parse, echoed with its password
        text = str(exc)
        if mask(text) != text:
            raise ValueError(f"connection {name!r}: {mask(text)}") from None
        raise


def to_table(batches: Iterator[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_batches(list(batches), schema=schema)
