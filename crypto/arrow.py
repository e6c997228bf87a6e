"""Arrow storage for encrypted values: the ``fabric.encrypted`` extension type.

Storage is ``struct<ct: dictionary<int32, large_binary>, slot: int32>``:

* ``ct`` is the envelope bytes of an :class:`~crypto.vector.EncryptedVector`. It is
  dictionary-encoded so that many rows can point at one ciphertext without copying it:
  a packed score ciphertext holds up to 4,096 candidates' scores (N=8192).
* ``slot`` is the SEAL slot holding this row's value. A row with a slot is an encrypted
  *scalar* and decrypts to a float; a row whose slot is null is a whole encrypted vector
  and decrypts to an array.

The type parameter ``n`` is the logical width of a cell (1 for scalars), so an Arrow
schema says ``extension<fabric.encrypted>`` and the binding type ``encrypted[n]``. The
type is registered with pyarrow on import, so it survives Arrow IPC (and so the sandbox
and the wire).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from .vector import EncryptedVector

STORAGE = pa.struct(
    [pa.field("ct", pa.dictionary(pa.int32(), pa.large_binary())), pa.field("slot", pa.int32())]
)
EXTENSION_NAME = "fabric.encrypted"


class EncryptedType(pa.ExtensionType):
    """Arrow extension type of encrypted cells (see the module docstring)."""

    def __init__(self, n: int = 1):
        self.n = int(n)
        super().__init__(STORAGE, EXTENSION_NAME)

    def __arrow_ext_serialize__(self) -> bytes:
        return json.dumps({"n": self.n}).encode()

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type, serialized):
        meta = json.loads(serialized) if serialized else {}
        return cls(int(meta.get("n", 1)))

    def __reduce__(self):
        return EncryptedType, (self.n,)


with contextlib.suppress(pa.ArrowKeyError):  # already registered (module reloaded)
    pa.register_extension_type(EncryptedType())


def is_encrypted_type(t: pa.DataType) -> bool:
    return isinstance(t, pa.ExtensionType) and t.extension_name == EXTENSION_NAME


def packed_array(
    cts: Sequence[EncryptedVector],
    ct_index: Sequence[int] | np.ndarray,
    slots: Sequence[int | None] | np.ndarray,
    n: int = 1,
) -> pa.ExtensionArray:
    """Rows pointing into shared ciphertexts: row ``i`` is slot ``slots[i]`` of
    ``cts[ct_index[i]]`` (``slots[i]`` None means the whole vector)."""
    dictionary = pa.array([c.to_bytes() for c in cts], pa.large_binary())
    ct = pa.DictionaryArray.from_arrays(pa.array(ct_index, pa.int32()), dictionary)
    storage = pa.StructArray.from_arrays([ct, pa.array(slots, pa.int32())], fields=list(STORAGE))
    return pa.ExtensionArray.from_storage(EncryptedType(n), storage)


def to_arrow(values: Sequence[EncryptedVector]) -> pa.ExtensionArray:
    """One row per value. Single-value vectors (``n == 1``, e.g. a weighted score) become
    scalar cells that decrypt to a float; others decrypt to arrays."""
    if not values:
        return packed_array([], [], [], 1)
    width = {v.n for v in values}
    n = width.pop() if len(width) == 1 else 0  # 0: vectors of different sizes
    slots = [0 if v.n == 1 else None for v in values]
    return packed_array(values, list(range(len(values))), slots, n)


def iter_cells(x, chunk: int = 0):
    """Yield ``(key, fetch, slot)`` per row of an encrypted scalar, array or chunked array.

    ``key`` identifies the ciphertext (rows sharing a dictionary entry share the key, so a
    caller decrypts each ciphertext once), ``fetch()`` returns its envelope bytes, and
    ``slot`` is the row's slot (None for a whole vector). Null rows yield ``(None, None,
    None)``.
    """
    if isinstance(x, pa.ChunkedArray):
        for i, part in enumerate(x.chunks):
            yield from iter_cells(part, i)
        return
    if isinstance(x, pa.ExtensionScalar):
        if not is_encrypted_type(x.type):
            raise TypeError(f"not an encrypted Arrow value: extension type {x.type}")
        v = x.value
        if v is None or not v.is_valid or not v["ct"].is_valid:
            yield None, None, None
        else:
            blob = v["ct"].as_py()
            yield ("scalar",), (lambda: blob), v["slot"].as_py()
        return
    if isinstance(x, pa.ExtensionArray):
        if not is_encrypted_type(x.type):
            raise TypeError(f"not an encrypted Arrow column: extension type {x.type}")
        st = x.storage
        ct = st.field("ct")
        idx = ct.indices.to_numpy(zero_copy_only=False)
        slots = st.field("slot").to_pylist()
        valid = st.is_valid().to_numpy(zero_copy_only=False) & ct.is_valid().to_numpy(
            zero_copy_only=False
        )
        dictionary = ct.dictionary
        for i in range(len(x)):
            if not valid[i]:
                yield None, None, None
                continue
            j = int(idx[i])
            yield (chunk, j), (lambda j=j: dictionary[j].as_py()), slots[i]
        return
    raise TypeError(
        f"not an encrypted Arrow value: {type(x).__name__} (expected a fabric.encrypted "
        "scalar, array or chunked array)"
    )
