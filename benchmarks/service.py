"""One fabric for many agents, measured: N agent processes querying the seed bindings,
(a) each with its own embedded fabric, (b) all through one ``fabric serve`` (Flight).

    python benchmarks/service.py                  # 1, 4 and 16 agents, 5 s each
    python benchmarks/service.py --agents 1 4 --seconds 3

Per row: memory in total (RSS of every agent process, plus the server's in (b)), Kafka
bytes consumed in total (the news topic once per fabric that ingests it, plus what the
queries' Kafka scans read, from their stats), p50/p99 latency, throughput. Then the
remote overhead per query over embedded, interleaved in one process, for a 10-row
result (goal: < 1 ms on loopback via Flight), from MariaDB and from the in-process news
dataset (no database time), decomposed: through Flight to ``fabric serve``, the same
Flight code in a probe process that times each call in the server (token check,
handler, query, stream written), a bare pyarrow.flight server answering the same table
(the transport floor), a TCP ping-pong (the OS / VM floor), HTTP JSON; with the client's
CPU time per path, and the bare floor after the machine sat idle 0, 1 and 10 ms.

    python benchmarks/service.py --overhead-only --reps 300

Needs the servers of ``scripts/services``; loads the seed data under its own names.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SEED = ROOT / "examples" / "seed"
TOKEN = "bench-token-0123456789"
SESSIONS = [("nearby_offers", {"user_id": u}) for u in range(1, 21)] + [
    ("top_category_last_week", {"user_id": u}) for u in range(1, 21)
]


def _rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _kafka_bytes(res: Any) -> int:
    return sum(
        int(s.get("bytes") or 0)
        for s in res.stats.get("sources", {}).values()
        if str(s.get("uri", "")).startswith("kafka://")
    )


def agent(mode: str, target: str, env: dict[str, str], seconds: float, out: Any) -> None:
    """One agent process: query the seed bindings round-robin for ``seconds``."""
    try:
        _agent(mode, target, env, seconds, out)
    except BaseException as e:  # said to the parent, which leaves this agent out
        out.put(("failed", f"{type(e).__name__}: {e}"))


def _agent(mode: str, target: str, env: dict[str, str], seconds: float, out: Any) -> None:
    os.environ.update(env)
    import fabric

    if mode == "embedded":
        fab: Any = fabric.open(target)
        fab.catch_up(60)
    else:
        fab = fabric.connect(target, token=TOKEN)
    for name, session in SESSIONS[:4]:  # warm: compile, connect
        fab.query(name, session)
    out.put(("ready", os.getpid()))
    lat: list[float] = []
    kbytes = 0
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end:
        name, session = SESSIONS[i % len(SESSIONS)]
        i += 1
        t0 = time.perf_counter()
        res = fab.query(name, session)
        lat.append(time.perf_counter() - t0)
        kbytes += _kafka_bytes(res)
    out.put(("done", {"lat": lat, "rss": _rss_mb(), "kafka": kbytes}))
    fab.close()


def _config(work: Path, topic: str, tag: str) -> Path:
    d = work / tag
    shutil.copytree(SEED / "agents", d / "agents")
    nearby = d / "agents" / "nearby_offers.yaml"
    nearby.write_text(nearby.read_text().replace("location_stream", topic))
    text = (SEED / "fabric.yaml").read_text()
    text = re.sub(
        r"^ingest:.*$",
        'ingest: {checkpoint_dir: "${FABRIC_STATE_DIR}", group_prefix: "${FABRIC_GROUP}"}',
        text,
        flags=re.M,
    )
    text += (
        f'\nagents:\n  bench: {{token: "{TOKEN}", bindings: ["*"], query_text: true, max_concurrent: 4, '
        "max_queued: 256}\nserver: {query_workers: 4}\n"
    )
    (d / "fabric.yaml").write_text(text)
    return d / "fabric.yaml"


def topic_bytes(bootstrap: str, topic: str) -> int:
    """Bytes (keys + values) in ``topic``: what one fabric ingesting it consumes."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-size-{os.getpid()}"})
    md = c.list_topics(topic, timeout=10).topics[topic]
    total = 0
    for p in md.partitions:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if hi <= lo:
            continue
        c.assign([TopicPartition(topic, p, lo)])
        n = 0
        while n < hi - lo:
            for m in c.consume(1000, timeout=5):
                if m.error() is None:
                    total += len(m.value() or b"") + len(m.key() or b"")
                n += 1
    c.close()
    return total


def run(mode: str, n: int, target: str, envs: list[dict[str, str]], seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=agent, args=(mode, target, envs[i], seconds, q)) for i in range(n)]
    for p in procs:
        p.start()
    ready, failed = 0, []
    while ready + len(failed) < n:
        kind, r = q.get(timeout=300)
        ready += kind == "ready"
        if kind == "failed":
            failed.append(r)
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    while len(results) + len(failed) < n:
        kind, r = q.get(timeout=300)
        if kind == "done":
            results.append(r)
        elif kind == "failed":
            failed.append(r)
    for why in failed:
        print(f"{mode} agent failed: {why}", file=sys.stderr)
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    lat = sorted(x for r in results for x in r["lat"])
    return {
        "rss": sum(r["rss"] for r in results),
        "kafka_scan": sum(r["kafka"] for r in results),
        "p50": lat[len(lat) // 2] * 1000,
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        "qps": len(lat) / wall,
        "ran": len(results),
    }


OVERHEAD_QUERIES = {
    # 10 rows from MariaDB: the scan pool and the database's own time (noisy under load)
    "mysql": "from mysql://shop/merchants as m where m.status = 'active' "
    "select m.id, m.name order by m.id limit 10",
    # 10 rows of the news dataset, in process: what is left is the service's own cost
    "dataset": "from dataset://news as n select n.id, n.symbol order by n.id limit 10",
}
# the paths of the decomposition, in the order of the table
PATHS = ("embedded", "flight", "probe", "bare", "socket", "rtt", "http")


def echo_server(reply: int, out: Any) -> None:
    """(a) the OS / VM floor: a TCP server in a process of its own that answers every
    request (one recv) with ``reply`` bytes."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    out.put(s.getsockname()[1])
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = b"x" * reply
    while c.recv(65536):
        c.sendall(data)


def probe_server(kind: str, config: str, env: dict[str, str], tables: dict, out: Any) -> None:
    """A Flight server in a process of its own that times every ``do_get`` in the server:
    ``bench.timings`` answers the calls since the last one as JSON, per call ``[total,
    cpu, pre, handler, query, write]`` in seconds: from the call's start (headers
    received, before the token check) to its completion (the last batch written), wall and
    the thread's CPU; of it before the handler (the middlewares: the token check), in the
    handler (``do_get``: ticket, session, query, result metadata), the query itself
    (``fab.query`` / ``fab.query_text``), after the handler (the stream written).

    (b) ``bare``: pyarrow.flight alone, no middleware but the timing, ``do_get(name)``
    answers the 10-row table the query of that name gives (its IPC bytes in ``tables``).
    (c') ``probe``: ``FabricFlightServer`` over ``QueryService(fabric.open(config))``, the
    code ``fabric serve`` runs for a Flight call (without its HTTP and MCP servers)."""
    import json
    import threading

    os.environ.update(env)
    import pyarrow as pa
    import pyarrow.flight as fl

    from fabric.service.transport import grpc_defaults

    calls: list[list[float]] = []
    now: dict[int, list[float]] = {}  # per thread: the running call's marks

    class Timed(fl.ServerMiddleware):
        def __init__(self, method: Any) -> None:
            self.method = method
            self.tid = threading.get_ident()
            self.c0 = time.thread_time()
            self.t0 = time.perf_counter()
            now[self.tid] = self.marks = [self.t0, 0.0, 0.0, 0.0]  # start, in, out, query

        def call_completed(self, exception: Any) -> None:
            t = time.perf_counter()
            same = threading.get_ident() == self.tid
            if self.method == fl.FlightMethod.DO_GET and exception is None:
                t0, t_in, t_out, q = self.marks
                cpu = time.thread_time() - self.c0 if same else -1.0
                calls.append([t - t0, cpu, t_in - t0, t_out - t_in, q, t - t_out])

    class TimedFactory(fl.ServerMiddlewareFactory):
        def start_call(self, info: Any, headers: Any) -> Timed:
            return Timed(info.method)

    def timings() -> list[fl.Result]:
        got = list(calls)
        del calls[: len(got)]
        return [fl.Result(json.dumps(got).encode())]

    def handler(do_get: Any) -> Any:
        def timed_do_get(context: Any, ticket: Any) -> Any:
            marks = now[threading.get_ident()]
            marks[1] = time.perf_counter()
            try:
                return do_get(context, ticket)
            finally:
                marks[2] = time.perf_counter()

        return timed_do_get

    def query(run: Any) -> Any:
        def timed_query(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return run(*args, **kw)
            finally:
                now[threading.get_ident()][3] += time.perf_counter() - t0

        return timed_query

    timed = {"bench": TimedFactory()}
    server: Any
    if kind == "bare":
        by_name = {k.encode(): pa.ipc.open_stream(v).read_all() for k, v in tables.items()}

        class Bare(fl.FlightServerBase):
            def do_get(self, context: Any, ticket: Any) -> Any:
                return fl.RecordBatchStream(by_name[ticket.ticket])

            def do_action(self, context: Any, action: Any) -> Any:
                return timings()

        with grpc_defaults():
            server = Bare("grpc://127.0.0.1:0", middleware=timed)
    else:
        import fabric
        from fabric.service.core import QueryService
        from fabric.service.flight import FabricFlightServer

        fab = fabric.open(config)
        fab.catch_up(60)
        fab.query = query(fab.query)  # type: ignore[method-assign]
        fab.query_text = query(fab.query_text)  # type: ignore[method-assign]

        class Probe(FabricFlightServer):
            def do_action(self, context: Any, action: Any) -> Any:
                if action.type == "bench.timings":
                    return timings()
                return super().do_action(context, action)

        with grpc_defaults():
            server = Probe(QueryService(fab), "grpc://127.0.0.1:0", middleware=timed)
    server.do_get = handler(server.do_get)
    # served from a thread with the main thread waiting, as in fabric serve (FlightThread)
    threading.Thread(target=server.serve, name="fabric-flight", daemon=True).start()
    out.put(server.port)
    while True:
        time.sleep(0.5)


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q), daemon=True)
    p.start()
    return p, q.get(timeout=300)


def overhead(
    config: Path, grpc: str, http_url: str, env: dict[str, str], reps: int
) -> list[dict[str, Any]]:
    """Per query of ``OVERHEAD_QUERIES``, the same 10-row result by every path of
    ``PATHS``, interleaved in one process (the order rotates every repetition):

    - embedded ``fab.query_text``; (c) ``flight``: ``fabric.connect`` to ``fabric serve``;
      (c') ``probe``: ``fabric.connect`` to the same Flight code in a process that times it
      (``probe_server``); (b) ``bare``: a pyarrow.flight ``do_get`` of the same table from a
      server with nothing of ours; (a) ``socket``: a TCP ping-pong of the ticket's size out
      and the result's Arrow IPC size back; ``rtt``: a Flight ``list_actions`` to ``fabric
      serve`` (a call that runs no query); ``http``: ``POST /v1/query_text`` (JSON rows,
      one kept-alive connection).

    Per path the p50 wall time, the p50 of the paired differences with the embedded run
    next to it, and the p50 of the calling thread's CPU time; for probe and bare the p50 of
    the server's own time per call (wall and CPU: start of the call to its last batch)."""
    import http.client
    import json
    import socket
    import urllib.parse

    os.environ.update(env)
    import fabric  # the client first: fabric.connect starts pyarrow's gRPC as it serves

    remote = fabric.connect(grpc, token=TOKEN)
    fab = fabric.open(config)  # ingesting, so dataset://news holds the topic as served
    fab.catch_up(60)
    import pyarrow as pa
    import pyarrow.flight as fl

    from fabric.service.flight import result_table

    results = {name: fab.query_text(text) for name, text in OVERHEAD_QUERIES.items()}
    ipc = {}
    for name, res in results.items():
        sink = pa.BufferOutputStream()
        table = result_table(res)
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        ipc[name] = sink.getvalue().to_pybytes()
    probe_env = {**env, "FABRIC_GROUP": env.get("FABRIC_GROUP", "bench") + "_probe"}
    probe_env["FABRIC_STATE_DIR"] = env.get("FABRIC_STATE_DIR", "/tmp") + "-probe"
    procs = []
    p, port = _spawn(probe_server, "probe", str(config), probe_env, {})
    procs.append(p)
    probe = fabric.connect(f"grpc://127.0.0.1:{port}", token=TOKEN)
    p, port = _spawn(probe_server, "bare", "", env, {k: v for k, v in ipc.items()})
    procs.append(p)
    bare = fl.FlightClient(f"grpc://127.0.0.1:{port}")
    client = fl.FlightClient(grpc)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    url = urllib.parse.urlsplit(http_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=60)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    def over_http(body: bytes) -> int:
        conn.request("POST", "/v1/query_text", body=body, headers=headers)
        resp = conn.getresponse()
        rows = json.loads(resp.read())["rows"]
        assert resp.status == 200, resp.status
        return len(rows)

    def server_times(c: Any, o: Any = None) -> list[list[float]]:
        res = list(c.do_action(fl.Action("bench.timings", b""), options=o))
        return json.loads(res[0].body.to_pybytes())

    out = []
    for name, text in OVERHEAD_QUERIES.items():
        body = json.dumps({"text": text}).encode()
        ticket = json.dumps({"text": text, "session": {}}, separators=(",", ":")).encode()
        p, port = _spawn(echo_server, len(ipc[name]))
        procs.append(p)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def ping(sock: Any = sock, size: int = len(ipc[name]), ticket: bytes = ticket) -> int:
            sock.sendall(ticket)
            n = 0
            while n < size:
                n += len(sock.recv(65536))
            return 10

        bare_ticket = fl.Ticket(name.encode())
        calls = {
            "embedded": lambda text=text: fab.query_text(text).table.num_rows,
            "flight": lambda text=text: remote.query_text(text).table.num_rows,
            "probe": lambda text=text: probe.query_text(text).table.num_rows,
            "bare": lambda t=bare_ticket: bare.do_get(t).read_all().num_rows,
            "socket": ping,
            "rtt": lambda: len(list(client.list_actions(options=opts))),
            "http": lambda body=body: over_http(body),
        }
        for kind in ("embedded", "flight", "probe", "bare", "http"):
            assert calls[kind]() == 10, (name, kind)
        for _ in range(20):  # warm: compile, connect
            for fn in calls.values():
                fn()
        server_times(probe._client, probe._opts)  # forget the warm-up's
        server_times(bare)
        wall: dict[str, list[float]] = {k: [] for k in calls}
        cpu: dict[str, list[float]] = {k: [] for k in calls}
        order = list(calls)
        for i in range(reps):
            k = i % len(order)
            for kind in order[k:] + order[:k]:
                c0 = time.thread_time()
                t0 = time.perf_counter()
                calls[kind]()
                wall[kind].append(time.perf_counter() - t0)
                cpu[kind].append(time.thread_time() - c0)
        ms = 1000.0
        row: dict[str, Any] = {"query": name, "ipc_bytes": len(ipc[name])}
        for kind in calls:
            pairs = zip(wall[kind], wall["embedded"])
            row[kind] = {
                "p50": statistics.median(wall[kind]) * ms,
                "over": statistics.median(r - e for r, e in pairs) * ms,
                "cpu": statistics.median(cpu[kind]) * ms,
            }
        for kind, c, o in (("probe", probe._client, probe._opts), ("bare", bare, None)):
            st = server_times(c, o)
            for i, part in enumerate(("server", "server_cpu", "pre", "handler", "query", "write")):
                got = [x[i] for x in st if x[i] >= 0]
                row[kind][part] = statistics.median(got) * ms if got else None
            if kind == "bare":
                row[kind]["query"] = None
        out.append(row)
        sock.close()
    out.append({"query": "idle", "gaps": idle_gaps(bare, ipc["dataset"], reps, server_times)})
    conn.close()
    for c in (remote, probe):
        c.close()
    bare.close()
    client.close()
    fab.close()
    for p in procs:
        p.terminate()
        p.join(10)
    return out


IDLE_GAPS_MS = (0.0, 1.0, 10.0)


def idle_gaps(bare: Any, ipc: bytes, reps: int, server_times: Any) -> list[dict[str, Any]]:
    """The same bare Flight do_get and TCP ping-pong back to back and after the caller
    sleeps ``IDLE_GAPS_MS`` between calls (the server idle meanwhile, as it is between
    an agent's queries): what an idle machine adds to a round trip (wake-ups of halted
    CPUs, cold caches), in wall time and in the CPU time of the client's and the
    server's thread."""
    import socket

    import pyarrow.flight as fl

    p, port = _spawn(echo_server, len(ipc))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ticket = fl.Ticket(b"dataset")
    rows = []
    for gap in IDLE_GAPS_MS:
        server_times(bare)
        wall: dict[str, list[float]] = {"bare": [], "socket": []}
        cpu: dict[str, list[float]] = {"bare": [], "socket": []}
        for _ in range(max(reps // 2, 50)):
            for kind in ("bare", "socket"):
                if gap:
                    time.sleep(gap / 1000)
                c0 = time.thread_time()
                t0 = time.perf_counter()
                if kind == "bare":
                    bare.do_get(ticket).read_all()
                else:
                    sock.sendall(b"x" * 100)
                    n = 0
                    while n < len(ipc):
                        n += len(sock.recv(65536))
                wall[kind].append(time.perf_counter() - t0)
                cpu[kind].append(time.thread_time() - c0)
        st = server_times(bare)
        rows.append(
            {
                "gap": gap,
                **{f"{k}_p50": statistics.median(v) * 1000 for k, v in wall.items()},
                **{f"{k}_cpu": statistics.median(v) * 1000 for k, v in cpu.items()},
                "server_cpu": statistics.median(x[1] for x in st) * 1000 if st else None,
            }
        )
    sock.close()
    p.terminate()
    p.join(10)
    return rows


def print_overhead(over: list[dict[str, Any]], reps: int) -> None:
    print(
        f"\n10-row queries, {reps} reps interleaved in one process (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    print(
        f"{'query':<8} {'path':<9} {'p50 ms':>8} {'over emb':>9} {'client cpu':>10} "
        f"{'server':>8} {'srv cpu':>8} {'pre':>6} {'handler':>8} {'query':>6} {'write':>6}"
    )

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    idle = [o for o in over if o["query"] == "idle"]
    for o in over:
        if o["query"] == "idle":
            continue
        for kind in PATHS:
            r = o[kind]
            parts = ("server", "server_cpu", "pre", "handler", "query", "write")
            srv = " ".join(
                f"{f(r.get(p)):>{w}}" for p, w in zip(parts, (8, 8, 6, 8, 6, 6), strict=True)
            )
            print(
                f"{o['query']:<8} {kind:<9} {r['p50']:>8.3f} "
                f"{'' if kind == 'embedded' else f(r['over']):>9} {r['cpu']:>10.3f} {srv}"
            )
    print(
        "p50 in ms. over emb: the median of the paired differences with the embedded run "
        "next to it (goal for flight < 1 ms). client cpu: the calling thread's CPU time. "
        "server: the server's own time per do_get, from the call's start (before the token "
        "check) to its last batch written, wall and thread CPU (srv cpu); of it pre: before "
        "the handler (the token check), handler: do_get (ticket, session, query, result "
        "metadata), query: fab.query_text inside it, write: after the handler (the stream "
        "written). flight: fabric.connect to fabric serve; probe: the same Flight code in a "
        "process that times it; bare: pyarrow.flight do_get of the same table, nothing of "
        "ours; socket: TCP ping-pong of the ticket out and the result's IPC bytes back; rtt: "
        "Flight list_actions to fabric serve (no query); http: POST /v1/query_text"
    )
    for o in idle:
        print(
            "\nidle between calls: a bare Flight do_get of the dataset result and a TCP "
            "ping-pong of its size, back to back and after the client sleeps"
        )
        print(
            f"{'gap ms':>6} {'flight p50':>10} {'client cpu':>10} {'server cpu':>10} "
            f"{'socket p50':>10} {'client cpu':>10}"
        )
        for g in o["gaps"]:
            sc = "-" if g["server_cpu"] is None else f"{g['server_cpu']:.3f}"
            print(
                f"{g['gap']:>6g} {g['bare_p50']:>10.3f} {g['bare_cpu']:>10.3f} {sc:>10} "
                f"{g['socket_p50']:>10.3f} {g['socket_cpu']:>10.3f}"
            )


def cleanup(env: dict[str, str]) -> None:
    """Drop what the benchmark loaded (its own database, collection, topics)."""
    from examples.seed.load import drop_loaded

    drop_loaded(env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=300, help="repetitions of the overhead query")
    ap.add_argument("--overhead-only", action="store_true", help="only the remote overhead")
    args = ap.parse_args(argv)
    from examples.seed.data import generate
    from examples.seed.load import environment, load_all

    prefix = f"bench_service_{os.getpid()}"
    env = environment(prefix)
    env["FABRIC_LOCATION_TOPIC"] = f"{prefix}_locations"
    work = Path(tempfile.mkdtemp(prefix="fabric-bench-service-"))
    from crypto import KeyRing

    (work / "agent.pub").write_bytes(KeyRing.generate().public_context())
    env["FABRIC_AGENT_PUBLIC_CONTEXT"] = str(work / "agent.pub")
    data = generate(users=30, merchants=1000, coupons=3000, orders=5000, news=500)
    if args.overhead_only:  # only what the overhead queries read: MariaDB and the news topic
        from examples.seed.load import load_mysql, produce

        load_mysql(env["FABRIC_SHOP_URL"], {"merchants": data["merchants"]})
        produce(env["FABRIC_KAFKA_BOOTSTRAP"], env["FABRIC_NEWS_TOPIC"], data["news"], "id")
    else:
        load_all(env, data)
    config = _config(work, env["FABRIC_LOCATION_TOPIC"], "cfg")
    news_bytes = topic_bytes(env["FABRIC_KAFKA_BOOTSTRAP"], env["FABRIC_NEWS_TOPIC"])

    def fab_env(tag: str) -> dict[str, str]:
        return {
            **env,
            "FABRIC_STATE_DIR": str(work / f"state-{tag}"),
            "FABRIC_GROUP": f"{prefix}_{tag}",
        }

    server_env = {**os.environ, **fab_env("server")}
    srv = subprocess.Popen(
        [
            *(sys.executable, "-m", "fabric", "serve", "--config", str(config)),
            *("--port", "0", "--flight-port", "0", "--log-level", "warning"),
        ],
        env=server_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    grpc = http = ""
    while not http:
        line = srv.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit("fabric serve did not start")
        if m := re.search(r"queries on (grpc://\S+)", line):
            grpc = m.group(1)
        if m := re.search(r"listening on (http://\S+)", line):
            http = m.group(1)
    for _ in range(600):
        try:
            with urllib.request.urlopen(http + "/readyz", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    rows = []
    try:
        for n in [] if args.overhead_only else args.agents:
            e = run(
                "embedded", n, str(config), [fab_env(f"a{n}_{i}") for i in range(n)], args.seconds
            )
            e["kafka"] = news_bytes * e["ran"] + e["kafka_scan"]
            rows.append(("embedded", n, e))
            s = run("served", n, grpc, [dict(env)] * n, args.seconds)
            s["rss"] += _rss_mb(srv.pid)
            s["kafka"] = news_bytes + s["kafka_scan"]
            rows.append(("served", n, s))
        over = overhead(config, grpc, http, fab_env("overhead"), args.reps)
    finally:
        srv.terminate()
        srv.wait(20)
        cleanup(env)
    print(f"\nseed bindings (nearby_offers, top_category_last_week), {args.seconds:g} s per row")
    print(
        f"{'mode':<9} {'agents':>6} {'ran':>4} {'memory MB':>10} {'kafka MB':>9} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'queries/s':>10}"
    )
    for mode, n, r in rows:
        print(
            f"{mode:<9} {n:>6} {r['ran']:>4} {r['rss']:>10.0f} {r['kafka'] / 1e6:>9.2f} {r['p50']:>8.2f} "
            f"{r['p99']:>8.2f} {r['qps']:>10.1f}"
        )
    print(
        "\nkafka MB: the news topic once per ingesting fabric "
        f"({news_bytes / 1e6:.2f} MB each) plus the queries' Kafka scans (their stats)"
    )
    print_overhead(over, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
