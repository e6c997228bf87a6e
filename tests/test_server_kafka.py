"""``fabric serve`` end to end on the real broker: a fabric.yaml with a Kafka-fed dataset and
a binding; a producer outruns ingestion; UDP and webhook receivers get data_stale, then
data_fresh, once each; /v1/freshness and /metrics follow."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from confluent_kafka import Producer

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receivers:
    """A UDP socket and a webhook on loopback, collecting every pushed event."""

    def __init__(self):
        self.udp: list[dict] = []
        self.hook: list[dict] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.udp_port = self.sock.getsockname()[1]
        outer = self

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.hook.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        self.hook_url = f"http://127.0.0.1:{self.http.server_address[1]}/fabric-signals"
        self.stop = threading.Event()
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        threading.Thread(target=self._udp_loop, daemon=True).start()

    def _udp_loop(self):
        while not self.stop.is_set():
            try:
                self.udp.append(json.loads(self.sock.recv(65536)))
            except TimeoutError:
                continue
            except OSError:  # closed at the end of the test
                return

    def close(self):
        self.stop.set()
        self.http.shutdown()
        self.http.server_close()
        self.sock.close()


def transitions(events: list[dict]) -> list[str]:
    return [e["event"] for e in events if e["event"] != "heartbeat" and e.get("scope") == "source"]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def doc(i: int) -> bytes:
    return json.dumps(
        {"id": f"d{i}", "n": i, "body": f"w{i % 50} tick", "vec": [i % 7, 1, i % 3, 0.5]}
    ).encode()


def test_fabric_serve_signals_a_producer_outrunning_ingestion(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=2, prefix="serve")
    rx = Receivers()
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "search.yaml").write_text(
        "binding: doc_search\nsources:\n  d:\n    from: dataset://docs\nselect: [d.id]\n"
    )
    (tmp_path / "fabric.yaml").write_text(
        f"""
connections:
  bus: {{kind: kafka, bootstrap: "{kafka_bootstrap}"}}
datasets:
  docs:
    from: kafka://bus/{topic}
    key: id
    schema: {{id: str, n: int, body: str, vec: "vector[4]"}}
    indexes: {{n: btree, body: inverted, vec: hnsw}}
signals:
  stale_when: {{lag_messages: 1000, lag_seconds: 60}}
  hysteresis: 0.5
  heartbeat: 1s
  targets: ["udp://127.0.0.1:{rx.udp_port}", "{rx.hook_url}"]
bindings: [agents/]
ingest: {{batch_size: 2000}}
"""
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fabric.server",
            "--config",
            str(tmp_path / "fabric.yaml"),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    try:
        wait(lambda: _up(base) or proc.poll() is not None, 30, "fabric serve to answer")
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        for i in range(200):
            p.produce(topic, key=f"d{i}", value=doc(i))
        p.flush()
        wait(
            lambda: get_json(base + "/v1/freshness")["sources"]["docs"]["ingested_total"] == 200,
            30,
            "200 ingested",
        )
        snap = get_json(base + "/v1/freshness")
        assert (
            snap["sources"]["docs"]["state"] == "fresh"
            and snap["bindings"]["doc_search"]["state"] == "fresh"
        )
        assert transitions(rx.udp) == []

        burst = 60_000  # much faster than the dataset can index them
        for i in range(200, 200 + burst):
            p.produce(topic, key=f"d{i}", value=doc(i))
            if i % 10000 == 0:
                p.poll(0)
        p.flush()
        # while the burst is being ingested, a loopback load generator hammers the endpoint
        results = hammer(base + "/v1/freshness", requests=1000, threads=8)
        assert len(results) == 1000 and all(code == 200 for code, _ in results)
        assert any(lag > 0 for _, lag in results)  # it answered while ingestion was behind
        wait(lambda: "data_stale" in transitions(rx.udp), 30, "data_stale over UDP")
        stale = next(e for e in rx.udp if e["event"] == "data_stale")
        assert stale["source"] == "docs" and stale["bindings"] == ["doc_search"]
        assert stale["lag_messages"] > 1000 and stale["at"].endswith("+00:00")
        seen_stale = get_json(base + "/v1/freshness?binding=doc_search")
        wait(lambda: "data_fresh" in transitions(rx.udp), 180, "data_fresh over UDP")
        wait(
            lambda: transitions(rx.hook) == ["data_stale", "data_fresh"],
            30,
            "the webhook to get both",
        )
        assert transitions(rx.udp) == ["data_stale", "data_fresh"]  # once each: no flapping
        fresh = next(e for e in rx.udp if e["event"] == "data_fresh")
        assert fresh["lag_messages"] <= 500
        assert seen_stale["state"] == "stale" or seen_stale["lag_messages"] >= 0

        final = get_json(base + "/v1/freshness")
        wait(
            lambda: (
                get_json(base + "/v1/freshness")["sources"]["docs"]["ingested_total"] == 200 + burst
            ),
            60,
            "all ingested",
        )
        final = get_json(base + "/v1/freshness")
        assert (
            final["sources"]["docs"]["lag_messages"] == 0 and final["totals"]["stale_bindings"] == 0
        )
        health = get_json(base + "/healthz")
        assert health["datasets"]["docs"] == 200 + burst
        assert health["ingestors"]["docs"]["group"].startswith("fabric.")
        beats = [e for e in rx.udp if e["event"] == "heartbeat"]
        assert beats and all(b["source"] == "docs" for b in beats)
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert (
            f'fabric_source_ingested_messages_total{{source="docs"}} {float(200 + burst)}'
            in metrics
        )
    finally:
        proc.terminate()
        try:
            _out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
        rx.close()
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / ".fabric" / "state" / "docs" / "CURRENT").exists()  # checkpoint on shutdown


def hammer(url: str, requests: int, threads: int) -> list[tuple[int, int]]:
    """(status, sources.docs.lag_messages) for each of ``requests`` GETs from a thread pool."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_):
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())["sources"]["docs"]["lag_messages"]

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(requests)))


def _up(base: str) -> bool:
    try:
        return get_json(base + "/healthz")["status"] == "ok"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
