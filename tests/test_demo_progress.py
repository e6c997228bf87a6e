"""Progress output of `fabric demo` (issue 19): rich's spinner and bars on a terminal,
plain lines without escape codes anywhere else (pipes, CI logs)."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys

import pytest

from fabric import progress
from fabric.progress import Progress

ESC = "\x1b["


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal(monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)  # every update is a line
    out = io.StringIO()
    p = Progress(out)
    assert not p.rich
    with p.step("loading the seed data", total=30) as step:
        step.update(10)
        step.update(30)
    text = out.getvalue()
    assert ESC not in text
    assert text.splitlines()[0] == "... loading the seed data"
    assert "... loading the seed data: 30 of 30 after" in text


def test_plain_lines_are_not_one_per_update():
    out = io.StringIO()
    with Progress(out).step("catching up", total=1000) as step:
        for i in range(1000):
            step.update(i)
    assert out.getvalue().count("\n") == 1  # the start line; the next after PLAIN_EVERY s


def test_rich_bar_on_a_terminal():
    out = _Terminal()
    p = Progress(out)
    assert p.rich
    with p.step("loading the seed data", total=30) as step:
        step.update(30)
    text = out.getvalue()
    assert ESC in text and "loading the seed data" in text and "30/30" in text


def _env(tmp):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env.update(TMPDIR=str(tmp), PYTHONUNBUFFERED="1", TERM="xterm", COLUMNS="120")
    return env


@pytest.mark.slow
def test_demo_on_a_pseudo_terminal_and_in_a_pipe(tmp_path):
    cmd = [sys.executable, "-m", "fabric", "demo", "--only", "analytics"]
    piped = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert piped.returncode == 0, piped.stdout[-3000:] + piped.stderr[-3000:]
    assert ESC not in piped.stdout and ESC not in piped.stderr
    assert "... loading the seed data" in piped.stdout

    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdin=follower,
                            stdout=follower, stderr=follower)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the demo closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert ESC in text  # rich drew on the terminal
    assert "... loading the seed data" not in text  # no plain lines there
    assert "every scenario matched its independent reference" in text
