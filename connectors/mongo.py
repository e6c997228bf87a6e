"""MongoDB collections through pymongo (``mongo`` kind).

Options: ``url`` (required), ``database`` (required), ``timeout`` (5 s: server selection,
connect and socket timeouts), ``sample`` (100: documents read to infer a schema),
``schemas`` (``{collection: {column: type}}``: declared schemas win over inference).

Documents are flattened: the nested field ``meta.city`` is the column ``meta.city``;
ObjectIds become strings, datetimes ``timestamp[us, UTC]``; a value that does not fit
its column's type becomes null. Filters become ``find()`` filters in which every value
is typed and wrapped in an explicit operator (``{"f": {"$eq": v}}``), so a session value
that looks like an operator object is matched as a plain value (equality with a plain
scalar is written `{"f": v}`, which index planners match). SQL semantics are kept:
a comparison is never true for null/missing fields (``!=`` is ``$nin: [v, null]``), and
``not`` is pushed down with De Morgan's laws before translating.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa

from connectors._util import (
    apply_locally,
    flat_options,
    is_json_field,
    schema_from_spec,
    typed_params,
)
from connectors.arrow_expr import (
    ANY,
    ONE,
    NotTranslatable,
    eval_constant,
    is_constant,
    like_tokens,
    sort_indices,
    utcnow,
)
from connectors.base import (
    Capability,
    Connection,
    Pushdown,
    ScanMetrics,
    ScanRequest,
    Source,
    SourceError,
    Statistics,
    UnknownColumnError,
    UnknownObjectError,
    Watermark,
)
from connectors.credentials import mask_url
from connectors.json_decode import infer_schema, rows_to_batch
from dsl.ast import Between, Binary, Column, Expr, InList, IsNull, Like, Param, SortKey, Unary

NEVER: dict[str, Any] = {"_id": {"$in": []}}  # matches no document
_OPS = {"=": "$eq", "<": "$lt", "<=": "$lte", ">": "$gt", ">=": "$gte"}
_FLIP = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_NEG = {"=": "!=", "!=": "=", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}


#: unbounded wildcards a pushed LIKE regex may hold (an unanchored start counts as one):
#: with one, a regex engine's backtracking is linear in the string; with k it is O(n^k)
#: (a 26-character ``%a%b%c...`` pattern took 5-13 s of server CPU)
MAX_LIKE_WILDCARDS = 1


def like_regex(pattern: str) -> str | None:
    """SQL LIKE pattern -> an equivalent, fully escaped regex whose backtracking is bounded
    (a leading/trailing ``%`` drops the anchor instead of becoming ``.*``), or None when
    that needs more than ``MAX_LIKE_WILDCARDS`` unbounded wildcards.

    >>> like_regex("abc%"), like_regex("%a_c%"), like_regex("a%c%"), like_regex("%a%b%")
    ('^abc', 'a.c', '^a.*c', None)
    """
    toks = like_tokens(pattern)
    head = not (toks and toks[0] == ANY)
    body = toks if head else toks[1:]
    tail = not (body and body[-1] == ANY)
    body = body if tail else body[:-1]
    if body.count(ANY) + (0 if head else 1) > MAX_LIKE_WILDCARDS:
        return None
    parts = ["^" if head else ""]
    for t in body:
        parts.append(".*" if t == ANY else "." if t == ONE else re.escape(t[0]))
    parts.append("$(?!\\n)" if tail else "")  # '$' alone also matches before a final newline
    return "".join(parts)


def like_prefilter(pattern: str) -> str | None:
    """A bounded regex every match of ``pattern`` also matches (None: nothing useful): the
    anchored literal start, else the longest literal piece. The LIKE itself is then
    applied by the connector on the rows it returns."""
    toks = like_tokens(pattern)
    if toks and isinstance(toks[0], tuple):
        return "^" + re.escape(toks[0][0])
    pieces = [t[0] for t in toks if isinstance(t, tuple)]
    return re.escape(max(pieces, key=len)) if pieces else None


def _plain_scalar(v: Any) -> bool:
    """Values that can only mean themselves as ``{field: v}`` (never a dict, list or regex)."""
    from bson import ObjectId

    return type(v) in (str, int, float, bool, dt.datetime, ObjectId)


def merge_and(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Conjunction of filters, as one flat document where fields and operators do not
    collide (``{"city": {"$eq": c}, "score": {"$gte": 10, "$lte": 12}}``: what query
    planners match indexes against), else ``$and``."""
    flat: list[dict[str, Any]] = []
    for p in parts:
        if not p:
            continue
        if set(p) == {"$and"}:
            flat.extend(p["$and"])
        else:
            flat.append(p)
    out: dict[str, Any] = {}
    rest: list[dict[str, Any]] = []
    for p in flat:
        for k, v in p.items():
            if k not in out:
                out[k] = dict(v) if isinstance(v, dict) and not k.startswith("$") else v
            elif (
                not k.startswith("$")
                and isinstance(out[k], dict)
                and isinstance(v, dict)
                and not set(out[k]) & set(v)
                and all(o.startswith("$") for o in v)
            ):
                out[k].update(v)
            else:
                rest.append({k: v})
    if rest:
        out = {"$and": [out, *rest]} if out else {"$and": rest}
    return out


class LikeTooComplex(NotTranslatable):
    """A LIKE pattern past ``MAX_LIKE_WILDCARDS``: applied by the connector on the returned
    rows; ``prefilter`` is a bounded regex filter every matching document also passes."""

    def __init__(self, prefilter: dict[str, Any] | None):
        super().__init__("a LIKE pattern with too many '%' wildcards for a bounded regex")
        self.prefilter = prefilter


def _number(v: Any) -> bool:
    return isinstance(v, int | float | decimal.Decimal) and not isinstance(v, bool)


class _Translator:
    def __init__(
        self, src: MongoSource, params: Mapping[str, Any], now: dt.datetime, probe: bool = False
    ):
        self.src, self.params, self.now, self.probe = src, params, now, probe

    def field(self, e: Expr) -> str:
        if not isinstance(e, Column):
            raise NotTranslatable(f"only columns can be compared in a Mongo filter: {e}")
        f = self.src._fields.get(e.name)
        if f is None:
            raise NotTranslatable(f"unknown column {e.name}")
        t = f.type
        if is_json_field(f) or pa.types.is_list(t) or pa.types.is_fixed_size_list(t):
            raise NotTranslatable(
                f"column {e.name} holds lists or objects (array matching differs from SQL)"
            )
        return e.name

    def const(self, e: Expr) -> Any:
        if not is_constant(e):
            raise NotTranslatable(f"not a constant: {e}")
        if self.probe and e.params():
            return 0
        v = eval_constant(e, self.params, self.now)
        if isinstance(v, dt.datetime) and v.tzinfo is None:
            v = v.replace(tzinfo=dt.UTC)
        if isinstance(v, dt.date) and not isinstance(v, dt.datetime):
            v = dt.datetime(v.year, v.month, v.day, tzinfo=dt.UTC)
        if isinstance(v, dt.timedelta):
            raise NotTranslatable("a bare interval")
        if isinstance(v, decimal.Decimal):  # columns read from Mongo are floats (double)
            return float(v)
        return v

    def oid(self, col: Expr, v: Any) -> Any:
        """Strings compared with an ObjectId column are compared as ObjectIds."""
        if isinstance(col, Column) and col.name in self.src.oid_columns and isinstance(v, str):
            from bson import ObjectId

            return ObjectId(v) if ObjectId.is_valid(v) else v
        return v

    def cmp(self, op: str, left: Expr, right: Expr) -> dict[str, Any]:
        if is_constant(left) and not is_constant(right):
            left, right, op = right, left, _FLIP[op]
        name, v = self.field(left), self.oid(left, self.const(right))
        if v is None:
            return NEVER  # a comparison with null is never true
        if isinstance(v, float) and math.isnan(v):
            raise NotTranslatable(f"a comparison with NaN ({name} {op} NaN) orders as DuckDB's")
        if op == "!=":
            return {name: {"$nin": [v, None]}}
        floating = pa.types.is_floating(self.src._fields[name].type)
        if floating and _number(v):
            # the fabric compares the double it reads (a long 2^53 + 1, a Decimal128
            # 3.5000000000000001 read as 2^53, 3.5) with the constant as a double; the
            # server compares what it holds exactly: send a range one ulp wider each way
            fv = float(v)
            lo, hi = math.nextafter(fv, -math.inf), math.nextafter(fv, math.inf)
            bounds = {"=": {"$gte": lo, "$lte": hi}, ">=": {"$gte": lo}, "<=": {"$lte": hi}}
            r: dict[str, Any] = {name: bounds.get(op, {_OPS[op]: fv})}
        elif op == "=" and _plain_scalar(v):
            return {name: v}  # implicit equality: same meaning, and what index planners match
        else:
            r = {name: {_OPS[op]: v}}
        if op in (">", ">=") and floating:
            # the fabric orders NaN above every number (DuckDB's order); the server, below
            # every one: add NaN (the rows are re-checked)
            r = {"$or": [r, {name: float("nan")}]}
        return r

    def go(self, e: Expr, neg: bool = False) -> dict[str, Any]:
        if is_constant(e):
            v = True if self.probe else eval_constant(e, self.params, self.now)
            if v is None:  # unknown: never true, nor is its negation
                return NEVER
            if not isinstance(v, bool):
                raise NotTranslatable(f"a constant filter must be true or false: {e}")
            return {} if v != neg else NEVER
        if isinstance(e, Unary) and e.op == "not":
            return self.go(e.operand, not neg)
        if isinstance(e, Binary) and e.op in ("and", "or"):
            a, b = self.go(e.left, neg), self.go(e.right, neg)
            conj = (e.op == "and") != neg
            return merge_and([a, b]) if conj else {"$or": [a, b]}
        if isinstance(e, Binary) and e.op in _NEG:
            # not (f > 1) is f <= 1 for NaN too: NaN is above every number in the fabric
            return self.cmp(_NEG[e.op] if neg else e.op, e.left, e.right)
        if isinstance(e, IsNull):
            name = self.field(e.expr)
            if e.negated != neg:
                return {name: {"$ne": None}}
            # the fabric reads a value of another type (5.5 in an int column, an array) as
            # null: match every document whose value is not surely read as a value
            surely = self.src.read_types(name)
            if surely is None:
                raise NotTranslatable(f"which values of {name} are read as null is not known")
            return {"$or": [{name: {"$not": {"$type": surely}}}, {name: {"$type": "array"}}]}
        if isinstance(e, Between):
            lo, hi = Binary(">=", e.expr, e.low), Binary("<=", e.expr, e.high)
            return self.go(Binary("and", lo, hi), neg != e.negated)
        if isinstance(e, InList):
            return self._in(e, neg != e.negated)
        if isinstance(e, Like):
            return self._like(e, neg != e.negated)
        if (
            isinstance(e, Column)
            and self.src._fields.get(e.name) is not None
            and self.src._fields[e.name].type == pa.bool_()
        ):
            return {self.field(e): {"$eq": not neg}}
        raise NotTranslatable(f"cannot translate {e} to a Mongo filter")

    def _in(self, e: InList, negated: bool) -> dict[str, Any]:
        name = self.field(e.expr)
        if isinstance(e.items, Param):
            values = [0] if self.probe else list(self.params[e.items.name])
        else:
            values = [self.const(i) for i in e.items]
        values = [
            self.oid(
                e.expr,
                v.replace(tzinfo=dt.UTC) if isinstance(v, dt.datetime) and v.tzinfo is None else v,
            )
            for v in values
        ]
        if any(isinstance(v, dict | list) for v in values):
            raise NotTranslatable("'in' with objects")
        nonnull = [v for v in values if v is not None]
        if not negated and pa.types.is_floating(self.src._fields[name].type):
            nums = [float(v) for v in nonnull if _number(v)]
            if any(math.isnan(v) for v in nums) or len(nums) < len(nonnull):
                raise NotTranslatable(f"'in' of {name} with NaN or a non-number")
            if not nums:
                return NEVER
            # as in cmp: the server compares exactly, the fabric in doubles (a long past
            # 2^53, a Decimal128): each value widened by one ulp; a long list, its range
            ranges = [(math.nextafter(v, -math.inf), math.nextafter(v, math.inf)) for v in nums]
            if len(ranges) > 64:
                ranges = [(min(lo for lo, _ in ranges), max(hi for _, hi in ranges))]
            ors = [{name: {"$gte": lo, "$lte": hi}} for lo, hi in ranges]
            return ors[0] if len(ors) == 1 else {"$or": ors}
        if not negated:
            return {name: {"$in": nonnull}}
        if len(nonnull) < len(values):
            return NEVER  # x not in (.., null) is never true
        return {name: {"$nin": [*nonnull, None]}}

    def _like(self, e: Like, negated: bool) -> dict[str, Any]:
        name = self.field(e.expr)
        if not pa.types.is_string(self.src._fields[name].type):
            raise NotTranslatable("'like' on a non-string column")
        pattern = "" if self.probe else self.const(e.pattern)
        if pattern is None:
            return NEVER
        if not isinstance(pattern, str):
            raise NotTranslatable("'like' pattern must be a string")
        options = "s" + ("i" if e.case_insensitive else "")
        regex = like_regex(pattern)
        if regex is None:  # would backtrack: the connector applies it to the rows instead
            pre = None if negated else like_prefilter(pattern)
            raise LikeTooComplex(
                None if pre is None else {name: {"$regex": pre, "$options": options}}
            )
        rx = {"$regex": regex, "$options": options}
        if negated:
            return {name: {"$not": rx, "$type": "string"}}
        return {name: rx}


class MongoSource(Source):
    capabilities = frozenset({Capability.PROJECTION, Capability.LIMIT, Capability.ORDER_BY})

    def __init__(
        self,
        uri: str,
        conn: MongoConnection,
        collection: str,
        schema: pa.Schema,
        oid_columns: frozenset[str] = frozenset({"_id"}),
    ):
        super().__init__(uri)
        self.oid_columns = oid_columns
        self.conn = conn
        self.collection = collection
        self._schema = schema
        self._fields = {f.name: f for f in schema}

    @property
    def coll(self) -> Any:
        return self.conn.db[self.collection]

    def schema(self) -> pa.Schema:
        return self._schema

    def read_types(self, name: str) -> list[str] | None:
        """BSON types the fabric always reads as a value (never null) in column ``name``
        (None: not known). Other values (5.5 or an array in an int column) are read as
        null, so a pushed filter is re-checked on the rows (``scan``)."""
        t = self._fields[name].type
        if name in self.oid_columns:
            return ["objectId", "string"]
        if pa.types.is_integer(t):
            return ["int", "long"]
        if pa.types.is_floating(t):
            return ["double", "int", "long"]
        if pa.types.is_string(t):
            return ["string"]
        if pa.types.is_boolean(t):
            return ["bool"]
        return None

    def supports_filter(self, expr: Expr) -> Pushdown:
        try:
            _Translator(self, {}, utcnow(), probe=True).go(expr)
        except (NotTranslatable, KeyError, TypeError):
            return Pushdown.UNSUPPORTED
        return Pushdown.EXACT

    def find_filter(
        self, filters: tuple[Expr, ...], params: Mapping[str, Any], now: dt.datetime | None = None
    ) -> dict[str, Any]:
        params = typed_params(filters, params, self._schema, self.uri)
        tr = _Translator(self, params, now or utcnow())
        return merge_and([tr.go(f) for f in filters])

    def statistics(self) -> Statistics:
        try:
            n = self.coll.estimated_document_count()
        except Exception as exc:
            raise self.conn.error(exc, self.collection) from exc
        return Statistics(row_count=int(n), exact=False)

    def watermark(self) -> Watermark:
        now = time.time()
        return Watermark(
            observed_at=now, event_time=now, lag_messages=0, detail={"kind": "query time"}
        )

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        params = typed_params(request.filters, request.params, self._schema, self.uri)
        tr = _Translator(self, params, utcnow())
        parts, local = [], []
        for f in request.filters:
            try:
                parts.append(tr.go(f))
            except LikeTooComplex as exc:  # applied below; a bounded regex narrows the read
                local.append(f)
                if exc.prefilter is not None and isinstance(f, Like):
                    parts.append(exc.prefilter)
            except NotTranslatable:  # a filter not offered first (dynamic): applied below
                local.append(f)
        query = merge_and(parts)
        from bson import json_util

        # this scan's own (the source is shared by concurrent queries): the filter sent
        request.metrics.statement = json_util.dumps(query)
        cols = list(request.columns) if request.columns is not None else self._schema.names
        unknown = [c for c in cols if c not in self._fields]
        if unknown:
            raise UnknownColumnError(self.uri, unknown, self._schema.names)
        # every filter is also applied to the rows as read: the server compares what it
        # holds, and a value the fabric reads as null (5.5 in an int column, an array, a
        # Decimal128 in an int column) passed x > 4 there; pushed, a filter only narrows
        # the read (a translation is never narrower than the fabric's own evaluation)
        check = list(request.filters)
        selected = list(dict.fromkeys([*cols, *sorted(c.name for f in check for c in f.columns())]))
        if not check:
            yield from self._scan(request, query, selected, request.limit)
            return
        limit = request.limit
        if limit is not None and not local:  # the server's first `limit` rows, if all pass
            first = list(self._scan(request, query, selected, limit))
            kept = list(apply_locally(iter(first), check, params, limit, cols))
            if sum(b.num_rows for b in kept) == min(limit, sum(b.num_rows for b in first)):
                yield from kept
                return
        yield from apply_locally(
            self._scan(request, query, selected, None), check, params, limit, cols
        )

    def _scan(
        self, request: ScanRequest, query: dict[str, Any], cols: list[str], limit: int | None
    ) -> Iterator[pa.RecordBatch]:
        schema = pa.schema([self._fields[c] for c in cols])
        need = list(
            dict.fromkeys(
                [*cols, *(k.expr.name for k in request.order_by if isinstance(k.expr, Column))]
            )
        )
        projection = {c: 1 for c in need}
        if "_id" not in need:
            projection["_id"] = 0
        request.metrics.records, request.metrics.bad_records = 0, 0
        if limit is not None and limit <= 0:
            yield pa.RecordBatch.from_pylist([], schema=schema)
            return
        keys = request.order_by
        if keys and not all(isinstance(k.expr, Column) for k in keys):
            raise ValueError(
                f"{self.uri}: can only order by columns, got {', '.join(map(str, keys))}"
            )
        try:
            if not keys:
                yield from self._batches(
                    self._find(query, projection, [], limit, request), schema, request
                )
                return
            # The server sorts what it holds: NaN below every number, a value the fabric
            # reads as null (5.5 in an int column, a string, an array) by its BSON type. It
            # sorts only the documents whose keys are surely read as values (the first
            # `limit` of them); the others, few, are read in full; the fabric orders both.
            sure = self._surely_values(keys)
            first: list[pa.RecordBatch] = []
            rest_query = query
            if sure is not None:
                sort = [(_name(k), -1 if k.descending else 1) for k in keys]
                first = list(
                    self._batches(
                        self._find(merge_and([query, sure]), projection, sort, limit, request),
                        schema,
                        request,
                    )
                )
                rest_query = merge_and([query, {"$nor": [sure]}])
            rest = self._batches(
                self._find(rest_query, projection, [], None, request), schema, request
            )
            table = _sort_table(pa.Table.from_batches([*first, *rest], schema=schema), keys)
            if limit is not None:
                table = table.slice(0, limit)
            yield from table.to_batches(max_chunksize=request.batch_size)
        except (KeyError, ValueError):
            raise
        except Exception as exc:
            raise self.conn.error(exc, self.collection) from exc

    def _surely_values(self, keys: tuple[SortKey, ...]) -> dict[str, Any] | None:
        """A filter of the documents whose sort keys the server orders as the fabric does:
        each key of a type the fabric always reads as a value, not an array, not NaN
        (None: a key of a type without that knowledge)."""
        parts: list[dict[str, Any]] = []
        for k in keys:
            name = _name(k)
            types = self.read_types(name)
            if types is None:
                return None
            parts += [{name: {"$type": types}}, {name: {"$not": {"$type": "array"}}}]
            if pa.types.is_floating(self._fields[name].type):
                parts.append({name: {"$gte": float("-inf")}})  # every number but NaN
        return {"$and": parts}

    def _find(
        self,
        query: dict[str, Any],
        projection: dict[str, int],
        sort: list[tuple[str, int]],
        limit: int | None,
        request: ScanRequest,
    ) -> Any:
        cur = self.coll.find(query, projection, batch_size=max(1, min(request.batch_size, 10_000)))
        if sort:
            cur = cur.sort(sort)
        if limit is not None:
            cur = cur.limit(int(limit))
        if request.timeout:
            cur = cur.max_time_ms(int(request.timeout * 1000))
        return cur

    def _batches(
        self, cursor: Any, schema: pa.Schema, request: ScanRequest
    ) -> Iterator[pa.RecordBatch]:
        buf: list[Mapping[str, Any]] = []
        for doc in cursor:
            buf.append(doc)
            if len(buf) >= request.batch_size:
                yield self._batch(buf, schema, request.metrics)
                buf = []
        if buf or not request.metrics.records:
            yield self._batch(buf, schema, request.metrics)

    def _batch(
        self, docs: list[Mapping[str, Any]], schema: pa.Schema, metrics: ScanMetrics
    ) -> pa.RecordBatch:
        batch, errors = rows_to_batch(docs, schema, on_error="null")
        first = metrics.records or 0
        metrics.records = first + len(docs)
        if errors:  # the bad cells are null
            metrics.bad(len(errors), ({"document": first + i, "reason": why} for i, why in errors))
        return batch


def _name(k: SortKey) -> str:
    assert isinstance(k.expr, Column)
    return k.expr.name


def _sort_table(table: pa.Table, keys: tuple[SortKey, ...]) -> pa.Table:
    if not keys:
        return table
    # pyarrow sorts with one null placement; sort stably from the last key to the first
    for k in reversed(keys):
        order = "descending" if k.descending else "ascending"
        idx = sort_indices(table, [(_name(k), order, "at_start" if k.nulls_first else "at_end")])
        table = table.take(idx)
    return table


def _oid_columns(docs: list[Any], prefix: str = "") -> frozenset[str]:
    from bson import ObjectId

    out: set[str] = set()
    for d in docs:
        for k, v in d.items():
            if isinstance(v, ObjectId):
                out.add(prefix + k)
            elif isinstance(v, dict):
                out |= _oid_columns([v], f"{prefix}{k}.")
    return frozenset(out)


class MongoConnection(Connection):
    kind = "mongo"

    def __init__(self, name: str, options: Mapping[str, Any]):
        options = flat_options(
            options, {"connect_timeout": "timeout", "query_timeout": "read_timeout"}
        )
        super().__init__(name, options)
        for key in ("url", "database"):
            if not options.get(key):
                raise ValueError(
                    f"connection {name!r}: a mongo connection needs '{key}' (e.g. url: mongodb://host:27017, database: crm)"
                )
        self.timeout = float(options.get("timeout", 5))
        self.sample = int(options.get("sample", 100))
        self.schemas: Mapping[str, Mapping[str, str]] = options.get("schemas") or {}
        self._client: Any = None

    def uri(self, obj: str = "") -> str:
        return f"mongo://{self.name}/{obj}"

    @property
    def client(self) -> Any:
        if self._client is None:
            import pymongo

            ms = int(self.timeout * 1000)
            self._client = pymongo.MongoClient(
                str(self.options["url"]),
                serverSelectionTimeoutMS=ms,
                connectTimeoutMS=ms,
                socketTimeoutMS=int(float(self.options.get("read_timeout", 30)) * 1000),
                # a read that timed out is not retried on a new connection: a server that
                # stops answering fails a scan after read_timeout, not twice that
                retryReads=False,
                tz_aware=True,
            )
        return self._client

    @property
    def db(self) -> Any:
        return self.client[str(self.options["database"])]

    def error(self, exc: BaseException, obj: str = "") -> SourceError:
        import pymongo.errors as pe

        msg = (
            str(exc)
            .split(", Timeout:")[0]
            .split(", Topology Description")[0]
            .split(", full error:")[0]
        )
        down = isinstance(
            exc,
            pe.AutoReconnect
            | pe.ServerSelectionTimeoutError
            | pe.NetworkTimeout
            | pe.ExecutionTimeout,
        )
        hint = (
            f"check that the MongoDB server at {mask_url(self.options['url'])} is running and reachable"
            if down
            else None
        )
        limits = (
            f" (timeout {self.timeout:g} s for server selection and connect, read timeout "
            f"{float(self.options.get('read_timeout', 30)):g} s)"
            if down
            else ""
        )
        return SourceError(
            self.uri(obj), f"{type(exc).__name__}: {msg}{limits}", hint=hint, retriable=down
        )

    def ping(self) -> None:
        try:
            self.client.admin.command("ping")
        except Exception as exc:
            raise self.error(exc) from exc

    def list_objects(self) -> list[str]:
        try:
            return sorted(self.db.list_collection_names())
        except Exception as exc:
            raise self.error(exc) from exc

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> MongoSource:
        declared = (options or {}).get("schema") or self.schemas.get(obj)
        existing = self.list_objects()
        if obj not in existing:
            raise UnknownObjectError(self.uri(obj), existing)
        docs: list[Any] = []
        if declared:
            schema = schema_from_spec(declared)
        else:
            try:
                docs = list(self.db[obj].find({}, limit=self.sample))
            except Exception as exc:
                raise self.error(exc, obj) from exc
            if not docs:
                raise SourceError(
                    self.uri(obj),
                    "cannot infer a schema: the collection is empty",
                    hint=f"declare it under connections.{self.name}.schemas.{obj} in fabric.yaml",
                )
            schema = infer_schema(docs)
        return MongoSource(
            self.uri(obj), self, obj, schema, frozenset({"_id"}) | _oid_columns(docs)
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
