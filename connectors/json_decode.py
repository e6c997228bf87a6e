"""JSON documents (Kafka message values, Mongo documents) into typed Arrow batches.

Nested fields are addressed with dots: the column ``meta.city`` reads ``doc["meta"]["city"]``
(a key that itself contains a dot is found first). Values are converted to the column's
declared type; a value that does not fit is a *row error* (Kafka: the message is skipped
and reported) or, with ``on_error="null"`` (Mongo), that cell becomes null and the row is
kept. Nothing here ever raises on bad data.

Type conversions: ``int`` accepts ints and integral floats; ``float`` ints and floats;
``str`` strings (ObjectId and other BSON scalars by ``str()``); ``bool`` booleans;
``timestamp`` datetimes (naive = UTC), ISO-8601 strings and epoch numbers (seconds, or
milliseconds when larger than 10^11); ``date`` dates and ISO strings; ``list[T]`` lists;
``vector[N]`` lists of N numbers; ``json`` anything, stored as JSON text.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from connectors._util import JSON_META, _utc, is_json_field

_MISSING = object()


class _Bad(Exception):
    pass


def get_path(doc: Mapping[str, Any], name: str) -> Any:
    """``doc[name]`` or, for ``a.b``, ``doc["a"]["b"]``; ``_MISSING`` when absent."""
    if name in doc:
        return doc[name]
    if "." not in name:
        return _MISSING
    cur: Any = doc
    for part in name.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _json_default(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return _utc(v).isoformat()
    if isinstance(v, dt.date):
        return v.isoformat()
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def convert(v: Any, t: pa.DataType, json_text: bool = False) -> Any:
    """One value to the Python form pyarrow accepts for type ``t``; raises _Bad."""
    if v is None:
        return None
    if json_text:
        return json.dumps(v, default=_json_default, sort_keys=True)
    if pa.types.is_integer(t):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise _Bad(f"expected int, got {type(v).__name__} {v!r:.40}")
    if pa.types.is_floating(t):
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
        if type(v).__name__ == "Decimal128":  # bson.Decimal128
            return float(v.to_decimal())
        raise _Bad(f"expected float, got {type(v).__name__} {v!r:.40}")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if isinstance(v, str):
            return v
        if isinstance(v, dict | list | bool | int | float | bytes):
            raise _Bad(f"expected str, got {type(v).__name__} {v!r:.40}")
        return str(v)  # ObjectId, Decimal128, UUID ...
    if pa.types.is_boolean(t):
        if isinstance(v, bool):
            return v
        raise _Bad(f"expected bool, got {type(v).__name__} {v!r:.40}")
    if pa.types.is_timestamp(t):
        if isinstance(v, dt.datetime):
            return _utc(v)
        if isinstance(v, str):
            try:
                return _utc(dt.datetime.fromisoformat(v))
            except ValueError:
                raise _Bad(f"expected an ISO-8601 timestamp, got {v!r:.40}") from None
        if isinstance(v, int | float) and not isinstance(v, bool):
            secs = v / 1000 if abs(v) > 1e11 else v
            return dt.datetime.fromtimestamp(secs, dt.UTC)
        raise _Bad(f"expected timestamp, got {type(v).__name__} {v!r:.40}")
    if pa.types.is_date(t):
        if isinstance(v, dt.datetime):
            return v.date()
        if isinstance(v, dt.date):
            return v
        if isinstance(v, str):
            try:
                return dt.date.fromisoformat(v[:10])
            except ValueError:
                raise _Bad(f"expected an ISO-8601 date, got {v!r:.40}") from None
        raise _Bad(f"expected date, got {type(v).__name__} {v!r:.40}")
    if pa.types.is_fixed_size_list(t):
        if not isinstance(v, list | tuple) or len(v) != t.list_size:
            raise _Bad(f"expected a vector of {t.list_size} numbers, got {v!r:.40}")
        return [convert(x, t.value_type) for x in v]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if not isinstance(v, list | tuple):
            raise _Bad(f"expected a list, got {type(v).__name__} {v!r:.40}")
        return [convert(x, t.value_type) for x in v]
    if pa.types.is_binary(t):
        if isinstance(v, bytes):
            return v
        raise _Bad(f"expected bytes, got {type(v).__name__}")
    return v


def rows_to_batch(
    docs: Sequence[Mapping[str, Any]],
    schema: pa.Schema,
    *,
    on_error: str = "skip",
    first_row: int = 0,
) -> tuple[pa.RecordBatch, list[tuple[int, str]]]:
    """Typed batch from decoded documents. Errors are (row index, message)."""
    names = schema.names
    flags = [is_json_field(f) for f in schema]
    types = [f.type for f in schema]
    cols: list[list[Any]] = [[] for _ in names]
    errors: list[tuple[int, str]] = []
    kept: list[int] = []  # the doc index of each row in cols
    for i, doc in enumerate(docs):
        row: list[Any] = []
        bad = None
        for name, t, js in zip(names, types, flags):
            v = get_path(doc, name)
            if v is _MISSING:
                row.append(None)
                continue
            try:
                row.append(convert(v, t, js))
                continue
            except _Bad as exc:
                why = f"field '{name}': {exc}"
            except (ValueError, OverflowError, TypeError, OSError) as exc:  # out of range ...
                why = f"field '{name}': {type(exc).__name__}: {exc} (value {v!r:.40})"
            bad = bad or why  # the first bad field names the row's error
            if on_error == "skip":
                break
            row.append(None)  # this cell only: the row keeps one value per column
        if bad is not None:
            errors.append((first_row + i, bad))
            if on_error == "skip":
                continue
        kept.append(i)
        for c, v in zip(cols, row):
            c.append(v)
    try:
        arrays = [pa.array(c, type=t) for c, t in zip(cols, types)]
    except (pa.ArrowException, ValueError, OverflowError, TypeError):
        # a value Python holds but Arrow cannot (beyond int64, a lone surrogate): find it
        arrays = _arrays_dropping_unstorable(cols, names, types, kept, first_row, on_error, errors)
        errors.sort()
    return pa.RecordBatch.from_arrays(arrays, schema=schema), errors


def _arrays_dropping_unstorable(
    cols: list[list[Any]],
    names: list[str],
    types: list[pa.DataType],
    kept: list[int],
    first_row: int,
    on_error: str,
    errors: list[tuple[int, str]],
) -> list[pa.Array]:
    """The slow path of ``rows_to_batch``: each value on its own; a row with a value Arrow
    refuses is an error (``skip``) or gets a null there (``null``)."""
    drop: set[int] = set()
    for c, name, t in zip(cols, names, types):
        for j, v in enumerate(c):
            if v is None or j in drop:
                continue
            try:
                pa.array([v], type=t)
            except (pa.ArrowException, ValueError, OverflowError, TypeError) as exc:
                msg = f"field '{name}': {type(exc).__name__}: {exc} (value {v!r:.40})"
                if on_error == "skip":
                    errors.append((first_row + kept[j], msg))
                    drop.add(j)
                else:
                    c[j] = None
                    if (first_row + kept[j], msg) not in errors:
                        errors.append((first_row + kept[j], msg))
    keep = [j for j in range(len(kept)) if j not in drop]
    return [pa.array([c[j] for j in keep], type=t) for c, t in zip(cols, types)]


def one_object_per_line(data: bytes, n: int) -> bool:
    """``data`` (n values joined by newlines) can be trusted to the JSON reader: every value
    is one line starting with ``{`` (so it yields at least one row, and a row count of n
    means exactly one each) and the whole is UTF-8 (the reader takes invalid UTF-8 into
    string columns, and skips it in fields the schema ignores; ``json.loads`` rejects it).
    Anything else (an empty value, a value spanning lines, leading blanks) goes to the
    per-message path, which decides."""
    if data[:1] != b"{" or data[-1:] == b"\n" or b"\r" in data:
        return False
    import numpy as np  # (bytes.count is ~10x slower than this for a batch)

    a = np.frombuffer(data, np.uint8)
    nl = np.flatnonzero(a == 10)
    if len(nl) != n - 1 or (n > 1 and not bool((a[nl + 1] == 123).all())):  # b"\n", b"{"
        return False
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def _fast_ok(schema: pa.Schema) -> bool:
    return all(
        "." not in f.name
        and not is_json_field(f)
        and (
            pa.types.is_integer(f.type)
            or pa.types.is_floating(f.type)
            or pa.types.is_boolean(f.type)
            or pa.types.is_string(f.type)
            or pa.types.is_timestamp(f.type)
        )
        for f in schema
    )


def _fast_decode(values: Sequence[bytes | None], schema: pa.Schema) -> pa.RecordBatch | None:
    """pyarrow's JSON reader for a batch where every message is one clean line; else None.

    Any doubt (a null value, a newline inside a value, a value the reader rejects, a row
    count that does not match) returns None and the careful per-message path runs.
    """
    import io

    import pyarrow.json as pj

    if not values or len(values) < 64 or not _fast_ok(schema):
        return None
    if None in values:
        return None
    joined = b"\n".join(values)  # type: ignore[arg-type]
    if not one_object_per_line(joined, len(values)):
        return None
    try:
        table = pj.read_json(
            io.BytesIO(joined),
            read_options=pj.ReadOptions(
                use_threads=False, block_size=max(1 << 20, len(joined) + 1)
            ),
            parse_options=pj.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"
            ),
        )
    except (pa.ArrowException, ValueError):
        return None
    if table.num_rows != len(values):
        return None
    table = table.select(schema.names).cast(schema)
    return pa.RecordBatch.from_arrays([c.combine_chunks() for c in table.columns], schema=schema)


def decode_json_messages(
    values: Sequence[bytes | None], schema: pa.Schema
) -> tuple[pa.RecordBatch, list[tuple[int, str]]]:
    """Decode JSON message values into ``schema``; bad messages are skipped, never raised.

    Returns the batch of the good rows (in input order) and ``(index, reason)`` for every
    skipped message (index into ``values``): null values (tombstones), invalid JSON,
    non-object JSON, and fields whose value does not fit the declared type.
    """
    fast = _fast_decode(values, schema)
    if fast is not None:
        return fast, []
    docs: list[Mapping[str, Any]] = []
    where: list[int] = []
    errors: list[tuple[int, str]] = []
    for i, raw in enumerate(values):
        if raw is None:
            errors.append((i, "null message value (tombstone)"))
            continue
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            errors.append((i, f"invalid JSON: {exc}"))
            continue
        except RecursionError:
            errors.append((i, "invalid JSON: nested too deeply"))
            continue
        if not isinstance(doc, dict):
            errors.append((i, f"expected a JSON object, got {type(doc).__name__}"))
            continue
        docs.append(doc)
        where.append(i)
    batch, bad = rows_to_batch(docs, schema, on_error="skip")
    errors.extend((where[i], msg) for i, msg in bad)
    errors.sort()
    return batch, errors


# ----------------------------------------------------------------- schema inference


def _kind(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, dt.datetime):
        return "timestamp"
    if isinstance(v, dt.date):
        return "date"
    if isinstance(v, bytes):
        return "bytes"
    if isinstance(v, list | tuple):
        kinds = {_kind(x) for x in v} - {None}
        if len(kinds) == 1:
            (k,) = kinds
            if k in ("int", "float", "str", "bool", "timestamp"):
                return f"list[{k}]"
        if kinds == {"int", "float"}:
            return "list[float]"
        return "json"
    if isinstance(v, dict):
        return "json"
    if type(v).__name__ == "Decimal128":
        return "float"
    return "str"  # ObjectId, UUID, ...


def _flatten(doc: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for k, v in doc.items():
        name = f"{prefix}{k}"
        if (
            isinstance(v, dict)
            and v
            and all(isinstance(x, str) and x and x[0] != "$" and "." not in x for x in v)
        ):
            _flatten(v, name + ".", out)
        else:
            out[name] = v


def infer_schema(
    docs: Iterable[Mapping[str, Any]], *, timestamp_fields: Iterable[str] = ()
) -> pa.Schema:
    """Columns and types from a sample; nested objects become ``a.b`` columns.

    A column seen with several kinds widens (int + float -> float) or becomes ``json``.
    Columns are ordered by first appearance; ``_id`` (if present) comes first.
    """
    from connectors._util import parse_type

    kinds: dict[str, set[str]] = {}
    for doc in docs:
        flat: dict[str, Any] = {}
        _flatten(doc, "", flat)
        for name, v in flat.items():
            s = kinds.setdefault(name, set())
            k = _kind(v)
            if k is not None:
                s.add(k)
    ts = set(timestamp_fields)
    for name in list(kinds):  # 'a' both a value and an object somewhere: keep 'a' as json
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in kinds:
                kinds[parent].add("json")
                kinds.pop(name, None)
                break
    fields = []
    for name, s in kinds.items():
        if name in ts:
            k = "timestamp"
        elif not s:
            k = "str"
        elif len(s) == 1:
            (k,) = s
        elif s == {"int", "float"}:
            k = "float"
        elif s == {"list[int]", "list[float]"}:
            k = "list[float]"
        else:
            k = "json"
        meta = {JSON_META: b"json"} if k == "json" else None
        fields.append(pa.field(name, parse_type(k), metadata=meta))
    fields.sort(key=lambda f: f.name != "_id")
    return pa.schema(fields)
