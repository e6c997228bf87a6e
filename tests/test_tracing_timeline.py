"""Session timelines served by a real ``fabric serve``: queries sent with
``X-Fabric-Session`` come back in order from ``GET /v1/sessions/{id}/timeline`` (JSON and
HTML), through ``fabric timeline``, with the per-session cost on ``/metrics``; the HTML
page's chart renders in a real headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # one fabric serve subprocess for the module (~20 s)

TOKEN = "ops-token-0123456789abcdef"
OTHER = "other-token-0123456789abcdef"


def _serve(root: Path) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "fabric", "serve", "--config", str(root / "fabric.yaml")),
            *("--port", "0", "--flight-port", "0", "--log-level", "warning"),
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    grpc = ""
    while time.time() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"fabric serve ended: {proc.stderr.read()}")  # type: ignore[union-attr]
        if m := re.search(r"queries on (grpc://\S+)", line):
            grpc = m.group(1)
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
            while time.time() < deadline:  # printed just before the server starts
                try:
                    with urllib.request.urlopen(url + "/healthz", timeout=5):
                        return proc, url, grpc
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.2)
    proc.kill()
    raise RuntimeError("fabric serve did not start")


def _call(url: str, token: str | None, body: Any = None, headers: dict | None = None) -> Any:
    req = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read(), r.headers.get("content-type", "")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tl") / "fab"
    subprocess.run(
        [sys.executable, "-m", "fabric", "init", str(root)], check=True, capture_output=True
    )
    cfg = root / "fabric.yaml"
    cfg.write_text(
        cfg.read_text()
        + f"agents:\n  ops: {{token: {TOKEN}, bindings: ['*'], query_text: true}}\n"
        + f"  other: {{token: {OTHER}, bindings: [nothing_here]}}\n"
        + "tracing:\n  prices:\n    connections: {local: {call: 0.25, row: 0.001}}\n"
    )
    proc, url, grpc = _serve(root)
    try:
        yield grpc, url
    finally:
        proc.terminate()
        proc.wait(20)


def _run_session(url: str, sid: str, n: int) -> list[int]:
    rows = []
    for i in range(n):
        status, body, _ = _call(
            f"{url}/v1/query/top_products",
            TOKEN,
            {"session": {"min_qty": 1 + i}},
            {"X-Fabric-Session": sid},
        )
        assert status == 200
        rows.append(len(json.loads(body)["rows"]))
    return rows


def test_the_timeline_lists_the_session_queries_in_order(served) -> None:
    _root, url = served
    rows = _run_session(url, "conv-a", 3)
    _run_session(url, "conv-b", 1)  # another session: not in conv-a's timeline
    status, body, ctype = _call(f"{url}/v1/sessions/conv-a/timeline", TOKEN)
    assert status == 200 and ctype.startswith("application/json")
    tl = json.loads(body)
    assert tl["session"] == "conv-a"
    qs = tl["queries"]
    assert [q["binding"] for q in qs] == ["top_products"] * 3
    assert [q["rows"] for q in qs] == rows
    assert all(q["session_values"]["min_qty"].startswith("hmac:") for q in qs)
    assert qs[0]["start_ms"] == 0 and qs[0]["start_ms"] < qs[1]["start_ms"] < qs[2]["start_ms"]
    for q in qs:
        assert q["status"] == "ok" and "Scan: o <- file://local/orders.csv" in q["plan"]
        scans = [o for o in q["operators"] if o["name"].startswith("Scan ")]
        assert {o["attributes"]["fabric.source.alias"] for o in scans} == {"o", "p"}
        assert sum(o["attributes"]["fabric.source.rows"] for o in scans) == q["rows_fetched"]
        assert q["cost"]["source_calls"] == 2
    total = tl["cost"]["total"]
    assert total["queries"] == 3 and total["sources"]["local"]["calls"] == 6
    fetched = sum(q["rows_fetched"] for q in qs)
    assert total["price"] == pytest.approx(6 * 0.25 + fetched * 0.001)
    # an agent sees only the queries of bindings it may run; no token: 401
    _, body, _ = _call(f"{url}/v1/sessions/conv-a/timeline", OTHER)
    assert json.loads(body)["queries"] == []
    with pytest.raises(urllib.error.HTTPError) as e:
        _call(f"{url}/v1/sessions/conv-a/timeline", None)
    assert e.value.code == 401
    # the per-session cost on /metrics
    _, text, _ = _call(f"{url}/metrics", None)
    line = next(
        ln
        for ln in text.decode().splitlines()
        if ln.startswith("fabric_session_source_calls_total{")
        and 'session="conv-a"' in ln
        and 'connection="local"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) == 6.0


def test_fabric_timeline_cli(served) -> None:
    _root, url = served
    _run_session(url, "conv-cli", 2)
    env = {**os.environ, "FABRIC_TOKEN": TOKEN}
    out = subprocess.run(
        [sys.executable, "-m", "fabric", "timeline", "conv-cli", "--url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "session conv-cli: 2 queries"
    assert lines[1].startswith("#1 +0.0 ms top_products [ok]")
    assert any(ln.startswith("#2 ") for ln in lines)
    assert any("Scan o: rows=" in ln and "file://local/orders.csv" in ln for ln in lines)
    assert lines[-2].startswith("total: 2 queries, 0 failed")
    missing = subprocess.run(
        [sys.executable, "-m", "fabric", "timeline", "nobody", "--url", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert missing.returncode == 1 and "no queries of session 'nobody'" in missing.stdout


def _png_pixels(path: Path) -> np.ndarray:
    """A tiny PNG decoder (8-bit RGB/RGBA, non-interlaced, as Chromium writes them)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height = int.from_bytes(body[:4], "big"), int.from_bytes(body[4:8], "big")
            depth, color = body[8], body[9]
            assert depth == 8 and color in (2, 6) and body[12] == 0
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        cur = np.zeros(stride, dtype=np.int32)
        for x in range(stride):
            a = cur[x - channels] if x >= channels else 0
            b = prev[x]
            c = prev[x - channels] if x >= channels else 0
            if f == 0:
                v = line[x]
            elif f == 1:
                v = line[x] + a
            elif f == 2:
                v = line[x] + b
            elif f == 3:
                v = line[x] + (a + b) // 2
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                v = line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)
            cur[x] = v & 0xFF
        out[y] = cur
        prev = cur
    return out.reshape(height, width, channels)[:, :, :3]


def test_the_html_timeline_renders_in_headless_chromium(served, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    _root, url = served
    _run_session(url, "conv-html", 3)
    status, page, ctype = _call(f"{url}/v1/sessions/conv-html/timeline?format=html", TOKEN)
    assert status == 200 and ctype.startswith("text/html")
    text = page.decode()
    assert "<svg" in text and text.count('class="bar scan"') == 6  # 3 queries x 2 sources
    assert "file://local/orders.csv" in text and "file://local/products.parquet" in text
    html_file = tmp_path / "timeline.html"
    html_file.write_bytes(page)
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=1000,420",
            html_file.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), run.stderr[-2000:]
    px = _png_pixels(shot).astype(np.int32)
    assert px.shape[0] >= 300 and px.shape[1] >= 900
    # non-blank: many non-white pixels, and the chart's colours are there
    assert (px.sum(axis=2) < 700).mean() > 0.01
    scan_green = np.all(np.abs(px - np.array([0x59, 0xA1, 0x4F])) < 12, axis=2).sum()
    query_blue = np.all(np.abs(px - np.array([0x4C, 0x78, 0xA8])) < 12, axis=2).sum()
    assert scan_green > 50 and query_blue > 50, (scan_green, query_blue)


def test_a_flight_client_names_its_session(served) -> None:
    import fabric

    grpc, url = served
    with fabric.connect(grpc, token=TOKEN) as remote:
        res = remote.query("top_products", {"min_qty": 3}, session_id="conv-flight")
        text = remote.query_text(
            "from file://local/products.parquet as p select p.name limit 2",
            session_id="conv-flight",
        )
    _, body, _ = _call(f"{url}/v1/sessions/conv-flight/timeline", TOKEN)
    qs = json.loads(body)["queries"]
    assert [q["binding"] for q in qs] == ["top_products", "query"]
    assert [q["rows"] for q in qs] == [len(res), len(text)]


def test_real_prometheus_scrapes_the_session_cost(served, prometheus_bin, tmp_path: Path) -> None:
    import socket
    import urllib.parse

    _, url = served
    _run_session(url, "conv-prom", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = url.split("://", 1)[1]
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: fabric\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
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
        q = urllib.parse.urlencode(
            {
                "query": 'sum by (connection) (fabric_session_source_calls_total{session="conv-prom"})'
            }
        )
        value, deadline = None, time.monotonic() + 60
        while value is None and time.monotonic() < deadline:
            time.sleep(0.5)
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                _, body, _ = _call(f"http://127.0.0.1:{port}/api/v1/query?{q}", None)
            except OSError:
                continue
            res = json.loads(body)["data"]["result"]
            if res:
                assert res[0]["metric"]["connection"] == "local"
                value = float(res[0]["value"][1])
        assert value == 4.0  # 2 queries x 2 sources
    finally:
        proc.terminate()
        proc.wait(10)
