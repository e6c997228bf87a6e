"""Thin layer over TenSEAL's bundled SEAL bindings (``tenseal.sealapi``).

The high-level ``tenseal.CKKSVector`` has no rotations and hides levels, which packed
scoring needs, so the fabric talks to SEAL directly through the bindings TenSEAL ships.
SEAL objects serialize only to files: :func:`to_bytes` / :func:`from_bytes` go through a
private directory on tmpfs (``/dev/shm``) when there is one.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence

import numpy as np
import tenseal.sealapi as seal

from .errors import DepthError, ParamsError, ShapeError
from .params import ParamSet

_tmp: str | None = None


def _tmpdir() -> str:
    global _tmp
    if _tmp is None or not os.path.isdir(_tmp):
        base = None  # tmpfs when it has room for a few public contexts (containers: 64 MB)
        if os.access("/dev/shm", os.W_OK):
            st = os.statvfs("/dev/shm")
            base = "/dev/shm" if st.f_bavail * st.f_frsize >= 512 * 2**20 else None
        _tmp = tempfile.mkdtemp(prefix="fabric-crypto-", dir=base)
        atexit.register(shutil.rmtree, _tmp, True)
    return _tmp


def to_bytes(obj) -> bytes:
    """Serialize a SEAL object (or ``Serializable``) with SEAL's own format."""
    path = os.path.join(_tmpdir(), uuid.uuid4().hex)
    try:
        obj.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def from_bytes(cls, context, data: bytes, what: str):
    """Load a SEAL object of class ``cls``; SEAL's own validation errors become ParamsError."""
    path = os.path.join(_tmpdir(), uuid.uuid4().hex)
    try:
        with open(path, "wb") as f:
            f.write(data)
        obj = cls()
        obj.load(context, path)
        return obj
    except Exception as e:  # SEAL raises ValueError/RuntimeError on invalid data
        raise ParamsError(
            f"{what} does not fit its parameter set ({e}); it was made under other "
            "parameters than its envelope claims"
        ) from None
    finally:
        if os.path.exists(path):
            os.unlink(path)


@functools.cache
def seal_context(ps: ParamSet):
    parms = seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(ps.poly_modulus_degree)
    parms.set_coeff_modulus(
        seal.CoeffModulus.Create(ps.poly_modulus_degree, list(ps.coeff_mod_bit_sizes))
    )
    ctx = seal.SEALContext(parms, True, seal.SEC_LEVEL_TYPE.TC128)
    if not ctx.parameters_set():
        raise ParamsError(
            f"parameter set {ps.name!r} is refused by SEAL: {ctx.parameters_error_message()}"
        )
    return ctx


def galois_elements(ps: ParamSet) -> list[int] | None:
    """Galois elements for the set's rotation steps (SEAL's GaloisTool.get_elt_from_step)."""
    if ps.rotation_steps is None:
        return None
    m, half = 2 * ps.poly_modulus_degree, ps.poly_modulus_degree // 2
    return [pow(3, (half + s) if s < 0 else s, m) for s in ps.rotation_steps]


def layout(values: np.ndarray, period: int, slots: int, stride: int = 1) -> np.ndarray:
    """Slot vector holding ``values[i]`` at slot ``i*stride``, repeated every ``period``."""
    block = np.zeros(period, dtype=np.float64)
    block[: len(values) * stride : stride] = values
    return np.tile(block, slots // period)


class Engine:
    """SEAL evaluator bound to one parameter set and one key set (no secret key)."""

    def __init__(self, ps: ParamSet, public_key, relin_keys, galois_keys):
        self.ps = ps
        self.context = seal_context(ps)
        self.encoder = seal.CKKSEncoder(self.context)
        self.evaluator = seal.Evaluator(self.context)
        self.encryptor = seal.Encryptor(self.context, public_key)
        self.relin_keys = relin_keys
        self.galois_keys = galois_keys
        self.slots = ps.slots

    # levels ------------------------------------------------------------------------------
    def level(self, ct) -> int:
        """Rescalings left (SEAL chain index; 0 = last level)."""
        return self.context.get_context_data(ct.parms_id()).chain_index()

    def _last_prime(self, ct) -> float:
        data = self.context.get_context_data(ct.parms_id())
        return float(data.parms().coeff_modulus()[-1].value())

    def drop_to(self, ct, level: int):
        """``ct`` modulus-switched down to ``level`` (no noise cost, smaller); ``ct`` itself
        when it is already there. Ciphertexts are never modified in place once shared."""
        if self.level(ct) <= level:
            return ct
        out = seal.Ciphertext()
        self.evaluator.mod_switch_to_next(ct, out)
        while self.level(out) > level:
            self.evaluator.mod_switch_to_next_inplace(out)
        return out

    def align(self, a, b):
        lv = min(self.level(a), self.level(b))
        return self.drop_to(a, lv), self.drop_to(b, lv)

    def _need(self, ct, op: str):
        if self.level(ct) < 1:
            raise DepthError(f"{op}: the ciphertext has no multiplicative level left")

    # encoding ----------------------------------------------------------------------------
    def encode(self, slots_or_scalar: float | np.ndarray, ct, scale: float):
        pt = seal.Plaintext()
        if isinstance(slots_or_scalar, int | float | np.floating):
            self.encoder.encode(float(slots_or_scalar), ct.parms_id(), scale, pt)
        else:
            self.encoder.encode(
                np.asarray(slots_or_scalar, dtype=np.float64).tolist(), ct.parms_id(), scale, pt
            )
        return pt

    def encrypt_zero_like(self, ct):
        out = seal.Ciphertext()
        self.encryptor.encrypt_zero(ct.parms_id(), out)
        out.scale = ct.scale
        return out

    # arithmetic --------------------------------------------------------------------------
    def add(self, a, b):
        a, b = self.align(a, b)
        out = seal.Ciphertext()
        self.evaluator.add(a, b, out)
        return out

    def sub(self, a, b):
        a, b = self.align(a, b)
        out = seal.Ciphertext()
        self.evaluator.sub(a, b, out)
        return out

    def negate(self, a):
        out = seal.Ciphertext()
        self.evaluator.negate(a, out)
        return out

    def add_plain(self, ct, slots_or_scalar):
        out = seal.Ciphertext()
        self.evaluator.add_plain(ct, self.encode(slots_or_scalar, ct, ct.scale), out)
        return out

    def mul_plain_raw(self, ct, slots_or_scalar):
        """Product before rescaling; its scale is ``ct.scale * q_last`` (see mul_plain)."""
        q = self._last_prime(ct)
        if not np.any(slots_or_scalar):  # SEAL refuses exact-zero ("transparent") products
            out = self.encrypt_zero_like(ct)
            out.scale = ct.scale * q
            return out
        out = seal.Ciphertext()
        self.evaluator.multiply_plain(ct, self.encode(slots_or_scalar, ct, q), out)
        return out

    def rescale(self, ct):
        self.evaluator.rescale_to_next_inplace(ct)
        return ct

    def mul_plain(self, ct, slots_or_scalar):
        """Multiply by plain values, one level. The plaintext is encoded at the scale of the
        prime the rescale drops, so the result keeps exactly the input's scale."""
        self._need(ct, "multiply by plain")
        return self.rescale(self.mul_plain_raw(ct, slots_or_scalar))

    def mul(self, a, b):
        """Ciphertext x ciphertext, relinearized and rescaled, one level. The scale is reset
        to the nominal scale (relative error |q/2^40 - 1| <= 7e-7 per multiplication)."""
        a, b = self.align(a, b)
        self._need(a, "multiply")
        out = seal.Ciphertext()
        if a is b:
            self.evaluator.square(a, out)
        else:
            self.evaluator.multiply(a, b, out)
        self.evaluator.relinearize_inplace(out, self.relin_keys)
        self.evaluator.rescale_to_next_inplace(out)
        out.scale = self.ps.scale
        return out

    def rotate(self, ct, step: int):
        """Slot ``i`` of the result holds slot ``i + step`` of the input (cyclic)."""
        step %= self.slots
        if step == 0:
            return ct
        out = seal.Ciphertext()
        try:
            self.evaluator.rotate_vector(ct, step, self.galois_keys, out)
        except (ValueError, RuntimeError) as e:
            raise ShapeError(
                f"rotation by {step} slots needs a Galois key that parameter set "
                f"{self.ps.name!r} does not include (keys for steps "
                f"{self.ps.rotation_steps or 'all powers of two'}; {e}); use n8192-s40 for "
                f"sums and dot products over vectors longer than {self.ps.max_period}"
            ) from None
        return out

    def sum_blocks(self, ct, width: int):
        """Rotate-and-sum: slot ``i`` gets the sum of slots ``i .. i+width-1``
        (``width`` a power of two; log2(width) rotations)."""
        step = 1
        while step < width:
            ct = self.add(ct, self.rotate(ct, step))
            step *= 2
        return ct

    def replicate(self, ct, period: int):
        """From values in slots ``[0, period)`` (zeros elsewhere) to the same block repeated
        over all slots: log2(slots/period) rotations by negative powers of two."""
        width = period
        while width < self.slots:
            ct = self.add(ct, self.rotate(ct, -width))
            width *= 2
        return ct

    def add_many(self, cts: Sequence):
        out = cts[0]
        for c in cts[1:]:
            out = self.add(out, c)
        return out
