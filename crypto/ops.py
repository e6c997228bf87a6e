"""Fabric-side operations on ciphertexts (public context only, no secret key).

Every function takes the agent's :class:`~crypto.keys.PublicContext` first and returns
new encrypted values; inputs may be ``EncryptedVector`` objects or their bytes. Each
operation checks the multiplicative depth it needs against the levels the ciphertext has
left *before* computing, and raises :class:`~crypto.errors.DepthError` naming itself,
the depth needed and a parameter set that has it.

Depth per operation: add/sub/negate/sum 0; multiply (plain or encrypted), dot, weighted,
score_dot 1; sigmoid/threshold/polyval ``1 + ceil(log2(degree)) + 1`` (affine map to
[-1, 1], Chebyshev products, coefficients).

Entry points for the query executor:

* ``score_dot(ctx, enc, candidates)`` -> ``pa.ExtensionArray`` with one encrypted score
  per candidate row (packed: one ciphertext holds up to ``slots`` scores).
* ``weighted(ctx, enc, weights, bias)`` -> ``EncryptedVector`` of one value.
* ``threshold(ctx, enc, t, lo, hi)`` / ``sigmoid(ctx, enc, lo, hi)`` -> ``EncryptedVector``.
* ``plan_info(value)`` -> ``EncryptedPlanInfo`` for ``explain``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from . import _seal
from .arrow import iter_cells, packed_array
from .errors import DepthError, ShapeError
from .keys import PublicContext, next_pow2
from .params import DEEP_PARAMS, PARAM_SETS
from .poly import Approximation, poly_depth, sigmoid_approx, step_approx
from .vector import EncryptedVector, OpRecord

METHODS = ("diagonal", "replicated", "per_candidate")

# ------------------------------------------------------------------------------ helpers


def _load(ctx: PublicContext, x: Any, what: str = "encrypted vector"):
    return ctx.ciphertext(x, what)


def _need(ctx: PublicContext, ev: EncryptedVector, ct, op: str, depth: int) -> None:
    have = ctx.engine.level(ct)
    if have >= depth:
        return
    deeper = [p.name for p in PARAM_SETS.values() if p.depth >= depth + ev.depth]
    fix = (
        f"generate the agent's key ring with KeyRing.generate(params={deeper[0]!r}) "
        f"({PARAM_SETS[deeper[0]].depth} levels)"
        if deeper
        else "lower the polynomial degree or split the computation"
    )
    used = ", ".join(str(o) for o in ev.ops) or "nothing"
    raise DepthError(
        f"{op} needs multiplicative depth {depth} but the encrypted value has {have} level(s) "
        f"left (parameter set {ctx.params.name!r} has {ctx.params.depth}; already used by: "
        f"{used}); {fix}"
    )


def _result(
    ctx, src: EncryptedVector, ct, record: OpRecord, depth: int, **layout
) -> EncryptedVector:
    lv = ctx.engine.level(ct)
    return EncryptedVector(
        params=ctx.params.name,
        key_id=ctx.key_id,
        n=layout.get("n", src.n),
        period=layout.get("period", src.period),
        stride=layout.get("stride", src.stride),
        level=lv,
        depth=depth,
        ops=(*src.ops, record),
        _ct=ct,
    )


def _slots_of(ctx, ev: EncryptedVector, values: Any, op: str) -> np.ndarray:
    """Plain operand laid out like ``ev`` (scalars broadcast to the n values only, so the
    padding slots stay zero)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 0:
        v = np.full(ev.n, float(v))
    v = v.ravel()
    if v.size != ev.n:
        raise ShapeError(
            f"{op}: plain operand has {v.size} values but the encrypted vector has {ev.n}"
        )
    if not np.all(np.isfinite(v)):
        raise ShapeError(f"{op}: plain operand contains NaN or infinite values")
    return _seal.layout(v, ev.period, ctx.params.slots, ev.stride)


def _same_layout(a: EncryptedVector, b: EncryptedVector, op: str) -> None:
    if (a.n, a.period, a.stride) != (b.n, b.period, b.stride):
        raise ShapeError(
            f"{op}: encrypted operands differ in shape/layout: encrypted[{a.n}] "
            f"(period {a.period}, stride {a.stride}) vs encrypted[{b.n}] "
            f"(period {b.period}, stride {b.stride})"
        )


def _is_encrypted(x: Any) -> bool:
    return isinstance(x, EncryptedVector | bytes | bytearray | memoryview)


# --------------------------------------------------------------------------- arithmetic


def _linear(ctx, a, b, op: str, sign: int) -> EncryptedVector:
    ea, ca = _load(ctx, a)
    eng = ctx.engine
    if _is_encrypted(b):
        eb, cb = _load(ctx, b, "second operand")
        _same_layout(ea, eb, op)
        ct = eng.add(ca, cb) if sign > 0 else eng.sub(ca, cb)
        depth = max(ea.depth, eb.depth)
    else:
        ct = eng.add_plain(ca, sign * _slots_of(ctx, ea, b, op))
        depth = ea.depth
    return _result(ctx, ea, ct, OpRecord(op, 0), depth)


def add(ctx: PublicContext, a: Any, b: Any) -> EncryptedVector:
    """``a + b``; ``b`` encrypted (same shape) or plain (scalar or n values). Depth 0."""
    return _linear(ctx, a, b, "add", 1)


def sub(ctx: PublicContext, a: Any, b: Any) -> EncryptedVector:
    """``a - b``; ``b`` encrypted (same shape) or plain. Depth 0."""
    return _linear(ctx, a, b, "sub", -1)


def negate(ctx: PublicContext, a: Any) -> EncryptedVector:
    ea, ca = _load(ctx, a)
    return _result(ctx, ea, ctx.engine.negate(ca), OpRecord("negate", 0), ea.depth)


def multiply(ctx: PublicContext, a: Any, b: Any) -> EncryptedVector:
    """Element-wise ``a * b``; ``b`` plain (scalar or n values) or encrypted. Depth 1."""
    ea, ca = _load(ctx, a)
    _need(ctx, ea, ca, "multiply", 1)
    eng = ctx.engine
    if _is_encrypted(b):
        eb, cb = _load(ctx, b, "second operand")
        _same_layout(ea, eb, "multiply")
        _need(ctx, eb, cb, "multiply", 1)
        return _result(
            ctx,
            ea,
            eng.mul(ca, cb),
            OpRecord("multiply", 1, "encrypted"),
            max(ea.depth, eb.depth) + 1,
        )
    ct = eng.mul_plain(ca, _slots_of(ctx, ea, b, "multiply"))
    return _result(ctx, ea, ct, OpRecord("multiply", 1, "plain"), ea.depth + 1)


def _check_period(ctx, ev: EncryptedVector, op: str) -> None:
    if ev.period > ctx.params.max_period:
        raise ShapeError(
            f"{op}: summing a vector laid out over {ev.period} slots needs rotations the "
            f"parameter set {ctx.params.name!r} has no keys for (up to {ctx.params.max_period}); "
            "encrypt with replicate=True or use the default parameter set"
        )


def total(ctx: PublicContext, a: Any) -> EncryptedVector:
    """Sum of the n values (rotate-and-sum, log2(period) rotations). Depth 0."""
    ea, ca = _load(ctx, a)
    return _total(ctx, ea, ca, OpRecord("sum", 0, f"n={ea.n}"), ea.depth)


def _total(
    ctx, ea: EncryptedVector, ct, record: OpRecord, depth: int, bias: float = 0.0
) -> EncryptedVector:
    _check_period(ctx, ea, record.op)
    ct = ctx.engine.sum_blocks(ct, ea.period)
    if bias:
        ct = ctx.engine.add_plain(ct, float(bias))
    # Every slot now holds the sum: a one-value vector with period 1.
    return _result(ctx, ea, ct, record, depth, n=1, period=1, stride=1)


def weighted(
    ctx: PublicContext, a: Any, weights: Sequence[float] | np.ndarray, bias: float = 0.0
) -> EncryptedVector:
    """Weighted score ``w . a + bias`` -> one encrypted value. Depth 1."""
    return _dot(ctx, a, weights, bias, "weighted")


def dot(ctx: PublicContext, a: Any, vector: Sequence[float] | np.ndarray) -> EncryptedVector:
    """Dot product with one plain vector -> one encrypted value. Depth 1."""
    return _dot(ctx, a, vector, 0.0, "dot")


def _dot(ctx: PublicContext, a: Any, w: Any, bias: float, op: str) -> EncryptedVector:
    ea, ca = _load(ctx, a)
    _need(ctx, ea, ca, op, 1)
    _check_period(ctx, ea, op)
    ct = ctx.engine.mul_plain(ca, _slots_of(ctx, ea, w, op))
    return _total(ctx, ea, ct, OpRecord(op, 1, f"d={ea.n}"), ea.depth + 1, bias)


def finish(ctx: PublicContext, a: Any) -> EncryptedVector:
    """Drop a result to the last level before sending it back: same values, ~1/3 of the
    bytes at N=8192 (1 prime instead of 3). No further multiplications are possible."""
    ea, ca = _load(ctx, a)
    return _result(ctx, ea, ctx.engine.drop_to(ca, 0), OpRecord("finish", 0), ea.depth)


# ------------------------------------------------------------------ packed dot products


@dataclass(frozen=True)
class PackedScores:
    """Scores of many candidates: row ``i`` is slot ``slots[i]`` of ``cts[ct_index[i]]``."""

    cts: tuple[EncryptedVector, ...]
    ct_index: np.ndarray
    slots: np.ndarray

    def to_arrow(self) -> pa.ExtensionArray:
        return packed_array(self.cts, self.ct_index, self.slots)

    @property
    def nbytes(self) -> int:
        """Ciphertext bytes sent back to the agent."""
        return sum(len(c.to_bytes()) for c in self.cts)


def _candidates(ev: EncryptedVector, candidates: Any) -> np.ndarray:
    if isinstance(candidates, pa.ChunkedArray):
        candidates = candidates.combine_chunks()
    if isinstance(candidates, pa.FixedSizeListArray):
        m = candidates.flatten().to_numpy(zero_copy_only=False).reshape(len(candidates), -1)
    elif isinstance(candidates, pa.Array):
        m = np.asarray(candidates.to_pylist(), dtype=np.float64)
    else:
        m = np.asarray(candidates, dtype=np.float64)
    if m.ndim == 1 and m.size == 0:
        m = m.reshape(0, ev.n)
    if m.ndim != 2 or m.shape[1] != ev.n:
        raise ShapeError(
            f"score_dot: candidates must be a (rows, {ev.n}) matrix to match encrypted[{ev.n}], "
            f"got shape {m.shape}"
        )
    if not np.all(np.isfinite(m)):
        raise ShapeError("score_dot: candidate vectors contain NaN or infinite values (nulls?)")
    return m


def _prepared_query(ctx, ev: EncryptedVector, ct, finish_: bool, op: str):
    eng = ctx.engine
    _need(ctx, ev, ct, op, 1)
    if ev.stride != 1:
        raise ShapeError(f"{op}: the encrypted vector must be a plain n-value vector (stride 1)")
    p = next_pow2(ev.n)
    if p > ctx.params.max_period:
        raise ShapeError(
            f"{op}: encrypted[{ev.n}] needs rotations by up to {p // 2} slots, but parameter set "
            f"{ctx.params.name!r} only has rotation keys for vectors of up to "
            f"{ctx.params.max_period} values; score long vectors under n8192-s40"
        )
    if ev.period != p:  # not replicated by the agent: replicate by rotations
        _check_period(ctx, ev, op)
        ct = eng.replicate(ct, p)
    if finish_:  # one level is all we need: compute on the smallest ciphertext
        ct = eng.drop_to(ct, 1)
    return ct, p


def score_dot_packed(
    ctx: PublicContext,
    enc: Any,
    candidates: Any,
    *,
    bias: float | Sequence[float] | np.ndarray = 0.0,
    method: str = "diagonal",
    finish: bool = True,
) -> PackedScores:
    """Dot products of one encrypted d-dim vector with every row of ``candidates``.

    ``diagonal`` (default): Halevi-Shoup diagonals with baby-step/giant-step rotations on
    the replicated query: ``p`` plain multiplications and ~2*sqrt(p) rotations give ``slots``
    scores in one ciphertext (p = d rounded up to a power of two). ``replicated``: ``slots/p``
    candidates per ciphertext, one multiplication then log2(p) rotate-and-sum steps, the
    score of candidate j at slot j*p. ``per_candidate``: one dot product per row (baseline).

    With ``finish`` the query is first dropped to level 1, so everything runs on the
    smallest ciphertexts, and the results come back at level 0 (smallest to send); without
    it the results keep ``level - 1`` levels for further operations. ``bias`` (a scalar or
    one value per row) is added to the scores under encryption (depth 0), which makes
    per-row weighted scores ``w_i . ctx + b_i`` a ``score_dot`` with ``W`` as candidates.
    """
    if method not in METHODS:
        raise ValueError(
            f"score_dot: unknown method {method!r}; choose one of {', '.join(METHODS)}"
        )
    ev, ct = _load(ctx, enc)
    m = _candidates(ev, candidates)
    ct, p = _prepared_query(ctx, ev, ct, finish, "score_dot")
    eng, S, rows = ctx.engine, ctx.params.slots, m.shape[0]
    padded = np.zeros((rows, p))
    padded[:, : ev.n] = m
    record = OpRecord("score_dot", 1, f"{method}, {rows} candidates x {ev.n}")
    biases = np.broadcast_to(np.asarray(bias, dtype=np.float64), (rows,))
    if not np.all(np.isfinite(biases)):
        raise ShapeError("score_dot: bias contains NaN or infinite values")
    cts: list = []
    index = np.zeros(rows, dtype=np.int64)
    slots = np.zeros(rows, dtype=np.int64)

    def done(c, start: int, positions: np.ndarray, **layout):
        """Record rows ``start ..`` held at ``positions`` of ciphertext ``c``."""
        stop = start + len(positions)
        if biases[start:stop].any():
            plain = np.zeros(S)
            plain[positions] = biases[start:stop]
            if layout["period"] == 1:  # per-candidate: the score fills every slot
                plain[:] = biases[start]
            c = eng.add_plain(c, plain)
        c = eng.drop_to(c, 0) if finish else c
        cts.append(_result(ctx, ev, c, record, ev.depth + 1, **layout))
        index[start:stop] = len(cts) - 1
        slots[start:stop] = positions

    if method == "diagonal":
        for start in range(0, rows, S):
            block = padded[start : start + S]
            y = _diagonal(eng, ct, block, p)
            done(y, start, np.arange(len(block)), n=len(block), period=S, stride=1)
    elif method == "replicated":
        per = S // p
        for start in range(0, rows, per):
            block = padded[start : start + per]
            prod = eng.rescale(eng.mul_plain_raw(ct, _fill(block.ravel(), S)))
            y = eng.sum_blocks(prod, p)
            done(y, start, np.arange(len(block)) * p, n=len(block), period=S, stride=p)
    else:
        for i in range(rows):
            prod = eng.rescale(eng.mul_plain_raw(ct, np.tile(padded[i], S // p)))
            done(eng.sum_blocks(prod, p), i, np.zeros(1, dtype=np.int64), n=1, period=1, stride=1)
    return PackedScores(tuple(cts), index, slots)


def _fill(values: np.ndarray, S: int) -> np.ndarray:
    out = np.zeros(S)
    out[: values.size] = values
    return out


def _diagonal(eng: _seal.Engine, q, block: np.ndarray, p: int):
    """Halevi-Shoup with baby-step/giant-step for a (r <= slots, p) plain block.

    With ``q`` replicated (period p), diagonal ``i`` holds ``block[s, (s+i) mod p]`` at slot
    s and ``sum_i diag_i * rot(q, i)`` puts candidate s's score in slot s. Writing
    i = g*B + b: ``y = sum_g rot(sum_b rot(diag_i, -gB) * rot(q, b), gB)``; the B-1 baby
    rotations of q are shared, the giant steps are a Horner chain of rotations by B.
    """
    S, r = eng.slots, block.shape[0]
    B = 2 ** math.ceil(math.log2(p) / 2)
    G = p // B
    baby = [q]
    for _ in range(1, B):
        baby.append(eng.rotate(baby[-1], 1))
    rows = np.arange(r)
    y = None
    for g in reversed(range(G)):
        acc = None
        for b in range(B):
            i = g * B + b
            diag = np.zeros(S)
            diag[:r] = block[rows, (rows + i) % p]
            if not diag.any():
                continue
            term = eng.mul_plain_raw(baby[b], np.roll(diag, g * B))
            acc = term if acc is None else eng.add(acc, term)
        inner = eng.rescale(acc) if acc is not None else None
        if y is not None:
            y = eng.rotate(y, B)
        y = inner if y is None else (y if inner is None else eng.add(y, inner))
    if y is None:  # every candidate is the zero vector
        y = eng.rescale(eng.mul_plain_raw(q, 0.0))
    return y


def score_dot(
    ctx: PublicContext,
    enc: Any,
    candidates: Any,
    *,
    bias: float | Sequence[float] | np.ndarray = 0.0,
    method: str = "diagonal",
    finish: bool = True,
) -> pa.ExtensionArray:
    """Encrypted score column: one ``fabric.encrypted`` scalar per candidate row, in row
    order; rows share ciphertexts (see ``score_dot_packed``). Depth 1."""
    packed = score_dot_packed(ctx, enc, candidates, bias=bias, method=method, finish=finish)
    return packed.to_arrow()


def broadcast(value: EncryptedVector, rows: int) -> pa.ExtensionArray:
    """A column of ``rows`` cells that all point at one encrypted value (stored once), e.g.
    a query-level ``weighted(...)`` score attached to every result row."""
    slot: int | None = 0 if value.n == 1 else None
    return packed_array([value], [0] * rows, [slot] * rows, value.n)


# ------------------------------------------------------------------------ polynomials


def _chebyshev(
    ctx, ev: EncryptedVector, ct, approx: Approximation, record_op: str, detail: str
) -> EncryptedVector:
    eng = ctx.engine
    deg = approx.degree
    affine = (approx.lo, approx.hi) != (-1.0, 1.0)
    depth = poly_depth(deg, affine)
    _need(ctx, ev, ct, record_op, depth)
    mask = _slots_of(ctx, ev, 1.0, record_op)
    if affine:
        alpha = 2.0 / (approx.hi - approx.lo)
        beta = -(approx.hi + approx.lo) / (approx.hi - approx.lo)
        t1 = eng.add_plain(eng.mul_plain(ct, alpha * mask), beta * mask)
    else:
        t1 = ct
    T = {1: t1}
    for k in range(2, deg + 1):
        if k & (k - 1) == 0:  # T_2a = 2 T_a^2 - 1
            a = k // 2
            T[k] = eng.add_plain(eng.mul(eng.add(T[a], T[a]), T[a]), -1.0)
        else:  # T_(a+b) = 2 T_a T_b - T_(a-b), a = largest power of two below k
            a = 2 ** int(math.log2(k - 1))
            b = k - a
            prod = eng.mul(eng.add(T[a], T[a]), T[b])
            T[k] = eng.sub(prod, T[a - b]) if a != b else eng.add_plain(prod, -1.0)
    c = np.asarray(approx.coeffs)
    scale = np.max(np.abs(c)) or 1.0
    terms = [
        eng.mul_plain(T[k], c[k] * mask) for k in range(1, deg + 1) if abs(c[k]) > 1e-12 * scale
    ]
    if not terms:
        raise ShapeError(
            f"{record_op}: the approximating polynomial is constant; nothing to compute"
        )
    out = eng.add_plain(eng.add_many(terms), c[0] * mask)
    # The padding slots are zero again: every term was multiplied by the 0/1 mask.
    return _result(ctx, ev, out, OpRecord(record_op, depth, detail), ev.depth + depth)


def sigmoid(
    ctx: PublicContext, enc: Any, lo: float = -6.0, hi: float = 6.0, degree: int = 15
) -> EncryptedVector:
    """Element-wise logistic function, valid for inputs in ``[lo, hi]``.
    Depth ``poly_depth(degree)`` (6 for degree 15; approximation error 2.1e-4 on [-6, 6])."""
    ev, ct = _load(ctx, enc)
    ap = sigmoid_approx(float(lo), float(hi), int(degree))
    detail = f"deg {degree} on [{lo:g}, {hi:g}], approx error {ap.max_error:.1e}"
    return _chebyshev(ctx, ev, ct, ap, "sigmoid", detail)


def threshold(
    ctx: PublicContext,
    enc: Any,
    t: float,
    lo: float,
    hi: float,
    *,
    degree: int = 15,
    eps: float = 0.05,
) -> EncryptedVector:
    """Encrypted decision ``x > t`` (~1) / ``x <= t`` (~0) for inputs in ``[lo, hi]``.

    Values at least ``margin`` away from ``t`` decrypt within ``eps`` (+ CKKS noise) of
    0/1; ``threshold_margin(t, lo, hi, degree, eps)`` says the margin before running.
    Depth ``poly_depth(degree)`` (6 for degree 15): needs the ``n16384-s40`` set."""
    ev, ct = _load(ctx, enc)
    ap = step_approx(float(t), float(lo), float(hi), int(degree), float(eps))
    detail = f"x > {t:g} on [{lo:g}, {hi:g}], deg {degree}, margin {ap.margin:.3g}, eps {eps:g}"
    return _chebyshev(ctx, ev, ct, ap, "threshold", detail)


def threshold_margin(t: float, lo: float, hi: float, degree: int = 15, eps: float = 0.05) -> float:
    """Half-width of the band around ``t`` where ``threshold`` makes no promise."""
    return step_approx(float(t), float(lo), float(hi), int(degree), float(eps)).margin


def polyval(
    ctx: PublicContext,
    enc: Any,
    coeffs: Sequence[float] | np.ndarray,
    lo: float = -1.0,
    hi: float = 1.0,
) -> EncryptedVector:
    """Evaluate ``sum_k coeffs[k] * T_k(u)``, ``u = (2x - lo - hi)/(hi - lo)`` (Chebyshev
    series on ``[lo, hi]``, e.g. from ``numpy.polynomial.Chebyshev.fit(...).coef``)."""
    ev, ct = _load(ctx, enc)
    ap = Approximation(tuple(float(c) for c in coeffs), float(lo), float(hi), 0.0)
    if ap.degree < 1:
        raise ShapeError("polyval: give at least two coefficients (degree >= 1)")
    return _chebyshev(ctx, ev, ct, ap, "polyval", f"deg {ap.degree} on [{lo:g}, {hi:g}]")


def power_depth(degree: int) -> int:
    """Levels used by ``poly``: ``c_k x^k`` is computed as ``(c_k x) * x^(k-1)``."""
    if degree <= 1:
        return 1
    return max(1, math.ceil(math.log2(degree - 1))) + 1


def poly(ctx: PublicContext, enc: Any, coeffs: Sequence[float]) -> EncryptedVector:
    """Element-wise ``c0 + c1 x + c2 x^2 + ...`` (power basis, the DSL's ``poly``).

    Depth ``power_depth(degree)``: 1 for degree 1, 2 for degree 2-3 (fits ``n8192-s40``,
    e.g. the classic sigmoid ``0.5 + 0.197x - 0.004x^3`` on [-5, 5]), 3 up to degree 5.
    Large power-basis coefficients amplify CKKS noise; for an approximation on a range
    prefer ``polyval`` (Chebyshev basis)."""
    ev, ct = _load(ctx, enc)
    c = np.asarray(coeffs, dtype=np.float64).ravel()
    if c.size < 2 or not np.all(np.isfinite(c)):
        raise ShapeError("poly: give at least two finite coefficients [c0, c1, ...]")
    deg = int(np.max(np.flatnonzero(c))) if c[1:].any() else 0
    if deg == 0:
        raise ShapeError("poly: the polynomial is constant; nothing to compute under encryption")
    depth = power_depth(deg)
    _need(ctx, ev, ct, "poly", depth)
    eng = ctx.engine
    mask = _slots_of(ctx, ev, 1.0, "poly")
    powers = {1: ct}  # x^k at depth ceil(log2 k)
    for k in range(2, deg):
        a = 2 ** int(math.log2(k - 1)) if k & (k - 1) else k // 2
        powers[k] = eng.mul(powers[a], powers[k - a])
    terms = []
    for k in range(1, deg + 1):
        if c[k] == 0.0:
            continue
        term = eng.mul_plain(ct, c[k] * mask)
        terms.append(term if k == 1 else eng.mul(term, powers[k - 1]))
    out = eng.add_many(terms)
    if c[0]:
        out = eng.add_plain(out, c[0] * mask)
    record = OpRecord("poly", depth, f"deg {deg}")
    return _result(ctx, ev, out, record, ev.depth + depth)


def score_column(
    ctx: PublicContext,
    fn: str,
    enc: Any,
    arg: Any,
    bias: float = 0.0,
    *,
    rows: int,
) -> pa.ExtensionArray:
    """One entry point for the executor's ``EncryptedScore`` node (DSL functions
    ``dot``, ``weighted``, ``poly``), returning an encrypted column of ``rows`` cells.

    * ``dot(ctx, col)`` / ``weighted(ctx, col, b)`` with a vector *column* (Arrow array of
      vectors or 2-D array, one per row): packed ``score_dot`` (+ bias), one score per row.
    * ``dot(ctx, [..])`` / ``weighted(ctx, [..], b)`` with one plain vector: a single
      encrypted value shared by every row.
    * ``poly(ctx, [c0, c1, ..])``: the element-wise polynomial, shared by every row.
    """
    if fn == "poly":
        return broadcast(poly(ctx, enc, arg), rows)
    if fn not in ("dot", "weighted"):
        raise ValueError(f"unknown encrypted function {fn!r}; expected dot, weighted or poly")
    is_column = isinstance(arg, pa.Array | pa.ChunkedArray) or np.ndim(arg) == 2
    if is_column:
        if len(arg) != rows:
            raise ShapeError(f"{fn}: {len(arg)} vectors for {rows} rows")
        return score_dot(ctx, enc, arg, bias=bias)
    return broadcast(weighted(ctx, enc, arg, bias), rows)


# ---------------------------------------------------------------------------- explain


def depth_of(op: str, degree: int | None = None) -> int:
    """Multiplicative depth an operation needs (for planning and ``explain``)."""
    if op in ("add", "sub", "negate", "sum", "finish"):
        return 0
    if op in ("multiply", "dot", "weighted", "score_dot"):
        return 1
    if op in ("sigmoid", "threshold", "polyval"):
        return poly_depth(degree or 15)
    if op == "poly":
        return power_depth(degree or 1)
    raise ValueError(f"unknown encrypted operation {op!r}")


@dataclass(frozen=True)
class EncryptedPlanInfo:
    """What ran under encryption: the operations (from the ciphertext's own record), the
    multiplicative depth used and the levels the parameter set provides."""

    ops: tuple[OpRecord, ...]
    depth: int
    levels: int
    params: str

    def __str__(self) -> str:
        chain = " -> ".join(str(o) for o in self.ops)
        return f"encrypted ({self.params}, depth {self.depth} of {self.levels}): {chain}"


def plan_info(x: Any) -> EncryptedPlanInfo:
    """Describe an encrypted value or column (reads the first non-null cell's header)."""
    if isinstance(x, bytes | bytearray | memoryview):
        x = EncryptedVector.from_bytes(bytes(x))
    if not isinstance(x, EncryptedVector):
        blob = next((fetch() for key, fetch, _ in iter_cells(x) if key is not None), None)
        if blob is None:
            return EncryptedPlanInfo((), 0, 0, "")
        x = EncryptedVector.from_bytes(blob)
    return EncryptedPlanInfo(x.ops, x.depth, PARAM_SETS[x.params].depth, x.params)


__all__ = [
    "DEEP_PARAMS",
    "METHODS",
    "EncryptedPlanInfo",
    "PackedScores",
    "add",
    "broadcast",
    "depth_of",
    "dot",
    "finish",
    "multiply",
    "negate",
    "plan_info",
    "poly",
    "polyval",
    "power_depth",
    "score_column",
    "score_dot",
    "score_dot_packed",
    "sigmoid",
    "sub",
    "threshold",
    "threshold_margin",
    "total",
    "weighted",
]
