"""The Python API: ``fabric.open(...) -> Fabric``.

    fab = fabric.open("fabric.yaml")
    res = fab.query("nearby_offers", session={"user_id": 42})
    print(fab.explain("nearby_offers"))
    fab.query_text("from mysql://shop/merchants as m where m.status = 'active' select m.name limit 5")
    fab.validate()          # [Diagnostic(file, line, column, message), ...]
    fab.close()

A small facade: configuration in ``fabric.config``, sources in ``fabric.catalog``,
compilation and hot reload in ``fabric.compiler``, execution in ``fabric.execute``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from connectors.base import Connection, Source
from dsl.errors import Diagnostic, DslError, FabricError
from fabric.catalog import Catalog
from fabric.compiler import BindingFiles, CompiledBinding, Compiler
from fabric.config import FabricConfig, load_config

log = logging.getLogger("fabric")


_execute: Any = None  # fabric.execute.execute, imported on the first query (it loads DuckDB)


def _load_execute() -> Any:
    global _execute
    from fabric.execute import execute

    _execute = execute
    return execute


def _kafka_connection(uri: str | None) -> str | None:
    """The connection of a ``kafka://<connection>/<topic>`` URI, else None."""
    if not uri or not uri.startswith("kafka://"):
        return None
    return uri[len("kafka://") :].partition("/")[0]


class UnknownBindingError(FabricError, LookupError):
    """No binding of that name; the message lists the existing ones."""


class Fabric:
    def __init__(
        self,
        config: FabricConfig,
        *,
        ingest: bool = True,
        watch: bool = True,
        catalog: Catalog | None = None,
        connections: Mapping[str, Connection] | None = None,
        dataset_sources: Mapping[str, Source] | None = None,
        offline: bool = False,
        prewarm: bool = True,
    ):
        self.config = config
        self.catalog = catalog or Catalog(
            config, connections=connections, dataset_sources=dataset_sources, offline=offline
        )
        self.executor: Any = None  # fabric.ray.RayExecutor with executor: ray
        #: datasets of fabric.yaml with shards: N (fabric.ray.shards.ShardedDataset)
        self.sharded: dict[str, Any] = {}
        self.compiler = Compiler(self.catalog)
        self.bindings = BindingFiles(self.compiler, config.binding_files, config.root)
        self._closed = False
        self.service: Any = None
        self._caches: dict[tuple[str, str], Any] = {}  # (binding, content hash) -> cache
        self._cache_lock = threading.Lock()
        #: fabric.tracing.Tracer (``tracing:`` of fabric.yaml; on by default), None when off
        self.tracer: Any = None
        if config.tracing.enabled:
            from fabric.tracing import Tracer

            self.tracer = Tracer(config.tracing)
        self.catalog.tracer = self.tracer  # type: ignore[attr-defined]
        if config.executor.kind == "ray" and not offline:  # before the datasets' first refresh
            from fabric.ray import start

            try:
                self.executor = start(config.executor, config.root / ".fabric" / "ray")
            except BaseException:
                self.close()
                raise
            self.catalog.executor = self.executor  # type: ignore[attr-defined]
        if not offline:
            try:
                self._start_datasets(ingest)
                if prewarm:  # cache: {prewarm: FILE} of the bindings
                    self._prewarm_declared()
            except BaseException:
                self.close()
                raise
        if watch:
            self.bindings.watch()

    # ---- lifecycle
    def _start_datasets(self, ingest: bool) -> None:
        """Materialize the datasets of fabric.yaml (loaded from their last checkpoint),
        attach each to the catalog as ``dataset://<name>``, and, with ``ingest``, start
        consuming the Kafka-fed ones. Freshness of every source is tracked for results,
        ``freshness()`` and the pushed signals."""
        import dataclasses

        from connectors.dataset import DatasetSource
        from fabric.datasets import FabricService

        config = self.config
        sharded = {n: d for n, d in config.datasets.items() if d.shards > 1}
        if sharded:  # run on Ray actors (fabric.ray.shards), not by the dataset manager
            self._check_sharded(sharded)
            local = {n: d for n, d in config.datasets.items() if n not in sharded}
            config = dataclasses.replace(config, datasets=local)
        self.service = FabricService.from_config(config, connection_factory=self.catalog.connection)
        if self.executor is not None:  # refreshes read their sources as Ray tasks too
            self.service.manager.scan_hook = self.executor.scan
        try:
            self.service.start(ingest=ingest)
        except BaseException:
            self.service.stop()
            raise
        for name, ds in self.service.manager.datasets.items():
            self.catalog.register_dataset(name, DatasetSource(f"dataset://{name}", ds))
        if sharded:
            from fabric.ray.shards import ShardedSource, open_sharded

            mgr = self.service.manager
            for name, d in sharded.items():
                self.sharded[name] = open_sharded(
                    self.executor.cluster,
                    d,
                    self.catalog.connection,
                    state_dir=mgr.state_dir / name,
                    group_id=mgr.group_id(name, _kafka_connection(d.from_uri)),
                    batch_size=mgr.batch_size,
                    ingest=ingest,
                )
                src = ShardedSource(f"dataset://{name}", self.sharded[name])
                self.catalog.register_dataset(name, src)
                if d.refresh is not None:  # from a table, collection or file
                    from fabric.datasets import DatasetDecl
                    from fabric.ray.shards import ShardedRefresher

                    decl = DatasetDecl.from_config(d)
                    r = mgr.refreshers[name] = ShardedRefresher(mgr, decl, self.sharded[name])
                    if ingest:
                        r.start()
        self.catalog.freshness = self._source_freshness  # type: ignore[attr-defined]
        if self.tracer is not None:  # data_stale / data_fresh on the session timelines
            self.tracer.attach(self.service.tracker)

    def _check_sharded(self, sharded: Mapping[str, Any]) -> None:
        from dsl.errors import Diagnostic, DslError

        if self.executor is None:
            name, d = next(iter(sharded.items()))
            raise DslError(
                Diagnostic(
                    f"dataset '{name}' declares shards: {d.shards}, and shards run as Ray "
                    "actors, but this fabric runs with executor: local",
                    d.shards_span,
                    "set executor: ray in fabric.yaml (or fabric.open(..., executor='ray')), "
                    "or remove shards:",
                )
            )

    def _source_freshness(self, uri: str) -> Mapping[str, Any] | None:
        """The executor's freshness provider for a dataset, always against its source: a
        Kafka-fed one ingested here reports what its ingestor measured from the broker
        (every 0.5 s); one not ingested here (``ingest=False``), not measured yet, or whose
        ingestor reports an error is measured against the broker now
        (``DatasetManager.broker_lag``); a refreshed one compares its refresh watermark
        with the source's (``DatasetManager.refresh_freshness``)."""
        name = uri[len("dataset://") :] if uri.startswith("dataset://") else uri
        mgr = self.service.manager
        if name in self.sharded:  # refreshed: its refresher's; else every shard's lag
            from fabric.ray.shards import sharded_freshness

            if name in mgr.refreshers:
                return mgr.refresh_freshness(name)
            return sharded_freshness(self.sharded[name])
        decl = mgr.decls.get(name)
        if decl is None:
            return None
        if decl.kafka_feed() is None:
            return mgr.refresh_freshness(name)
        ing = mgr.ingestors.get(name)
        if ing is None or ing.lag_messages is None or ing.last_error is not None:
            wm = mgr.broker_lag(name)
            if ing is not None and ing.last_error is not None and not wm.get("error"):
                wm["error"] = f"ingestion: {ing.last_error}"
            return wm
        lag = self.service.tracker.lag(name)
        if lag is None or lag[0] != "kafka":
            return None
        _kind, lag_messages, lag_seconds, event_time = lag
        return {"lag_messages": lag_messages, "lag_seconds": lag_seconds, "event_time": event_time}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tracer is not None:
            self.tracer.close()
        self.bindings.stop()
        if self.service is not None:
            self.service.stop()
        for ds in self.sharded.values():  # checkpoints written, then the actors stopped
            ds.close()
        self.catalog.close()
        if self.executor is not None:
            self.executor.close()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- bindings
    def binding(self, name: str) -> CompiledBinding:
        """The compiled binding (compiled on first use, recompiled when its file changes)."""
        try:
            return self.bindings.get(name)
        except LookupError as e:
            raise UnknownBindingError(str(e)) from None

    @property
    def diagnostics(self) -> list[Diagnostic]:
        """Current problems of the binding files (e.g. a broken edit still being served by
        its last good plan)."""
        return self.bindings.diagnostics

    def validate(self) -> list[Diagnostic]:
        """Parse and compile every binding, and check that every dataset's ``from:`` source
        exists (a topic, table, collection or file); every problem with file, line and
        column. A binding's ``cache: {prewarm: FILE}`` is read and each session checked
        against the binding's session types, not run."""
        found = self.bindings.validate()
        return self._check_dataset_sources() + found + self._check_prewarm_files(found)

    def _check_prewarm_files(self, found: list[Diagnostic]) -> list[Diagnostic]:
        """What ``_prewarm_declared`` would refuse at open (fabric/semantic_cache.py,
        ``prewarm_sessions``): a missing or unreadable file at the binding's ``prewarm:``,
        a line that is not a JSON object or whose session values have the wrong types at
        its line and column. A binding with problems of its own (``found``) is skipped."""
        from fabric.semantic_cache import prewarm_sessions

        bad = {d.span.file for d in found if d.span is not None}
        out: list[Diagnostic] = []
        for name in self.bindings.names():
            try:
                spec = self.bindings.spec(name)
            except LookupError:
                continue
            if spec.cache is None or spec.cache.prewarm is None or spec.file in bad:
                continue
            try:
                bind = self.binding(name).bind
            except DslError:  # reported by bindings.validate()
                continue
            path = Path(spec.file)
            path = path if path.is_absolute() else self.config.root / path
            try:
                prewarm_sessions(spec, path, spec.file, bind)
            except DslError as e:
                out.extend(e.diagnostics)
        return out

    def _check_dataset_sources(self) -> list[Diagnostic]:
        if self.catalog.offline:
            return []
        out = []
        for d in self.config.datasets.values():
            if d.from_uri is None:
                continue
            if d.from_uri.startswith("kafka://"):
                why = self.service.manager.topic_problem(d.name) if self.service else None
                if why is not None:
                    out.append(
                        Diagnostic(
                            why,
                            d.from_span,
                            "create the topic, or fix from: in fabric.yaml",
                        )
                    )
                continue
            try:
                self.catalog.resolve(d.from_uri, d.from_span)
            except DslError as e:
                out.extend(e.diagnostics)
        return out

    def reload(self) -> list[str]:
        """Re-read changed binding files now (the watcher does this every ~200 ms)."""
        return self.bindings.scan()

    def explain(
        self,
        name: str,
        session: Mapping[str, Any] | None = None,
        *,
        analyze: bool = False,
        optimized: bool = True,
        session_id: str | None = None,
    ) -> str:
        """The plan as indented text; ``analyze=True`` runs it and shows actual rows and times."""
        compiled = self.binding(name)
        if analyze:
            params = compiled.bind(session)
            from fabric.execute import execute

            result = execute(
                compiled.runnable,
                params,
                self.catalog,
                binding=name,
                analyze=True,
                session_id=session_id,
                version=compiled.content_hash,
            )
            return result.explain or compiled.explain(optimized)
        if session is not None:
            compiled.bind(session)
        return compiled.explain(optimized)

    # ---- queries
    def query(
        self,
        name: str,
        session: Mapping[str, Any] | None = None,
        *,
        session_id: str | None = None,
    ) -> Any:
        """Run a binding with the agent's session values; returns a ``fabric.result.Result``.
        ``session_id`` names the agent's session in the traces and timelines
        (docs/tracing.md); without it, the one set by ``fabric.tracing.session(...)``."""
        try:
            compiled = self.bindings.get(name)  # (self.binding, one call less per query)
        except LookupError as e:
            raise UnknownBindingError(str(e)) from None
        params = compiled.bind(session)
        execute = _execute or _load_execute()
        if compiled.spec.cache is None:  # no semantic cache: run the plan, nothing around it
            return execute(
                compiled.runnable,
                params,
                self.catalog,
                binding=name,
                session_id=session_id,
                version=compiled.content_hash,
            )

        def run() -> Any:
            return execute(
                compiled.runnable,
                params,
                self.catalog,
                binding=name,
                analyze=False,
                session_id=session_id,
                version=compiled.content_hash,
            )

        if self.tracer is not None and compiled.spec.cache is not None:  # a hit runs no plan
            return self.tracer.cached(
                name,
                compiled.content_hash,
                params,
                session_id,
                lambda: self._cached(compiled, params, run),
            )
        return self._cached(compiled, params, run)

    # ---- the semantic cache (``cache:`` of a binding; fabric/semantic_cache.py)
    def _cached(self, compiled: CompiledBinding, params: dict[str, Any], run: Any) -> Any:
        """``run()``, or a valid cached answer to a similar question (``cache:``)."""
        spec = compiled.spec.cache
        if spec is None:
            return run()
        from fabric.semantic_cache import SemanticCache, run_cached, uris_of

        key = (compiled.name, compiled.content_hash)
        with self._cache_lock:
            entry = self._caches.get(key)
            if entry is None:
                for old in [k for k in self._caches if k[0] == compiled.name]:
                    del self._caches[old]  # the binding changed: its answers may too
                cache = SemanticCache(compiled.name, spec)
                entry = self._caches[key] = (cache, uris_of(compiled.plan))
        cache, uris = entry
        return run_cached(cache, params, self.catalog, uris, run)

    def prewarm(self, name: str, sessions: Any) -> dict[str, Any]:
        """Fill binding ``name``'s semantic cache from representative sessions (run each
        once); returns the cache's counters."""
        for s in sessions:
            self.query(name, s)
            self._cache_count(name, "prewarmed")
        return self.cache_metrics(name)

    def _prewarm_declared(self) -> None:
        """Run the sessions of every ``cache: {prewarm: FILE}`` (fabric/semantic_cache.py,
        ``prewarm_sessions``): a missing or bad file, or a session value of the wrong type,
        fails the open with its position; a session whose query fails is logged and
        counted (``prewarm_failed``), the fabric still opens."""
        from fabric.semantic_cache import prewarm_sessions

        for name in self.bindings.names():
            try:
                spec = self.bindings.spec(name)
            except LookupError:
                continue
            if spec.cache is None or spec.cache.prewarm is None:
                continue
            try:
                compiled = self.binding(name)
            except DslError as e:  # reported by validate(); nothing to prewarm
                log.warning("binding %s does not compile; not prewarmed:\n%s", name, e.format())
                continue
            path = Path(spec.file)
            path = path if path.is_absolute() else self.config.root / path
            for s in prewarm_sessions(spec, path, spec.file, compiled.bind):
                try:
                    self.query(name, s)
                except Exception as e:
                    log.warning("binding %s: a prewarm session failed: %s", name, e)
                    self._cache_count(name, "prewarm_failed")
                else:
                    self._cache_count(name, "prewarmed")

    def _cache_count(self, name: str, counter: str) -> None:
        with self._cache_lock:
            found = [c for (n, _), (c, _) in self._caches.items() if n == name]
        if found:
            found[0].count(counter)

    def cache_metrics(self, name: str) -> dict[str, Any]:
        """Hits, misses by reason, invalidations, expirations, evictions, entries and bytes
        of binding ``name``'s semantic cache (empty when it has none or never ran)."""
        with self._cache_lock:
            found = [c for (n, _), (c, _) in self._caches.items() if n == name]
        return found[0].metrics() if found else {}

    def cache_metrics_all(self) -> dict[str, dict[str, Any]]:
        """``cache_metrics`` of every binding whose cache has run (``/metrics`` reads it)."""
        with self._cache_lock:
            caches = {n: c for (n, _), (c, _) in self._caches.items()}
        return {n: c.metrics() for n, c in caches.items()}

    def compile_text(
        self, text: str, session: Mapping[str, Any] | None = None, *, python: str | None = None
    ) -> CompiledBinding:
        return self.compiler.compile_text(text, session, python=python)

    def query_text(
        self,
        text: str,
        session: Mapping[str, Any] | None = None,
        *,
        python: str | None = None,
        analyze: bool = False,
        session_id: str | None = None,
    ) -> Any:
        """Run the compact text form of a binding, e.g.
        ``from mysql://shop/merchants as m where m.status = 'active' select m.name limit 5``.
        ``python`` attaches a sandboxed ``run(table)`` post-processing function."""
        compiled = self.compiler.compile_text(text, session, python=python)
        params = compiled.bind(session)
        from fabric.execute import execute

        return execute(
            compiled.runnable,
            params,
            self.catalog,
            binding=compiled.name,
            analyze=analyze,
            session_id=session_id,
            version=compiled.content_hash,
        )

    def explain_text(
        self, text: str, session: Mapping[str, Any] | None = None, *, optimized: bool = True
    ) -> str:
        compiled = self.compiler.compile_text(text, session)
        if session is not None:
            compiled.bind(session)
        return compiled.explain(optimized)

    # ---- datasets and freshness
    def dataset(self, name: str) -> Any:
        """The materialized, indexed dataset ``name``: ``upsert(table)``, ``delete(keys)``,
        ``count()``, ``search(...)``."""
        if self.service is None:
            raise LookupError("this fabric was opened offline: no datasets are materialized")
        if name in self.sharded:  # fabric.ray.shards.ShardedDataset
            return self.sharded[name]
        return self.service.manager.dataset(name)

    def refresh(self, name: str) -> dict[str, Any]:
        """Refresh dataset ``name`` from its table, collection or file now (its
        ``refresh:`` mode); returns what was read. Kafka-fed datasets ingest continuously."""
        if self.service is None:
            raise LookupError("this fabric was opened offline: no datasets are materialized")
        mgr = self.service.manager
        if name not in mgr.refreshers:
            mgr.dataset(name)  # unknown name: KeyError with the existing ones
            raise LookupError(
                f"dataset {name!r} is not fed from a table, collection or file (from: ...)"
            )
        return mgr.refreshers[name].refresh()

    def catch_up_timeout(self, timeout: float | None = None) -> float:
        """``timeout``, else the longest ``timeout`` of the Kafka connections feeding
        datasets (10 s by default)."""
        if timeout is not None:
            return float(timeout)
        conns = {
            d.from_uri.split("://", 1)[1].split("/", 1)[0]
            for d in self.config.datasets.values()
            if d.from_uri and d.from_uri.startswith("kafka://")
        }
        return max(
            (float(getattr(self.catalog.connection(c), "timeout", 10.0)) for c in conns),
            default=10.0,
        )

    def catch_up(self, timeout: float | None = None) -> bool:
        """Wait until every dataset ingested here has applied everything the broker held
        when it was last measured (``catch_up_timeout`` seconds at most); True if so."""
        if self.service is None or not self.service.manager.ingestors:
            return True
        return self.service.manager.wait_caught_up(self.catch_up_timeout(timeout))

    def freshness(self) -> dict[str, Any]:
        """Every source and binding with state, lags and since-when, as ``GET
        /v1/freshness`` serves it."""
        if self.service is None:
            return {"sources": {}, "bindings": {}}
        return self.service.tracker.snapshot()

    def __repr__(self) -> str:
        return f"Fabric({self.config.path or '<config>'}, bindings={self.bindings.names()})"


def open(
    path_or_config: str | Path | FabricConfig | Mapping[str, Any] | None = "fabric.yaml",
    *,
    ingest: bool = True,
    watch: bool = True,
    connections: Mapping[str, Connection] | None = None,
    dataset_sources: Mapping[str, Source] | None = None,
    offline: bool = False,
    executor: str | Mapping[str, Any] | None = None,
    prewarm: bool = True,
) -> Fabric:
    """Open a fabric from ``fabric.yaml`` (a path), YAML text, a dict, or a FabricConfig.

    ``executor``: ``"local"`` or ``"ray"`` (or ``{"kind": "ray", "min_rows": ...}``),
    instead of fabric.yaml's ``executor:``. ``prewarm=False``: the bindings' semantic
    caches start empty (``cache: {prewarm: FILE}`` is not run; ``validate()`` checks it)."""
    config = (
        path_or_config if isinstance(path_or_config, FabricConfig) else load_config(path_or_config)
    )
    if executor is not None:
        config = _with_executor(config, executor)
    return Fabric(
        config,
        ingest=ingest,
        watch=watch,
        connections=connections,
        dataset_sources=dataset_sources,
        offline=offline,
        prewarm=prewarm,
    )


def _with_executor(config: FabricConfig, executor: str | Mapping[str, Any]) -> FabricConfig:
    import dataclasses

    from fabric.config import EXECUTOR_KEYS, EXECUTOR_KINDS, ExecutorConfig

    spec = {"kind": executor} if isinstance(executor, str) else dict(executor)
    unknown = sorted(set(spec) - set(EXECUTOR_KEYS))
    if unknown or spec.get("kind", "local") not in EXECUTOR_KINDS:
        raise ValueError(
            f"fabric.open(executor={executor!r}): use 'local', 'ray' or a dict with "
            f"{', '.join(EXECUTOR_KEYS)} (kind one of {', '.join(EXECUTOR_KINDS)})"
        )
    return dataclasses.replace(config, executor=ExecutorConfig(**spec))
