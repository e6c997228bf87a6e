"""Key separation: the agent's ``KeyRing`` (secret key) and the fabric's ``PublicContext``.

The agent generates a key ring, exports ``public_context()`` (public key, relinearization
keys and Galois/rotation keys, never the secret key) and hands those bytes to the fabric
(``crypto: {public_context: agent.pub}``). The fabric loads them with
``PublicContext.load`` and can evaluate on ciphertexts but not decrypt them: it holds no
``SecretKey`` object at all and SEAL's ``Decryptor`` cannot be built from what it has.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import tenseal.sealapi as seal

from . import _seal, envelope
from .arrow import iter_cells
from .errors import (
    CryptoError,
    FormatError,
    KeyMismatchError,
    ParamsError,
    SecretKeyError,
    ShapeError,
)
from .params import ParamSet, check_definition, get_params
from .vector import EncryptedVector, OpRecord

_PARTS = ("public_key", "relin_keys", "galois_keys")
_CACHE: dict[str, tuple[tuple[str, int, int], PublicContext]] = {}


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _check_key(ev: EncryptedVector, key_id: str, params: str, holder: str) -> None:
    if ev.params != params:
        raise ParamsError(
            f"the encrypted vector was made under parameter set {ev.params!r} but {holder} "
            f"uses {params!r}; encrypt with the key ring whose public context the fabric holds"
        )
    if ev.key_id != key_id:
        raise KeyMismatchError(
            f"the encrypted vector belongs to key {ev.key_id} but {holder} holds key {key_id}; "
            "it was encrypted by another agent's key ring, or the fabric has a stale public "
            "context for this agent"
        )


class KeyRing:
    """The agent's side: secret key, encryption, decryption. Never give it to the fabric."""

    def __init__(self, ps: ParamSet, secret_key, key_id: str):
        self.params = ps
        self.key_id = key_id
        self._sk = secret_key
        ctx = _seal.seal_context(ps)
        self._encoder = seal.CKKSEncoder(ctx)
        self._encryptor = seal.Encryptor(ctx, secret_key)  # symmetric: seeded, half size
        self._decryptor = seal.Decryptor(ctx, secret_key)
        self._public: bytes | None = None

    @classmethod
    def generate(cls, params: str | ParamSet = "default") -> KeyRing:
        ps = get_params(params)
        keygen = seal.KeyGenerator(_seal.seal_context(ps))
        return cls(ps, keygen.secret_key(), secrets.token_hex(8))

    def __repr__(self) -> str:
        return f"KeyRing(params={self.params.name!r}, key_id={self.key_id!r})"

    # export ------------------------------------------------------------------------------
    def public_context(self) -> bytes:
        """Evaluation keys for the fabric (no secret key), in a checked envelope.

        Generated on first call (Galois keys: ~0.2 s and ~17 MB for ``n8192-s40``)."""
        if self._public is None:
            ps = self.params
            keygen = seal.KeyGenerator(_seal.seal_context(ps), self._sk)
            elts = _seal.galois_elements(ps)
            gk = keygen.create_galois_keys() if elts is None else keygen.create_galois_keys(elts)
            pk = seal.PublicKey()
            keygen.create_public_key(pk)
            parts = [
                _seal.to_bytes(pk),
                _seal.to_bytes(keygen.create_relin_keys()),
                _seal.to_bytes(gk),
            ]
            header = {
                "params": ps.describe(),
                "key_id": self.key_id,
                "parts": [[name, len(p)] for name, p in zip(_PARTS, parts)],
            }
            self._public = envelope.pack(b"C", header, b"".join(parts))
        return self._public

    def save(self, path: str | os.PathLike) -> None:
        """Write the secret key ring to ``path`` (mode 0600). Keep it on the agent's side."""
        header = {"params": self.params.describe(), "key_id": self.key_id}
        data = envelope.pack(b"K", header, _seal.to_bytes(self._sk))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KeyRing:
        data = Path(path).read_bytes()
        env = envelope.unpack(data, b"K", str(path))
        ps = check_definition(env.header.get("params"), f"key ring {path}")
        sk = _seal.from_bytes(
            seal.SecretKey, _seal.seal_context(ps), env.payload, f"key ring {path}"
        )
        return cls(ps, sk, str(env.header["key_id"]))

    # encrypt / decrypt -------------------------------------------------------------------
    def encrypt(
        self, values: Sequence[float] | np.ndarray, *, replicate: bool = True
    ) -> EncryptedVector:
        """Encrypt ``n`` real values. With ``replicate`` (default) the vector, zero-padded to
        the next power of two ``p``, is repeated across all slots (period ``p``): the layout
        packed dot products and sums need. ``replicate=False`` leaves slots ``>= n`` zero
        (period = slots); the fabric then replicates by rotations when it must."""
        x = np.asarray(values, dtype=np.float64).ravel()
        ps = self.params
        if x.size == 0:
            raise ShapeError("cannot encrypt an empty vector")
        if x.size > ps.slots:
            raise ShapeError(
                f"cannot encrypt {x.size} values: parameter set {ps.name!r} has {ps.slots} "
                "slots; split the vector or use a larger parameter set"
            )
        if not np.all(np.isfinite(x)):
            raise ShapeError("cannot encrypt NaN or infinite values")
        period = next_pow2(x.size) if replicate else ps.slots
        pt = seal.Plaintext()
        self._encoder.encode(_seal.layout(x, period, ps.slots).tolist(), ps.scale, pt)
        payload = _seal.to_bytes(self._encryptor.encrypt_symmetric(pt))
        return EncryptedVector(
            params=ps.name,
            key_id=self.key_id,
            n=int(x.size),
            period=period,
            level=ps.depth,
            ops=(OpRecord("encrypt", 0, f"n={x.size}"),),
            payload=payload,
        )

    def _slots(self, ev: EncryptedVector) -> np.ndarray:
        _check_key(ev, self.key_id, self.params.name, "this key ring")
        ct = ev._ct
        if ct is None:
            ct = _seal.from_bytes(
                seal.Ciphertext, _seal.seal_context(self.params), ev.payload, "encrypted vector"
            )
        pt = seal.Plaintext()
        try:
            self._decryptor.decrypt(ct, pt)
        except Exception as e:
            raise CryptoError(f"cannot decrypt the encrypted vector: {e}") from None
        return np.asarray(self._encoder.decode_double(pt))

    def decrypt(self, x: Any) -> Any:
        """Decrypt an ``EncryptedVector`` or its bytes (-> ndarray of ``n`` values), an
        encrypted Arrow scalar (-> float for a score cell, ndarray for a vector cell), or an
        encrypted Arrow array / chunked array (-> float64 ndarray, NaN for nulls, when every
        row is a score cell; else a list)."""
        if isinstance(x, bytes | bytearray | memoryview):
            x = EncryptedVector.from_bytes(bytes(x))
        if isinstance(x, EncryptedVector):
            s = self._slots(x)
            return s[: x.n * x.stride : x.stride].copy()
        if isinstance(x, pa.ExtensionScalar | pa.ExtensionArray | pa.ChunkedArray):
            out = self._decrypt_cells(x)
            return out[0] if isinstance(x, pa.ExtensionScalar) else out
        raise FormatError(
            f"cannot decrypt a {type(x).__name__}: pass an EncryptedVector, its bytes, or a "
            "fabric.encrypted Arrow scalar/column"
        )

    def _decrypt_cells(self, x) -> Any:
        cache: dict[Any, tuple[EncryptedVector, np.ndarray]] = {}
        out: list[Any] = []
        for key, fetch, slot in iter_cells(x):
            if key is None:
                out.append(None)
                continue
            if key not in cache:
                ev = EncryptedVector.from_bytes(fetch(), "Arrow cell")
                cache[key] = (ev, self._slots(ev))
            ev, s = cache[key]
            if slot is None:
                out.append(s[: ev.n * ev.stride : ev.stride].copy())
            elif not 0 <= slot < len(s):
                raise FormatError(f"encrypted cell points at slot {slot}, outside 0..{len(s) - 1}")
            else:
                out.append(float(s[slot]))
        if isinstance(x, pa.ExtensionScalar) or any(isinstance(v, np.ndarray) for v in out):
            return out
        return np.array([np.nan if v is None else v for v in out], dtype=np.float64)

    def top_k(self, scores: Any, k: int, ids: Any = None) -> list[tuple[Any, float]]:
        """Best ``k`` rows by decrypted score, highest first: ``[(id or row index, score)]``.

        ``scores`` is an encrypted column (decrypted here) or plain numbers; ``ids`` an
        optional column/sequence of row labels. NaN (null) scores are never picked."""
        if isinstance(scores, pa.ExtensionArray | pa.ChunkedArray | EncryptedVector):
            scores = self.decrypt(scores)
        s = np.asarray(scores, dtype=np.float64)
        valid = np.flatnonzero(~np.isnan(s))
        k = max(0, min(int(k), valid.size))
        order = valid[np.argsort(-s[valid], kind="stable")[:k]]
        if ids is not None and isinstance(ids, pa.ChunkedArray | pa.Array):
            ids = ids.to_pylist()
        return [(int(i) if ids is None else ids[i], float(s[i])) for i in order]


class PublicContext:
    """The fabric's side: evaluation keys only. It cannot decrypt."""

    def __init__(self, ps: ParamSet, key_id: str, engine: _seal.Engine, raw: bytes):
        self.params = ps
        self.key_id = key_id
        self.engine = engine
        self._raw = raw

    @classmethod
    def load(cls, src: bytes | str | os.PathLike) -> PublicContext:
        """Load the bytes of ``KeyRing.public_context()`` or a file holding them."""
        label = ""
        if isinstance(src, str | os.PathLike):
            label = str(src)
            try:
                src = Path(src).read_bytes()
            except OSError as e:
                raise CryptoError(f"cannot read the public context {label}: {e.strerror}") from None
        where = f"public context {label}".strip()
        env = envelope.unpack(src, b"C", label)
        h = env.header
        ps = check_definition(h.get("params"), where)
        parts = h.get("parts")
        if (
            not isinstance(parts, list)
            or [p[0] for p in parts] != list(_PARTS)
            or sum(int(p[1]) for p in parts) != len(env.payload)
        ):
            raise FormatError(f"{where}: the header's key list does not match the payload")
        ctx = _seal.seal_context(ps)
        objs, off = {}, 0
        for (name, size), cls_ in zip(parts, (seal.PublicKey, seal.RelinKeys, seal.GaloisKeys)):
            objs[name] = _seal.from_bytes(
                cls_, ctx, env.payload[off : off + size], f"{where}: {name}"
            )
            off += size
        engine = _seal.Engine(ps, objs["public_key"], objs["relin_keys"], objs["galois_keys"])
        return cls(ps, str(h["key_id"]), engine, bytes(src))

    @classmethod
    def load_cached(cls, path: str | os.PathLike) -> PublicContext:
        """``load(path)``, reused while the file is unchanged (same size and mtime): a
        public context is 17-40 MB and takes ~0.15-0.3 s to load."""
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError as e:
            raise CryptoError(f"cannot read the public context {path}: {e.strerror}") from None
        key = (real, st.st_size, st.st_mtime_ns)
        hit = _CACHE.get(real)
        if hit is None or hit[0] != key:
            hit = (key, cls.load(real))
            _CACHE[real] = hit
        return hit[1]

    def __repr__(self) -> str:
        return f"PublicContext(params={self.params.name!r}, key_id={self.key_id!r})"

    def has_secret_key(self) -> bool:
        """Always False: a public context is built from public and evaluation keys only."""
        return False

    def to_bytes(self) -> bytes:
        return self._raw

    def decrypt(self, x: Any) -> Any:
        """Always raises: the fabric has no secret key. Results go back to the agent."""
        raise SecretKeyError(
            f"the fabric cannot decrypt: it holds only the public context of key {self.key_id} "
            "(no secret key); return the encrypted value to the agent and call "
            "KeyRing.decrypt there"
        )

    def ciphertext(self, x: EncryptedVector | bytes, what: str = "encrypted vector"):
        """The live SEAL ciphertext of ``x`` after checking its key and parameters."""
        if isinstance(x, bytes | bytearray | memoryview):
            x = EncryptedVector.from_bytes(bytes(x), what)
        if not isinstance(x, EncryptedVector):
            raise FormatError(f"{what}: expected an EncryptedVector, got {type(x).__name__}")
        _check_key(x, self.key_id, self.params.name, "the fabric's public context")
        if x._ct is not None:
            return x, x._ct
        ct = _seal.from_bytes(seal.Ciphertext, self.engine.context, x.payload, what)
        if self.engine.level(ct) != x.level or ct.size() != 2:
            raise FormatError(
                f"{what}: header says level {x.level} but the ciphertext is at level "
                f"{self.engine.level(ct)} (size {ct.size()}); it was altered"
            )
        return x, ct
