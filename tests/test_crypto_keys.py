"""Key separation, envelopes and error handling of the crypto package."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import tenseal.sealapi as seal

import crypto
from crypto import (
    CorruptedError,
    CryptoError,
    EncryptedVector,
    FormatError,
    KeyMismatchError,
    KeyRing,
    ParamsError,
    PublicContext,
    SecretKeyError,
    ShapeError,
    TruncatedError,
    _seal,
    envelope,
    ops,
)


@pytest.fixture(scope="module")
def ring() -> KeyRing:
    return KeyRing.generate()


@pytest.fixture(scope="module")
def pub_bytes(ring: KeyRing) -> bytes:
    return ring.public_context()


@pytest.fixture(scope="module")
def pub(pub_bytes: bytes) -> PublicContext:
    return PublicContext.load(pub_bytes)


@pytest.fixture(scope="module")
def other_ring() -> KeyRing:
    return KeyRing.generate()


VALUES = [0.7, 0.2, 0.9]


# ------------------------------------------------------------------- key separation


def test_fabric_side_holds_no_secret_key(pub: PublicContext, pub_bytes: bytes) -> None:
    assert pub.has_secret_key() is False
    held = list(vars(pub).values()) + list(vars(pub.engine).values())
    assert not any(isinstance(v, seal.SecretKey) for v in held)
    header = envelope.unpack(pub_bytes, b"C").header
    assert [name for name, _ in header["parts"]] == ["public_key", "relin_keys", "galois_keys"]


def test_serialized_public_context_does_not_contain_the_secret_key(
    ring: KeyRing, pub_bytes: bytes, tmp_path
) -> None:
    path = tmp_path / "agent.key"
    ring.save(path)
    sk = envelope.unpack(path.read_bytes(), b"K").payload
    # Every 48-byte window of the serialized secret key is absent from the public bytes.
    windows = {sk[i : i + 48] for i in range(0, len(sk) - 48, 997)}
    assert len(windows) > 10
    assert not any(w in pub_bytes for w in windows)


def test_decrypting_on_the_fabric_side_fails(ring: KeyRing, pub: PublicContext) -> None:
    enc = ring.encrypt(VALUES)
    result = ops.weighted(pub, enc, [1.0, 1.0, 1.0])
    with pytest.raises(SecretKeyError, match="the fabric cannot decrypt"):
        pub.decrypt(result)
    # The fabric can build SEAL objects, but not a decryptor for the agent's key: the best
    # it can do is a secret key of its own, which yields noise, not the values.
    ctx = _seal.seal_context(pub.params)
    attacker = seal.Decryptor(ctx, seal.KeyGenerator(ctx).secret_key())
    pt = seal.Plaintext()
    attacker.decrypt(result._ct, pt)
    guess = np.asarray(seal.CKKSEncoder(ctx).decode_double(pt))[:3]
    assert np.all(np.abs(guess - sum(VALUES)) > 1.0)
    # ... while the agent decrypts the same ciphertext correctly.
    assert ring.decrypt(result)[0] == pytest.approx(sum(VALUES), abs=1e-5)


def test_public_context_round_trip_from_file(ring: KeyRing, pub_bytes: bytes, tmp_path) -> None:
    path = tmp_path / "agent.pub"
    path.write_bytes(pub_bytes)
    pub = PublicContext.load(path)
    assert pub.key_id == ring.key_id and pub.params.name == "n8192-s40"
    enc = ring.encrypt(VALUES)
    assert ring.decrypt(ops.add(pub, enc, enc)) == pytest.approx(2 * np.array(VALUES), abs=1e-6)


def test_load_cached_reloads_only_when_the_file_changes(other_ring, pub_bytes, tmp_path) -> None:
    path = tmp_path / "agent.pub"
    path.write_bytes(pub_bytes)
    first = PublicContext.load_cached(path)
    assert PublicContext.load_cached(str(path)) is first
    path.write_bytes(other_ring.public_context())
    again = PublicContext.load_cached(path)
    assert again is not first and again.key_id == other_ring.key_id
    with pytest.raises(CryptoError, match="cannot read the public context"):
        PublicContext.load_cached(tmp_path / "missing.pub")


def test_key_ring_save_and_load(ring: KeyRing, pub: PublicContext, tmp_path) -> None:
    path = tmp_path / "agent.key"
    ring.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    again = KeyRing.load(path)
    assert again.key_id == ring.key_id
    enc = ring.encrypt(VALUES)
    assert again.decrypt(ops.negate(pub, enc)) == pytest.approx(-np.array(VALUES), abs=1e-6)


# ------------------------------------------------------------------------ wrong keys


def test_wrong_key_on_the_fabric(other_ring: KeyRing, pub: PublicContext) -> None:
    enc = other_ring.encrypt(VALUES)
    with pytest.raises(KeyMismatchError, match=r"belongs to key .* holds key"):
        ops.weighted(pub, enc, [1, 1, 1])


def test_wrong_key_on_the_agent(ring: KeyRing, other_ring: KeyRing, pub: PublicContext) -> None:
    result = ops.add(pub, ring.encrypt(VALUES), 1.0)
    with pytest.raises(KeyMismatchError, match="another agent's key ring"):
        other_ring.decrypt(result)


def test_mixing_parameter_sets_is_refused(ring: KeyRing) -> None:
    deep = KeyRing.generate("n16384-s40")
    enc = deep.encrypt(VALUES)
    with pytest.raises(ParamsError, match=r"n16384-s40.*n8192-s40"):
        ring.decrypt(enc)


def test_unknown_parameter_set_lists_the_known_ones() -> None:
    with pytest.raises(ParamsError, match="known sets: n8192-s40, n16384-s40"):
        KeyRing.generate("n4096-s20")


# -------------------------------------------------------------- damaged envelopes


def _variants(blob: bytes):
    yield "truncated header", blob[:10], TruncatedError
    yield "truncated payload", blob[: len(blob) // 2], TruncatedError
    yield "last byte cut", blob[:-1], TruncatedError
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x40
    yield "bit flip in payload", bytes(flipped), CorruptedError
    flipped = bytearray(blob)
    flipped[-1] ^= 0x01
    yield "bit flip in checksum", bytes(flipped), CorruptedError
    yield "trailing garbage", blob + b"\x00", CorruptedError
    yield "bad magic", b"XXXX" + blob[4:], FormatError
    yield "future version", blob[:5] + b"\x09" + blob[6:], FormatError
    yield "not bytes at all", b"hello world, not a ciphertext at all", FormatError


@pytest.mark.parametrize("case", range(9))
def test_damaged_ciphertext_gives_a_clear_error(ring, pub, case) -> None:
    name, bad, err = list(_variants(ring.encrypt(VALUES).to_bytes()))[case]
    with pytest.raises(err) as fabric_side:
        ops.weighted(pub, bad, [1, 1, 1])
    with pytest.raises(err):
        ring.decrypt(bad)
    assert "encrypted vector" in str(fabric_side.value) or "fabric crypto" in str(
        fabric_side.value
    ), name


@pytest.mark.parametrize("case", range(9))
def test_damaged_public_context_gives_a_clear_error(pub_bytes, case) -> None:
    _name, bad, err = list(_variants(pub_bytes))[case]
    with pytest.raises(err):
        PublicContext.load(bad)


def test_wrong_kind_of_object(ring, pub_bytes) -> None:
    with pytest.raises(
        FormatError, match="expected a public context but the bytes hold an encrypted vector"
    ):
        PublicContext.load(ring.encrypt(VALUES).to_bytes())
    with pytest.raises(
        FormatError, match="expected an encrypted vector but the bytes hold a public context"
    ):
        EncryptedVector.from_bytes(pub_bytes)


def _reseal(blob: bytes, kind: bytes, edit) -> bytes:
    env = envelope.unpack(blob, kind)
    header, payload = edit(dict(env.header), env.payload)
    return envelope.pack(kind, header, payload)


def test_edited_parameter_definition_is_refused(ring) -> None:
    def edit(h, p):
        h["params"] = {**h["params"], "coeff_mod_bit_sizes": [60, 40, 60]}
        return h, p

    bad = _reseal(ring.encrypt(VALUES).to_bytes(), b"V", edit)
    with pytest.raises(ParamsError, match="different definition"):
        EncryptedVector.from_bytes(bad)


def test_ciphertext_from_other_parameters_under_a_valid_envelope(ring, pub) -> None:
    deep = KeyRing.generate("n16384-s40").encrypt(VALUES)

    def edit(h, _p):  # a correct checksum around a payload made under other parameters
        return h, deep.payload

    bad = _reseal(ring.encrypt(VALUES).to_bytes(), b"V", edit)
    with pytest.raises(CryptoError, match="does not fit its parameter set"):
        ops.weighted(pub, bad, [1, 1, 1])


def test_header_level_must_match_the_ciphertext(ring, pub) -> None:
    def edit(h, p):
        h["level"] = 1
        return h, p

    bad = _reseal(ring.encrypt(VALUES).to_bytes(), b"V", edit)
    with pytest.raises(FormatError, match="header says level 1 but the ciphertext is at level 2"):
        ops.weighted(pub, bad, [1, 1, 1])


def test_envelope_layout_is_documented() -> None:
    blob = envelope.pack(b"V", {"a": 1}, b"xyz")
    magic, kind, version, hlen, plen = struct.unpack_from(">4sccIQ", blob)
    assert (magic, kind, version[0], plen) == (b"FHE\x00", b"V", 1, 3)
    assert len(blob) == 18 + hlen + plen + 32


# ------------------------------------------------------------ session value type


def test_encrypted_vector_as_session_value(ring, pub) -> None:
    enc = ring.encrypt(VALUES)
    assert enc.type_name == "encrypted[3]" and len(enc) == 3
    again = pickle.loads(pickle.dumps(enc))
    assert again.key_id == enc.key_id and again.n == 3
    assert ring.decrypt(again) == pytest.approx(VALUES, abs=1e-6)
    assert ring.decrypt(enc.to_bytes()) == pytest.approx(VALUES, abs=1e-6)


def test_encrypt_rejects_bad_input(ring) -> None:
    with pytest.raises(ShapeError, match="4096 slots"):
        ring.encrypt(np.zeros(5000))
    with pytest.raises(ShapeError, match="NaN"):
        ring.encrypt([1.0, float("nan")])
    with pytest.raises(ShapeError, match="empty"):
        ring.encrypt([])


def test_public_api_is_exported() -> None:
    for name in (
        "KeyRing",
        "PublicContext",
        "EncryptedVector",
        "EncryptedType",
        "ops",
        "plan_info",
    ):
        assert hasattr(crypto, name)
