"""Framing between the fabric and a sandbox worker: an 8-byte header, a JSON header, a payload.

``<u32 json_len><u32 payload_len><json><payload>``; the payload is an Arrow IPC stream.
The fabric treats everything a worker sends as hostile: sizes are checked against caps
before anything is read.
"""

from __future__ import annotations

import json
import struct

import pyarrow as pa

from dsl.errors import FabricError

PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20


def encode(header: dict, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    head = json.dumps(header, separators=(",", ":"), default=_json_default).encode()
    return [PREFIX.pack(len(head), len(payload)) + head, payload]


def ipc_into(region, table: pa.Table) -> int | None:
    """Write ``table`` as an Arrow IPC stream at the start of ``region`` (a writable buffer,
    the shared memory between the two processes); its size, or None if it does not fit."""
    try:
        out = pa.FixedSizeBufferWriter(region)
        with pa.ipc.new_stream(out, table.schema) as writer:
            writer.write_table(table)
        return out.tell()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError):
        return None


def ipc_bytes(table: pa.Table) -> pa.Buffer:
    """``table`` as an Arrow IPC stream in memory (the payload sent down the pipe)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _json_default(value: object) -> object:
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return tolist()
    isoformat = getattr(value, "isoformat", None)
    if callable(isoformat):
        return isoformat()
    raise TypeError(f"sandbox parameter of type {type(value).__name__} is not JSON-serializable")


class DecodeBomb(FabricError, ValueError):
    """A table whose encodings (dictionary, run-end, views, null children) expand past a cap."""


def _expands(t: pa.DataType) -> bool:
    """True when arrays of type ``t`` can hold far more logical data than physical bytes."""
    if (
        pa.types.is_dictionary(t)
        or pa.types.is_run_end_encoded(t)
        or pa.types.is_null(t)
        or t.id in _VIEW_IDS
    ):
        return True
    if isinstance(t, pa.ExtensionType):
        return _expands(t.storage_type)
    return any(_expands(t.field(i).type) for i in range(t.num_fields))


_VIEW_IDS = {
    pa.string_view().id,
    pa.binary_view().id,
    pa.list_view(pa.int8()).id,
    pa.large_list_view(pa.int8()).id,
}


def check_decoded_size(table: pa.Table, limit: int) -> None:
    """Raise ``DecodeBomb`` if ``table`` would take more than ``limit`` bytes once every
    encoding is expanded (each value counted at least one byte, as a reader decoding it
    to Python or JSON would spend).  Columns of plain types are bounded by their buffers
    already and are not walked; the others are measured without expanding anything."""
    total = 0
    for name, col in zip(table.column_names, table.columns, strict=True):
        if not _expands(col.type):
            continue
        for chunk in col.chunks:
            total += int(_element_sizes(chunk, limit).sum())
            if total > limit:
                raise DecodeBomb(
                    f"column '{name}' expands to more than {limit} bytes ({col.type} decoded)"
                )


def _element_sizes(arr: pa.Array, budget: int):
    """Bytes each element of ``arr`` takes once decoded (an int64 numpy vector)."""
    import numpy as np

    n = len(arr)
    if n > budget:  # every element costs at least a byte
        raise DecodeBomb(f"an array of {n} values ({arr.type}) is over the limit of {budget} bytes")
    t = arr.type
    if isinstance(t, pa.ExtensionType):
        return _element_sizes(arr.storage, budget)
    if pa.types.is_null(t):
        return np.ones(n, np.int64)
    if pa.types.is_dictionary(t):
        entry = _element_sizes(arr.dictionary, budget)
        if not len(entry):
            return np.ones(n, np.int64)
        idx = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return entry[idx]
    if pa.types.is_run_end_encoded(t):
        values = _element_sizes(arr.values, budget)
        ends = arr.run_ends.to_numpy(zero_copy_only=False).astype(np.int64)
        ends = np.clip(ends - arr.offset, 0, n)
        return np.repeat(values, np.diff(ends, prepend=0))
    if t.id in (pa.string_view().id, pa.binary_view().id):
        views = np.frombuffer(arr.buffers()[1], np.int32)[::4][arr.offset : arr.offset + n]
        return views.astype(np.int64) + 1
    if (
        pa.types.is_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_string(t)
        or (pa.types.is_large_binary(t))
    ):
        import pyarrow.compute as pc

        lengths = pc.binary_length(arr).fill_null(0)
        return lengths.to_numpy(zero_copy_only=False).astype(np.int64) + 1
    if t.id in (pa.list_view(pa.int8()).id, pa.large_list_view(pa.int8()).id):
        child = np.concatenate([[0], np.cumsum(_element_sizes(arr.values, budget))])
        off = arr.offsets.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        size = arr.sizes.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return child[off + size] - child[off] + 1
    if pa.types.is_fixed_size_list(t):
        k = t.list_size
        if k == 0:
            return np.ones(n, np.int64)
        child = _element_sizes(arr.values, budget)[arr.offset * k : (arr.offset + n) * k]
        return child.reshape(n, k).sum(axis=1) + 1
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        child = np.concatenate([[0], np.cumsum(_element_sizes(arr.values, budget))])
        off = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        return child[off[1:]] - child[off[:-1]] + 1
    if pa.types.is_struct(t):
        out = np.ones(n, np.int64)
        for field in arr.flatten():
            out += _element_sizes(field, budget)
        return out
    if pa.types.is_union(t):
        raise DecodeBomb(f"a union ({t}) holding dictionary, run-end or view data is not accepted")
    width = getattr(t, "byte_width", None) or max(1, t.bit_width // 8)
    return np.full(n, width, np.int64)
