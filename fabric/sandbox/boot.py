"""Entry point of a sandbox worker, run by path: ``python -s .../fabric/sandbox/boot.py ...``.

It runs before anything else is imported, while the process still has a single thread:
namespaces a thread is not moved into later must be entered here.  ``unshare`` moves only
the calling thread into a new network namespace, and threads inherit it when they are
created; pyarrow (its CPU pool, jemalloc's background thread) and numpy start threads as
soon as they are imported, so unsharing after those imports left them in the host's
network namespace (issue 13, finding 1).  Run by path, not with ``-m``: ``-m`` would import
the ``fabric.sandbox`` package, and with it pyarrow, first.
"""

import ctypes
import os
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000


def new_network_namespace() -> str:
    """Enter an empty network namespace; the layer's state ("active" or why not)."""
    if "network_namespace" in _skipped():
        return "unavailable: disabled by the pool"
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # nothing above may start a thread; if it did, say so
        return f"unavailable: {len(threads)} threads exist before unshare"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return "active"
    first = ctypes.get_errno()
    # without CAP_SYS_ADMIN: a user namespace (if the kernel allows them) owns the new one
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "active"
    return f"unavailable: OSError: unshare(CLONE_NEWNET): {os.strerror(first)}"


def _skipped() -> set[str]:
    argv = sys.argv
    if "--skip-layers" in argv:
        i = argv.index("--skip-layers")
        if i + 1 < len(argv):
            return set(argv[i + 1].split(","))
    return set()


if __name__ == "__main__":
    # the script's own directory (fabric/sandbox) must not shadow top-level modules
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    state = new_network_namespace()
    from fabric.sandbox.worker import main

    main(network_namespace=state)
