"""HTTP JSON APIs as sources (``rest://<connection>/<endpoint>``).

A ``kind: rest`` connection is one API (``base_url``); its objects are the ``endpoints``
it declares, each a path returning JSON records, read with the declared schema of
``connections.<name>.schemas.<endpoint>`` (or the endpoint's ``schema:``)::

    crm:
      kind: rest
      base_url: "http://127.0.0.1:8080/v1"
      headers: {Authorization: "Bearer ${CRM_TOKEN}"}
      rate_limit: {per_second: 5, burst: 5}
      retries: {max: 4, base: 0.2, max_delay: 5}
      timeout: 10
      endpoints:
        merchants:
          path: /merchants
          records: data                      # where the list is in the body (default: the body)
          total: meta.total                  # optional: the row count, for statistics
          paging: {kind: page, param: page, size_param: per_page, size: 50}
          filters:                           # what the API documents as query parameters
            city: {"=": city, in: city}
            score: {">=": min_score, "<=": max_score}
      schemas:
        merchants: {id: int, name: str, city: str, score: int, created_at: timestamp}

Pushdown: a filter is EXACT when every comparison in it is one the endpoint documents
(``column op value``, either side, the value a literal or a session value; ``in`` sends
one query parameter per item; ``between`` needs ``>=`` and ``<=``; ``and`` of such); all
else is UNSUPPORTED and applied by the fabric above the scan. A comparison with null or an
empty ``in`` list matches nothing, so no request is sent. Values are sent as text: ints as
digits, floats by ``repr``, booleans ``true``/``false``, timestamps ISO 8601 in UTC.

Paging (``paging.kind``): ``page`` (``param`` from ``start``, default 1), ``offset``
(``param`` advanced by the rows received), ``cursor`` (``param`` set to the body's
``next`` path until it is absent or empty), ``link`` (the ``Link: <url>; rel="next"``
header, or the body's ``next`` path holding a URL; only URLs of the same origin as
``base_url`` are followed, so credentials never go elsewhere); ``none`` (default). A
page shorter than ``size`` ends ``page``/``offset`` paging. A pushed limit stops paging.

Requests go through the connection's token bucket (``rate_limit``) and are retried on
429/502/503/504 and connection failures (``retries``, honouring ``Retry-After``); see
``connectors/ratelimit.py``. Header values (and ``auth``) are credentials: remembered by
``connectors/credentials.py`` and masked in every error. ``watermark()`` is the newest
``Last-Modified`` the API sent (or ``watermark:``, a body path holding a timestamp): that
of a response of the last 0.25 s (the query's own scan), else asked now with one request
for a page of one row.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import email.utils
import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urljoin, urlsplit

import pyarrow as pa

from connectors._util import flat_options, schema_from_spec, typed_params
from connectors.arrow_expr import filter_table
from connectors.base import (
    Capability,
    Connection,
    Pushdown,
    ScanMetrics,
    ScanRequest,
    Source,
    SourceError,
    Statistics,
    UnknownObjectError,
    Watermark,
    check_columns,
)
from connectors.credentials import mask, remember
from connectors.json_decode import _MISSING, get_path, rows_to_batch
from connectors.ratelimit import (
    RateLimitConfigError,
    RetryPolicy,
    TokenBucket,
)
from dsl.ast import Between, Binary, Column, Expr, InList, Literal, Param
from dsl.errors import FabricError

_OPS = ("=", "!=", "<", "<=", ">", ">=", "in")
_FLIP = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_TRANSIENT = frozenset({429, 502, 503, 504})
_PAGING = ("none", "page", "offset", "cursor", "link")
_ENDPOINT_KEYS = (
    "path",
    "records",
    "total",
    "paging",
    "filters",
    "params",
    "schema",
    "watermark",
    "on_error",
    "max_pages",
)
_SECRET_HEADER = ("auth", "key", "token", "secret", "cookie", "session", "signature")
_PROBE_TTL = 30.0  # seconds a probe's total / Last-Modified is reused by the planner
#: a response this recent (seconds) answers watermark() without another request
WATERMARK_REUSE = 0.25


class RestConfigError(FabricError, ValueError):
    """A ``kind: rest`` connection option that is not valid; names the connection and key."""


@dataclass(frozen=True)
class Paging:
    kind: str = "none"
    param: str | None = None
    size_param: str | None = None
    size: int | None = None
    start: int = 1
    next: str | None = None  # body path of the next cursor / URL


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    records: str | None = None
    total: str | None = None
    paging: Paging = Paging()
    #: column -> op -> query parameter name
    filters: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    schema: Any = None
    watermark: str | None = None
    on_error: str = "fail"
    max_pages: int = 10_000


def _endpoint(conn: str, name: str, spec: Any) -> Endpoint:
    what = f"connection '{conn}': endpoints.{name}"
    if isinstance(spec, str):
        spec = {"path": spec}
    if not isinstance(spec, Mapping):
        raise RestConfigError(f"{what} must be a path or a mapping with 'path', got {spec!r}")
    unknown = sorted(set(spec) - set(_ENDPOINT_KEYS))
    if unknown:
        raise RestConfigError(
            f"{what} has unknown key(s) {', '.join(unknown)}; keys: {', '.join(_ENDPOINT_KEYS)}"
        )
    path = spec.get("path", f"/{name}")
    pg = spec.get("paging") or {}
    if not isinstance(pg, Mapping):
        raise RestConfigError(f"{what}.paging must be a mapping, got {pg!r}")
    kind = str(pg.get("kind", "none"))
    if kind not in _PAGING:
        raise RestConfigError(f"{what}.paging.kind is {kind!r}; kinds: {', '.join(_PAGING)}")
    if kind in ("page", "offset", "cursor") and not pg.get("param"):
        raise RestConfigError(f"{what}.paging ({kind}) needs 'param' (the query parameter)")
    if kind == "cursor" and not pg.get("next"):
        raise RestConfigError(f"{what}.paging (cursor) needs 'next' (body path of the cursor)")
    size = pg.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise RestConfigError(f"{what}.paging.size must be a positive integer, got {size!r}")
    paging = Paging(
        kind,
        pg.get("param"),
        pg.get("size_param"),
        size,
        int(pg.get("start", 1 if kind == "page" else 0)),
        pg.get("next"),
    )
    filters: dict[str, dict[str, str]] = {}
    fm = spec.get("filters") or {}
    if not isinstance(fm, Mapping):
        raise RestConfigError(f"{what}.filters must map columns to {{op: query parameter}}")
    for col, ops in fm.items():
        if isinstance(ops, str):  # shorthand: `city: city` is equality
            ops = {"=": ops}
        if not isinstance(ops, Mapping):
            raise RestConfigError(f"{what}.filters.{col} must map operators to parameter names")
        bad = sorted(str(o) for o in ops if o not in _OPS)
        if bad:
            raise RestConfigError(
                f"{what}.filters.{col}: unknown operator(s) {', '.join(bad)}; "
                f"operators: {', '.join(_OPS)}"
            )
        filters[str(col)] = {str(o): str(p) for o, p in ops.items()}
    on_error = str(spec.get("on_error", "fail"))
    if on_error not in ("fail", "skip", "null"):
        raise RestConfigError(f"{what}.on_error is {on_error!r}; one of fail, skip, null")
    return Endpoint(
        name,
        str(path),
        spec.get("records"),
        spec.get("total"),
        paging,
        filters,
        {str(k): _text(v) for k, v in (spec.get("params") or {}).items()},
        spec.get("schema"),
        spec.get("watermark"),
        on_error,
        int(spec.get("max_pages", 10_000)),
    )


def _text(v: Any) -> str:
    """A value as query-parameter text."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dt.datetime):
        v = v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)
        return v.isoformat()
    if isinstance(v, dt.date):
        return v.isoformat()
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` (seconds, or an HTTP date) as seconds from now."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _next_link(header: str | None) -> str | None:
    """The ``rel="next"`` URL of a ``Link`` header."""
    if not header:
        return None
    for part in header.split(","):
        url, _, rest = part.partition(";")
        url = url.strip()
        if url.startswith("<") and url.endswith(">") and 'rel="next"' in rest.replace(" ", ""):
            return url[1:-1]
    return None


class _Term:
    """One pushable comparison: column, operator, the value's Param or Literal."""

    __slots__ = ("column", "op", "value")

    def __init__(self, column: str, op: str, value: Expr | tuple[Expr, ...]):
        self.column, self.op, self.value = column, op, value


def _terms(e: Expr) -> list[_Term] | None:
    """The comparisons ``e`` is a conjunction of, or None when it has another shape."""
    if isinstance(e, Binary) and e.op == "and":
        a, b = _terms(e.left), _terms(e.right)
        return None if a is None or b is None else a + b
    if isinstance(e, Binary) and e.op in _FLIP:
        if isinstance(e.left, Column) and isinstance(e.right, Param | Literal):
            return [_Term(e.left.name, e.op, e.right)]
        if isinstance(e.right, Column) and isinstance(e.left, Param | Literal):
            return [_Term(e.right.name, _FLIP[e.op], e.left)]
        return None
    if isinstance(e, InList) and not e.negated and isinstance(e.expr, Column):
        items = e.items
        if isinstance(items, Param):
            return [_Term(e.expr.name, "in", items)]
        if all(isinstance(i, Param | Literal) for i in items):
            return [_Term(e.expr.name, "in", tuple(items))]
        return None
    if (
        isinstance(e, Between)
        and not e.negated
        and isinstance(e.expr, Column)
        and isinstance(e.low, Param | Literal)
        and isinstance(e.high, Param | Literal)
    ):
        return [_Term(e.expr.name, ">=", e.low), _Term(e.expr.name, "<=", e.high)]
    return None


def _value(v: Expr, params: Mapping[str, Any]) -> Any:
    if isinstance(v, Param):
        return params.get(v.name)
    assert isinstance(v, Literal)
    return v.value


class RestSource(Source):
    capabilities = frozenset({Capability.PROJECTION, Capability.LIMIT})

    def __init__(self, conn: RestConnection, endpoint: Endpoint, schema: pa.Schema):
        super().__init__(f"rest://{conn.name}/{endpoint.name}")
        self.conn = conn
        self.endpoint = endpoint
        self._schema = schema
        self._lock = threading.Lock()
        self._total: int | None = None
        self._modified: float | None = None
        self._probed_at: float | None = None
        self._seen_at: float | None = None  # time.monotonic() of the last response

    def schema(self) -> pa.Schema:
        return self._schema

    # -------------------------------------------------------------- planning view

    def supports_filter(self, expr: Expr) -> Pushdown:
        terms = _terms(expr)
        if not terms:
            return Pushdown.UNSUPPORTED
        for t in terms:
            ops = self.endpoint.filters.get(t.column, {})
            if t.column not in self._schema.names or t.op not in ops:
                return Pushdown.UNSUPPORTED
            if isinstance(t.value, Literal) and t.value.type not in (
                "int",
                "float",
                "str",
                "bool",
                "timestamp",
                "date",
                "null",
            ):
                return Pushdown.UNSUPPORTED
        return Pushdown.EXACT

    def statistics(self) -> Statistics:
        if self.endpoint.total is None:
            return Statistics()
        self._probe()
        return Statistics(row_count=self._total, exact=False)

    def watermark(self) -> Watermark | None:
        """The newest Last-Modified (or ``watermark:`` value) the API sent: the one of a
        response received in the last ``WATERMARK_REUSE`` seconds (the scan this query just
        made), else asked now with one small request (a page of one row), so a change is
        seen at once. Nothing is pending at an API (it serves its current state):
        ``lag_messages`` is 0, so an old Last-Modified is not lag."""
        seen = self._seen_at
        if seen is None or time.monotonic() - seen > WATERMARK_REUSE:
            self._probe(force=True)
        if self._modified is None:
            return None
        return Watermark(
            event_time=self._modified, lag_messages=0, detail={"kind": "last modified"}
        )

    def _probe(self, force: bool = False) -> None:
        """One small request for the row count and Last-Modified (reused for a few seconds
        by the planner's statistics)."""
        now = time.monotonic()
        if not force and self._probed_at is not None and now - self._probed_at < _PROBE_TTL:
            return
        query = dict(self.endpoint.params)
        pg = self.endpoint.paging
        if pg.size_param:
            query[pg.size_param] = "1"
        with contextlib.suppress(SourceError):  # the planner goes on without the facts
            self._get(self.conn.url(self.endpoint.path, list(query.items())), ScanMetrics(), None)
        self._probed_at = now

    # -------------------------------------------------------------- scan

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        schema = self._schema
        check_columns(self.uri, request.columns, schema.names)
        params = typed_params(request.filters, request.params, schema, self.uri)
        query: list[tuple[str, str]] = list(self.endpoint.params.items())
        used: set[str] = set()
        local: list[Expr] = []
        for f in request.filters:
            terms = _terms(f) if self.supports_filter(f) is Pushdown.EXACT else None
            if terms is None:
                local.append(f)  # never offered (or not pushable): applied here, still exact
                continue
            pairs: list[tuple[str, str]] = []
            for t in terms:
                name = self.endpoint.filters[t.column][t.op]
                if t.op == "in":
                    values = (
                        params.get(t.value.name) or []
                        if isinstance(t.value, Param)
                        else [_value(v, params) for v in t.value]  # type: ignore[union-attr]
                    )
                    values = [v for v in values if v is not None]
                    if not values:
                        return  # x in () matches nothing
                    pairs.extend((name, _text(v)) for v in values)
                else:
                    v = _value(t.value, params)  # type: ignore[arg-type]
                    if v is None:
                        return  # a comparison with null is never true
                    pairs.append((name, _text(v)))
            names = {n for n, _ in pairs}
            if names & used:
                local.append(f)  # the parameter already carries another filter's value
                continue
            used |= names
            query.extend(pairs)
        want = list(request.columns) if request.columns is not None else schema.names
        extra = {c.name for f in local for c in f.columns()} - set(want)
        read = [n for n in schema.names if n in set(want) | extra]
        read_schema = pa.schema([schema.field(n) for n in read])
        limit = request.limit
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        metrics = request.metrics  # this scan's own (pages, retries, waits, records)
        metrics.records, metrics.bad_records = 0, 0
        got = 0
        # the API's records count towards the limit only when nothing is filtered here
        for docs in self._pages(query, metrics, deadline, None if local else limit):
            metrics.records += len(docs)
            batch, errors = rows_to_batch(
                docs, read_schema, on_error=self.endpoint.on_error, first_row=got
            )
            if errors:
                metrics.bad(len(errors), ({"record": r, "reason": why} for r, why in errors))
            if errors and self.endpoint.on_error == "fail":
                row, msg = errors[0]
                raise SourceError(
                    self.uri,
                    f"record {row} does not fit the declared schema: {msg}",
                    hint=f"fix the declared schema of {self.endpoint.name}, or set "
                    "on_error: null (bad cells become null) or skip (the record is dropped)",
                )
            t = pa.Table.from_batches([batch], schema=read_schema)
            for f in local:
                t = filter_table(t, f, params)
            if limit is not None:
                t = t.slice(0, limit - got)
            got += t.num_rows
            t = t.select(want)
            yield from t.to_batches(max_chunksize=request.batch_size)
            if limit is not None and got >= limit:
                return

    def _pages(
        self,
        query: list[tuple[str, str]],
        metrics: ScanMetrics,
        deadline: float | None,
        limit: int | None,
    ) -> Iterator[list[Mapping[str, Any]]]:
        ep, pg = self.endpoint, self.endpoint.paging
        base = list(query)
        if pg.size_param and pg.size:
            base.append((pg.size_param, str(pg.size)))
        pos = pg.start
        url: str | None = self.conn.url(ep.path, base + self._position(pg, pos, None))
        seen = 0
        for _ in range(ep.max_pages):
            assert url is not None
            body, headers = self._get(url, metrics, deadline)
            docs = self._records(body)
            yield docs
            seen += len(docs)
            if limit is not None and seen >= limit:
                return
            if pg.kind == "none":
                return
            if pg.kind in ("page", "offset"):
                if not docs or (pg.size is not None and len(docs) < pg.size):
                    return
                pos = pos + 1 if pg.kind == "page" else pos + len(docs)
                url = self.conn.url(ep.path, base + self._position(pg, pos, None))
            elif pg.kind == "cursor":
                cur = get_path(body, pg.next) if isinstance(body, Mapping) and pg.next else None
                if cur is _MISSING or cur in (None, ""):
                    return
                url = self.conn.url(ep.path, base + self._position(pg, pos, cur))
            else:  # link
                nxt = _next_link(headers.get("link"))
                if nxt is None and pg.next and isinstance(body, Mapping):
                    v = get_path(body, pg.next)
                    nxt = None if v is _MISSING or not v else str(v)
                if not nxt:
                    return
                url = self.conn.same_origin(urljoin(url, nxt), self.uri)
        raise SourceError(
            self.uri,
            f"more than {ep.max_pages} pages",
            hint=f"raise endpoints.{ep.name}.max_pages, or filter more",
        )

    @staticmethod
    def _position(pg: Paging, pos: int, cursor: Any) -> list[tuple[str, str]]:
        if pg.kind in ("page", "offset") and pg.param:
            return [(pg.param, str(pos))]
        if pg.kind == "cursor" and pg.param and cursor is not None:
            return [(pg.param, _text(cursor))]
        return []

    def _records(self, body: Any) -> list[Mapping[str, Any]]:
        path = self.endpoint.records
        docs = body if path is None else get_path(body, path) if isinstance(body, Mapping) else None
        if docs is _MISSING or not isinstance(docs, list):
            shape = type(body).__name__
            keys = ", ".join(list(body)[:10]) if isinstance(body, Mapping) else ""
            raise SourceError(
                self.uri,
                f"the response has no list of records at {path or '(the body)'} "
                f"(got a {shape}{': ' + keys if keys else ''})",
                hint=f"set endpoints.{self.endpoint.name}.records to the path of the list",
            )
        bad = next((i for i, d in enumerate(docs) if not isinstance(d, Mapping)), None)
        if bad is not None:
            raise SourceError(
                self.uri,
                f"record {bad} is a {type(docs[bad]).__name__}, not a JSON object",
            )
        return docs

    def _get(
        self, url: str, metrics: ScanMetrics, deadline: float | None
    ) -> tuple[Any, Mapping[str, str]]:
        status, headers, data = self.conn.request(url, metrics, deadline, self.uri)
        lm = headers.get("last-modified")
        modified = None
        if lm:
            try:
                modified = email.utils.parsedate_to_datetime(lm).timestamp()
            except (TypeError, ValueError):
                modified = None
        try:
            body = json.loads(data)
        except ValueError as e:
            ctype = headers.get("content-type", "?")
            raise SourceError(
                self.uri,
                f"the response ({status}, {ctype}) is not JSON: {e}; it starts "
                f"{data[:120].decode('utf-8', 'replace')!r}",
            ) from None
        if self.endpoint.watermark and isinstance(body, Mapping):
            v = get_path(body, self.endpoint.watermark)
            if v is not _MISSING and v is not None:
                modified = _epoch(v) or modified
        total = None
        if self.endpoint.total and isinstance(body, Mapping):
            v = get_path(body, self.endpoint.total)
            total = v if isinstance(v, int) and not isinstance(v, bool) else None
        with self._lock:
            self._seen_at = time.monotonic()
            if modified is not None and (self._modified is None or modified > self._modified):
                self._modified = modified
            if total is not None:
                self._total = total
        return body, headers


def _epoch(v: Any) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v) / (1000 if v > 1e11 else 1)
    if isinstance(v, str):
        try:
            d = dt.datetime.fromisoformat(v)
        except ValueError:
            return None
        return (d.replace(tzinfo=dt.UTC) if d.tzinfo is None else d).timestamp()
    return None


class RestConnection(Connection):
    """``{kind: rest, base_url, headers, auth, timeout, rate_limit, retries, endpoints}``."""

    kind = "rest"  # options and capabilities: connectors/registry.py

    def __init__(self, name: str, options: Mapping[str, Any]):
        super().__init__(name, options)
        opts = flat_options(options, {"query_timeout": "timeout"})
        base = opts.get("base_url")
        if not base or not isinstance(base, str):
            raise RestConfigError(f"connection '{name}' (rest) needs base_url: http(s)://host/...")
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RestConfigError(
                f"connection '{name}': base_url must be an http:// or https:// URL, got {mask(base)!r}"
            )
        self.base_url = base.rstrip("/")
        self._origin = (parts.scheme, parts.hostname, parts.port)
        self.timeout = float(opts.get("timeout", 30.0))
        self.connect_timeout = float(opts.get("connect_timeout", self.timeout))
        headers = {str(k): str(v) for k, v in (opts.get("headers") or {}).items()}
        auth = opts.get("auth")
        if auth is not None:
            headers.update(self._auth_headers(auth))
        headers.setdefault("Accept", "application/json")
        headers.setdefault("User-Agent", "agent-data-fabric")
        self.headers = headers
        secret = [v for k, v in headers.items() if any(s in k.lower() for s in _SECRET_HEADER)]
        for v in list(secret):  # "Bearer abc...": the token alone too
            scheme, _, token = v.partition(" ")
            if token and scheme.lower() in ("bearer", "basic", "token", "apikey"):
                secret.append(token)
        remember({f"header_{i}_password": v for i, v in enumerate(secret)})
        try:
            self.bucket = TokenBucket.from_options(
                opts.get("rate_limit"), f"connection '{name}': rate_limit"
            )
            self.retry = RetryPolicy.from_options(
                opts.get("retries"), f"connection '{name}': retries"
            )
        except RateLimitConfigError as e:
            raise RestConfigError(str(e)) from None
        eps = opts.get("endpoints") or {}
        if not isinstance(eps, Mapping):
            raise RestConfigError(f"connection '{name}': endpoints must map names to paths")
        self.endpoints = {str(k): _endpoint(name, str(k), v) for k, v in eps.items()}
        self._local = threading.local()

    @staticmethod
    def _auth_headers(auth: Any) -> dict[str, str]:
        if isinstance(auth, Mapping):
            if "bearer" in auth:
                return {"Authorization": f"Bearer {auth['bearer']}"}
            if "basic" in auth and isinstance(auth["basic"], Mapping):
                b = auth["basic"]
                raw = f"{b.get('user', '')}:{b.get('password', '')}".encode()
                return {"Authorization": "Basic " + base64.b64encode(raw).decode()}
            if "header" in auth and "value" in auth:
                return {str(auth["header"]): str(auth["value"])}
        raise RestConfigError(
            "auth must be {bearer: TOKEN}, {basic: {user, password}} or {header: NAME, value: V}"
        )

    def url(self, path: str, query: list[tuple[str, str]]) -> str:
        u = path if "://" in path else self.base_url + "/" + path.lstrip("/")
        if query:
            u += ("&" if "?" in u else "?") + urlencode(query)
        return u

    def same_origin(self, url: str, uri: str) -> str:
        p = urlsplit(url)
        if (p.scheme, p.hostname, p.port) != self._origin:
            raise SourceError(
                uri,
                f"the API's next-page link {mask(url)!r} leaves {mask(self.base_url)!r}; "
                "not followed (the connection's credentials would go to another host)",
            )
        return url

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> Source:
        ep = self.endpoints.get(obj)
        uri = f"rest://{self.name}/{obj}"
        if ep is None:
            raise UnknownObjectError(uri, sorted(self.endpoints))
        declared = (options or {}).get("schema") or ep.schema
        if declared is None:
            raise SourceError(
                uri,
                "no declared schema: a JSON API's columns and types are declared",
                hint=f"declare connections.{self.name}.schemas.{obj}: {{column: type, ...}}",
            )
        return RestSource(self, ep, schema_from_spec(declared))

    def list_objects(self) -> list[str]:
        return sorted(self.endpoints)

    def ping(self) -> None:
        self.request(self.base_url + "/", ScanMetrics(), None, f"rest://{self.name}", ok=True)

    # -------------------------------------------------------------- HTTP

    def _client(self, scheme: str, host: str, port: int | None) -> http.client.HTTPConnection:
        """One keep-alive HTTP connection per thread and origin."""
        key = (scheme, host, port)
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = {}
        c = pool.get(key)
        if c is None:
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            c = pool[key] = cls(host, port, timeout=self.connect_timeout)
        return c  # type: ignore[no-any-return]

    def _drop(self, scheme: str, host: str, port: int | None) -> None:
        pool = getattr(self._local, "pool", {}) or {}
        c = pool.pop((scheme, host, port), None)
        if c is not None:
            c.close()

    def request(
        self,
        url: str,
        metrics: ScanMetrics,
        deadline: float | None,
        uri: str,
        *,
        ok: bool = False,
    ) -> tuple[int, Mapping[str, str], bytes]:
        """GET ``url`` within the rate limit, retrying transient failures; (status, headers
        with lower-case names, body). Raises SourceError (masked) for anything else."""
        p = urlsplit(url)
        target = p.path or "/"
        if p.query:
            target += "?" + p.query
        host = p.hostname or ""
        attempt = 0
        while True:
            if self.bucket is not None:
                try:
                    metrics.throttle_wait_s += self.bucket.acquire(deadline, "request")
                except TimeoutError as e:
                    raise SourceError(uri, str(e), retriable=True) from None
            metrics.requests += 1
            failure: str
            retry_after: float | None = None
            try:
                c = self._client(p.scheme, host, p.port)
                timeout = self.timeout
                if deadline is not None:
                    timeout = max(0.001, min(timeout, deadline - time.monotonic()))
                c.timeout = timeout
                if c.sock is not None:
                    c.sock.settimeout(timeout)
                c.request("GET", target, headers=self.headers)
                r = c.getresponse()
                data = r.read()
                headers = {k.lower(): v for k, v in r.getheaders()}
                metrics.statuses[r.status] = metrics.statuses.get(r.status, 0) + 1
                if r.will_close:
                    self._drop(p.scheme, host, p.port)
                if 200 <= r.status < 300 or ok:
                    return r.status, headers, data
                text = data[:200].decode("utf-8", "replace").strip()
                failure = f"HTTP {r.status} {r.reason} from GET {url}" + (
                    f": {text}" if text else ""
                )
                if r.status not in _TRANSIENT:
                    hint = {
                        401: "check the connection's headers / auth (the ${ENV} variable holding "
                        "the token may be unset or expired)",
                        403: "the credentials lack access to this endpoint",
                        404: "check base_url and the endpoint's path",
                    }.get(r.status, "check the endpoint's path, parameters and the API's docs")
                    raise SourceError(uri, failure, hint=hint)
                retry_after = _retry_after(headers.get("retry-after"))
            except (OSError, http.client.HTTPException) as e:
                self._drop(p.scheme, host, p.port)
                kind = "timed out" if isinstance(e, socket.timeout | TimeoutError) else "failed"
                failure = f"GET {url} {kind}: {type(e).__name__}: {e}"
            if attempt >= self.retry.max:
                raise SourceError(
                    uri,
                    failure + (f" (after {attempt} retries)" if attempt else ""),
                    hint="the API is unavailable or throttling; raise retries.max or lower "
                    "rate_limit.per_second",
                    retriable=True,
                )
            delay = self.retry.delay(attempt, retry_after)
            if deadline is not None and time.monotonic() + delay > deadline:
                after = "" if retry_after is None else f" (Retry-After {retry_after:g} s)"
                raise SourceError(
                    uri,
                    f"{failure}; the next retry{after} would end after the query's deadline",
                    hint="raise the query timeout, or try again later",
                    retriable=True,
                )
            if delay > 0 and not math.isinf(delay):
                time.sleep(delay)
            metrics.backoff_wait_s += delay
            metrics.retries += 1
            attempt += 1
