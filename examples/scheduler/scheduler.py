"""A reference GPU scheduler that consumes the fabric's freshness signals.

Agents declare the bindings they read. The scheduler keeps, per binding, whether its data
is stale; an agent with a stale binding is *parked*: it gets no GPU, and a GPU it holds is
released to the next runnable agent. When every binding of a parked agent is fresh again
the agent is released back to the queue.

Signals come either pushed (UDP datagrams, one JSON object each: ``data_stale`` /
``data_fresh`` / ``heartbeat`` naming the ``bindings`` affected) or pulled
(``GET /v1/freshness``: ``bindings.<name>.state``). Run it next to ``fabric serve``:

    python examples/scheduler/scheduler.py --udp 127.0.0.1:9999 --gpus 4 \\
        --agent analyst=market_open_news --agent shopper=nearby_offers
    python examples/scheduler/scheduler.py --poll http://127.0.0.1:8765/v1/freshness ...
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Agent:
    name: str
    bindings: tuple[str, ...]
    gpu: int | None = None  # the GPU it holds, if any
    parked: bool = False


@dataclass
class Scheduler:
    """GPU assignment with parking on stale data. Thread-safe; ``log`` receives decisions."""

    gpus: int
    agents: dict[str, Agent] = field(default_factory=dict)
    stale_bindings: set[str] = field(default_factory=set)
    log: Callable[[str], None] = print
    _free: list[int] = field(default_factory=list)
    _queue: deque[str] = field(default_factory=deque)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    last_signal_at: float | None = None

    def __post_init__(self) -> None:
        self._free = list(range(self.gpus))

    # ------------------------------------------------------------------ agents

    def add_agent(self, name: str, bindings: Iterable[str]) -> None:
        with self._lock:
            a = Agent(name, tuple(bindings))
            self.agents[name] = a
            a.parked = self._blocked(a)
            if not a.parked:
                self._queue.append(name)
            self._assign()

    def finish(self, name: str) -> None:
        """The agent's job ended: its GPU goes back to the pool, it queues for the next job."""
        with self._lock:
            a = self.agents[name]
            self._release_gpu(a)
            if not a.parked:
                self._queue.append(name)
            self._assign()

    def holding(self) -> dict[str, int]:
        with self._lock:
            return {a.name: a.gpu for a in self.agents.values() if a.gpu is not None}

    def parked(self) -> list[str]:
        with self._lock:
            return sorted(a.name for a in self.agents.values() if a.parked)

    # ------------------------------------------------------------------ signals

    def on_signal(self, event: Mapping[str, Any]) -> None:
        """One pushed signal (a dict decoded from the datagram / POST body)."""
        kind = event.get("event")
        bindings = set(event.get("bindings") or ())
        with self._lock:
            self.last_signal_at = time.time()
            if kind == "data_stale":
                self._set_stale(bindings, True, event)
            elif kind == "data_fresh":
                self._set_stale(bindings, False, event)
            elif kind == "heartbeat" and event.get("state") in ("fresh", "stale"):
                self._set_stale(bindings, event["state"] == "stale", event)

    def on_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        """A ``GET /v1/freshness`` body (the pull side)."""
        with self._lock:
            for name, b in snapshot.get("bindings", {}).items():
                self._set_stale(
                    {name},
                    b.get("state") == "stale",
                    {"source": ",".join(b.get("stale_sources", []))},
                )

    def _set_stale(self, bindings: set[str], stale: bool, event: Mapping[str, Any]) -> None:
        changed = bindings - self.stale_bindings if stale else bindings & self.stale_bindings
        if not changed:
            return
        if stale:
            self.stale_bindings |= changed
        else:
            self.stale_bindings -= changed
        for a in self.agents.values():
            if not set(a.bindings) & changed:
                continue
            blocked = self._blocked(a)
            if blocked and not a.parked:
                a.parked = True
                self._release_gpu(a)
                if a.name in self._queue:
                    self._queue.remove(a.name)
                self.log(f"park    {a.name}: {sorted(set(a.bindings) & self.stale_bindings)} stale "
                         f"(source {event.get('source')}, lag {event.get('lag_messages')} messages)")  # fmt: skip
            elif not blocked and a.parked:
                a.parked = False
                self._queue.append(a.name)
                self.log(f"release {a.name}: its bindings are fresh")
        self._assign()

    # ------------------------------------------------------------------ internals

    def _blocked(self, a: Agent) -> bool:
        return any(b in self.stale_bindings for b in a.bindings)

    def _release_gpu(self, a: Agent) -> None:
        if a.gpu is not None:
            self._free.append(a.gpu)
            a.gpu = None

    def _assign(self) -> None:
        while self._free and self._queue:
            a = self.agents[self._queue.popleft()]
            if a.parked or a.gpu is not None:
                continue
            a.gpu = self._free.pop()


def listen_udp(sched: Scheduler, host: str, port: int, stop: threading.Event) -> threading.Thread:
    """Receive pushed signals on UDP (one JSON object per datagram)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, port))
    sock.settimeout(0.5)

    def run() -> None:
        with sock:
            while not stop.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                try:
                    sched.on_signal(json.loads(data))
                except ValueError:
                    sched.log(f"ignored a datagram that is not JSON: {data[:80]!r}")

    t = threading.Thread(target=run, name="scheduler-udp", daemon=True)
    t.start()
    return t


def poll_http(
    sched: Scheduler, url: str, interval: float, stop: threading.Event
) -> threading.Thread:
    """Pull ``/v1/freshness`` every ``interval`` seconds."""

    def run() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    sched.on_snapshot(json.loads(r.read()))
            except (OSError, ValueError) as exc:
                sched.log(f"poll {url}: {exc}")
            stop.wait(interval)

    t = threading.Thread(target=run, name="scheduler-poll", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Reference GPU scheduler driven by fabric freshness signals"
    )
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--agent", action="append", default=[], metavar="NAME=BINDING[,BINDING]",
                   help="an agent and the bindings it reads (repeatable)")  # fmt: skip
    p.add_argument("--udp", metavar="HOST:PORT", help="listen for pushed signals here")
    p.add_argument("--poll", metavar="URL", help="poll this /v1/freshness URL instead")
    p.add_argument("--interval", type=float, default=1.0)
    a = p.parse_args(argv)
    if not a.udp and not a.poll:
        p.error("give --udp HOST:PORT (pushed signals) or --poll URL (pulled /v1/freshness)")
    sched = Scheduler(a.gpus, log=lambda s: print(time.strftime("%H:%M:%S"), s, flush=True))
    for spec in a.agent:
        name, _, bindings = spec.partition("=")
        if not name or not bindings:
            p.error(f"--agent {spec!r}: expected NAME=BINDING[,BINDING]")
        sched.add_agent(name, bindings.split(","))
    stop = threading.Event()
    if a.udp:
        host, _, port = a.udp.rpartition(":")
        listen_udp(sched, host or "127.0.0.1", int(port), stop)
    else:
        poll_http(sched, a.poll, a.interval, stop)
    try:
        while True:
            time.sleep(5)
            print(
                time.strftime("%H:%M:%S"),
                "holding",
                sched.holding(),
                "parked",
                sched.parked(),
                flush=True,
            )
    except KeyboardInterrupt:
        stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
