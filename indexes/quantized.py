"""An 8-bit first pass for exact top-k over gathered candidate rows.

A filter whose rows are scattered over the row ids (whole clusters, a category, a
keyword) leaves the exact path a *gather*: ~20k rows of 128 float32 each fetched by
index, memory-bound (PERF_FACTS: ~90 ns per row against ~24 ns contiguous). ``Codes``
keeps beside the float32 matrix a copy of every row in 8 bits per dimension (scalar
quantization: ``x_j ~ mid_j + step_j * c_j`` with ``c_j`` in -127..127), a quarter of the
bytes. ``shortlist`` gathers the candidates' codes, scores them all with an integer dot
product, and keeps only the rows whose score could still put them in the exact top-k;
the caller then computes exact float32 distances on that shortlist (tens to hundreds of
rows) exactly as it would have on all candidates. The answer is the same rows with the
same distances as the exact pass, never an approximation, because the shortlist is cut
with a proven bound, not a guess:

For a row ``x`` and the query ``q`` let ``d32`` be the float32 distance the exact path
computes (``VectorIndex.distances``) and ``key`` the first pass's score (a float64 affine
function of the integer dot, the same for every row up to a per-query constant). Then
``|d32 - (key + const)| <= B`` for every *safe* row, with ``B`` per query (below). If
``K`` is the k-th smallest key, k rows have ``d32 <= K + const + B``, so a row whose
``key > K + 2B`` has ``d32 > K + const + B``, strictly worse than those k: it cannot be in
the top-k, whatever the tie rule. The shortlist is every row with ``key <= K + 2B`` plus
every row that is not safe; rows tied at the k-th distance are all in it, so the lowest
row ids win exactly as in ``indexes.retrieval.topk``.

The bound, per query (``_bound``; u = 2**-24 is float32's unit roundoff, d the dimension,
``gamma = d u / (1 - d u)``, Higham's bound for a float32 dot product in any order):

- quantization: the stored row is ``x = mid + step * c + e`` with ``|e_j| <= err_j``
  (measured when the codes are fitted, in float64, with a margin for its own rounding),
  so ``|x.q - (mid.q + c.(step q))| <= sum_j err_j |q_j|``;
- the query side, ``c.w`` with ``w = step * q``: the numkong kernel splits ``w`` into two
  int8 vectors, ``w = t1 r1 + t2 r2 + rest``, and computes ``c.r1`` and ``c.r2`` exactly
  in integers, leaving ``|c.rest| <= 127 sum_j |rest_j|`` (about 1/32,000 of ``w``); the
  numpy kernel computes ``c.float32(w)`` in float32, leaving ``127 (sum_j |w_j -
  float32(w_j)| + gamma sum_j |w_j|)`` plus float32 underflow;
- float32 rounding of the exact pass itself: ``|fl(x.q) - x.q| <= gamma |x| |q|``, plus a
  few roundings of the final arithmetic (``l2``: ``aux - 2 dot + q.q``; ``ip``: ``1 -
  dot``; ``cosine``: ``1 - dot * inv_norm(x) * inv_norm(q)``), bounded through the largest
  norm among safe rows, and an absolute term for float32 underflow (tiny vectors);
- the float64 arithmetic of the first pass, a relative ``2**-40`` of the magnitudes.

Under ``cosine`` the codes quantize ``x * inv_norm(x)`` (the stored float32 inverse norm,
``VectorIndex.aux``; the product of two float32 numbers is exact in float64), so one
bound serves rows of any norm, tiny ones included. A row is *safe* when it is finite,
its norm is at most ``2**60`` (no float32 overflow in its distance for a query of norm
at most ``2**60``; a larger query skips the first pass) and, for rows appended after the
fit, its codes are within ``err`` of it (not clipped); a row that is not safe (NaN, inf,
huge, outside the fitted range) is always in the shortlist, so its distance is whatever
the exact pass computes. When too many appended rows are unsafe, the codes are fitted
again over every stored row.

Kernels: ``numkong`` (SIMD int8 dot products with int32 accumulation, AVX-512 VNNI /
AVX2 / NEON) when it is installed, else numpy (the codes converted to float32 chunk by
chunk, one single-threaded einsum each). ``set_kernel("numpy")`` forces the fallback
(tests run both; the cost model's calibration measures whichever is active).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

LEVELS = 127  # codes are -LEVELS..LEVELS (int8, symmetric: |c| <= 127 bounds c.w's error)
U32 = 2.0**-24  # float32 unit roundoff
NORM_MAX = 2.0**60  # rows (and queries) above this norm are not safe (float32 overflow)
MARGIN = 1 / 8  # the fitted range is widened by this share of it on each side (rows
# appended later mostly fall inside: fewer unsafe rows, for a bound ~20 % wider)
CHUNK = 4096  # rows gathered and scored per kernel call (stays in cache)
REFIT_SHARE = 1 / 64  # refit when unsafe rows exceed this share of the stored rows
REFIT_MIN = 64  # ... and this many


def _numkong() -> Any:
    try:
        import numkong
    except ImportError:
        return None
    return numkong


ENABLED = True  # retrieval.exact_on uses the first pass (benchmarks switch it off to compare)
_NK = _numkong()
KERNEL = "numkong" if _NK is not None else "numpy"


def set_kernel(name: str) -> str:
    """Choose the integer dot-product kernel: ``numkong`` (if installed) or ``numpy``;
    returns the previous one."""
    global KERNEL
    if name not in ("numkong", "numpy"):
        raise ValueError(f"unknown kernel {name!r}: use 'numkong' or 'numpy'")
    if name == "numkong" and _NK is None:
        raise ValueError("the numkong kernel needs `pip install numkong`")
    old, KERNEL = KERNEL, name
    return old


class Codes:
    """8-bit codes of one vector column's stored rows (row id = code row), kept in step
    with ``VectorIndex.append``."""

    def __init__(self, dim: int, metric: str):
        self.dim, self.metric = dim, metric
        self.codes = np.zeros((0, dim), dtype=np.int8)
        self.safe = np.zeros(0, dtype=bool)
        self.n = 0
        self.unsafe = 0  # rows below n that are not safe
        self.fitted = False
        self.mid = np.zeros(dim)
        self.step = np.zeros(dim)
        self.err = np.zeros(dim)  # |x_j - (mid_j + step_j c_j)| <= err_j on safe rows
        self.umax = 0.0  # largest norm of a safe row's quantized vector (float64)
        self.amax = 0.0  # largest aux of a safe row (l2: squared norm; cosine: 1/norm)
        self._local = threading.local()

    # ------------------------------------------------------------------ storage
    def nbytes(self) -> int:
        return self.n * (self.dim + 1)

    def _rows64(self, m: np.ndarray, aux: np.ndarray) -> np.ndarray:
        """What is quantized: the rows (l2, ip) or the rows times their inverse norm
        (cosine; exact in float64)."""
        u = m.astype(np.float64)
        if self.metric == "cosine":
            u *= aux.astype(np.float64)[:, None]
        return u

    def _candidates(self, m: np.ndarray, aux: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Rows whose exact distance the bound covers: finite, norm at most NORM_MAX."""
        with np.errstate(over="ignore", invalid="ignore"):
            fin = np.isfinite(u).all(axis=1) & np.isfinite(aux)
            nrm = np.sqrt(np.einsum("ij,ij->i", m, m, dtype=np.float64))
        return fin & (nrm <= NORM_MAX)  # type: ignore[no-any-return]

    def append(self, start: int, end: int, vectors: np.ndarray, aux: np.ndarray) -> None:
        """Codes for rows ``start..end-1`` of ``vectors`` (the column's whole matrix, with
        ``aux`` as ``VectorIndex`` keeps it: the rows below ``start`` are there for a
        refit)."""
        if end > len(self.codes):
            cap = max(end, 2 * len(self.codes), 1024)
            c = np.zeros((cap, self.dim), dtype=np.int8)
            c[: self.n] = self.codes[: self.n]
            s = np.zeros(cap, dtype=bool)
            s[: self.n] = self.safe[: self.n]
            self.codes, self.safe = c, s
        if start < self.n:  # rows stored again: forget what they were
            self.unsafe -= int(np.count_nonzero(~self.safe[start : min(end, self.n)]))
        if not self.fitted:
            self.fit(vectors[:end], aux[:end])
            return
        for s0 in range(start, end, CHUNK):
            s1 = min(end, s0 + CHUNK)
            self._encode(s0, vectors[s0:s1], aux[s0:s1])
        self.n = max(self.n, end)
        if self.unsafe > REFIT_MIN + REFIT_SHARE * self.n:
            self.fit(vectors[: self.n], aux[: self.n])

    def fit(self, vectors: np.ndarray, aux: np.ndarray) -> None:
        """Fit mid / step to the safe rows among ``vectors`` (every stored row, with their
        aux) and encode them all."""
        n = len(vectors)
        lo = np.full(self.dim, np.inf)
        hi = np.full(self.dim, -np.inf)
        for s0 in range(0, n, CHUNK):
            mm, aa = vectors[s0 : s0 + CHUNK], aux[s0 : s0 + CHUNK]
            u = self._rows64(mm, aa)
            ok = self._candidates(mm, aa, u)
            if ok.any():
                lo = np.minimum(lo, u[ok].min(axis=0))
                hi = np.maximum(hi, u[ok].max(axis=0))
        if not np.isfinite(lo).all():  # no safe row: nothing to fit to yet
            lo = hi = np.zeros(self.dim)
        width = hi - lo
        lo, hi = lo - MARGIN * width, hi + MARGIN * width
        self.mid = (lo + hi) / 2
        self.step = (hi - lo) / (2 * LEVELS)
        # |e_j| <= step_j / 2 inside the range, plus float64 rounding of the reconstruction
        self.err = self.step / 2 * (1 + 2.0**-30) + 2.0**-40 * (np.abs(self.mid) + hi - lo)
        self.fitted = True
        self.unsafe, self.umax, self.amax = 0, 0.0, 0.0
        if len(self.codes) < n:
            self.codes = np.zeros((max(n, 1024), self.dim), dtype=np.int8)
            self.safe = np.zeros(max(n, 1024), dtype=bool)
        for s0 in range(0, n, CHUNK):
            self._encode(s0, vectors[s0 : s0 + CHUNK], aux[s0 : s0 + CHUNK])
        self.n = n

    def _encode(self, start: int, m: np.ndarray, aux: np.ndarray) -> None:
        u = self._rows64(m, aux)
        ok = self._candidates(m, aux, u)
        step = np.where(self.step > 0, self.step, 1.0)
        with np.errstate(invalid="ignore", over="ignore"):
            c = np.rint((np.where(ok[:, None], u, 0.0) - self.mid) / step)
            c = np.clip(c, -LEVELS, LEVELS)
            c = np.where(self.step > 0, c, 0.0)
            e = np.abs(u - (self.mid + self.step * c))
        ok &= (e <= self.err).all(axis=1)
        end = start + len(m)
        self.codes[start:end] = c.astype(np.int8)
        self.safe[start:end] = ok
        self.unsafe += int(len(m) - np.count_nonzero(ok))
        if ok.any():
            un = np.sqrt(np.einsum("ij,ij->i", u[ok], u[ok]))
            self.umax = max(self.umax, float(un.max()) * (1 + 2.0**-40))
            self.amax = max(self.amax, float(np.abs(aux[ok]).max()))

    # ------------------------------------------------------------------ the first pass
    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        b = getattr(self._local, "buf", None)
        if b is None or b[0].shape[1] != self.dim:
            b = self._local.buf = (
                np.empty((CHUNK, self.dim), dtype=np.int8),
                np.empty((CHUNK, self.dim), dtype=np.float32),
            )
        return b  # type: ignore[no-any-return]

    def _int_dots(self, ids: np.ndarray, r: np.ndarray) -> np.ndarray:
        """numkong: exact integer dot products ``codes[ids] . r[i]`` for the two rows of
        ``r`` (int8), as float64 (m x 2)."""
        assert _NK is not None
        out = np.empty((len(ids), 2), dtype=np.float64)
        cbuf, _ = self._buffers()
        packed = _NK.dots_pack(r)
        for s0 in range(0, len(ids), CHUNK):
            part = ids[s0 : s0 + CHUNK]
            b = cbuf[: len(part)]
            np.take(self.codes, part, axis=0, out=b)
            out[s0 : s0 + len(part)] = np.asarray(_NK.dots_packed(b, packed))
        return out

    def _float_dots(self, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """numpy: ``codes[ids] . w`` (w float32) in float32 -- the codes converted chunk by
        chunk into a reused buffer, one single-threaded einsum per chunk (a BLAS matmul
        here spawns threads that cost 20-50x on a loaded machine) -- as float64."""
        out = np.empty(len(ids), dtype=np.float64)
        cbuf, fbuf = self._buffers()
        for s0 in range(0, len(ids), CHUNK):
            part = ids[s0 : s0 + CHUNK]
            b, f = cbuf[: len(part)], fbuf[: len(part)]
            np.take(self.codes, part, axis=0, out=b)
            np.copyto(f, b)
            out[s0 : s0 + len(part)] = np.einsum("ij,j->i", f, w)
        return out

    def shortlist(
        self, q: np.ndarray, ids: np.ndarray, k: int, aux: np.ndarray
    ) -> np.ndarray | None:
        """The rows of ``ids`` (sorted int64 row ids below ``n``) that can be in the exact
        top-k of ``q`` (float32, finite), in ``ids`` order; None when the first pass cannot
        vouch for this query (no fit, too few safe rows, a query norm above NORM_MAX): the
        caller computes every distance then. ``aux``: ``VectorIndex.aux``."""
        if len(ids) <= k:
            return None
        fp = self.first_pass(q, ids, aux)
        if fp is None:
            return None
        key, bound, _ = fp
        safe = None if not self.unsafe else self.safe[ids]
        kth = _kth(key if safe is None else key[safe], k)
        if kth is None:
            return None
        keep = key <= kth + 2 * bound
        if safe is not None:
            keep |= ~safe
        return ids[keep]  # type: ignore[no-any-return]

    def first_pass(
        self, q: np.ndarray, ids: np.ndarray, aux: np.ndarray
    ) -> tuple[np.ndarray, float, float] | None:
        """(key, B, const): for every safe row of ``ids``, ``|d32 - (key + const)| <= B``
        where ``d32`` is ``VectorIndex.distances``' float32 distance (module docstring);
        None when the query's norm is above NORM_MAX or nothing is fitted."""
        if not self.fitted:
            return None
        q64 = q.astype(np.float64)
        qn = math.sqrt(float(q64 @ q64))
        if not qn <= NORM_MAX:
            return None
        w = self.step * q64
        if KERNEL == "numkong" and _NK is not None:  # w = t1 r1 + t2 r2 + rest, r int8
            t1 = float(np.abs(w).max()) / LEVELS
            r1 = np.rint(w / t1) if t1 > 0 else np.zeros(self.dim)
            rest = w - t1 * r1
            t2 = float(np.abs(rest).max()) / LEVELS
            r2 = np.rint(rest / t2) if t2 > 0 else np.zeros(self.dim)
            rest = rest - t2 * r2
            p = self._int_dots(ids, np.stack([r1, r2]).astype(np.int8))
            key = p[:, 0] * t1
            key += p[:, 1] * t2  # c.(step q), up to the bound; mid.q is in const
            # |c.rest| <= 127 sum |rest|: integer dots are exact
            b_query = LEVELS * float(np.abs(rest).sum())
        else:  # one float32 dot: its rounding, and w's to float32, are in the bound
            w32 = w.astype(np.float32)
            key = self._float_dots(ids, w32)
            a32 = np.abs(w32.astype(np.float64))
            gamma = self.dim * U32 / (1 - self.dim * U32)
            b_query = (
                LEVELS * (float(np.abs(w - w32).sum()) + gamma * float(a32.sum()))
                + 4 * self.dim * 2.0**-149
            )
        bound, scale = self._bound(q, q64, qn, w, b_query)
        if not math.isfinite(bound):
            return None
        mq = float(self.mid @ q64)
        if self.metric == "l2":  # distance = aux - 2 x.q + q.q
            key *= -2.0
            key += aux[ids]
            return key, bound, -2.0 * mq + float(q @ q)
        key *= -scale  # ip: 1 - x.q; cosine: 1 - (x inv(x)).q inv(q)
        return key, bound, 1.0 - mq * scale

    def _bound(
        self,
        q: np.ndarray,
        q64: np.ndarray,
        qn: float,
        w: np.ndarray,
        b_query: float,
    ) -> tuple[float, float]:
        """(B, scale): |d32 - (key + const)| <= B for every safe row; ``scale`` multiplies
        the dot in ``key`` (cosine: the float32 inverse query norm the exact path uses)."""
        d, u = self.dim, U32
        gamma = d * u / (1 - d * u)
        aq = np.abs(q64)
        # |x.q - (mid.q + t1 c.r1 + t2 c.r2)|: quantization, and what r1, r2 leave of w
        b_dot = float(self.err @ aq) + b_query
        # float64 arithmetic of the first pass (w, the split, mid.q, the products)
        mag = float(np.abs(self.mid) @ aq) + LEVELS * float(np.abs(w).sum()) * 4
        b_dot += 2.0**-40 * mag
        xq = self.umax * qn  # |x| |q| for any safe row (cosine: |x inv| |q|)
        tiny = 8 * d * 2.0**-149  # float32 underflow in one dot product, absolute
        if self.metric == "l2":
            qq = float(q @ q)  # the exact path's float32 q.q
            mag2 = self.amax + 2 * xq * (1 + gamma) + qq
            b = 2 * (b_dot + gamma * xq + tiny) + 3.01 * u * mag2 + 2.0**-40 * (mag2 + 2 * mag)
            return b * (1 + 2.0**-20), 1.0
        if self.metric == "ip":
            mag2 = 1 + xq * (1 + gamma)
            b = b_dot + gamma * xq + tiny + 2.01 * u * mag2 + 2.0**-40 * (mag2 + mag)
            return b * (1 + 2.0**-20), 1.0
        # cosine, as VectorIndex.dist_from_dots computes it: inv = float32(1 / |q|)
        inv = float(np.float32(1.0 / qn)) if qn > 0 else 0.0  # (as a float32 factor)
        p_max = (xq * (1 + gamma) + tiny * self.amax) * inv
        b = (
            inv * (b_dot + gamma * xq + tiny * self.amax)
            + 2.01 * u * p_max
            + 1.01 * u * (1 + p_max)
            + 2.0**-148 * (1 + inv)  # float32 underflow in the two products
            + 2.0**-40 * (1 + inv * mag)
        )
        return b * (1 + 2.0**-20), inv


def _kth(key: np.ndarray, k: int) -> float | None:
    """The k-th smallest of ``key``, None if it holds fewer than k."""
    n = len(key)
    if n < k:
        return None
    if n >= 4096 and n >= 16 * k:  # a strided sample bounds it from above: partition less
        sample = key[:: max(2, int((n / k) ** 0.5))]
        bound = np.partition(sample, k - 1)[k - 1]
        sel = key[key <= bound]
        if len(sel) >= k:
            return float(np.partition(sel, k - 1)[k - 1])
    return float(np.partition(key, k - 1)[k - 1])
