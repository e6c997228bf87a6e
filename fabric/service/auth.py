"""``agents:`` of fabric.yaml: who may query a served fabric, and what.

    agents:
      support-bot:
        token: ${SUPPORT_BOT_TOKEN}        # or token_file: secrets/support-bot.token
        bindings: [nearby_offers, "top_*"] # globs of the bindings it may run
        query_text: false                  # compact text queries (default false)
        python: false                      # python snippets sent with query_text (default false)
        datasets: []                       # globs of the datasets it may upsert into
        pin: {user_id: 42}                 # session values it may not choose itself
        max_concurrent: 2                  # its queries running at once (default 2)
        max_queued: 64                     # waiting beyond that are refused (default 64)

A request carries ``Authorization: Bearer <token>``; no token, or one no agent holds, is
refused. ``FairScheduler`` shares the server's query workers between agents round-robin, so
an agent flooding requests waits behind its own; ``FifoScheduler`` (``server.queue: fifo``)
serves every request in arrival order instead, with no per-agent limit.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric.service.errors import Busy, Forbidden, Unauthenticated

AGENT_KEYS = (
    "token",
    "token_file",
    "bindings",
    "query_text",
    "python",
    "datasets",
    "pin",
    "max_concurrent",
    "max_queued",
    "description",
)


@dataclass(frozen=True)
class AgentConfig:
    name: str
    token: str = field(repr=False)
    bindings: tuple[str, ...] = ()
    query_text: bool = False
    python: bool = False
    datasets: tuple[str, ...] = ()
    pin: Mapping[str, Any] = field(default_factory=dict)
    max_concurrent: int = 2
    max_queued: int = 64

    def may_run(self, binding: str) -> bool:
        return any(fnmatch.fnmatchcase(binding, g) for g in self.bindings)

    def may_upsert(self, dataset: str) -> bool:
        return any(fnmatch.fnmatchcase(dataset, g) for g in self.datasets)

    def check_binding(self, binding: str) -> None:
        if not self.may_run(binding):
            raise Forbidden(
                f"agent {self.name!r} may not run binding {binding!r} (it may run: "
                f"{', '.join(self.bindings) or 'none'}); add it to agents.{self.name}.bindings "
                "in fabric.yaml"
            )

    def session(self, session: Mapping[str, Any] | None) -> dict[str, Any]:
        """``session`` with this agent's pinned values; a different value for a pinned key
        is refused (never silently replaced)."""
        out = dict(session or {})
        for k, v in self.pin.items():
            if k in out and out[k] != v:
                raise Forbidden(
                    f"session value {k!r} is pinned for agent {self.name!r} and cannot be "
                    f"overridden (sent {out[k]!r}); leave it out, the server fills it in"
                )
            out[k] = v
        return out


def parse_agents(L: Any, doc: Any) -> dict[str, AgentConfig]:
    """The ``agents:`` section (``fabric.config`` calls this with its loader): every
    problem with the file, line and column of the YAML node."""
    y = L.y
    m = y.mapping(doc, "agents", "agents")
    out: dict[str, AgentConfig] = {}
    tokens: dict[str, str] = {}
    for key in m:
        name = str(key)
        a = y.mapping(m, key, f"agent {name}")
        y.check_keys(a, AGENT_KEYS, f"agent {name}")
        if ("token" in a) == ("token_file" in a):
            raise y.error(
                f"agent {name} needs exactly one of token: or token_file:",
                y.key_span(m, key),
                "token: ${ENV_VAR} (from the environment) or token_file: path/to/file",
            )
        if "token" in a:
            token = str(L.subst(a, "token")).strip()
            span = y.value_span(a, "token")
        else:
            span = y.value_span(a, "token_file")
            path = L.root / str(L.subst(a, "token_file"))
            try:
                token = Path(path).read_text().strip()
            except OSError as exc:
                raise y.error(
                    f"agent {name}: cannot read token_file {path}: {exc.strerror}", span
                ) from None
        if len(token) < 16:
            raise y.error(
                f"agent {name}: a token needs at least 16 characters (got {len(token)})",
                span,
                "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            )
        if token in tokens:
            raise y.error(f"agent {name} has the same token as agent {tokens[token]}", span)
        tokens[token] = name
        kw: dict[str, Any] = {}
        for k in ("bindings", "datasets"):
            if k in a:
                v = a[k]
                if isinstance(v, str):
                    v = [v]
                if not isinstance(v, list) or not all(isinstance(g, str) for g in v):
                    raise y.error(
                        f"agent {name}: {k} must be a list of names or globs", y.value_span(a, k)
                    )
                kw[k] = tuple(v)
        for k in ("query_text", "python"):
            if k in a:
                if not isinstance(a[k], bool):
                    raise y.error(f"agent {name}: {k} must be true or false", y.value_span(a, k))
                kw[k] = a[k]
        if kw.get("python") and not kw.get("query_text"):
            raise y.error(
                f"agent {name}: python: true needs query_text: true (snippets come with text "
                "queries)",
                y.value_span(a, "python"),
            )
        if "pin" in a:
            kw["pin"] = dict(L.subst(a, "pin")) if a["pin"] else {}
            y.mapping(a, "pin", f"agent {name} pin")
        for k, lo in (("max_concurrent", 1), ("max_queued", 0)):
            if k in a:
                kw[k] = y.integer(a, k, k, lo)
        out[name] = AgentConfig(name, token, **kw)
    return out


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """The agent of a request's token: one dict lookup by the token's SHA-256 (what an
    attacker can time is the digest's, never the token's bytes), then a constant-time
    compare with the token itself."""

    def __init__(self, agents: Mapping[str, AgentConfig]):
        self.agents = dict(agents)
        self.by_digest = {_digest(a.token): a for a in self.agents.values()}

    def agent(self, authorization: str | None) -> AgentConfig:
        """The agent whose token ``authorization`` (``Bearer <token>``) carries."""
        if not self.agents:
            raise Unauthenticated(
                "this fabric serves no agents: add an agents: section with tokens to "
                "fabric.yaml (docs/service.md)"
            )
        if not authorization:
            raise Unauthenticated(
                "no token: send 'authorization: Bearer <token>' (fabric.connect(url, "
                "token=...)); tokens are set in agents: of fabric.yaml"
            )
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the authorization header must read 'Bearer <token>'")
        token = token.strip()
        found = self.by_digest.get(_digest(token))
        if found is None or not hmac.compare_digest(found.token.encode(), token.encode()):
            raise Unauthenticated("unknown token: no agent in fabric.yaml holds it")
        return found


class FairScheduler:
    """``workers`` query slots shared by agents: each agent runs at most its
    ``max_concurrent`` at once and waits in its own queue; a freed slot goes to the next
    agent (round-robin) with a request waiting, so one agent's flood delays only itself."""

    def __init__(self, workers: int):
        self.workers = workers
        self.free = workers
        self.lock = threading.Lock()
        self.queues: dict[str, deque[threading.Event]] = {}
        self.running: dict[str, int] = {}
        self.limits: dict[str, int] = {}
        self.turn: deque[str] = deque()

    def acquire(self, agent: AgentConfig, timeout: float | None = None) -> None:
        with self.lock:
            q = self.queues.setdefault(agent.name, deque())
            running = self.running.get(agent.name, 0)
            if not q and self.free > 0 and running < agent.max_concurrent:
                # a free slot and nothing of this agent's waiting: whoever else waits is at
                # its own limit (every change dispatches), so the slot is this agent's
                self.limits[agent.name] = agent.max_concurrent
                self.running[agent.name] = running + 1
                self.free -= 1
                return
            ev = threading.Event()
            if len(q) >= max(agent.max_queued, 0) and (
                self.running.get(agent.name, 0) >= agent.max_concurrent or self.free == 0
            ):
                raise Busy(
                    f"agent {agent.name!r} has {len(q)} queries waiting (max_queued "
                    f"{agent.max_queued}); retry later"
                )
            self.limits[agent.name] = agent.max_concurrent
            q.append(ev)
            if agent.name not in self.turn:
                self.turn.append(agent.name)
            self._dispatch()
        if not ev.wait(timeout):
            with self.lock:
                if ev.is_set():
                    return
                q.remove(ev)
            raise Busy(f"agent {agent.name!r}: no query slot within {timeout:g} s")

    def release(self, agent: AgentConfig) -> None:
        with self.lock:
            self.running[agent.name] -= 1
            self.free += 1
            self._dispatch()

    def _dispatch(self) -> None:
        granted = True
        while self.free > 0 and granted:
            granted = False
            for _ in range(len(self.turn)):
                if self.free == 0:
                    return
                name = self.turn[0]
                self.turn.rotate(-1)
                q = self.queues.get(name)
                if q and self.running.get(name, 0) < self.limits.get(name, 1):
                    q.popleft().set()
                    self.running[name] = self.running.get(name, 0) + 1
                    self.free -= 1
                    granted = True

    def active(self) -> dict[str, tuple[int, int]]:
        """Per agent: (running, waiting)."""
        with self.lock:
            names = set(self.running) | set(self.queues)
            return {n: (self.running.get(n, 0), len(self.queues.get(n, ()))) for n in sorted(names)}


class FifoScheduler:
    """``server.queue: fifo``: ``workers`` query slots taken in arrival order by every
    agent, with no per-agent limit (``max_queued`` still refuses past an agent's backlog).
    One agent flooding delays every other: for a server of one agent, and the setting
    fair queuing is measured against (``test_a_flooding_agent_does_not_starve_another``)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.free = workers
        self.lock = threading.Lock()
        self.waiting: deque[tuple[str, threading.Event]] = deque()
        self.running: dict[str, int] = {}
        self.queued: dict[str, int] = {}

    def acquire(self, agent: AgentConfig, timeout: float | None = None) -> None:
        name = agent.name
        with self.lock:
            if self.free > 0 and not self.waiting:
                self.free -= 1
                self.running[name] = self.running.get(name, 0) + 1
                return
            n = self.queued.get(name, 0)
            if n >= max(agent.max_queued, 0):
                raise Busy(
                    f"agent {name!r} has {n} queries waiting (max_queued {agent.max_queued}); "
                    "retry later"
                )
            item = (name, threading.Event())
            self.waiting.append(item)
            self.queued[name] = n + 1
        if not item[1].wait(timeout):
            with self.lock:
                if item[1].is_set():
                    return
                self.waiting.remove(item)
                self.queued[name] -= 1
            raise Busy(f"agent {name!r}: no query slot within {timeout:g} s")

    def release(self, agent: AgentConfig) -> None:
        with self.lock:
            self.running[agent.name] -= 1
            self.free += 1
            if self.waiting:
                name, ev = self.waiting.popleft()
                self.queued[name] -= 1
                self.running[name] = self.running.get(name, 0) + 1
                self.free -= 1
                ev.set()

    def active(self) -> dict[str, tuple[int, int]]:
        """Per agent: (running, waiting)."""
        with self.lock:
            names = set(self.running) | set(self.queued)
            return {n: (self.running.get(n, 0), self.queued.get(n, 0)) for n in sorted(names)}
