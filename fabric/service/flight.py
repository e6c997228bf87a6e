"""The Arrow Flight server of ``fabric serve`` (pyarrow.flight).

Every call carries ``authorization: Bearer <token>`` (checked by a middleware before the
call runs: no token, or an unknown one, is ``FlightUnauthenticatedError``).

- ``DoGet(ticket)``: the ticket is JSON ``{"binding": NAME, "session": {...}}`` or
  ``{"text": "...", "session": {...}, "python": "..."}``; the result streams as record
  batches; its schema metadata holds ``fabric.freshness`` and ``fabric.stats`` (JSON).
- ``DoAction``: ``explain`` ``{binding, session, analyze}``, ``validate``, ``freshness``,
  ``bindings`` (what this agent may run, with session JSON schemas); the body is JSON.
- ``DoPut`` with descriptor path ``["dataset", NAME]``: upsert the batches into a dataset.
- Flight SQL (``GetFlightInfo`` with a ``CommandStatementQuery``, as ADBC's flightsql
  driver sends it): the statement is a compact text query, or a binding name followed by
  an optional JSON session (``nearby_offers {"user_id": 3}``).

Errors carry their kind (``fabric.service.errors``) in ``extra_info`` so the client raises
the same class with the server's message.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from fabric.service import wire
from fabric.service.core import QueryService, translate
from fabric.service.errors import BadRequest, ServiceError, Unauthenticated
from fabric.service.transport import grpc_defaults

_ERRORS = {
    "unauthenticated": fl.FlightUnauthenticatedError,
    "forbidden": fl.FlightUnauthorizedError,
    "not_found": fl.FlightServerError,
    "bad_request": fl.FlightServerError,
    "busy": fl.FlightUnavailableError,
    "failed": fl.FlightServerError,
}


def flight_error(e: ServiceError) -> fl.FlightError:
    return _ERRORS.get(e.kind, fl.FlightServerError)(str(e), extra_info=e.kind.encode())


_GILSTATE = ctypes.pythonapi if sys.implementation.name == "cpython" else None


class _AuthMiddleware(fl.ServerMiddleware):
    """The agent of the call's token; and the Python thread state of the call's gRPC
    thread, kept from ``start_call`` to ``call_completed``.

    pyarrow runs each Python callback of a call (the middleware's ``start_call``, the
    handler, ``sending_headers``, ``call_completed``) on a thread of gRPC's that Python
    does not know: ``PyGILState_Ensure`` makes a thread state for the callback and the
    matching release deletes it, so every callback built a thread state and mapped and
    unmapped its 16 KB frame stack. One more ``PyGILState_Ensure`` in ``start_call`` (the
    thread holds the GIL there, so it only counts) keeps that state for the call's other
    callbacks; ``call_completed``, on the same thread (pyarrow runs a call's middleware
    and handler on one thread), releases it, so nothing outlives the call (gRPC ends
    threads and starts new ones: a state kept past its call would be kept forever)."""

    def __init__(self, agent: Any):
        self.agent = agent
        self.thread = 0
        self.state = 0

    def keep_thread_state(self) -> None:
        if _GILSTATE is not None:
            self.state = _GILSTATE.PyGILState_Ensure()
            self.thread = threading.get_ident()

    def call_completed(self, exception: Any) -> None:
        if self.thread and self.thread == threading.get_ident():
            self.thread = 0
            _GILSTATE.PyGILState_Release(self.state)  # type: ignore[union-attr]


class _AuthFactory(fl.ServerMiddlewareFactory):
    def __init__(self, service: QueryService):
        self.service = service

    def start_call(self, info: Any, headers: dict[str, list[str]]) -> _AuthMiddleware:
        values: list[str | None] = [*(headers.get("authorization") or [])] or [None]
        try:
            middleware = _AuthMiddleware(self.service.agent(values[0]))
        except Unauthenticated as e:
            raise flight_error(e) from None
        # the last factory (nothing after it can fail the call's start), so call_completed
        # is sure to come
        middleware.keep_thread_state()
        return middleware


def result_table(result: Any) -> pa.Table:
    """The result's table with freshness and stats in its schema metadata."""
    meta = {
        **(result.table.schema.metadata or {}),
        b"fabric.freshness": wire.dumps(result.freshness),
        b"fabric.stats": wire.dumps(result.stats),
        b"fabric.binding": (result.binding or "").encode(),
    }
    if result.partial:
        meta[b"fabric.partial"] = b"1"
    return result.table.replace_schema_metadata(meta)


def _json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object")
    return obj


def _statement(sql: str) -> dict[str, Any]:
    """A Flight SQL statement: ``NAME [json-session]`` runs a binding, anything else is a
    compact text query."""
    head, _, rest = sql.strip().partition(" ")
    if head.isidentifier() and head.lower() != "from" and (not rest or rest.lstrip()[:1] == "{"):
        return {"binding": head, "session": json.loads(rest) if rest.strip() else {}}
    return {"text": sql}


def _proto_fields(data: bytes) -> dict[int, bytes]:
    """Length-delimited fields of a protobuf message (enough for Any and
    CommandStatementQuery, which hold only strings and bytes)."""
    out: dict[int, bytes] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wt = key >> 3, key & 7
        if wt == 2:
            n, i = _varint(data, i)
            out[field] = data[i : i + n]
            i += n
        elif wt == 0:
            _, i = _varint(data, i)
        else:
            raise BadRequest(f"unsupported protobuf wire type {wt} in a Flight SQL command")
    return out


def _proto(fields: dict[int, bytes]) -> bytes:
    """A protobuf message of length-delimited fields."""
    out = bytearray()
    for num, value in fields.items():
        out += _enc_varint(num << 3 | 2) + _enc_varint(len(value)) + value
    return bytes(out)


def _enc_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_SQL = "type.googleapis.com/arrow.flight.protocol.sql."


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


class FabricFlightServer(fl.FlightServerBase):
    def __init__(
        self,
        service: QueryService,
        location: str,
        middleware: dict[str, fl.ServerMiddlewareFactory] | None = None,
    ):
        """``middleware``: more factories, started before the token check's (a benchmark's
        timing of every call, ``benchmarks/service.py``)."""
        factories = {**(middleware or {}), "auth": _AuthFactory(service)}
        super().__init__(location, middleware=factories)
        self.service = service
        self._pending: dict[bytes, tuple[Any, pa.Table]] = {}  # Flight SQL results by ticket
        self._lock = threading.Lock()

    def _agent(self, context: Any) -> Any:
        return context.get_middleware("auth").agent

    def _run(self, agent: Any, req: dict[str, Any]) -> pa.Table:
        session = wire.decode_session(req.get("session"))
        sid = req.get("session_id")  # the agent's session in traces (docs/tracing.md)
        if sid is None:  # no session of its own: the thread's (None) as it is
            return result_table(self._query(agent, req, session))
        from fabric.tracing import session as traced_session

        with traced_session(str(sid)[:200]):
            return result_table(self._query(agent, req, session))

    def _query(self, agent: Any, req: dict[str, Any], session: dict[str, Any]) -> Any:
        if "binding" in req:
            return self.service.query(agent, str(req["binding"]), session)
        if "text" in req:
            return self.service.query_text(agent, str(req["text"]), session, req.get("python"))
        raise BadRequest('a ticket names a "binding" or carries a "text" query')

    def do_get(self, context: Any, ticket: fl.Ticket) -> fl.FlightDataStream:
        agent = self._agent(context)
        try:
            with self._lock:
                pending = self._pending.pop(ticket.ticket, None)
            if pending is not None:
                owner, table = pending
                if owner is not agent:
                    raise Unauthenticated("this ticket was issued to another agent")
            else:
                table = self._run(agent, _json(ticket.ticket))
        except Exception as e:
            raise flight_error(translate(e)) from None
        return fl.RecordBatchStream(table)

    def get_flight_info(self, context: Any, descriptor: fl.FlightDescriptor) -> fl.FlightInfo:
        agent = self._agent(context)
        try:
            if descriptor.descriptor_type != fl.DescriptorType.CMD:
                raise BadRequest("GetFlightInfo takes a command (Flight SQL statement or JSON)")
            cmd = descriptor.command
            if cmd[:1] == b"{":
                req = _json(cmd)
            else:
                any_msg = _proto_fields(cmd)
                type_url = any_msg.get(1, b"").decode()
                if not type_url.endswith(
                    ("CommandStatementQuery", "CommandPreparedStatementQuery")
                ):
                    raise BadRequest(
                        f"this Flight SQL server runs statements only (got {type_url}); "
                        "catalog calls are not served"
                    )
                # a statement's query and a prepared statement's handle (the query) are field 1
                req = _statement(_proto_fields(any_msg.get(2, b"")).get(1, b"").decode())
            table = self._run(agent, req)
        except Exception as e:
            raise flight_error(translate(e)) from None
        token = uuid.uuid4().hex.encode()
        with self._lock:
            if len(self._pending) > 1000:  # results nobody fetched
                self._pending.pop(next(iter(self._pending)))
            self._pending[token] = (agent, table)
        endpoint = fl.FlightEndpoint(token, [])
        return fl.FlightInfo(table.schema, descriptor, [endpoint], table.num_rows, table.nbytes)

    def do_action(self, context: Any, action: fl.Action) -> Any:
        agent = self._agent(context)
        try:
            raw = action.body.to_pybytes() if action.body is not None else b""
            kind = action.type
            if kind == "CreatePreparedStatement":  # Flight SQL: the handle is the statement
                query = _proto_fields(_proto_fields(raw).get(2, b"")).get(1, b"")
                result = _proto(
                    {
                        1: _SQL.encode() + b"ActionCreatePreparedStatementResult",
                        2: _proto({1: query}),
                    }
                )
                return [fl.Result(result)]
            if kind == "ClosePreparedStatement":
                return []
            body = _json(raw)
            if kind == "explain":
                out: Any = self.service.explain(
                    agent,
                    str(body.get("binding")),
                    wire.decode_session(body.get("session")) or None,
                    bool(body.get("analyze")),
                )
            elif kind == "validate":
                out = self.service.validate(agent)
            elif kind == "freshness":
                out = self.service.freshness(agent)
            elif kind == "bindings":
                out = self.service.bindings(agent)
            else:
                raise BadRequest(
                    f"unknown action {kind!r}; actions: explain, validate, freshness, bindings"
                )
        except Exception as e:
            raise flight_error(translate(e)) from None
        return [fl.Result(wire.dumps(out))]

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [
            ("explain", "the plan of a binding: {binding, session, analyze}"),
            ("validate", "every problem of the binding files"),
            ("freshness", "sources and bindings with state and lag"),
            ("bindings", "the bindings this agent may run, with session schemas"),
        ]

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        agent = self._agent(context)
        try:
            path = [p.decode() if isinstance(p, bytes) else p for p in (descriptor.path or [])]
            if len(path) != 2 or path[0] != "dataset":
                raise BadRequest('DoPut takes the descriptor path ["dataset", NAME]')
            table = reader.read_all()
            out = self.service.upsert(agent, path[1], table)
        except Exception as e:
            raise flight_error(translate(e)) from None
        writer.write(pa.py_buffer(wire.dumps(out)))


class FlightThread:
    """The Flight server in a thread of ``fabric serve``."""

    def __init__(self, service: QueryService, host: str = "127.0.0.1", port: int = 0):
        try:
            with grpc_defaults():
                self.server = FabricFlightServer(service, f"grpc://{host}:{port}")
        except Exception as exc:
            raise OSError(
                f"fabric serve: cannot listen for Arrow Flight on {host}:{port}: {exc}; "
                "pick another --flight-port"
            ) from exc
        self.host, self.port = host, self.server.port
        self.thread = threading.Thread(target=self.server.serve, name="fabric-flight", daemon=True)

    @property
    def url(self) -> str:
        return f"grpc://{self.host}:{self.port}"

    def start(self) -> FlightThread:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(5.0)
