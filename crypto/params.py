"""Named CKKS parameter sets.

A parameter set fixes the ring size ``N`` (slots = N/2), the coefficient modulus chain
and the scale. Every envelope (public context, ciphertext, key ring) names the set it was
made under, so a mismatch is caught by name before any bytes reach SEAL, and the set's
definition is re-checked on load (a renamed or edited set is refused).

=============  =====  ==========================  =====  =====  ======  ==================
name           N      coeff modulus bits          scale  depth  slots   rotation keys
=============  =====  ==========================  =====  =====  ======  ==================
n8192-s40      8192   60, 40, 40, 60 (200)        2^40   2      4096    all powers of two
n16384-s40     16384  60, 7 x 40, 60 (400)        2^40   7      8192    1, 2, 4, 8
=============  =====  ==========================  =====  =====  ======  ==================

Both are at the 128-bit security level of the HomomorphicEncryption.org standard (SEAL's
``sec_level_type.tc128`` check refuses the context otherwise: at most 218 bits of
modulus for N=8192 and 438 for N=16384).

``depth`` is the number of rescalings available: each multiplication (by a plain value or
by another ciphertext) uses one. ``n8192-s40`` is enough for sums, weighted scores and
dot products (depth 1); polynomial approximations (sigmoid, thresholds) need
``n16384-s40``. Its Galois keys are limited to small rotations (vectors of up to 16
values) because each key at this size weighs ~9 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ParamsError


@dataclass(frozen=True)
class ParamSet:
    name: str
    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int
    security_bits: int = 128
    # Rotation steps with Galois keys; None means every power of two (both directions).
    rotation_steps: tuple[int, ...] | None = None

    @property
    def slots(self) -> int:
        return self.poly_modulus_degree // 2

    @property
    def depth(self) -> int:
        """Multiplicative levels available to a fresh ciphertext."""
        return len(self.coeff_mod_bit_sizes) - 2

    @property
    def scale(self) -> float:
        return float(2**self.scale_bits)

    @property
    def max_period(self) -> int:
        """Largest vector layout period whose sums can be computed by rotations."""
        if self.rotation_steps is None:
            return self.slots
        p = 1
        while p in self.rotation_steps:
            p *= 2
        return p

    def describe(self) -> dict[str, object]:
        """The definition written into envelopes and re-checked on load."""
        return {
            "name": self.name,
            "N": self.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes),
            "scale_bits": self.scale_bits,
            "rotation_steps": None if self.rotation_steps is None else list(self.rotation_steps),
        }


PARAM_SETS: dict[str, ParamSet] = {
    p.name: p
    for p in (
        ParamSet("n8192-s40", 8192, (60, 40, 40, 60), 40),
        ParamSet("n16384-s40", 16384, (60, 40, 40, 40, 40, 40, 40, 40, 60), 40, 128, (1, 2, 4, 8)),
    )
}
DEFAULT_PARAMS = "n8192-s40"
DEEP_PARAMS = "n16384-s40"


def get_params(name: str | ParamSet, *, where: str = "") -> ParamSet:
    """Look up a parameter set by name (``"default"`` is ``n8192-s40``)."""
    if isinstance(name, ParamSet):
        return name
    key = DEFAULT_PARAMS if name == "default" else name
    try:
        return PARAM_SETS[key]
    except KeyError:
        at = f" in {where}" if where else ""
        raise ParamsError(
            f"unknown CKKS parameter set {name!r}{at}; known sets: "
            f"{', '.join(PARAM_SETS)} (or 'default' = {DEFAULT_PARAMS})"
        ) from None


def check_definition(described: object, where: str) -> ParamSet:
    """Validate a parameter description read from an envelope against the registry."""
    if not isinstance(described, dict) or not isinstance(described.get("name"), str):
        raise ParamsError(f"{where}: the envelope has no parameter-set description")
    ps = get_params(described["name"], where=where)
    if described != ps.describe():
        raise ParamsError(
            f"{where}: parameter set {ps.name!r} was written with a different definition "
            f"({described}) than this version of the fabric uses ({ps.describe()}); "
            "re-create the keys and ciphertexts with this version"
        )
    return ps
