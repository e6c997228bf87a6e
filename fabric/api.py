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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from connectors.base import Connection, Source
from dsl.errors import Diagnostic
from fabric.catalog import Catalog
from fabric.compiler import BindingFiles, CompiledBinding, Compiler
from fabric.config import FabricConfig, load_config

log = logging.getLogger("fabric")


class UnknownBindingError(LookupError):
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
    ):
        self.config = config
        self.catalog = catalog or Catalog(
            config, connections=connections, dataset_sources=dataset_sources, offline=offline
        )
        self.compiler = Compiler(self.catalog)
        self.bindings = BindingFiles(self.compiler, config.binding_files, config.root)
        self._ingest = ingest
        self._closed = False
        if watch:
            self.bindings.watch()
        if ingest:
            self._start_ingest()

    # ---- lifecycle
    def _start_ingest(self) -> None:
        """LEAD: wire Kafka ingestion of the datasets declared in fabric.yaml here
        (fabric.ingest); until then open() does not ingest."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.bindings.stop()
        self.catalog.close()

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
        """Parse and compile every binding; every problem with file, line and column."""
        return self.bindings.validate()

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
    ) -> str:
        """The plan as indented text; ``analyze=True`` runs it and shows actual rows and times."""
        compiled = self.binding(name)
        if analyze:
            params = compiled.bind(session)
            from fabric.execute import execute

            result = execute(compiled.plan, params, self.catalog, binding=name, analyze=True)
            return result.explain or compiled.explain(optimized)
        if session is not None:
            compiled.bind(session)
        return compiled.explain(optimized)

    # ---- queries
    def query(self, name: str, session: Mapping[str, Any] | None = None) -> Any:
        """Run a binding with the agent's session values; returns a ``fabric.result.Result``."""
        compiled = self.binding(name)
        params = compiled.bind(session)
        from fabric.execute import execute

        return execute(compiled.plan, params, self.catalog, binding=name, analyze=False)

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
    ) -> Any:
        """Run the compact text form of a binding, e.g.
        ``from mysql://shop/merchants as m where m.status = 'active' select m.name limit 5``.
        ``python`` attaches a sandboxed ``run(table)`` post-processing function."""
        compiled = self.compiler.compile_text(text, session, python=python)
        params = compiled.bind(session)
        from fabric.execute import execute

        return execute(compiled.plan, params, self.catalog, binding=compiled.name, analyze=analyze)

    def explain_text(
        self, text: str, session: Mapping[str, Any] | None = None, *, optimized: bool = True
    ) -> str:
        compiled = self.compiler.compile_text(text, session)
        if session is not None:
            compiled.bind(session)
        return compiled.explain(optimized)

    # ---- to be wired by the lead
    def dataset(self, name: str) -> Any:
        """LEAD: return the materialized dataset ``name`` (upsert/delete/count)."""
        raise NotImplementedError(
            "Fabric.dataset() is wired by the datasets integration (indexes/, connectors/dataset.py)"
        )

    def freshness(self) -> Any:
        """LEAD: every source and binding with its freshness, as GET /v1/freshness serves it."""
        raise NotImplementedError(
            "Fabric.freshness() is wired by the freshness integration (fabric/freshness.py)"
        )

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
) -> Fabric:
    """Open a fabric from ``fabric.yaml`` (a path), YAML text, a dict, or a FabricConfig."""
    config = (
        path_or_config if isinstance(path_or_config, FabricConfig) else load_config(path_or_config)
    )
    return Fabric(
        config,
        ingest=ingest,
        watch=watch,
        connections=connections,
        dataset_sources=dataset_sources,
        offline=offline,
    )
