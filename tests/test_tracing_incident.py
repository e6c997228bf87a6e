"""The incident scenario on a session timeline (issue 18), on the real Kafka broker: a
headline topic 60,000 messages ahead of the dataset ingesting it; an analyst session
whose binding waits for fresh data (on_stale: wait). Its timeline shows the wait as such,
the data_stale signal naming the binding, the lag, and data_fresh (the release), in one
chart that renders in headless Chromium."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import fabric
from examples.seed.load import produce
from fabric.tracing.timeline import render_html, render_text
from tests.servers import TopicFactory

BURST = 60_000

CONFIG = """\
connections:
  bus: {{kind: kafka, bootstrap: "{bootstrap}"}}
datasets:
  headlines:
    from: "kafka://bus/{topic}"
    key: id
    schema: {{id: str, published_at: timestamp, symbol: str, body: str}}
    indexes: {{published_at: btree}}
signals:
  stale_when: {{lag_messages: 1000, lag_seconds: 3600}}
  heartbeat: 1s
ingest: {{checkpoint_dir: "{state}", group_prefix: "{group}"}}
bindings: [agents/]
"""

BINDING = """\
binding: market_headlines
session: {symbol: str}
sources:
  h:
    from: dataset://headlines
    where: symbol = {{session.symbol}}
    freshness: {max_lag_messages: 1000, on_stale: wait, wait_timeout: 170s}
select: [h.id, h.published_at]
order_by: h.published_at desc
limit: 5
"""


def _headlines(n: int) -> pa.Table:
    now = dt.datetime.now(dt.UTC)
    syms = ["AAPL", "MSFT", "NVDA", "SPY"]
    return pa.table(
        {
            "id": [f"h{i:07d}" for i in range(n)],
            "published_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
            "symbol": [syms[i % 4] for i in range(n)],
            "body": [f"{syms[i % 4]} moves at the open, update {i}" for i in range(n)],
        }
    )


@pytest.mark.slow
def test_the_incident_timeline_shows_lag_waits_stale_and_release(
    kafka_bootstrap: str, test_run_id: str, tmp_path: Path
) -> None:
    topics = TopicFactory(kafka_bootstrap, test_run_id)
    topic = topics(partitions=2, prefix="trace_headlines")
    try:
        produce(kafka_bootstrap, topic, _headlines(BURST), "id", recreate=False)
        (tmp_path / "agents").mkdir()
        (tmp_path / "agents" / "h.yaml").write_text(BINDING)
        (tmp_path / "fabric.yaml").write_text(
            CONFIG.format(
                bootstrap=kafka_bootstrap,
                topic=topic,
                state=tmp_path / "state",
                group=f"trace_{test_run_id}",
            )
        )
        with fabric.open(tmp_path / "fabric.yaml", watch=False) as fab:
            # the dataset starts 60,000 messages behind: the analyst's query waits
            res = fab.query("market_headlines", {"symbol": "NVDA"}, session_id="analyst-1")
            assert res.waited > 0 and res.freshness["h"]["status"] == "fresh"
            deadline = time.time() + 120
            while time.time() < deadline:  # data_fresh comes below half the threshold
                fab.tracer.flush()
                if any(s.name == "signal data_fresh headlines" for s in fab.tracer.spans()):
                    break
                time.sleep(0.3)
            res2 = fab.query("market_headlines", {"symbol": "NVDA"}, session_id="analyst-1")
            assert res2.waited == 0
            tl = fab.tracer.timeline("analyst-1")
    finally:
        topics.cleanup()
    q1, q2 = tl["queries"]
    assert q1["status"] == "ok" and q1["wait_seconds"] == pytest.approx(res.waited)
    (wait,) = q1["waits"]
    assert wait["attributes"]["fabric.wait.reason"] == "waiting_for_fresh_data"
    assert wait["duration_ms"] == pytest.approx(res.waited * 1000, rel=0.05, abs=5)
    scan = next(o for o in q1["operators"] if o["name"] == "Scan h")
    assert wait["start_ms"] < scan["start_ms"]  # the wait, then the read
    assert not q2["waits"]
    events = [(s["event"], s["source"]) for s in tl["signals"] if s["scope"] == "source"]
    assert ("data_stale", "headlines") in events and ("data_fresh", "headlines") in events
    assert events.index(("data_stale", "headlines")) < events.index(("data_fresh", "headlines"))
    stale = next(s for s in tl["signals"] if s["event"] == "data_stale")
    assert "market_headlines" in stale["bindings"] and stale["lag_messages"] > 1000
    text = render_text(tl)
    assert "waiting for fresh data" in text and "signal +" in text and "data_fresh" in text
    page = render_html(tl)
    assert 'class="bar wait"' in page and 'class="lag"' in page
    assert 'class="signal data_stale"' in page and 'class="signal data_fresh"' in page

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium): chart not rendered")
    from tests.test_tracing_timeline import _png_pixels

    (tmp_path / "incident.html").write_text(page)
    shot = tmp_path / "incident.png"
    subprocess.run(
        [
            *(chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"),
            *(f"--screenshot={shot}", "--window-size=1000,460"),
            (tmp_path / "incident.html").as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    px = _png_pixels(shot).astype(np.int32)

    def count(rgb: tuple[int, int, int]) -> int:
        return int(np.all(np.abs(px - np.array(rgb)) < 14, axis=2).sum())

    assert count((0xF2, 0x8E, 0x2B)) > 30, "the wait (orange) is drawn"
    assert count((0xD6, 0x27, 0x28)) > 30, "data_stale (red) is drawn"
    assert count((0x2C, 0xA0, 0x2C)) > 30, "data_fresh (green) is drawn"
    assert count((0x8C, 0x56, 0x4B)) > 30, "the lag (brown) is drawn"
