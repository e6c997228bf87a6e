"""Retrieval strategies behind one protocol (issue 20): one table (``STRATEGIES``) that
the chooser, ``ds.search(strategy=...)``, explain and calibration all read, and searches
that change nothing shared -- each returns what it learned and ``Dataset.learn`` applies
it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from indexes import STRATEGIES, CostModel, DatasetError, calibrate, retrieval
from indexes.retrieval import (
    BUILTIN,
    Alternative,
    Calibration,
    Hits,
    SearchContext,
    Strategy,
    register_strategy,
    unregister_strategy,
)
from tests.test_retrieval import FAR10, K, anti_data, anti_dataset, brute, cl_in


class _Flat(Strategy):
    """Exact over every row, claiming to be nearly free (the test's registered strategy)."""

    name = "flat_test"
    calibration = Calibration(queries=3)

    def cost(self, ctx: SearchContext) -> Alternative:
        return Alternative(self.name, 1e-6 * ctx.scale.get(self.name, 1.0), "flat scan", 1e-6)

    def run(self, ctx: SearchContext) -> Hits:
        return BUILTIN["exact"].run(ctx)


def test_a_search_changes_nothing_shared_and_returns_what_it_learned():
    ds, _lab, _x, _ = anti_dataset(3000, 0, name="learn")
    cm = CostModel()
    ds.cost_model, ds.feedback = cm, {}
    q = anti_data(1, seed=41, clusters=50)[1][0]
    where = cl_in(FAR10)  # whole clusters far from the query: the walk keeps none
    with ds.lock.read():
        _, _, info = retrieval.search(
            ds, "v", q, K, where, {}, strategy="postfilter", graph_lock=ds.graph_lock
        )
    assert info.guard and "post-filter kept" in info.guard, str(info)
    assert ds.feedback == {} and cm.scale == {}  # the search itself changed nothing
    fb = info.feedback
    assert fb is not None and fb.key == info.feedback_key and fb.model is cm
    assert fb.fired == (("postfilter", True),)
    assert fb.decay_except is None  # forced: the other strategies' rates stay
    assert fb.cost is not None and fb.cost[0] == "postfilter" and fb.cost[1] > 0
    ds.learn(fb)  # the one place it is applied
    assert ds.feedback == {info.feedback_key: {"postfilter": pytest.approx(0.3)}}
    assert set(cm.scale) == {"postfilter"}
    # Dataset.search applies what its search returned, the same way
    ds.search("v", q, K, where, {}, strategy="postfilter")
    assert ds.feedback[info.feedback_key]["postfilter"] == pytest.approx(0.7 * 0.3 + 0.3)
    # an optimizer choice decays the other strategies' fire rates
    _, chose = ds.search("v", q, K, where, {})
    assert chose.feedback is not None and chose.feedback.decay_except == chose.chosen
    assert chose.chosen != "postfilter", str(chose)
    assert ds.feedback[info.feedback_key]["postfilter"] == pytest.approx(0.98 * 0.51)


def test_concurrent_searches_each_apply_what_they_learned():
    """Eight threads, 40 searches by a strategy whose guard always fires: every search's
    outcome is applied exactly once (0.3 + 0.7 x the previous rate each time), none lost
    to a race, as if they had run one after the other."""

    class Failing(_Flat):
        name = "failing_test"

        def run(self, ctx: SearchContext) -> Hits:
            ctx.observe(self.name, True)
            return super().run(ctx)

    ds, _lab, _x, _ = anti_dataset(3000, 0, name="threads")
    ds.cost_model, ds.feedback = CostModel(), {}
    qs = anti_data(8, seed=43, clusters=50)[1]
    where = cl_in(FAR10)
    errors: list[BaseException] = []

    def worker(q: np.ndarray) -> None:
        try:
            for _ in range(5):
                ds.search("v", q, K, where, {}, strategy="failing_test")
        except BaseException as e:  # reported below
            errors.append(e)

    register_strategy(Failing())
    try:
        threads = [threading.Thread(target=worker, args=(q,)) for q in qs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        unregister_strategy("failing_test")
    assert not errors, errors
    (rates,) = ds.feedback.values()
    assert rates == {"failing_test": pytest.approx(1 - 0.7**40)}
    assert 0.25 <= ds.cost_model.scale["failing_test"] <= 5.0


def test_a_registered_strategy_is_costed_chosen_explained_forced_and_calibrated(tmp_path):
    ds, lab, x, _ = anti_dataset(3000, 0, name="registered")
    q = anti_data(1, seed=45, clusters=50)[1][0]
    register_strategy(_Flat())
    try:
        assert "flat_test" in STRATEGIES
        ds.cost_model, ds.feedback = CostModel(), {}
        res, info = ds.search("v", q, K, cl_in([77]), {}, columns=["id"])
        assert info.chosen == info.executed == "flat_test", str(info)
        assert info.guarantee == "exact"
        assert res.column("id").to_pylist() == brute(x, lab == 77, q).tolist()
        text = str(info)
        assert "* flat_test" in text and "chosen: flat_test" in text, text
        assert all(s in text for s in BUILTIN if s != "partition" or "partition" in text)
        _, forced = ds.search("v", q, K, None, {}, strategy="flat_test")
        assert forced.forced and forced.executed == "flat_test"
        with pytest.raises(DatasetError, match=r"unknown retrieval strategy 'nope'.*flat_test"):
            ds.search("v", q, K, strategy="nope")
        with pytest.raises(DatasetError, match="already registered"):
            register_strategy(_Flat())
        cm = calibrate(ds, rows=2000, save_to=str(tmp_path / "costs.json"))
        assert "flat_test" in cm.overheads  # calibration iterates the table
        assert {"postfilter", "insearch", "prefilter", "exact"} <= set(cm.overheads)
    finally:
        unregister_strategy("flat_test")
        ds.cost_model, ds.feedback = None, {}
    assert "flat_test" not in STRATEGIES
    with pytest.raises(DatasetError, match="unknown retrieval strategy"):
        ds.search("v", q, K, strategy="flat_test")
    with pytest.raises(DatasetError, match="built in"):
        unregister_strategy("prefilter")
    with pytest.raises(DatasetError, match="lower-case"):
        register_strategy(type("Bad", (_Flat,), {"name": "Bad Name"})())


def test_a_guard_hands_over_to_the_cheapest_strategy_that_answers_exactly():
    """A registered ``fallback`` strategy cheaper than the pre-filter answers a fired
    guard; the answer is still numpy's."""
    ds, lab, x, _ = anti_dataset(3000, 0, name="handover")
    ds.vectors["v"].partitions = None  # no per-value graphs: the pre-filter or ours

    class Scan(_Flat):
        name = "scan_test"
        fallback = True

        def cost(self, ctx: SearchContext) -> Alternative:
            return Alternative(self.name, 1e-3, "cheap exact answer", 1e-3)

    register_strategy(Scan())
    try:
        q = anti_data(1, seed=47, clusters=50)[1][0]
        res, info = ds.search("v", q, K, cl_in(FAR10), {}, strategy="postfilter", columns=["id"])
        assert info.guard and info.executed == "scan_test" and info.guarantee == "exact"
        assert res.column("id").to_pylist() == brute(x, np.isin(lab, FAR10), q).tolist()
    finally:
        unregister_strategy("scan_test")
    res, info = ds.search("v", q, K, cl_in(FAR10), {}, strategy="postfilter", columns=["id"])
    assert info.guard and info.executed == "prefilter", str(info)
