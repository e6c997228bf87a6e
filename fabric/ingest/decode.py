"""Kafka JSON message values -> a record batch in the dataset schema.

Two paths with the same answer for good messages:

- fast: Arrow's C++ JSON reader over the values joined by newlines, with the dataset
  schema as explicit schema (vectors read as lists, then cast to their fixed size); it is
  4-10x faster than decoding in Python. It is strict (a value of the wrong JSON kind, a
  wrong vector length, a non-integral number for an int column ... fail the block);
- exact: ``connectors.json_decode.decode_json_messages``, per message, which accepts a
  few more forms (epoch timestamps, integral floats for ints) and names the bad field.

A block that the fast path refuses is bisected down to ``min_chunk`` messages, and those
go through the exact path, so one bad message costs a few small re-parses, not a
Python decode of the whole batch.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.json as pj

from connectors.json_decode import decode_json_messages, one_object_per_line

Errors = list[tuple[int, str]]


def _read_schema(schema: pa.Schema) -> pa.Schema | None:
    """The schema the JSON reader parses with; None if the fast path cannot express it."""
    fields = []
    for f in schema:
        if "." in f.name:  # dotted names address nested fields: exact path only
            return None
        t = f.type
        if pa.types.is_fixed_size_list(t):
            t = pa.list_(t.value_type)
        fields.append(pa.field(f.name, t))
    return pa.schema(fields)


class JsonDecoder:
    """``decode(values) -> (batch, [(index, error)])``; null values are reported as errors
    (the ingestor handles tombstones before calling it)."""

    def __init__(self, schema: pa.Schema, *, min_chunk: int = 64):
        self.schema = schema
        self.read_schema = _read_schema(schema)
        self.min_chunk = min_chunk
        self.fast_batches = 0
        self.fallback_batches = 0
        self._parse = pj.ParseOptions(
            explicit_schema=self.read_schema, unexpected_field_behavior="ignore"
        )

    def decode(self, values: Sequence[bytes | None]) -> tuple[pa.RecordBatch, Errors]:
        if not values:
            return pa.RecordBatch.from_pylist([], schema=self.schema), []
        if self.read_schema is None or None in values:
            return decode_json_messages(values, self.schema)
        tables: list[pa.Table] = []
        errors: Errors = []
        self._decode(values, 0, tables, errors)  # type: ignore[arg-type]  # no None left
        if len(tables) == 1:
            table = tables[0]
        else:
            table = pa.concat_tables(tables)
        batch = table.combine_chunks().to_batches()
        return (batch[0] if batch else pa.RecordBatch.from_pylist([], schema=self.schema)), errors

    def _fast(self, values: Sequence[bytes]) -> pa.Table | None:
        data = b"\n".join(values)
        if not one_object_per_line(data, len(values)):
            return None
        try:
            t = pj.read_json(
                io.BytesIO(data),
                # one block (the whole batch), so threads only add dispatch cost
                read_options=pj.ReadOptions(
                    use_threads=False, block_size=max(1 << 20, len(data) + 1)
                ),
                parse_options=self._parse,
            )
            if t.num_rows != len(values):  # two objects on a line
                return None
            return t.cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return None

    def _decode(
        self, values: Sequence[bytes], offset: int, tables: list[pa.Table], errors: Errors
    ) -> None:
        t = self._fast(values)
        if t is not None:
            self.fast_batches += 1
            tables.append(t)
            return
        if len(values) <= self.min_chunk:
            self.fallback_batches += 1
            batch, errs = decode_json_messages(values, self.schema)
            tables.append(pa.Table.from_batches([batch], schema=self.schema))
            errors.extend((offset + i, e) for i, e in errs)
            return
        mid = len(values) // 2
        self._decode(values[:mid], offset, tables, errors)
        self._decode(values[mid:], offset + mid, tables, errors)
