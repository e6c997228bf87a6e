"""``fabric.yaml``: connections, datasets, binding locations, signals, crypto, sandbox.

Parsed strictly (unknown keys rejected with "did you mean ...", every error at file,
line and column) into frozen dataclasses. ``${ENV}`` in any string is replaced by the
environment variable; a missing one is an error naming it and where it is used
(``${NAME:-default}`` gives a default).

    connections:
      shop: {kind: mysql, url: "mysql+pymysql://fabric:${SHOP_PASSWORD}@127.0.0.1:3306/shop"}
      crm:  {kind: mongo, url: "mongodb://127.0.0.1:27017", database: crm,
             schemas: {coupons: {merchant_id: int, code: str, discount: float}}}
    datasets:
      news:
        from: kafka://bus/news
        key: id
        schema: {id: str, published_at: timestamp, body: str, embedding: vector[384]}
        indexes: {embedding: hnsw, published_at: btree, body: inverted}
      merchants:
        from: mysql://shop/merchants
        key: id
        schema: {id: int, name: str, updated_at: timestamp}
        refresh: {mode: append, every: 10m, cursor: updated_at}
    bindings: [agents/]
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from connectors import registry
from connectors.ratelimit import OPTIONS as LIMIT_OPTIONS
from connectors.ratelimit import RateLimitConfigError, limits_of
from dsl import parser as P
from dsl.errors import Diagnostic, DslError, Span, did_you_mean
from dsl.options import check_uri, duration_seconds
from dsl.types import ValueType
from dsl.yamlpos import YamlMap, YamlSeq, YamlText
from fabric.tracing.config import TracingConfig

TOP_KEYS = (
    "connections",
    "datasets",
    "bindings",
    "signals",
    "crypto",
    "sandbox",
    "server",
    "ingest",
    "agents",
    "tracing",
    "executor",
)
DATASET_KEYS = (
    "from",
    "key",
    "schema",
    "indexes",
    "description",
    "retention",
    "time_column",
    "where",
    "refresh",
    "embed",
    "shards",
    "shard_by",
)
SHARD_BY = ("key", "partition")
EMBED_KEYS = ("from", "into", "model")
REFRESH_KEYS = ("mode", "every", "cursor")
REFRESH_MODES = ("full", "append", "changes")
INDEX_KINDS = ("hnsw", "btree", "inverted")
INDEX_KEYS = {
    "hnsw": ("kind", "metric", "M", "ef_construction", "ef", "max_elements"),
    "btree": ("kind",),
    "inverted": ("kind", "tokenizer", "lowercase"),
}
SIGNAL_KEYS = (
    "stale_when",
    "heartbeat",
    "targets",
    "sources",
    "hysteresis",
    "recover_after",
    "timeout",
)
STALE_KEYS = ("lag_messages", "lag_seconds")
SANDBOX_KEYS = (
    "cpu_seconds",
    "wall_seconds",
    "memory_mb",
    "output_mb",
    "allowed_imports",
    "workers",
)
CRYPTO_KEYS = ("public_context", "agents")
SERVER_KEYS = (
    "host",
    "port",
    "header_timeout",
    "keep_alive",
    "max_connections",
    "max_header_bytes",
    "flight_port",
    "query_workers",
    "queue",
)
INGEST_KEYS = ("checkpoint_dir", "group_prefix", "batch_size", "enabled")
EXECUTOR_KEYS = ("kind", "num_cpus", "address", "min_rows", "join_min_rows")
EXECUTOR_KINDS = ("local", "ray")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class ConnectionConfig:
    """One ``connections:`` entry. ``options`` holds every key (with ``kind``), env-substituted,
    as ``connectors.base.open_connection(name, options)`` expects. ``schemas`` declares
    object schemas (Mongo collections, JSON topics; memory tables)."""

    name: str
    kind: str
    options: Mapping[str, Any] = field(repr=False)  # holds credentials: never printed
    schemas: Mapping[str, pa.Schema] = field(default_factory=dict)
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class IndexConfig:
    column: str
    kind: str  # hnsw | btree | inverted
    options: Mapping[str, Any] = field(default_factory=dict)  # metric, M, ef_construction, ef, ...

    @property
    def metric(self) -> str | None:
        return self.options.get("metric")


@dataclass(frozen=True)
class RefreshConfig:
    """How a dataset fed from a non-Kafka source is kept current (``refresh:``).

    ``mode``: ``full`` (read the whole source; rows gone from it are deleted), ``append``
    (read rows whose ``cursor`` column is above the largest value held), ``changes``
    (MongoDB change stream, applied as they come). ``every``: seconds between refreshes
    (None: once when the fabric opens, and on ``refresh()``)."""

    mode: str = "full"
    every_seconds: float | None = None
    cursor: str | None = None


@dataclass(frozen=True)
class DatasetConfig:
    """A materialized, indexed dataset. ``from_uri`` None: filled only through upsert."""

    name: str
    schema: pa.Schema
    key: str | None = None
    from_uri: str | None = None
    indexes: tuple[IndexConfig, ...] = ()
    description: str | None = None
    retention_seconds: float | None = None
    time_column: str | None = None
    span: Span | None = field(default=None, compare=False)
    refresh: RefreshConfig | None = None  # set for every non-Kafka ``from:``
    from_span: Span | None = field(default=None, compare=False)
    #: fabric.embed.EmbedSpec: vector columns computed from text columns as rows arrive
    embed: tuple[Any, ...] = ()
    #: ``shards: N`` (executor: ray): N Ray actors each hold a part (fabric.ray.shards);
    #: ``shard_by`` ``partition`` (Kafka-fed: shard i owns partitions p % N == i) or
    #: ``key`` (filled through upsert: crc32 of the key)
    shards: int = 1
    shard_by: str | None = None
    shards_span: Span | None = field(default=None, compare=False)

    def index(self, column: str) -> IndexConfig | None:
        return next((i for i in self.indexes if i.column == column), None)


@dataclass(frozen=True)
class StaleWhen:
    lag_messages: int | None = 1000
    lag_seconds: float | None = 30.0


@dataclass(frozen=True)
class SignalsConfig:
    stale_when: StaleWhen = StaleWhen()
    heartbeat_seconds: float = 5.0
    targets: tuple[str, ...] = ()
    sources: Mapping[str, StaleWhen] = field(default_factory=dict)  # per source URI overrides
    hysteresis: float = 0.5  # fresh again only when lag <= hysteresis * threshold ...
    recover_after_seconds: float = 2.0  # ... continuously for this long (no flapping)
    timeout_seconds: float = 2.0

    def threshold(self, uri: str) -> StaleWhen:
        return self.sources.get(uri, self.stale_when)


@dataclass(frozen=True)
class SandboxConfig:
    cpu_seconds: float = 2.0
    wall_seconds: float = 5.0
    memory_mb: int = 512
    output_mb: int = 64
    allowed_imports: tuple[str, ...] = ()
    workers: int = 2


@dataclass(frozen=True)
class CryptoConfig:
    public_context: Path | None = None
    agents: Mapping[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerConfig:
    """``server:`` of fabric.yaml (``fabric serve``). A request whose headers are not in
    within ``header_timeout`` seconds is closed; an idle keep-alive connection after
    ``keep_alive``; past ``max_connections`` (also kept below the process's open-file
    limit) the longest-waiting half-open connection is closed to make room;
    ``max_header_bytes`` bounds a request's headers."""

    host: str = "127.0.0.1"
    port: int = 8765
    header_timeout: float = 10.0
    keep_alive: float = 5.0
    max_connections: int = 1000
    max_header_bytes: int = 16_384
    #: Arrow Flight port for queries (``agents:`` given); 0 picks a free one
    flight_port: int = 8815
    #: queries run at once, shared fairly between agents (fabric.service.auth)
    query_workers: int = 4
    #: ``fair`` (round-robin between agents, each at most its max_concurrent) or ``fifo``
    queue: str = "fair"


@dataclass(frozen=True)
class IngestConfig:
    enabled: bool = True
    checkpoint_dir: Path | None = None
    group_prefix: str = "fabric"
    batch_size: int = 10_000


@dataclass(frozen=True)
class ExecutorConfig:
    """``executor:`` of fabric.yaml: ``local`` (the default: scans on this process's
    thread pool) or ``ray`` (coarse scans as Ray tasks, docs/scale.md). For ``ray``:
    ``num_cpus`` of the local cluster it starts, ``address`` of a running cluster to
    attach to instead, ``min_rows``: scans estimated below it stay local."""

    kind: str = "local"
    num_cpus: int = 2
    address: str | None = None
    min_rows: int | None = None  # None: fabric.ray.scan.DEFAULT_MIN_ROWS
    #: joins with both sides at this many rows or more run as hash-partitioned Ray tasks
    join_min_rows: int | None = None  # None: fabric.ray.join.DEFAULT_JOIN_MIN_ROWS


@dataclass(frozen=True)
class FabricConfig:
    path: Path | None
    root: Path
    connections: Mapping[str, ConnectionConfig] = field(default_factory=dict)
    datasets: Mapping[str, DatasetConfig] = field(default_factory=dict)
    bindings: tuple[str, ...] = ()
    signals: SignalsConfig = SignalsConfig()
    crypto: CryptoConfig = CryptoConfig()
    sandbox: SandboxConfig = SandboxConfig()
    server: ServerConfig = ServerConfig()
    ingest: IngestConfig = IngestConfig()
    #: ``agents:`` (fabric.service.auth.AgentConfig by name): who may query over the wire
    agents: Mapping[str, Any] = field(default_factory=dict)
    executor: ExecutorConfig = ExecutorConfig()
    #: ``tracing:`` (docs/tracing.md): spans, the ring buffer, OTLP export, prices
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def binding_files(self) -> list[Path]:
        """Every binding file: directories (``*.yaml``/``*.yml`` recursively), globs and files,
        relative to the config file."""
        out: dict[Path, None] = {}
        skip = self.path.resolve() if self.path else None
        for pattern in self.bindings:
            p = Path(pattern)
            base = p if p.is_absolute() else self.root / p
            if any(ch in pattern for ch in "*?["):
                for match in sorted(glob.glob(str(base), recursive=True)):
                    if Path(match).is_file() and Path(match).resolve() != skip:
                        out[Path(match)] = None
            elif base.is_dir():
                for f in sorted(base.rglob("*")):
                    if f.suffix in (".yaml", ".yml") and f.is_file() and f.resolve() != skip:
                        out[f] = None
            elif base.is_file():
                out[base] = None
        return list(out)


# ------------------------------------------------------------------ loading


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    root: str | Path | None = None,
) -> FabricConfig:
    """Load ``fabric.yaml`` from a path, from YAML text (a string containing a newline), or
    from a dict. Raises DslError with every problem found."""
    env = os.environ if env is None else env
    if source is None:
        return FabricConfig(None, Path(root or ".").resolve())
    if isinstance(source, Mapping):
        import yaml

        text = yaml.safe_dump(_plain(source), sort_keys=False)
        return _load_text(text, "<config>", None, Path(root or ".").resolve(), env)
    if isinstance(source, str) and "\n" in source:
        return _load_text(source, "<config>", None, Path(root or ".").resolve(), env)
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise DslError.at(
            f"cannot read config {path}: {e.strerror}",
            Span(str(path), 1, 1),
            "pass the path of fabric.yaml (fabric.open('fabric.yaml'))",
        ) from None
    return _load_text(text, str(path), path.resolve(), path.resolve().parent, env)


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    return v


class _Loader:
    def __init__(self, y: YamlText, env: Mapping[str, str], root: Path):
        self.y, self.env, self.root = y, env, root
        self.problems: list[Diagnostic] = []

    def collect(self, fn, *args, default=None):
        try:
            return fn(*args)
        except DslError as e:
            self.problems.extend(self.y.with_source(e).diagnostics)
            return default

    def subst(self, c, key) -> Any:
        v = c[key]
        if isinstance(v, str) and "${" in v:

            def repl(m: re.Match[str]) -> str:
                name, default = m.group(1), m.group(2)
                if name in self.env:
                    return self.env[name]
                if default is not None:
                    return default
                raise self.y.error(
                    f"environment variable {name} is not set",
                    self.y.value_span(c, key),
                    f"export {name}=... before starting the fabric, or write ${{{name}:-default}}",
                )

            return _ENV.sub(repl, str(v))
        if isinstance(v, YamlMap):
            return {str(k): self.subst(v, k) for k in v}
        if isinstance(v, YamlSeq):
            return [self.subst(v, i) for i in range(len(v))]
        return v


def _load_text(
    text: str, file: str, path: Path | None, root: Path, env: Mapping[str, str]
) -> FabricConfig:
    y = YamlText(text, file)
    docs = y.documents()
    if len(docs) > 1:
        raise y.error("fabric.yaml must hold one YAML document", y.node_span(docs[1]))
    doc = docs[0] if docs else YamlMap()
    if not isinstance(doc, YamlMap):
        raise y.error(
            "fabric.yaml must be a mapping (connections:, datasets:, bindings: ...)",
            y.node_span(doc),
        )
    L = _Loader(y, env, root)
    L.collect(y.check_keys, doc, TOP_KEYS, "fabric.yaml")

    def section(key: str, fn: Any, default: Any, *args: Any) -> Any:
        """``fn(L, doc, *args)`` when ``key:`` is given (problems collected), else ``default``."""
        return L.collect(fn, L, doc, *args, default=default) if doc.get(key) else default

    conns = section("connections", _connections, {})
    datasets = section("datasets", _datasets, {}, conns)
    bindings = section("bindings", _bindings, ())
    signals = section("signals", _signals, SignalsConfig())
    crypto = section("crypto", _crypto, CryptoConfig())
    sandbox = section("sandbox", _sandbox, SandboxConfig())
    server = section("server", _server, ServerConfig())
    ingest = section("ingest", _ingest, IngestConfig())
    from fabric.service.auth import parse_agents

    agents = section("agents", parse_agents, {})
    from fabric.tracing.config import parse_tracing

    tracing = section("tracing", parse_tracing, TracingConfig())
    executor = section("executor", _executor, ExecutorConfig())
    if L.problems:
        raise DslError(L.problems)
    return FabricConfig(
        path,
        root,
        conns,
        datasets,
        bindings,
        signals,
        crypto,
        sandbox,
        server,
        ingest,
        agents,
        executor,
        tracing=tracing,
    )


def _name_ok(L: _Loader, m: YamlMap, key: Any, what: str) -> str:
    k = str(key)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", k):
        raise L.y.error(
            f"{what} '{k}' is not a valid name",
            L.y.key_span(m, key),
            "use letters, digits, _ and -",
        )
    return k


def _connections(L: _Loader, doc: YamlMap) -> dict[str, ConnectionConfig]:
    y = L.y
    m = y.mapping(doc, "connections", "connections")
    out = {}
    for key in m:

        def one(key=key) -> None:
            name = _name_ok(L, m, key, "connection")
            cm = y.mapping(m, key, f"connection '{name}'")
            if "kind" not in cm:
                raise y.error(
                    f"connection '{name}' needs 'kind'",
                    y.key_span(m, key),
                    f"kinds: {', '.join(registry.kinds())}",
                )
            kind = y.string(cm, "kind", "kind")
            known = registry.kinds()
            if kind not in known:
                raise y.error(
                    f"unknown connection kind '{kind}'",
                    y.value_span(cm, "kind"),
                    did_you_mean(kind, known, "kinds")
                    + f"; a third-party kind registers in the '{registry.ENTRY_POINT_GROUP}'"
                    " entry-point group",
                )
            try:
                spec = registry.spec(kind)
            except ImportError as e:  # a third-party kind whose package does not import
                raise y.error(
                    f"connection kind '{kind}' is registered but its class does not import: {e}",
                    y.value_span(cm, "kind"),
                    f"check the package providing the '{registry.ENTRY_POINT_GROUP}' entry point",
                ) from None
            # rate_limit / retries: any kind (connectors/ratelimit.py)
            allowed = tuple(
                dict.fromkeys(("kind", "schemas", "description", *spec.options, *LIMIT_OPTIONS))
            )
            y.check_keys(cm, allowed, f"connection '{name}' ({kind})")
            options = {str(k): L.subst(cm, k) for k in cm if k not in ("schemas", "description")}
            for opt in LIMIT_OPTIONS:
                if opt in cm:
                    try:
                        limits_of({opt: options[opt]}, f"connection '{name}'", kind)
                    except RateLimitConfigError as e:
                        raise y.error(
                            str(e),
                            y.value_span(cm, opt),
                            "rate_limit: {per_second: 5, burst: 10}; "
                            "retries: {max: 3, base: 0.1, max_delay: 10}",
                        ) from None
            if kind == "kafka":
                _kafka_options(L, cm, name, options)
            if kind == "file" and isinstance(options.get("root"), str):
                # a relative root is from fabric.yaml's directory (like bindings:), so a
                # directory written by `fabric init` still runs after it is moved
                options["root"] = str(L.root / os.path.expanduser(options["root"]))
            schemas = {}
            if "schemas" in cm:
                sm = y.mapping(cm, "schemas", "schemas")
                for obj in sm:
                    schemas[str(obj)] = _schema(L, sm, obj, f"schema of {kind}://{name}/{obj}")
            out[name] = ConnectionConfig(name, kind, options, schemas, span=y.key_span(m, key))

        L.collect(one)
    return out


def _kafka_options(L: _Loader, cm: YamlMap, name: str, options: Mapping[str, Any]) -> None:
    """A kafka connection's nested ``options:`` hold connection options (the same keys as
    the top level), never librdkafka settings; ``security:`` and ``config:`` are librdkafka
    settings, checked by librdkafka itself (a client is built, nothing is contacted)."""
    y = L.y
    if "options" in cm:
        om = y.mapping(cm, "options", f"options of connection '{name}'")
        allowed = [k for k in registry.spec("kafka").options if k != "options"]
        problems = [
            y.diagnostic(
                f"unknown kafka option '{k}' in connection '{name}'",
                y.key_span(om, k),
                did_you_mean(str(k), allowed, "options")
                + "; librdkafka settings go under 'config:', SASL/TLS under 'security:'",
            )
            for k in om
            if k not in allowed
        ]
        if problems:
            raise DslError(problems)
    for key in ("security", "config"):
        if key not in cm:
            continue
        settings = options.get(key)
        if not isinstance(settings, Mapping):
            raise y.error(
                f"'{key}' of connection '{name}' must be a mapping of librdkafka settings",
                y.value_span(cm, key),
            )
        from connectors.kafka import client_config_problem

        why = client_config_problem(settings)
        if why is not None:
            raise y.error(
                f"librdkafka rejects '{key}' of connection '{name}': {why}",
                y.value_span(cm, key),
                "see https://github.com/confluentinc/librdkafka/blob/master/CONFIGURATION.md",
            )


def _schema(L: _Loader, parent: Any, key: Any, what: str) -> pa.Schema:
    y = L.y
    sm = y.mapping(parent, key, what)
    fields = []
    for col in sm:
        t = _type(L, sm, col)
        fields.append(pa.field(str(col), t.arrow()))
    if not fields:
        raise y.error(f"{what} declares no columns", y.value_span(parent, key))
    return pa.schema(fields)


def _type(L: _Loader, m: YamlMap, key: Any) -> ValueType:
    y = L.y
    if not isinstance(m[key], str):
        raise y.error(
            f"type of column '{key}' must be a type name, got {m[key]!r}",
            y.value_span(m, key),
            "types: int, float, str, bool, timestamp, date, bytes, list[T], vector[N]",
        )
    text, ln, col, positions = y.scalar(m, key)
    t = P.parse_type(text, y.file, ln, col, positions=positions)
    if t.kind == "encrypted":
        raise y.error("encrypted[N] is a session type, not a column type", y.value_span(m, key))
    return t


def _datasets(
    L: _Loader, doc: YamlMap, conns: Mapping[str, ConnectionConfig]
) -> dict[str, DatasetConfig]:
    y = L.y
    m = y.mapping(doc, "datasets", "datasets")
    out = {}
    for key in m:

        def one(key=key) -> None:
            name = _name_ok(L, m, key, "dataset")
            dm = y.mapping(m, key, f"dataset '{name}'")
            y.check_keys(dm, DATASET_KEYS, f"dataset '{name}'", required=("schema",))
            schema = _schema(L, dm, "schema", f"schema of dataset '{name}'")
            from_uri = None
            if dm.get("from") is not None:
                y.string(dm, "from", "from")
                from_uri = check_uri(str(L.subst(dm, "from")).strip(), y.value_span(dm, "from"))
                if from_uri.startswith("dataset://"):
                    raise y.error(
                        "a dataset cannot be fed from another dataset", y.value_span(dm, "from")
                    )
                conn = from_uri.split("://", 1)[1].split("/", 1)[0]
                if conn not in conns:
                    raise y.error(
                        f"unknown connection '{conn}' in dataset '{name}'",
                        y.value_span(dm, "from"),
                        did_you_mean(conn, conns, "connections"),
                    )
            key_col = None
            if "key" in dm:
                key_col = y.string(dm, "key", "key")
                if key_col not in schema.names:
                    raise y.error(
                        f"key column '{key_col}' is not in the schema of dataset '{name}'",
                        y.value_span(dm, "key"),
                        did_you_mean(key_col, schema.names, "columns"),
                    )
            indexes = _indexes(L, dm, schema, name) if "indexes" in dm else ()
            retention = (
                duration_seconds(dm["retention"], y.value_span(dm, "retention"), "retention")
                if "retention" in dm
                else None
            )
            time_col = None
            if "time_column" in dm:
                time_col = y.string(dm, "time_column", "time_column")
                if time_col not in schema.names:
                    raise y.error(
                        f"time_column '{time_col}' is not in the schema",
                        y.value_span(dm, "time_column"),
                        did_you_mean(time_col, schema.names, "columns"),
                    )
            if retention is not None:  # rows expire by their time, so it needs one
                if time_col is None:
                    raise y.error(
                        "retention needs time_column: (the timestamp column rows expire by)",
                        y.key_span(dm, "retention"),
                        "add time_column: <a timestamp column>, or remove retention:",
                    )
                t = schema.field(time_col).type
                if not (pa.types.is_timestamp(t) or pa.types.is_date(t)):
                    raise y.error(
                        f"time_column '{time_col}' is {t}; retention compares it with the "
                        "current time, so it must be a timestamp or a date",
                        y.value_span(dm, "time_column"),
                        "name a timestamp column, or remove retention:",
                    )
            desc = y.string(dm, "description", "description") if "description" in dm else None
            refresh = _refresh(L, dm, schema, from_uri, conns)
            embeds = _embed(L, dm, schema, key_col) if "embed" in dm else ()
            shards, shard_by = _shards(L, dm, from_uri, key_col, refresh)
            out[name] = DatasetConfig(
                name,
                schema,
                key_col,
                from_uri,
                indexes,
                desc,
                retention,
                time_col,
                span=y.key_span(m, key),
                refresh=refresh,
                from_span=y.value_span(dm, "from") if from_uri else None,
                embed=embeds,
                shards=shards,
                shard_by=shard_by,
                shards_span=y.key_span(dm, "shards") if "shards" in dm else None,
            )

        L.collect(one)
    return out


def _shards(
    L: _Loader,
    dm: YamlMap,
    from_uri: str | None,
    key: str | None,
    refresh: RefreshConfig | None = None,
) -> tuple[int, str | None]:
    """``shards: N`` and ``shard_by: partition | key`` of a dataset (executor: ray runs
    the shards as actors; fabric.ray.shards)."""
    y = L.y
    if "shards" not in dm:
        if "shard_by" in dm:
            raise y.error(
                "shard_by applies to a sharded dataset, and this one has no shards:",
                y.key_span(dm, "shard_by"),
                "add shards: N (N Ray actors, executor: ray), or remove shard_by:",
            )
        return 1, None
    n = y.integer(dm, "shards", "shards", 1)
    kind = from_uri.split("://", 1)[0] if from_uri else None
    natural = "partition" if kind == "kafka" else "key"
    by = y.string(dm, "shard_by", "shard_by") if "shard_by" in dm else natural
    if by not in SHARD_BY:
        raise y.error(
            f"unknown shard_by '{by}'", y.value_span(dm, "shard_by"), did_you_mean(by, SHARD_BY)
        )
    where = y.value_span(dm, "shard_by") if "shard_by" in dm else y.key_span(dm, "shards")
    if refresh is not None and refresh.mode == "changes" and n > 1:
        raise y.error(
            "a sharded dataset cannot follow a change stream (refresh mode changes applies "
            "one change at a time: a Ray call per change)",
            y.key_span(dm, "shards"),
            "use refresh: {mode: full} or {mode: append, cursor: <column>}, or remove shards:",
        )
    if by != natural:
        raise y.error(
            "a dataset fed from Kafka is sharded by partition (the producer already hashed "
            "each key to one partition)"
            if kind == "kafka"
            else "shard_by: partition needs a dataset fed from kafka://; this one is filled "
            "through upsert",
            where,
            f"use shard_by: {natural}, or leave shard_by out",
        )
    if key is None and n > 1:
        raise y.error(
            "a sharded dataset needs key: (the column that decides a row's shard)",
            y.key_span(dm, "shards"),
        )
    return n, by


def _embed(L: _Loader, dm: YamlMap, schema: pa.Schema, key: str | None) -> tuple[Any, ...]:
    """``embed: {from: body, into: embedding, model: hash}`` (or a list of them)."""
    from fabric.embed import DEFAULT_MODEL, EmbedSpec, check_model

    y = L.y
    v = dm["embed"]
    entries = [(v, i) for i in range(len(v))] if isinstance(v, YamlSeq) else [(dm, "embed")]
    out: list[EmbedSpec] = []
    for c, k in entries:
        em = y.mapping(c, k, "embed")
        y.check_keys(em, EMBED_KEYS, "embed", required=("from", "into"))
        src = y.string(em, "from", "embed from")
        into = y.string(em, "into", "embed into")
        for col, what in ((src, "from"), (into, "into")):
            if col not in schema.names:
                raise y.error(
                    f"embed {what} column '{col}' is not in the schema",
                    y.value_span(em, what),
                    did_you_mean(col, schema.names, "columns"),
                )
        if not pa.types.is_string(schema.field(src).type):
            raise y.error(
                f"embed from column '{src}' is {P_type(schema.field(src).type)}; it must be str",
                y.value_span(em, "from"),
                "embed a text column",
            )
        t = schema.field(into).type
        if not pa.types.is_fixed_size_list(t):
            raise y.error(
                f"embed into column '{into}' is {P_type(t)}; it must be vector[N]",
                y.value_span(em, "into"),
                f"declare {into}: vector[384] (the model's width) in the schema",
            )
        if into == key or any(e.into == into for e in out):
            raise y.error(
                f"column '{into}' is "
                + ("the key" if into == key else "already computed by another embed"),
                y.value_span(em, "into"),
                "embed into a vector column of its own",
            )
        model = y.string(em, "model", "embed model") if "model" in em else DEFAULT_MODEL
        problem = check_model(model)
        if problem:
            raise y.error(problem, y.value_span(em, "model"))
        out.append(EmbedSpec(src, into, model, span=y.key_span(dm, "embed")))
    return tuple(out)


def _refresh(
    L: _Loader,
    dm: YamlMap,
    schema: pa.Schema,
    from_uri: str | None,
    conns: Mapping[str, ConnectionConfig],
) -> RefreshConfig | None:
    """``refresh: {mode: full|append|changes, every: 10m, cursor: col}`` of a dataset fed
    from a non-Kafka source (default: full, once at open)."""
    y = L.y
    kind = from_uri.split("://", 1)[0] if from_uri else None
    if "refresh" in dm and (from_uri is None or kind == "kafka"):
        raise y.error(
            "refresh applies to datasets fed from a table, collection or file "
            + (
                "(a kafka-fed dataset is ingested continuously)"
                if kind
                else "(this one has no from:)"
            ),
            y.key_span(dm, "refresh"),
            "remove refresh:, or give from: mysql://..., mongo://..., s3://... or file://...",
        )
    if from_uri is None or kind == "kafka":
        return None
    if "refresh" not in dm:
        return RefreshConfig()
    rm = y.mapping(dm, "refresh", "refresh")
    y.check_keys(rm, REFRESH_KEYS, "refresh")
    mode = y.string(rm, "mode", "mode") if "mode" in rm else "full"
    if mode not in REFRESH_MODES:
        raise y.error(
            f"unknown refresh mode '{mode}'",
            y.value_span(rm, "mode"),
            did_you_mean(mode, REFRESH_MODES, "modes"),
        )
    every = (
        duration_seconds(rm["every"], y.value_span(rm, "every"), "every") if "every" in rm else None
    )
    cursor = None
    if "cursor" in rm:
        cursor = y.string(rm, "cursor", "cursor")
        if cursor not in schema.names:
            raise y.error(
                f"cursor column '{cursor}' is not in the schema",
                y.value_span(rm, "cursor"),
                did_you_mean(cursor, schema.names, "columns"),
            )
    if mode == "append" and cursor is None:
        raise y.error(
            "refresh mode append needs 'cursor:' (a column that grows: an id or updated_at)",
            y.key_span(dm, "refresh"),
            "add cursor: <column>, or use mode: full",
        )
    conn = conns.get(from_uri.split("://", 1)[1].split("/", 1)[0])
    if mode == "changes" and (conn is None or conn.kind != "mongo"):
        raise y.error(
            "refresh mode changes reads a MongoDB change stream: it needs a mongo:// source",
            y.value_span(rm, "mode"),
            "use mode: full or append for this source",
        )
    return RefreshConfig(mode, every, cursor)


def _indexes(L: _Loader, dm: YamlMap, schema: pa.Schema, ds: str) -> tuple[IndexConfig, ...]:
    y = L.y
    im = y.mapping(dm, "indexes", "indexes")
    out = []
    for col in im:
        c = str(col)
        if c not in schema.names:
            raise y.error(
                f"index on unknown column '{c}' of dataset '{ds}'",
                y.key_span(im, col),
                did_you_mean(c, schema.names, "columns"),
            )
        v = im[col]
        opts: dict[str, Any] = {}
        if isinstance(v, YamlMap):
            if "kind" not in v:
                raise y.error(
                    f"index on '{c}' needs 'kind'",
                    y.key_span(im, col),
                    f"kinds: {', '.join(INDEX_KINDS)}",
                )
            kind = y.string(v, "kind", "index kind")
            if kind in INDEX_KEYS:
                y.check_keys(v, INDEX_KEYS[kind], f"{kind} index on '{c}'")
            opts = {str(k): v[k] for k in v if k != "kind"}
            span = y.value_span(v, "kind")
        else:
            kind = y.string(im, col, "index kind")
            span = y.value_span(im, col)
        if kind not in INDEX_KINDS:
            raise y.error(
                f"unknown index kind '{kind}'", span, did_you_mean(kind, INDEX_KINDS, "index kinds")
            )
        t = schema.field(c).type
        if kind == "hnsw" and not pa.types.is_fixed_size_list(t):
            raise y.error(f"hnsw index needs a vector[N] column; '{c}' is {P_type(t)}", span)
        if kind == "inverted" and not (pa.types.is_string(t) or pa.types.is_list(t)):
            raise y.error(
                f"inverted index needs a str or list[str] column; '{c}' is {P_type(t)}", span
            )
        if kind == "hnsw":
            metric = opts.get("metric", "cosine")
            if metric not in ("cosine", "l2", "ip"):
                raise y.error(
                    f"unknown hnsw metric {metric!r}",
                    y.value_span(v, "metric"),
                    did_you_mean(str(metric), ("cosine", "l2", "ip"), "metrics"),
                )
            for k in ("M", "ef_construction", "ef", "max_elements"):
                if k in opts and (
                    isinstance(opts[k], bool) or not isinstance(opts[k], int) or opts[k] <= 0
                ):
                    raise y.error(f"hnsw {k} must be a positive integer", y.value_span(v, k))
            opts = {"metric": metric, **{k: val for k, val in opts.items() if k != "metric"}}
        out.append(IndexConfig(c, kind, opts))
    return tuple(out)


def P_type(t: pa.DataType) -> str:
    from dsl.types import from_arrow

    return from_arrow(t)


def _bindings(L: _Loader, doc: YamlMap) -> tuple[str, ...]:
    y = L.y
    out = []
    for c, k in y.items(doc, "bindings"):
        if not isinstance(c[k], str):
            raise y.error("bindings must list directories, globs or files", y.value_span(c, k))
        out.append(L.subst(c, k))
    return tuple(out)


def _stale(L: _Loader, m: YamlMap, key: Any, base: StaleWhen | None = None) -> StaleWhen:
    y = L.y
    sm = y.mapping(m, key, "stale_when")
    y.check_keys(sm, STALE_KEYS, "stale_when")
    base = base or StaleWhen()
    msgs = base.lag_messages
    secs = base.lag_seconds
    if "lag_messages" in sm:
        msgs = y.integer(sm, "lag_messages", "lag_messages", 1)
    if "lag_seconds" in sm:
        secs = duration_seconds(sm["lag_seconds"], y.value_span(sm, "lag_seconds"), "lag_seconds")
    return StaleWhen(msgs, secs)


def _signals(L: _Loader, doc: YamlMap) -> SignalsConfig:
    y = L.y
    m = y.mapping(doc, "signals", "signals")
    y.check_keys(m, SIGNAL_KEYS, "signals")
    kw: dict[str, Any] = {}  # what is not given keeps SignalsConfig's default

    def seconds(key: str, field_name: str) -> None:
        if key in m:
            kw[field_name] = duration_seconds(m[key], y.value_span(m, key), key)

    if "stale_when" in m:
        kw["stale_when"] = _stale(L, m, "stale_when")
    seconds("heartbeat", "heartbeat_seconds")
    if "targets" in m:
        targets = []
        for c, k in y.items(m, "targets"):
            t = L.subst(c, k)
            if not isinstance(t, str) or not re.match(r"^(udp|http|https)://", t):
                raise y.error(
                    f"signal target must be udp://host:port or http(s)://..., got {t!r}",
                    y.value_span(c, k),
                )
            targets.append(t)
        kw["targets"] = tuple(targets)
    if "sources" in m:
        srcm = y.mapping(m, "sources", "signals sources")
        base = kw.get("stale_when", StaleWhen())
        kw["sources"] = {str(uri): _stale(L, srcm, uri, base) for uri in srcm}
    if "hysteresis" in m:
        hyst = m["hysteresis"]
        if isinstance(hyst, bool) or not isinstance(hyst, int | float) or not 0 < hyst <= 1:
            raise y.error("hysteresis must be a number in (0, 1]", y.value_span(m, "hysteresis"))
        kw["hysteresis"] = float(hyst)
    seconds("timeout", "timeout_seconds")
    seconds("recover_after", "recover_after_seconds")
    return SignalsConfig(**kw)


def _sandbox(L: _Loader, doc: YamlMap) -> SandboxConfig:
    y = L.y
    m = y.mapping(doc, "sandbox", "sandbox")
    y.check_keys(m, SANDBOX_KEYS, "sandbox")
    kw: dict[str, Any] = {}
    for k in ("cpu_seconds", "wall_seconds"):
        if k in m:
            kw[k] = duration_seconds(m[k], y.value_span(m, k), k)
    for k in ("memory_mb", "output_mb", "workers"):
        if k in m:
            kw[k] = y.integer(m, k, k, 1)
    if "allowed_imports" in m:
        kw["allowed_imports"] = tuple(str(c[k]) for c, k in y.items(m, "allowed_imports"))
    return SandboxConfig(**kw)


def _crypto(L: _Loader, doc: YamlMap) -> CryptoConfig:
    y = L.y
    m = y.mapping(doc, "crypto", "crypto")
    y.check_keys(m, CRYPTO_KEYS, "crypto")
    pub = L.root / L.subst(m, "public_context") if "public_context" in m else None
    agents = {}
    if "agents" in m:
        am = y.mapping(m, "agents", "crypto agents")
        agents = {str(k): L.root / str(L.subst(am, k)) for k in am}
    return CryptoConfig(pub, agents)


def _server(L: _Loader, doc: YamlMap) -> ServerConfig:
    y = L.y
    m = y.mapping(doc, "server", "server")
    y.check_keys(m, SERVER_KEYS, "server")
    kw: dict[str, Any] = {}
    if "host" in m:
        kw["host"] = str(L.subst(m, "host"))
    if "port" in m:
        kw["port"] = y.integer(m, "port", "port", 1)
    for k in ("header_timeout", "keep_alive"):
        if k in m:
            kw[k] = duration_seconds(m[k], y.value_span(m, k), k)
            if kw[k] <= 0:
                raise y.error(f"{k} must be more than 0 seconds", y.value_span(m, k))
    if "max_connections" in m:
        kw["max_connections"] = y.integer(m, "max_connections", "max_connections", 1)
    if "max_header_bytes" in m:
        kw["max_header_bytes"] = y.integer(m, "max_header_bytes", "max_header_bytes", 1024)
    if "flight_port" in m:
        kw["flight_port"] = y.integer(m, "flight_port", "flight_port", 0)
    if "query_workers" in m:
        kw["query_workers"] = y.integer(m, "query_workers", "query_workers", 1)
    if "queue" in m:
        kw["queue"] = y.string(m, "queue", "queue")
        if kw["queue"] not in ("fair", "fifo"):
            raise y.error(
                f"server queue must be fair or fifo, got {kw['queue']!r}",
                y.value_span(m, "queue"),
                "fair: round-robin between agents (the default); fifo: arrival order",
            )
    return ServerConfig(**kw)


def _ingest(L: _Loader, doc: YamlMap) -> IngestConfig:
    y = L.y
    m = y.mapping(doc, "ingest", "ingest")
    y.check_keys(m, INGEST_KEYS, "ingest")
    kw: dict[str, Any] = {}
    if "enabled" in m:
        kw["enabled"] = y.boolean(m, "enabled", "enabled")
    if "checkpoint_dir" in m:
        kw["checkpoint_dir"] = L.root / str(L.subst(m, "checkpoint_dir"))
    if "group_prefix" in m:
        kw["group_prefix"] = y.string(m, "group_prefix", "group_prefix")
    if "batch_size" in m:
        kw["batch_size"] = y.integer(m, "batch_size", "batch_size", 1)
    return IngestConfig(**kw)


def _executor(L: _Loader, doc: YamlMap) -> ExecutorConfig:
    """``executor: ray`` or ``executor: {kind: ray, num_cpus: 2, address: ..., min_rows: ...}``."""
    y = L.y
    if not isinstance(doc["executor"], YamlMap):
        kind = str(L.subst(doc, "executor"))
        span = y.value_span(doc, "executor")
        kw: dict[str, Any] = {}
    else:
        m = y.mapping(doc, "executor", "executor")
        y.check_keys(m, EXECUTOR_KEYS, "executor")
        kind = str(L.subst(m, "kind")) if "kind" in m else "local"
        span = y.value_span(m, "kind") if "kind" in m else y.value_span(doc, "executor")
        kw = {}
        if "num_cpus" in m:
            kw["num_cpus"] = y.integer(m, "num_cpus", "num_cpus", 1)
        if "address" in m:
            kw["address"] = str(L.subst(m, "address"))
        if "min_rows" in m:
            kw["min_rows"] = y.integer(m, "min_rows", "min_rows", 0)
        if "join_min_rows" in m:
            kw["join_min_rows"] = y.integer(m, "join_min_rows", "join_min_rows", 0)
    if kind not in EXECUTOR_KINDS:
        raise y.error(
            f"unknown executor {kind!r}",
            span,
            did_you_mean(kind, EXECUTOR_KINDS, "executors"),
        )
    return ExecutorConfig(kind=kind, **kw)
