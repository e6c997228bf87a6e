"""Framing between the fabric and a sandbox worker: an 8-byte header, a JSON header, a payload.

``<u32 json_len><u32 payload_len><json><payload>``; the payload is an Arrow IPC stream.
The fabric treats everything a worker sends as hostile: sizes are checked against caps
before anything is read.
"""

from __future__ import annotations

import json
import struct

import pyarrow as pa

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
