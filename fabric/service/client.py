"""``fabric.connect(url, token=...)``: a served fabric with the surface of ``fabric.open``.

    fab = fabric.connect("grpc://fabric.internal:8815", token=os.environ["FABRIC_TOKEN"])
    res = fab.query("nearby_offers", session={"user_id": 42})   # a fabric.result.Result
    res.table, res.freshness, res.stats

Queries travel over Arrow Flight; the server checks the token, the agent's rights and the
session values (typed against the binding's declaration, as embedded). A refused or failed
request raises the class the server named (``fabric.service.errors``) with its message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from fabric.result import Result
from fabric.service import wire
from fabric.service.errors import KINDS, Failed, ServiceError
from fabric.service.transport import grpc_defaults


def _raise(e: fl.FlightError) -> ServiceError:
    kind = (getattr(e, "extra_info", None) or b"").decode(errors="replace")
    cls = KINDS.get(kind)
    if cls is None:
        cls = Failed
        if isinstance(e, fl.FlightUnauthenticatedError):
            cls = KINDS["unauthenticated"]
    msg = str(e)
    for cut in (". Detail:", ". gRPC client debug context:"):
        if cut in msg:
            msg = msg.split(cut, 1)[0]
    return cls(msg)


class _Diagnostic(dict):
    """A validate() problem as the server reported it (``.format()`` for the text)."""

    def format(self) -> str:
        return str(self.get("text") or self.get("message"))

    @property
    def message(self) -> str:
        return str(self.get("message"))


class RemoteDataset:
    def __init__(self, fab: RemoteFabric, name: str):
        self.fab, self.name = fab, name

    def upsert(self, table: pa.Table) -> int:
        desc = fl.FlightDescriptor.for_path("dataset", self.name)
        try:
            writer, reader = self.fab._client.do_put(desc, table.schema, options=self.fab._opts)
            writer.write_table(table)
            writer.done_writing()
            buf = reader.read()
            writer.close()
        except fl.FlightError as e:
            raise _raise(e) from None
        return int(json.loads(buf.to_pybytes())["upserted"]) if buf is not None else 0


class RemoteFabric:
    """What ``fabric.connect`` returns: query / query_text / explain / validate /
    freshness / bindings / dataset(name).upsert(table) / close."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float | None = None):
        if not url.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
            raise ValueError(
                f"fabric.connect takes a grpc://host:port URL (the Flight port of fabric "
                f"serve), got {url!r}"
            )
        self.url = url
        with grpc_defaults():
            self._client = fl.FlightClient(url)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._opts = fl.FlightCallOptions(headers=headers, timeout=timeout)

    def _get(self, req: dict[str, Any]) -> Result:
        ticket = fl.Ticket(json.dumps(req, separators=(",", ":")).encode())
        try:
            table = self._client.do_get(ticket, options=self._opts).read_all()
        except fl.FlightError as e:
            raise _raise(e) from None
        meta = dict(table.schema.metadata or {})
        freshness = wire.loads(meta.pop(b"fabric.freshness", b"{}"))
        stats = wire.loads(meta.pop(b"fabric.stats", b"{}"))
        binding = meta.pop(b"fabric.binding", b"").decode() or None
        partial = meta.pop(b"fabric.partial", None) == b"1"
        table = table.replace_schema_metadata(meta or None)
        return Result(table, freshness, stats, binding=binding, partial=partial)

    def _action(self, kind: str, body: Mapping[str, Any] | None = None) -> Any:
        action = fl.Action(kind, json.dumps(body or {}).encode())
        try:
            results = list(self._client.do_action(action, options=self._opts))
        except fl.FlightError as e:
            raise _raise(e) from None
        return wire.loads(results[0].body.to_pybytes()) if results else None

    # ---- the fabric.open surface
    def query(
        self,
        name: str,
        session: Mapping[str, Any] | None = None,
        *,
        session_id: str | None = None,
    ) -> Result:
        req: dict[str, Any] = {"binding": name, "session": wire.encode_session(session)}
        if session_id is not None:  # names the agent's session in traces (docs/tracing.md)
            req["session_id"] = session_id
        return self._get(req)

    def query_text(
        self,
        text: str,
        session: Mapping[str, Any] | None = None,
        *,
        python: str | None = None,
        session_id: str | None = None,
    ) -> Result:
        req: dict[str, Any] = {"text": text, "session": wire.encode_session(session)}
        if python is not None:
            req["python"] = python
        if session_id is not None:
            req["session_id"] = session_id
        return self._get(req)

    def explain(
        self, name: str, session: Mapping[str, Any] | None = None, *, analyze: bool = False
    ) -> str:
        body = {"binding": name, "session": wire.encode_session(session), "analyze": analyze}
        return str(self._action("explain", body))

    def validate(self) -> list[_Diagnostic]:
        return [_Diagnostic(d) for d in self._action("validate")]

    def freshness(self) -> dict[str, Any]:
        return dict(self._action("freshness"))

    def bindings(self) -> list[dict[str, Any]]:
        """The bindings this agent may run: name, description, session types and schema."""
        return list(self._action("bindings"))

    def dataset(self, name: str) -> RemoteDataset:
        return RemoteDataset(self, name)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteFabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteFabric({self.url})"


def connect(url: str, token: str | None = None, *, timeout: float | None = None) -> RemoteFabric:
    """A served fabric (``fabric serve`` with ``agents:``) at ``grpc://host:port``."""
    return RemoteFabric(url, token, timeout=timeout)
