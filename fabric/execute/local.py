"""A minimal catalog over opened connections: ``<kind>://<connection>/<object>`` -> Source.

The Fabric API has its own catalog (config, datasets, sandbox, crypto); this one serves
the executor's tests, the scenario tests and the benchmark, which open connections
directly. Sources are opened once and kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from connectors.base import Connection, Source


class LocalCatalog:
    def __init__(
        self,
        connections: Mapping[str, Connection],
        *,
        datasets: Mapping[str, Source] | None = None,
        scan_timeout: float | None = None,
        **hooks: Any,
    ):
        self.connections = dict(connections)
        self.scan_timeout = scan_timeout
        self._sources: dict[str, Source] = {
            f"dataset://{n}": s for n, s in (datasets or {}).items()
        }
        for name, hook in hooks.items():  # sandbox=..., crypto_score=..., freshness=...
            setattr(self, name, hook)

    def source(self, uri: str) -> Source:
        if uri not in self._sources:
            _kind, sep, rest = uri.partition("://")
            conn_name, _, obj = rest.partition("/")
            if not sep or conn_name not in self.connections:
                raise LookupError(
                    f"no connection {conn_name!r} for source {uri}; known connections: "
                    f"{', '.join(sorted(self.connections)) or '(none)'}"
                )
            self._sources[uri] = self.connections[conn_name].source(obj)
        return self._sources[uri]

    def resolve(self, uri: str, span: Any = None) -> Any:
        """The planning view the binding builder asks for (``fabric.catalog.SourceView``)."""
        from fabric.catalog import SourceView

        src = self.source(uri)
        caps = frozenset(getattr(src, "capabilities", frozenset({"projection"})))
        return SourceView(uri, uri.partition("://")[0], src.schema(), caps, src)
