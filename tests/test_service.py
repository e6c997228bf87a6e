"""One fabric for many agents (issue 15): the real ``fabric serve`` in a subprocess with
``agents:``, the seed data in the real servers, queried over Arrow Flight
(``fabric.connect``), HTTP and ADBC Flight SQL, compared with an embedded ``fab.query``
over the same fabric.yaml; refusals (no token, a binding not granted, python not granted,
a pinned session value) checked to run nothing on the server."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import fabric
from fabric.service import errors as E
from fabric.service import wire

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "examples" / "seed"
TOKENS = {
    "alice": "alice-token-0123456789",
    "bob": "bob-token-0123456789ab",
    "carol": "carol-token-0123456789",
    "flood": "flood-token-0123456789",
}

AGENTS = """
agents:
  alice: {token: "${SVC_ALICE}", bindings: ["*"], query_text: true, python: true,
          datasets: [news]}
  bob:   {token: "${SVC_BOB}", bindings: [nearby_offers], pin: {user_id: 7}}
  carol: {token_file: carol.token, bindings: ["top_*"], query_text: true}
  flood: {token: "${SVC_FLOOD}", bindings: ["*"], max_concurrent: 1}
server: {query_workers: 2}
"""


def _fabric_yaml(work: Path, topic: str) -> Path:
    """The seed's fabric.yaml and bindings in ``work``, reading this run's location topic,
    with a consumer group and state dir of its own per process (FABRIC_GROUP)."""
    shutil.copytree(SEED / "agents", work / "agents")
    nearby = work / "agents" / "nearby_offers.yaml"
    nearby.write_text(nearby.read_text().replace("location_stream", topic))
    text = (SEED / "fabric.yaml").read_text()
    text = re.sub(
        r"^ingest:.*$",
        'ingest: {checkpoint_dir: "${FABRIC_STATE_DIR}", group_prefix: "${FABRIC_GROUP}"}',
        text,
        flags=re.M,
    )
    (work / "carol.token").write_text(TOKENS["carol"] + "\n")
    path = work / "fabric.yaml"
    path.write_text(text + AGENTS)
    return path


RELAY = """
import socket, sys, threading
target = (sys.argv[1], int(sys.argv[2]))
listener = socket.create_server(("127.0.0.1", 0))
sent = [0]
lock = threading.Lock()
def pipe(src, dst, count):
    try:
        while data := src.recv(65536):
            if count:
                with lock:
                    sent[0] += len(data)
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
def accept():
    while True:
        client, _ = listener.accept()
        server = socket.create_connection(target)
        threading.Thread(target=pipe, args=(client, server, True), daemon=True).start()
        threading.Thread(target=pipe, args=(server, client, False), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
print(listener.getsockname()[1], flush=True)
for line in sys.stdin:  # each line asks how many bytes clients have sent to the server
    with lock:
        print(sent[0], flush=True)
"""


class Relay:
    """A TCP relay (a subprocess) in front of a server, counting the bytes its clients send:
    what reached the server itself, not what the fabric says it read."""

    def __init__(self, host: str, port: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RELAY, host, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def sent(self) -> int:
        self.proc.stdin.write("?\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _sandbox_workers(pid: int) -> list[int]:
    """The sandbox worker processes (``fabric/sandbox/boot.py``) under process ``pid``."""
    from fabric.sandbox.pool import _BOOT

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            if _BOOT in (Path("/proc") / str(p) / "cmdline").read_bytes().decode(errors="replace"):
                found.append(p)
        except OSError:
            continue
    return found


def _sandbox_activity(pid: int) -> tuple[list[int], int]:
    """The sandbox workers under ``pid`` and their context switches in total: an idle
    worker blocks on its channel and does not switch, so a snippet sent to one shows."""
    workers = sorted(_sandbox_workers(pid))
    switches = 0
    for w in workers:
        for task in (Path("/proc") / str(w) / "task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches" in line:
                    switches += int(line.split()[1])
    return workers, switches


class Served:
    """``fabric serve`` in a subprocess; its HTTP and Flight addresses from its stdout."""

    def __init__(self, config: Path, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "fabric", "serve", "--config", str(config)),
                *("--port", "0", "--flight-port", "0", "--log-level", "warning"),
            ],
            cwd=config.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self) -> None:
        self.http = self.grpc = ""
        deadline = time.time() + 120
        while not self.http and time.time() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"fabric serve ended: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            if m := re.search(r"queries on (grpc://\S+)", line):
                self.grpc = m.group(1)
            if m := re.search(r"listening on (http://\S+)", line):
                self.http = m.group(1)
        assert self.grpc and self.http
        while time.time() < deadline:  # ready: every Kafka-fed dataset caught up once
            try:
                with urllib.request.urlopen(self.http + "/readyz", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)

    def post(
        self, path: str, body: Any, token: str | None = None, accept: str | None = None
    ) -> tuple[int, bytes, str]:
        req = urllib.request.Request(
            self.http + path, data=json.dumps(body).encode(), method="POST"
        )
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if accept:
            req.add_header("Accept", accept)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read(), r.headers.get("content-type", "")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers.get("content-type", "")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    test_run_id: str,
    servers: Any,
    mariadb_url: str,  # the seed world is on these servers: named so that the tests
    kafka_bootstrap: str,  # using it are marked `servers` (pytest -m "not servers")
    mongo_url: str,
    s3: Any,
) -> Iterator[dict[str, Any]]:
    sys.path.insert(0, str(ROOT))
    from crypto import KeyRing
    from examples.seed.data import generate
    from examples.seed.load import environment, load_all

    work = tmp_path_factory.mktemp("service")
    prefix = f"svc_{test_run_id}".replace("-", "_")
    env = environment(prefix)
    env["FABRIC_LOCATION_TOPIC"] = f"{prefix}_locations"
    ring = KeyRing.generate()
    (work / "agent.pub").write_bytes(ring.public_context())
    env["FABRIC_AGENT_PUBLIC_CONTEXT"] = str(work / "agent.pub")
    data = generate(users=30, merchants=1000, coupons=3000, orders=5000, news=500)
    load_all(env, data)
    config = _fabric_yaml(work, env["FABRIC_LOCATION_TOPIC"])
    base = {**os.environ, **env}
    base.update(SVC_ALICE=TOKENS["alice"], SVC_BOB=TOKENS["bob"], SVC_FLOOD=TOKENS["flood"])
    server_env = {**base, "FABRIC_STATE_DIR": str(work / "srv"), "FABRIC_GROUP": f"{prefix}_srv"}
    # the served fabric reaches MariaDB through a relay counting what it sends there
    import sqlalchemy as sa

    shop = sa.make_url(env["FABRIC_SHOP_URL"])
    relay = Relay(shop.host or "127.0.0.1", shop.port or 3306)
    server_env["FABRIC_SHOP_URL"] = shop.set(host="127.0.0.1", port=relay.port).render_as_string(
        hide_password=False
    )
    try:
        served = Served(config, server_env)
    except BaseException:
        relay.stop()
        raise
    old = dict(os.environ)
    os.environ.update({**base, "FABRIC_STATE_DIR": str(work / "emb"), "FABRIC_GROUP": prefix})
    emb = fabric.open(config)
    try:
        assert emb.catch_up(60)
        ds = emb.dataset("news")
        t0 = time.time()
        while ds.count() < data["news"].num_rows and time.time() - t0 < 60:
            time.sleep(0.2)
        yield {
            "served": served,
            "emb": emb,
            "data": data,
            "ring": ring,
            "work": work,
            "config": config,
            "server_env": server_env,
            "mysql_relay": relay,
        }
    finally:
        emb.close()
        served.stop()
        relay.stop()
        os.environ.clear()
        os.environ.update(old)
        _cleanup(env)


def _cleanup(env: dict[str, str]) -> None:
    from examples.seed.load import drop_loaded

    drop_loaded(env)


def _sessions(world: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    from examples.seed.data import hash_embed

    q = [float(x) for x in hash_embed(["how did the US market open today"])[0]]
    out: list[tuple[str, dict[str, Any]]] = []
    for user in (1, 3, 7, 12, 20):
        out.append(("nearby_offers", {"user_id": user}))
        out.append(("top_category_last_week", {"user_id": user}))
    out.append(("market_open_news", {"query_vec": q, "symbols": ["AAPL", "NVDA", "SPY"]}))
    return out


def _plan(text: str) -> str:
    """An explain text without its row estimates: each process learns estimates from the
    rows its own queries saw (the embedded fabric here has run other tests' queries), so
    the plans must agree, the estimates need not."""
    return re.sub(r"est_rows=\d+", "est_rows=?", text)


def _rows(table: pa.Table) -> list[Any]:
    return _norm(table.to_pylist())


def _norm(rows: list[dict[str, Any]]) -> list[Any]:
    """The rows; for the news retrieval, (symbol, body) sorted: documents from one template
    and symbol share an embedding, so which of those tied ones the nearest-k keeps is up
    to each process's HNSW graph (embedded and served build their own)."""
    if rows and set(rows[0]) == {"id", "published_at", "symbol", "body"}:
        return sorted((r["symbol"], r["body"]) for r in rows)
    return rows


def test_seed_bindings_over_flight_http_and_adbc_equal_embedded(world) -> None:
    served, emb = world["served"], world["emb"]
    remote = fabric.connect(served.grpc, token=TOKENS["alice"])
    import adbc_driver_flightsql.dbapi as flightsql

    adbc = flightsql.connect(
        served.grpc, db_kwargs={"adbc.flight.sql.authorization_header": f"Bearer {TOKENS['alice']}"}
    )
    answered = 0
    for name, session in _sessions(world):
        want = emb.query(name, session)
        got = remote.query(name, session)
        assert _rows(got.table) == _rows(want.table), (name, session)
        assert got.table.schema.names == want.table.schema.names
        assert set(got.freshness) == set(want.freshness)
        assert {a: f["status"] for a, f in got.freshness.items()} == {
            a: f["status"] for a, f in want.freshness.items()
        }
        assert set(got.stats["sources"]) == set(want.stats["sources"])
        status, body, ctype = served.post(
            f"/v1/query/{name}", {"session": wire.encode_session(session)}, TOKENS["alice"]
        )
        assert status == 200 and ctype.startswith("application/json"), body
        obj = json.loads(body)
        assert _norm([wire.decode_value(r) for r in obj["rows"]]) == _rows(want.table)
        assert set(obj["freshness"]) == set(want.freshness) and "sources" in obj["stats"]
        status, body, ctype = served.post(
            f"/v1/query/{name}",
            {"session": wire.encode_session(session)},
            TOKENS["alice"],
            accept="application/vnd.apache.arrow.stream",
        )
        assert status == 200 and ctype == "application/vnd.apache.arrow.stream"
        ipc = pa.ipc.open_stream(body).read_all()
        assert _rows(ipc) == _rows(want.table)
        assert json.loads(ipc.schema.metadata[b"fabric.freshness"]).keys() == want.freshness.keys()
        if name != "market_open_news":  # vectors do not fit a one-line statement
            cur = adbc.cursor()
            cur.execute(f"{name} {json.dumps(session)}")
            assert _rows(cur.fetch_arrow_table()) == _rows(want.table)
            cur.close()
        answered += bool(want.table.num_rows)
    assert answered >= 6
    adbc.close()
    remote.close()


def test_query_text_explain_validate_freshness_and_upsert_remote(world) -> None:
    served, emb = world["served"], world["emb"]
    remote = fabric.connect(served.grpc, token=TOKENS["alice"])
    text = "from mysql://shop/merchants as m where m.status = 'active' select m.id, m.name order by m.id limit 5"
    assert _rows(remote.query_text(text).table) == _rows(emb.query_text(text).table)
    status, body, _ = served.post("/v1/query_text", {"text": text}, TOKENS["alice"])
    assert status == 200 and len(json.loads(body)["rows"]) == 5
    assert _plan(remote.explain("nearby_offers")) == _plan(emb.explain("nearby_offers"))
    status, body, _ = served.post("/v1/explain/nearby_offers", {}, TOKENS["alice"])
    assert status == 200 and _plan(json.loads(body)["plan"]) == _plan(emb.explain("nearby_offers"))
    assert remote.validate() == [] and emb.validate() == []
    fresh = remote.freshness()
    assert "news" in fresh["sources"]
    names = {b["name"]: b for b in remote.bindings()}
    assert names["nearby_offers"]["schema"]["properties"]["user_id"]["type"] == "integer"
    assert (
        "user_id"
        not in fabric.connect(served.grpc, token=TOKENS["bob"]).bindings()[0]["schema"][
            "properties"
        ]
    )
    # a session value of the wrong type is refused by the server, with the embedded message
    with pytest.raises(E.BadRequest, match="user_id") as exc:
        remote.query("nearby_offers", {"user_id": "seven"})
    with pytest.raises(fabric.SessionError) as emb_exc:
        emb.query("nearby_offers", {"user_id": "seven"})
    assert emb_exc.value.diagnostics[0].message in str(exc.value)
    # upsert into the served dataset; the served query sees it at once
    import datetime as dt

    from examples.seed.data import hash_embed

    q = [float(x) for x in hash_embed(["zebra crossing quarterly results"])[0]]
    row = world["data"]["news"].slice(0, 1).to_pylist()[0]
    row = {
        **row,
        "id": "svc-upsert-1",
        "body": "zebra crossing quarterly results",
        "symbol": "AAPL",
        "embedding": q,
        "published_at": dt.datetime.now(dt.UTC),
    }
    schema = world["data"]["news"].schema
    n = remote.dataset("news").upsert(pa.Table.from_pylist([row], schema=schema))
    assert n == 1
    res = remote.query("market_open_news", {"query_vec": q, "symbols": ["AAPL"]})
    assert "svc-upsert-1" in res.table.column("id").to_pylist()
    with pytest.raises(E.Forbidden, match="may not write dataset 'news'"):
        fabric.connect(served.grpc, token=TOKENS["carol"]).dataset("news").upsert(
            pa.Table.from_pylist([row], schema=schema)
        )


def _source_rows(served: Served) -> dict[str, float]:
    out = {}
    for line in served.metrics().splitlines():
        if m := re.match(r'fabric_source_rows_total\{source="([^"]+)"\} (\S+)', line):
            out[m.group(1)] = float(m.group(2))
    return out


def _settled_sandbox(pid: int, timeout: float = 60.0) -> tuple[list[int], int]:
    """``_sandbox_activity`` once it holds still: the pool starts its workers after the
    first in the background (fabric/sandbox/pool.py), and one still booting switches."""
    last = _sandbox_activity(pid)
    deadline = time.time() + timeout
    while time.time() < deadline:
        time.sleep(0.5)
        now = _sandbox_activity(pid)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the sandbox workers under {pid} kept switching: {last}")


def test_refused_requests_say_why_and_run_nothing(world) -> None:
    """Nothing ran for a refused request, seen outside the server: no byte reached MariaDB
    (a relay counts what the served fabric sends it) and no sandbox worker started or woke
    up (their processes and context switches); the service's own counters agree."""
    served, relay = world["served"], world["mysql_relay"]
    alice = fabric.connect(served.grpc, token=TOKENS["alice"])
    alice.query(*_sessions(world)[-1])  # market_open_news: its python pushdown warms the pool
    before = _source_rows(served)
    sent, sandbox = relay.sent(), _settled_sandbox(served.proc.pid)
    assert sandbox[0], "the served fabric's sandbox pool has workers (market_open_news ran)"
    # no token / an unknown token
    with pytest.raises(E.Unauthenticated, match="no token"):
        fabric.connect(served.grpc).query("top_category_last_week", {"user_id": 1})
    with pytest.raises(E.Unauthenticated, match="unknown token"):
        fabric.connect(served.grpc, token="x" * 20).query("top_category_last_week", {"user_id": 1})
    status, body, _ = served.post("/v1/query/top_category_last_week", {"session": {"user_id": 1}})
    assert status == 401 and b"no token" in body
    # a binding not granted
    bob = fabric.connect(served.grpc, token=TOKENS["bob"])
    with pytest.raises(E.Forbidden, match="may not run binding 'top_category_last_week'"):
        bob.query("top_category_last_week", {"user_id": 1})
    status, body, _ = served.post(
        "/v1/query/top_category_last_week", {"session": {"user_id": 1}}, TOKENS["bob"]
    )
    assert status == 403 and b"may not run binding" in body
    # query_text not granted; python not granted (the snippet never reaches a sandbox)
    with pytest.raises(E.Forbidden, match="may not send text queries"):
        bob.query_text("from mysql://shop/orders as o select o.id limit 1")
    carol = fabric.connect(served.grpc, token=TOKENS["carol"])
    snippet = "def run(table):\n    return table\n"
    with pytest.raises(E.Forbidden, match="may not send python snippets"):
        carol.query_text("from mysql://shop/orders as o select o.id limit 1", python=snippet)
    status, body, _ = served.post(
        "/v1/query_text",
        {"text": "from mysql://shop/orders as o select o.id limit 1", "python": snippet},
        TOKENS["carol"],
    )
    assert status == 403 and b"python" in body
    # a pinned session value cannot be overridden; left out, the pin is used
    with pytest.raises(E.Forbidden, match="'user_id' is pinned"):
        bob.query("nearby_offers", {"user_id": 3})
    assert relay.sent() == sent  # no statement reached MariaDB
    assert _sandbox_activity(served.proc.pid) == sandbox  # no snippet reached a sandbox
    assert _source_rows(served) == before  # none of the above read a source
    res = bob.query("nearby_offers")
    assert _rows(res.table) == _rows(world["emb"].query("nearby_offers", {"user_id": 7}).table)
    assert relay.sent() > sent  # the relay sees a query that did run (merchants)
    alice.query_text("from mysql://shop/orders as o select o.id limit 1", python=snippet)
    assert _sandbox_activity(served.proc.pid)[1] > sandbox[1]  # ... and a snippet that did run
    text = served.metrics()
    assert 'fabric_query_errors_total{agent="bob",kind="forbidden"}' in text
    assert 'fabric_query_errors_total{agent="-",kind="unauthenticated"}' in text


def test_metrics_have_no_nan_and_query_series(world) -> None:
    served = world["served"]
    fabric.connect(served.grpc, token=TOKENS["alice"]).query(
        "top_category_last_week", {"user_id": 2}
    )
    text = served.metrics()
    assert "NaN" not in text
    assert re.search(r'fabric_query_seconds_count\{binding="top_category_last_week"', text)
    assert re.search(r'fabric_source_rows_total\{source="mysql://shop/orders"\} \d', text)
    assert re.search(r'fabric_agent_active_queries\{agent="alice",state="running"\} 0', text)
    assert "fabric_build_info{" in text
    # only Kafka-fed sources export an ingested counter
    for line in text.splitlines():
        if line.startswith("fabric_source_ingested_total{"):
            assert 'source="news"' in line, line


def test_changed_binding_file_is_served_at_once(world) -> None:
    served, work = world["served"], world["work"]
    remote = fabric.connect(served.grpc, token=TOKENS["alice"])
    path = work / "agents" / "svc_reload.yaml"
    body = (
        "binding: top_merchants\ndescription: a few active merchants\nsources:\n"
        "  m: {{from: mysql://shop/merchants, where: \"status = 'active'\"}}\n"
        "select: [m.id]\norder_by: m.id\nlimit: {n}\n"
    )
    path.write_text(body.format(n=2))
    try:
        deadline = time.time() + 10
        while True:
            try:
                assert remote.query("top_merchants").table.num_rows == 2
                break
            except E.NotFound:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        path.write_text(body.format(n=4))
        deadline = time.time() + 10
        while remote.query("top_merchants").table.num_rows != 4:
            assert time.time() < deadline, "the changed binding was not served"
            time.sleep(0.2)
    finally:
        path.unlink()


FLOOD = """
import sys, threading, time, fabric
from fabric.service.errors import Busy
url, token, streams = sys.argv[1], sys.argv[2], int(sys.argv[3])
answered, inflight = [0], [0]
lock = threading.Lock()
go = threading.Event()
def flood():
    f = fabric.connect(url, token=token)
    while True:
        go.wait()
        with lock:
            inflight[0] += 1
        try:
            f.query("top_category_last_week", {"user_id": 5})
            with lock:
                answered[0] += 1
        except Busy:
            pass
        finally:
            with lock:
                inflight[0] -= 1
for _ in range(streams):
    threading.Thread(target=flood, daemon=True).start()
for line in sys.stdin:  # go / stop (answered once every request in flight is done) / ?
    if line.strip() == "go":
        go.set()
    elif line.strip() == "stop":
        go.clear()
        while inflight[0]:
            time.sleep(0.01)
    print(answered[0], flush=True)
"""


class Flooder:
    """An agent process sending ``streams`` requests at once, all the time, while on."""

    def __init__(self, grpc: str, streams: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FLOOD, grpc, TOKENS["flood"], str(streams)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def say(self, cmd: str) -> int:
        """Send go / stop / ?; the number of flood requests answered so far."""
        self.proc.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _times(fab: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fab.query("top_category_last_week", {"user_id": 3})
        out.append(time.perf_counter() - t0)
    return out


def _served_variant(world: dict[str, Any], tag: str, server: str) -> Served:
    """A ``fabric serve`` of the world's config with ``server:`` replaced, its own state
    directory and consumer group."""
    work = world["work"]
    text = world["config"].read_text()
    assert "server: {query_workers: 2}" in text
    config = work / f"fabric-{tag}.yaml"
    config.write_text(text.replace("server: {query_workers: 2}", f"server: {server}"))
    env = dict(world["server_env"])
    env.update(
        FABRIC_STATE_DIR=str(work / f"srv-{tag}"), FABRIC_GROUP=f"{env['FABRIC_GROUP']}_{tag}"
    )
    return Served(config, env)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_flooding_agent_does_not_starve_another(world) -> None:
    """Another agent process floods with 8 concurrent streams; the measured agent's p50
    alone and while flooded, in alternating phases (the machine's load drifts; each
    phase pair sees the same). With the fair queue (the flooder's max_concurrent 1,
    round-robin between agents) her p50 stays within 2x of her p50 alone; with
    ``server.queue: fifo`` (arrival order, no per-agent limit) the same flood pushes it
    past 2x, so the flood is strong enough for the fair result to mean something."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:  # the world's server: query_workers 2
        starting = [
            pool.submit(_served_variant, world, q, f"{{query_workers: 2, queue: {q}}}")
            for q in ("fair", "fifo")
        ]
        servers = [f.result() for f in starting]
    alone: dict[str, list[float]] = {"fair": [], "fifo": []}
    flooded: dict[str, list[float]] = {"fair": [], "fifo": []}
    answered = {"fair": 0, "fifo": 0}
    clients: list[Any] = []
    try:
        for queue, served in zip(("fair", "fifo"), servers):
            alice = fabric.connect(served.grpc, token=TOKENS["alice"])
            _times(alice, 10)  # warm
            clients.append((queue, alice, Flooder(served.grpc, 8)))
        for i in range(6):  # short phases, many rounds: the load's drift falls on both
            for queue, alice, flooder in clients:
                if queue == "fifo" and i >= 3:  # each of its flooded queries waits long
                    continue
                n = 8 if queue == "fair" else 5
                alone[queue] += _times(alice, n)
                before = flooder.say("go")
                time.sleep(0.2)  # the flood's queue fills
                flooded[queue] += _times(alice, n)
                answered[queue] += flooder.say("stop") - before
    finally:
        for _, alice, flooder in clients:
            flooder.stop()
            alice.close()
        for served in servers:
            served.stop()
    ratio = {q: statistics.median(flooded[q]) / statistics.median(alone[q]) for q in alone}
    print(
        *(
            f"{q}: p50 alone {statistics.median(alone[q]) * 1000:.1f} ms, flooded "
            f"{statistics.median(flooded[q]) * 1000:.1f} ms ({ratio[q]:.2f}x, "
            f"{answered[q]} flood answers)"
            for q in ratio
        ),
        sep="\n",
    )
    assert min(answered.values()) > 30, answered  # the flood really ran alongside
    assert ratio["fifo"] > 2, ratio  # without fair queuing the flood starves her
    assert ratio["fair"] < 2, ratio


@pytest.mark.parametrize(
    ("agents", "message", "line"),
    [
        ("  a: {token: short}\n", "a token needs at least 16 characters", 2),
        ("  a: {token: '${SVC_UNSET_VAR}'}\n", "environment variable SVC_UNSET_VAR is not set", 2),
        ("  a:\n    token: x0123456789abcdef\n    tokn: 1\n", "tokn", 4),
        (
            "  a: {token: x0123456789abcdef, python: true}\n",
            "python: true needs query_text: true",
            2,
        ),
        ("  a: {bindings: ['*']}\n", "needs exactly one of token: or token_file:", 2),
        ("  a: {token_file: missing.token}\n", "cannot read token_file", 2),
        (
            "  a: {token: x0123456789abcdef}\n  b: {token: x0123456789abcdef}\n",
            "same token as agent a",
            3,
        ),
    ],
)
def test_agents_config_errors_have_positions(tmp_path, agents, message, line) -> None:
    path = tmp_path / "fabric.yaml"
    path.write_text("agents:\n" + agents)
    with pytest.raises(fabric.DslError) as exc:
        fabric.load_config(path)
    d = exc.value.diagnostics[0]
    assert message in d.message or message in str(d.format()), d.format()
    assert d.span is not None and d.span.line == line and d.span.file.endswith("fabric.yaml")


def test_server_queue_setting(tmp_path) -> None:
    """``server.queue`` is fair (the default) or fifo; anything else is refused with its
    position."""
    from fabric.service.auth import FairScheduler, FifoScheduler
    from fabric.service.core import QueryService

    path = tmp_path / "fabric.yaml"
    for text, cls in (
        ("server: {query_workers: 3}\n", FairScheduler),
        ("server:\n  queue: fifo\n", FifoScheduler),
    ):
        path.write_text(text)
        config = fabric.load_config(path)
        qs = QueryService(type("F", (), {"config": config})())
        assert type(qs.scheduler) is cls
    path.write_text("server:\n  query_workers: 2\n  queue: lifo\n")
    with pytest.raises(fabric.DslError) as exc:
        fabric.load_config(path)
    d = exc.value.diagnostics[0]
    assert "server queue must be fair or fifo, got 'lifo'" in d.message, d.format()
    assert d.span is not None and d.span.line == 3


def test_fifo_scheduler_serves_in_arrival_order() -> None:
    from fabric.service.auth import AgentConfig, FifoScheduler

    s = FifoScheduler(1)
    a = AgentConfig("a", "t" * 16, max_concurrent=1)
    b = AgentConfig("b", "u" * 16, max_concurrent=1)
    s.acquire(a)
    order: list[str] = []

    def want(agent: AgentConfig) -> None:
        s.acquire(agent)
        order.append(agent.name)
        s.release(agent)

    threads = []
    for agent in (a, a, a, b):
        threads.append(threading.Thread(target=want, args=(agent,)))
        threads[-1].start()
        time.sleep(0.1)
    assert s.active() == {"a": (1, 3), "b": (0, 1)}
    s.release(a)
    for t in threads:
        t.join(5)
    assert order == ["a", "a", "a", "b"], order  # b waits behind a's whole backlog


def test_fair_scheduler_round_robin_between_agents() -> None:
    from fabric.service.auth import AgentConfig, FairScheduler

    s = FairScheduler(1)
    a = AgentConfig("a", "t" * 16, max_concurrent=1)
    b = AgentConfig("b", "u" * 16, max_concurrent=1)
    s.acquire(a)
    order: list[str] = []

    def want(agent: AgentConfig) -> None:
        s.acquire(agent)
        order.append(agent.name)
        s.release(agent)

    threads = [threading.Thread(target=want, args=(a,)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # a's three are queued first
    tb = threading.Thread(target=want, args=(b,))
    tb.start()
    time.sleep(0.2)
    s.release(a)
    for t in [*threads, tb]:
        t.join(5)
    assert order.index("b") <= 1, order  # b is served next, not after a's whole backlog


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_wire_dumps_is_json_without_nan(monkeypatch, fast) -> None:
    """orjson and the stdlib's C encoder write what the Python walk wrote: NaN and
    infinities as null (no NaN in any answer), datetimes as ISO text, numpy scalars as
    numbers, enums as their values, other objects and non-text keys as text; and
    wire.loads reads it back as json.loads does (a big integer, which orjson refuses,
    too)."""
    import dataclasses
    import datetime as dt
    import decimal
    import enum
    import uuid

    import numpy as np

    if not fast:
        monkeypatch.setattr(wire, "orjson", None)
    else:
        assert wire.orjson is not None  # the [serve] extra, which the tests install

    class Kind(enum.Enum):
        A = "a"

    class Num(enum.IntEnum):
        ONE = 1

    @dataclasses.dataclass
    class Point:
        x: int

    class Big(int):
        pass

    cases: list[Any] = [
        {"a": 1.5, "b": [1, 2, {"c": "x"}], "n": None, "t": True, "e": 1e16, "s": 1e-7},
        {"lag": float("nan"), "inf": [float("inf"), -float("inf")]},
        {"at": dt.datetime(2026, 12, 2, 1, 2, 3), "day": dt.date(2026, 12, 2)},
        {"tz": dt.datetime(2026, 12, 2, 1, 2, 3, 793000, tzinfo=dt.UTC)},
        {"i": np.int64(3), "f": np.float32(0.5), "nan": np.float64("nan")},
        {"d": decimal.Decimal("1.25"), "s": {1}, (1, 2): "tuple key", 7: "int key"},
        {"k": Kind.A, "n": Num.ONE, "u": uuid.UUID(int=5), "p": Point(1), "t": (1, 2)},
        {"big": 2**70, "sub": Big(3), "time": dt.time(1, 2)},
    ]
    for obj in cases:
        got = wire.dumps(obj)
        want = json.dumps(wire._plain(obj), separators=(",", ":"))
        assert json.loads(got) == json.loads(want), obj
        assert b"NaN" not in got and b"Infinity" not in got
        assert wire.loads(got) == json.loads(got)


GRPC_PROBE = """
import os, sys
import fabric
fabric.connect("grpc://127.0.0.1:9", token="x" * 16)
print(repr(os.environ.get("GRPC_EXPERIMENTS")))
"""


@pytest.mark.parametrize("preset", [None, "", "-event_engine_client"])
def test_flight_client_starts_grpc_without_the_event_engine(preset) -> None:
    """fabric.connect starts pyarrow's gRPC with the low-latency poller (gRPC logs the
    experiments it read), and only for that moment: the process's environment is left
    as it was; a GRPC_EXPERIMENTS the process set itself (even empty) is kept."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env["GRPC_VERBOSITY"] = "debug"
    if preset is not None:
        env["GRPC_EXPERIMENTS"] = preset
    out = subprocess.run(
        [sys.executable, "-c", GRPC_PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(preset)
    # gRPC names the experiments it was given (no line when none)
    line = next((x for x in out.stderr.splitlines() if "gRPC experiments:" in x), "")
    assert ("event_engine_client:off" in line) == (preset != ""), out.stderr[-2000:]
    if preset is None:
        assert "event_engine_listener:off" in line and "event_engine_callback_cq:off" in line


THREAD_STATE_PROBE = """
import itertools, json, sys, threading
import pyarrow.flight as fl
import fabric
from fabric.service import flight
from fabric.service.core import QueryService

local = threading.local()
numbers = itertools.count(1)
stale = []  # calls whose start found a thread-local of an earlier call on its thread

class Mark(fl.ServerMiddleware):
    def __init__(self, n):
        self.n = n

class Marks(fl.ServerMiddlewareFactory):  # started before the token check, same callback
    def start_call(self, info, headers):
        if getattr(local, "n", None) is not None:
            stale.append(local.n)
        local.n = n = next(numbers)
        return Mark(n)

class Server(flight.FabricFlightServer):
    def do_action(self, context, action):
        self._agent(context)  # through the token check, as every call
        seen = getattr(local, "n", None)  # the handler is a callback of its own
        mine = context.get_middleware("mark").n
        return [fl.Result(json.dumps([seen == mine, len(stale)]).encode())]

fab = fabric.open(sys.argv[1])
server = Server(QueryService(fab), "grpc://127.0.0.1:0", middleware={"mark": Marks()})
threading.Thread(target=server.serve, daemon=True).start()
client = fl.FlightClient(f"grpc://127.0.0.1:{server.port}")
opts = fl.FlightCallOptions(headers=[(b"authorization", b"Bearer tok-0123456789abcdef")])
got = []
for _ in range(40):
    (r,) = client.do_action(fl.Action("n", b""), options=opts)
    got.append(json.loads(r.body.to_pybytes()))
print(json.dumps({"same_state": sum(s for s, _ in got), "stale": got[-1][1]}))
server.shutdown()
fab.close()
"""


def test_a_flight_call_keeps_one_python_thread_state(tmp_path) -> None:
    """pyarrow runs each Python callback of a Flight call on a gRPC thread Python does not
    know; every callback built a thread state of its own (and mapped and unmapped its
    frame stack). The token check keeps the state of its start for the call's handler
    and the rest of its callbacks, and lets it go when the call completes: a thread-local
    set as the call starts is seen by its handler (40 of 40 calls), and none is left for
    the next call on that thread (gRPC ends threads and starts new ones: a state kept
    past its call would be kept forever)."""
    (tmp_path / "fabric.yaml").write_text(
        'agents:\n  t: {token: "tok-0123456789abcdef", bindings: ["*"]}\n'
    )
    out = subprocess.run(
        [sys.executable, "-c", THREAD_STATE_PROBE, str(tmp_path / "fabric.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"same_state": 40, "stale": 0}, got


async def _mcp(open_streams: Any, calls: list[tuple[str, dict[str, Any]]]) -> tuple[Any, list[Any]]:
    from mcp.client.session import ClientSession

    async with open_streams as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = await session.list_tools()
            results = [await session.call_tool(n, a) for n, a in calls]
    return tools, results


def _mcp_http(url: str, token: str | None, calls: list[tuple[str, dict[str, Any]]]) -> Any:
    import anyio
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    headers = {"authorization": f"Bearer {token}"} if token else {}

    async def run() -> Any:
        async with httpx2.AsyncClient(headers=headers, timeout=60) as client:
            return await _mcp(streamable_http_client(url, http_client=client), calls)

    return anyio.run(run)


def _mcp_stdio(
    args: list[str], env: dict[str, str], calls: list[tuple[str, dict[str, Any]]]
) -> Any:
    import anyio
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "fabric", "mcp", *args], env=env
    )

    async def run() -> Any:
        return await _mcp(stdio_client(params), calls)

    return anyio.run(run)


def _mcp_rows(result: Any) -> list[dict[str, Any]]:
    assert not result.is_error, result.content
    body = json.loads(result.content[0].text)
    assert set(body) >= {"rows", "freshness", "stats"}
    return _norm([wire.decode_value(r) for r in body["rows"]])


def test_seed_bindings_as_mcp_tools_over_stdio_and_http(world) -> None:
    served, emb = world["served"], world["emb"]
    calls = [(n, wire.encode_session(s)) for n, s in _sessions(world)]
    env = {**os.environ, "FABRIC_TOKEN": TOKENS["alice"]}
    # stdio in front of the served fabric
    tools, results = _mcp_stdio(["--connect", served.grpc], env, calls)
    by_name = {t.name: t for t in tools.tools}
    assert by_name["nearby_offers"].description == emb.binding("nearby_offers").spec.description
    assert by_name["nearby_offers"].input_schema["properties"]["user_id"]["type"] == "integer"
    assert by_name["market_open_news"].input_schema["properties"]["query_vec"]["maxItems"] == 384
    for (name, session), res in zip(_sessions(world), results, strict=True):
        assert _mcp_rows(res) == _rows(emb.query(name, session).table), name
    # streamable HTTP, with the same tokens
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric", "mcp", "--http", "--port", "0", "--connect", served.grpc],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        url = re.search(r"(http://\S+/mcp)", line).group(1)  # type: ignore[union-attr]
        tools, results = _mcp_http(url, TOKENS["alice"], calls[:3])
        for (name, session), res in zip(_sessions(world)[:3], results, strict=True):
            assert _mcp_rows(res) == _rows(emb.query(name, session).table), name
        tools, results = _mcp_http(url, TOKENS["bob"], [("top_category_last_week", {"user_id": 1})])
        assert [t.name for t in tools.tools] == ["nearby_offers"]
        assert "user_id" not in tools.tools[0].input_schema["properties"]  # pinned
        assert results[0].is_error and "may not run binding" in results[0].content[0].text
        req = urllib.request.Request(url, data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 401 and b"no token" in exc.value.read()
    finally:
        proc.terminate()
        proc.wait(10)


def test_mcp_over_http_mounted_in_fabric_serve(world) -> None:
    """``fabric serve`` itself answers MCP at /mcp (the real SDK's client), in front of the
    same service as Flight and HTTP JSON: the same tokens, pins, refusals and metrics."""
    served, emb = world["served"], world["emb"]
    url = served.http + "/mcp"
    calls = [(n, wire.encode_session(s)) for n, s in _sessions(world)]
    tools, results = _mcp_http(url, TOKENS["alice"], calls)
    by_name = {t.name: t for t in tools.tools}
    assert set(by_name) == set(emb.bindings.names())
    assert by_name["nearby_offers"].description == emb.binding("nearby_offers").spec.description
    assert by_name["nearby_offers"].input_schema["properties"]["user_id"]["type"] == "integer"
    for (name, session), res in zip(_sessions(world), results, strict=True):
        assert _mcp_rows(res) == _rows(emb.query(name, session).table), name
    # bob: only his binding, his user_id pinned (left out of the schema and applied)
    tools, results = _mcp_http(
        url, TOKENS["bob"], [("nearby_offers", {}), ("top_category_last_week", {"user_id": 1})]
    )
    assert [t.name for t in tools.tools] == ["nearby_offers"]
    assert "user_id" not in tools.tools[0].input_schema["properties"]
    assert _mcp_rows(results[0]) == _rows(emb.query("nearby_offers", {"user_id": 7}).table)
    assert results[1].is_error and "may not run binding" in results[1].content[0].text
    for headers in ({}, {"Authorization": "Bearer " + "x" * 20}):
        req = urllib.request.Request(url, data=b"{}", method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 401 and b"token" in exc.value.read()
    text = served.metrics()  # the calls went through the one QueryService
    assert 'fabric_query_seconds_count{binding="nearby_offers"' in text
    assert re.search(r'fabric_query_errors_total\{agent="bob",kind="forbidden"\} [1-9]', text)


def _blocks(path: Path) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", path.read_text(), flags=re.S)


def test_docs_service_blocks(world, tmp_path) -> None:
    """Every config and command block of docs/service.md, run against the served fabric."""
    import yaml

    served = world["served"]
    blocks = _blocks(ROOT / "docs" / "service.md")
    kinds = [k for k, _ in blocks]
    assert kinds.count("yaml") == 3 and kinds.count("python") == 2
    assert kinds.count("sh") == 2 and kinds.count("json") == 1
    env = {
        **os.environ,
        "FABRIC_URL": served.grpc,
        "FABRIC_HTTP": served.http,
        "FABRIC_TOKEN": TOKENS["alice"],
    }
    for kind, text in blocks:
        if kind == "yaml" and "agents:" in text:
            (tmp_path / "analyst.token").write_text("analyst-token-0123456789\n")
            cfg = tmp_path / "fabric.yaml"
            cfg.write_text(text)
            os.environ.update(
                SUPPORT_BOT_TOKEN="support-token-0123456789",
                INGEST_BOT_TOKEN="ingest-token-0123456789",
            )
            try:
                config = fabric.load_config(cfg)
            finally:
                del os.environ["SUPPORT_BOT_TOKEN"], os.environ["INGEST_BOT_TOKEN"]
            agents = config.agents
            assert agents["support-bot"].pin == {"user_id": 42}
            assert agents["analyst"].token == "analyst-token-0123456789"
            assert agents["analyst"].query_text and not agents["analyst"].python
            assert agents["ingest-bot"].may_upsert("news")
            assert config.server.flight_port == 8815 and config.server.query_workers == 4
        elif kind == "yaml" and "scrape_configs" in text:
            job = yaml.safe_load(text)["scrape_configs"][0]
            with urllib.request.urlopen(served.http + job["metrics_path"], timeout=10) as r:
                assert b"fabric_build_info{" in r.read()
        elif kind == "yaml":
            trigger = yaml.safe_load(text)["spec"]["triggers"][0]["metadata"]
            path = "/" + trigger["url"].split("/", 3)[3]
            with urllib.request.urlopen(served.http + path, timeout=10) as r:
                value = json.loads(r.read())[trigger["valueLocation"]]
            assert isinstance(value, int | float)
        elif kind == "python":
            old = dict(os.environ)
            os.environ.update(env)
            try:
                exec(compile(text, "docs/service.md", "exec"), {})
            finally:
                os.environ.clear()
                os.environ.update(old)
        elif kind == "sh" and text.startswith("fabric serve"):
            from tests.test_server_kafka import free_port

            args = text.split()[1:]
            args[args.index("--port") + 1] = str(free_port())
            args[args.index("--flight-port") + 1] = str(free_port())
            args[args.index("--config") + 1] = str(world["config"])
            run_env = {
                **world["server_env"],
                "FABRIC_GROUP": "docs",
                "FABRIC_STATE_DIR": str(tmp_path / "st"),
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "fabric", *args],
                env=run_env,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                seen = [proc.stdout.readline() for _ in range(3)]  # type: ignore[union-attr]
                assert "queries on grpc://127.0.0.1:" in seen[0], seen
                assert re.search(r"MCP tools on http://127\.0\.0\.1:\d+/mcp", seen[1]), seen
                assert "listening on http://127.0.0.1:" in seen[2], seen
            finally:
                proc.terminate()
                proc.wait(20)
        elif kind == "sh":
            if shutil.which("curl") is None:
                pytest.skip("curl is not installed")
            out = subprocess.run(["bash", "-c", text], env=env, capture_output=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert "rows" in json.loads(out.stdout)
        elif kind == "json":
            spec = json.loads(text)["mcpServers"]["fabric"]
            command = str(Path(sys.executable).parent / spec["command"])
            args = [a.replace("grpc://127.0.0.1:8815", served.grpc) for a in spec["args"]]
            assert args[0] == "mcp"
            tools, _ = _mcp_stdio(
                args[1:], {**os.environ, **spec["env"], "FABRIC_TOKEN": TOKENS["alice"]}, []
            )
            assert "nearby_offers" in {t.name for t in tools.tools}
            assert Path(command).exists()
