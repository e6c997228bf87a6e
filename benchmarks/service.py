"""One fabric for many agents, measured: N agent processes querying the seed bindings,
(a) each with its own embedded fabric, (b) all through one ``fabric serve`` (Flight).

    python benchmarks/service.py                  # 1, 4 and 16 agents, 5 s each
    python benchmarks/service.py --agents 1 4 --seconds 3

Per row: memory in total (RSS of every agent process, plus the server's in (b)), Kafka
bytes consumed in total (the news topic once per fabric that ingests it, plus what the
queries' Kafka scans read, from their stats), p50/p99 latency, throughput. Then the
remote overhead per query over embedded, interleaved in one process, for a 10-row
result (goal: < 1 ms on loopback via Flight), through Flight and through HTTP JSON: from
MariaDB and from the in-process news dataset (no database time), with the bare Flight
round trip as the floor.

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


def overhead(
    config: Path, grpc: str, http_url: str, env: dict[str, str], reps: int
) -> list[dict[str, Any]]:
    """Per query of ``OVERHEAD_QUERIES``: the same 10-row query embedded, through Flight
    (``fabric.connect``) and through HTTP JSON (``POST /v1/query_text`` on one kept-alive
    connection), interleaved in one process (the order rotates every repetition), with the
    Flight round trip of a call that runs no query (``list_actions``): the floor. Per path
    the p50 and the p50 of the paired differences with the embedded run next to it."""
    import http.client
    import json
    import urllib.parse

    os.environ.update(env)
    import fabric  # the client first: fabric.connect starts pyarrow's gRPC as it serves

    fab = fabric.open(config)  # ingesting, so dataset://news holds the topic as served
    fab.catch_up(60)
    remote = fabric.connect(grpc, token=TOKEN)
    import pyarrow.flight as fl

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

    out = []
    for name, text in OVERHEAD_QUERIES.items():
        body = json.dumps({"text": text}).encode()
        calls = {
            "embedded": lambda text=text: fab.query_text(text).table.num_rows,
            "flight": lambda text=text: remote.query_text(text).table.num_rows,
            "http": lambda body=body: over_http(body),
            "rtt": lambda: len(list(client.list_actions(options=opts))),
        }
        for kind in ("embedded", "flight", "http"):
            assert calls[kind]() == 10, (name, kind)
        for _ in range(20):  # warm: compile, connect
            for fn in calls.values():
                fn()
        times: dict[str, list[float]] = {k: [] for k in calls}
        order = list(calls)
        for i in range(reps):
            for kind in order[i % 4 :] + order[: i % 4]:
                t0 = time.perf_counter()
                calls[kind]()
                times[kind].append(time.perf_counter() - t0)
        ms = 1000.0
        row: dict[str, Any] = {"query": name}
        for kind, t in times.items():
            row[kind] = statistics.median(t) * ms
        for kind in ("flight", "http"):
            pairs = zip(times[kind], times["embedded"])
            row[f"{kind}_over"] = statistics.median(r - e for r, e in pairs) * ms
        out.append(row)
    conn.close()
    remote.close()
    fab.close()
    return out


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
    print(
        f"\n10-row queries, {args.reps} reps interleaved embedded / Flight / HTTP JSON in one "
        f"process (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    print(
        f"{'query':<8} {'embedded':>9} {'flight':>9} {'http':>9} {'flight/emb':>10} "
        f"{'http/emb':>9} {'flight over':>11} {'http over':>10} {'flight rtt':>10}"
    )
    for o in over:
        print(
            f"{o['query']:<8} {o['embedded']:>9.3f} {o['flight']:>9.3f} {o['http']:>9.3f} "
            f"{o['flight'] / o['embedded']:>10.2f} {o['http'] / o['embedded']:>9.2f} "
            f"{o['flight_over']:>11.3f} {o['http_over']:>10.3f} {o['rtt']:>10.3f}"
        )
    print(
        "p50 in ms; over: the median of the paired differences with the embedded run next to "
        "it (goal for flight < 1 ms); flight rtt: a Flight call that runs no query "
        "(list_actions), the floor of any remote call"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
