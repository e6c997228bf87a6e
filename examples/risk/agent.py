"""Risk: an encrypted context [intent, risk, urgency] scored against policies under CKKS.

The agent encrypts its context with its own key ring (``crypto.KeyRing``); the fabric
holds only the public context, computes ``dot(ctx, weights)`` for every active policy on
the ciphertext, and returns encrypted scores that only the agent can decrypt. Each
decrypted score is checked to be within 1e-3 of the same dot product in plain numpy.

    python examples/risk/agent.py [--seed 7] [--scale 1.0] [--context 0.7,0.2,0.9]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout (or site-packages) root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import pyarrow as pa

from examples.embedded import embedded, generate, parser

HERE = Path(__file__).resolve().parent
BOUND = 1e-3  # CKKS is approximate: the stated error bound of a decrypted score


def ask(fab, ring, context: list[float]) -> dict[str, float]:
    """The agent's side: encrypt, query, decrypt (only the agent holds the secret key)."""
    res = fab.query("risk_check", session={"ctx": ring.encrypt(context)})
    names = res.table["policy"].to_pylist()
    return {
        name: float(np.ravel(ring.decrypt(res.table.column("risk")[i]))[0])
        for i, name in enumerate(names)
    }


def reference(data: dict[str, pa.Table], context: list[float]) -> dict[str, float]:
    """The plain scores of the active policies, in numpy (no fabric, no encryption)."""
    pol = data["risk_policies"]
    w = np.asarray(pol["weights"].combine_chunks().values).reshape(-1, 3)
    scores = w @ np.asarray(context)
    return {
        name: float(s)
        for name, s, active in zip(pol["policy"].to_pylist(), scores, pol["active"].to_pylist())
        if active
    }


def main(argv: list[str] | None = None) -> int:
    from crypto import KeyRing

    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--context", default="0.7,0.2,0.9", help="intent,risk,urgency (0.7,0.2,0.9)")
    args = ap.parse_args(argv)
    context = [float(x) for x in args.context.split(",")]
    data = generate(args.seed, args.scale)
    ring = KeyRing.generate()  # the agent's side: the secret key never leaves this object
    with tempfile.TemporaryDirectory(prefix="fabric-example-risk-") as tmp:
        pub = Path(tmp) / "agent.pub"
        pub.write_bytes(ring.public_context())  # evaluation keys only, no secret key
        with embedded("risk", HERE, data, FABRIC_AGENT_PUBLIC_CONTEXT=str(pub)) as (fab, _):
            got = ask(fab, ring, context)
    ref = reference(data, context)
    thresholds = dict(zip(data["risk_policies"]["policy"].to_pylist(),
                          data["risk_policies"]["threshold"].to_pylist()))  # fmt: skip
    print(f"context {context} scored against {len(got)} active policies on ciphertexts:")
    for name, score in list(got.items())[:10]:
        flag = "ABOVE" if score > thresholds[name] else "below"
        print(f"  {name:<20} risk={score:+.5f} (plain {ref[name]:+.5f}) "
              f"threshold {thresholds[name]:.2f} -> {flag}")  # fmt: skip
    ok = got.keys() == ref.keys() and all(abs(got[k] - ref[k]) < BOUND for k in ref)
    print(f"[ok] every decrypted score within {BOUND:g} of numpy" if ok else "[MISMATCH]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
