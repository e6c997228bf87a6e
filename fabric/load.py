"""Filling a materialized dataset from a file or a source: ``fabric load`` / ``materialize``.

``read_file`` reads a Parquet, CSV or JSON-lines file (and ``.npy`` matrices for vector
columns, row-aligned with it); ``read_source`` reads the dataset's declared columns of any
``<kind>://<connection>/<object>`` source through the query engine. ``conform`` checks the
rows against the dataset's declared schema before anything is written: a column the file
lacks or has in excess, or a value that does not convert, is a ``DslError`` naming the
column, the file and the row (``file:line:col`` for CSV and JSON lines), with the
declaration's place in fabric.yaml in the hint. ``write`` then upserts in batches,
reporting progress, so a bad row never leaves a dataset half loaded: nothing is written
until every row converts.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from dsl.errors import Diagnostic, DslError, Span
from dsl.types import from_arrow

FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
}
BATCH_ROWS = 10_000


@dataclass(frozen=True)
class Origin:
    """Where rows come from, to name a row in an error: a file of ``fmt`` (csv, jsonl,
    parquet, npy) or a source URI (``fmt`` "source")."""

    name: str  # the file as the user gave it, or the URI
    fmt: str
    path: Path | None = None
    delimiter: str = ","

    def where(self, row: int, column: str | None = None) -> tuple[Span | None, str, str | None]:
        """(span, "row N" text, the file's line) of 0-based data row ``row``."""
        if self.path is None or self.fmt not in ("csv", "jsonl"):
            return None, f"{self.name}: row {row + 1:,}", None
        header = 1 if self.fmt == "csv" else 0
        line_no, text = _nth_line(self.path, row, header, skip_blank=self.fmt == "jsonl")
        if text is None:
            return None, f"{self.name}: row {row + 1:,}", None
        col, end = 1, None
        if column is not None and self.fmt == "csv":
            col, end = _csv_field(self.path, text, column, self.delimiter)
        elif column is not None:
            at = text.find(json.dumps(column))
            if at >= 0:
                col, end = at + 1, at + 1 + len(json.dumps(column))
        span = Span(self.name, line_no, col, None if end is None else line_no, end)
        return span, f"row {row + 1:,}", text


def _nth_line(path: Path, row: int, header: int, skip_blank: bool) -> tuple[int, str | None]:
    with path.open(newline="") as f:
        n = 0
        for line_no, line in enumerate(f, 1):
            if line_no <= header or (skip_blank and not line.strip()):
                continue
            if n == row:
                return line_no, line.rstrip("\r\n")
            n += 1
    return 0, None


def _csv_field(path: Path, line: str, column: str, delimiter: str) -> tuple[int, int | None]:
    """(1-based start, exclusive end) of ``column``'s field in the CSV ``line``."""
    with path.open(newline="") as f:
        names = next(csv.reader(f, delimiter=delimiter), [])
    if column not in names:
        return 1, None
    idx, start, quoted = names.index(column), 0, False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif ch == delimiter and not quoted:
            if idx == 0:
                return start + 1, i + 1
            idx -= 1
            start = i + 1
    return (start + 1, len(line) + 1) if idx == 0 else (1, None)


# ------------------------------------------------------------------ reading


def file_format(path: Path, given: str | None) -> str:
    if given:
        return given
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DslError(
            Diagnostic(
                f"{path}: cannot tell the format from the extension {path.suffix or '(none)'!r}",
                None,
                "give --format parquet, csv or jsonl (vectors from a .npy file: "
                "--vectors COLUMN=FILE.npy next to the file of the other columns)",
            )
        )
    return fmt


def read_file(
    path: Path, schema: pa.Schema, *, fmt: str | None = None, shown: str | None = None
) -> tuple[pa.Table, Origin]:
    """The rows of ``path`` as an Arrow table (types not yet the declared ones: ``conform``)."""
    shown = shown or str(path)
    if not path.is_file():
        raise DslError(Diagnostic(f"no file {shown}", None, "give the path of a file to load"))
    fmt = file_format(path, fmt)
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    origin = Origin(shown, fmt, path, delimiter)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path), origin
        if fmt == "csv":
            import pyarrow.csv as pacsv

            # every declared scalar column as text first: "007" stays "007" in a str column,
            # and a value that does not convert is found by ``conform`` with its row
            with path.open(newline="") as f:
                names = next(csv.reader(f, delimiter=delimiter), [])
            types = {n: pa.string() for n in names}
            table = pacsv.read_csv(
                path,
                parse_options=pacsv.ParseOptions(delimiter=delimiter),
                convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=True),
            )
            return _csv_lists(table, schema, origin), origin
        if fmt == "jsonl":
            import pyarrow.json as pajson

            return pajson.read_json(path), origin
    except pa.ArrowInvalid as e:
        raise DslError(
            Diagnostic(
                f"{shown}: not a readable {fmt} file: {e}",
                None,
                "check the file, or give its format with --format parquet, csv or jsonl",
            )
        ) from None
    raise DslError(Diagnostic(f"unknown format {fmt!r}", None, "use parquet, csv or jsonl"))


def _csv_lists(table: pa.Table, schema: pa.Schema, origin: Origin) -> pa.Table:
    """CSV cells of list and vector columns hold JSON arrays (``"[0.1, 0.2]"``)."""
    for i, name in enumerate(table.column_names):
        if name not in schema.names:
            continue
        t = schema.field(name).type
        if not (pa.types.is_list(t) or pa.types.is_fixed_size_list(t)):
            continue
        values = []
        for row, cell in enumerate(table.column(name).to_pylist()):
            try:
                values.append(None if cell in (None, "") else json.loads(cell))
            except json.JSONDecodeError:
                raise _bad_value(origin, row, name, cell, t, "not a JSON array") from None
        table = table.set_column(i, name, pa.array(values))
    return table


def add_vectors(table: pa.Table, vectors: Mapping[str, Path], origin: Origin) -> pa.Table:
    """Columns from ``.npy`` matrices (one row per row of ``table``), ``--vectors COL=F``."""
    import numpy as np

    for column, path in vectors.items():
        try:
            m = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DslError(
                Diagnostic(f"--vectors {column}={path}: not a .npy array ({e})", None)
            ) from None
        if m.ndim != 2 or len(m) != table.num_rows:
            raise DslError(
                Diagnostic(
                    f"--vectors {column}={path}: a {' x '.join(map(str, m.shape))} array; "
                    f"{origin.name} has {table.num_rows:,} rows",
                    None,
                    f"the .npy file must hold one row per row of {origin.name} "
                    f"({table.num_rows:,} x the vector's dimension)",
                )
            )
        arr = pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(m, dtype=np.float32).ravel()), m.shape[1]
        )
        if column in table.column_names:
            table = table.set_column(table.column_names.index(column), column, arr)
        else:
            table = table.append_column(column, arr)
    return table


def read_source(fab: Any, uri: str, schema: pa.Schema, optional: Iterable[str]) -> pa.Table:
    """The declared columns of source ``uri`` (all its rows), through the query engine."""
    have = fab.catalog.schema(uri).names
    optional = set(optional)
    missing = [n for n in schema.names if n not in have and n not in optional]
    if missing:
        raise DslError(
            Diagnostic(
                f"{uri} has no column {', '.join(missing)}",
                None,
                f"it has {', '.join(have)}; load a source with every column of the dataset's "
                "schema (or change the schema in fabric.yaml)",
            )
        )
    cols = ", ".join(f"t.{n}" for n in schema.names if n in have)
    return fab.query_text(f"from {uri} as t select {cols}").table


# ------------------------------------------------------------------ checking


def conform(
    table: pa.Table,
    schema: pa.Schema,
    *,
    dataset: str,
    origin: Origin,
    key: str,
    optional: Iterable[str] = (),
    ignore_extra: bool = False,
    declared_at: Span | None = None,
) -> pa.Table:
    """``table`` as the dataset's declared ``schema``; a column missing or unknown, a value
    that does not convert or a null key is a ``DslError`` naming the column, file and row.
    ``optional``: columns the dataset computes itself (``embed:``) when they are absent."""
    at = f" ({declared_at})" if declared_at is not None else ""
    optional = set(optional)
    missing = [n for n in schema.names if n not in table.column_names and n not in optional]
    extra = [n for n in table.column_names if n not in schema.names]
    problems = []
    for n in missing:
        problems.append(
            Diagnostic(
                f"{origin.name} has no column '{n}' ({from_arrow(schema.field(n).type)}), "
                f"declared in the schema of dataset {dataset}",
                None,
                f"add the column to {origin.name}, or remove '{n}' from the dataset's "
                f"schema{at}; the file has {', '.join(table.column_names)}",
            )
        )
    if extra and not ignore_extra:
        for n in extra:
            problems.append(
                Diagnostic(
                    f"{origin.name} has column '{n}', which is not in the schema of dataset "
                    f"{dataset}",
                    None,
                    f"declare it in the dataset's schema{at}, or pass --ignore-extra to skip "
                    f"it; the schema has {', '.join(schema.names)}",
                )
            )
    if problems:
        raise DslError(problems)
    names = [n for n in schema.names if n in table.column_names]
    table = table.select(names)
    out = []
    for n in names:
        t = schema.field(n).type
        col = table.column(n)
        if col.type == t:
            out.append(col)
            continue
        try:
            out.append(col.cast(t))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            row = _first_bad(col, t)
            if row is None:
                raise DslError(
                    Diagnostic(
                        f"{origin.name}: column '{n}' ({col.type}) cannot be converted to "
                        f"{from_arrow(t)}, declared in dataset {dataset}: {e}",
                        None,
                        f"change the column in the file, or its type in the schema{at}",
                    )
                ) from None
            raise _bad_value(origin, row, n, col[row].as_py(), t, None, dataset, at) from None
    conformed = pa.table(out, schema=pa.schema([schema.field(n) for n in names]))
    if key in conformed.column_names and conformed.column(key).null_count:
        row = conformed.column(key).is_null().to_pylist().index(True)
        span, row_text, line = origin.where(row, key)
        raise DslError(
            Diagnostic(
                f"{row_text}: the key column '{key}' of dataset {dataset} is empty",
                span,
                "every row needs a key (rows are upserted by it)",
                source_line=line,
            )
        )
    return conformed


def _first_bad(col: pa.ChunkedArray, t: pa.DataType) -> int | None:
    """The first row of ``col`` that does not cast to ``t`` (halving, then one by one)."""
    arr = col.combine_chunks()
    lo, hi = 0, len(arr)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        try:
            arr.slice(lo, mid - lo).cast(t)
            lo = mid
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            hi = mid
    for i in range(lo, hi):
        try:
            arr.slice(i, 1).cast(t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return i
    return None


def _bad_value(
    origin: Origin,
    row: int,
    column: str,
    value: Any,
    t: pa.DataType,
    why: str | None = None,
    dataset: str | None = None,
    at: str = "",
) -> DslError:
    span, row_text, line = origin.where(row, column)
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    if why is None:
        name = from_arrow(t)
        why = f"not {'an' if name[0] in 'aeiou' else 'a'} {name}"
        if pa.types.is_fixed_size_list(t) and isinstance(value, list):
            why = f"{len(value)} values, not {t.list_size}"
    return DslError(
        Diagnostic(
            f"{row_text}, column '{column}': {shown} is {why}"
            + (f" (declared {from_arrow(t)} in dataset {dataset})" if dataset else ""),
            span,
            f"fix the value in the file, or the column's type in the schema{at}; "
            "nothing was loaded",
            source_line=line,
        )
    )


# ------------------------------------------------------------------ writing


def write(
    ds: Any,
    table: pa.Table,
    report: Callable[[int], None] = lambda n: None,
    batch_rows: int = BATCH_ROWS,
) -> int:
    """Upsert ``table`` into ``ds`` in batches of ``batch_rows``, calling ``report(rows
    written so far)`` after each; returns the rows written."""
    done = 0
    for start in itertools.count(0, batch_rows):
        if start >= table.num_rows:
            break
        ds.upsert(table.slice(start, batch_rows))
        done = min(start + batch_rows, table.num_rows)
        report(done)
    return done
