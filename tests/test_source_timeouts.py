"""Every source call obeys its own timeout (issue 14, finding 6), against the real servers
behind a private TCP proxy whose forwarding can be paused: what a SIGSTOPped server looks
like from outside (the kernel still accepts connections, nothing answers). The shared
servers are never stopped."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import pytest

import fabric
from fabric.execute.errors import QueryError


class PausableProxy:
    """127.0.0.1:<port> -> target; ``pause()`` stops forwarding in both directions (new
    connections are accepted but not forwarded), ``resume()`` continues."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(64)
        self.port = self.srv.getsockname()[1]
        self.go = threading.Event()
        self.go.set()
        self.stop = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.srv.settimeout(0.2)
        while not self.stop.is_set():
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            self.socks.append(c)
            threading.Thread(target=self._pipe, args=(c,), daemon=True).start()

    def _pipe(self, c: socket.socket) -> None:
        while not self.go.wait(0.2):
            if self.stop.is_set():
                return
        try:
            u = socket.create_connection(self.target, timeout=5)
        except OSError:
            c.close()
            return
        self.socks.append(u)
        pair = {c: u, u: c}
        while not self.stop.is_set():
            r, _, _ = select.select(list(pair), [], [], 0.2)
            if not self.go.is_set():
                continue
            for s in r:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    c.close()
                    u.close()
                    return
                pair[s].sendall(data)

    def pause(self) -> None:
        self.go.clear()

    def close(self) -> None:
        self.stop.set()
        self.srv.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.mark.slow
def test_sql_query_fails_within_its_own_timeouts_when_the_server_stops(mariadb_url):
    """A pooled connection to a server that stops answering: the pre-ping and the one
    reconnect attempt each wait the connect timeout (the ping used to wait the read
    timeout, and the reconnect's handshake the read timeout again: 2 x read_timeout);
    the error names the source and both timeouts."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    table = f"d_probe_{time.time_ns() % 10**9}"
    eng = sa.create_engine(mariadb_url)
    with eng.begin() as c:
        c.execute(sa.text(f"create table {table} (id int primary key)"))
        c.execute(sa.text(f"insert into {table} values (1), (2)"))
    u = make_url(mariadb_url)
    px = PausableProxy(u.host or "127.0.0.1", u.port or 3306)
    try:
        url = u.set(host="127.0.0.1", port=px.port).render_as_string(hide_password=False)
        read_timeout, connect_timeout = 10.0, 1.0
        conns = {
            "shop": {
                "kind": "mysql",
                "url": url,
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
            }
        }
        with fabric.open({"connections": conns}, watch=False) as fab:
            text = f"from mysql://shop/{table} as d select d.id"
            assert fab.query_text(text).table.num_rows == 2
            px.pause()
            t0 = time.monotonic()
            with pytest.raises(QueryError) as e:
                fab.query_text(text)
            took = time.monotonic() - t0
    finally:
        px.close()
        with eng.begin() as c:
            c.execute(sa.text(f"drop table if exists {table}"))
    msg = str(e.value)
    assert f"mysql://shop/{table}" in msg, msg
    assert (
        f"read timeout {read_timeout:g} s" in msg
        and f"connect timeout {connect_timeout:g} s" in msg
    ), msg
    # a ping and a reconnect, each bounded by connect_timeout; no read timeout is waited
    assert took < 3 * connect_timeout + 3 < read_timeout, took


@pytest.mark.slow
def test_mongo_query_fails_within_its_own_timeouts_when_the_server_stops(mongo_url, mongo_db):
    from urllib.parse import urlsplit

    coll = mongo_db[f"d_probe_{time.time_ns()}"]
    coll.insert_many([{"_id": i, "v": i} for i in range(3)])
    parts = urlsplit(mongo_url)
    px = PausableProxy(parts.hostname or "127.0.0.1", parts.port or 27017)
    try:
        read_timeout, timeout = 6.0, 1.0
        conns = {
            "crm": {
                "kind": "mongo",
                "url": f"mongodb://127.0.0.1:{px.port}/?directConnection=true",
                "database": mongo_db.name,
                "timeout": timeout,
                "options": {"read_timeout": read_timeout},
                "schemas": {coll.name: {"_id": "int", "v": "int"}},
            }
        }
        with fabric.open({"connections": conns}, watch=False) as fab:
            text = f"from mongo://crm/{coll.name} as d select d.v"
            assert fab.query_text(text).table.num_rows == 3
            px.pause()
            t0 = time.monotonic()
            with pytest.raises(QueryError) as e:
                fab.query_text(text)
            took = time.monotonic() - t0
    finally:
        px.close()
    msg = str(e.value)
    assert f"mongo://crm/{coll.name}" in msg, msg
    assert f"read timeout {read_timeout:g} s" in msg and f"timeout {timeout:g} s" in msg, msg
    assert took < read_timeout + timeout + 3, took  # one read timeout, not a retried read
