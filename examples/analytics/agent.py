"""Analytics: which category did I spend most on last week?

An agent asks ``top_category_last_week`` for a user: the fabric reads that user's orders
of the last 7 days from the shop database (the filter runs in SQL), joins them with the
product -> category map in a CSV file and aggregates in DuckDB. The answer is checked
against DuckDB over the same generated rows.

    python examples/analytics/agent.py [--seed 7] [--scale 1.0] [--user 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout (or site-packages) root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import duckdb
import pyarrow as pa

from examples.embedded import embedded, generate, parser

HERE = Path(__file__).resolve().parent


def ask(fab, user: int) -> list[tuple]:
    """The agent's side: one query through the public API."""
    res = fab.query("top_category_last_week", session={"user_id": user})
    return [(r["category"], round(r["spent"], 6), r["orders"]) for r in res.table.to_pylist()]


def reference(data: dict[str, pa.Table], user: int) -> list[tuple]:
    """The same question in DuckDB over the generated tables (no fabric involved)."""
    con = duckdb.connect()
    con.register("o", data["orders"])
    con.register("k", data["categories"])
    rows = con.execute(
        "select k.category, sum(o.amount) as spent, count(*) from o "
        "join k on k.product_id = o.product_id "
        "where o.user_id = ? and o.ordered_at > now() - interval 7 day "
        "group by 1 order by 2 desc limit 3",
        [user],
    ).fetchall()
    return [(c, round(s, 6), n) for c, s, n in rows]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--user", type=int, default=3, help="the user asking (3)")
    args = ap.parse_args(argv)
    data = generate(args.seed, args.scale)
    with embedded("analytics", HERE, data) as (fab, _):
        got = ask(fab, args.user)
    ref = reference(data, args.user)
    print(f"user {args.user}, last 7 days ({data['orders'].num_rows} orders generated):")
    for category, spent, orders in got:
        print(f"  {category:<12} {spent:10.2f} over {orders} orders")
    ok = got == ref
    print("[ok] matches the DuckDB reference" if ok else f"[MISMATCH] reference: {ref}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
