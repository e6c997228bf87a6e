"""`fabric demo` on embedded defaults: SQLite, a local directory, and noida-db / SecantusDB
started by the demo itself; nothing of the shared servers (.services) is used, and nothing
is left behind (temporary directory, child processes), also after Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _env(tmp: Path) -> dict[str, str]:
    # no FABRIC_* addresses and no checkout: the demo must find everything in the package
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env["TMPDIR"] = str(tmp)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _demo(tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fabric", "demo", *args],
        cwd=tmp,
        env=_env(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a test run started in the background by a non-interactive shell has SIGINT
        # ignored, and the demo would inherit that: give it the disposition a terminal has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _ports(out: str) -> list[int]:
    return [int(p) for p in re.findall(r"on 127\.0\.0\.1:(\d+)", out)]


def test_embedded_demo_runs_every_scenario_and_cleans_up(tmp_path):
    proc = _demo(tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "every scenario matched its independent reference" in out
    assert out.count("[MISMATCH]") == 0 and out.count("[ok]") >= 15, out[-4000:]
    assert "time per step:" in out
    assert "peak lag" in out
    ports = _ports(out)
    assert len(ports) == 2, out[:2000]  # noida-db and SecantusDB, on free ports
    assert all(_closed(p) for p in ports)
    assert list(tmp_path.glob("fabric-*")) == [], "the demo left files in the temp directory"


def test_only_finance_starts_no_mongo_and_loads_only_the_news(tmp_path):
    proc = _demo(tmp_path, "--only", "finance")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    loaded = next(line for line in out.splitlines() if line.startswith("loaded the seed data"))
    assert loaded.endswith("news=2000"), loaded
    assert "SecantusDB" not in out.splitlines()[0]
    assert list(tmp_path.glob("fabric-*")) == []


def test_ctrl_c_stops_the_local_servers_and_removes_their_files(tmp_path):
    proc = _demo(tmp_path, "--only", "ecommerce")
    assert proc.stdout is not None
    first = proc.stdout.readline()
    while first.startswith("... "):  # a step's plain progress line (no terminal here)
        first = proc.stdout.readline()
    assert first.startswith("started local servers"), first
    ports = _ports(first)
    assert ports and not any(_closed(p) for p in ports)
    # interrupt while it loads the seed data into the servers it started: interrupting at
    # the scenario's header raced with its end (a loaded CI run finished the scenario, rc 0,
    # before the signal landed)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, rest[-3000:]
    assert "Traceback" not in rest
    deadline = time.monotonic() + 10
    while not all(_closed(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_closed(p) for p in ports)
    assert list(tmp_path.glob("fabric-*")) == []
