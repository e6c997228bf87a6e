"""``fabric serve`` holds against half-open connections (issue 13, finding 12): a request
whose headers do not arrive within ``server.header_timeout`` is closed, and past
``server.max_connections`` the longest-waiting half-open connection makes room (a
request that arrives whole is always served). Against a real ``fabric serve`` process.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.config import load_config

PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x"  # the request line and a header, never ended


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthz(port: int, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=timeout) as r:
        return r.status


def _closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@contextlib.contextmanager
def _serve(
    tmp_path: Path, server: str, nofile: int | None = None, args: tuple[str, ...] = ()
) -> Iterator[int]:
    port = _free_port()
    cfg = tmp_path / "fabric.yaml"
    cfg.write_text(f"connections: {{}}\nbindings: []\nserver: {{port: {port}, {server}}}\n")

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log = (tmp_path / "serve.log").open("wb")  # a file: a full pipe would block the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "serve", "--config", str(cfg), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=limit,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _healthz(port, 1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "serve.log").read_text()) from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _half_open(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(PARTIAL)
        out.append(s)
    return out


def test_half_open_requests_time_out_and_healthz_answers(tmp_path: Path) -> None:
    with _serve(tmp_path, "header_timeout: 1") as port:
        socks = _half_open(port, 160)
        try:
            assert _healthz(port) == 200
            deadline = time.monotonic() + 20  # a bound for the test only; the timeout is 1 s
            while not all(_closed_by_server(s) for s in socks) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert all(_closed_by_server(s) for s in socks), "half-open connections stayed open"
            assert _healthz(port) == 200
        finally:
            for s in socks:
                s.close()


@pytest.mark.slow
def test_past_the_connection_cap_the_oldest_half_open_makes_room(tmp_path: Path) -> None:
    """Under a file-descriptor limit of 256, 300 half-open connections (which exhaust it
    without a cap) still leave /healthz answering; the first ones were closed for it."""
    with _serve(tmp_path, "header_timeout: 60", nofile=256) as port:
        socks = _half_open(port, 300)
        try:
            for _ in range(5):
                assert _healthz(port) == 200
            time.sleep(0.5)
            assert _closed_by_server(socks[0])
            assert not _closed_by_server(socks[-1])
        finally:
            for s in socks:
                s.close()


def test_command_line_overrides_the_header_timeout(tmp_path: Path) -> None:
    with _serve(tmp_path, "header_timeout: 600", args=("--header-timeout", "1")) as port:
        socks = _half_open(port, 5)
        deadline = time.monotonic() + 20
        while not all(_closed_by_server(s) for s in socks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_closed_by_server(s) for s in socks)
    bad = subprocess.run(
        [sys.executable, "-m", "fabric", "serve", "--max-connections", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--max-connections must be more than 0" in bad.stderr


def test_server_limits_in_fabric_yaml(tmp_path: Path) -> None:
    cfg = load_config(
        "connections: {}\nserver: {header_timeout: 2.5s, keep_alive: 3, max_connections: 64,"
        " max_header_bytes: 8192}\n"
    )
    s = cfg.server
    assert (s.header_timeout, s.keep_alive, s.max_connections, s.max_header_bytes) == (
        2.5,
        3.0,
        64,
        8192,
    )
    default = load_config("connections: {}\n").server
    assert default.header_timeout > 0 and default.max_connections > 0
    with pytest.raises(Exception) as info:
        load_config("connections: {}\nserver: {max_connections: 0}\n")
    assert "max_connections" in str(info.value)
