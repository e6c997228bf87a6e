"""FreshnessTracker: lag definitions, rate, errors, binding readiness, waiting, live sources."""

from __future__ import annotations

import threading
import time

import pytest

from connectors.base import Source, Watermark
from fabric.freshness import FreshnessTimeout, FreshnessTracker
from fabric.signals import DATA_FRESH, DATA_STALE, HEARTBEAT, STALE, Thresholds


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def tr():
    clock = Clock()
    tracker = FreshnessTracker(
        Thresholds(lag_messages=1000, lag_seconds=30), rate_window=10, clock=clock
    )
    tracker.clock_ = clock
    tracker.events = []
    tracker.listen(tracker.events.append)
    tracker.register_source("news", uri="kafka://bus/news")
    tracker.register_source("loc", uri="kafka://bus/location_stream")
    tracker.set_bindings(
        {"market_open_news": ["news"], "nearby_offers": ["loc"], "both": ["news", "loc"]}
    )
    return tracker


def test_lag_seconds_is_zero_when_caught_up_and_bounded_by_when_it_fell_behind(tr):
    c = tr.clock_
    tr.record_applied(
        "news", 10, newest_event_time=c.t - 3600
    )  # last event an hour ago, idle since
    tr.update_lag("news", 0)
    assert tr.source("news").lag_seconds == 0.0
    tr.update_lag("news", 1)  # one new message arrives now: not an hour of lag
    c.t += 2
    f = tr.source("news")
    assert f.lag_messages == 1 and f.lag_seconds == pytest.approx(2.0)
    tr.record_applied("news", 1, newest_event_time=c.t - 0.5)
    c.t += 1
    assert tr.source("news").lag_seconds == pytest.approx(1.5)  # now - newest applied


def test_rate_over_window_and_counters(tr):
    c = tr.clock_
    for _ in range(5):
        tr.record_applied("news", 200)
        c.t += 1
    tr.record_dead_letters("news", 3)
    f = tr.source("news")
    assert f.ingest_rate == pytest.approx(1000 / 10)
    assert f.ingested_total == 1000 and f.dead_letter_total == 3
    c.t += 30
    assert tr.source("news").ingest_rate == 0.0


def test_transitions_name_the_bindings_and_binding_readiness_follows(tr):
    tr.update_lag("news", 5000)
    assert [e["event"] for e in tr.events] == [DATA_STALE]
    ev = tr.events[0]
    assert ev["source"] == "news" and ev["bindings"] == ["both", "market_open_news"]
    assert ev["lag_messages"] == 5000 and ev["at"].endswith("+00:00")
    snap = tr.snapshot()
    assert snap["bindings"]["market_open_news"]["state"] == STALE
    assert snap["bindings"]["both"]["stale_sources"] == ["news"]
    assert snap["bindings"]["nearby_offers"]["state"] == "fresh"
    assert snap["totals"]["stale_bindings"] == 2 and snap["totals"]["lag_messages"] == 5000
    tr.update_lag("news", 600)  # above half: still stale
    assert len(tr.events) == 1
    tr.update_lag("news", 400)
    assert [e["event"] for e in tr.events] == [DATA_STALE, DATA_FRESH]
    assert tr.binding_state("both")[0] == "fresh"


def test_binding_override_has_its_own_bound(tr):
    tr.set_bindings(
        {"strict": ["news"], "lax": ["news"]},
        overrides={("strict", "news"): Thresholds(lag_messages=10, lag_seconds=None)},
    )
    tr.update_lag("news", 50)
    assert [(e["event"], e["bindings"], e["scope"]) for e in tr.events] == [
        (DATA_STALE, ["strict"], "binding")
    ]
    snap = tr.snapshot()
    assert (
        snap["bindings"]["strict"]["state"] == STALE and snap["bindings"]["lax"]["state"] == "fresh"
    )
    assert snap["sources"]["news"]["state"] == "fresh"


def test_error_marks_stale_with_last_error_until_cleared(tr):
    tr.record_error("loc", "KafkaError: all brokers down")
    f = tr.source("loc")
    assert f.stale and f.last_error == "KafkaError: all brokers down"
    assert tr.events[-1]["event"] == DATA_STALE and "brokers down" in tr.events[-1]["reason"]
    tr.clear_error("loc")
    assert not tr.source("loc").stale and tr.events[-1]["event"] == DATA_FRESH


def test_heartbeat_one_event_per_source(tr):
    tr.update_lag("news", 7)
    tr.heartbeat()
    beats = [e for e in tr.events if e["event"] == HEARTBEAT]
    assert sorted(b["source"] for b in beats) == ["loc", "news"]
    assert next(b for b in beats if b["source"] == "news")["lag_messages"] == 7


def test_unknown_source_lists_registered_ones(tr):
    with pytest.raises(KeyError, match="registered sources: loc, news"):
        tr.source("nwes")


def test_wait_until_fresh_returns_waited_seconds_and_times_out():
    tr = FreshnessTracker(Thresholds(lag_messages=100, lag_seconds=None))
    tr.register_source("s")
    assert tr.wait_until_fresh("s", timeout=0.1) == pytest.approx(0.0, abs=0.05)
    tr.update_lag("s", 5000)

    def catch_up():
        time.sleep(0.3)
        tr.update_lag("s", 2000)
        time.sleep(0.2)
        tr.update_lag("s", 10)

    t = threading.Thread(target=catch_up)
    t.start()
    waited = tr.wait_until_fresh("s", max_lag_messages=50, timeout=5)
    t.join()
    assert 0.4 < waited < 3.0
    tr.update_lag("s", 900)
    with pytest.raises(
        FreshnessTimeout, match=r"s still behind .* lag 900 messages.*bound 50 messages"
    ) as ei:
        tr.wait_until_fresh("s", max_lag_messages=50, timeout=0.2)
    assert ei.value.waited >= 0.2 and ei.value.freshness.lag_messages == 900


class _Live(Source):
    def __init__(self, wm):
        super().__init__("s3://lake/orders/*.parquet")
        self.wm = wm

    def watermark(self):
        if isinstance(self.wm, Exception):
            raise self.wm
        return self.wm


def test_live_sources_use_their_watermark():
    tr = FreshnessTracker(Thresholds(lag_messages=None, lag_seconds=60))
    now = time.time()
    f = tr.live_freshness("orders", _Live(Watermark(observed_at=now, event_time=now - 120)))
    assert f.kind == "live" and f.lag_seconds == pytest.approx(120) and f.stale
    f = tr.live_freshness("orders", _Live(Watermark(observed_at=now, event_time=now - 5)))
    assert f.lag_seconds == pytest.approx(5) and not f.stale
    f = tr.live_freshness("m", _Live(None))  # no watermark: fresh as of query time
    assert f.lag_seconds == 0.0 and not f.stale
    f = tr.live_freshness("m", _Live(ConnectionError("refused")))
    assert f.stale and "refused" in f.last_error


def test_lag_is_the_cheap_read_queries_make_and_agrees_with_the_snapshot(tr):
    c = tr.clock_
    assert tr.lag("no_such_source") is None
    tr.record_applied("news", 5, newest_event_time=c.t - 10)
    tr.update_lag("news", 250)
    c.t += 4
    kind, lag_messages, lag_seconds, newest = tr.lag("news")
    snap = tr.source("news")
    assert (kind, lag_messages, newest) == ("kafka", 250, c.t - 14)
    assert lag_seconds == pytest.approx(snap.lag_seconds)
