"""CKKS-encrypted context vectors (TenSEAL / SEAL).

Agent side::

    from crypto import KeyRing
    ring = KeyRing.generate()                  # secret key stays with the agent
    open("agent.pub", "wb").write(ring.public_context())
    ctx = ring.encrypt([0.7, 0.2, 0.9])        # EncryptedVector, session type encrypted[3]
    ring.decrypt(result_column[0])

Fabric side::

    from crypto import PublicContext, ops
    pub = PublicContext.load("agent.pub")      # no secret key
    scores = ops.score_dot(pub, ctx, candidates)   # pa.ExtensionArray, one row per candidate

See docs/crypto.md for the threat model, parameter sets, layouts and error bounds.
"""

from . import ops
from .arrow import EXTENSION_NAME, EncryptedType, is_encrypted_type, packed_array, to_arrow
from .errors import (
    CorruptedError,
    CryptoError,
    DepthError,
    EnvelopeError,
    FormatError,
    KeyMismatchError,
    ParamsError,
    SecretKeyError,
    ShapeError,
    TruncatedError,
)
from .keys import KeyRing, PublicContext
from .ops import EncryptedPlanInfo, plan_info
from .params import DEEP_PARAMS, DEFAULT_PARAMS, PARAM_SETS, ParamSet, get_params
from .vector import EncryptedVector, OpRecord

__all__ = [
    "DEEP_PARAMS",
    "DEFAULT_PARAMS",
    "EXTENSION_NAME",
    "PARAM_SETS",
    "CorruptedError",
    "CryptoError",
    "DepthError",
    "EncryptedPlanInfo",
    "EncryptedType",
    "EncryptedVector",
    "EnvelopeError",
    "FormatError",
    "KeyMismatchError",
    "KeyRing",
    "OpRecord",
    "ParamSet",
    "ParamsError",
    "PublicContext",
    "SecretKeyError",
    "ShapeError",
    "TruncatedError",
    "get_params",
    "is_encrypted_type",
    "ops",
    "packed_array",
    "plan_info",
    "to_arrow",
]
