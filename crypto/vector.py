"""``EncryptedVector``: a CKKS ciphertext with the metadata needed to use it safely.

Slot layout: value ``i`` (``0 <= i < n``) sits in slot ``i * stride``, and the block of
``period`` slots repeats across all slots. A fresh agent-side encryption of ``n`` values
has ``stride=1`` and ``period`` = next power of two >= n (the vector is replicated, which
is what packed dot products and rotate-and-sum need). A packed score ciphertext has
``period = slots`` (no replication) and holds one candidate per slot.

The value is self-describing and context-free, so it can travel as a session value
(binding type ``encrypted[n]``) and be stored in an Arrow column; it is bound to a key
(``key_id``) and a parameter set, and it records the encrypted operations applied to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from . import envelope
from .errors import FormatError
from .params import check_definition, get_params


@dataclass(frozen=True)
class OpRecord:
    """One encrypted operation: its name, the levels it used and a short detail."""

    op: str
    depth: int
    detail: str = ""

    def __str__(self) -> str:
        d = f"[{self.detail}]" if self.detail else ""
        return f"{self.op}{d}(depth {self.depth})"


@dataclass(frozen=True, eq=False)
class EncryptedVector:
    params: str
    key_id: str
    n: int
    period: int
    level: int
    depth: int = 0
    stride: int = 1
    ops: tuple[OpRecord, ...] = ()
    payload: bytes = field(default=b"", repr=False)
    # Live SEAL ciphertext (fabric or agent process); serialized lazily into payload.
    _ct: Any = field(default=None, repr=False, compare=False)

    @property
    def type_name(self) -> str:
        """The binding type of this session value."""
        return f"encrypted[{self.n}]"

    def __len__(self) -> int:
        return self.n

    @property
    def size(self) -> int:
        """Number of values (``n``); the name ``dsl.types`` checks session values by."""
        return self.n

    def serialize(self) -> bytes:
        """Alias of :meth:`to_bytes` (TenSEAL's method name, which ``dsl.types`` expects)."""
        return self.to_bytes()

    def _payload(self) -> bytes:
        if not self.payload:
            from ._seal import to_bytes

            object.__setattr__(self, "payload", to_bytes(self._ct))
        return self.payload

    def header(self) -> dict[str, Any]:
        return {
            "params": get_params(self.params).describe(),
            "key_id": self.key_id,
            "n": self.n,
            "period": self.period,
            "stride": self.stride,
            "level": self.level,
            "depth": self.depth,
            "ops": [[o.op, o.depth, o.detail] for o in self.ops],
        }

    def to_bytes(self) -> bytes:
        """Versioned, checksummed envelope (see ``crypto.envelope``)."""
        return envelope.pack(b"V", self.header(), self._payload())

    def __reduce__(self):  # pickling goes through the checked envelope
        return (EncryptedVector.from_bytes, (self.to_bytes(),))

    @property
    def nbytes(self) -> int:
        return len(self._payload())

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "") -> EncryptedVector:
        env = envelope.unpack(data, b"V", where)
        h = env.header
        what = f"encrypted vector{f' ({where})' if where else ''}"
        ps = check_definition(h.get("params"), what)
        try:
            ops = tuple(OpRecord(str(o), int(d), str(t)) for o, d, t in h.get("ops", []))
            ev = cls(
                params=ps.name,
                key_id=str(h["key_id"]),
                n=int(h["n"]),
                period=int(h["period"]),
                stride=int(h["stride"]),
                level=int(h["level"]),
                depth=int(h["depth"]),
                ops=ops,
                payload=env.payload,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{what}: header field missing or malformed ({e!r})") from None
        if not (
            ev.n > 0 and ev.n * ev.stride <= ev.period <= ps.slots and ps.slots % ev.period == 0
        ):
            raise FormatError(
                f"{what}: layout n={ev.n}, stride={ev.stride}, period={ev.period} does not fit "
                f"{ps.slots} slots"
            )
        return ev

    def with_ops(self, *records: OpRecord) -> EncryptedVector:
        return replace(self, ops=self.ops + records)
