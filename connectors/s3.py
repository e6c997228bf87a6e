"""Files in S3 (``s3`` kind) or a local directory (``file`` kind) through pyarrow datasets.

Connection options, ``s3``: ``endpoint`` (e.g. ``http://127.0.0.1:8333``; omit for AWS),
``bucket`` (required), ``access_key`` / ``secret_key`` (else ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` from the environment), ``region`` (us-east-1),
``connect_timeout`` (5 s), ``request_timeout`` (30 s), ``retries`` (2).
``file``: ``root`` (the directory objects are relative to). Both: ``schemas``
(``{object: {column: type}}``) and ``formats`` (``{object: parquet|csv|json}``).

An object is a path relative to the bucket/root: a file (``categories.csv``), a directory
or prefix (``orders/``: every file below it), or a glob (``orders/*.parquet``, where ``*``
also matches ``/`` so hive directories below are included). The format comes from the
extension (.parquet/.pq, .csv/.tsv, .json/.jsonl/.ndjson) unless declared; directories
named ``key=value`` are hive partitions and become columns.

Every filter pyarrow can evaluate is EXACT: the scanner applies it fully. Before reading,
partition filters drop whole files and Parquet row-group statistics drop row groups; the
counts are in the scan's ``request.metrics`` (files/row groups total and read, rows
returned, ``extra["reader"]``), which ``res.stats`` reports under the source.

Plain Parquet files (no hive partitions, no declared schema, no zoneless timestamps, the
same schema in every file) are decoded by DuckDB's Parquet reader (``connectors/
s3_duckdb.py``: it filters before it decodes the other columns, 2-3x less CPU than
pyarrow on TPC-H lineitem); the filters DuckDB would evaluate differently are applied by
pyarrow to its output. ``parquet_reader: pyarrow`` in the connection turns it off.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.csv
import pyarrow.dataset as ds
from pyarrow import fs as pafs

from connectors import s3_duckdb
from connectors._util import (
    BadValueError,
    apply_locally,
    compared_params,
    flat_options,
    schema_from_spec,
    typed_params,
)
from connectors.arrow_expr import NotTranslatable, param_is_list, to_arrow, utcnow
from connectors.base import (
    Capability,
    ColumnStats,
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
from dsl.ast import Expr, and_all
from dsl.errors import FabricError

_EXT = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".parq": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
}
_GLOB = set("*?[")


def _sample(t: pa.DataType) -> Any:
    """A value of Arrow type ``t`` (0 for types without a sample)."""
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return 0.0
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return ""
    if pa.types.is_boolean(t):
        return False
    if pa.types.is_timestamp(t):
        return dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    if pa.types.is_date(t):
        return dt.date(2000, 1, 1)
    return 0


def probe_params(expr: Expr, schema: pa.Schema) -> dict[str, Any]:
    """Sample session values of the right type for checking a filter before values exist."""
    out: dict[str, Any] = {}
    for c, param, many in compared_params(expr):
        if c.name in schema.names:
            v = _sample(schema.field(c.name).type)
            out[param.name] = [v] if many else v
    for p in expr.params():
        out.setdefault(p, [0] if param_is_list(expr, p) else 0)
    return out


# Samples for a session value that is not compared with a column directly but sits in
# arithmetic (`l_shipdate < {{session.d}} + interval '1 year'`, `date '1998-12-01' -
# {{session.delta}}`): a number, a date, an interval.
_LOOSE_SAMPLES: tuple[Any, ...] = (0, dt.date(2000, 1, 1), dt.timedelta(days=1))


def arrow_filter_ok(expr: Expr, schema: pa.Schema) -> bool:
    """Whether pyarrow can evaluate ``expr`` over ``schema`` (checked on an empty table).
    Session values compared with a column are sampled with that column's type; the others
    (inside arithmetic) are tried as a number, a date and an interval."""
    if any(
        c.name not in schema.names and c.name.split(".")[0] not in schema.names
        for c in expr.columns()
    ):
        return False
    typed = probe_params(expr, schema)
    loose = [p for p in expr.params() if p not in {q.name for _, q, _ in compared_params(expr)}]
    for sample in _LOOSE_SAMPLES if loose else (None,):
        params = {**typed, **{p: sample for p in loose if not param_is_list(expr, p)}}
        try:
            e = to_arrow(expr, params, now=utcnow(), schema=schema)
            schema.empty_table().filter(e)
            return True
        except (NotTranslatable, KeyError, TypeError, ValueError, pa.ArrowException):
            continue
    return False


class S3Source(Source):
    capabilities = frozenset({Capability.PROJECTION, Capability.LIMIT, Capability.AGGREGATE})

    def __init__(self, uri: str, conn: S3Connection, obj: str, options: Mapping[str, Any]):
        super().__init__(uri)
        self.conn = conn
        self.obj = obj
        self.options = dict(options)
        self._files: list[pafs.FileInfo] = []
        self._dataset: ds.FileSystemDataset | None = None
        self._stats: Statistics | None = None
        self._naive_ts: set[str] = set()
        self._peers: dict[str, S3Source] = {}  # the object sets of this connection's exists
        self.refresh()

    # ----------------------------------------------------------------- files

    def _list(self) -> tuple[list[pafs.FileInfo], str]:
        path = self.conn.path(self.obj)
        fs = self.conn.fs
        parts = path.split("/")
        first_glob = next((i for i, p in enumerate(parts) if _GLOB & set(p)), None)
        if first_glob is None:
            info = fs.get_file_info(path.rstrip("/"))
            if info.type == pafs.FileType.File:
                return [info], os.path.dirname(path.rstrip("/"))
            if info.type == pafs.FileType.NotFound:
                return [], path
            base = path.rstrip("/")
            pattern = None
        else:
            base = "/".join(parts[:first_glob])
            pattern = path
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        files = []
        for i in infos:
            if i.type != pafs.FileType.File:
                continue
            rel = i.path[len(base) :].lstrip("/")
            if any(seg.startswith(("_", ".")) for seg in rel.split("/")):
                continue
            if pattern is None or fnmatch.fnmatchcase(i.path, pattern):
                files.append(i)
        files.sort(key=lambda i: i.path)
        return files, base

    def _format(self, files: list[pafs.FileInfo]) -> str:
        declared = self.options.get("format")
        if declared:
            if declared not in ("parquet", "csv", "json"):
                raise ValueError(
                    f"{self.uri}: unknown format {declared!r}; use parquet, csv or json"
                )
            return declared
        kinds = {_EXT.get(os.path.splitext(f.path)[1].lower()) for f in files}
        if None in kinds or len(kinds) != 1:
            exts = sorted({os.path.splitext(f.path)[1] or "(none)" for f in files})
            raise ValueError(
                f"{self.uri}: cannot tell the file format from the extensions {', '.join(exts)}; "
                "declare it (formats: {<object>: parquet|csv|json} in the connection)"
            )
        return kinds.pop()  # type: ignore[return-value]

    def refresh(self) -> None:
        """List the objects again and rebuild the dataset if they changed."""
        try:
            files, base = self._list()
        except (OSError, pa.ArrowException) as exc:
            raise self.conn.error(exc, self.obj) from exc
        self.conn.check_inside(self.obj, files)
        if not files:
            raise UnknownObjectError(self.uri, self.conn.list_objects())
        key = [(f.path, f.size, f.mtime) for f in files]
        if self._dataset is not None and key == [(f.path, f.size, f.mtime) for f in self._files]:
            return
        self.format = self._format(files)
        fmt: ds.FileFormat
        if self.format == "parquet":
            fmt = ds.ParquetFileFormat()
        elif self.format == "csv":
            delim = "\t" if files[0].path.endswith(".tsv") else self.options.get("delimiter", ",")
            fmt = ds.CsvFileFormat(
                parse_options=pa.csv.ParseOptions(delimiter=delim),
                convert_options=pa.csv.ConvertOptions(
                    strings_can_be_null=True
                ),  # empty field = null
            )
        else:
            fmt = ds.JsonFileFormat()
        hive = any("=" in seg for f in files for seg in f.path[len(base) :].split("/")[:-1])
        declared = self.options.get("schema")
        try:

            def make(schema: pa.Schema | None = None) -> ds.FileSystemDataset:
                return ds.dataset(
                    [f.path for f in files],
                    schema=schema,
                    filesystem=self.conn.fs,
                    format=fmt,
                    partitioning=ds.HivePartitioning.discover(infer_dictionary=False)
                    if hive
                    else None,
                    partition_base_dir=base if hive else None,
                )

            dataset = make()
            if declared:
                want = schema_from_spec(declared)
                fields = [
                    want.field(n) if n in want.names else dataset.schema.field(n)
                    for n in dataset.schema.names
                ]
                fields += [f for f in want if f.name not in dataset.schema.names]
                dataset = make(pa.schema(fields))  # files are read (and converted) into it
            naive = [
                f for f in dataset.schema if pa.types.is_timestamp(f.type) and f.type.tz is None
            ]
            self._naive_ts = {f.name for f in naive}
            if naive:  # times without a zone are UTC, as everywhere in the fabric
                dataset = make(
                    pa.schema(
                        [
                            f.with_type(pa.timestamp(f.type.unit, tz="UTC")) if f in naive else f
                            for f in dataset.schema
                        ]
                    )
                )
        except (OSError, pa.ArrowException) as exc:
            raise self.conn.error(exc, self.obj) from exc
        self._files, self._dataset, self._stats, self._fmt = files, dataset, None, fmt
        # DuckDB decodes plain Parquet files (the same schema in every file, read as is)
        self._duck: bool | None = (
            None
            if self.format == "parquet"
            and not hive
            and not declared
            and not naive
            and all(s3_duckdb.plain_path(f.path) for f in files)
            else False
        )

    @property
    def dataset(self) -> ds.FileSystemDataset:
        assert self._dataset is not None
        return self._dataset

    # ----------------------------------------------------------------- planning view

    def schema(self) -> pa.Schema:
        return self.dataset.schema

    def supports_filter(self, expr: Expr) -> Pushdown:
        if s3_duckdb.has_exists(expr):
            return Pushdown.EXACT if self._exists_ok(expr) else Pushdown.UNSUPPORTED
        return Pushdown.EXACT if arrow_filter_ok(expr, self.schema()) else Pushdown.UNSUPPORTED

    # ----------------------------------------------------------------- exists

    def peer(self, uri: str) -> S3Source:
        """The source of ``uri`` when it is an object set of this source's connection;
        raises NotTranslatable."""
        obj = uri.partition("://")[2].partition("/")[2]
        if not obj or uri != self.conn.uri(obj):
            raise NotTranslatable(f"{uri} is not an object set of {self.conn.uri()}")
        if uri not in self._peers:
            try:
                self._peers[uri] = self.conn.source(obj)
            except (FabricError, OSError, pa.ArrowException) as exc:
                raise NotTranslatable(str(exc)) from None
        return self._peers[uri]

    def _duck_files_ok(self) -> bool:
        """Whether every scan of these files goes through DuckDB's reader."""
        return (
            self.conn.parquet_reader == "duckdb"
            and self.format == "parquet"
            and self._duck is not False
            and self._duck_ok([])
        )

    def _exists_ok(self, expr: Expr) -> bool:
        """An ``ExistsIn`` (``fabric.optimizer.push_exists``) is EXACT when these files and
        the other set's are read by DuckDB (plain Parquet of one schema, reader duckdb) and
        all of ``expr`` is in the subset DuckDB evaluates as the fabric would
        (``s3_duckdb.Filters``). Otherwise the fabric evaluates it, as before."""
        if not self._duck_files_ok():
            return False

        def probe(uri: str) -> tuple[pa.Schema, list[str]]:
            other = self.peer(uri)
            if not other._duck_files_ok():
                raise NotTranslatable(f"{uri} is not read by DuckDB")
            return other.schema(), ["probe"]

        tr = s3_duckdb.Filters(self.schema(), probe_params(expr, self.schema()), utcnow(), probe)
        try:
            tr.sql(expr)
        except (NotTranslatable, KeyError, TypeError, ValueError):
            return False
        return True

    def _peer_files(self, uri: str) -> tuple[pa.Schema, list[str]]:
        """The schema and files (as DuckDB reads them) of an ``ExistsIn``'s object set,
        listed now like the scan's own."""
        other = self.peer(uri)
        other.refresh()
        if not other._duck_files_ok():
            raise NotTranslatable(f"{uri} is not read by DuckDB")
        paths = [f.path for f in other.dataset.get_fragments()]
        files = self.conn.duck_files()
        if files is None:
            return other.schema(), paths
        files.know(other._files)
        return other.schema(), [files.url(p) for p in paths]

    def supports_aggregate(self, agg: Any, schema: pa.Schema | None = None) -> bool:
        """Every aggregation the optimizer pushes (``push_aggregate``): Parquet read by
        DuckDB groups in the reading query; otherwise the rows read are aggregated by
        the same DuckDB SQL here (``fabric.execute.sql.run_aggregate``)."""
        return True

    def statistics(self) -> Statistics:
        if self._stats is None:
            self._stats = self._compute_stats()
        return self._stats

    def _compute_stats(self) -> Statistics:
        size = sum(f.size or 0 for f in self._files)
        if self.format != "parquet":
            return Statistics(row_count=None, exact=False, total_bytes=size)
        rows = 0
        acc: dict[str, list[Any]] = {}  # column -> [min, max, null count, min/max known]
        try:
            for frag in self.dataset.get_fragments():
                md = frag.metadata
                rows += md.num_rows
                for g in range(md.num_row_groups):
                    rg = md.row_group(g)
                    for c in range(rg.num_columns):
                        col = rg.column(c)
                        st = col.statistics
                        a = acc.setdefault(col.path_in_schema, [None, None, 0, True])
                        if st is None or not st.has_min_max:
                            a[3] = False
                            continue
                        a[2] += st.null_count if st.has_null_count else 0
                        try:
                            a[0] = st.min if a[0] is None else min(a[0], st.min)
                            a[1] = st.max if a[1] is None else max(a[1], st.max)
                        except TypeError:
                            a[3] = False
        except (OSError, pa.ArrowException) as exc:
            raise self.conn.error(exc, self.obj) from exc
        names = set(self.schema().names)
        cols = {
            n: ColumnStats(
                null_count=a[2], min=_utc(a[0]) if a[3] else None, max=_utc(a[1]) if a[3] else None
            )
            for n, a in acc.items()
            if n in names
        }
        return Statistics(row_count=rows, exact=True, total_bytes=size, columns=cols)

    def watermark(self) -> Watermark:
        newest = max(
            (f.mtime.timestamp() for f in self._files if f.mtime is not None), default=None
        )
        return Watermark(
            event_time=newest,
            detail={"kind": "newest object modification time", "files": len(self._files)},
        )

    # ----------------------------------------------------------------- scan

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        if request.aggregate is not None:
            yield from self._aggregated(request)
            return
        yield from self._rows(request)

    def _aggregated(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        """The request's aggregate: in DuckDB's reading query when it evaluates every
        filter, else over the rows read (the same SQL, ``run_aggregate``)."""
        from fabric.execute.sql import run_aggregate

        done: dict[str, bool] = {}
        batches = list(self._rows(request, done))
        if done.get("grouped"):
            yield from batches
            return
        schema = self.schema()
        cols = list(request.columns or schema.names)
        rows = (
            pa.Table.from_batches(batches).select(cols)
            if batches
            else pa.schema([schema.field(c) for c in cols]).empty_table()
        )
        params = typed_params(request.filters, request.params, schema, self.uri)
        table = run_aggregate(rows, request.aggregate, params, utcnow())
        request.metrics.rows = table.num_rows
        yield from table.to_batches() or [pa.RecordBatch.from_pylist([], schema=table.schema)]

    def _rows(
        self, request: ScanRequest, done: dict[str, bool] | None = None
    ) -> Iterator[pa.RecordBatch]:
        self.refresh()
        schema = self.schema()
        cols = list(request.columns) if request.columns is not None else schema.names
        check_columns(self.uri, cols, schema.names)
        # an exists over another object set: only DuckDB's reading query evaluates it
        exists = [f for f in request.filters if s3_duckdb.has_exists(f)]
        plain = [f for f in request.filters if f not in exists]
        params = typed_params(plain, request.params, schema, self.uri)
        # Filters on zoneless file timestamps (read as UTC) cannot use the files' statistics:
        # pyarrow would compare them with the raw column. They run on the scanned batches.
        post = [f for f in plain if {c.name for c in f.columns()} & self._naive_ts]
        # Filters on float columns of Parquet files neither: the statistics leave NaN out
        # of a row group's min / max, and pyarrow pruned (or, min = max = 1.0, rewrote
        # v to 1.0) the group of [0.5, NaN, 2.0] for not (v < 3), dropping the NaN row.
        # One that no NaN passes (v < 3, v = 2, v between 1 and 2) may still prune.
        floats = {f.name for f in schema if pa.types.is_floating(f.type)}
        prune = []
        if self.format == "parquet" and floats:
            for f in plain:
                if f not in post and {c.name for c in f.columns()} & floats:
                    post.append(f)
                    if _false_for_nan(f, floats, params):
                        prune.append(f)
        pred = and_all([f for f in plain if f not in post] + prune)
        expr = to_arrow(pred, params, now=utcnow(), schema=schema) if pred is not None else None
        read = list(dict.fromkeys([*cols, *sorted(c.name for f in post for c in f.columns())]))
        stats = request.metrics  # this scan's own: the source is shared by concurrent queries
        stats.extra["reader"] = "pyarrow"
        stats.files_total, stats.files_read, stats.rows = len(self._files), 0, 0
        if self.format == "parquet":
            stats.row_groups_total = stats.row_groups_read = 0
        try:
            frags = (
                list(self.dataset.get_fragments(filter=expr))
                if expr is not None
                else list(self.dataset.get_fragments())
            )
            stats.files_read = len(frags)
            if self.format == "parquet":
                pieces = []
                for f in frags:
                    pieces.extend(_row_groups(f, expr, schema))
                stats.row_groups_total = sum(f.metadata.num_row_groups for f in frags)
                stats.row_groups_read = len(pieces)
                if frags and self._duck_ok(frags):
                    yield from self._duck_scan(frags, cols, request, params, stats, done)
                    return
                frags = pieces
            if exists and frags:
                raise SourceError(
                    self.uri,
                    f"an exists over another object set ({exists[0]}) is evaluated only by "
                    "DuckDB's Parquet reader, and these files are read by pyarrow",
                    hint="set parquet_reader: duckdb on the connection (the default)",
                )
            target = ds.FileSystemDataset(
                frags, schema=schema, format=self._fmt, filesystem=self.conn.fs
            )
            scanner = target.scanner(columns=read, filter=expr, batch_size=request.batch_size)
            left = request.limit
            if left is not None and left <= 0:
                yield pa.RecordBatch.from_pylist(
                    [], schema=pa.schema([schema.field(c) for c in cols])
                )
                return
            batches: Iterator[pa.RecordBatch] = scanner.to_batches()
            if post:
                batches = apply_locally(batches, post, params, None, cols)
            for b in batches:
                if left is not None:
                    b = b.slice(0, left)
                    left -= b.num_rows
                stats.rows += b.num_rows
                yield b
                if left is not None and left <= 0:
                    return
        except BadValueError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise self.conn.error(exc, self.obj) from exc

    def _duck_ok(self, frags: list[Any]) -> bool:
        """Whether DuckDB reads these files as pyarrow would: every file has the dataset's
        schema (checked once per listing, from the cached footers)."""
        if self.conn.parquet_reader != "duckdb":
            return False
        if self._duck is None:
            want = self.schema()
            self._duck = all(
                f.physical_schema.remove_metadata() == want.remove_metadata()
                for f in self.dataset.get_fragments()
            )
        return self._duck

    def _duck_scan(
        self,
        frags: list[Any],
        cols: list[str],
        request: ScanRequest,
        params: Mapping[str, Any],
        stats: ScanMetrics,
        done: dict[str, bool] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        stats.extra["reader"] = "duckdb"
        files = self.conn.duck_files()
        if files is None:
            urls = [f.path for f in frags]
        else:
            files.know(self._files)
            urls = [files.url(f.path) for f in frags]
        now = utcnow()
        schema = self.schema()
        try:
            table, left = s3_duckdb.scan(
                urls,
                cols,
                list(request.filters),
                params,
                schema,
                now,
                request.limit,
                request.aggregate if done is not None else None,
                self._peer_files,
            )
        except s3_duckdb.DuckError as exc:  # a read failed: the store, as for pyarrow
            raise self.conn.error(OSError(str(exc).strip()), self.obj) from exc
        if done is not None and request.aggregate is not None and not left:
            done["grouped"] = True  # grouped in the reading query
            stats.rows = table.num_rows
            yield from table.to_batches() or [pa.RecordBatch.from_pylist([], schema=table.schema)]
            return
        if any(s3_duckdb.has_exists(f) for f in left):
            raise SourceError(
                self.uri,
                f"DuckDB cannot evaluate the exists {next(f for f in left if s3_duckdb.has_exists(f))}"
                " over these files as planned (the other object set changed since?)",
                hint="run the query again (it is planned anew)",
            )
        rest = and_all(left)
        if rest is not None:  # the filters DuckDB does not evaluate as pyarrow does
            table = table.filter(to_arrow(rest, params, now=now, schema=schema))
            if request.limit is not None:
                table = table.slice(0, max(request.limit, 0))
        table = table.select(cols)
        stats.rows = table.num_rows
        if table.num_rows == 0:
            yield pa.RecordBatch.from_pylist([], schema=table.schema)
            return
        yield from table.to_batches(max_chunksize=request.batch_size)


def _false_for_nan(e: Expr, floats: set[str], params: Mapping[str, Any]) -> bool:
    """Whether ``e`` is a float column's comparison that no NaN passes (NaN is above every
    number): ``v < c``, ``v <= c``, ``v = c``, ``v between a and b``, ``v in (...)`` with
    constants that are not NaN, so pruning row groups by their range drops no row it keeps."""
    import math

    from connectors.arrow_expr import eval_constant, is_constant
    from dsl.ast import Between, Binary, Column, InList, Param

    def const_ok(x: Any) -> bool:
        if not is_constant(x):
            return False
        try:
            v = eval_constant(x, params)
        except Exception:
            return False
        return not (isinstance(v, float) and math.isnan(v))

    def float_col(x: Any) -> bool:
        return isinstance(x, Column) and x.name in floats

    flip = {"<": ">", "<=": ">=", "=": "=", ">": "<", ">=": "<="}
    if isinstance(e, Binary) and e.op in flip:
        if float_col(e.left) and const_ok(e.right):
            return e.op in ("<", "<=", "=")
        if float_col(e.right) and const_ok(e.left):
            return flip[e.op] in ("<", "<=", "=")
        return False
    if isinstance(e, Between) and not e.negated:
        return float_col(e.expr) and const_ok(e.low) and const_ok(e.high)
    if isinstance(e, InList) and not e.negated and float_col(e.expr):
        if isinstance(e.items, Param):
            values = list(params.get(e.items.name) or [])
            return all(not (isinstance(v, float) and math.isnan(v)) for v in values)
        return all(const_ok(i) for i in e.items)
    return False


def _utc(v: Any) -> Any:
    return v.replace(tzinfo=dt.UTC) if isinstance(v, dt.datetime) and v.tzinfo is None else v


def _row_groups(frag: Any, expr: Any, schema: pa.Schema) -> list[Any]:
    """The row groups of a Parquet file whose statistics may match ``expr`` (all of them
    when the statistics cannot be compared, e.g. a zoneless timestamp read as UTC)."""
    if expr is None:
        return list(frag.split_by_row_group())
    try:
        return list(frag.split_by_row_group(filter=expr, schema=schema))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return list(frag.split_by_row_group())


class S3Connection(Connection):
    kind = "s3"

    def __init__(self, name: str, options: Mapping[str, Any]):
        options = flat_options(options, {"query_timeout": "request_timeout"})
        super().__init__(name, options)
        self.local = options.get("kind") == "file"
        if self.local:
            if not options.get("root"):
                raise ValueError(
                    f"connection {name!r}: a file connection needs 'root' (a directory)"
                )
            self.base = os.path.abspath(str(options["root"]))
        else:
            if not options.get("bucket"):
                raise ValueError(f"connection {name!r}: an s3 connection needs 'bucket'")
            self.base = str(options["bucket"]).strip("/")
        self._fs: pafs.FileSystem | None = None
        self._duck_files: s3_duckdb.ObjectFiles | None = None
        reader = str(options.get("parquet_reader", "duckdb"))
        if reader not in ("duckdb", "pyarrow"):
            raise ValueError(
                f"connection {name!r}: parquet_reader is {reader!r}; use duckdb or pyarrow"
            )
        self.parquet_reader = reader

    def close(self) -> None:
        if self._duck_files is not None:
            self._duck_files.close()
            self._duck_files = None

    def duck_files(self) -> s3_duckdb.ObjectFiles | None:
        """The objects as DuckDB reads them (None for a local root: DuckDB reads the
        files itself)."""
        if self.local:
            return None
        if self._duck_files is None:
            mb = float(self.options.get("cache_mb", 0) or 0)
            self._duck_files = s3_duckdb.ObjectFiles(self.fs, int(mb * 1024 * 1024))
        self._duck_files.register(s3_duckdb._connection())
        return self._duck_files

    def uri(self, obj: str = "") -> str:
        return f"{'file' if self.local else 's3'}://{self.name}/{obj}"

    def path(self, obj: str) -> str:
        """The object's path on the file system: always below the bucket/root (a ``..``
        segment, also URL-encoded or inside a glob, raises SourceError)."""
        for text in {obj, unquote(obj)}:
            if ".." in text.replace("\\", "/").split("/"):
                raise SourceError(
                    self.uri(obj),
                    "an object path may not contain '..' segments: objects are read only "
                    f"below the connection's {'root' if self.local else 'bucket'}",
                    hint="name the object relative to the root (e.g. orders/*.parquet)",
                )
        prefix = str(self.options.get("prefix") or "").strip("/")
        return "/".join(p for p in (self.base, prefix, obj.lstrip("/")) if p)

    def check_inside(self, obj: str, files: list[pafs.FileInfo]) -> None:
        """Refuse files that resolve outside the root (a symlink to elsewhere): local only."""
        if not self.local:
            return
        root = os.path.realpath(self.base)
        for f in files:
            real = os.path.realpath(f.path)
            if os.path.commonpath([root, real]) != root:
                rel = os.path.relpath(f.path, self.base)
                raise SourceError(
                    self.uri(obj),
                    f"{rel} is a symbolic link to a file outside the connection's root",
                    hint="copy the file below the root, or point the connection's root at it",
                )

    @property
    def fs(self) -> pafs.FileSystem:
        if self._fs is None:
            if self.local:
                self._fs = pafs.LocalFileSystem()
            else:
                o = self.options
                kw: dict[str, Any] = {
                    "region": o.get("region", "us-east-1"),
                    "connect_timeout": float(o.get("connect_timeout", 5)),
                    "request_timeout": float(o.get("request_timeout", 30)),
                    "retry_strategy": pafs.AwsStandardS3RetryStrategy(
                        max_attempts=int(o.get("retries", 2)) + 1
                    ),
                }
                ak = o.get("access_key") or os.environ.get("AWS_ACCESS_KEY_ID")
                sk = o.get("secret_key") or os.environ.get("AWS_SECRET_ACCESS_KEY")
                if ak and sk:
                    kw.update(access_key=str(ak), secret_key=str(sk))
                if o.get("endpoint"):
                    raw = str(o["endpoint"])
                    ep = urlsplit(raw if "://" in raw else f"{o.get('scheme', 'https')}://{raw}")
                    kw.update(endpoint_override=ep.netloc or ep.path, scheme=ep.scheme or "https")
                self._fs = pafs.S3FileSystem(**kw)
        return self._fs

    def error(self, exc: BaseException, obj: str = "") -> SourceError:
        where = (
            self.base
            if self.local
            else f"bucket {self.base} at {self.options.get('endpoint', 'AWS S3')}"
        )
        down = isinstance(exc, OSError)
        return SourceError(
            self.uri(obj),
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
            hint=f"check that {where} is reachable and the credentials are right" if down else None,
            retriable=down,
        )

    def ping(self) -> None:
        try:
            self.fs.get_file_info(self.base)
        except (OSError, pa.ArrowException) as exc:
            raise self.error(exc) from exc

    def list_objects(self) -> list[str]:
        """Files and top-level directories below the bucket/root (at most 200)."""
        root = self.path("")
        try:
            infos = self.fs.get_file_info(
                pafs.FileSelector(root, recursive=True, allow_not_found=True)
            )
        except (OSError, pa.ArrowException) as exc:
            raise self.error(exc) from exc
        out: set[str] = set()
        for i in infos:
            rel = i.path[len(root) :].lstrip("/")
            if i.type == pafs.FileType.Directory and "/" not in rel:
                out.add(rel + "/")
            elif i.type == pafs.FileType.File and "=" not in rel:
                out.add(rel)
        return sorted(out)[:200]

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> S3Source:
        opts: dict[str, Any] = {}
        if obj in (self.options.get("schemas") or {}):
            opts["schema"] = self.options["schemas"][obj]
        if obj in (self.options.get("formats") or {}):
            opts["format"] = self.options["formats"][obj]
        elif self.options.get("format"):
            opts["format"] = self.options["format"]
        opts.update(options or {})
        return S3Source(self.uri(obj), self, obj, opts)


__all__ = ["S3Connection", "S3Source", "arrow_filter_ok", "probe_params"]
