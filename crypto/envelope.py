"""The versioned, checksummed byte envelope around every serialized crypto object.

Layout (integers big-endian)::

    offset  size  field
    0       4     magic  b"FHE\\x00"
    4       1     kind   b"C" public context, b"V" encrypted vector, b"K" secret key ring
    5       1     format version (1)
    6       4     header length H
    10      8     payload length P
    18      H     header: UTF-8 JSON (parameter set, key id, shape, operations applied)
    18+H    P     payload: SEAL objects as SEAL serializes them (zstd-compressed, seeded)
    18+H+P  32    BLAKE2b-256 of every byte before it

The envelope is validated completely (length, magic, kind, version, checksum, header JSON)
before a single payload byte is handed to SEAL, so truncated or corrupted bytes raise a
:class:`~crypto.errors.EnvelopeError` instead of reaching native code.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from .errors import CorruptedError, FormatError, TruncatedError

MAGIC = b"FHE\x00"
VERSION = 1
KINDS = {b"C": "public context", b"V": "encrypted vector", b"K": "secret key ring"}
_FIXED = struct.Struct(">4sccIQ")
_SUM = 32


@dataclass(frozen=True)
class Envelope:
    kind: bytes
    header: dict[str, Any]
    payload: bytes


def _an(what: str) -> str:
    return ("an " if what[0] in "aeiou" else "a ") + what


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_SUM).digest()


def pack(kind: bytes, header: dict[str, Any], payload: bytes) -> bytes:
    assert kind in KINDS
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = b"".join(
        [_FIXED.pack(MAGIC, kind, bytes([VERSION]), len(head), len(payload)), head, payload]
    )
    return body + _digest(body)


def unpack(data: bytes | bytearray | memoryview, expect: bytes, where: str = "") -> Envelope:
    """Parse and validate an envelope of the expected kind; raise a clear error otherwise."""
    what = KINDS[expect]
    at = f" ({where})" if where else ""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise FormatError(f"expected the bytes of {_an(what)}{at}, got {type(data).__name__}")
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise TruncatedError(
            f"{what}{at} is truncated: {len(view)} bytes, shorter than the {_FIXED.size}-byte "
            "envelope header; re-send or re-read the whole object"
        )
    magic, kind, version, hlen, plen = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise FormatError(
            f"not a fabric crypto object{at}: bad magic {bytes(magic)!r} (expected {MAGIC!r}); "
            f"pass the bytes produced by the fabric's crypto package for {_an(what)}"
        )
    if kind != expect:
        got = KINDS.get(kind, f"unknown kind {kind!r}")
        raise FormatError(f"expected {_an(what)}{at} but the bytes hold {_an(got)}")
    if version[0] != VERSION:
        raise FormatError(
            f"{what}{at} uses envelope format version {version[0]}, this fabric reads version "
            f"{VERSION}; re-create it with a matching version of the crypto package"
        )
    total = _FIXED.size + hlen + plen + _SUM
    if len(view) < total:
        raise TruncatedError(
            f"{what}{at} is truncated: {len(view)} of {total} bytes; re-send or re-read the "
            "whole object"
        )
    if len(view) > total:
        raise CorruptedError(
            f"{what}{at} has {len(view) - total} unexpected trailing bytes after the checksum"
        )
    body = view[: total - _SUM]
    if _digest(body) != bytes(view[total - _SUM :]):
        raise CorruptedError(
            f"{what}{at} is corrupted: checksum mismatch (the bytes changed after they were "
            "written); re-send it from the agent"
        )
    try:
        header = json.loads(bytes(view[_FIXED.size : _FIXED.size + hlen]))
    except ValueError as e:  # checksum passed, so this was written wrong
        raise FormatError(f"{what}{at} has an unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{what}{at} header is not a JSON object")
    payload = bytes(view[_FIXED.size + hlen : total - _SUM])
    return Envelope(kind, header, payload)
