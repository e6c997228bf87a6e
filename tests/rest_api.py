"""A real local HTTP JSON API for the REST connector's tests and benchmarks/rag.py.

``MerchantsAPI`` serves the 200 merchants of ``tests.connectors.data`` (or any rows given)
from a ``ThreadingHTTPServer`` on 127.0.0.1 with a free port. It documents these query
parameters (the connector's ``filters:`` in ``ENDPOINT``), with SQL semantics (a null
never compares true):

- ``id`` (repeatable: in), ``id_lt``, ``id_le``, ``id_gt``, ``id_ge``;
- ``status`` (repeatable: in), ``status_ne``; ``city`` (repeatable); ``name``;
- ``score_lt``/``score_le``/``score_gt``/``score_ge``; ``rating_*`` the same;
- ``created_after``/``created_before`` (ISO 8601);
- paging: ``page`` + ``per_page`` (``/v1/merchants``), ``offset`` + ``limit``
  (``/v1/offset``), ``cursor`` (``/v1/cursor``: body ``next``), ``Link`` headers
  (``/v1/link``).

It requires ``Authorization: Bearer <token>`` when ``token`` is set (a 401 echoes the
header it got, as careless APIs do), sends ``Last-Modified``, and plays faults queued in
``faults`` (``(status, retry_after)`` per coming request). Every request's arrival time
and query are recorded in ``log`` (the rate-limit test counts them).
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.connectors import data

ENDPOINT = {
    "path": "/v1/merchants",
    "records": "data",
    "total": "meta.total",
    "paging": {"kind": "page", "param": "page", "size_param": "per_page", "size": 50},
    "filters": {
        "id": {"=": "id", "in": "id", "<": "id_lt", "<=": "id_le", ">": "id_gt", ">=": "id_ge"},
        "status": {"=": "status", "in": "status", "!=": "status_ne"},
        "city": {"=": "city", "in": "city"},
        "name": {"=": "name"},
        "score": {"<": "score_lt", "<=": "score_le", ">": "score_gt", ">=": "score_ge"},
        "rating": {"<": "rating_lt", "<=": "rating_le", ">": "rating_gt", ">=": "rating_ge"},
        "created_at": {">": "created_after", "<": "created_before"},
    },
}

_CMP = {
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
}


def _json_row(r: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in r.items()}


class MerchantsAPI:
    def __init__(self, rows: list[dict[str, Any]] | None = None, token: str | None = None):
        self.rows = rows if rows is not None else data.rows()
        self.token = token
        self.faults: list[tuple[int, float | None]] = []
        self.log: list[tuple[float, str]] = []
        self.modified = time.time() - 60
        self.delay = 0.0  # seconds each response takes
        self.other_origin: str | None = None  # /v1/link's next page points here when set
        self._lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> MerchantsAPI:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def requests(self, path: str | None = None) -> list[tuple[float, str]]:
        with self._lock:
            return [e for e in self.log if path is None or urlsplit(e[1]).path == path]

    def touch(self) -> None:
        """The data changed now: Last-Modified advances."""
        self.modified = time.time()

    # ---------------------------------------------------------------- serving

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: Any, **headers: str) -> None:
        raw = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.send_header("Last-Modified", email.utils.formatdate(self.modified, usegmt=True))
        for k, v in headers.items():
            h.send_header(k.replace("_", "-"), v)
        h.end_headers()
        h.wfile.write(raw)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.log.append((time.monotonic(), h.path))
            fault = self.faults.pop(0) if self.faults else None
        if self.delay:
            time.sleep(self.delay)
        if self.token is not None:
            got = h.headers.get("Authorization", "")
            if got != f"Bearer {self.token}":
                self._send(h, 401, {"error": f"invalid credentials: {got!r}"})
                return
        if fault is not None:
            status, retry_after = fault
            extra = {} if retry_after is None else {"Retry_After": f"{retry_after:g}"}
            self._send(h, status, {"error": "try again"}, **extra)
            return
        u = urlsplit(h.path)
        q = parse_qs(u.query, keep_blank_values=True)
        if u.path not in ("/v1/merchants", "/v1/offset", "/v1/cursor", "/v1/link", "/v1/bare"):
            self._send(h, 404, {"error": f"no route {u.path}"})
            return
        try:
            rows = self._filter(q)
        except ValueError as e:
            self._send(h, 400, {"error": str(e)})
            return
        rows.sort(key=lambda r: r["id"])
        if u.path == "/v1/bare":
            self._send(h, 200, [_json_row(r) for r in rows])
        elif u.path == "/v1/merchants":
            size = int(q.get("per_page", ["20"])[0])
            page = int(q.get("page", ["1"])[0])
            chunk = rows[(page - 1) * size : page * size]
            self._send(
                h,
                200,
                {"data": [_json_row(r) for r in chunk], "meta": {"total": len(rows), "page": page}},
            )
        elif u.path == "/v1/offset":
            size = int(q.get("limit", ["20"])[0])
            off = int(q.get("offset", ["0"])[0])
            self._send(h, 200, {"data": [_json_row(r) for r in rows[off : off + size]]})
        elif u.path == "/v1/cursor":
            after = int(q.get("cursor", ["0"])[0] or 0)
            chunk = [r for r in rows if r["id"] > after][:30]
            nxt = str(chunk[-1]["id"]) if len(chunk) == 30 else None
            self._send(h, 200, {"items": [_json_row(r) for r in chunk], "next": nxt})
        else:  # link
            page = int(q.get("p", ["1"])[0])
            chunk = rows[(page - 1) * 40 : page * 40]
            headers = {}
            if page * 40 < len(rows):
                rest = "&".join(f"{k}={v}" for k, vs in q.items() if k != "p" for v in vs)
                base = self.other_origin or ""
                headers["Link"] = f'<{base}/v1/link?p={page + 1}&{rest}>; rel="next"'
            self._send(h, 200, {"data": [_json_row(r) for r in chunk]}, **headers)

    def _filter(self, q: dict[str, list[str]]) -> list[dict[str, Any]]:
        rows = list(self.rows)

        def keep(pred: Any) -> None:
            nonlocal rows
            rows = [r for r in rows if pred(r)]

        for name, values in q.items():
            col, _, op = name.rpartition("_") if "_" in name else (name, "", "")
            if name in ("page", "per_page", "offset", "limit", "cursor", "p"):
                continue
            if name in ("id", "status", "city", "name"):
                vals: list[Any] = [int(v) for v in values] if name == "id" else list(values)
                keep(lambda r, c=name, vs=vals: r[c] is not None and r[c] in vs)
            elif name == "status_ne":
                keep(lambda r, v=values[0]: r["status"] is not None and r["status"] != v)
            elif col in ("id", "score", "rating") and op in _CMP:
                v = float(values[0])
                keep(lambda r, c=col, f=_CMP[op], v=v: r[c] is not None and f(r[c], v))
            elif name in ("created_after", "created_before"):
                t = dt.datetime.fromisoformat(values[0])
                f = _CMP["gt" if name == "created_after" else "lt"]
                keep(lambda r, f=f, t=t: f(r["created_at"], t))
            else:
                raise ValueError(f"unknown parameter {name}")
        return rows


@contextmanager
def running(
    rows: list[dict[str, Any]] | None = None, token: str | None = None
) -> Iterator[MerchantsAPI]:
    api = MerchantsAPI(rows, token).start()
    try:
        yield api
    finally:
        api.stop()
