"""Polynomial approximations for decisions under encryption (plain numpy, cached).

CKKS evaluates only additions and multiplications, so a sigmoid or a threshold is
replaced by a polynomial that is accurate on a *declared* input range ``[lo, hi]``.
Polynomials are kept in the Chebyshev basis on ``[-1, 1]`` after the affine map
``u = (2x - lo - hi) / (hi - lo)``: their coefficients stay small (|c_k| <= 1 here), so
CKKS noise is not amplified, unlike power-basis coefficients of the same function.

Outside ``[lo, hi]`` the polynomials grow fast: the range is a contract with the caller.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
from numpy.polynomial import chebyshev as C


@dataclass(frozen=True)
class Approximation:
    coeffs: tuple[float, ...]  # Chebyshev coefficients on [-1, 1]
    lo: float
    hi: float
    max_error: float  # max |poly - target| on the checked region (plain arithmetic)
    margin: float = 0.0  # thresholds: band around t (input units) left unchecked

    @property
    def degree(self) -> int:
        return len(self.coeffs) - 1

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Plain evaluation of the same polynomial (the oracle for encrypted results)."""
        u = (2 * np.asarray(x, dtype=np.float64) - self.lo - self.hi) / (self.hi - self.lo)
        return C.chebval(u, self.coeffs)


def poly_depth(degree: int, affine: bool = True) -> int:
    """Levels used by Chebyshev evaluation: affine map + T_k products + coefficients."""
    return int(affine) + max(0, math.ceil(math.log2(degree))) + 1 if degree >= 1 else 0


def _check_range(lo: float, hi: float, what: str) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(
            f"{what}: the declared input range [{lo}, {hi}] must be finite with lo < hi"
        )


@functools.lru_cache(maxsize=256)
def sigmoid_approx(lo: float, hi: float, degree: int) -> Approximation:
    """Chebyshev interpolant of the logistic function on ``[lo, hi]``."""
    _check_range(lo, hi, "sigmoid")

    def f(u):
        return 1.0 / (1.0 + np.exp(-(u * (hi - lo) / 2 + (hi + lo) / 2)))

    c = C.chebinterpolate(f, degree)
    g = np.linspace(-1, 1, 20001)
    err = float(np.max(np.abs(C.chebval(g, c) - f(g))))
    return Approximation(tuple(float(v) for v in c), lo, hi, err)


def _fit_step(tp: float, degree: int, delta: float) -> tuple[np.ndarray, float]:
    x = np.concatenate([np.cos(np.linspace(0, np.pi, 4001)), np.linspace(-1, 1, 4001)])
    keep = np.abs(x - tp) >= delta
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = C.chebfit(x[keep], (x[keep] > tp).astype(float), degree)
    g = np.linspace(-1, 1, 20001)
    gk = np.abs(g - tp) >= delta
    err = float(np.max(np.abs(C.chebval(g[gk], c) - (g[gk] > tp)))) if gk.any() else 0.0
    return c, err


@functools.lru_cache(maxsize=256)
def step_approx(t: float, lo: float, hi: float, degree: int, eps: float) -> Approximation:
    """Polynomial ~ [x > t] on ``[lo, hi]``: within ``eps`` of 0/1 for ``|x - t| >= margin``,
    with the smallest margin (found by bisection) for which a least-squares Chebyshev fit
    of this degree reaches ``eps``."""
    _check_range(lo, hi, "threshold")
    if not lo < t < hi:
        raise ValueError(f"threshold: t={t} must lie inside the declared range ({lo}, {hi})")
    tp = (2 * t - lo - hi) / (hi - lo)
    a, b = 1e-3, 0.999 * max(1 - tp, 1 + tp)
    best = _fit_step(tp, degree, b)
    if best[1] > eps:
        raise ValueError(
            f"threshold: a degree-{degree} polynomial cannot get within eps={eps} of 0/1 "
            f"for t={t} on [{lo}, {hi}]; raise the degree or eps"
        )
    for _ in range(24):
        mid = (a + b) / 2
        c, err = _fit_step(tp, degree, mid)
        if err <= eps:
            b, best = mid, (c, err)
        else:
            a = mid
    c, err = best
    return Approximation(tuple(float(v) for v in c), lo, hi, err, margin=b * (hi - lo) / 2)
