"""``fabric serve``: ingest every Kafka-fed dataset and serve freshness to schedulers.

Endpoints (docs/freshness.md has the JSON shapes and the KEDA paths):

- ``GET /v1/freshness``: every source and binding (state, lags, since, rate, last error);
  ``?source=NAME`` or ``?binding=NAME`` narrows it to one entry.
- ``GET /metrics``: Prometheus exposition (lag gauges, stale flags, ingest and dead-letter
  counters, dropped signals).
- ``GET /v1/events``: server-sent events, one per transition (``?heartbeats=1`` adds the
  heartbeats); the stream starts with one ``state`` event per source.
- ``GET /healthz``; ``GET /readyz`` (503 until every Kafka-fed dataset is ingesting).

The HTTP layer needs only a ``FreshnessTracker`` (``create_app``), so it runs without Kafka.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from connectors.credentials import mask
from fabric.freshness import FreshnessTracker
from fabric.signals import HEARTBEAT, SignalEmitter, iso, make_event

log = logging.getLogger("fabric.server")


class FreshnessCollector:
    """Prometheus collector reading the tracker at scrape time (no second bookkeeping)."""

    def __init__(self, tracker: FreshnessTracker, emitter: SignalEmitter | None = None):
        self.tracker = tracker
        self.emitter = emitter

    def collect(self):
        snap = self.tracker.snapshot()
        src = snap["sources"]
        families = {
            "lag_messages": GaugeMetricFamily(
                "fabric_source_lag_messages",
                "Messages in the log not yet applied",
                labels=["source"],
            ),
            "lag_seconds": GaugeMetricFamily(
                "fabric_source_lag_seconds", "Seconds behind the newest event", labels=["source"]
            ),
            "stale": GaugeMetricFamily(
                "fabric_source_stale", "1 if the source is stale", labels=["source"]
            ),
            "ingest_rate": GaugeMetricFamily(
                "fabric_source_ingest_rate",
                "Messages applied per second (window)",
                labels=["source"],
            ),
        }
        ingested = CounterMetricFamily(
            "fabric_source_ingested_messages", "Messages applied", labels=["source"]
        )
        dead = CounterMetricFamily(
            "fabric_source_dead_letters", "Messages dead-lettered", labels=["source"]
        )
        errored = GaugeMetricFamily(
            "fabric_source_error", "1 if the source reports an error", labels=["source"]
        )
        for name, s in src.items():
            for key, fam in families.items():
                v = s[key]
                if v is not None:  # a lag not measured (or not a log) exports no series
                    fam.add_metric([name], float(v))
            if s.get("kind") == "kafka":  # only a log is ingested message by message
                ingested.add_metric([name], s["ingested_total"])
                dead.add_metric([name], s["dead_letter_total"])
            errored.add_metric([name], 1.0 if s["last_error"] else 0.0)
        bstale = GaugeMetricFamily(
            "fabric_binding_stale", "1 if the binding reads a stale source", labels=["binding"]
        )
        for name, b in snap["bindings"].items():
            bstale.add_metric([name], b["stale"])
        yield from families.values()
        yield from (ingested, dead, errored, bstale)
        if self.emitter is not None:
            dropped = CounterMetricFamily(
                "fabric_signals_dropped", "Pushed signals dropped (queue full)"
            )
            dropped.add_metric([], self.emitter.dropped)
            yield dropped


class MaskedJSONResponse(JSONResponse):
    """JSON whose text has every credential masked (``connectors.credentials``): a signals
    target or an error kept in the tracker may carry one."""

    def render(self, content: Any) -> bytes:
        return mask(super().render(content).decode()).encode()


def create_app(
    tracker: FreshnessTracker,
    *,
    emitter: SignalEmitter | None = None,
    health: Callable[[], dict[str, Any]] | None = None,
    ready: Callable[[], dict[str, Any]] | None = None,
    routes: Sequence[Route] = (),
    collectors: Sequence[Any] = (),
    lifespan: Callable[[Any], Any] | None = None,
) -> Starlette:
    """``routes``, ``collectors`` and ``lifespan``: the query service's (fabric.service; the
    lifespan runs the mounted MCP app's session manager), when served."""
    registry = CollectorRegistry()
    registry.register(FreshnessCollector(tracker, emitter))
    for c in collectors:
        registry.register(c)

    async def freshness(request: Request) -> Response:
        snap = tracker.snapshot()
        for kind, section in (("source", "sources"), ("binding", "bindings")):
            if name := request.query_params.get(kind):
                if name not in snap[section]:
                    return MaskedJSONResponse(
                        {"error": f"unknown {kind} {name!r}", section: sorted(snap[section])},
                        status_code=404,
                    )
                return MaskedJSONResponse(snap[section][name])
        return MaskedJSONResponse(snap)

    async def metrics(request: Request) -> Response:
        text = mask(generate_latest(registry).decode())
        return Response(text.encode(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        body: dict[str, Any] = {"status": "ok"}
        if health is not None:
            body.update(health())
        return MaskedJSONResponse(body)

    async def readyz(request: Request) -> Response:
        """Readiness (a Kubernetes readinessProbe): 503 until every Kafka-fed dataset reads
        an existing topic, measures its lag without error and has caught up once."""
        body = {"ready": True} if ready is None else await asyncio.to_thread(ready)
        return MaskedJSONResponse(body, status_code=200 if body["ready"] else 503)

    async def events(request: Request) -> Response:
        heartbeats = request.query_params.get("heartbeats") in ("1", "true", "yes")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)

        def put(ev: dict[str, Any]) -> None:
            if queue.full():  # a slow client loses its oldest events, never blocks the fabric
                queue.get_nowait()
            queue.put_nowait(ev)

        def on_event(ev: dict[str, Any]) -> None:
            if ev["event"] == HEARTBEAT and not heartbeats:
                return
            loop.call_soon_threadsafe(put, ev)

        unsubscribe = tracker.listen(on_event)

        async def stream() -> AsyncIterator[bytes]:
            try:
                snap = tracker.snapshot()
                for name, s in snap["sources"].items():
                    ev = make_event(
                        "state",
                        name,
                        s["bindings"],
                        s["lag_messages"],
                        s["lag_seconds"],
                        state=s["state"],
                    )
                    yield _sse(ev)
                while True:
                    try:
                        ev = await asyncio.wait_for(queue.get(), timeout=1.0)
                    except TimeoutError:
                        if await request.is_disconnected():
                            return
                        yield b": keepalive\n\n"
                        continue
                    yield _sse(ev)
            finally:
                unsubscribe()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    return Starlette(
        routes=[
            Route("/v1/freshness", freshness),
            Route("/metrics", metrics),
            Route("/v1/events", events),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            *routes,
        ],
        lifespan=lifespan,
    )


def _sse(ev: dict[str, Any]) -> bytes:
    data = mask(json.dumps(ev, separators=(",", ":")))
    return f"event: {ev['event']}\ndata: {data}\n\n".encode()


_BUSY_TEXT = b"fabric serve: too many connections, retry shortly\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT)
)


def connection_cap(max_connections: int) -> int:
    """``max_connections``, kept below the process's open-file limit (a quarter of it, at
    least 64 descriptors, stays for Kafka clients, files and the rest)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - max(64, soft // 4)))


def guarded_protocol(header_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a header-read timeout and a connection cap (uvicorn has
    neither: a request line sent without its end held a connection forever).

    A connection that has no request in progress (nothing sent yet, headers incomplete, or
    idle between keep-alive requests) for a whole ``header_timeout`` period is closed.
    Past ``max_connections`` the connection that has waited longest that way is closed to
    make room, so a request that arrives whole is served; if every connection is busy
    with a request, the new one gets a 503."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _guard: asyncio.TimerHandle | None = None
        _since = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._since = self.loop.time()
            if len(self.connections) > max_connections and not self._make_room():
                transport.write(_BUSY)
                transport.close()
                return
            self._arm(None)

        def waiting(self) -> bool:
            """No request in progress: its headers have not (all) arrived."""
            return self.conn.their_state is h11.IDLE and (
                self.cycle is None or self.cycle.response_complete
            )

        def _make_room(self) -> bool:
            idle = [
                c
                for c in self.connections
                if c is not self
                and isinstance(c, GuardedH11Protocol)
                and not c.transport.is_closing()
                and c.waiting()
            ]
            if not idle:
                return False
            min(idle, key=lambda c: c._since).transport.close()
            return True

        def _arm(self, cycle: Any) -> None:
            self._guard = self.loop.call_later(header_timeout, self._check, cycle)

        def _check(self, cycle: Any) -> None:
            self._guard = None
            if self.transport.is_closing():
                return
            if self.cycle is cycle and self.waiting():
                self.transport.close()  # no complete request for a whole period
                return
            self._since = self.loop.time()
            self._arm(self.cycle)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._guard is not None:
                self._guard.cancel()
                self._guard = None
            super().connection_lost(exc)

    return GuardedH11Protocol


class ServerThread:
    """Run an ASGI app with uvicorn in a daemon thread (tests, ``fabric.open`` users).
    ``limits`` (a ``fabric.config.ServerConfig``): header timeout, keep-alive, connection
    cap and header size; its defaults when None."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, limits: Any = None):
        from fabric.config import ServerConfig

        limits = limits if limits is not None else ServerConfig()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"fabric serve: cannot listen on {host}:{port}: {exc}; pick another --port"
            ) from exc
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="auto",  # the mounted MCP app's session manager (fabric.service.mcp)
            timeout_graceful_shutdown=1,
            access_log=False,
            http=guarded_protocol(limits.header_timeout, connection_cap(limits.max_connections)),
            timeout_keep_alive=max(1, round(limits.keep_alive)),
            h11_max_incomplete_event_size=limits.max_header_bytes,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="fabric-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                return self
            deadline.wait(0.02)
        raise RuntimeError(f"fabric HTTP server on {self.url} did not start within {timeout}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5.0)
        self.sock.close()


# --------------------------------------------------------------------------- CLI


def _limits(server_config: Any, args: argparse.Namespace) -> Any:
    """fabric.yaml's ``server:`` with the command line's overrides."""
    import dataclasses

    from fabric.config import ServerConfig

    limits = server_config if server_config is not None else ServerConfig()
    given = {
        k: v
        for k, v in (
            ("header_timeout", args.header_timeout),
            ("max_connections", args.max_connections),
        )
        if v is not None
    }
    return dataclasses.replace(limits, **given)


def main(argv: Sequence[str] | None = None) -> int:
    """``fabric serve [--config fabric.yaml] [--host H] [--port P]``."""
    p = argparse.ArgumentParser(
        prog="fabric serve", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    p.add_argument(
        "--config", default="fabric.yaml", help="path to fabric.yaml (default: ./fabric.yaml)"
    )
    p.add_argument(
        "--host", help="address to listen on (default: server.host in fabric.yaml, else 127.0.0.1)"
    )
    p.add_argument(
        "--port",
        type=int,
        help="port to listen on (default: server.port in fabric.yaml, else 8765)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        help="seconds a connection may wait for a complete request (default: "
        "server.header_timeout, else 10)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open connections at most (default: server.max_connections, else 1000)",
    )
    p.add_argument(
        "--flight-port",
        type=int,
        help="Arrow Flight port for queries when fabric.yaml has agents: (default: "
        "server.flight_port, else 8815; 0 picks a free port)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    for flag, v in (
        ("--header-timeout", args.header_timeout),
        ("--max-connections", args.max_connections),
    ):
        if v is not None and v <= 0:
            p.error(f"{flag} must be more than 0")
    from connectors.credentials import MaskingFormatter

    logging.basicConfig(level=args.log_level.upper())
    for handler in logging.getLogger().handlers:  # the log never shows a credential
        handler.setFormatter(MaskingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    from fabric.datasets import FabricService

    path = Path(args.config)
    if not path.exists():
        print(
            f"fabric serve: config file {path} not found; pass --config PATH or run in the directory holding fabric.yaml",
            file=sys.stderr,
        )
        return 2
    fab: Any = None
    try:
        from fabric.config import load_config

        config = load_config(path)
        if config.agents:  # queries are served: the whole fabric (compiler, watcher, catalog)
            import fabric

            fab = fabric.open(config)
            service = fab.service
        else:
            service = FabricService.from_config(config)
    except Exception as exc:  # config errors are already formatted with file:line:col
        print(f"fabric serve: {mask(exc)}", file=sys.stderr)
        return 2
    if fab is None:
        service.start()
    routes: list[Route] = []
    collectors: list[Any] = []
    flight: Any = None
    lifespan: Any = None
    try:
        host = args.host or getattr(service.server_config, "host", None) or "127.0.0.1"
        if fab is not None:
            from fabric.semantic_cache import CacheCollector
            from fabric.service import http as service_http
            from fabric.service import mcp as service_mcp
            from fabric.service.core import QueryService
            from fabric.service.flight import FlightThread

            qs = QueryService(fab)
            # the semantic caches' hits, misses, invalidations, evictions, entries and bytes
            collectors = [qs.metrics, CacheCollector(fab.cache_metrics_all)]
            routes = service_http.routes(qs)
            if fab.tracer is not None:  # GET /v1/sessions/{id}/timeline, per-session cost
                from fabric.tracing import http as tracing_http

                routes += tracing_http.routes(fab, qs)
                collectors.append(fab.tracer.collector())
            try:
                mcp_route, lifespan = service_mcp.mount(qs, host)
                routes.append(mcp_route)
            except ImportError as exc:  # the mcp SDK is in the [serve] extra
                log.warning("fabric serve: no MCP at /mcp (%s); install the [serve] extra", exc)
            fport = args.flight_port
            if fport is None:
                fport = getattr(service.server_config, "flight_port", 8815)
            flight = FlightThread(qs, host, fport).start()
        app = create_app(
            service.tracker,
            emitter=service.emitter,
            health=service.health,
            ready=service.readiness,
            routes=routes,
            collectors=collectors,
            lifespan=lifespan,
        )
        if fab is not None and fab.tracer is not None:
            from fabric.tracing.http import SessionHeader

            app.add_middleware(SessionHeader)  # X-Fabric-Session names a query's session
        port = args.port if args.port is not None else getattr(service.server_config, "port", 8765)
        srv = ServerThread(app, host, port, limits=_limits(service.server_config, args))
    except OSError as exc:
        if flight is not None:
            flight.stop()
        if fab is not None:
            fab.close()
        else:
            service.stop()
        print(str(exc), file=sys.stderr)
        return 2
    if flight is not None:
        print(f"fabric serve: queries on {flight.url} (Arrow Flight)", flush=True)
        if lifespan is not None:
            print(f"fabric serve: MCP tools on {srv.url}/mcp (streamable HTTP)", flush=True)
    log.info(
        "fabric serve: %s (freshness %s/v1/freshness, metrics %s/metrics)",
        srv.url,
        srv.url,
        srv.url,
    )
    print(f"fabric serve: listening on {srv.url} at {iso(time.time())}", flush=True)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("fabric serve: signal %d, shutting down (final checkpoint)", signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        srv.start()
        while not stop.wait(0.5):
            if not srv.thread.is_alive():
                print("fabric serve: the HTTP server stopped unexpectedly", file=sys.stderr)
                return 1
    finally:
        srv.stop()
        if flight is not None:
            flight.stop()
        if fab is not None:
            fab.close()
        else:
            service.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
