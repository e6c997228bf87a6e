"""``pytest -p tests.ray_mode ...``: run test suites unchanged with ``executor: ray``.

Loaded as a plugin, it starts the session's one local Ray cluster (tests/ray_support.py:
2 CPUs, loopback, ``RAY_USAGE_STATS_ENABLED=0``, token and session files under the
session's data folder) before the first test, and every ``Fabric`` the session opens
whose configuration says ``executor: local`` (the default) runs with
``executor: {kind: ray, min_rows: 0}`` instead: every scan that splits goes to Ray
tasks. The tests' own assertions (brute force, DuckDB, the expected rows) are then the
check that Ray mode gives local mode's results. At the end it prints how many fabrics
ran on Ray and how many scans ran as Ray tasks, so a run that never reached Ray shows
as such::

    .venv/bin/pytest -p tests.ray_mode tests/test_retrieval.py tests/test_ingest*.py -q

The cluster is stopped at the end of the session, only the processes it started, by PID.
"""

from __future__ import annotations

import pytest

from tests import ray_support

ray_cluster = ray_support.ray_cluster

COUNTS = {"fabrics": 0, "ray_scans": 0, "local_scans": 0}
RAY_EXECUTOR = {"kind": "ray", "min_rows": 0}


@pytest.fixture(scope="session", autouse=True)
def _every_fabric_on_ray(ray_cluster):
    from fabric import api
    from fabric.ray import scan

    init, ray_scan = api.Fabric.__init__, scan.RayScans.scan

    def fabric_init(self, config, *args, **kw):
        if config.executor.kind == "local":
            config = api._with_executor(config, RAY_EXECUTOR)
        init(self, config, *args, **kw)
        if self.executor is not None:
            COUNTS["fabrics"] += 1

    def counted_scan(self, source, request, scan_=None):
        got = ray_scan(self, source, request, scan_)
        COUNTS["ray_scans" if got is not None else "local_scans"] += 1
        return got

    api.Fabric.__init__ = fabric_init  # type: ignore[method-assign]
    scan.RayScans.scan = counted_scan  # type: ignore[method-assign]
    try:
        yield ray_cluster
    finally:
        api.Fabric.__init__ = init  # type: ignore[method-assign]
        scan.RayScans.scan = ray_scan  # type: ignore[method-assign]


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(
        f"executor: ray mode: {COUNTS['fabrics']} fabrics opened on the session's Ray cluster; "
        f"{COUNTS['ray_scans']} scans ran as Ray tasks, "
        f"{COUNTS['local_scans']} stayed in-process (unsplittable: dataset, memory, file, "
        "or limited / ordered)"
    )
