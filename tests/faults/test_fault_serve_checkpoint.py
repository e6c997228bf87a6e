"""Issue 14 finding 4 through the real ``fabric serve`` process: with the newest checkpoint's
rows.arrow truncated it starts (before: a bare traceback), serves, says in /v1/freshness
that it fell back and which file was bad, and ends with every row."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.faults.helpers import docs, free_port, produce, wait_for

ROOT = Path(__file__).resolve().parents[2]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def serve(cfg: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.server", "--config", str(cfg), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"fabric serve exited {proc.returncode}: {proc.stderr.read()[-3000:]}"
            )
        try:
            get(base + "/healthz")
            return True
        except OSError:
            return False

    wait_for(up, 60, "fabric serve to answer")
    return proc, base


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return err


def caught_up(base: str, rows: int) -> bool:
    src = get(base + "/v1/freshness")["sources"]["docs"]
    return src["status"] == "fresh" and get(base + "/healthz")["datasets"]["docs"] == rows


@pytest.mark.slow
def test_fabric_serve_falls_back_from_a_damaged_checkpoint(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=2, prefix="fault_serve")
    cfg = tmp_path / "fabric.yaml"
    cfg.write_text(
        f"""
connections:
  bus: {{kind: kafka, bootstrap: "{kafka_bootstrap}"}}
datasets:
  docs:
    from: kafka://bus/{topic}
    key: id
    schema: {{id: str, n: int, ts: timestamp, body: str, vec: "vector[4]"}}
    indexes: {{n: btree, body: inverted}}
bindings: []
"""
    )
    for lo, hi in ((0, 500), (500, 800)):  # two checkpoints (written at each stop)
        produce(kafka_bootstrap, topic, docs(range(lo, hi)))
        proc, base = serve(cfg)
        wait_for(lambda hi=hi, base=base: caught_up(base, hi), 60, f"{hi} rows")
        stop(proc)
    state = tmp_path / ".fabric" / "state" / "docs"
    older, newer = sorted(p for p in state.iterdir() if p.name.startswith("ckpt-"))
    rows = newer / "dataset" / "rows.arrow"
    rows.write_bytes(rows.read_bytes()[: rows.stat().st_size // 2])
    produce(kafka_bootstrap, topic, docs(range(800, 900)))

    proc, base = serve(cfg)  # starts: no traceback
    try:
        wait_for(lambda: caught_up(base, 900), 60, "900 rows after the fall-back")
        src = get(base + "/v1/freshness")["sources"]["docs"]
        said = " ".join(n["message"] for n in src["notices"])
        assert f"fell back to {older.name}" in said and "rows.arrow" in said, said
    finally:
        err = stop(proc)
    assert "rows.arrow" in err and "Traceback" not in err, err[-3000:]
