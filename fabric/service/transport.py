"""gRPC settings of the Flight server and client, applied where pyarrow's gRPC starts.

pyarrow's Flight runs on a gRPC core of its own, which reads ``GRPC_EXPERIMENTS`` once,
when the process creates its first Flight client or server. Its default I/O engine (the
"event engine") hands every read and write to threads of its own and wakes the calling
thread afterwards; the older poller lets the thread waiting for the answer read the socket
itself. On loopback that is the larger part of a round trip: a Flight ``DoGet`` of a
10-row table took 0.57-0.66 ms with the defaults and 0.34-0.41 ms without the event engine
(``benchmarks/service.py``; docs/service.md, "Measured").

``grpc_defaults()`` sets the variable only while that first client or server is made, and
only if the process has not set it itself (any value, even empty, keeps gRPC's defaults),
so other gRPC libraries in the process (``grpcio``) and child processes never see it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

LOW_LATENCY = (
    "-event_engine_client,-event_engine_listener,-event_engine_callback_cq,"
    "-event_engine_for_all_other_endpoints"
)
_lock = threading.Lock()
_started = False


@contextmanager
def grpc_defaults() -> Iterator[None]:
    """Around the creation of a ``pyarrow.flight`` client or server: the first one in this
    process starts gRPC with ``LOW_LATENCY`` (unless ``GRPC_EXPERIMENTS`` is set)."""
    global _started
    with _lock:
        if _started or "GRPC_EXPERIMENTS" in os.environ:
            _started = True
            yield
            return
        os.environ["GRPC_EXPERIMENTS"] = LOW_LATENCY
        try:
            yield
        finally:
            _started = True
            os.environ.pop("GRPC_EXPERIMENTS", None)
