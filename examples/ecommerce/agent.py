"""E-commerce: what offers are near me?

An agent asks ``nearby_offers`` for a user: the fabric takes the user's latest location
from a Kafka stream, derives its geohash cell, reads the active merchants of that cell
from the shop database (the cell and the status are pushed into SQL) and their unexpired
coupons from MongoDB (the merchant ids are pushed as an ``$in``), and keeps the 10
largest discounts. Then the user moves (a new location on the stream) and the same
query follows. Both answers are checked against DuckDB over the same generated rows.

    python examples/ecommerce/agent.py [--seed 7] [--scale 1.0] [--user 3]
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout (or site-packages) root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from examples.embedded import embedded, generate, parser

HERE = Path(__file__).resolve().parent


def ask(fab, user: int) -> pa.Table:
    """The agent's side: one query through the public API."""
    return fab.query("nearby_offers", session={"user_id": user}).table


def reference(data: dict[str, pa.Table], lat: float, lon: float) -> list[tuple]:
    """The same question in DuckDB over the generated tables, for a user at (lat, lon)."""
    from fabric.functions import geo_hash

    cell = geo_hash(pa.array([lat]), pa.array([lon]), 6)[0].as_py()
    con = duckdb.connect()
    con.register("m", data["merchants"])
    con.register("c", data["coupons"])
    return con.execute(
        "select m.name, c.discount, c.code from m join c on c.merchant_id = m.id "
        "where m.geo_hash = ? and m.status = 'active' and c.expires_at > now() "
        "order by c.discount desc, c.code limit 10",
        [cell],
    ).fetchall()


def same_offers(got: pa.Table, ref: list[tuple]) -> bool:
    """Equal top-10 discounts (ties at the 10th discount may pick other coupons)."""
    return sorted(got["discount"].to_pylist()) == sorted(r[1] for r in ref)


def last_location(data: dict[str, pa.Table], user: int) -> dict:
    locs = data["location_stream"].filter(pc.equal(data["location_stream"]["user_id"], user))
    return locs.slice(locs.num_rows - 1).to_pylist()[0]


def move(env: dict[str, str], data: dict[str, pa.Table], user: int) -> dict:
    """Put the user next to the last active merchant: one new message on the stream."""
    from examples.seed.load import produce

    m = data["merchants"]
    far = m.filter(pc.equal(m["status"], "active")).to_pylist()[-1]
    moved = {"user_id": user, "lat": far["lat"], "lon": far["lon"], "ts": dt.datetime.now(dt.UTC)}
    produce(
        env["FABRIC_KAFKA_BOOTSTRAP"],
        env["FABRIC_LOCATION_TOPIC"],
        pa.Table.from_pylist([moved]),
        "user_id",
        recreate=False,
    )
    return moved


def _show(label: str, table: pa.Table) -> None:
    print(f"{label}: {table.num_rows} offers")
    for r in table.slice(0, 5).to_pylist():
        print(f"  {r['name']}  {r['discount']:>3}%  {r['code']}")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--user", type=int, default=3, help="the user asking (3)")
    args = ap.parse_args(argv)
    data = generate(args.seed, args.scale)
    here = last_location(data, args.user)
    with embedded("ecommerce", HERE, data) as (fab, env):
        before = ask(fab, args.user)
        moved = move(env, data, args.user)
        after = ask(fab, args.user)
    _show(f"user {args.user} at ({here['lat']:.4f}, {here['lon']:.4f})", before)
    _show(f"after moving to ({moved['lat']:.4f}, {moved['lon']:.4f})", after)
    checks = {
        "before the move, matches the DuckDB reference": same_offers(
            before, reference(data, here["lat"], here["lon"])
        ),
        "after the move, matches the DuckDB reference": after.num_rows > 0
        and same_offers(after, reference(data, moved["lat"], moved["lon"])),
        "the answer followed the move": before.to_pylist() != after.to_pylist(),
    }
    for what, ok in checks.items():
        print(f"[{'ok' if ok else 'MISMATCH'}] {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
