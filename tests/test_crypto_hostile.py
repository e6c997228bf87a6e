"""Hostile ciphertexts reaching the fabric's CKKS operations: a valid envelope (checksum
recomputed) around a damaged SEAL payload or a lying header. Every failure is a
CryptoError naming what is wrong; SEAL's own ValueError/RuntimeError never escapes."""

from __future__ import annotations

import random

import pytest

import crypto
from crypto import KeyRing, envelope, ops
from crypto.errors import CryptoError


@pytest.fixture(scope="module")
def setup():
    ring = KeyRing.generate()
    ctx = crypto.PublicContext.load(ring.public_context())
    return ctx, envelope.unpack(ring.encrypt([0.7, 0.2, 0.9]).serialize(), b"V")


def _variants(env, n: int = 20):
    rng = random.Random(2)
    for i in range(n):
        p, h = bytearray(env.payload), dict(env.header)
        how = i % 5
        if how == 0:
            for _ in range(8):
                p[rng.randrange(len(p))] ^= rng.randrange(1, 256)
        elif how == 1:
            p = p[: rng.randrange(1, len(p))]
        elif how == 2:
            p = bytearray(rng.randrange(256) for _ in range(len(p)))
        elif how == 3:
            k = rng.choice(sorted(h))
            h[k] = rng.choice([None, -1, 10**9, "x", [], {}, 3.5])
        else:
            p[0:64] = bytes(64)
        yield envelope.pack(b"V", h, bytes(p))


def test_hostile_ciphertexts_raise_only_crypto_errors(setup) -> None:
    ctx, env = setup
    refused = 0
    for data in _variants(env):
        for op in (
            lambda x: ops.dot(ctx, x, [1.0, 2.0, 3.0]),
            lambda x: ops.total(ctx, x),
            lambda x: ops.add(ctx, x, x),
        ):
            try:
                op(data)
            except CryptoError as e:
                refused += 1
                assert str(e)
    assert refused >= 40  # most damage is caught; the rest computes on noise, never plaintext
