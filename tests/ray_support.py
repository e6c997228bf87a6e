"""The one local Ray cluster of a test session (tests/test_ray*.py import ``ray_cluster``).

Started on first use with 2 CPUs, loopback only, its token and session files under the
session's temporary directory; every module shares it (``fabric.ray.cluster.acquire`` is
process-wide) and it is stopped at the end of the session, only the processes it started,
by PID."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="executor: ray needs the ray extra (pip install -e '.[ray]')")

from fabric.ray import cluster as _cluster


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    c = _cluster.acquire(tmp_path_factory.mktemp("ray"), num_cpus=2)
    try:
        yield c
    finally:
        _cluster.release(c)
        # each test module holds the session's cluster once; the last release stops it
        alive = [] if _cluster.current() is c else [p for p in c.pids if _cluster._alive(p)]
        if alive:  # name them: state and command line
            alive = [(p, _describe(p)) for p in alive]
        assert not alive, f"the session's Ray processes {alive} outlived the cluster"


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().split(") ", 1)[1][:1]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode()[:80]
        return f"{state} {cmd}"
    except OSError:
        return "gone"
