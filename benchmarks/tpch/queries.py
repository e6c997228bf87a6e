"""The 22 TPC-H queries: the reference SQL (DuckDB), the substitution parameters (the spec's
validation values and seeded random ones, TPC-H 2.18 clause 2.4.x.3) and what the answer's
order is. The bindings for the fabric are the YAML files in ``queries/`` (``q01.yaml`` ...);
their session values are these parameters under the same names.

The SQL is the spec's text with ``$name`` parameters; the table aliases are the bindings'
source aliases (``l``, ``o``, ``c``, ``p``, ``ps``, ``s``, ``n``, ``r``), so rows needed per
source can be counted with the same names.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pyarrow as pa

D = dt.date

SEGMENTS = ["AUTOMOBILE", "BUILDING", "FURNITURE", "MACHINERY", "HOUSEHOLD"]
TYPE_S1 = ["STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO"]
TYPE_S2 = ["ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED"]
TYPE_S3 = ["TIN", "NICKEL", "BRASS", "STEEL", "COPPER"]
CONTAINER_S1 = ["SM", "LG", "MED", "JUMBO", "WRAP"]
CONTAINER_S2 = ["CASE", "BOX", "BAG", "JAR", "PKG", "PACK", "CAN", "DRUM"]
SHIPMODES = ["REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB"]
WORD1 = ["special", "pending", "unusual", "express"]
WORD2 = ["packages", "requests", "accounts", "deposits"]


@dataclass(frozen=True)
class Vocab:
    """Value lists the random parameters draw from, read from the generated data."""

    nations: list[str]
    nation_region: dict[str, str]
    regions: list[str]
    colors: list[str]

    @staticmethod
    def of(tables: dict[str, pa.Table]) -> Vocab:
        region = dict(
            zip(
                tables["region"]["r_regionkey"].to_pylist(),
                tables["region"]["r_name"].to_pylist(),
            )
        )
        nations = tables["nation"]["n_name"].to_pylist()
        nation_region = dict(
            zip(nations, [region[k] for k in tables["nation"]["n_regionkey"].to_pylist()])
        )
        words = sorted({w for name in tables["part"]["p_name"].to_pylist() for w in name.split()})
        return Vocab(sorted(nations), nation_region, sorted(region.values()), words)


def _month(rng: random.Random, first: tuple[int, int], last: tuple[int, int]) -> dt.date:
    months = [
        (y, m)
        for y in range(first[0], last[0] + 1)
        for m in range(1, 13)
        if first <= (y, m) <= last
    ]
    y, m = rng.choice(months)
    return D(y, m, 1)


def _year(rng: random.Random) -> dt.date:
    return D(rng.randint(1993, 1997), 1, 1)


def _brand(rng: random.Random) -> str:
    return f"Brand#{rng.randint(1, 5)}{rng.randint(1, 5)}"


@dataclass(frozen=True)
class Query:
    name: str  # q01 ... q22
    sql: str
    validation: dict[str, Any]
    random: Callable[[random.Random, Vocab, float], dict[str, Any]]
    order: tuple[str, ...] = ()  # output columns the query orders by (empty: unordered)
    scale: Callable[[dict[str, Any], float], dict[str, Any]] = field(
        default=lambda p, sf: p
    )  # parameters that depend on the scale factor (Q11's FRACTION)

    def params(self, sf: float, seed: int | None, vocab: Vocab) -> dict[str, Any]:
        """The validation parameters (seed None) or seeded random ones."""
        if seed is None:
            return self.scale(dict(self.validation), sf)
        rng = random.Random(f"{self.name}:{seed}")
        return self.scale(self.random(rng, vocab, sf), sf)


def _q11_scale(p: dict[str, Any], sf: float) -> dict[str, Any]:
    return {**p, "fraction": Decimal("0.0001") / Decimal(f"{sf:g}")}


QUERIES: dict[str, Query] = {}


def _q(name: str, sql: str, validation: dict[str, Any], rand, order=(), scale=None) -> None:
    kw = {"scale": scale} if scale else {}
    QUERIES[name] = Query(name, sql.strip(), validation, rand, tuple(order), **kw)


_q(
    "q01",
    """
select l_returnflag, l_linestatus,
  sum(l_quantity) as sum_qty, sum(l_extendedprice) as sum_base_price,
  sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
  sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
  avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price, avg(l_discount) as avg_disc,
  count(*) as count_order
from lineitem l
where l_shipdate <= date '1998-12-01' - cast($delta as integer)
group by l_returnflag, l_linestatus
order by l_returnflag, l_linestatus
""",
    {"delta": 90},
    lambda r, v, sf: {"delta": r.randint(60, 120)},
    order=("l_returnflag", "l_linestatus"),
)

_q(
    "q02",
    """
select s_acctbal, s_name, n_name, p_partkey, p_mfgr, s_address, s_phone, s_comment
from part p, supplier s, partsupp ps, nation n, region r
where p_partkey = ps_partkey and s_suppkey = ps_suppkey and p_size = $size
  and p_type like '%' || $type and s_nationkey = n_nationkey
  and n_regionkey = r_regionkey and r_name = $region
  and ps_supplycost = (
    select min(ps2.ps_supplycost)
    from partsupp ps2, supplier s2, nation n2, region r2
    where p_partkey = ps2.ps_partkey and s2.s_suppkey = ps2.ps_suppkey
      and s2.s_nationkey = n2.n_nationkey and n2.n_regionkey = r2.r_regionkey
      and r2.r_name = $region)
order by s_acctbal desc, n_name, s_name, p_partkey
limit 100
""",
    {"size": 15, "type": "BRASS", "region": "EUROPE"},
    lambda r, v, sf: {
        "size": r.randint(1, 50),
        "type": r.choice(TYPE_S3),
        "region": r.choice(v.regions),
    },
    order=("s_acctbal", "n_name", "s_name", "p_partkey"),
)

_q(
    "q03",
    """
select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue, o_orderdate, o_shippriority
from customer c, orders o, lineitem l
where c_mktsegment = $segment and c_custkey = o_custkey and l_orderkey = o_orderkey
  and o_orderdate < $date and l_shipdate > $date
group by l_orderkey, o_orderdate, o_shippriority
order by revenue desc, o_orderdate
limit 10
""",
    {"segment": "BUILDING", "date": D(1995, 3, 15)},
    lambda r, v, sf: {"segment": r.choice(SEGMENTS), "date": D(1995, 3, r.randint(1, 31))},
    order=("revenue", "o_orderdate"),
)

_q(
    "q04",
    """
select o_orderpriority, count(*) as order_count
from orders o
where o_orderdate >= $date and o_orderdate < $date + interval 3 month
  and exists (select * from lineitem l where l_orderkey = o_orderkey and l_commitdate < l_receiptdate)
group by o_orderpriority
order by o_orderpriority
""",
    {"date": D(1993, 7, 1)},
    lambda r, v, sf: {"date": _month(r, (1993, 1), (1997, 10))},
    order=("o_orderpriority",),
)

_q(
    "q05",
    """
select n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
from customer c, orders o, lineitem l, supplier s, nation n, region r
where c_custkey = o_custkey and l_orderkey = o_orderkey and l_suppkey = s_suppkey
  and c_nationkey = s_nationkey and s_nationkey = n_nationkey and n_regionkey = r_regionkey
  and r_name = $region and o_orderdate >= $date and o_orderdate < $date + interval 1 year
group by n_name
order by revenue desc
""",
    {"region": "ASIA", "date": D(1994, 1, 1)},
    lambda r, v, sf: {"region": r.choice(v.regions), "date": _year(r)},
    order=("revenue",),
)

_q(
    "q06",
    """
select sum(l_extendedprice * l_discount) as revenue
from lineitem l
where l_shipdate >= $date and l_shipdate < $date + interval 1 year
  and l_discount between $discount - 0.01 and $discount + 0.01 and l_quantity < $quantity
""",
    {"date": D(1994, 1, 1), "discount": Decimal("0.06"), "quantity": 24},
    lambda r, v, sf: {
        "date": _year(r),
        "discount": Decimal(r.randint(2, 9)) / 100,
        "quantity": r.randint(24, 25),
    },
)

_q(
    "q07",
    """
select supp_nation, cust_nation, l_year, sum(volume) as revenue
from (
  select n1.n_name as supp_nation, n2.n_name as cust_nation,
    extract(year from l_shipdate) as l_year, l_extendedprice * (1 - l_discount) as volume
  from supplier s, lineitem l, orders o, customer c, nation n1, nation n2
  where s_suppkey = l_suppkey and o_orderkey = l_orderkey and c_custkey = o_custkey
    and s_nationkey = n1.n_nationkey and c_nationkey = n2.n_nationkey
    and ((n1.n_name = $nation1 and n2.n_name = $nation2)
      or (n1.n_name = $nation2 and n2.n_name = $nation1))
    and l_shipdate between date '1995-01-01' and date '1996-12-31') as shipping
group by supp_nation, cust_nation, l_year
order by supp_nation, cust_nation, l_year
""",
    {"nation1": "FRANCE", "nation2": "GERMANY"},
    lambda r, v, sf: dict(zip(("nation1", "nation2"), r.sample(v.nations, 2))),
    order=("supp_nation", "cust_nation", "l_year"),
)


def _q8_random(r: random.Random, v: Vocab, sf: float) -> dict[str, Any]:
    nation = r.choice(v.nations)
    return {
        "nation": nation,
        "region": v.nation_region[nation],
        "type": f"{r.choice(TYPE_S1)} {r.choice(TYPE_S2)} {r.choice(TYPE_S3)}",
    }


_q(
    "q08",
    """
select o_year, sum(case when nation = $nation then volume else 0 end) / sum(volume) as mkt_share
from (
  select extract(year from o_orderdate) as o_year,
    l_extendedprice * (1 - l_discount) as volume, n2.n_name as nation
  from part p, supplier s, lineitem l, orders o, customer c, nation n1, nation n2, region r
  where p_partkey = l_partkey and s_suppkey = l_suppkey and l_orderkey = o_orderkey
    and o_custkey = c_custkey and c_nationkey = n1.n_nationkey and n1.n_regionkey = r_regionkey
    and r_name = $region and s_nationkey = n2.n_nationkey
    and o_orderdate between date '1995-01-01' and date '1996-12-31' and p_type = $type
  ) as all_nations
group by o_year
order by o_year
""",
    {"nation": "BRAZIL", "region": "AMERICA", "type": "ECONOMY ANODIZED STEEL"},
    _q8_random,
    order=("o_year",),
)

_q(
    "q09",
    """
select nation, o_year, sum(amount) as sum_profit
from (
  select n_name as nation, extract(year from o_orderdate) as o_year,
    l_extendedprice * (1 - l_discount) - ps_supplycost * l_quantity as amount
  from part p, supplier s, lineitem l, partsupp ps, orders o, nation n
  where s_suppkey = l_suppkey and ps_suppkey = l_suppkey and ps_partkey = l_partkey
    and p_partkey = l_partkey and o_orderkey = l_orderkey and s_nationkey = n_nationkey
    and p_name like '%' || $color || '%') as profit
group by nation, o_year
order by nation, o_year desc
""",
    {"color": "green"},
    lambda r, v, sf: {"color": r.choice(v.colors)},
    order=("nation", "o_year"),
)

_q(
    "q10",
    """
select c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) as revenue, c_acctbal, n_name,
  c_address, c_phone, c_comment
from customer c, orders o, lineitem l, nation n
where c_custkey = o_custkey and l_orderkey = o_orderkey and o_orderdate >= $date
  and o_orderdate < $date + interval 3 month and l_returnflag = 'R' and c_nationkey = n_nationkey
group by c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
order by revenue desc
limit 20
""",
    {"date": D(1993, 10, 1)},
    lambda r, v, sf: {"date": _month(r, (1993, 2), (1995, 1))},
    order=("revenue",),
)

_q(
    "q11",
    """
select ps_partkey, sum(ps_supplycost * ps_availqty) as value
from partsupp ps, supplier s, nation n
where ps_suppkey = s_suppkey and s_nationkey = n_nationkey and n_name = $nation
group by ps_partkey
having sum(ps_supplycost * ps_availqty) > (
  select sum(ps2.ps_supplycost * ps2.ps_availqty) * $fraction
  from partsupp ps2, supplier s2, nation n2
  where ps2.ps_suppkey = s2.s_suppkey and s2.s_nationkey = n2.n_nationkey and n2.n_name = $nation)
order by value desc
""",
    {"nation": "GERMANY"},
    lambda r, v, sf: {"nation": r.choice(v.nations)},
    order=("value",),
    scale=_q11_scale,
)

_q(
    "q12",
    """
select l_shipmode,
  sum(case when o_orderpriority = '1-URGENT' or o_orderpriority = '2-HIGH' then 1 else 0 end)
    as high_line_count,
  sum(case when o_orderpriority <> '1-URGENT' and o_orderpriority <> '2-HIGH' then 1 else 0 end)
    as low_line_count
from orders o, lineitem l
where o_orderkey = l_orderkey and l_shipmode in ($shipmode1, $shipmode2)
  and l_commitdate < l_receiptdate and l_shipdate < l_commitdate
  and l_receiptdate >= $date and l_receiptdate < $date + interval 1 year
group by l_shipmode
order by l_shipmode
""",
    {"shipmode1": "MAIL", "shipmode2": "SHIP", "date": D(1994, 1, 1)},
    lambda r, v, sf: {
        **dict(zip(("shipmode1", "shipmode2"), r.sample(SHIPMODES, 2))),
        "date": _year(r),
    },
    order=("l_shipmode",),
)

_q(
    "q13",
    """
select c_count, count(*) as custdist
from (
  select c_custkey, count(o_orderkey) as c_count
  from customer c left outer join orders o
    on c_custkey = o_custkey and o_comment not like '%' || $word1 || '%' || $word2 || '%'
  group by c_custkey) as c_orders
group by c_count
order by custdist desc, c_count desc
""",
    {"word1": "special", "word2": "requests"},
    lambda r, v, sf: {"word1": r.choice(WORD1), "word2": r.choice(WORD2)},
    order=("custdist", "c_count"),
)

_q(
    "q14",
    """
select 100.00 * sum(case when p_type like 'PROMO%' then l_extendedprice * (1 - l_discount) else 0 end)
  / sum(l_extendedprice * (1 - l_discount)) as promo_revenue
from lineitem l, part p
where l_partkey = p_partkey and l_shipdate >= $date and l_shipdate < $date + interval 1 month
""",
    {"date": D(1995, 9, 1)},
    lambda r, v, sf: {"date": _month(r, (1993, 1), (1997, 12))},
)

_q(
    "q15",
    """
with revenue0 as (
  select l_suppkey as supplier_no, sum(l_extendedprice * (1 - l_discount)) as total_revenue
  from lineitem l
  where l_shipdate >= $date and l_shipdate < $date + interval 3 month
  group by l_suppkey)
select s_suppkey, s_name, s_address, s_phone, total_revenue
from supplier s, revenue0
where s_suppkey = supplier_no and total_revenue = (select max(total_revenue) from revenue0)
order by s_suppkey
""",
    {"date": D(1996, 1, 1)},
    lambda r, v, sf: {"date": _month(r, (1993, 1), (1997, 10))},
    order=("s_suppkey",),
)


def _q16_random(r: random.Random, v: Vocab, sf: float) -> dict[str, Any]:
    return {
        "brand": _brand(r),
        "type": f"{r.choice(TYPE_S1)} {r.choice(TYPE_S2)}",
        "sizes": r.sample(range(1, 51), 8),
    }


_q(
    "q16",
    """
select p_brand, p_type, p_size, count(distinct ps_suppkey) as supplier_cnt
from partsupp ps, part p
where p_partkey = ps_partkey and p_brand <> $brand and p_type not like $type || '%'
  and list_contains($sizes, p_size)
  and ps_suppkey not in (select s_suppkey from supplier where s_comment like '%Customer%Complaints%')
group by p_brand, p_type, p_size
order by supplier_cnt desc, p_brand, p_type, p_size
""",
    {"brand": "Brand#45", "type": "MEDIUM POLISHED", "sizes": [49, 14, 23, 45, 19, 3, 36, 9]},
    _q16_random,
    order=("supplier_cnt", "p_brand", "p_type", "p_size"),
)

_q(
    "q17",
    """
select sum(l_extendedprice) / 7.0 as avg_yearly
from lineitem l, part p
where p_partkey = l_partkey and p_brand = $brand and p_container = $container
  and l_quantity < (select 0.2 * avg(l2.l_quantity) from lineitem l2 where l2.l_partkey = p_partkey)
""",
    {"brand": "Brand#23", "container": "MED BOX"},
    lambda r, v, sf: {
        "brand": _brand(r),
        "container": f"{r.choice(CONTAINER_S1)} {r.choice(CONTAINER_S2)}",
    },
)

_q(
    "q18",
    """
select c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice, sum(l_quantity) as sum_qty
from customer c, orders o, lineitem l
where o_orderkey in (
    select l2.l_orderkey from lineitem l2 group by l2.l_orderkey having sum(l2.l_quantity) > $quantity)
  and c_custkey = o_custkey and o_orderkey = l_orderkey
group by c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice
order by o_totalprice desc, o_orderdate
limit 100
""",
    {"quantity": 300},
    lambda r, v, sf: {"quantity": r.randint(312, 315)},
    order=("o_totalprice", "o_orderdate"),
)


def _q19_random(r: random.Random, v: Vocab, sf: float) -> dict[str, Any]:
    return {
        "quantity1": r.randint(1, 10),
        "quantity2": r.randint(10, 20),
        "quantity3": r.randint(20, 30),
        "brand1": _brand(r),
        "brand2": _brand(r),
        "brand3": _brand(r),
    }


_q(
    "q19",
    """
select sum(l_extendedprice * (1 - l_discount)) as revenue
from lineitem l, part p
where (p_partkey = l_partkey and p_brand = $brand1
    and p_container in ('SM CASE', 'SM BOX', 'SM PACK', 'SM PKG')
    and l_quantity >= $quantity1 and l_quantity <= $quantity1 + 10 and p_size between 1 and 5
    and l_shipmode in ('AIR', 'AIR REG') and l_shipinstruct = 'DELIVER IN PERSON')
  or (p_partkey = l_partkey and p_brand = $brand2
    and p_container in ('MED BAG', 'MED BOX', 'MED PKG', 'MED PACK')
    and l_quantity >= $quantity2 and l_quantity <= $quantity2 + 10 and p_size between 1 and 10
    and l_shipmode in ('AIR', 'AIR REG') and l_shipinstruct = 'DELIVER IN PERSON')
  or (p_partkey = l_partkey and p_brand = $brand3
    and p_container in ('LG CASE', 'LG BOX', 'LG PACK', 'LG PKG')
    and l_quantity >= $quantity3 and l_quantity <= $quantity3 + 10 and p_size between 1 and 15
    and l_shipmode in ('AIR', 'AIR REG') and l_shipinstruct = 'DELIVER IN PERSON')
""",
    {
        "quantity1": 1,
        "quantity2": 10,
        "quantity3": 20,
        "brand1": "Brand#12",
        "brand2": "Brand#23",
        "brand3": "Brand#34",
    },
    _q19_random,
)

_q(
    "q20",
    """
select s_name, s_address
from supplier s, nation n
where s_suppkey in (
    select ps_suppkey from partsupp ps
    where ps_partkey in (select p_partkey from part p where p_name like $color || '%')
      and ps_availqty > (
        select 0.5 * sum(l_quantity) from lineitem l
        where l_partkey = ps_partkey and l_suppkey = ps_suppkey
          and l_shipdate >= $date and l_shipdate < $date + interval 1 year))
  and s_nationkey = n_nationkey and n_name = $nation
order by s_name
""",
    {"color": "forest", "date": D(1994, 1, 1), "nation": "CANADA"},
    lambda r, v, sf: {"color": r.choice(v.colors), "date": _year(r), "nation": r.choice(v.nations)},
    order=("s_name",),
)

_q(
    "q21",
    """
select s_name, count(*) as numwait
from supplier s, lineitem l1, orders o, nation n
where s_suppkey = l1.l_suppkey and o_orderkey = l1.l_orderkey and o_orderstatus = 'F'
  and l1.l_receiptdate > l1.l_commitdate
  and exists (select * from lineitem l2
    where l2.l_orderkey = l1.l_orderkey and l2.l_suppkey <> l1.l_suppkey)
  and not exists (select * from lineitem l3
    where l3.l_orderkey = l1.l_orderkey and l3.l_suppkey <> l1.l_suppkey
      and l3.l_receiptdate > l3.l_commitdate)
  and s_nationkey = n_nationkey and n_name = $nation
group by s_name
order by numwait desc, s_name
limit 100
""",
    {"nation": "SAUDI ARABIA"},
    lambda r, v, sf: {"nation": r.choice(v.nations)},
    order=("numwait", "s_name"),
)

_q(
    "q22",
    """
select cntrycode, count(*) as numcust, sum(c_acctbal) as totacctbal
from (
  select substring(c_phone, 1, 2) as cntrycode, c_acctbal
  from customer c
  where list_contains($codes, substring(c_phone, 1, 2))
    and c_acctbal > (select avg(c2.c_acctbal) from customer c2
      where c2.c_acctbal > 0.00 and list_contains($codes, substring(c2.c_phone, 1, 2)))
    and not exists (select * from orders o where o_custkey = c_custkey)) as custsale
group by cntrycode
order by cntrycode
""",
    {"codes": ["13", "31", "23", "29", "30", "18", "17"]},
    lambda r, v, sf: {"codes": [str(x) for x in r.sample(range(10, 35), 7)]},
    order=("cntrycode",),
)
