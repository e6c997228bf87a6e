"""The reference scheduler (examples/scheduler) on real pushed signals, and its simulation."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

from fabric.freshness import FreshnessTracker
from fabric.server import ServerThread, create_app
from fabric.signals import SignalEmitter, Thresholds

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "scheduler"))

import scheduler as sch
import simulate


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def make_tracker() -> FreshnessTracker:
    tr = FreshnessTracker(Thresholds(lag_messages=1000, lag_seconds=None))
    tr.register_source("news")
    tr.register_source("loc")
    tr.set_bindings({"market_open_news": ["news"], "nearby_offers": ["loc"]})
    return tr


def test_scheduler_parks_and_releases_on_udp_signals():
    port = free_udp_port()
    log: list[str] = []
    s = sch.Scheduler(2, log=log.append)
    s.add_agent("analyst", ["market_open_news"])
    s.add_agent("shopper", ["nearby_offers"])
    s.add_agent("shopper2", ["nearby_offers"])
    assert set(s.holding()) == {"analyst", "shopper"}  # two GPUs, first come first served
    stop = threading.Event()
    sch.listen_udp(s, "127.0.0.1", port, stop)
    tr = make_tracker()
    em = SignalEmitter([f"udp://127.0.0.1:{port}"])
    tr.listen(em.emit)
    try:
        tr.update_lag("news", 100_000)  # the incident
        assert wait_for(lambda: s.parked() == ["analyst"])
        assert set(s.holding()) == {"shopper", "shopper2"}  # its GPU went to the waiting agent
        tr.update_lag("news", 700)  # below the threshold, above half: still parked
        tr.update_lag("news", 40)
        assert wait_for(lambda: s.parked() == [])
        s.finish("shopper")
        assert "analyst" in s.holding()
    finally:
        stop.set()
        em.close()
    assert [x.split()[0] for x in log] == ["park", "release"]
    assert "lag 100000 messages" in log[0]


def test_scheduler_polls_the_freshness_endpoint():
    tr = make_tracker()
    srv = ServerThread(create_app(tr)).start()
    s = sch.Scheduler(1, log=lambda _m: None)
    s.add_agent("analyst", ["market_open_news"])
    stop = threading.Event()
    sch.poll_http(s, srv.url + "/v1/freshness", 0.05, stop)
    try:
        tr.update_lag("news", 5000)
        assert wait_for(lambda: s.parked() == ["analyst"])
        tr.update_lag("news", 0)
        assert wait_for(lambda: s.parked() == [] and "analyst" in s.holding())
    finally:
        stop.set()
        srv.stop()


def test_simulation_signal_saves_gpu_seconds():
    blind = simulate.run(False, gpus=6, burst=100_000)
    aware = simulate.run(True, gpus=6, burst=100_000)
    assert blind.wasted > 100  # six news agents stuck holding GPUs during the incident
    assert aware.wasted < blind.wasted / 10
    assert aware.jobs > blind.jobs
    assert aware.signals == 2  # one data_stale, one data_fresh: no flapping
    assert simulate.run(True, gpus=6, burst=0).max_parked == 0  # no incident, nobody parked
