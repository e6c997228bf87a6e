"""The catalog: source URIs -> planning views (schema, capabilities) and sources.

Built from ``fabric.yaml``. ``<kind>://<connection>/<object>`` resolves through the
connection (opened lazily with ``connectors.base.open_connection``); ``dataset://<name>``
through the ``dataset_sources`` hook (the materialized datasets), or, when none is given,
through the dataset's declared schema. Views are cached; ``version`` increases whenever a
source's schema changes (``refresh()``), which invalidates compiled plans.

``offline=True`` never opens a connection: object schemas come from the declarations in
``connections.<name>.schemas`` (used by ``fabric validate --offline`` and tests).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa

from connectors import registry
from connectors.base import (
    Capability,
    Connection,
    ScanRequest,
    Source,
    SourceError,
    UnknownObjectError,
    as_capabilities,
    open_connection,
)
from connectors.ratelimit import (
    LimitedSource,
    Limits,
    RateLimitConfigError,
    connector_options,
    limits_of,
)
from dsl.errors import DslError, Span, did_you_mean
from fabric.config import ConnectionConfig, DatasetConfig, FabricConfig

SQL_KINDS = ("mysql", "postgres", "sql")
FILE_KINDS = ("s3", "file")


# the Python module a driver error names -> the extra that installs it
DRIVER_EXTRAS = {
    "psycopg": "postgres",
    "psycopg2": "postgres",
    "pymysql": "mysql",
    "MySQLdb": "mysql",
    "mariadb": "mysql",
    "pymongo": "mongo",
    "bson": "mongo",
    "confluent_kafka": "kafka",
    "tenseal": "crypto",
}


_OWN_PACKAGES = frozenset({"fabric", "dsl", "connectors", "indexes", "crypto"})


def _missing_driver(name: str, cc: Any, e: ImportError, span: Span | None) -> DslError:
    """A driver that is not installed: said at the connection's line of fabric.yaml, with
    the extra that installs it (not the import's traceback)."""
    module = (e.name or str(e)).split(".")[0]
    extra = DRIVER_EXTRAS.get(module)
    kind = cc.kind if cc is not None else "?"
    hint = (
        f"pip install 'agent-data-fabric[{extra}]'"
        if extra
        else f"install the Python package {module!r}"
    )
    where = cc.span if cc is not None and cc.span is not None else span
    return DslError.at(
        f"connection '{name}' ({kind}) needs the Python module {module!r}, which is not installed",
        where,
        hint,
    )


def _offline_capabilities(kind: str) -> frozenset[Capability]:
    """What a kind's sources can do, planned without opening them (``connectors.registry``)."""
    try:
        return registry.spec(kind).capabilities
    except (KeyError, ImportError):
        return frozenset({Capability.PROJECTION})


def _objects_noun(kind: str) -> str:
    try:
        return registry.spec(kind).objects
    except (KeyError, ImportError):
        return "objects"


def _interchangeable(a: str, b: str) -> bool:
    """A mysql:// source reads any SQL connection and an s3:// source a local directory
    (``kind: file``), so one binding runs on the full servers and on embedded defaults."""
    return (a in SQL_KINDS and b in SQL_KINDS) or (a in FILE_KINDS and b in FILE_KINDS)


class DeclaredSource(Source):
    """A source known only by its declared schema (offline planning, or a dataset whose
    materialized store is not attached to this process). ``scan`` raises."""

    def __init__(self, uri: str, schema: pa.Schema, capabilities: frozenset[Capability]):
        super().__init__(uri)
        self._schema = schema
        self.capabilities = capabilities  # type: ignore[misc]

    def schema(self) -> pa.Schema:
        return self._schema

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        raise SourceError(
            self.uri,
            "only its declared schema is known here (no live source attached)",
            hint="open the fabric with its connections (not offline) or attach the dataset",
        )


class _SandboxHook:
    """Adapts the plan's ``SandboxLimitsSpec`` (a binding's ``pushdown.limits``) to the
    pool's ``SandboxLimits``, unset values falling back to this fabric's ``sandbox:`` limits,
    which are also the ceiling a binding may only lower (the pool may be shared)."""

    def __init__(self, pool: Any, ceiling: Any = None):
        self.pool = pool
        self.ceiling = ceiling or pool.limits

    def run(self, code: str, table: Any, *, limits: Any = None, **kw: Any) -> Any:
        from fabric.sandbox import SandboxLimits

        if limits is not None and not isinstance(limits, SandboxLimits):
            limits = SandboxLimits.from_settings(limits, base=self.ceiling)
        return self.pool.run(code, table, limits=limits, ceiling=self.ceiling, **kw)


@dataclass(frozen=True)
class SourceView:
    """What the planner knows about one source without moving data."""

    uri: str
    kind: str
    schema: pa.Schema
    capabilities: frozenset[str]
    source: Source
    dataset: DatasetConfig | None = None

    @property
    def is_dataset(self) -> bool:
        return self.kind == "dataset"


def nearest(word: str, choices: Any, what: str, limit: int = 12) -> str:
    """``did_you_mean`` listing every name while there are few; past ``limit`` (a shared
    broker holds hundreds of topics) only the closest few and how many there are."""
    import difflib

    names = sorted(set(choices))
    if len(names) <= limit:
        return did_you_mean(word, names, what)
    close = difflib.get_close_matches(word, names, n=3, cutoff=0.5)
    listing = (
        f"nearest existing {what}: {', '.join(close)} ({len(names)} in all)"
        if close
        else f"no existing {what} is close; {len(names)} in all, e.g. {', '.join(names[:3])}"
    )
    best = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f"did you mean '{best[0]}'? ({listing})" if best else listing


def split_uri(uri: str) -> tuple[str, str, str]:
    """``mysql://shop/merchants`` -> ('mysql', 'shop', 'merchants'); ``dataset://news`` -> ('dataset', 'news', '')."""
    kind, _, rest = uri.partition("://")
    conn, _, obj = rest.partition("/")
    return kind, conn, obj


class Catalog:
    def __init__(
        self,
        config: FabricConfig,
        *,
        connections: Mapping[str, Connection] | None = None,
        dataset_sources: Mapping[str, Source] | None = None,
        offline: bool = False,
    ):
        self.config = config
        self.offline = offline
        self._connections: dict[str, Connection] = dict(connections or {})
        self._datasets: dict[str, Source] = dict(dataset_sources or {})
        self._views: dict[str, SourceView] = {}
        self._limits: dict[str, Limits] = {}  # connection -> rate_limit / retries
        self._lock = threading.RLock()
        self.version = 1
        for name, cc in config.connections.items():
            if cc.kind == "memory" and name not in self._connections:
                self._connections[name] = self._memory(cc)

    # ---- connections
    @staticmethod
    def _memory(cc: ConnectionConfig) -> Connection:
        from connectors.memory import MemoryConnection

        conn = MemoryConnection(cc.name, dict(cc.options))
        for obj, schema in cc.schemas.items():
            conn.add(obj, schema.empty_table())
        return conn

    def connection(self, name: str, span: Span | None = None) -> Connection:
        with self._lock:
            if name in self._connections:
                return self._connections[name]
            cc = self.config.connections.get(name)
            if cc is None:
                raise DslError.at(
                    f"unknown connection '{name}'",
                    span,
                    did_you_mean(name, self.config.connections, "connections"),
                )
            try:
                limits = (
                    None
                    if cc.kind == "rest"
                    else limits_of(cc.options, f"connection '{name}'", cc.kind)
                )
            except RateLimitConfigError as e:
                raise DslError.at(str(e), span) from None
            try:
                # rest limits each HTTP request itself; any other kind each scan (LimitedSource)
                opts = cc.options if cc.kind == "rest" else connector_options(cc.options, cc.kind)
                conn = open_connection(name, opts)
            except ImportError as e:
                if (e.name or "").split(".")[0] in _OWN_PACKAGES or not e.name:
                    raise  # our own code failed to import: a bug to show, not a driver to install
                raise _missing_driver(name, cc, e, span) from None
            except AttributeError as e:
                raise DslError.at(
                    f"connection '{name}' ({cc.kind}) is not available: {e}", span
                ) from None
            self._connections[name] = conn
            if limits is not None:
                self._limits[name] = limits
            return conn

    def register_dataset(self, name: str, source: Source) -> None:
        """Attach the materialized store of a dataset (the datasets module calls this)."""
        with self._lock:
            self._datasets[name] = source
            self._views.pop(f"dataset://{name}", None)
            self.version += 1

    # ---- resolution
    def resolve(self, uri: str, span: Span | None = None) -> SourceView:
        view = self._views.get(uri)
        if view is not None:
            return view
        with self._lock:
            view = self._views.get(uri)
            if view is None:
                view = self._resolve(uri, span)
                self._views[uri] = view
            return view

    def source(self, uri: str) -> Source:
        """The source to scan (the executor's entry point)."""
        return self.resolve(uri).source

    def schema(self, uri: str) -> pa.Schema:
        return self.resolve(uri).schema

    def _resolve(self, uri: str, span: Span | None) -> SourceView:
        kind, conn_name, obj = split_uri(uri)
        if kind == "dataset":
            return self._dataset(conn_name, uri, span)
        cc = self.config.connections.get(conn_name)
        if cc is None and conn_name not in self._connections:
            raise DslError.at(
                f"unknown connection '{conn_name}' in {uri}",
                span,
                did_you_mean(conn_name, self.config.connections, "connections"),
            )
        if cc is not None and kind != cc.kind and not _interchangeable(kind, cc.kind):
            raise DslError.at(
                f"connection '{conn_name}' is a {cc.kind} connection, not {kind}",
                span,
                f"write {cc.kind}://{conn_name}/{obj}",
            )
        # memory tables carry their own schema; declarations only create them empty
        declared = cc.schemas.get(obj) if cc is not None and cc.kind != "memory" else None
        if (
            self.offline
            and (cc is None or cc.kind != "memory")
            and conn_name not in self._connections
        ):
            if declared is None:
                existing = sorted(cc.schemas) if cc else []
                raise DslError.at(
                    f"{uri} has no declared schema (offline)",
                    span,
                    (
                        did_you_mean(obj, existing, "declared objects")
                        if existing
                        else f"declare it under connections.{conn_name}.schemas.{obj} or validate online"
                    ),
                )
            caps = _offline_capabilities(kind)
            return SourceView(uri, kind, declared, caps, DeclaredSource(uri, declared, caps))
        conn = self.connection(conn_name, span)
        opts: dict[str, Any] = {"schema": declared} if declared is not None else {}
        try:
            src = conn.source(obj, opts or None)
            schema = declared if declared is not None else src.schema()
        except UnknownObjectError as e:
            what = _objects_noun(kind)
            raise DslError.at(
                f"{uri} does not exist", span, nearest(obj, e.existing, what)
            ) from None
        except ImportError as e:  # the driver is imported when first used
            raise _missing_driver(conn_name, cc, e, span) from None
        except SourceError as e:
            raise DslError.at(
                f"cannot plan over {uri}: {e}",
                span,
                e.hint or "check that the server is up, or validate with --offline",
            ) from None
        caps = as_capabilities(
            getattr(src, "capabilities", {Capability.PROJECTION}), f"source {uri}"
        )
        limits = self._limits.get(conn_name)
        if limits is not None:  # rate_limit / retries of the connection (any kind but rest)
            src = cast(Source, LimitedSource(src, limits))  # a Source in all but name
        return SourceView(uri, kind, schema, caps, src)

    def _dataset(self, name: str, uri: str, span: Span | None) -> SourceView:
        dc = self.config.datasets.get(name)
        src = self._datasets.get(name)
        if dc is None and src is None:
            raise DslError.at(
                f"unknown dataset '{name}'",
                span,
                did_you_mean(name, set(self.config.datasets) | set(self._datasets), "datasets"),
            )
        if src is None:
            assert dc is not None
            caps = registry.DATASET_CAPABILITIES
            return SourceView(
                uri, "dataset", dc.schema, caps, DeclaredSource(uri, dc.schema, caps), dc
            )
        caps = as_capabilities(getattr(src, "capabilities", ()), f"source {uri}")
        caps |= {Capability.VECTOR_SEARCH}
        return SourceView(uri, "dataset", src.schema(), caps, src, dc)

    # ---- execution hooks
    def sandbox(self) -> Any:
        """The sandbox pool that runs ``pushdown.python`` (the executor's hook), sized and
        limited by ``sandbox:`` in fabric.yaml; started on first use."""
        from fabric.sandbox import SandboxLimits, shared_pool

        sb = self.config.sandbox
        ceiling = SandboxLimits.from_settings(sb)
        return _SandboxHook(
            shared_pool(
                size=sb.workers, limits=ceiling, allowed_modules=sb.allowed_imports or None
            ),
            ceiling,
        )

    def crypto_score(self, node: Any, table: pa.Table, params: Mapping[str, Any]) -> pa.Table:
        """The executor's hook for ``EncryptedScore``: score the encrypted session value under
        CKKS with the public context of ``crypto:`` (the fabric holds no secret key).

        ``weighted(ctx, [w..], bias)``, ``dot(ctx, [v..])`` and ``poly(ctx, [c..])`` give one
        encrypted value shared by every row; ``dot(ctx, t.vec)`` / ``weighted(ctx, t.vec, b)``
        give one per row (packed: many rows per ciphertext)."""
        import numpy as np

        from crypto import PublicContext, ops
        from dsl.ast import Literal, Param

        call = node.expr
        path = self.config.crypto.public_context
        if path is None:
            raise SourceError(
                "crypto",
                "encrypted scoring needs the agent's public CKKS context",
                hint="add crypto: {public_context: agent.pub} to fabric.yaml",
            )
        pub = PublicContext.load_cached(path)
        first = call.args[0]
        if not isinstance(first, Param) or first.name not in params:
            raise SourceError(
                "crypto", f"{call}: the first argument must be a bound encrypted session value"
            )
        enc = params[first.name]
        other = call.args[1]
        bias = 0.0
        if len(call.args) > 2:
            b = call.args[2]
            bias = (
                float(b.value)
                if isinstance(b, Literal)
                else float(params[b.name])
                if isinstance(b, Param)
                else 0.0
            )
        if isinstance(other, Literal):
            values = np.asarray(other.value, dtype=np.float64)
            if call.name == "poly":
                value = ops.polyval(pub, enc, values)
            elif call.name == "weighted":
                value = ops.weighted(pub, enc, values, bias)
            else:
                value = ops.dot(pub, enc, values)
            column = ops.broadcast(value, table.num_rows)
        else:
            name = getattr(other, "qualified", str(other))
            if name not in table.column_names:
                name = getattr(other, "name", name)
            vectors = table.column(name).to_pylist()
            candidates = np.asarray(vectors, dtype=np.float64).reshape(len(vectors), -1)
            column = ops.score_dot(pub, enc, candidates, bias=bias)
        return table.append_column(pa.field(node.name, column.type), column)

    # ---- invalidation
    def refresh(self) -> bool:
        """Re-resolve every cached source; bump ``version`` if a schema (or the source
        object behind a URI) changed. Sources that fail are dropped and re-resolved on use."""
        changed = False
        with self._lock:
            for uri, view in list(self._views.items()):
                try:
                    new = self._resolve(uri, None)
                except Exception:
                    self._views.pop(uri, None)
                    changed = True
                    continue
                if not new.schema.equals(view.schema) or new.source is not view.source:
                    self._views[uri] = new
                    changed = True
            if changed:
                self.version += 1
        return changed

    def invalidate(self, uri: str | None = None) -> None:
        with self._lock:
            if uri is None:
                self._views.clear()
            else:
                self._views.pop(uri, None)
            self.version += 1

    def close(self) -> None:
        with self._lock:
            for conn in self._connections.values():
                with contextlib.suppress(Exception):  # closing is best effort
                    conn.close()
            self._views.clear()
