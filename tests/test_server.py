"""The HTTP layer over a FreshnessTracker: /v1/freshness, /metrics, /v1/events, /healthz,
a real Prometheus scraping it, and the endpoint under a loopback load."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fabric.freshness import FreshnessTracker
from fabric.server import ServerThread, create_app
from fabric.signals import Thresholds


def get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


@pytest.fixture
def served():
    tr = FreshnessTracker(Thresholds(lag_messages=1000, lag_seconds=30))
    tr.register_source("news", uri="kafka://bus/news")
    tr.register_source("loc", uri="kafka://bus/location_stream")
    tr.set_bindings({"market_open_news": ["news"], "nearby_offers": ["loc"]})
    srv = ServerThread(create_app(tr)).start()
    yield tr, srv
    srv.stop()


def dig(obj, path: str):
    """What a KEDA metrics-api scaler does with valueLocation (gjson path, dots)."""
    for part in path.split("."):
        obj = obj[part]
    return obj


def test_freshness_json_and_keda_paths(served):
    tr, srv = served
    tr.record_applied("news", 120, newest_event_time=time.time() - 1)
    tr.update_lag("news", 4321)
    status, body = get(srv.url + "/v1/freshness")
    snap = json.loads(body)
    assert status == 200
    assert dig(snap, "sources.news.lag_messages") == 4321
    assert dig(snap, "sources.news.stale") == 1 and dig(snap, "sources.news.state") == "stale"
    assert dig(snap, "bindings.market_open_news.stale") == 1
    assert dig(snap, "bindings.nearby_offers.state") == "fresh"
    assert dig(snap, "totals.stale_bindings") == 1
    assert snap["sources"]["news"]["ingested_total"] == 120
    _, one = get(srv.url + "/v1/freshness?source=news")
    assert json.loads(one)["lag_messages"] == 4321
    with pytest.raises(urllib.error.HTTPError) as ei:
        get(srv.url + "/v1/freshness?binding=nope")
    assert ei.value.code == 404 and "market_open_news" in ei.value.read().decode()
    assert json.loads(get(srv.url + "/healthz")[1])["status"] == "ok"


def test_metrics_exposition(served):
    tr, srv = served
    tr.update_lag("news", 2500)
    tr.record_applied("loc", 42)
    tr.record_dead_letters("loc", 2)
    _, body = get(srv.url + "/metrics")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }
    assert samples[("fabric_source_lag_messages", (("source", "news"),))] == 2500
    assert samples[("fabric_source_stale", (("source", "news"),))] == 1
    assert samples[("fabric_source_ingested_messages_total", (("source", "loc"),))] == 42
    assert samples[("fabric_source_dead_letters_total", (("source", "loc"),))] == 2
    assert samples[("fabric_binding_stale", (("binding", "market_open_news"),))] == 1


def test_sse_stream_carries_transitions(served):
    tr, srv = served
    got: list[tuple[str, dict]] = []
    ready = threading.Event()

    def read():
        with urllib.request.urlopen(srv.url + "/v1/events", timeout=10) as r:
            event = None
            for raw in r:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    got.append((event, json.loads(line[6:])))
                    if event == "state" and len(got) == 2:
                        ready.set()
                    if event == "data_fresh":
                        return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert ready.wait(10)
    tr.update_lag("loc", 99999)
    tr.update_lag("loc", 0)
    t.join(10)
    names = [e for e, _ in got]
    assert names == ["state", "state", "data_stale", "data_fresh"]
    assert got[2][1]["source"] == "loc" and got[2][1]["bindings"] == ["nearby_offers"]
    assert got[2][1]["lag_messages"] == 99999


def test_endpoint_keeps_answering_under_load_while_state_changes(served):
    tr, srv = served
    stop = threading.Event()

    def churn():  # an ingestor-like writer updating the tracker continuously
        i = 0
        while not stop.is_set():
            tr.record_applied("news", 10, newest_event_time=time.time())
            tr.update_lag("news", (i * 37) % 3000)
            i += 1
            time.sleep(0.001)

    w = threading.Thread(target=churn, daemon=True)
    w.start()
    url = srv.url + "/v1/freshness"

    def one(_):
        t0 = time.perf_counter()
        status, body = get(url, timeout=10)
        json.loads(body)["sources"]["news"]["lag_messages"]
        return status, time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(2000)))
    finally:
        stop.set()
        w.join(5)
    elapsed = time.perf_counter() - t0
    assert all(s == 200 for s, _ in results) and len(results) == 2000
    lat = sorted(d for _, d in results)
    print(
        f"\n2000 requests in {elapsed:.2f}s = {2000 / elapsed:.0f} req/s; p50 {lat[1000] * 1e3:.1f} ms, p99 {lat[1980] * 1e3:.1f} ms"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_prometheus_scrapes_the_lag_series(served, prometheus_bin, tmp_path):
    tr, srv = served
    tr.update_lag("news", 777)
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: fabric\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{srv.port}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    try:
        q = urllib.parse.urlencode({"query": 'fabric_source_lag_messages{source="news"}'})
        deadline = time.monotonic() + 60
        value = None
        while time.monotonic() < deadline and value is None:
            time.sleep(0.5)
            if proc.poll() is not None:
                pytest.fail(
                    "prometheus exited: " + (tmp_path / "prometheus.log").read_text()[-2000:]
                )
            try:
                _, body = get(f"http://127.0.0.1:{port}/api/v1/query?{q}")
            except OSError:
                continue
            res = json.loads(body)["data"]["result"]
            if res:
                value = float(res[0]["value"][1])
        assert value == 777
        tr.update_lag("news", 12)  # the next scrapes see the new lag: a series, not a constant
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            rq = urllib.parse.urlencode({"query": 'fabric_source_lag_messages{source="news"}[30s]'})
            vals = [
                float(v)
                for _, v in json.loads(get(f"http://127.0.0.1:{port}/api/v1/query?{rq}")[1])[
                    "data"
                ]["result"][0]["values"]
            ]
            if vals[-1] == 12:
                break
        assert 777 in vals and vals[-1] == 12
    finally:
        proc.terminate()
        proc.wait(10)
