"""One local Ray cluster per process, started offline and quiet, or attached to.

``acquire(data_dir, num_cpus=2, address=None)`` returns the process-wide ``Cluster``:
the first caller starts it (or attaches to ``address``), later callers share it;
``release()`` stops it when the last user lets go, and only if this process started it.

Started clusters are:

- offline: ``RAY_USAGE_STATS_ENABLED=0`` (no usage report), no dashboard, the node on
  127.0.0.1 (loopback only);
- token-authenticated with a token written under the fabric's data folder
  (``<data_dir>/auth_token``, mode 0600; never ``~/.ray``);
- with their session files under ``<data_dir>/tmp`` (a short path under /tmp when that
  one is too long for Ray's unix sockets, which must fit in 107 bytes);
- stopped with ``ray.shutdown()``, then any process this node started that is still
  alive is killed by its PID (never by name).

Ray's own costs on a 2-core machine (measured, see docs/scale.md): ~10 s to start under
load, ~2 ms per task round trip, ~1.2 ms per actor call, ~34 ms to move a 16 MB Arrow
table there and back. Only coarse work pays off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsl.errors import FabricError

__all__ = ["Cluster", "RayUnavailable", "acquire", "current", "release"]

# Ray's session directory holds unix sockets (<temp>/session_<date>_<pid>/sockets/raylet);
# their path must fit in sockaddr_un (107 bytes)
_MAX_TEMP_DIR = 60
START_ATTEMPTS = 3


class RayUnavailable(FabricError, RuntimeError):
    """Ray is not installed, or its cluster did not start."""


@dataclass
class Cluster:
    num_cpus: int
    address: str | None
    temp_dir: Path | None
    started: bool  # this process started the cluster (and stops it)
    start_seconds: float
    pids: list[int] = field(default_factory=list)  # processes the started node runs
    users: int = 0

    def cpus(self) -> int:
        import ray

        return int(ray.cluster_resources().get("CPU", self.num_cpus))


_lock = threading.Lock()
_cluster: Cluster | None = None


def current() -> Cluster | None:
    return _cluster


def _temp_dir(data_dir: Path) -> Path:
    want = data_dir / "tmp"
    if len(str(want)) <= _MAX_TEMP_DIR:
        return want
    digest = hashlib.sha1(str(want).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"fabric-ray-{digest}"


def _token(data_dir: Path) -> Path:
    path = data_dir / "auth_token"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def acquire(data_dir: str | Path, *, num_cpus: int = 2, address: str | None = None) -> Cluster:
    """The process-wide cluster, started (or attached to ``address``) on first use."""
    global _cluster
    with _lock:
        if _cluster is None:
            _cluster = _start(Path(data_dir), num_cpus, address)
        _cluster.users += 1
        return _cluster


def release(cluster: Cluster) -> None:
    """Let go of ``cluster``; the last user stops it (when this process started it)."""
    global _cluster
    with _lock:
        cluster.users -= 1
        if cluster.users > 0 or _cluster is not cluster:
            return
        _cluster = None
    _stop(cluster)


def _start(data_dir: Path, num_cpus: int, address: str | None) -> Cluster:
    # before Ray is imported (it reads them once), and inherited by every Ray process
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if address is None:
        # a single-node cluster on the loopback address (Ray otherwise picks the address
        # of the default route, reachable from the network)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(_token(data_dir.resolve()))
    was_imported = "ray" in sys.modules
    try:
        import ray
    except ImportError:
        raise RayUnavailable(
            "executor: ray needs the ray package, which is not installed "
            "(pip install 'agent-data-fabric[ray]')"
        ) from None
    t0 = time.perf_counter()
    if ray.is_initialized():  # someone in this process already runs Ray: share it
        return Cluster(num_cpus, address, None, False, 0.0)
    kw: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.WARNING,
        "configure_logging": False,
    }
    if address is not None:
        ray.init(address=address, **kw)
        return Cluster(num_cpus, address, None, False, time.perf_counter() - t0)
    if was_imported:  # Ray read its settings before they were set: read them again
        from ray._private import ray_constants
        from ray._raylet import Config  # type: ignore[attr-defined]

        ray_constants.ENABLE_RAY_CLUSTER = False
        Config.initialize("")
    temp = _temp_dir(data_dir.resolve())
    temp.mkdir(parents=True, exist_ok=True)
    for attempt in range(START_ATTEMPTS):
        try:
            ray.init(
                num_cpus=num_cpus,
                _temp_dir=str(temp),
                _node_ip_address="127.0.0.1",
                **kw,
            )
            break
        except Exception as e:
            # Ray gives its raylet a fixed 30 s to register: a loaded machine misses it
            with contextlib.suppress(Exception):
                ray.shutdown()  # the processes this attempt started
            if attempt + 1 == START_ATTEMPTS:
                raise RayUnavailable(
                    f"the local Ray cluster did not start ({START_ATTEMPTS} attempts): {e}"
                ) from e
    pids: list[int] = []
    node = getattr(ray._private.worker, "_global_node", None)
    for infos in getattr(node, "all_processes", {}).values():
        for info in infos:
            proc = getattr(info, "process", None)
            if proc is not None and getattr(proc, "pid", None):
                pids.append(int(proc.pid))
    return Cluster(num_cpus, None, temp, True, time.perf_counter() - t0, pids)


def _stop(cluster: Cluster) -> None:
    import ray

    if not cluster.started:
        if cluster.address is not None:
            ray.shutdown()  # only disconnects from a cluster someone else runs
        return
    ray.shutdown()
    deadline = time.monotonic() + 5
    alive = list(cluster.pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.1)
    for pid in alive:  # still there: ours, by PID
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive and time.monotonic() < deadline:  # gone once the kernel has them
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False
