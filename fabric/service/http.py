"""The HTTP query routes of ``fabric serve`` (next to /v1/freshness and /metrics).

- ``POST /v1/query/{binding}``  body ``{"session": {...}}``
- ``POST /v1/query_text``       body ``{"text": "...", "session": {...}, "python": "..."}``
- ``POST /v1/explain/{binding}`` body ``{"session": {...}, "analyze": false}`` -> ``{"plan"}``
- ``GET /v1/bindings``: what this agent may run, with session JSON schemas.

Every route needs ``Authorization: Bearer <token>`` (401 without, 403 for a binding or a
flag the agent is not granted). A query answers ``{"binding", "columns", "rows",
"freshness", "stats", "partial"}``; rows are JSON with bytes, decimals and timestamps
tagged (``fabric.service.wire``). ``Accept: application/vnd.apache.arrow.stream`` answers
an Arrow IPC stream instead, freshness and stats in its schema metadata.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pyarrow as pa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fabric.service import wire
from fabric.service.core import QueryService, translate
from fabric.service.errors import BadRequest, ServiceError
from fabric.service.flight import result_table

ARROW_STREAM = "application/vnd.apache.arrow.stream"


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(wire.dumps(obj), status_code=status, media_type="application/json")


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return [wire.encode_value(r) for r in table.to_pylist()]


def _result_body(res: Any) -> bytes:
    body = {
        "binding": res.binding,
        "columns": res.table.column_names,
        "rows": _rows(res.table),
        "freshness": res.freshness,
        "stats": res.stats,
        "partial": res.partial,
    }
    meta = wire.dumps({k: v for k, v in body.items() if k != "rows"})
    rows = json.dumps(body["rows"], separators=(",", ":"), default=str).encode()
    return meta[:-1] + b',"rows":' + rows + b"}"


def routes(service: QueryService) -> list[Route]:
    async def call(request: Request, fn: Any) -> Response:
        try:
            agent = service.agent(request.headers.get("authorization"))
            raw = await request.body()
            try:
                body = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRequest(f"the request body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            return await asyncio.to_thread(fn, agent, body, request)
        except Exception as e:
            err = translate(e) if not isinstance(e, ServiceError) else e
            return _json_response({"error": str(err), "kind": err.kind}, err.http_status)

    def answer(res: Any, request: Request) -> Response:
        if ARROW_STREAM in request.headers.get("accept", ""):
            table = result_table(res)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            return Response(sink.getvalue().to_pybytes(), media_type=ARROW_STREAM)
        return Response(_result_body(res), media_type="application/json")

    def run_query(agent: Any, body: dict[str, Any], request: Request) -> Response:
        name = request.path_params["binding"]
        res = service.query(agent, name, wire.decode_session(body.get("session")))
        return answer(res, request)

    def run_text(agent: Any, body: dict[str, Any], request: Request) -> Response:
        if not isinstance(body.get("text"), str):
            raise BadRequest('the body needs "text": a compact text query')
        res = service.query_text(
            agent, body["text"], wire.decode_session(body.get("session")), body.get("python")
        )
        return answer(res, request)

    def run_explain(agent: Any, body: dict[str, Any], request: Request) -> Response:
        name = request.path_params["binding"]
        plan = service.explain(
            agent, name, wire.decode_session(body.get("session")) or None, bool(body.get("analyze"))
        )
        return _json_response({"binding": name, "plan": plan})

    def list_bindings(agent: Any, body: dict[str, Any], request: Request) -> Response:
        return _json_response({"bindings": service.bindings(agent)})

    async def query(request: Request) -> Response:
        return await call(request, run_query)

    async def query_text(request: Request) -> Response:
        return await call(request, run_text)

    async def explain(request: Request) -> Response:
        return await call(request, run_explain)

    async def bindings(request: Request) -> Response:
        return await call(request, list_bindings)

    return [
        Route("/v1/query/{binding}", query, methods=["POST"]),
        Route("/v1/query_text", query_text, methods=["POST"]),
        Route("/v1/explain/{binding}", explain, methods=["POST"]),
        Route("/v1/bindings", bindings, methods=["GET"]),
    ]
