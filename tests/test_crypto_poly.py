"""Polynomial decisions under encryption on the deep parameter set (n16384-s40).

Bounds: encrypted result vs the same polynomial in numpy <= 1e-3; sigmoid vs the true
logistic <= approximation error (reported by the op) + 1e-3; threshold decisions: for
inputs at least ``margin`` from t, within eps + 1e-3 of the right 0/1 answer.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.polynomial import chebyshev as C

from crypto import DepthError, KeyRing, PublicContext, ShapeError, ops
from crypto.poly import sigmoid_approx, step_approx

NOISE = 1e-3


@pytest.fixture(scope="module")
def ring() -> KeyRing:
    return KeyRing.generate("n16384-s40")


@pytest.fixture(scope="module")
def pub(ring: KeyRing) -> PublicContext:
    return PublicContext.load(ring.public_context())


def test_sigmoid_over_the_declared_range(ring, pub) -> None:
    x = np.linspace(-6, 6, 37)
    enc = ops.sigmoid(pub, ring.encrypt(x), -6, 6)
    got = ring.decrypt(enc)
    ap = sigmoid_approx(-6.0, 6.0, 15)
    assert np.max(np.abs(got - ap(x))) <= NOISE
    assert np.max(np.abs(got - 1 / (1 + np.exp(-x)))) <= ap.max_error + NOISE
    assert ap.max_error < 1e-3
    assert enc.depth == 6 and ops.plan_info(enc).ops[-1].op == "sigmoid"


@pytest.mark.parametrize(("t", "lo", "hi"), [(0.7, 0.0, 1.0), (0.0, -1.0, 1.0), (40.0, 0.0, 100.0)])
def test_threshold_decisions_outside_the_margin(ring, pub, t, lo, hi) -> None:
    rng = np.random.default_rng(int(t))
    x = np.concatenate([rng.uniform(lo, hi, 60), [lo, hi, t]])
    eps = 0.05
    got = ring.decrypt(ops.threshold(pub, ring.encrypt(x), t, lo, hi, eps=eps))
    ap = step_approx(t, lo, hi, 15, eps)
    assert np.max(np.abs(got - ap(x))) <= NOISE
    assert 0 < ap.margin < 0.1 * (hi - lo)
    far = np.abs(x - t) >= ap.margin
    assert far.sum() > 40
    want = (x[far] > t).astype(float)
    assert np.max(np.abs(got[far] - want)) <= eps + NOISE
    assert np.array_equal(got[far] > 0.5, x[far] > t)
    assert ops.threshold_margin(t, lo, hi) == ap.margin


def test_risk_above_threshold_from_a_weighted_score(ring, pub) -> None:
    """The risk scenario: w . [intent, risk, urgency] + b, then "score > 0.5", encrypted."""
    weights, bias = [0.2, 0.6, 0.2], 0.0
    rows = [[0.7, 0.9, 0.9], [0.1, 0.1, 0.3], [0.5, 0.8, 0.4], [0.2, 0.3, 0.1]]
    for ctx in rows:
        score = ops.weighted(pub, ring.encrypt(ctx), weights, bias)
        decision = ops.threshold(pub, score, 0.5, 0.0, 1.0)
        plain = float(np.dot(weights, ctx) + bias)
        assert abs(plain - 0.5) >= ops.threshold_margin(0.5, 0.0, 1.0)
        assert ring.decrypt(decision)[0] == pytest.approx(float(plain > 0.5), abs=0.05 + NOISE)
        assert decision.depth == 7 and decision.level == 0


def test_polyval_matches_numpy(ring, pub) -> None:
    coeffs = [0.1, -0.5, 0.25, 0.3, -0.2]
    x = np.linspace(-2, 3, 11)
    got = ring.decrypt(ops.polyval(pub, ring.encrypt(x), coeffs, -2, 3))
    assert np.max(np.abs(got - C.chebval((2 * x - 1) / 5, coeffs))) <= NOISE


def test_too_deep_for_what_is_left(ring, pub) -> None:
    score = ops.weighted(pub, ring.encrypt([0.3, 0.4, 0.5]), [1, 1, 1], 0)
    with pytest.raises(DepthError, match=r"threshold needs multiplicative depth 7.*6 level"):
        ops.threshold(pub, score, 0.5, 0.0, 2.0, degree=31)


def test_bad_ranges_are_refused(ring, pub) -> None:
    enc = ring.encrypt([0.5])
    with pytest.raises(ValueError, match=r"t=2.0 must lie inside the declared range \(0.0, 1.0\)"):
        ops.threshold(pub, enc, 2.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="lo < hi"):
        ops.sigmoid(pub, enc, 3.0, -3.0)


def test_deep_set_scores_short_vectors_and_refuses_long_ones(ring, pub) -> None:
    rng = np.random.default_rng(3)
    q, cands = rng.uniform(-1, 1, 16), rng.uniform(-1, 1, (30, 16))
    got = ring.decrypt(ops.score_dot(pub, ring.encrypt(q), cands))
    assert np.max(np.abs(got - cands @ q)) <= 1e-4
    with pytest.raises(ShapeError, match="only has rotation keys for vectors of up to 16"):
        ops.score_dot(pub, ring.encrypt(np.ones(32)), np.ones((2, 32)))
    with pytest.raises(ShapeError, match="encrypt with replicate=True"):
        ops.weighted(pub, ring.encrypt([1.0, 2.0], replicate=False), [1.0, 1.0])
