"""CKKS scoring benchmark: one encrypted 128-d vector against many plaintext candidates.

Compares, in one run, on the default parameter set (n8192-s40, 4096 slots):

* ``diagonal``      packed: Halevi-Shoup diagonals + baby-step/giant-step rotations
                    (the default of ``crypto.ops.score_dot``), 4096 scores per ciphertext;
* ``replicated``    packed: 32 copies of the query per ciphertext, one multiply and
                    7 rotate-and-sum steps per 32 candidates;
* ``per-candidate`` one encrypted dot product per candidate on the same engine;
* ``tenseal .dot``  one ``tenseal.CKKSVector.dot`` per candidate (the naive baseline);
* ``numpy``         the plaintext matrix-vector product, for scale.

Per-candidate methods are timed on a subset and extrapolated linearly (marked ``*``).
"Bytes" are ciphertext bytes moved: the query uploaded once plus the results returned.
A second table times the polynomial decisions on the deep set (n16384-s40).

    .venv/bin/python benchmarks/ckks.py [--repeat 3] [--subset 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import tenseal as ts

from crypto import KeyRing, PublicContext, ops
from crypto.poly import sigmoid_approx, step_approx


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def unit(rng, *shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def tenseal_baseline(q, cands, subset: int):
    """Per-candidate TenSEAL dot products (N=8192, [60,40,40,60], all Galois keys)."""
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    ctx.global_scale = 2**40
    ctx.generate_galois_keys()
    enc = ts.ckks_vector(ctx, q.tolist())
    rows = [c.tolist() for c in cands[:subset]]
    t = time.perf_counter()
    res = [enc.dot(r) for r in rows]
    per = (time.perf_counter() - t) / subset
    nbytes = len(res[0].serialize())
    err = max(abs(r.decrypt()[0] - float(c @ q)) for r, c in zip(res, cands[:subset]))
    return per, nbytes, len(enc.serialize()), err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--subset", type=int, default=48, help="candidates timed for per-candidate methods"
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    d = 128
    q, cands = unit(rng, d), unit(rng, 8192, d)

    t = time.perf_counter()
    ring = KeyRing.generate()
    pub_bytes = ring.public_context()
    keygen = time.perf_counter() - t
    t = time.perf_counter()
    pub = PublicContext.load(pub_bytes)
    load = time.perf_counter() - t
    enc_t, enc = timed(lambda: ring.encrypt(q), args.repeat)
    up = len(enc.to_bytes())
    print(
        f"n8192-s40: key ring + public context {keygen * 1e3:.0f} ms, public context "
        f"{len(pub_bytes) / 2**20:.1f} MiB (load {load * 1e3:.0f} ms); encrypt {enc_t * 1e3:.1f} ms, "
        f"query ciphertext {up / 1024:.0f} KiB\n"
    )
    ts_per, ts_bytes, ts_up, ts_err = tenseal_baseline(q, cands, args.subset)
    ops.score_dot_packed(pub, enc, cands[:64])  # warm up

    # Per-candidate costs do not depend on how many candidates there are: time once.
    sub = cands[: args.subset]
    sub_t, sub_packed = timed(
        lambda: ops.score_dot_packed(pub, enc, sub, method="per_candidate"), 1
    )
    sub_err = np.max(np.abs(ring.decrypt(sub_packed.to_arrow()) - sub @ q))
    per_t, per_bytes = sub_t / args.subset, sub_packed.nbytes / args.subset

    rows = []
    for n in (1024, 8192):
        c = cands[:n]
        want = c @ q
        np_t, _ = timed(lambda c=c: c @ q, 50)
        for method in ("diagonal", "replicated"):
            rep = args.repeat if method == "diagonal" or n == 1024 else 1
            lat, packed = timed(
                lambda c=c, m=method: ops.score_dot_packed(pub, enc, c, method=m), rep
            )
            got = ring.decrypt(packed.to_arrow())
            err = np.max(np.abs(got - want))
            rows.append((method, n, lat, False, len(packed.cts), up + packed.nbytes, err))
        rows.append(("per-candidate", n, per_t * n, True, n, up + per_bytes * n, sub_err))
        rows.append(("tenseal .dot", n, ts_per * n, True, n, ts_up + ts_bytes * n, ts_err))
        rows.append(("numpy (plain)", n, np_t, False, 0, 0, 0.0))

    base = {n: lat for m, n, lat, *_ in rows if m == "tenseal .dot"}
    mine = {n: lat for m, n, lat, *_ in rows if m == "per-candidate"}
    print(
        f"{'method':<15}{'cands':>7}{'latency ms':>13}{'us/cand':>10}{'cts back':>10}"
        f"{'MiB moved':>11}{'max |err|':>11}{'vs tenseal':>12}{'vs per-cand':>13}"
    )
    for m, n, lat, extrap, nct, nbytes, err in rows:
        star = "*" if extrap else " "
        ratios = (
            f"{'-':>12}{'-':>13}"
            if m.startswith("numpy")
            else f"{base[n] / lat:>11.1f}x{mine[n] / lat:>12.1f}x"
        )
        print(
            f"{m:<15}{n:>7}{lat * 1e3:>12.3f}{star}{lat / n * 1e6:>10.2f}{nct:>10}"
            f"{nbytes / 2**20:>11.2f}{err:>11.1e}{ratios}"
        )
    print("* timed on", args.subset, "candidates and extrapolated linearly\n")

    # Polynomial decisions on the deep parameter set.
    t = time.perf_counter()
    deep = KeyRing.generate("n16384-s40")
    dpub_bytes = deep.public_context()
    dkey = time.perf_counter() - t
    dpub = PublicContext.load(dpub_bytes)
    x = np.array([0.7, 0.2, 0.9])
    w = np.array([0.2, 0.6, 0.2])
    ex = deep.encrypt(x)
    print(
        f"n16384-s40: key ring + public context {dkey * 1e3:.0f} ms, public context "
        f"{len(dpub_bytes) / 2**20:.1f} MiB, ciphertext {len(ex.to_bytes()) / 1024:.0f} KiB"
    )
    xs = np.linspace(0, 1, 64)
    exs = deep.encrypt(xs)
    sig = np.linspace(-6, 6, 64)
    esig = deep.encrypt(sig)
    cases = [
        (
            "weighted d=3",
            lambda: ops.weighted(dpub, ex, w, 0.0),
            lambda r: abs(deep.decrypt(r)[0] - x @ w),
        ),
        (
            "sigmoid deg15 [-6,6]",
            lambda: ops.sigmoid(dpub, esig, -6, 6),
            lambda r: np.max(np.abs(deep.decrypt(r) - sigmoid_approx(-6.0, 6.0, 15)(sig))),
        ),
        (
            "threshold deg15 t=.7 [0,1]",
            lambda: ops.threshold(dpub, exs, 0.7, 0, 1),
            lambda r: np.max(np.abs(deep.decrypt(r) - step_approx(0.7, 0.0, 1.0, 15, 0.05)(xs))),
        ),
    ]
    print(f"{'operation':<28}{'latency ms':>12}{'depth':>7}{'|enc - plain poly|':>20}")
    for name, fn, err in cases:
        lat, r = timed(fn, args.repeat)
        print(f"{name:<28}{lat * 1e3:>12.1f}{r.depth:>7}{err(r):>20.1e}")
    print(
        f"threshold margin (t=0.7 on [0,1], deg 15, eps 0.05): {ops.threshold_margin(0.7, 0, 1):.3f}; "
        f"sigmoid deg 15 on [-6,6] approximation error {sigmoid_approx(-6.0, 6.0, 15).max_error:.1e}"
    )


if __name__ == "__main__":
    main()
