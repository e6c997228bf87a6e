"""Errors raised by the crypto package.

Every error says what is wrong, where (which object, which operation) and what would fix
it. All of them derive from :class:`CryptoError`, so a caller can catch one type.
"""

from __future__ import annotations

from dsl.errors import FabricError


class CryptoError(FabricError):
    """Base class of every error raised by ``crypto``."""


class EnvelopeError(CryptoError):
    """Serialized bytes are not a valid fabric crypto envelope."""


class FormatError(EnvelopeError):
    """Wrong magic number, kind of object or format version."""


class TruncatedError(EnvelopeError):
    """The bytes end before the envelope says they should (cut off in transit or on disk)."""


class CorruptedError(EnvelopeError):
    """The checksum does not match: the bytes were altered after they were written."""


class ParamsError(CryptoError):
    """Unknown parameter set, or objects made under different parameter sets mixed."""


class KeyMismatchError(CryptoError):
    """A ciphertext and a context (or key ring) belong to different keys."""


class SecretKeyError(CryptoError):
    """An operation needs the secret key, which the fabric side never has."""


class DepthError(CryptoError):
    """An operation needs more multiplicative levels than the ciphertext has left."""


class ShapeError(CryptoError):
    """Sizes of encrypted and plain operands do not fit together or do not fit in the slots."""
