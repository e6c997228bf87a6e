"""Tracing, session timelines and per-session data cost (docs/tracing.md).

- ``Tracer``: one OpenTelemetry span per query and per plan operator, kept in a bounded
  ring buffer and exported by OTLP/HTTP when ``tracing.otlp_endpoint`` is set.
- ``session("conv-42")``: queries inside carry that session id (``fab.query(...,
  session_id=...)`` names it per call; HTTP: the ``X-Fabric-Session`` header).
- ``Tracer.timeline(session_id)``: the session's queries in order, with plan, figures,
  waits and cost; ``fabric.tracing.timeline.render_html`` draws it.

Importing this package does not import OpenTelemetry; a ``Tracer`` does.
"""

from fabric.tracing.config import Prices, TracingConfig
from fabric.tracing.tracer import Tracer, current_session, session

__all__ = ["Prices", "Tracer", "TracingConfig", "current_session", "session"]
