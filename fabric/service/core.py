"""``QueryService``: the one place a served request is authorized, queued and run.

Flight, HTTP and MCP call it with the agent their token named; it checks the agent's
rights before anything is compiled or read (a refused request runs nothing), applies the
agent's pinned session values, waits for a fair query slot, and runs the fabric exactly as
``fab.query`` / ``fab.query_text`` do (session values typed and checked against the
binding's declaration).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fabric.service.auth import AgentConfig, Authenticator, FairScheduler, FifoScheduler
from fabric.service.errors import BadRequest, Failed, Forbidden, NotFound, ServiceError
from fabric.service.metrics import ServiceMetrics


class QueryService:
    def __init__(self, fab: Any, *, workers: int | None = None, slot_timeout: float = 60.0):
        self.fab = fab
        self.auth = Authenticator(fab.config.agents)
        server = fab.config.server
        n = workers if workers is not None else getattr(server, "query_workers", 4)
        fifo = getattr(server, "queue", "fair") == "fifo"
        self.scheduler: FairScheduler | FifoScheduler = (FifoScheduler if fifo else FairScheduler)(
            n
        )
        self.metrics = ServiceMetrics(self.scheduler)
        self.slot_timeout = slot_timeout

    def agent(self, authorization: str | None) -> AgentConfig:
        try:
            return self.auth.agent(authorization)
        except ServiceError as e:
            self.metrics.error("-", e.kind)
            raise

    # ---- what an agent sees
    def bindings(self, agent: AgentConfig) -> list[dict[str, Any]]:
        """The bindings this agent may run: name, description, session types, JSON schema."""
        from fabric.service.schema import session_schema

        out = []
        for name in self.fab.bindings.names():
            if not agent.may_run(name):
                continue
            try:
                compiled = self.fab.binding(name)
            except Exception:  # a broken file: listed without a schema; its query says why
                out.append({"name": name, "description": "", "session": {}, "schema": None})
                continue
            spec = compiled.spec
            session = {k: str(t) for k, t in compiled.session.items()}
            out.append(
                {
                    "name": name,
                    "description": (getattr(spec, "description", None) or "").strip(),
                    "session": session,
                    "pinned": sorted(k for k in agent.pin if k in session),
                    "schema": session_schema(compiled.session, pinned=agent.pin),
                }
            )
        return out

    # ---- requests
    def query(self, agent: AgentConfig, binding: str, session: Mapping[str, Any] | None) -> Any:
        with self._counted(agent):
            agent.check_binding(binding)
            values = agent.session(session)
        return self._run(agent, binding, lambda: self.fab.query(binding, values))

    def query_text(
        self,
        agent: AgentConfig,
        text: str,
        session: Mapping[str, Any] | None,
        python: str | None = None,
    ) -> Any:
        if not agent.query_text:
            raise self._refused(
                agent,
                f"agent {agent.name!r} may not send text queries; set query_text: true for it "
                "in agents: of fabric.yaml, or run a binding",
            )
        if python is not None and not agent.python:
            raise self._refused(
                agent,
                f"agent {agent.name!r} may not send python snippets (nothing was run); set "
                "python: true for it in agents: of fabric.yaml",
            )
        with self._counted(agent):
            values = agent.session(session)
        return self._run(
            agent, "<text>", lambda: self.fab.query_text(text, values or None, python=python)
        )

    def explain(
        self,
        agent: AgentConfig,
        binding: str,
        session: Mapping[str, Any] | None,
        analyze: bool = False,
    ) -> str:
        with self._counted(agent):
            agent.check_binding(binding)
            values = agent.session(session) if (session or agent.pin) else None
        return self._run(
            agent,
            binding,
            lambda: self.fab.explain(binding, values, analyze=analyze),
            record=False,
        )

    def validate(self, agent: AgentConfig) -> list[dict[str, Any]]:
        out = []
        for d in self.fab.validate():
            span = d.span
            out.append(
                {
                    "message": d.message,
                    "hint": getattr(d, "hint", None),
                    "file": span.file if span else None,
                    "line": span.line if span else None,
                    "column": span.column if span else None,
                    "text": d.format(),
                }
            )
        return out

    def freshness(self, agent: AgentConfig) -> dict[str, Any]:
        snap = self.fab.freshness()
        bindings = {k: v for k, v in snap.get("bindings", {}).items() if agent.may_run(k)}
        return {**snap, "bindings": bindings}

    def upsert(self, agent: AgentConfig, dataset: str, table: Any) -> dict[str, Any]:
        if not agent.may_upsert(dataset):
            raise self._refused(
                agent,
                f"agent {agent.name!r} may not write dataset {dataset!r}; add it to "
                f"agents.{agent.name}.datasets in fabric.yaml",
            )
        try:
            ds = self.fab.dataset(dataset)
        except (KeyError, LookupError) as e:
            raise NotFound(str(e.args[0] if e.args else e)) from None
        n = ds.upsert(table)
        return {"dataset": dataset, "upserted": n if isinstance(n, int) else table.num_rows}

    # ---- running
    @contextmanager
    def _counted(self, agent: AgentConfig) -> Iterator[None]:
        """A refusal of the agent's rights (a binding not granted, a pinned value) is counted
        in ``fabric_query_errors_total`` like every other error."""
        try:
            yield
        except ServiceError as e:
            self.metrics.error(agent.name, e.kind)
            raise

    def _refused(self, agent: AgentConfig, message: str) -> Forbidden:
        self.metrics.error(agent.name, Forbidden.kind)
        return Forbidden(message)

    def _run(self, agent: AgentConfig, binding: str, fn: Any, record: bool = True) -> Any:
        self.scheduler.acquire(agent, self.slot_timeout)
        t0 = time.perf_counter()
        try:
            result = fn()
        except ServiceError as e:
            self.metrics.error(agent.name, e.kind)
            raise
        except Exception as e:
            err = translate(e)
            self.metrics.error(agent.name, err.kind, binding)
            raise err from e
        finally:
            self.scheduler.release(agent)
        if record:
            self.metrics.observe(agent.name, binding, result, time.perf_counter() - t0)
        return result


def translate(e: BaseException) -> ServiceError:
    """A fabric exception as the service error a client gets (with the same message)."""
    from connectors.base import SourceError
    from connectors.credentials import mask
    from dsl.errors import DslError
    from fabric.api import UnknownBindingError
    from fabric.execute.errors import QueryError

    if isinstance(e, ServiceError):
        return e
    if isinstance(e, UnknownBindingError):
        return NotFound(mask(str(e.args[0] if e.args else e)))
    if isinstance(e, DslError):
        return BadRequest(mask("\n".join(d.format() for d in e.diagnostics)))
    if isinstance(e, QueryError | SourceError):
        return Failed(mask(str(e)))
    if isinstance(e, TypeError | ValueError):
        return BadRequest(mask(str(e)))
    if isinstance(e, LookupError):
        return NotFound(mask(str(e.args[0] if e.args else e)))
    return Failed(mask(f"{type(e).__name__}: {e}"))
