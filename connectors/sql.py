"""SQL databases through SQLAlchemy Core (``mysql``, ``postgres``, ``sql`` kinds).

Options: ``url`` (SQLAlchemy URL; required), ``pool_size`` (5), ``max_overflow`` (5),
``pool_recycle`` (1800 s), ``connect_timeout`` (5 s), ``read_timeout`` (30 s: also the
longest a statement may run), ``schema`` (database schema to look tables up in).

Filters become SQLAlchemy expressions in which every session value and literal is a
bound parameter (``in {{session.list}}`` is an expanding bind parameter), so no value is
ever part of the query text. Everything the translator accepts is EXACT; to keep that
true on MySQL/MariaDB, where the usual collations compare strings case- and
trailing-space-insensitively, string comparisons are made on the binary form
(``CAST(col AS BINARY)``; equality and ``in`` keep a plain comparison next to it so an
index can still be used). Sorting on strings is binary too, and nulls sort last unless
asked otherwise (as in DuckDB). Rows stream from a server-side cursor into Arrow batches.

A correlated ``exists`` over another table of the same connection (``dsl.ast.ExistsIn``,
from ``fabric.optimizer.push_exists``) becomes ``[NOT] EXISTS (SELECT 1 FROM <table> AS
<alias> WHERE ...)``, its condition translated like any filter; it is EXACT only for a
table of this connection. Comparing text of two tables is exact on PostgreSQL (both
sides in byte order, ``COLLATE "C"``) and left to the fabric on MariaDB / MySQL, whose
two columns may differ in collation and character set.
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import json
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql as sa_mysql
from sqlalchemy.dialects import postgresql as pg_types
from sqlalchemy.engine import Engine, make_url

from connectors import sql_drivers
from connectors._util import BadValueError, apply_locally, flat_options, typed_params
from connectors.arrow_expr import NotTranslatable, eval_constant, is_constant, utcnow
from connectors.base import (
    Capability,
    ColumnStats,
    Connection,
    Pushdown,
    ScanRequest,
    Source,
    SourceError,
    Statistics,
    UnknownColumnError,
    UnknownObjectError,
    Watermark,
)
from dsl.ast import (
    Between,
    Binary,
    Call,
    Column,
    ExistsIn,
    Expr,
    InList,
    IsNull,
    Like,
    Literal,
    Param,
    Star,
    Unary,
    conjuncts,
    replace,
)

_CMP = {"=", "!=", "<", "<=", ">", ">="}
_ANY = pa.null()  # the type of a session value while planning: fits any column


def arrow_type(t: sa.types.TypeEngine) -> pa.DataType:
    """Arrow type for a reflected column type (timestamps are read as UTC)."""
    if isinstance(t, sa.Boolean) or (
        isinstance(t, sa_mysql.TINYINT) and getattr(t, "display_width", None) == 1
    ):
        return pa.bool_()
    if isinstance(t, sa_mysql.BIGINT) and getattr(t, "unsigned", False):
        return pa.uint64()  # up to 2^64 - 1: int64 overflowed past 2^63 (OverflowError)
    if isinstance(t, sa.Integer):
        return pa.int64()
    if isinstance(t, sa.Numeric) and not isinstance(t, sa.Float):
        p, s = getattr(t, "precision", None), getattr(t, "scale", None)
        if p and s is not None and p <= 38:
            return pa.decimal128(p, s)
        return pa.float64()
    if isinstance(t, sa.Float | sa.Numeric):
        return pa.float64()
    if isinstance(t, sa.DateTime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(t, sa.Date):
        return pa.date32()
    if isinstance(t, sa.Time):
        return pa.time64("us")
    if isinstance(t, sa.Interval):
        return pa.duration("us")
    if isinstance(t, sa.LargeBinary | sa.types._Binary):
        return pa.binary()
    return pa.string()  # String, Text, Enum, JSON, UUID, anything else as text


def _is_text(t: pa.DataType | None) -> bool:
    if t is None:
        return False
    if t is _ANY:
        return True
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _to_py(v: Any, t: pa.DataType) -> Any:
    if v is None:
        return None
    if _is_text(t) and not isinstance(v, str):
        import json

        return (
            v.decode()
            if isinstance(v, bytes)
            else json.dumps(v, default=str)
            if isinstance(v, dict | list)
            else str(v)
        )
    if pa.types.is_floating(t) and isinstance(v, decimal.Decimal):
        return float(v)
    if pa.types.is_boolean(t) and isinstance(v, int):
        return bool(v)
    return v


def _column(values: Any, t: pa.DataType) -> pa.Array:
    """Driver values as an Arrow array; per-value conversion only when the driver's type differs."""
    try:
        return pa.array(values, type=t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        return pa.array([_to_py(v, t) for v in values], type=t)


def _arrays(
    rows: list[tuple[Any, ...]], types: list[pa.DataType], rowtype: pa.DataType
) -> list[Any]:
    """The driver's row tuples as one Arrow array per column: transposed by Arrow itself
    (tuples as struct values, ~3x faster than zip), or column by column with per-value
    conversion when a driver value does not fit its column's type as it is."""
    if types:
        try:
            return pa.array(rows, type=rowtype).flatten()  # type: ignore[no-any-return]
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass
    cols = list(zip(*rows)) if types else []
    return [_column(col, t) for col, t in zip(cols, types)]


def _sqlite_binary_collation(conn: SqlConnection, table: sa.Table) -> bool:
    """True if ``table`` is a plain SQLite table whose definition names no collation."""
    try:
        with conn.engine.connect() as c:
            row = c.execute(
                sa.text("SELECT type, sql FROM sqlite_master WHERE name = :n"),
                {"n": table.name},
            ).first()
    except sa.exc.SQLAlchemyError:
        return False
    return row is not None and row[0] == "table" and "collate" not in str(row[1]).lower()


class SqlSource(Source):
    """One table or view."""

    capabilities = frozenset(
        {Capability.PROJECTION, Capability.LIMIT, Capability.ORDER_BY, Capability.AGGREGATE}
    )

    def __init__(self, uri: str, conn: SqlConnection, table: sa.Table):
        super().__init__(uri)
        self.conn = conn
        self.table = table
        self._schema = pa.schema([pa.field(c.name, arrow_type(c.type)) for c in table.columns])
        dialect = conn.engine.dialect.name
        self.mysql = dialect in ("mysql", "mariadb")
        # Other dialects: string comparison, LIKE and ordering semantics (collations) are
        # unknown here, so those filters are left to the fabric and order is not pushed.
        self.generic = dialect not in ("mysql", "mariadb", "postgresql")
        self.naive_times = dialect != "postgresql"  # bind UTC datetimes without a zone
        if self.generic:
            self.capabilities = frozenset({Capability.PROJECTION, Capability.LIMIT})  # type: ignore[misc]
        # SQLite compares TEXT bytewise (collation BINARY), as Arrow does, unless the table
        # declares another collation: then =, <, in on strings push down (not LIKE, which
        # SQLite folds ASCII case for)
        self.binary_text = dialect == "sqlite" and _sqlite_binary_collation(conn, table)
        self._stats: Statistics | None = None
        self._peers: dict[str, SqlSource] = {}
        # PostgreSQL CHAR(n) pads values with blanks ('Brand#13  ') and compares them
        # ignoring the padding: read and compare them as text (cast drops the padding), as
        # MariaDB and DuckDB's scanners return them, so pushed and local filters agree
        self._char = (
            {c.name for c in table.columns if isinstance(c.type, sa.CHAR | sa.NCHAR)}
            if dialect == "postgresql"
            else set()
        )

        # a DECIMAL wider than Arrow's 38 digits (DECIMAL(65, 30), NUMERIC without a
        # precision) is read as a double: select and compare it as that double, so a pushed
        # w = 0.3 keeps every row that reads 0.3 (compared exactly, 0.30000000000000001
        # was dropped and w > 0.3 kept a row reading 0.3)
        self._wide = {
            c.name
            for c in table.columns
            if isinstance(c.type, sa.Numeric)
            and not isinstance(c.type, sa.Float)
            and pa.types.is_floating(self._schema.field(c.name).type)
        }

    def col(self, name: str, table: Any = None) -> Any:
        """The column as selected and compared (CHAR(n) of PostgreSQL as unpadded text, a
        DECIMAL wider than 38 digits as the double it is read as); of ``table`` (an alias
        of this source's table) when given."""
        c = (self.table if table is None else table).c[name]
        if name in self._wide:
            if self.mysql:  # SQLAlchemy skips CAST(.. AS DOUBLE) on MySQL: + 0e0 is a double
                return sa.type_coerce(c + sa.literal_column("0e0"), sa.Float())
            return sa.cast(c, sa.Double())
        return sa.cast(c, sa.Text()) if name in self._char else c

    def schema(self) -> pa.Schema:
        return self._schema

    def peer(self, uri: str) -> SqlSource:
        """The source of ``uri`` when it is a table of this source's connection (the same
        server and database: one statement can read both); raises NotTranslatable."""
        obj = uri.partition("://")[2].partition("/")[2]
        if not obj or uri != self.conn.uri(obj):
            raise NotTranslatable(f"{uri} is not a table of {self.conn.uri()}")
        if uri not in self._peers:
            try:
                self._peers[uri] = self.conn.source(obj)
            except (UnknownObjectError, SourceError) as exc:
                raise NotTranslatable(str(exc)) from None
        return self._peers[uri]

    def leads_index(self, name: str) -> bool:
        """Whether column ``name`` is the first column of an index or of the primary key."""
        firsts = [next(iter(ix.columns)).name for ix in self.table.indexes if len(ix.columns)]
        pk = list(self.table.primary_key.columns)
        return name in firsts or bool(pk and pk[0].name == name)

    # ----------------------------------------------------------------- translation

    def supports_filter(self, expr: Expr) -> Pushdown:
        try:
            _Translator(self, {}, utcnow(), probe=True).go(expr)
        except (NotTranslatable, KeyError, TypeError):
            return Pushdown.UNSUPPORTED
        return Pushdown.EXACT

    def supports_aggregate(self, agg: Any, schema: pa.Schema | None = None) -> bool:
        """GROUP BY in the statement for what MariaDB and PostgreSQL compute as DuckDB
        does, exactly: ``count``, and ``sum`` / ``min`` / ``max`` of integer and DECIMAL
        columns under ``+ - *`` with integer / decimal constants (``min`` / ``max`` of a
        date column too; not ``sum`` of integers on MariaDB, whose cast back saturates); group keys integer, DECIMAL or date columns (and text on
        PostgreSQL, whose grouping is by equality; MariaDB's collations fold case). Not
        ``avg`` nor ``/`` (the servers' DECIMAL scale and integer division differ), nor
        floats."""
        if self.generic:
            return False
        for _, e, _ in agg.group_by:
            if not isinstance(e, Column) or e.name not in self.table.c:
                return False
            t = self._schema.field(e.name).type
            if not (_exact_number(t) or pa.types.is_date(t) or (not self.mysql and _is_text(t))):
                return False
        for _, e, t in agg.aggregates:
            if not isinstance(e, Call) or e.distinct or len(e.args) != 1:
                return False
            if self.mysql and e.name == "sum" and pa.types.is_integer(t):
                # MariaDB's SUM of integers is a DECIMAL, and CAST(... AS SIGNED) saturates
                # at 2^63-1 with only a warning: past it the answer would be quietly wrong
                return False
            (arg,) = e.args
            if e.name == "count":
                if not (
                    isinstance(arg, Star) or (isinstance(arg, Column) and arg.name in self.table.c)
                ):
                    return False
            elif e.name in ("min", "max") and isinstance(arg, Column) and arg.name in self.table.c:
                t = self._schema.field(arg.name).type
                if not (_exact_number(t) or pa.types.is_date(t)):
                    return False
            elif e.name not in ("sum", "min", "max") or not self._exact_arithmetic(arg):
                return False
        return True

    def _exact_arithmetic(self, e: Expr) -> bool:
        if isinstance(e, Column):
            return e.name in self.table.c and _exact_number(self._schema.field(e.name).type)
        if isinstance(e, Literal):
            return e.type in ("int", "decimal") and e.value is not None
        if isinstance(e, Binary) and e.op in ("+", "-", "*"):
            return self._exact_arithmetic(e.left) and self._exact_arithmetic(e.right)
        if isinstance(e, Unary) and e.op == "-":
            return self._exact_arithmetic(e.operand)
        return False

    def _grouped(self, stmt: Any, agg: Any, params: Mapping[str, Any], now: dt.datetime) -> Any:
        """``stmt`` (its FROM and WHERE) selecting ``agg``'s keys and aggregates, grouped."""
        tr = _Translator(self, params, now)
        keys = [tr.value(e)[0] for _, e, _ in agg.group_by]
        items = [k.label(n) for k, (n, _, _) in zip(keys, agg.group_by)]
        for n, e, t in agg.aggregates:
            (arg,) = e.args
            inner = sa.literal_column("*") if isinstance(arg, Star) else tr.value(arg)[0]
            clause = getattr(sa.func, e.name)(inner)
            if pa.types.is_integer(t):  # PostgreSQL's SUM of bigint is a numeric; the
                clause = sa.cast(clause, sa.BigInteger())  # cast errors past 2^63-1
            items.append(clause.label(n))
        out = stmt.with_only_columns(*items)
        return out.group_by(*keys) if keys else out

    def translate(self, e: Expr, params: Mapping[str, Any], now: dt.datetime) -> Any:
        """SQLAlchemy boolean expression for ``e``; raises NotTranslatable."""
        return _Translator(self, params, now).go(e)

    # ----------------------------------------------------------------- planning view

    def statistics(self) -> Statistics:
        if self._stats is None:
            try:
                self._stats = self.conn.table_statistics(self)
            except sa_exc.SQLAlchemyError:
                self._stats = Statistics()
        return self._stats

    def watermark(self) -> Watermark:
        now = time.time()
        return Watermark(
            observed_at=now, event_time=now, lag_messages=0, detail={"kind": "query time"}
        )

    # ----------------------------------------------------------------- scan

    def plan(
        self, request: ScanRequest, now: dt.datetime | None = None
    ) -> tuple[sa.Select, list[Expr], list[str], dict[str, Any]]:
        """(statement, filters applied here instead, columns selected, bound params).

        A filter that arrives without having been offered to ``supports_filter`` (a
        dynamic join-key filter) and does not translate is applied by the connector on the
        fetched rows; the limit then waits until after it.
        """
        now = now or utcnow()
        params = self._typed_params(request.filters, request.params)
        cols = list(request.columns) if request.columns is not None else self._schema.names
        missing = [c for c in cols if c not in self.table.c]
        if missing:
            raise UnknownColumnError(self.uri, missing, self._schema.names)
        where, local = [], []
        for f in request.filters:
            try:
                where.append(self.translate(f, params, now))
            except NotTranslatable:
                local.append(f)
        extra = sorted({c.name for f in local for c in f.columns()} - set(cols))
        selected = [*cols, *extra]
        stmt = (
            sa.select(
                *[
                    self.col(c).label(c) if c in self._char or c in self._wide else self.table.c[c]
                    for c in selected
                ]
            )
            if selected
            else sa.select(sa.literal(1))
        ).select_from(self.table)  # an EXISTS correlates with it, even when no column is read
        for w in where:
            stmt = stmt.where(w)
        for key in request.order_by:
            for clause in self._order(key, params, now):
                stmt = stmt.order_by(clause)
        if request.limit is not None and not local:
            stmt = stmt.limit(int(request.limit))
        if request.aggregate is not None and not local:
            stmt = self._grouped(stmt, request.aggregate, params, now)
        return stmt, local, selected, params

    def _typed_params(self, filters: tuple[Expr, ...], params: Mapping[str, Any]) -> dict[str, Any]:
        """``typed_params`` with the session values compared with another table's columns
        inside an ``ExistsIn`` checked against that table's types."""
        exists = [x for f in filters for x in f.walk() if isinstance(x, ExistsIn)]
        if not exists:
            return typed_params(filters, params, self._schema, self.uri)
        true = Literal(True, "bool")
        plain = [
            replace(f, lambda n: None, pre=lambda n: true if isinstance(n, ExistsIn) else None)
            for f in filters
        ]
        out = typed_params(plain, params, self._schema, self.uri)
        for x in exists:
            try:
                other = self.peer(x.uri)
            except NotTranslatable:
                continue  # not translated either: the scan reports it
            alias = x.alias

            def named(n: Expr, alias: str = alias) -> Expr | None:
                if isinstance(n, Column) and n.source == alias:
                    return Column(f"{alias}.{n.name}")
                return None

            fields = [*self._schema, *(f.with_name(f"{alias}.{f.name}") for f in other._schema)]
            out = typed_params([replace(x.where, named)], out, pa.schema(fields), self.uri)
        return out

    def statement(self, request: ScanRequest, now: dt.datetime | None = None) -> sa.Select:
        return self.plan(request, now)[0]

    def _order(self, key: Any, params: Mapping[str, Any], now: dt.datetime) -> list[Any]:
        tr = _Translator(self, params, now)
        e, typ = tr.value(key.expr)
        if typ is not None and _is_text(typ):
            if self.mysql:
                e = sa.cast(e, sa_mysql.BINARY())
            elif self.conn.engine.dialect.name == "postgresql":
                e = e.collate("C")  # byte order, as Arrow compares strings
        nulls_first = bool(key.nulls_first) if key.nulls_first is not None else False
        out = []
        if self.mysql:  # no NULLS FIRST/LAST: sort on "is null" first
            flag = sa.case((e.is_(None), 1), else_=0)
            out.append(flag.desc() if nulls_first else flag.asc())
            out.append(e.desc() if key.descending else e.asc())
        else:
            o = e.desc() if key.descending else e.asc()
            out.append(o.nulls_first() if nulls_first else o.nulls_last())
        return out

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        stmt, local, selected, params = self.plan(request)
        agg = request.aggregate
        if agg is not None and not local:  # grouped by the server
            yield from self.conn.stream(self, stmt, agg.schema, request)
            return
        if agg is not None:  # a filter applied here first: the rows, then the aggregate
            from fabric.execute.sql import run_aggregate

            cols = list(request.columns or self._schema.names)
            fields = pa.schema([self._schema.field(c) for c in selected])
            read = self.conn.stream(self, stmt, fields, request)
            kept = list(apply_locally(read, local, params, None, cols))
            table = (
                pa.Table.from_batches(kept).select(cols)
                if kept
                else pa.schema([self._schema.field(c) for c in cols]).empty_table()
            )
            out = run_aggregate(table, agg, params, utcnow())
            yield from out.to_batches() or [pa.RecordBatch.from_pylist([], schema=out.schema)]
            return
        cols = list(request.columns) if request.columns is not None else self._schema.names
        schema = pa.schema([self._schema.field(c) for c in selected])
        batches = self.conn.stream(self, stmt, schema, request)
        if local:
            batches = apply_locally(batches, local, params, request.limit, cols)
        yield from batches


class _Translator:
    """dsl.ast -> SQLAlchemy, binding every constant. ``value()`` returns (clause, arrow type)."""

    def __init__(
        self, src: SqlSource, params: Mapping[str, Any], now: dt.datetime, probe: bool = False
    ):
        self.src = src
        self.params = params
        self.now = now
        self.probe = probe  # planning: session values are not known yet
        self.pg = src.conn.engine.dialect.name == "postgresql"
        #: alias -> (source, aliased table) of each ``ExistsIn`` being translated
        self.tables: dict[str, tuple[SqlSource, Any]] = {}

    def const(self, e: Expr) -> tuple[Any, pa.DataType | None]:
        if self.probe and e.params():
            return sa.bindparam(None, None), _ANY
        v = eval_constant(e, self.params, self.now)
        if isinstance(v, dt.timedelta):
            raise NotTranslatable("interval values are folded into constants, not bound alone")
        if isinstance(v, dict | list | tuple | set):
            raise NotTranslatable(f"a {type(v).__name__} value cannot be compared here: {e}")
        if isinstance(v, dt.datetime):
            v = v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)
            if self.src.naive_times:
                v = v.replace(tzinfo=None)  # the session time zone is UTC
            return sa.bindparam(
                None, v, type_=sa.DateTime(timezone=not self.src.naive_times)
            ), pa.timestamp("us", tz="UTC")
        if v is None:
            return sa.null(), None
        if isinstance(v, bool):
            return sa.bindparam(None, v, type_=sa.Boolean()), pa.bool_()
        if isinstance(v, int):
            return sa.bindparam(None, v, type_=sa.BigInteger()), pa.int64()
        if isinstance(v, float):
            return sa.bindparam(None, v, type_=sa.Float()), pa.float64()
        if isinstance(v, decimal.Decimal):  # an exact decimal, compared exactly by the server
            from fabric.plan.types import decimal_type

            return sa.bindparam(None, v, type_=sa.Numeric(asdecimal=True)), decimal_type(v)
        if isinstance(v, str):
            return sa.bindparam(None, v, type_=sa.String()), pa.string()
        if isinstance(v, dt.date):
            return sa.bindparam(None, v, type_=sa.Date()), pa.date32()
        raise NotTranslatable(f"cannot bind a {type(v).__name__} value: {e}")

    def value(self, e: Expr) -> tuple[Any, pa.DataType | None]:
        if is_constant(e):
            return self.const(e)
        if isinstance(e, Column):
            if e.source is not None:  # a column of the table of an enclosing ExistsIn
                if e.source not in self.tables:
                    raise NotTranslatable(f"unknown column {e.qualified}")
                other, table = self.tables[e.source]
                if e.name not in other.table.c:
                    raise NotTranslatable(f"unknown column {e.qualified}")
                return other.col(e.name, table), other._schema.field(e.name).type
            if e.name not in self.src.table.c:
                raise NotTranslatable(f"unknown column {e.name}")
            return self.src.col(e.name), self.src._schema.field(e.name).type
        if isinstance(e, Binary) and e.op in ("+", "-", "*", "%"):
            (a, ta), (b, tb) = self.value(e.left), self.value(e.right)
            if not _numeric(ta) or not _numeric(tb):
                raise NotTranslatable(f"arithmetic on non-numbers: {e}")
            t = pa.float64() if pa.types.is_floating(ta) or pa.types.is_floating(tb) else ta
            if e.op == "+":
                return a + b, t
            if e.op == "-":
                return a - b, t
            if e.op == "*":
                return a * b, t
            return a % b, t
        if isinstance(e, Binary) and e.op == "||":
            (a, ta), (b, tb) = self.value(e.left), self.value(e.right)
            if not (_is_text(ta) and _is_text(tb)):
                raise NotTranslatable(f"'||' on non-strings: {e}")
            return a.concat(b), pa.string()
        if isinstance(e, Unary) and e.op == "-":
            a, ta = self.value(e.operand)
            if not _numeric(ta):
                raise NotTranslatable(f"negation of a non-number: {e}")
            return -a, ta
        if isinstance(e, Call):
            return self._call(e)
        raise NotTranslatable(f"cannot translate {e} to SQL")

    def _call(self, e: Call) -> tuple[Any, pa.DataType | None]:
        """A function through its registered SQL form for this dialect (fabric.functions)."""
        from fabric.functions import REGISTRY

        f = REGISTRY.get(e.name)
        if f is None or f.sql is None or f.aggregate:
            raise NotTranslatable(f"{e.name}() has no SQL form")
        args = []
        for i, a in enumerate(e.args):
            if i in f.constant_args:
                args.append((None, None, a))
                continue
            v, t = self.value(a)
            args.append((v, t, a))

        def const(a: Expr) -> Any:
            if not is_constant(a):
                raise NotTranslatable(f"argument {a} of {e.name}() must be a constant")
            if self.probe and a.params():
                raise NotTranslatable(f"argument {a} of {e.name}() is a session value")
            return eval_constant(a, self.params, self.now)

        return f.sql(self.src.conn.engine.dialect.name, args, const)

    def _binary(self, clause: Any, t: pa.DataType | None) -> Any:
        return (
            sa.cast(clause, sa_mysql.BINARY())
            if self.src.mysql and t is not None and _is_text(t)
            else clause
        )

    def _two_tables(self, t: pa.DataType | None, *exprs: Expr) -> bool:
        """Whether text ``exprs`` read columns of two tables (an ``ExistsIn``'s and the
        enclosing one's): MariaDB compares them by two collations (or character sets), so
        not there; PostgreSQL compares them in byte order (the caller adds COLLATE "C")."""
        if not (self.tables and _is_text(t)):
            return False
        owners = {c.source for e in exprs for c in e.columns()}
        if len(owners) < 2:
            return False
        if self.src.mysql or not self.pg:
            raise NotTranslatable(
                f"text of two tables compared by the server's collations: {exprs}"
            )
        return True

    def compare(self, op: str, left: Expr, right: Expr) -> Any:
        (a, ta), (b, tb) = self.value(left), self.value(right)
        _check_types(ta, tb, left, right)
        if ta is None or tb is None:  # comparison with null: unknown (so is its negation)
            return _UNKNOWN
        if self._two_tables(ta, left, right):
            fn = {"=": "__eq__", "!=": "__ne__", "<": "__lt__"}.get(op)
            cmp = {"<=": "__le__", ">": "__gt__", ">=": "__ge__"}
            return getattr(a.collate("C"), fn or cmp[op])(b.collate("C"))
        fn = {
            "=": "__eq__",
            "!=": "__ne__",
            "<": "__lt__",
            "<=": "__le__",
            ">": "__gt__",
            ">=": "__ge__",
        }[op]
        self._text_ok(ta)
        if _is_text(ta) and self.pg and op not in ("=", "!="):
            # every side that is not a constant, a column or an expression over one
            # (substring(name, 1, 2) < 'b' compares in name's collation, en-x-icu: 'a' < 'B')
            return getattr(a if is_constant(left) else a.collate("C"), fn)(
                b if is_constant(right) else b.collate("C")
            )
        if not (_is_text(ta) and self.src.mysql):
            return getattr(a, fn)(b)
        exact = getattr(self._binary(a, ta), fn)(self._binary(b, tb))
        if op == "=":  # the collation-aware test can use an index; the binary one makes it exact
            return sa.and_(a == b, exact)
        return exact

    def go(self, e: Expr) -> Any:
        if is_constant(e):
            if self.probe and e.params():
                return sa.true()
            v = eval_constant(e, self.params, self.now)
            if v is None:  # unknown: never true, nor is its negation
                return _UNKNOWN
            if not isinstance(v, bool):
                raise NotTranslatable(f"a constant filter must be true or false: {e}")
            return sa.true() if v else sa.false()
        if isinstance(e, Binary) and e.op in ("and", "or"):
            a, b = self.go(e.left), self.go(e.right)
            return sa.and_(a, b) if e.op == "and" else sa.or_(a, b)
        if isinstance(e, Unary) and e.op == "not":
            return sa.not_(self.go(e.operand))
        if isinstance(e, Binary) and e.op in _CMP:
            return self.compare(e.op, e.left, e.right)
        if isinstance(e, IsNull):
            a, _ = self.value(e.expr)
            return a.is_not(None) if e.negated else a.is_(None)
        if isinstance(e, Between):
            r = sa.and_(self.compare(">=", e.expr, e.low), self.compare("<=", e.expr, e.high))
            return sa.not_(r) if e.negated else r
        if isinstance(e, InList):
            return self._in(e)
        if isinstance(e, Like):
            return self._like(e)
        if isinstance(e, ExistsIn):
            return self._exists(e)
        if isinstance(e, Column):
            v, t = self.value(e)
            if t == pa.bool_():
                return v == sa.true()
        raise NotTranslatable(f"cannot translate {e} to a SQL condition")

    def _exists(self, e: ExistsIn) -> Any:
        """``EXISTS (SELECT 1 FROM <table> AS <alias> WHERE ...)`` over a table of this
        connection, correlated with the enclosing table (an alias of its own, so a table
        tested against itself, lineitem l1 vs l2, is two)."""
        if e.alias in self.tables:
            raise NotTranslatable(f"exists inside an exists over {e.alias}")
        other = self.src.peer(e.uri)
        self._correlation_ok(e, other)
        table = other.table.alias(f"__x_{e.alias}")
        self.tables[e.alias] = (other, table)
        try:
            cond = self.go(e.where)
        finally:
            del self.tables[e.alias]
        sub: sa.Select[Any] = sa.select(sa.literal_column("1")).select_from(table).where(cond)
        return sub.correlate(self.src.table).exists()

    def _correlation_ok(self, e: ExistsIn, other: SqlSource) -> None:
        """Raise NotTranslatable unless the server evaluates the exists as a semi-join, not
        row by row: some top-level ``other.col = <enclosing columns>``; on MariaDB / MySQL
        also either only such equalities reach the enclosing table (EXISTS-to-IN: a
        materialized lookup) or the equated column leads an index of ``other`` (a lookup
        per row). Else MariaDB scans ``other`` once per enclosing row (100k x 150k rows
        with ``x.k = a.k AND x.id <> a.id`` and no index on ``k``: past 20 s, 0.4 s with
        it), and the fabric's own evaluation is the better one."""
        keyed: list[str] = []
        other_refs = False
        for c in conjuncts(e.where):
            if not any(col.source is None for col in c.columns()):
                continue  # the other table's own condition
            found = None
            if isinstance(c, Binary) and c.op == "=":
                for a, b in ((c.left, c.right), (c.right, c.left)):
                    if (
                        isinstance(a, Column)
                        and a.source == e.alias
                        and all(col.source is None for col in b.columns())
                    ):
                        found = a.name
                        break
            if found is None:
                other_refs = True
            else:
                keyed.append(found)
        if not keyed:
            raise NotTranslatable(f"no equality with the enclosing table's columns: {e}")
        if self.src.mysql and other_refs and not any(other.leads_index(n) for n in keyed):
            raise NotTranslatable(
                f"MariaDB / MySQL would run this exists once per row: no index of "
                f"{other.uri} starts with {', '.join(keyed)}"
            )

    def _in(self, e: InList) -> Any:
        a, ta = self.value(e.expr)
        if ta is None:
            raise NotTranslatable(f"'in' on a null: {e}")
        if (
            self.tables
            and not isinstance(e.items, Param)
            and self._two_tables(ta, e.expr, *e.items)
        ):
            raise NotTranslatable(f"'in' of text from two tables: {e}")
        self._text_ok(ta)
        if isinstance(e.items, Param):
            if self.probe:
                return a.in_(sa.bindparam(None, [], expanding=True))
            if e.items.name not in self.params:
                raise KeyError(e.items.name)
            values = list(self.params[e.items.name])
            if any(isinstance(v, dict | list | tuple | set) for v in values):
                raise NotTranslatable("'in' list of objects")
            values = [self._plain(v) for v in values]
            nulls = any(v is None for v in values)
            values = [v for v in values if v is not None]
            array = _pg_array(ta) if self.pg else None
            if array is not None:
                # one array parameter: x = ANY($1) (a dynamic filter's 6,338 part keys of
                # TPC-H Q14: 96-131 ms, against 414-904 ms as 6,338 IN placeholders)
                r = a == sa.any_(sa.bindparam(None, values, type_=pg_types.ARRAY(array)))
                return _in_result(r, e.negated, nulls)
            if (
                self.src.mysql
                and len(values) > JSON_KEYS
                and pa.types.is_integer(ta)
                and self.src.conn.json_table()
                and all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in values)
            ):
                # one JSON parameter: x IN (SELECT k FROM JSON_TABLE(...)) (TPC-H Q9's
                # 29,020 order keys: ~0.5 s against 1.6-2.8 s as 29,020 IN placeholders)
                name = f"__json_keys_{next(_json_ids)}"
                keys = (
                    sa.text(
                        f"SELECT k FROM JSON_TABLE(:{name}, '$[*]' COLUMNS(k BIGINT PATH '$')) "
                        f"AS {name}"
                    )
                    .bindparams(sa.bindparam(name, json.dumps(values)))
                    .columns(sa.column("k", sa.BigInteger))
                )
                return _in_result(a.in_(keys), e.negated, nulls)
            bp: Any = sa.bindparam(None, values, expanding=True)
            r = a.in_(bp)
            if _is_text(ta) and self.src.mysql:
                r = sa.and_(r, self._binary(a, ta).in_(sa.bindparam(None, values, expanding=True)))
            return _in_result(r, e.negated, nulls)
        items = [self.value(i) for i in e.items]
        for i, (_, ti) in zip(e.items, items):
            _check_types(ta, ti, e.expr, i)
        nonnull = [v for v, t in items if t is not None]
        if not nonnull:  # x in (null): unknown
            return _UNKNOWN
        if _is_text(ta) and self.src.mysql:
            r = sa.and_(
                a.in_(nonnull),
                self._binary(a, ta).in_([self._binary(v, t) for v, t in items if t is not None]),
            )
        else:
            r = a.in_(nonnull)
        return _in_result(r, e.negated, len(nonnull) < len(items))

    def _text_ok(self, t: pa.DataType | None, like: bool = False) -> None:
        if self.src.generic and _is_text(t) and (like or not self.src.binary_text):
            raise NotTranslatable(
                f"string comparison semantics of {self.src.conn.engine.dialect.name} are not known"
            )

    def _plain(self, v: Any) -> Any:
        if isinstance(v, dt.datetime):
            v = v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v.astimezone(dt.UTC)
            return v.replace(tzinfo=None) if self.src.naive_times else v
        return v

    def _like(self, e: Like) -> Any:
        a, ta = self.value(e.expr)
        p, tp = self.value(e.pattern)
        if not (_is_text(ta) and _is_text(tp)):
            raise NotTranslatable(f"'like' needs strings: {e}")
        if self._two_tables(ta, e.expr, e.pattern):
            raise NotTranslatable(f"'like' of text from two tables: {e}")
        self._text_ok(ta, like=True)
        if e.case_insensitive:
            # the server's lower() folds case by its collation, not as pyarrow and DuckDB
            # do ('%ẞ%' found neither 'ß' nor 'Straße' on the server): the fabric applies it
            raise NotTranslatable(f"'ilike' folds case as the server does: {e}")
        if self.src.mysql:
            r = sa.and_(a.like(p), self._binary(a, ta).op("LIKE", is_comparison=True)(p))
        else:
            r = a.like(p)
        return sa.not_(r) if e.negated else r


#: SQL's unknown: a condition that is neither true nor false (and neither is its negation)
_UNKNOWN = sa.null()


def _in_result(r: Any, negated: bool, nulls: bool) -> Any:
    """``x [not] in (...)`` when the list held nulls (removed from ``r``): a value not
    found is unknown, not false, so that an enclosing ``not`` keeps it unknown (SQL:
    ``not (x in (1, null))`` is never true)."""
    if negated:
        r = sa.not_(r)
        return sa.and_(r, _UNKNOWN) if nulls else r
    return sa.or_(r, _UNKNOWN) if nulls else r


JSON_KEYS = 5000  # longer integer key lists go to MariaDB / MySQL as one JSON parameter
# (interleaved TPC-H A/B: 15-29k keys 0.69-0.81x the wall time; 3-5k keys 1.11-1.17x)
_json_ids = itertools.count()


def _pg_array(t: pa.DataType | None) -> Any:
    """The element type of a PostgreSQL array parameter for a list compared with a column
    of Arrow type ``t`` (integers, text, dates); None: bind the list as IN placeholders."""
    if t is None or t is _ANY:
        return None
    if pa.types.is_integer(t):
        return sa.BigInteger()
    if _is_text(t):
        return sa.Text()
    if pa.types.is_date(t):
        return sa.Date()
    return None


def _exact_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_decimal(t)


def _numeric(t: pa.DataType | None) -> bool:
    if t is _ANY:
        return True
    return t is not None and (
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
    )


def _family(t: pa.DataType) -> str:
    if _numeric(t):
        return "number"
    if _is_text(t):
        return "text"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    return str(t)


def _check_types(ta: pa.DataType | None, tb: pa.DataType | None, left: Expr, right: Expr) -> None:
    if ta is None or tb is None or ta is _ANY or tb is _ANY:
        return
    if _family(ta) != _family(tb):
        raise NotTranslatable(f"comparing {ta} with {tb}: {left} vs {right}")


#: errors of reaching the server (MariaDB Connector/C says a lost connection with an
#: InterfaceError where PyMySQL says OperationalError)
_CONNECTIVITY = (
    sa_exc.OperationalError
    | sa_exc.InterfaceError
    | sa_exc.DisconnectionError
    | sa_exc.TimeoutError
)


class SqlConnection(Connection):
    """A database reachable through one SQLAlchemy URL; tables are its objects."""

    kind = "sql"

    def __init__(self, name: str, options: Mapping[str, Any]):
        options = flat_options(options, {"query_timeout": "read_timeout"})
        super().__init__(name, options)
        if not options.get("url"):
            raise ValueError(
                f"connection {name!r}: a SQL connection needs 'url' (e.g. mysql+pymysql://user:pw@host:3306/db)"
            )
        self.url = sql_drivers.choose(make_url(str(options["url"])), options.get("driver"))
        self.connect_timeout = float(options.get("connect_timeout", 5))
        self.read_timeout = float(options.get("read_timeout", 30))
        self.db_schema = options.get("schema")
        self._engine: Engine | None = None
        self._json_table: bool | None = None
        self._lock = threading.Lock()
        self._tables: dict[str, sa.Table] = {}

    @property
    def scheme(self) -> str:
        return (
            "mysql"
            if self.url.get_backend_name() in ("mysql", "mariadb")
            else ("postgres" if self.url.get_backend_name() == "postgresql" else "sql")
        )

    def uri(self, obj: str = "") -> str:
        return f"{self.options.get('kind', self.scheme)}://{self.name}/{obj}"

    @property
    def engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                self._engine = sa.create_engine(
                    self.url,
                    pool_size=int(self.options.get("pool_size", 5)),
                    max_overflow=int(self.options.get("max_overflow", 5)),
                    pool_recycle=int(self.options.get("pool_recycle", 1800)),
                    pool_timeout=self.connect_timeout,
                    # PyMySQL and Connector/C: our own pre-ping, bounded by connect_timeout
                    pool_pre_ping=not self._pymysql
                    and self.url.get_driver_name() != "mariadbconnector",
                    connect_args=self._connect_args(),
                )
                sql_drivers.prepare_engine(self._engine, self.connect_timeout)
                if self._pymysql:
                    sa.event.listen(self._engine, "connect", self._after_connect)
                    sa.event.listen(self._engine, "checkout", self._ping)
            return self._engine

    def json_table(self) -> bool:
        """Whether the server has JSON_TABLE (MariaDB 10.6, MySQL 8.0.4 and later); asked
        once, when a long key list is first sent."""
        if self._json_table is None:
            try:
                d = self.engine.dialect
                if d.server_version_info is None:
                    with self.engine.connect():
                        pass  # the dialect learns the version on the first connection
                v = tuple(d.server_version_info or ())
                mariadb = bool(getattr(d, "is_mariadb", False))
                self._json_table = v >= ((10, 6) if mariadb else (8, 0, 4))
            except Exception:  # unknown: the plain IN list works everywhere
                self._json_table = False
        return self._json_table

    @property
    def _pymysql(self) -> bool:
        return (
            self.url.get_backend_name() in ("mysql", "mariadb")
            and self.url.get_driver_name() == "pymysql"
        )

    def _ping(self, dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        """Pessimistic disconnect handling for PyMySQL, like ``pool_pre_ping`` but waiting
        at most ``connect_timeout`` (not ``read_timeout``) for the answer: a server that
        stopped answering is noticed in seconds; the pool then tries a new connection once
        (whose handshake is bounded by connect_timeout too) and the scan fails."""
        rt = getattr(dbapi_conn, "_read_timeout", None)
        dbapi_conn._read_timeout = max(1, round(self.connect_timeout))
        try:
            dbapi_conn.ping(reconnect=False)
        except Exception as exc:
            raise sa_exc.DisconnectionError(f"ping failed: {exc}") from exc
        finally:
            dbapi_conn._read_timeout = rt

    def _after_connect(self, dbapi_conn: Any, _record: Any) -> None:
        """PyMySQL reads the handshake with its read timeout: it is opened with the
        connect timeout (so a server that accepts but never answers fails a reconnect after
        connect_timeout, not read_timeout again), then given the read timeout here."""
        rt = max(1, round(self.read_timeout))
        if hasattr(dbapi_conn, "_read_timeout"):
            dbapi_conn._read_timeout = rt
            dbapi_conn._write_timeout = rt

    def _connect_args(self) -> dict[str, Any]:
        backend, driver = self.url.get_backend_name(), self.url.get_driver_name()
        ct, rt = max(1, round(self.connect_timeout)), max(1, round(self.read_timeout))
        if backend in ("mysql", "mariadb") and driver in ("pymysql", "mysqldb"):
            return {
                "connect_timeout": ct,
                # the handshake; the read timeout is set once connected (_after_connect)
                "read_timeout": ct if driver == "pymysql" else rt,
                "write_timeout": ct if driver == "pymysql" else rt,
                "init_command": "SET time_zone = '+00:00'",
            }
        if backend in ("mysql", "mariadb") and driver == "mariadbconnector":
            return {
                "connect_timeout": ct,
                "read_timeout": rt,
                "write_timeout": rt,
                "init_command": "SET time_zone = '+00:00'",
            }
        if backend == "postgresql":
            return {
                "connect_timeout": ct,
                "options": f"-c timezone=UTC -c statement_timeout={rt * 1000}",
            }
        return {}

    def _error(self, exc: BaseException, obj: str = "") -> SourceError:
        orig = getattr(exc, "orig", None) or exc
        limits = (
            f" (connect timeout {self.connect_timeout:g} s, read timeout {self.read_timeout:g} s)"
            if isinstance(exc, _CONNECTIVITY | TimeoutError)
            else ""
        )
        return SourceError(
            self.uri(obj),
            f"{type(orig).__name__}: {str(orig).strip().splitlines()[0] if str(orig).strip() else orig!r}"
            + limits,
            hint=self._hint(exc),
            retriable=isinstance(exc, _CONNECTIVITY),
        )

    def _hint(self, exc: BaseException) -> str:
        if isinstance(exc, _CONNECTIVITY | TimeoutError) or not isinstance(exc, sa_exc.DBAPIError):
            where = self.url.render_as_string(hide_password=True)
            return f"check that the database at {where} is running and reachable"
        if isinstance(exc, sa_exc.DataError):  # the server is up; a value did not fit
            return (
                "the server computed a value that does not fit its type (a sum or cast past "
                "the column type's range?); check the data, or widen the type in a derive:"
            )
        return (
            "the server is up but refused the statement the fabric sent; "
            "explain(analyze=True) shows it on the scan's Sent line"
        )

    # ----------------------------------------------------------------- objects

    def list_objects(self) -> list[str]:
        try:
            insp = sa.inspect(self.engine)
            return sorted(
                set(insp.get_table_names(schema=self.db_schema))
                | set(insp.get_view_names(schema=self.db_schema))
            )
        except sa_exc.SQLAlchemyError as exc:
            raise self._error(exc) from exc

    def ping(self) -> None:
        try:
            with self.engine.connect() as c:
                c.execute(sa.text("SELECT 1"))
        except sa_exc.SQLAlchemyError as exc:
            raise self._error(exc) from exc

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> SqlSource:
        prefix, _, table = obj.rpartition(".")
        schema: str | None = prefix or self.db_schema
        try:
            if obj not in self._tables:
                self._tables[obj] = sa.Table(
                    table, sa.MetaData(), schema=schema, autoload_with=self.engine
                )
        except sa_exc.NoSuchTableError:
            raise UnknownObjectError(self.uri(obj), self.list_objects()) from None
        except sa_exc.SQLAlchemyError as exc:
            raise self._error(exc, obj) from exc
        return SqlSource(self.uri(obj), self, self._tables[obj])

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    # ----------------------------------------------------------------- execution

    def _set_timeout(self, c: sa.Connection, seconds: float | None) -> None:
        if seconds is None:
            return
        d = c.dialect
        if d.name == "postgresql":
            c.execute(
                sa.text("SELECT set_config('statement_timeout', :v, false)"),
                {"v": str(int(seconds * 1000))},
            )
        elif d.name in ("mysql", "mariadb"):
            if getattr(d, "is_mariadb", False):
                c.exec_driver_sql("SET SESSION max_statement_time = %s", (float(seconds),))
            else:
                c.exec_driver_sql("SET SESSION max_execution_time = %s", (int(seconds * 1000),))

    def stream(
        self, src: SqlSource, stmt: sa.Select, schema: pa.Schema, request: ScanRequest
    ) -> Iterator[pa.RecordBatch]:
        """The statement's rows as Arrow batches: the driver's tuples (read straight from
        its cursor, connectors.sql_drivers) become one Arrow column per selected column."""
        size = max(1, int(request.batch_size))
        types = [f.type for f in schema]
        rowtype = pa.struct([pa.field(f"c{i}", t) for i, t in enumerate(types)])
        driver_error = sql_drivers.driver_error(self.engine)
        try:
            with self.engine.connect() as c:
                self._set_timeout(c, request.timeout)
                result = c.execution_options(stream_results=True, yield_per=size).execute(stmt)
                # the text the driver was sent (placeholders; compiled once, SQLAlchemy's cache)
                request.metrics.statement = result.context.statement
                single = [i for i in sql_drivers.single_floats(result) if i < len(types)]
                for rows in sql_drivers.partitions(result, size):
                    arrays = _arrays(rows, types, rowtype)
                    for i in single:
                        if pa.types.is_float64(types[i]):
                            arrays[i] = sql_drivers.shortest(arrays[i])
                    yield pa.RecordBatch.from_arrays(arrays, schema=schema)
        except sa_exc.SQLAlchemyError as exc:
            raise self._error(exc, src.uri.rsplit("/", 1)[-1]) from exc
        except driver_error as exc:  # raised while reading the cursor, not wrapped
            wrapped = sa_exc.DBAPIError.instance(None, None, exc, driver_error)  # type: ignore[arg-type]
            raise self._error(wrapped, src.uri.rsplit("/", 1)[-1]) from exc

    def table_statistics(self, src: SqlSource) -> Statistics:
        """Row estimate and sizes from the catalog; min/max of indexed leading columns."""
        t = src.table
        rows = size = None
        distinct: dict[str, int] = {}
        with self.engine.connect() as c:
            d = c.dialect.name
            if d in ("mysql", "mariadb"):
                r = c.execute(
                    sa.text(
                        "SELECT table_rows, data_length + index_length FROM information_schema.tables "
                        "WHERE table_schema = COALESCE(:s, DATABASE()) AND table_name = :t"
                    ),
                    {"s": t.schema, "t": t.name},
                ).first()
                if r:
                    rows, size = r[0], r[1]
                for name, card in c.execute(
                    sa.text(
                        "SELECT column_name, MAX(cardinality) FROM information_schema.statistics "
                        "WHERE table_schema = COALESCE(:s, DATABASE()) AND table_name = :t AND seq_in_index = 1 "
                        "GROUP BY column_name"
                    ),
                    {"s": t.schema, "t": t.name},
                ):
                    if card is not None:
                        distinct[name] = int(card)
            elif d == "postgresql":
                r = c.execute(
                    sa.text(
                        "SELECT c.reltuples, pg_total_relation_size(c.oid), s.n_live_tup FROM pg_class c "
                        "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
                        "WHERE c.oid = to_regclass(:q)"
                    ),
                    {"q": f"{t.schema}.{t.name}" if t.schema else t.name},
                ).first()
                if r:
                    rows = max(int(r[0] or 0), int(r[2] or 0))  # reltuples is -1/0 before ANALYZE
                    size = r[1]
                for name, nd in c.execute(
                    sa.text(  # same schema as the table: a namesake elsewhere must not count
                        "SELECT attname, n_distinct FROM pg_stats "
                        "WHERE tablename = :t AND schemaname = coalesce(:s, current_schema())"
                    ),
                    {"t": t.name, "s": t.schema},
                ):
                    if nd is not None and rows:
                        distinct[name] = int(nd if nd > 0 else -nd * rows)
            exact = False
            if not rows and (size is None or size < 16 << 20):  # no estimate yet; counting is cheap
                rows, exact = (
                    c.execute(sa.select(sa.func.count()).select_from(t)).scalar_one(),
                    True,
                )
            indexed = {next(iter(ix.columns)).name for ix in t.indexes if ix.columns} | {
                c.name for c in list(t.primary_key.columns)[:1]
            }
            cols: dict[str, ColumnStats] = {}
            for name in sorted(indexed):
                col = t.c[name]
                typ = src._schema.field(name).type
                if _numeric(typ) or pa.types.is_timestamp(typ) or pa.types.is_date(typ):
                    lo, hi = c.execute(sa.select(sa.func.min(col), sa.func.max(col))).one()
                    if pa.types.is_timestamp(typ):
                        lo, hi = (
                            x.replace(tzinfo=dt.UTC)
                            if isinstance(x, dt.datetime) and x.tzinfo is None
                            else x
                            for x in (lo, hi)
                        )
                    cols[name] = ColumnStats(distinct_count=distinct.get(name), min=lo, max=hi)
            if d in ("mysql", "mariadb") and rows:
                small = _small_domains(c, src, set(), int(rows))
                for name, n in small.items():  # the sample saw the whole (small) domain
                    # InnoDB's index estimate of a small domain is off both ways (TPC-H
                    # c_nationkey: 50 for 25); one far above the sample's is kept (the
                    # sample's first rows may not show a column that follows the key)
                    if name not in distinct or distinct[name] <= 4 * n:
                        distinct[name] = n
                        if name in cols:
                            cols[name] = ColumnStats(
                                distinct_count=n, min=cols[name].min, max=cols[name].max
                            )
                if size is not None and size <= MINMAX_BYTES:
                    for name, (lo, hi) in _min_max(c, src, set(cols)).items():
                        cols[name] = ColumnStats(distinct_count=distinct.get(name), min=lo, max=hi)
            for name, n in distinct.items():
                cols.setdefault(name, ColumnStats(distinct_count=n))
        return Statistics(
            row_count=None if rows is None else int(rows),
            exact=exact,
            total_bytes=None if size is None else int(size),
            columns=cols,
        )


SAMPLE_ROWS = 10_000
MINMAX_BYTES = 64 << 20  # MariaDB tables up to this size get min/max of every column


def _min_max(c: Any, src: SqlSource, known: set[str]) -> dict[str, tuple[Any, Any]]:
    """Min and max of the number, date and zoned-or-not timestamp columns MariaDB keeps
    no statistics for (only indexed columns get theirs above), in one pass over a small
    table: without them a range on ``o_orderdate`` has no width estimate (TPC-H Q10's
    quarter: 13,356 orders estimated for 5,677)."""
    names = [
        f.name
        for f in src._schema
        if f.name not in known
        and (_numeric(f.type) or pa.types.is_date(f.type) or pa.types.is_timestamp(f.type))
    ]
    if not names:
        return {}
    t = src.table
    try:
        got = c.execute(
            sa.select(*[g(t.c[n]) for n in names for g in (sa.func.min, sa.func.max)])
        ).one()
    except sa_exc.SQLAlchemyError:
        return {}
    out: dict[str, tuple[Any, Any]] = {}
    for i, n in enumerate(names):
        lo, hi = got[2 * i], got[2 * i + 1]
        if lo is None or hi is None:
            continue
        if pa.types.is_timestamp(src._schema.field(n).type):
            lo, hi = (
                x.replace(tzinfo=dt.UTC) if isinstance(x, dt.datetime) and x.tzinfo is None else x
                for x in (lo, hi)
            )
        out[n] = (lo, hi)
    return out


def _small_domains(c: Any, src: SqlSource, known: set[str], rows: int) -> dict[str, int]:
    """Distinct counts of the category-like columns MariaDB keeps no statistics for (it
    counts only indexed columns): one query over the first ``SAMPLE_ROWS`` rows; a column
    counts when its sample holds at most 1 % distinct values (``o_orderstatus``: 3 of
    10,000), where the sample has seen the whole domain. Others stay unknown."""
    names = [
        f.name
        for f in src._schema
        if f.name not in known
        and (
            pa.types.is_string(f.type) or pa.types.is_boolean(f.type) or pa.types.is_integer(f.type)
        )
    ]
    if not names:
        return {}
    # the first rows by primary key: read through a secondary index that covers the
    # columns, the first rows would hold only its smallest values (13 of 25 nations)
    first = sa.select(*[src.table.c[n] for n in names])
    if len(src.table.primary_key.columns):
        first = first.order_by(*src.table.primary_key.columns)
    sample = first.limit(SAMPLE_ROWS).subquery()
    try:
        got = c.execute(
            sa.select(sa.func.count(), *[sa.func.count(sa.distinct(sample.c[n])) for n in names])
        ).one()
    except sa_exc.SQLAlchemyError:
        return {}
    seen, counts = int(got[0]), got[1:]
    if seen < min(rows, SAMPLE_ROWS) // 2:
        return {}
    return {n: int(k) for n, k in zip(names, counts) if k and (seen == rows or k <= seen // 100)}


__all__ = ["BadValueError", "SqlConnection", "SqlSource", "arrow_type"]
