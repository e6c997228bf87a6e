"""A binding's session declaration as JSON Schema (MCP tool input schemas, ``/v1/bindings``).

Values not expressible in JSON travel tagged (``fabric.service.wire``): an encrypted value
is ``{"$bytes": base64}``. Pinned keys are left out: the server fills them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsl.types import ValueType


def type_schema(t: ValueType) -> dict[str, Any]:
    k = t.kind
    if k == "int":
        return {"type": "integer"}
    if k == "float":
        return {"type": "number"}
    if k == "decimal":
        return {"type": ["number", "string"], "description": f"{t} (a string keeps every digit)"}
    if k == "bool":
        return {"type": "boolean"}
    if k == "str":
        return {"type": "string"}
    if k == "timestamp":
        return {"type": "string", "format": "date-time"}
    if k == "date":
        return {"type": "string", "format": "date"}
    if k == "interval":
        return {"type": "string", "description": "an interval, e.g. '7 days'"}
    if k == "vector":
        return {
            "type": "array",
            "items": {"type": "number"},
            "minItems": t.size,
            "maxItems": t.size,
        }
    if k == "list":
        return {"type": "array", "items": type_schema(t.item) if t.item else {}}
    if k == "bytes":
        return {"type": "object", "properties": {"$bytes": {"type": "string"}}}
    if k == "encrypted":
        return {
            "type": "object",
            "properties": {"$bytes": {"type": "string", "contentEncoding": "base64"}},
            "required": ["$bytes"],
            "description": f"{t}: a CKKS ciphertext (crypto.KeyRing.encrypt), base64",
        }
    return {}


def session_schema(
    session: Mapping[str, ValueType], *, pinned: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    props = {
        name: {**type_schema(t), "title": f"{name}: {t}"}
        for name, t in session.items()
        if name not in (pinned or {})
    }
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }
