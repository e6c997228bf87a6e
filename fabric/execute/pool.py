"""The process-wide thread pool the source units of multi-source plans run on."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

POOL_THREADS = int(os.environ.get("FABRIC_SCAN_THREADS", "16"))
"""Threads of the process-wide pool that runs the source units of multi-source plans.
Scans are I/O-bound (they wait on servers), so more threads than cores pay off; a query
never blocks a pool thread waiting for another unit (dependent units are submitted when
their keys are ready), so a busy pool queues work but cannot deadlock."""

_pool: cf.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def scan_pool() -> cf.ThreadPoolExecutor:
    """The process-wide pool for source units (created on first use, recreated after fork)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = cf.ThreadPoolExecutor(
                    max_workers=max(1, POOL_THREADS), thread_name_prefix="fabric-scan"
                )
    return _pool


def _forget_pool() -> None:  # a forked child has the pool object but not its threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
