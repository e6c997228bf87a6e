"""``executor: ray``: the same bindings, with coarse work on a Ray cluster.

    fab = fabric.open("fabric.yaml", executor="ray")      # or executor: ray in fabric.yaml

Local mode stays the default and unchanged. With ``ray`` the fabric starts (or attaches
to) one Ray cluster per process (``fabric.ray.cluster``: offline, loopback only, token
and session files under the fabric's data folder ``.fabric/ray``) and the executor sends
source scans estimated at ``min_rows`` or more to it as tasks split by the source's
natural unit (``fabric.ray.scan``), and joins whose two sides both hold
``join_min_rows`` rows or more as hash-partitioned tasks (``fabric.ray.join``).
Everything else (smaller joins, aggregates, retrieval, sandboxes) runs as in local
mode. docs/scale.md has the measurements and the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["RayExecutor", "start"]


class RayExecutor:
    """What a Fabric holds while it runs on Ray: the cluster it shares and the scan hook
    the executor calls (``catalog.executor``)."""

    def __init__(self, cluster: Any, scans: Any, joins: Any = None):
        self.cluster = cluster
        self.scans = scans
        #: fabric.ray.join.RayJoins: large joins as hash-partitioned tasks (None: local)
        self.joins = joins
        self._closed = False

    def scan(self, source: Any, request: Any, scan: Any = None) -> Any:
        return self.scans.scan(source, request, scan)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from fabric.ray import cluster

        cluster.release(self.cluster)


def start(config: Any, data_dir: str | Path) -> RayExecutor:
    """A RayExecutor for ``config`` (``fabric.config.ExecutorConfig``); the cluster is
    started or attached to on first use in this process and shared after."""
    from fabric.ray import cluster
    from fabric.ray.join import DEFAULT_JOIN_MIN_ROWS, RayJoins
    from fabric.ray.scan import DEFAULT_MIN_ROWS, RayScans

    c = cluster.acquire(Path(data_dir), num_cpus=config.num_cpus, address=config.address)
    try:
        min_rows = DEFAULT_MIN_ROWS if config.min_rows is None else config.min_rows
        jmin = getattr(config, "join_min_rows", None)
        jmin = DEFAULT_JOIN_MIN_ROWS if jmin is None else jmin
        return RayExecutor(c, RayScans(c, min_rows=min_rows), RayJoins(c, min_rows=jmin))
    except BaseException:
        cluster.release(c)
        raise
