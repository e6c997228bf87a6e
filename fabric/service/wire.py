"""Session values and result metadata as JSON on the wire.

JSON has no bytes, decimals, timestamps or numpy arrays: those travel tagged
(``{"$bytes": base64}``, ``{"$decimal": "1.25"}``, ``{"$datetime": iso}``, ``{"$date": iso}``,
``{"$seconds": 1.5}`` for an interval), and the server types and checks every value against
the binding's session declaration exactly as ``fab.query`` does.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import enum
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

try:  # the [serve] extra: a result's stats and freshness in ~2 us instead of ~12-22 us
    import orjson
except ImportError:  # pragma: no cover - the stdlib writes and reads the same values
    orjson = None  # type: ignore[assignment]


def encode_value(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return {"$bytes": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, decimal.Decimal):
        return {"$decimal": str(v)}
    if isinstance(v, dt.datetime):
        return {"$datetime": v.isoformat()}
    if isinstance(v, dt.date):
        return {"$date": v.isoformat()}
    if isinstance(v, dt.timedelta):
        return {"$seconds": v.total_seconds()}
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, list | tuple):
        return [encode_value(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): encode_value(x) for k, x in v.items()}
    return v


def decode_value(v: Any) -> Any:
    if isinstance(v, dict):
        if len(v) == 1:
            ((tag, x),) = v.items()
            if tag == "$bytes":
                return base64.b64decode(x)
            if tag == "$decimal":
                return decimal.Decimal(x)
            if tag == "$datetime":
                return dt.datetime.fromisoformat(x)
            if tag == "$date":
                return dt.date.fromisoformat(x)
            if tag == "$seconds":
                return dt.timedelta(seconds=x)
        return {k: decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    return v


def encode_session(session: Mapping[str, Any] | None) -> dict[str, Any]:
    return {str(k): encode_value(v) for k, v in (session or {}).items()}


def decode_session(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        from fabric.service.errors import BadRequest

        raise BadRequest(f"session must be a JSON object of name: value, got {type(obj).__name__}")
    return {str(k): decode_value(v) for k, v in obj.items()}


def _plain(v: Any) -> Any:
    """Metadata (freshness, stats) as JSON: no NaN, datetimes as ISO text."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dt.datetime | dt.date):
        return v.isoformat()
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return _plain(v.item())
    if isinstance(v, enum.Enum):  # its value, as orjson writes it (and str / int enums)
        return _plain(v.value)
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


# what the C encoder cannot write itself (datetimes, numpy scalars, other objects) goes
# through _plain as a value
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=_plain).encode
# orjson sends what it does not write as the stdlib does (datetimes, subclasses of the
# builtin types, dataclasses) to _plain too; NaN and infinities it writes as null
_ORJSON = (
    orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
    | orjson.OPT_PASSTHROUGH_DATACLASS
    if orjson is not None
    else 0
)


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON in one pass: orjson if it is installed, else the stdlib's
    C encoder (a query's stats and freshness on every served result: ~1-2 us, ~12-22 us
    with the stdlib, ~100-300 us walking them in Python first). A value neither writes
    as ``_plain`` would (a key that is not text, an integer past 64 bits, an int or
    float subclass) takes ``_plain``'s walk; NaN and infinities, which JSON cannot hold,
    are null either way."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, default=_plain, option=_ORJSON)
        except TypeError:  # a non-text key, a big integer, what _plain left as it was
            pass
    try:
        return _ENCODE(obj).encode()
    except (ValueError, TypeError):  # NaN / infinity (allow_nan=False), a tuple key
        return json.dumps(_plain(obj), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    """JSON from the server (orjson if installed; the stdlib for what orjson refuses:
    integers past 64 bits, lone surrogates)."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)
