"""Deterministic sample data for the seed scenarios (shop, CRM, lake, bus).

Everything is generated from one seed so the demo, the tests and the benchmarks can
recompute the same rows and check answers against an independent reference.

The news embeddings come from ``hash_embed``: a feature-hashing bag of words projected
to 384 dimensions and unit-normalized. It is not a language model (none can be
downloaded here); texts that share words land close together, which is what the demo
needs to show retrieval by meaning, time and keyword at once.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import re

import numpy as np
import pyarrow as pa

from fabric.functions import geo_hash

CENTER = (48.8566, 2.3522)  # the demo city
CATEGORIES = [
    "groceries",
    "electronics",
    "books",
    "fashion",
    "toys",
    "garden",
    "sports",
    "beauty",
    "travel",
    "pets",
    "music",
    "home",
]
SYMBOLS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOG", "META", "SPY"]
_TEMPLATES = [
    "{s} shares opened higher as the US market open lifted tech stocks",
    "{s} fell at the open after a weak guidance and analyst downgrade",
    "{s} rallied in early trading on strong quarterly earnings",
    "Futures point to a flat open; {s} in focus ahead of the Fed decision",
    "{s} announces a new product line; investors shrug",
    "{s} slides as bond yields climb and the dollar firms",
    "Market open: {s} leads gains while energy lags",
    "{s} board approves buyback; stock steady before the bell",
]
DIM = 384


def hash_embed(texts: list[str], dim: int = DIM) -> np.ndarray:
    """Unit-normalized feature-hashing embeddings (float32, shape (n, dim)); equal texts
    (the generated headlines repeat) are embedded once."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    seen: dict[str, int] = {}
    for i, text in enumerate(texts):
        if text in seen:
            out[i] = out[seen[text]]
            continue
        seen[text] = i
        for tok in re.findall(r"\w+", text.lower()):
            h = _token_hash(tok)
            out[i, h % dim] += 1.0 if (h >> 32) & 1 else -1.0
        n = np.linalg.norm(out[i])
        if n:
            out[i] /= n
    return out


@functools.lru_cache(maxsize=65_536)
def _token_hash(tok: str) -> int:
    return int.from_bytes(hashlib.blake2b(tok.encode(), digest_size=8).digest(), "little")


def vector_array(matrix: np.ndarray) -> pa.FixedSizeListArray:
    flat = pa.array(matrix.astype(np.float32).ravel(), type=pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, matrix.shape[1])


def generate(
    seed: int = 7,
    *,
    users: int = 50,
    merchants: int = 2_000,
    coupons: int = 6_000,
    orders: int = 20_000,
    products: int = 500,
    news: int = 2_000,
    policies: int = 3,
    now: dt.datetime | None = None,
) -> dict[str, pa.Table]:
    now = now or dt.datetime.now(dt.UTC).replace(microsecond=0)
    rng = np.random.default_rng(seed)

    def around(n: int, spread: float) -> tuple[np.ndarray, np.ndarray]:
        return (
            CENTER[0] + rng.uniform(-spread, spread, n),
            CENTER[1] + rng.uniform(-spread, spread, n),
        )

    # live locations: three pings per user, the last one is where the user is now
    pings = 3
    lat, lon = around(users * pings, 0.03)
    loc = pa.table(
        {
            "user_id": np.repeat(np.arange(1, users + 1), pings).astype(np.int64),
            "lat": lat,
            "lon": lon,
            "ts": pa.array(
                [
                    now - dt.timedelta(minutes=10 * (pings - 1 - i % pings))
                    for i in range(users * pings)
                ],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    mlat, mlon = around(merchants, 0.03)
    merch = pa.table(
        {
            "id": np.arange(1, merchants + 1, dtype=np.int64),
            "name": [f"merchant-{i:05d}" for i in range(1, merchants + 1)],
            "status": rng.choice(["active", "active", "active", "active", "closed"], merchants),
            "lat": mlat,
            "lon": mlon,
            "geo_hash": geo_hash(pa.array(mlat), pa.array(mlon), 6),
        }
    )
    coup = pa.table(
        {
            "merchant_id": rng.integers(1, merchants + 1, coupons).astype(np.int64),
            "discount": rng.integers(5, 60, coupons).astype(np.int64),
            "code": [f"C{i:06d}" for i in range(coupons)],
            "expires_at": pa.array(
                [now + dt.timedelta(days=int(d)) for d in rng.integers(-10, 30, coupons)],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    order_tab = pa.table(
        {
            "id": np.arange(1, orders + 1, dtype=np.int64),
            "user_id": rng.integers(1, users + 1, orders).astype(np.int64),
            "product_id": rng.integers(1, products + 1, orders).astype(np.int64),
            "amount": np.round(rng.gamma(2.0, 20.0, orders), 2),
            "ordered_at": pa.array(
                [now - dt.timedelta(minutes=int(m)) for m in rng.integers(0, 30 * 24 * 60, orders)],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    cats = pa.table(
        {
            "product_id": np.arange(1, products + 1, dtype=np.int64),
            "category": rng.choice(CATEGORIES, products),
        }
    )
    syms = rng.choice(SYMBOLS, news)
    bodies = [
        _TEMPLATES[int(t)].format(s=s) for t, s in zip(rng.integers(0, len(_TEMPLATES), news), syms)
    ]
    news_tab = pa.table(
        {
            "id": [f"n{i:06d}" for i in range(news)],
            "published_at": pa.array(
                [now - dt.timedelta(seconds=int(s)) for s in rng.integers(0, 2 * 86_400, news)],
                pa.timestamp("us", tz="UTC"),
            ),
            "symbol": syms,
            "body": bodies,
            "embedding": vector_array(hash_embed(bodies)),
        }
    )
    # risk policies: weights over the agent's context [intent, risk, urgency]
    policies_tab = pa.table(
        {
            "policy": ["fraud_review", "escalate_to_human", "auto_approve_block"],
            "weights": vector_array(
                np.array([[0.2, 0.7, 0.1], [0.1, 0.3, 0.6], [-0.5, 0.9, 0.2]], dtype=np.float32)
            ),
            "threshold": [0.5, 0.6, 0.3],
            "active": [True, True, True],
        }
    )
    if policies > 3:  # more, from their own generator: the rows above stay the same
        more = np.random.default_rng(seed + 1)
        extra = policies - 3
        policies_more = pa.table(
            {
                "policy": [f"policy_{i:04d}" for i in range(4, policies + 1)],
                "weights": vector_array(more.uniform(-1, 1, (extra, 3)).astype(np.float32)),
                "threshold": np.round(more.uniform(0, 1, extra), 2),
                "active": more.random(extra) < 0.8,
            }
        )
        policies_tab = pa.concat_tables([policies_tab, policies_more.cast(policies_tab.schema)])
    return {
        "location_stream": loc,
        "merchants": merch,
        "coupons": coup,
        "orders": order_tab,
        "categories": cats,
        "news": news_tab,
        "risk_policies": policies_tab,
    }
