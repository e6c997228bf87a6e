"""``fabric serve``'s tracing routes and the session header.

- ``GET /v1/sessions/{id}/timeline``: the session's queries in order (JSON);
  ``?format=html`` (or ``Accept: text/html``): the page with the timeline chart. Needs
  ``Authorization: Bearer <token>`` like the query routes; an agent sees the queries of
  the bindings it may run.
- ``X-Fabric-Session: <id>`` on a query request names its session (``SessionHeader``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from fabric.tracing.tracer import _SESSION

SESSION_HEADER = b"x-fabric-session"


class SessionHeader:
    """ASGI middleware: the request's ``X-Fabric-Session`` becomes the session id of the
    queries it runs (``fabric.tracing.session``; ``asyncio.to_thread`` carries it over)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sid = next((v for k, v in scope.get("headers", ()) if k == SESSION_HEADER), None)
        if sid is None:
            await self.app(scope, receive, send)
            return
        token = _SESSION.set(sid.decode("latin-1")[:200])
        try:
            await self.app(scope, receive, send)
        finally:
            _SESSION.reset(token)


def routes(fab: Any, service: Any) -> list[Route]:
    from fabric.service.core import translate
    from fabric.service.errors import ServiceError
    from fabric.tracing.timeline import render_html

    async def session_timeline(request: Request) -> Response:
        try:
            agent = service.agent(request.headers.get("authorization"))
            sid = request.path_params["session_id"]
            tl = await asyncio.to_thread(fab.tracer.timeline, sid, may_see=agent.may_run)
        except Exception as e:
            err = translate(e) if not isinstance(e, ServiceError) else e
            body = json.dumps({"error": str(err), "kind": err.kind})
            return Response(body, status_code=err.http_status, media_type="application/json")
        wants_html = request.query_params.get("format") == "html" or (
            "text/html" in request.headers.get("accept", "")
            and request.query_params.get("format") != "json"
        )
        if wants_html:
            return HTMLResponse(render_html(tl))
        return Response(json.dumps(tl, default=str), media_type="application/json")

    return [Route("/v1/sessions/{session_id}/timeline", session_timeline, methods=["GET"])]
