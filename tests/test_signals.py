"""The fresh|stale state machine (hysteresis, dwell) and the pushed signals (UDP, webhook)."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fabric.signals import (
    DATA_FRESH,
    DATA_STALE,
    FRESH,
    HEARTBEAT,
    STALE,
    SignalEmitter,
    StateMachine,
    Target,
    Thresholds,
    make_event,
)


def run_series(machine: StateMachine, series, start: float = 1000.0):
    """Feed (lag_messages, lag_seconds) pairs one second apart; return the transitions."""
    out = []
    for i, (m, s) in enumerate(series):
        t = machine.update(m, s, now=start + i)
        if t is not None:
            out.append((i, t.state))
    return out


def test_sawtooth_lag_goes_stale_once_and_does_not_flap():
    m = StateMachine(Thresholds(lag_messages=1000, lag_seconds=None), now=1000.0)
    # ramp to 1200, then saw-tooth between 600 and 1300 for a while (crossing 1000 each time)
    saw = [0, 400, 800, 1200] + [600, 900, 1300, 700, 1100, 650, 1250] * 5
    series = [(x, 0.0) for x in saw]
    transitions = run_series(m, series)
    assert transitions == [(3, STALE)]
    # a naive threshold without hysteresis would flap on every crossing of 1000
    naive = sum(1 for a, b in itertools.pairwise(saw) if (a > 1000) != (b > 1000))
    assert naive > 10
    # below half of the threshold: fresh again, exactly once
    tail = run_series(m, [(520, 0.0), (500, 0.0), (300, 0.0), (0, 0.0)], start=2000.0)
    assert tail == [(1, FRESH)]


def test_seconds_threshold_and_both_must_recover():
    m = StateMachine(Thresholds(lag_messages=100, lag_seconds=10), now=0)
    assert m.update(5, 11.0, now=1).state == STALE  # seconds alone
    assert m.update(0, 6.0, now=2) is None  # messages fine, seconds above half
    assert m.update(60, 1.0, now=3) is None  # seconds fine, messages above half
    assert m.update(50, 5.0, now=4).state == FRESH  # at half of both: fresh


def test_error_forces_stale_until_cleared():
    m = StateMachine(Thresholds(), now=0)
    t = m.update(0, 0.0, error="broker down", now=1)
    assert t.state == STALE and "broker down" in t.reason
    assert m.update(0, 0.0, error="broker down", now=2) is None
    assert m.update(0, 0.0, now=3).state == FRESH


def test_min_dwell_holds_stale():
    m = StateMachine(Thresholds(lag_messages=10, lag_seconds=None, min_dwell=5.0), now=0)
    assert m.update(11, None, now=1).state == STALE
    assert m.update(0, None, now=3) is None  # recovered, but only 2 s in stale
    assert m.update(0, None, now=6.5).state == FRESH


def test_threshold_and_target_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="lag_messages must be >= 0"):
        Thresholds(lag_messages=-1)
    with pytest.raises(ValueError, match=r"unsupported scheme 'tcp'.*udp://host:port"):
        Target.parse("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs a port"):
        Target.parse("udp://127.0.0.1")
    assert Target.parse("https://sched.local/hook").port == 443


def test_udp_target_receives_one_json_object_per_datagram():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    port = rx.getsockname()[1]
    em = SignalEmitter([f"udp://127.0.0.1:{port}"])
    try:
        em.emit(make_event(DATA_STALE, "news", ["b2", "b1"], 5000, 12.5, at=0.0))
        em.emit(make_event(DATA_FRESH, "news", ["b1", "b2"], 10, 0.1))
        got = [json.loads(rx.recv(65536)) for _ in range(2)]
    finally:
        em.close()
        rx.close()
    assert [g["event"] for g in got] == [DATA_STALE, DATA_FRESH]
    first = got[0]
    assert first["source"] == "news" and first["bindings"] == ["b1", "b2"]
    assert first["lag_messages"] == 5000 and first["lag_seconds"] == 12.5
    assert first["at"] == "1970-01-01T00:00:00.000+00:00"
    assert got[1]["seq"] == first["seq"] + 1


class _Hook(BaseHTTPRequestHandler):
    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.gate.wait(10)
        with srv.lock:
            srv.attempts += 1
            fail = srv.attempts <= srv.fail_first
            if not fail:
                srv.bodies.append(body)
        self.send_response(503 if fail else 204)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def webhook():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    srv.bodies, srv.attempts, srv.fail_first = [], 0, 0
    srv.lock, srv.gate = threading.Lock(), threading.Event()
    srv.gate.set()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/fabric-signals"
    yield srv
    srv.gate.set()
    srv.shutdown()
    srv.server_close()


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_webhook_is_retried_with_backoff_until_accepted(webhook):
    webhook.fail_first = 2
    em = SignalEmitter([webhook.url], retries=3, backoff=0.05)
    try:
        em.emit(make_event(DATA_STALE, "news", ["b"], 2000, 3.0))
        assert wait_for(lambda: webhook.bodies)
        # the server has the body before the sender thread has read the 200: wait for both
        assert wait_for(lambda: em.stats()[webhook.url]["sent"] == 1)
        stats = em.stats()[webhook.url]
    finally:
        em.close()
    assert webhook.attempts == 3
    assert stats["retries"] == 2 and stats["sent"] == 1 and stats["failed"] == 0
    assert webhook.bodies[0]["event"] == DATA_STALE and webhook.bodies[0]["lag_messages"] == 2000


def test_full_queue_drops_heartbeats_first_and_counts_drops(webhook):
    webhook.gate.clear()  # the receiver hangs: the sender is stuck on the first event
    em = SignalEmitter([webhook.url], queue_size=3, retries=0, http_timeout=10)
    sender = em._senders[0]
    try:
        em.emit(make_event(DATA_STALE, "s0", [], 1, 0))
        assert wait_for(lambda: len(sender.queue) == 0)  # taken by the sender thread
        em.emit(make_event(HEARTBEAT, "hb1", [], 0, 0))
        em.emit(make_event(DATA_FRESH, "s1", [], 0, 0))
        em.emit(make_event(HEARTBEAT, "hb2", [], 0, 0))
        em.emit(make_event(DATA_STALE, "s2", [], 0, 0))  # full: hb1 goes
        em.emit(make_event(DATA_FRESH, "s3", [], 0, 0))  # full: hb2 goes
        em.emit(make_event(DATA_STALE, "s4", [], 0, 0))  # full, no heartbeat left: oldest (s1) goes
        # emit never waits for the receiver (still hung): it dropped instead of blocking
        assert [e["source"] for e in sender.queue] == ["s2", "s3", "s4"]
        assert em.dropped == 3
        webhook.gate.set()
        assert wait_for(lambda: len(webhook.bodies) == 4)
    finally:
        em.close()
    assert [b["source"] for b in webhook.bodies] == ["s0", "s2", "s3", "s4"]


def test_sawtooth_through_tracker_and_real_receivers_sends_one_stale_one_fresh(webhook):
    from fabric.freshness import FreshnessTracker

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(0.3)
    clock = [1000.0]
    tr = FreshnessTracker(Thresholds(lag_messages=1000, lag_seconds=60), clock=lambda: clock[0])
    tr.register_source("news")
    tr.set_bindings({"market_open_news": ["news"]})
    em = SignalEmitter([f"udp://127.0.0.1:{rx.getsockname()[1]}", webhook.url])
    tr.listen(em.emit)
    try:
        # a producer outruns ingestion, then the lag saw-tooths around the threshold for a
        # minute (600..1400, crossing 1000 twice a period), then it drains
        series = [0, 300, 900, 1400] + [600, 1000, 1400, 1100, 700, 1300] * 10 + [800, 450, 100, 0]
        for lag in series:
            clock[0] += 1
            tr.record_applied("news", 500, newest_event_time=clock[0] - 1)
            tr.update_lag("news", lag)
        got = []
        while True:
            try:
                got.append(json.loads(rx.recv(65536)))
            except TimeoutError:
                break
        assert wait_for(lambda: len(webhook.bodies) == 2)
    finally:
        em.close()
        rx.close()
    assert [g["event"] for g in got] == [DATA_STALE, DATA_FRESH]
    assert [b["event"] for b in webhook.bodies] == [DATA_STALE, DATA_FRESH]
    assert got[0]["lag_messages"] == 1400 and got[1]["lag_messages"] == 450
    assert got[0]["bindings"] == ["market_open_news"]
