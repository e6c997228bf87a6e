"""Connection kinds: one table that config, catalog and ``open_connection`` read.

After fsspec's registry: a built-in kind is a lazily imported ``module:Class`` with the
pip extra that installs its driver, the options its ``fabric.yaml`` entry accepts
(besides ``kind``, ``schemas`` and ``description``), the capabilities its sources have
when planning offline, and the noun for its objects in messages. Nothing here imports a
driver: ``fabric validate --offline`` checks options without psycopg or confluent_kafka.

A third-party package adds a kind without touching this repository, either from Python::

    register_connection("redis", RedisConnection)

or, installed, through an entry point in the ``agent_data_fabric.connectors`` group
(``redis = fabric_redis:RedisConnection`` in its ``pyproject.toml``
``[project.entry-points."agent_data_fabric.connectors"]``). The class declares
``options`` (tuple of option names), ``capabilities`` (``connectors.base.Capability``
members or their names; an unknown name is refused when the kind is registered) and
``objects`` (the plural noun, e.g. ``"indices"``) as class attributes; an entry point's
class is imported the first time its kind is looked up.

``inline_kinds()`` (the kinds with ``Capability.IN_PROCESS``, and ``dataset``) is what the
physical planner runs on the caller's thread.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.base import Capability, as_capabilities

if TYPE_CHECKING:
    from connectors.base import Connection

#: the entry-point group third-party connectors register in
ENTRY_POINT_GROUP = "agent_data_fabric.connectors"


@dataclass(frozen=True)
class ConnectorSpec:
    """What the fabric knows of a kind without importing it."""

    kind: str
    #: ``module:Class`` of the Connection, imported when a connection is opened
    target: str
    #: options a ``connections:`` entry of this kind accepts (besides kind/schemas/description)
    options: tuple[str, ...] = ("options",)
    #: capabilities of its sources when planning offline (``Source.capabilities``)
    capabilities: frozenset[Capability] = frozenset({Capability.PROJECTION})
    #: plural noun of its objects in messages ("tables", "topics")
    objects: str = "objects"
    #: the ``agent-data-fabric[extra]`` that installs its driver, if any
    extra: str | None = None


_SQL_KEYS = (
    "url",
    "pool_size",
    "max_overflow",
    "pool_recycle",
    "connect_timeout",
    "read_timeout",
    "query_timeout",
    "timeout",
    "options",
)
C = Capability
_SQL_CAPS = frozenset({C.PROJECTION, C.LIMIT, C.ORDER_BY})
_TABLE_CAPS = _SQL_CAPS | {C.AGGREGATE}  # SqlSource: GROUP BY in its statement
_FILE_CAPS = frozenset({C.PROJECTION, C.LIMIT})
_OBJECT_CAPS = _FILE_CAPS | {C.AGGREGATE}  # S3Source (s3, file): aggregates in its reader

_BUILTIN = (
    ConnectorSpec(
        "mysql", "connectors.sql:SqlConnection", _SQL_KEYS, _TABLE_CAPS, "tables", "mysql"
    ),
    ConnectorSpec(
        "postgres", "connectors.sql:SqlConnection", _SQL_KEYS, _TABLE_CAPS, "tables", "postgres"
    ),
    ConnectorSpec("sql", "connectors.sql:SqlConnection", _SQL_KEYS, _TABLE_CAPS, "tables"),
    ConnectorSpec(
        "mongo",
        "connectors.mongo:MongoConnection",
        ("url", "database", "connect_timeout", "query_timeout", "timeout", "sample", "options"),
        _SQL_CAPS,
        "collections",
        "mongo",
    ),
    ConnectorSpec(
        "s3",
        "connectors.s3:S3Connection",
        (
            "endpoint",
            "bucket",
            "access_key",
            "secret_key",
            "region",
            "scheme",
            "format",
            "formats",
            "delimiter",
            "prefix",
            "parquet_reader",
            "cache_mb",
            "options",
        ),
        _OBJECT_CAPS,
        "objects",
    ),
    ConnectorSpec(
        "file",
        "connectors.s3:S3Connection",
        ("root", "format", "formats", "delimiter", "options"),
        _OBJECT_CAPS,
        "files",
    ),
    ConnectorSpec(
        "kafka",
        "connectors.kafka:KafkaConnection",
        (
            "bootstrap",
            "connect_timeout",
            "query_timeout",
            "group_prefix",
            "format",
            "security",
            "timeout",
            "timestamp_field",
            "sample",
            "end",
            "cache",
            "cache_max_messages",
            "cache_max_bytes",
            "config",
            "options",
        ),
        frozenset({C.PROJECTION, C.LIMIT, C.LATEST_BY, C.TIME_RANGE}),
        "topics",
        "kafka",
    ),
    ConnectorSpec(
        "memory",
        "connectors.memory:MemoryConnection",
        ("options",),
        _SQL_CAPS | {C.IN_PROCESS},
        "tables",
    ),
    ConnectorSpec(
        "rest",
        "connectors.rest:RestConnection",
        (
            "base_url",
            "headers",
            "auth",
            "timeout",
            "connect_timeout",
            "query_timeout",
            "rate_limit",
            "retries",
            "endpoints",
            "options",
        ),
        _FILE_CAPS,
        "endpoints",
    ),
)

#: kind -> spec; built-ins first, then ``register_connection`` calls
_KINDS: dict[str, ConnectorSpec] = {s.kind: s for s in _BUILTIN}
#: kinds registered with a class object (not a dotted path)
_CLASSES: dict[str, type[Connection]] = {}

#: capabilities of a materialized dataset's sources (``dataset://``), planned offline
DATASET_CAPABILITIES = frozenset({C.PROJECTION, C.LIMIT, C.VECTOR_SEARCH, C.IN_PROCESS})


def _spec_of(kind: str, cls: type[Any], target: str) -> ConnectorSpec:
    options = tuple(getattr(cls, "options", None) or ())
    return ConnectorSpec(
        kind,
        target,
        options if "options" in options else (*options, "options"),
        as_capabilities(
            getattr(cls, "capabilities", None) or {Capability.PROJECTION},
            f"connection class {target}",
        ),
        str(getattr(cls, "objects", "objects")),
        getattr(cls, "extra", None),
    )


def register_connection(kind: str, cls: type[Connection], *, replace: bool = False) -> None:
    """Make ``kind`` a connection kind served by ``cls`` (see the module docstring for the
    class attributes read). A built-in kind is replaced only with ``replace=True``."""
    if kind in _KINDS and not replace:
        raise ValueError(
            f"connection kind {kind!r} is already registered ({_KINDS[kind].target}); "
            "pass replace=True to override it"
        )
    _KINDS[kind] = _spec_of(kind, cls, f"{cls.__module__}:{cls.__qualname__}")
    _CLASSES[kind] = cls


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Installed third-party kinds, read on every look-up (cheap; a package installed or
    put on ``sys.path`` later is found)."""
    importlib.invalidate_caches()
    return {
        ep.name: ep
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.name not in _KINDS
    }


def kinds() -> tuple[str, ...]:
    """Every known kind: built-in, registered and installed through entry points."""
    return (*_KINDS, *sorted(_entry_points()))


def spec(kind: str) -> ConnectorSpec:
    """The spec of ``kind``; an entry point's class is imported (and registered) here.
    Raises ``KeyError`` for an unknown kind."""
    if kind in _KINDS:
        return _KINDS[kind]
    ep = _entry_points().get(kind)
    if ep is None:
        raise KeyError(kind)
    register_connection(kind, ep.load())
    return _KINDS[kind]


def inline_kinds() -> frozenset[str]:
    """Kinds whose sources scan in this process (``Capability.IN_PROCESS``): a plan over
    one of them alone runs on the caller's thread. Built-in and registered kinds (an
    installed entry point's kind counts once it was looked up), and ``dataset``."""
    return frozenset(k for k, s in _KINDS.items() if Capability.IN_PROCESS in s.capabilities) | {
        "dataset"
    }


def connection_class(kind: str) -> type[Connection]:
    """The Connection class of ``kind``, imported now (a missing driver raises ImportError)."""
    try:
        s = spec(kind)
    except KeyError:
        raise ValueError(
            f"unknown connection kind {kind!r}; known kinds: {', '.join(sorted(kinds()))}"
        ) from None
    if kind in _CLASSES:
        return _CLASSES[kind]
    mod, _, cls = s.target.partition(":")
    return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return]
