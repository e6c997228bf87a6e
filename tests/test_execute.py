"""Executor over in-memory sources, checked against DuckDB reference queries on the same
tables (the reference never goes through the fabric's planner or executor)."""

from __future__ import annotations

import dataclasses
import threading
import time

import duckdb
import pyarrow as pa
import pytest
from fixtures.optimizer import world
from fixtures.optimizer.scenario_data import textbook_geohash as ref_geohash
from fixtures.optimizer.world import NOW, C, eq, lit

from connectors.base import Capability, Pushdown, SourceError, Watermark
from dsl.ast import Binary, Call, Column, Literal, Param, SortKey
from fabric.execute import QueryError, execute
from fabric.optimizer import optimize
from fabric.plan.nodes import Aggregate, Filter, Freshness, Join, Limit, Project, Scan, Sort

USERS = range(24)


@pytest.fixture(scope="module")
def tables():
    return world.make_tables()


@pytest.fixture(scope="module")
def ref(tables):
    con = duckdb.connect()
    for name, t in tables.items():
        con.register(name, t)
    return con


def ref_nearby(ref, user: int, limit: int = 10) -> tuple[list[dict], dict[str, int]]:
    lat, lon = ref.execute(
        "SELECT lat, lon FROM locations WHERE user_id = ? ORDER BY ts DESC LIMIT 1", [user]
    ).fetchone()
    cell = ref_geohash(lat, lon, 6)
    rows = ref.execute(
        """SELECT m.name, c.discount, c.code FROM merchants m JOIN coupons c ON c.merchant_id = m.id
           WHERE m.geo_hash = ? AND m.status = 'active' AND c.expires_at > ?
           ORDER BY c.discount DESC, c.code LIMIT ?""",
        [cell, NOW, limit],
    ).fetchall()
    need_m = ref.execute(
        "SELECT count(*) FROM merchants WHERE geo_hash = ? AND status = 'active'", [cell]
    ).fetchone()[0]
    need_c = ref.execute(
        """SELECT count(*) FROM coupons WHERE expires_at > ? AND merchant_id IN
           (SELECT id FROM merchants WHERE geo_hash = ? AND status = 'active')""",
        [NOW, cell],
    ).fetchone()[0]
    return [dict(zip(("name", "discount", "code"), r)) for r in rows], {"m": need_m, "c": need_c}


def test_nearby_offers_matches_reference_with_minimal_fetch(tables, ref) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.nearby_offers(cat), cat)
    nonempty = 0
    for user in USERS:
        res = execute(plan, {"user_id": user}, cat, binding="nearby_offers", now=NOW)
        expected, needed = ref_nearby(ref, user)
        assert res.table.to_pylist() == expected, user
        nonempty += bool(expected)
        src = res.stats["sources"]
        # dynamic filters: exactly the merchants of the user's cell and their live coupons
        assert src["m"]["rows"] == needed["m"]
        assert src["c"]["rows"] == needed["c"]
        assert src["loc"]["rows"] == 4  # the user's 4 positions; latest_by keeps 1
    assert nonempty >= 20


def test_top_category_matches_reference(tables, ref) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.top_category(cat), cat)
    for user in USERS:
        res = execute(plan, {"user_id": user}, cat, binding="top_category", now=NOW)
        expected = ref.execute(
            """SELECT k.category, sum(o.amount) AS spent FROM orders o JOIN categories k ON k.sku = o.sku
               WHERE o.user_id = ? AND o.ordered_at >= ? GROUP BY 1 ORDER BY spent DESC, k.category LIMIT 1""",
            [user, NOW - dt_days(7)],
        ).fetchall()
        got = res.table.to_pylist()
        assert [(r["category"], pytest.approx(r["spent"])) for r in got] == [
            (c, pytest.approx(s)) for c, s in expected
        ]
        n_orders = ref.execute(
            "SELECT count(*) FROM orders WHERE user_id = ? AND ordered_at >= ?",
            [user, NOW - dt_days(7)],
        ).fetchone()[0]
        assert res.stats["sources"]["o"]["rows"] == n_orders


def dt_days(n: int):
    import datetime as dt

    return dt.timedelta(days=n)


def test_single_source_runs_in_pyarrow_with_limit_pushed(tables, ref) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.single_source(cat), cat)
    res = execute(plan, {}, cat, binding="b", now=NOW, analyze=True)
    expected = ref.execute(
        "SELECT name, id FROM merchants WHERE status = 'active' ORDER BY name LIMIT 5"
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == expected
    assert res.stats["sources"]["m"]["rows"] == 5
    assert "duckdb" not in res.explain


@pytest.mark.parametrize("answer", [Pushdown.INEXACT, Pushdown.UNSUPPORTED])
def test_fail_closed_filters_are_reapplied(tables, ref, answer) -> None:
    """A source that ignores filters (INEXACT that filters nothing, or UNSUPPORTED)
    still gives the exact answer: the fabric re-applies every session filter."""
    sources = {
        name: world.Picky(f"memory://t/{name}", tables[name], answer, drop=True)
        for name in ("locations", "merchants", "coupons")
    }
    cat = world.catalog(tables, **sources)
    plan = optimize(world.nearby_offers(cat), cat)
    for user in list(USERS)[:8]:
        res = execute(plan, {"user_id": user}, cat, binding="nearby_offers", now=NOW)
        assert res.table.to_pylist() == ref_nearby(ref, user)[0]
    if answer is Pushdown.UNSUPPORTED:
        assert all(r.filters == () for r in sources["merchants"].requests)
    else:
        assert any(r.filters for r in sources["merchants"].requests)


def test_session_values_are_bound_not_spliced(tables) -> None:
    cat = world.catalog(tables)
    m = Filter(world.scan(cat, "m", "merchants"), eq(C("m.name"), Param("name")))
    c = world.scan(cat, "c", "coupons")
    # a filter above the join runs in DuckDB: the value must be a bound parameter there too
    j = Filter(Join(m, c, eq(C("c.merchant_id"), C("m.id"))), eq(C("c.code"), Param("code")))
    plan = Project(j, (("code", C("c.code"), pa.string()),))
    for raw in (optimize(plan, None), optimize(plan, cat)):
        for evil in ("x' OR 1=1 --", "'; DROP TABLE merchants; --", "1 OR 1=1", '{"$ne": null}'):
            res = execute(raw, {"name": evil, "code": evil}, cat, binding="b")
            assert res.table.num_rows == 0
    assert cat.source("memory://t/merchants").table.num_rows == tables["merchants"].num_rows


def test_source_error_names_binding_and_source(tables) -> None:
    class Down(world.Picky):
        def scan(self, request):
            raise SourceError(self.uri, "connection refused", hint="start the server")

    cat = world.catalog(
        tables, coupons=Down("memory://t/coupons", tables["coupons"], Pushdown.EXACT)
    )
    plan = optimize(world.nearby_offers(cat), cat)
    with pytest.raises(QueryError) as err:
        execute(plan, {"user_id": 1}, cat, binding="nearby_offers", now=NOW)
    msg = str(err.value)
    assert "nearby_offers" in msg and "memory://t/coupons" in msg and "connection refused" in msg
    assert err.value.alias == "c" and "start the server" in msg
    # a binding that accepts partial answers gets one, flagged
    res = execute(plan, {"user_id": 1}, cat, binding="nearby_offers", now=NOW, allow_partial=True)
    assert (
        res.partial
        and res.table.num_rows == 0
        and "connection refused" in res.stats["sources"]["c"]["error"]
    )


def test_timeout_names_the_source(tables) -> None:
    release, returned = threading.Event(), threading.Event()

    class Slow(world.Picky):
        # stands for a network source (no IN_PROCESS): its unit runs on the scan pool
        capabilities = world.Picky.capabilities - {Capability.IN_PROCESS}

        def scan(self, request):
            release.wait(10)
            returned.set()
            yield from super().scan(request)

    cat = world.catalog(
        tables, merchants=Slow("memory://t/merchants", tables["merchants"], Pushdown.EXACT)
    )
    cat.scan_timeout = 0.3
    plan = optimize(world.single_source(cat), cat)
    try:
        with pytest.raises(
            QueryError, match=r"source m \(memory://t/merchants\): timed out after 0.3 s"
        ):
            execute(plan, {}, cat, binding="b")
        # the query gave up while the source was still blocked: it did not wait for it
        assert not returned.is_set()
    finally:
        release.set()


def test_in_process_single_unit_runs_inline_and_still_times_out(tables, ref) -> None:
    """A lone unit over an in-process source runs on the caller's thread; it cannot be
    abandoned, so past the timeout it gives the same error once it returns."""

    class Recording(world.Picky):
        delay = 0.0

        def scan(self, request):
            self.threads.append(threading.get_ident())
            time.sleep(self.delay)
            yield from super().scan(request)

    src = Recording("memory://t/merchants", tables["merchants"], Pushdown.EXACT)
    src.threads = []
    cat = world.catalog(tables, merchants=src)
    plan = optimize(world.single_source(cat), cat)
    res = execute(plan, {}, cat, binding="b")
    assert src.threads == [threading.get_ident()]
    expected = ref.execute(
        "SELECT name, id FROM merchants WHERE status = 'active' ORDER BY name LIMIT 5"
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == expected

    cat.scan_timeout, src.delay = 0.05, 0.2
    with pytest.raises(
        QueryError, match=r"source m \(memory://t/merchants\): timed out after 0.05 s"
    ):
        execute(plan, {}, cat, binding="b")
    res = execute(plan, {}, cat, binding="b", allow_partial=True)
    assert (
        res.partial
        and res.table.num_rows == 0
        and "timed out" in res.stats["sources"]["m"]["error"]
    )


def test_multi_source_units_share_one_bounded_pool(tables, ref) -> None:
    """Units of multi-source plans run on the process-wide pool: no thread per query."""
    from fabric.execute import POOL_THREADS, scan_pool

    names: set[str] = set()

    class Recording(world.Picky):
        def scan(self, request):
            names.add(threading.current_thread().name)
            yield from super().scan(request)

    sources = {
        n: Recording(f"memory://t/{n}", tables[n], Pushdown.EXACT)
        for n in ("locations", "merchants", "coupons")
    }
    cat = world.catalog(tables, **sources)
    plan = optimize(world.nearby_offers(cat), cat)
    for user in list(USERS)[:6]:
        res = execute(plan, {"user_id": user}, cat, binding="nearby_offers", now=NOW)
        assert res.table.to_pylist() == ref_nearby(ref, user)[0]
    assert names and all(n.startswith("fabric-scan") for n in names)
    assert threading.get_ident() not in {t.ident for t in scan_pool()._threads}
    assert len(scan_pool()._threads) <= POOL_THREADS
    before = threading.active_count()
    for user in list(USERS)[:6]:
        execute(plan, {"user_id": user}, cat, binding="nearby_offers", now=NOW)
    assert threading.active_count() <= max(before, POOL_THREADS + 1)


def test_many_concurrent_queries_with_dynamic_filters_do_not_starve_the_pool(tables, ref) -> None:
    """More concurrent queries than pool threads, each with units waiting on dynamic-filter
    keys: dependent units are submitted only when their keys are ready, so no pool thread
    blocks on another unit and every query answers."""
    import concurrent.futures as cf

    from fabric.execute import POOL_THREADS

    cat = world.catalog(tables)
    cat.scan_timeout = 20
    plan = optimize(world.nearby_offers(cat), cat)
    users = [u % len(USERS) for u in range(3 * POOL_THREADS)]
    with cf.ThreadPoolExecutor(2 * POOL_THREADS) as callers:
        got = list(
            callers.map(
                lambda u: execute(
                    plan, {"user_id": u}, cat, binding="b", now=NOW
                ).table.to_pylist(),
                users,
            )
        )
    assert got == [ref_nearby(ref, u)[0] for u in users]


def test_per_plan_facts_are_kept_on_the_plan_without_changing_it(tables, ref) -> None:
    """Units, order, parameters and filter text are computed once per plan object; the
    plan stays equal, hashable and replaceable, and each session still gets its answer."""
    cat = world.catalog(tables)
    plan = optimize(world.nearby_offers(cat), cat)
    copy = dataclasses.replace(plan)
    h = hash(plan)
    for user in (3, 7, 3):
        res = execute(plan, {"user_id": user}, cat, binding="b", now=NOW)
        assert res.table.to_pylist() == ref_nearby(ref, user)[0]
    assert plan == copy and hash(plan) == h and "_fabric_exec_shape" not in repr(plan)
    with pytest.raises(QueryError, match=r"session value\(s\) 'user_id' not bound"):
        execute(plan, {}, cat, binding="b", now=NOW)


def _shrink_max_keys(plan, **changes):
    def shrink(node):
        if isinstance(node, Scan) and node.dynamic:
            return dataclasses.replace(
                node,
                dynamic=tuple(dataclasses.replace(d, max_keys=1, **changes) for d in node.dynamic),
            )
        ch = node.children()
        return node.with_children(*(shrink(c) for c in ch)) if ch else node

    return shrink(plan)


def test_dynamic_filter_over_max_keys_is_skipped_and_answer_unchanged(tables, ref) -> None:
    cat = world.catalog(tables)
    small = _shrink_max_keys(optimize(world.nearby_offers(cat), cat), range=False)
    res = execute(small, {"user_id": 5}, cat, binding="b", now=NOW, analyze=True)
    expected, needed = ref_nearby(ref, 5)
    assert res.table.to_pylist() == expected
    dyn_c = res.stats["sources"]["c"]["dynamic"][0]
    assert dyn_c["pushed"] is False and dyn_c["keys"] == needed["m"] > 1
    assert res.stats["sources"]["c"]["rows"] > needed["c"]  # fetched without the key list
    assert "NOT pushed" in res.explain


def test_dynamic_filter_over_max_keys_pushes_the_key_range(tables, ref) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.nearby_offers(cat), cat)
    assert all(d.range for s in plan.scans() for d in s.dynamic)  # memory sources take >=, <=
    res = execute(_shrink_max_keys(plan), {"user_id": 5}, cat, binding="b", now=NOW, analyze=True)
    expected, needed = ref_nearby(ref, 5)
    assert res.table.to_pylist() == expected
    dyn_c = res.stats["sources"]["c"]["dynamic"][0]
    assert dyn_c["form"] == "range" and dyn_c["keys"] == needed["m"] > 1
    lo, hi = dyn_c["range"]
    in_range = ref.execute(
        "SELECT count(*) FROM coupons WHERE expires_at > ? AND merchant_id BETWEEN ? AND ?",
        [NOW, lo, hi],
    ).fetchone()[0]
    assert needed["c"] <= res.stats["sources"]["c"]["rows"] == in_range
    assert "pushed as range" in res.explain


def test_no_keys_skips_the_scan(tables) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.nearby_offers(cat), cat)
    res = execute(plan, {"user_id": 10_000}, cat, binding="b", now=NOW)  # no such user
    assert res.table.num_rows == 0
    assert res.stats["sources"]["m"]["rows"] == 0 and "skipped" in res.stats["sources"]["m"]
    assert cat.source("memory://t/merchants").scans == 0  # no key: the scan never ran
    assert cat.source("memory://t/coupons").scans == 0


def test_residual_filter_over_derived_column(tables, ref) -> None:
    cat = world.catalog(tables)
    plan = world.nearby_offers(cat)
    lat, lon = ref.execute(
        "SELECT lat, lon FROM locations WHERE user_id = 3 ORDER BY ts DESC LIMIT 1"
    ).fetchone()
    cell = ref_geohash(lat, lon, 6)

    def add(node):
        if isinstance(node, Join) and isinstance(node.left, Join):
            inner = node.left
            return dataclasses.replace(
                node,
                left=dataclasses.replace(
                    inner, left=Filter(inner.left, eq(C("loc.cell"), Param("cell")))
                ),
            )
        ch = node.children()
        return node.with_children(*(add(c) for c in ch)) if ch else node

    opt = optimize(add(plan), cat)
    text = opt.explain()
    assert "Filter: loc.cell = {{session.cell}}" in text
    hit = execute(opt, {"user_id": 3, "cell": cell}, cat, binding="b", now=NOW)
    miss = execute(opt, {"user_id": 3, "cell": "zzzzzz"}, cat, binding="b", now=NOW)
    assert hit.table.to_pylist() == ref_nearby(ref, 3)[0] and miss.table.num_rows == 0


def test_left_join_keeps_unmatched_rows(tables, ref) -> None:
    cat = world.catalog(tables)
    res = execute(optimize(world.left_join(cat), cat), {}, cat, binding="b")
    expected = ref.execute(
        """SELECT m.id FROM merchants m LEFT JOIN coupons c ON c.merchant_id = m.id AND c.discount > 55
           WHERE m.id < 50 AND c.code IS NULL ORDER BY 1"""
    ).fetchall()
    assert sorted(r["id"] for r in res.table.to_pylist()) == [r[0] for r in expected]
    assert len(expected) > 0


def test_filter_over_join_and_aggregates(tables, ref) -> None:
    cat = world.catalog(tables)
    res = execute(optimize(world.filter_over_join(cat), cat), {}, cat, binding="b")
    expected = ref.execute(
        """SELECT m.name, c.code FROM merchants m JOIN coupons c ON c.merchant_id = m.id
           WHERE m.status = 'active' AND c.discount > 50 AND c.discount > m.id + 0 ORDER BY 2"""
    ).fetchall()
    assert sorted((r["name"], r["code"]) for r in res.table.to_pylist()) == sorted(expected)

    m, c = world.scan(cat, "m", "merchants"), world.scan(cat, "c", "coupons")
    j = Join(m, c, eq(C("c.merchant_id"), C("m.id")))
    agg = Aggregate(
        j,
        (("status", C("m.status"), pa.string()),),
        (
            ("n", Call("count", ()), pa.int64()),
            ("merchants", Call("count_distinct", (C("m.id"),)), pa.int64()),
            ("best", Call("max", (C("c.discount"),)), pa.int64()),
            ("avg_discount", Call("avg", (C("c.discount"),)), pa.float64()),
        ),
    )
    plan = Sort(agg, (SortKey(Column("status")),))
    res = execute(optimize(plan, cat), {}, cat, binding="b")
    expected = ref.execute(
        """SELECT m.status, count(*), count(DISTINCT m.id), max(c.discount), avg(c.discount)
           FROM merchants m JOIN coupons c ON c.merchant_id = m.id GROUP BY 1 ORDER BY 1"""
    ).fetchall()
    got = [tuple(r.values()) for r in res.table.to_pylist()]
    assert [g[:4] for g in got] == [e[:4] for e in expected]
    assert [g[4] for g in got] == pytest.approx([e[4] for e in expected])
    assert res.table.schema.field("n").type == pa.int64()


def test_single_source_expressions_in_pyarrow(tables, ref) -> None:
    cat = world.catalog(tables)
    m = Filter(
        world.scan(cat, "m", "merchants"),
        Binary(
            "and",
            eq(Call("upper", (C("m.status"),)), lit("CLOSED")),
            Binary("<", C("m.id"), lit(300)),
        ),
    )
    p = Project(
        m,
        (
            ("id", C("m.id"), pa.int64()),
            ("twice", Binary("*", C("m.id"), lit(2)), pa.int64()),
            ("len", Call("length", (C("m.name"),)), pa.int64()),
        ),
    )
    plan = Limit(Sort(p, (SortKey(Column("twice"), descending=True),)), 7, offset=2)
    res = execute(optimize(plan, cat), {}, cat, binding="b")
    expected = ref.execute(
        """SELECT id, id * 2 AS twice, length(name) FROM merchants WHERE upper(status) = 'CLOSED' AND id < 300
           ORDER BY twice DESC LIMIT 7 OFFSET 2"""
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == expected


def test_geo_hash_in_a_join_condition_runs_in_duckdb(tables, ref) -> None:
    cat = world.catalog(tables)
    loc = Filter(
        world.scan(cat, "loc", "locations", latest_by=("user_id",)),
        eq(C("loc.user_id"), Param("user_id")),
    )
    m = world.scan(cat, "m", "merchants")
    on = eq(C("m.geo_hash"), Call("geo_hash", (C("loc.lat"), C("loc.lon"), lit(6))))
    plan = Project(Join(loc, m, on), (("id", C("m.id"), pa.int64()),))
    lat, lon = ref.execute(
        "SELECT lat, lon FROM locations WHERE user_id = 2 ORDER BY ts DESC LIMIT 1"
    ).fetchone()
    expected = ref.execute(
        "SELECT id FROM merchants WHERE geo_hash = ? ORDER BY 1", [ref_geohash(lat, lon, 6)]
    ).fetchall()
    res = execute(optimize(plan, cat), {"user_id": 2}, cat, binding="b")
    assert sorted(r["id"] for r in res.table.to_pylist()) == [r[0] for r in expected]


class Lagging(world.Picky):
    def __init__(self, *a, lag: list, **kw):
        super().__init__(*a, **kw)
        self.lag = lag  # successive lag_messages values, last one repeats

    def watermark(self):
        lag = self.lag.pop(0) if len(self.lag) > 1 else self.lag[0]
        return Watermark(event_time=time.time() - 60, lag_messages=lag)


def _with_freshness(cat, fresh):
    return optimize(world.nearby_offers(cat, fresh=fresh), cat)


def test_freshness_fail_flag_wait(tables) -> None:
    def cat_with(lag):
        return world.catalog(
            tables,
            locations=Lagging("memory://t/locations", tables["locations"], Pushdown.EXACT, lag=lag),
        )

    bound = dict(max_lag_seconds=5, max_lag_messages=100)
    cat = cat_with([5000])
    with pytest.raises(
        QueryError,
        match=r"source loc \(memory://t/locations\): data is stale: 5000 messages behind",
    ):
        execute(
            _with_freshness(cat, Freshness(**bound, on_stale="fail")),
            {"user_id": 1},
            cat,
            binding="nearby_offers",
        )

    res = execute(
        _with_freshness(cat, Freshness(**bound, on_stale="flag")), {"user_id": 1}, cat, binding="b"
    )
    f = res.freshness["loc"]
    assert (
        f["status"] == "stale"
        and f["lag_messages"] == 5000
        and f["lag_seconds"] >= 59
        and res.stale == ["loc"]
    )
    assert res.freshness["m"]["status"] == "unknown"

    cat = cat_with([5000, 4000, 800, 0])
    res = execute(
        _with_freshness(cat, Freshness(**bound, on_stale="wait", wait_timeout=5)),
        {"user_id": 1},
        cat,
        binding="b",
    )
    assert (
        res.freshness["loc"]["status"] == "fresh"
        and res.waited > 0
        and res.freshness["loc"]["waited_seconds"] > 0
    )

    cat = cat_with([5000])
    with pytest.raises(QueryError, match="still stale after waiting"):
        execute(
            _with_freshness(cat, Freshness(**bound, on_stale="wait", wait_timeout=0.2)),
            {"user_id": 1},
            cat,
            binding="b",
        )


def test_freshness_provider_from_catalog_wins(tables) -> None:
    cat = world.catalog(tables)
    cat.freshness = lambda uri: (
        {"lag_messages": 0, "lag_seconds": 0.5} if uri.endswith("locations") else None
    )
    res = execute(
        _with_freshness(cat, Freshness(max_lag_seconds=5, on_stale="fail")),
        {"user_id": 1},
        cat,
        binding="b",
    )
    assert res.freshness["loc"]["status"] == "fresh" and res.freshness["loc"]["lag_seconds"] == 0.5


def test_explain_analyze_shows_pushdown_and_actual_rows(tables) -> None:
    cat = world.catalog(
        tables, merchants=world.Picky("memory://t/merchants", tables["merchants"], Pushdown.INEXACT)
    )
    plan = optimize(world.nearby_offers(cat), cat)
    res = execute(plan, {"user_id": 4}, cat, binding="nearby_offers", analyze=True, now=NOW)
    text = res.explain
    m_line = next(ln for ln in text.splitlines() if "Scan: m <-" in ln)
    assert f"rows={res.stats['sources']['m']['rows']}" in m_line
    assert "pushed exact=[] inexact=[status = 'active']" in m_line
    assert "residual=[m.status = 'active']" in m_line
    assert "est=" in m_line and "dynamic geo_hash in keys(loc.cell)" in m_line
    join_line = next(ln for ln in text.splitlines() if "Join: inner on c.merchant_id = m.id" in ln)
    assert "rows=" in join_line and "est=" in join_line
    assert text.splitlines()[0].startswith(f"Result: {res.table.num_rows} rows")
    duck = next(ln for ln in text.splitlines() if ln.startswith("DuckDB: "))
    assert "JOIN" in duck and "ORDER BY" in duck and "LIMIT 10" in duck
    assert execute(plan, {"user_id": 4}, cat, binding="b", now=NOW).explain is None


def test_missing_hooks_and_params_are_clear_errors(tables) -> None:
    from fabric.plan.nodes import UserFunction

    cat = world.catalog(tables)
    plan = UserFunction(
        world.single_source(cat), "def run(t):\n    return t\n", "agents/x.yaml", 12, 7
    )
    with pytest.raises(QueryError, match="needs a sandbox"):
        execute(optimize(plan, cat), {}, cat, binding="b")

    class Sandbox:
        def run(self, code, table, **kw):
            assert kw["snippet_origin"] == ("agents/x.yaml", 12, 7) and kw["binding"] == "b"
            return table.slice(0, 2)

    cat.sandbox = lambda: Sandbox()
    assert execute(optimize(plan, cat), {}, cat, binding="b").table.num_rows == 2

    with pytest.raises(
        QueryError, match=r"session value\(s\) 'user_id' not bound\n  hint: pass session="
    ):
        execute(optimize(world.top_category(cat), cat), {}, cat, binding="b", now=NOW)


def test_result_repr_is_short(tables) -> None:
    cat = world.catalog(tables)
    res = execute(
        optimize(world.nearby_offers(cat), cat),
        {"user_id": 1},
        cat,
        binding="nearby_offers",
        now=NOW,
    )
    r = repr(res)
    assert r.startswith("<Result nearby_offers: ") and len(r) < 200 and "rows fetched" in r
    assert isinstance(Literal(1, "int"), Literal)


def test_sort_below_project_single_source(tables, ref) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.single_source_sorted_below_project(cat), cat)
    res = execute(plan, {}, cat, binding="b")
    expected = ref.execute(
        "SELECT name FROM merchants WHERE status = 'active' ORDER BY id DESC LIMIT 3 OFFSET 1"
    ).fetchall()
    assert [(r["name"],) for r in res.table.to_pylist()] == expected
    assert res.stats["sources"]["m"]["rows"] == 4  # limit + offset pushed into the scan


def test_bindings_through_the_builder_match_reference(tables, ref) -> None:
    """The same scenarios written as binding YAML, through loader, builder and optimizer."""
    import pathlib

    from dsl.loader import load_text
    from fabric.plan.builder import build

    fixtures = pathlib.Path(__file__).parent / "fixtures" / "optimizer" / "all"
    cat = world.catalog(tables)

    def compiled(name: str):
        text = (fixtures / f"{name}.yaml").read_text().split("---- optimized")[0]
        return optimize(build(load_text(text, name)[0], cat), cat)

    offers, top = compiled("nearby_offers"), compiled("top_category")
    for user in USERS:
        res = execute(offers, {"user_id": user}, cat, binding="nearby_offers", now=NOW)
        expected, needed = ref_nearby(ref, user)
        assert res.table.to_pylist() == expected
        assert res.stats["sources"]["loc"]["rows"] == 1  # the source kept the latest row itself
        assert res.stats["sources"]["m"]["rows"] == needed["m"]
        got = execute(
            top, {"user_id": user}, cat, binding="top_category", now=NOW
        ).table.to_pylist()
        want = ref.execute(
            """SELECT k.category, sum(o.amount) FROM orders o JOIN categories k ON k.sku = o.sku
               WHERE o.user_id = ? AND o.ordered_at >= ? GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 1""",
            [user, NOW - dt_days(7)],
        ).fetchall()
        assert [(r["category"], pytest.approx(r["spent"])) for r in got] == [
            (c, pytest.approx(s)) for c, s in want
        ]


def test_vector_search_through_an_indexed_dataset(tables) -> None:
    """nearest: the executor calls the dataset's search() and folds its explain in."""
    import numpy as np

    from connectors.dataset import DatasetSource
    from dsl.ast import Param
    from fabric.execute.local import LocalCatalog
    from fabric.plan.nodes import VectorSearch
    from indexes.dataset import Dataset

    rng = np.random.default_rng(3)
    n, d = 400, 16
    vecs = rng.normal(size=(n, d)).astype(np.float32)
    symbols = rng.choice(["AAPL", "MSFT", "NVDA"], n)
    schema = pa.schema(
        [("id", pa.int64()), ("symbol", pa.string()), ("embedding", pa.list_(pa.float32(), d))]
    )
    ds = Dataset.create(
        "news", schema, "id", {"embedding": {"kind": "hnsw", "metric": "l2"}, "symbol": "inverted"}
    )
    ds.upsert(
        pa.table(
            {
                "id": pa.array(range(n), pa.int64()),
                "symbol": symbols,
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), d),
            },
            schema=schema,
        )
    )
    cat = LocalCatalog({}, datasets={"news": DatasetSource("dataset://news", ds)})
    q = rng.normal(size=d).astype(np.float32)
    vs = VectorSearch(
        "n",
        "dataset://news",
        schema,
        "embedding",
        Param("q"),
        5,
        filters=(eq(Column("symbol"), lit("NVDA")),),
    )
    plan = optimize(
        Project(vs, (("id", C("n.id"), pa.int64()), ("dist", C("n._distance"), pa.float32()))), cat
    )
    res = execute(plan, {"q": q.tolist()}, cat, binding="market_news", analyze=True)
    mask = symbols == "NVDA"
    dist = ((vecs - q) ** 2).sum(axis=1)
    expected = [int(i) for i in np.argsort(np.where(mask, dist, np.inf))[:5]]
    assert res.table.column("id").to_pylist() == expected
    assert res.stats["sources"]["n"]["rows"] == 5
    assert "VectorSearch n:" in res.explain


def test_encrypted_score_hook_gets_node_table_and_params(tables) -> None:
    from fabric.plan.nodes import EncryptedScore

    cat = world.catalog(tables)
    inner = world.nearby_offers(cat)  # Limit(Project(Sort(join)))
    sort = inner.input.input
    node = EncryptedScore(sort, "score", Call("dot", (Param("ctx"), C("c.discount"))))
    plan = Limit(
        Project(
            node, (("code", C("c.code"), pa.string()), ("score", Column("score"), pa.binary()))
        ),
        3,
    )
    seen = {}

    def crypto_score(n, table, params):
        seen.update(node=n, rows=table.num_rows, ctx=params["ctx"])
        return [b"ct-%d" % v for v in table.column("c.discount").to_pylist()]

    with pytest.raises(QueryError, match="CKKS public context"):
        execute(optimize(plan, cat), {"user_id": 2, "ctx": b"x"}, cat, binding="risk", now=NOW)
    cat.crypto_score = crypto_score
    res = execute(optimize(plan, cat), {"user_id": 2, "ctx": b"x"}, cat, binding="risk", now=NOW)
    assert seen["node"].name == "score" and seen["ctx"] == b"x" and seen["rows"] >= 3
    top3 = execute(optimize(inner, cat), {"user_id": 2}, cat, binding="b", now=NOW).table.slice(
        0, 3
    )
    assert res.table.column("code").to_pylist() == top3.column("code").to_pylist()  # order kept
    assert res.table.column("score").to_pylist() == [
        b"ct-%d" % d for d in top3.column("discount").to_pylist()
    ]


def test_generated_sql_binds_every_value() -> None:
    """The DuckDB text holds only quoted identifiers and $n placeholders, never a value."""
    from dsl.ast import InList, Like
    from fabric.execute.sql import Rel, SqlBuilder

    evil = "x'); DROP TABLE t; --"
    b = SqlBuilder({"name": evil, "ids": [1, 2]}, NOW)
    rel = Rel("", ['m.na"me', "m.id"])
    pred = Binary(
        "and",
        Binary("and", eq(Column('na"me', "m"), Param("name")), InList(C("m.id"), Param("ids"))),
        Binary("or", Like(Column('na"me', "m"), lit("%a%")), Binary(">", C("m.id"), Call("now"))),
    )
    sql = b.expr(pred, rel)
    assert evil not in sql and "%a%" not in sql and "DROP" not in sql
    assert '"m.na""me"' in sql and "$1" in sql and "(SELECT unnest($2))" in sql
    assert b.values == [evil, [1, 2], "%a%", NOW]


def test_concurrent_queries_share_nothing_mutable(tables, ref) -> None:
    """Many sessions at once on one compiled plan (the agents' normal case)."""
    from concurrent.futures import ThreadPoolExecutor

    cat = world.catalog(tables)
    plan = optimize(world.nearby_offers(cat), cat)
    expected = {u: ref_nearby(ref, u)[0] for u in USERS}

    def one(u: int) -> bool:
        return (
            execute(plan, {"user_id": u}, cat, binding="b", now=NOW).table.to_pylist()
            == expected[u]
        )

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, [u for u in USERS for _ in range(3)]))


def test_integer_sums_keep_the_declared_type(tables, ref) -> None:
    cat = world.catalog(tables)
    o, k = world.scan(cat, "o", "orders"), world.scan(cat, "k", "categories")
    agg = Aggregate(
        Join(o, k, eq(C("k.sku"), C("o.sku"))),
        (("k.category", C("k.category"), pa.string()),),
        (("skus", Call("sum", (C("o.sku"),)), pa.int64()),),
    )
    res = execute(optimize(Sort(agg, (SortKey(C("k.category")),)), cat), {}, cat, binding="b")
    assert res.table.schema.field("skus").type == pa.int64()
    expected = ref.execute(
        "SELECT k.category, sum(o.sku) FROM orders o JOIN categories k ON k.sku = o.sku GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert [tuple(r.values()) for r in res.table.to_pylist()] == [(c, int(s)) for c, s in expected]


def test_unknown_source_at_run_time_names_it(tables) -> None:
    cat = world.catalog(tables)
    plan = optimize(world.single_source(cat), cat)
    del cat.connections["t"].tables["merchants"]
    cat._sources.clear()
    with pytest.raises(
        QueryError, match=r"binding 'b', source m \(memory://t/merchants\).*does not exist"
    ):
        execute(plan, {}, cat, binding="b")
