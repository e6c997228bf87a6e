"""fabric.tracing: spans per query and per plan operator, redaction of session values,
the bounded ring buffer, and OTLP/HTTP export received by a real receiver."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from fixtures.optimizer import scenario_data as sd

import fabric
from connectors.base import Pushdown, ScanRequest, Source, SourceError
from dsl.errors import DslError
from dsl.loader import load_text
from fabric.config import load_config
from fabric.execute import execute
from fabric.execute.local import LocalCatalog
from fabric.optimizer import optimize
from fabric.plan.builder import build
from fabric.tracing import Tracer, TracingConfig, session
from tests.servers import TopicFactory

SECRET = "tok-Zq8Xw31-secret"

CONFIG = """\
connections:
  shop:
    kind: memory
    schemas:
      merchants: {id: int, name: str, tier: str}
      orders: {id: int, merchant_id: int, amount: float, note: str}
bindings: [agents/]
tracing:
  redact: [api_key]
  record: [tier]
  ring_spans: RING
  prices:
    connections: {shop: {call: 0.5, row: 0.01, mib: 2.0}}
"""

BINDING = """\
binding: b
session: {min: float, api_key: str, tier: str, note: str}
sources:
  o:
    from: memory://shop/orders
    where: amount > {{session.min}} and note != {{session.note}} and note != {{session.api_key}}
  m:
    from: memory://shop/merchants
    join: m.id = o.merchant_id
    where: m.tier = {{session.tier}}
select: [m.name, sum(o.amount) as total, count(*) as n]
group_by: [m.name]
order_by: [m.name]
"""

MERCHANTS = pa.table(
    {"id": [1, 2, 3], "name": ["a", "b", "c"], "tier": ["premium", "basic", "premium"]}
)
ORDERS = pa.table(
    {
        "id": [1, 2, 3, 4],
        "merchant_id": [1, 2, 3, 1],
        "amount": [1.0, 5.0, 7.0, 9.0],
        "note": ["x", "y", "z", "w"],
    }
)
VALUES = {"min": 2.0, "api_key": SECRET, "tier": "premium", "note": SECRET + "-note"}


def _fab(tmp_path: Path, ring: int = 10_000, extra: str = "") -> Any:
    (tmp_path / "agents").mkdir(exist_ok=True)
    (tmp_path / "fabric.yaml").write_text(CONFIG.replace("RING", str(ring)) + extra)
    (tmp_path / "agents" / "b.yaml").write_text(BINDING)
    f = fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False)
    f.catalog.connection("shop").add("merchants", MERCHANTS)
    f.catalog.connection("shop").add("orders", ORDERS)
    f.catalog.refresh()
    return f


@pytest.fixture
def fab(tmp_path: Path):
    f = _fab(tmp_path)
    yield f
    f.close()


def _by_name(spans: list[Any]) -> dict[str, Any]:
    return {s.name: s for s in spans}


def test_a_query_and_its_operators_are_spans(fab) -> None:
    res = fab.query("b", VALUES, session_id="conv-1")
    assert res.to_pylist() == [
        {"name": "a", "total": 9.0, "n": 1},
        {"name": "c", "total": 7.0, "n": 1},
    ]
    fab.tracer.flush()
    spans = fab.tracer.spans()
    q = _by_name(spans)["query b"]
    a = q.attributes
    assert a["fabric.binding"] == "b"
    assert a["fabric.binding.version"] == fab.binding("b").content_hash
    assert a["fabric.session.id"] == "conv-1"
    assert a["fabric.rows"] == 2
    assert a["fabric.rows_fetched"] == res.rows_fetched
    assert a["fabric.bytes_fetched"] == res.stats["bytes_fetched"]
    assert "Scan: o <- memory://shop/orders" in a["fabric.plan"]
    scans = {s.name[5:]: s for s in spans if s.name.startswith("Scan ")}
    assert set(scans) == {"o", "m"}
    for alias, s in scans.items():
        assert s.parent is not None and s.context.trace_id == q.context.trace_id
        src = res.stats["sources"][alias]
        assert s.attributes["fabric.source.rows"] == src["rows"]
        assert s.attributes["fabric.source.bytes"] == src["bytes"]
        assert s.attributes["fabric.source.connection"] == "shop"
        assert q.start_time <= s.start_time <= s.end_time <= q.end_time
    assert scans["m"].attributes["fabric.pushdown.exact"] == ("tier = {{session.tier}}",)
    # data cost: 2 calls x 0.5 + rows x 0.01 + MiB x 2.0
    rows, nbytes = res.rows_fetched, res.stats["bytes_fetched"]
    price = 2 * 0.5 + rows * 0.01 + nbytes / 2**20 * 2.0
    assert a["fabric.cost.source_calls"] == 2
    assert a["fabric.cost.price"] == pytest.approx(price)
    book = fab.tracer.costs.session("conv-1")
    assert book["total"]["sources"]["shop"] == {
        "rows": rows,
        "bytes": nbytes,
        "calls": 2,
        "price": pytest.approx(price),
    }


def _explain_rows(text: str) -> dict[str, int]:
    """operator header -> rows=N of an explain(analyze=True) text."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:pyarrow |duckdb )?(.*?)\s+\[rows=(\d+)", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def test_operator_rows_are_what_explain_analyze_shows(fab) -> None:
    text = fab.explain("b", VALUES, analyze=True, session_id="conv-2")
    fab.query("b", VALUES, session_id="conv-2")
    fab.tracer.flush()
    want = _explain_rows(text)
    assert len(want) >= 4, text
    queries = [s for s in fab.tracer.spans() if s.name == "query b"]
    assert [q.attributes["fabric.analyze"] for q in queries] == [True, False]
    for q in queries:
        ops = [
            s
            for s in fab.tracer.spans()
            if s.context.trace_id == q.context.trace_id and "fabric.op" in s.attributes
        ]
        got = {s.attributes["fabric.op"]: s.attributes.get("fabric.rows") for s in ops}
        for header, rows in want.items():
            if q.attributes["fabric.analyze"] or got.get(header) is not None:
                assert got[header] == rows, (header, got, text)


def test_session_values_are_hashed_or_redacted_everywhere(fab) -> None:
    with session("conv-3"):
        fab.query("b", VALUES)
    fab.tracer.flush()
    spans = fab.tracer.spans()
    q = _by_name(spans)["query b"]
    a = q.attributes
    assert a["fabric.session.id"] == "conv-3"  # from the context
    assert a["fabric.session.value.api_key"] == "[redacted]"
    assert a["fabric.session.value.tier"] == "premium"  # record: in clear
    assert a["fabric.session.value.note"].startswith("hmac:")  # the default: a keyed hash
    assert a["fabric.session.value.min"].startswith("hmac:")
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    wire = encode_spans(spans).SerializeToString()
    text = "\n".join(s.to_json() for s in spans)
    for secret in (SECRET, SECRET + "-note"):
        assert secret not in text and secret.encode() not in wire
    assert "premium" in text


class _EchoingSource(Source):
    """A source whose server error echoes the bound values (as some drivers do)."""

    def schema(self) -> pa.Schema:
        return pa.schema([("k", pa.string()), ("v", pa.int64())])

    def supports_filter(self, expr: Any) -> Pushdown:
        return Pushdown.EXACT

    def scan(self, request: ScanRequest) -> Any:
        raise SourceError(self.uri, f"server rejected the query with values {request.params}")


def test_a_failed_query_is_a_span_with_its_error_redacted(tmp_path: Path) -> None:
    (tmp_path / "e.yaml").write_text(
        "binding: e\nsession: {key: str}\nsources:\n  d:\n    from: dataset://echo\n"
        "    where: k = {{session.key}}\nselect: [d.v]\n"
    )
    cfg = {"bindings": [str(tmp_path)], "tracing": {"redact": ["key"]}}
    src = _EchoingSource("dataset://echo")
    with fabric.open(cfg, ingest=False, watch=False, dataset_sources={"echo": src}) as f:
        with pytest.raises(Exception) as err:
            f.query("e", {"key": SECRET}, session_id="conv-err")
        assert SECRET in str(err.value)  # the caller's own error is unchanged
        f.tracer.flush()
        q = _by_name(f.tracer.spans())["query e"]
        assert q.status.status_code.name == "ERROR"
        assert q.attributes["fabric.session.id"] == "conv-err"
        assert "server rejected" in q.attributes["fabric.error"]
        assert "[redacted]" in q.attributes["fabric.error"]
        assert SECRET not in q.to_json() and SECRET not in q.status.description
        assert f.tracer.costs.session("conv-err")["total"]["errors"] == 1


def test_the_ring_buffer_is_bounded(tmp_path: Path) -> None:
    f = _fab(tmp_path, ring=25)
    try:
        for i in range(12):
            f.query("b", VALUES, session_id=f"s{i}")
        f.tracer.flush()
        spans = f.tracer.spans()
        assert len(spans) == 25
        assert f.tracer.ring.dropped > 0
        sessions = {s.attributes.get("fabric.session.id") for s in spans} - {None}
        assert "s11" in sessions and "s0" not in sessions  # the oldest went first
        assert f.tracer.costs.session("s0")["total"]["queries"] == 1  # cost outlives spans
    finally:
        f.close()


def test_tracing_off_records_nothing(tmp_path: Path) -> None:
    f = _fab(tmp_path, extra="")
    f.close()
    (tmp_path / "fabric.yaml").write_text(
        CONFIG.replace("RING", "10").replace("tracing:\n", "tracing:\n  enabled: false\n")
    )
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.catalog.connection("shop").add("merchants", MERCHANTS)
        f.catalog.connection("shop").add("orders", ORDERS)
        f.catalog.refresh()
        assert f.tracer is None and f.catalog.tracer is None
        assert len(f.query("b", VALUES)) == 2


def test_vector_session_values_are_hashed_from_their_buffers_and_recorded_lazily(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 128-d vector is hashed from its bytes (its numpy repr cost 2-4 ms of the GIL per
    query), equal vectors match and different ones do not; runs wait in the tracer until
    something reads the spans, so no thread builds spans while queries run."""
    import numpy as np

    from fabric.tracing.tracer import Redactor

    red = Redactor(TracingConfig(), b"k" * 32)
    v = np.arange(128, dtype=np.float32)
    assert red.value("q", v) == red.value("q", v.copy())
    assert red.value("q", v) != red.value("q", v + 1e-6)
    assert red.value("q", v) != red.value("q", v.astype(np.float64))  # dtype counts
    as_list = [float(x) for x in v]
    assert red.value("q", as_list) == red.value("q", list(as_list))
    assert red.value("q", as_list) != red.value("q", [*as_list[:-1], 0.5])
    assert red.value("q", ["a", "b"]).startswith("hmac:")

    import fabric.tracing.tracer as tracer_mod

    monkeypatch.setattr(tracer_mod, "IDLE_S", 60.0)  # the idle drain must not run mid-test
    tracer = Tracer(TracingConfig())
    try:
        for i in range(3):
            tracer._put(("signal", {"event": "data_stale", "source": f"s{i}"}, 1))
        assert len(tracer.ring) == 0 and len(tracer._pending) == 3  # nothing built yet
        names = [sp.name for sp in tracer.spans()]  # reading records what waits, in order
        assert names == [f"signal data_stale s{i}" for i in range(3)]
        assert len(tracer._pending) == 0
    finally:
        tracer.close()


def test_tracing_config_errors_are_positioned() -> None:
    with pytest.raises(DslError) as e:
        load_config("connections: {shop: {kind: memory}}\ntracing: {ring_span: 10}\n")
    assert "ring_span" in str(e.value) and ":2:" in str(e.value)
    with pytest.raises(DslError) as e:
        load_config(
            "connections: {shop: {kind: memory}}\n"
            "tracing:\n  prices:\n    connections: {shp: {call: 1}}\n"
        )
    assert "shp" in str(e.value) and "did you mean 'shop'" in str(e.value)
    with pytest.raises(DslError) as e:
        load_config("tracing: {session_values: clear}\n")
    assert "hash or redact" in str(e.value)
    with pytest.raises(DslError) as e:
        load_config("tracing: {otlp_endpoint: 'localhost:4318'}\n")
    assert "http(s) URL" in str(e.value)


# ---------------------------------------------------------------- OTLP/HTTP receiver


class _Receiver:
    """A real OTLP/HTTP receiver: decodes ExportTraceServiceRequest protobufs."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.requests: list[Any] = []
        self.paths: list[str] = []
        got = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                got.requests.append(req)
                got.paths.append(self.path)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, dict[str, Any], str]]:
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        attrs = {a.key: _any(a.value) for a in sp.attributes}
                        out.append((sp.name, attrs, service.get("service.name", "")))
        return out

    def close(self) -> None:
        self.server.shutdown()


def _any(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any(x) for x in v.array_value.values]
    return getattr(v, kind)


def test_otlp_http_export_round_trips(tmp_path: Path) -> None:
    rx = _Receiver()
    try:
        f = _fab(
            tmp_path,
            extra=f"  otlp_endpoint: {rx.url}\n  service_name: fabric-under-test\n",
        )
        try:
            res = f.query("b", VALUES, session_id="conv-otlp")
            assert f.tracer.flush()
        finally:
            f.close()
        got = rx.spans()
        assert rx.paths and set(rx.paths) == {"/v1/traces"}
        names = sorted(n for n, _, _ in got)
        local = sorted(s.name for s in f.tracer.spans())
        assert names == local and "query b" in names and "Scan o" in names
        q = next(a for n, a, _ in got if n == "query b")
        assert q["fabric.session.id"] == "conv-otlp"
        assert q["fabric.binding"] == "b"
        assert q["fabric.rows"] == len(res)
        assert q["fabric.session.value.api_key"] == "[redacted]"
        assert {svc for _, _, svc in got} == {"fabric-under-test"}
        scan = next(a for n, a, _ in got if n == "Scan o")
        assert scan["fabric.source.rows"] == res.stats["sources"]["o"]["rows"]
        assert scan["fabric.pushdown.exact"]  # a list attribute survives the wire
        blob = json.dumps([a for _, a, _ in got], default=str)
        assert SECRET not in blob
    finally:
        rx.close()


# ---------------------------------------------------------------- the seed scenarios, real servers

SIZES = sd.Sizes.at(0.002, users=12)


@pytest.fixture(scope="module")
def world(mariadb_url, mongo_url, mongo_db, s3, kafka_bootstrap, test_run_id):
    topics = TopicFactory(kafka_bootstrap, test_run_id)
    topic = topics(partitions=1, prefix="trace_locations")
    _, conns = sd.load_world(
        SIZES,
        mariadb_url=mariadb_url,
        mongo_url=mongo_url,
        mongo_db=mongo_db.name,
        s3=s3,
        kafka_bootstrap=kafka_bootstrap,
        topic=topic,
    )
    tracer = Tracer(TracingConfig(redact=("user_id",)))
    cat = LocalCatalog(conns, tracer=tracer)
    yield cat, topic
    tracer.close()
    for c in conns.values():
        c.close()
    topics.cleanup()


@pytest.mark.parametrize("scenario", ["nearby_offers", "top_category_last_week"])
def test_seed_scenario_spans_hold_what_the_plan_did(world, scenario) -> None:
    cat, topic = world
    text = sd.NEARBY_OFFERS.format(topic=topic) if scenario == "nearby_offers" else sd.TOP_CATEGORY
    plan = optimize(build(load_text(text, "scenario.yaml")[0], cat), cat)
    user = 3
    analyzed = execute(
        plan, {"user_id": user}, cat, binding=scenario, analyze=True, now=sd.NOW, session_id="seed"
    )
    cat.tracer.flush()
    spans = cat.tracer.spans()
    q = next(s for s in reversed(spans) if s.name == f"query {scenario}")
    assert q.attributes["fabric.analyze"] is True
    assert q.attributes["fabric.session.value.user_id"] == "[redacted]"
    ops = [
        s for s in spans if s.context.trace_id == q.context.trace_id and "fabric.op" in s.attributes
    ]
    want = _explain_rows(analyzed.explain)
    got = {s.attributes["fabric.op"]: s.attributes.get("fabric.rows") for s in ops}
    assert want and all(got[h] == n for h, n in want.items()), (got, analyzed.explain)
    for alias, src in analyzed.stats["sources"].items():
        leaf = next(s for s in ops if s.attributes.get("fabric.source.alias") == alias)
        assert leaf.attributes["fabric.source.rows"] == src["rows"]
        assert leaf.attributes["fabric.source.uri"] == src["uri"]
        f = analyzed.freshness.get(alias)
        if f is not None:
            assert leaf.attributes["fabric.freshness.status"] == f["status"]
    assert q.attributes["fabric.rows_fetched"] == analyzed.rows_fetched


@pytest.mark.slow
def test_fabric_query_exports_its_span_on_exit(tmp_path: Path) -> None:
    """``fabric query --session-id``: the CLI's process exports the query's spans by
    OTLP/HTTP before it exits (closing the fabric flushes the batch processor)."""
    import subprocess
    import sys

    rx = _Receiver()
    try:
        root = tmp_path / "fab"
        subprocess.run(
            [sys.executable, "-m", "fabric", "init", str(root)], check=True, capture_output=True
        )
        cfg = root / "fabric.yaml"
        cfg.write_text(cfg.read_text() + f"tracing: {{otlp_endpoint: '{rx.url}'}}\n")
        out = subprocess.run(
            [
                *(sys.executable, "-m", "fabric", "query", "top_products"),
                *("--session", "min_qty=2", "--session-id", "cli-7", "--format", "json"),
            ],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        q = next(a for n, a, _ in rx.spans() if n == "query top_products")
        assert q["fabric.session.id"] == "cli-7"
        assert q["fabric.rows"] == len(rows)
        assert q["fabric.session.value.min_qty"].startswith("hmac:")
    finally:
        rx.close()


@pytest.mark.slow
def test_sandbox_and_ckks_steps_are_spans_with_their_cost(tmp_path: Path) -> None:
    import crypto

    ring = crypto.KeyRing.generate()
    (tmp_path / "agent.pub").write_bytes(ring.public_context())
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(
        "connections:\n"
        '  risk: {kind: memory, schemas: {policies: {name: str, weights: "vector[3]"}}}\n'
        "bindings: [agents/]\ncrypto: {public_context: agent.pub}\n"
        "tracing: {prices: {sandbox_cpu_second: 10.0, ckks_op: 0.5}}\n"
    )
    (tmp_path / "agents" / "risk.yaml").write_text(
        "binding: risk_check\n"
        'session: {ctx: "encrypted[3]"}\n'
        "sources:\n  p: {from: memory://risk/policies}\n"
        "select:\n  - p.name\n"
        "  - risk: weighted({{session.ctx}}, [0.5, 0.3, 0.2], 0.1)\n"
        "  - score: dot({{session.ctx}}, p.weights)\n"
    )
    (tmp_path / "agents" / "py.yaml").write_text(
        "binding: py\nsources:\n  p: {from: memory://risk/policies}\nselect: [p.name]\n"
        "pushdown:\n  python: |\n    def run(table):\n        return table.slice(0, 1)\n"
    )
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.catalog.connection("risk").add(
            "policies",
            pa.table(
                {
                    "name": ["strict", "lax"],
                    "weights": pa.array(
                        [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], pa.list_(pa.float32(), 3)
                    ),
                }
            ),
        )
        f.catalog.refresh()
        ctx = ring.encrypt([0.7, 0.2, 0.9])
        assert len(f.query("risk_check", {"ctx": ctx}, session_id="s-ckks")) == 2
        assert f.query("py", session_id="s-py").to_pylist() == [{"name": "strict"}]
        f.tracer.flush()
        spans = f.tracer.spans()
        ckks = [s for s in spans if s.name == "EncryptedScore"]
        assert sorted(s.attributes["fabric.ckks.ops"] for s in ckks) == [1, 2]  # shared, per row
        q = next(s for s in spans if s.name == "query risk_check")
        assert q.attributes["fabric.cost.ckks_ops"] == 3
        assert q.attributes["fabric.cost.price"] == pytest.approx(3 * 0.5)
        assert q.attributes["fabric.session.value.ctx"] == "[EncryptedVector]"
        sandbox = next(s for s in spans if s.name == "UserFunction")
        secs = sandbox.attributes["fabric.sandbox.seconds"]
        assert 0 < secs == pytest.approx((sandbox.end_time - sandbox.start_time) / 1e9, rel=0.01)
        assert sandbox.attributes["fabric.rows"] == 1
        cost = f.tracer.costs.session("s-py")["total"]
        assert cost["sandbox_seconds"] == pytest.approx(secs)
        assert cost["price"] == pytest.approx(secs * 10.0)
        blob = b"".join(s.to_json().encode() for s in spans)
        assert (
            ctx.serialize()[-64:] not in blob and ctx.serialize()[-64:].hex().encode() not in blob
        )


def test_a_semantic_cache_hit_is_a_span_and_a_cache_hit(tmp_path: Path) -> None:
    import numpy as np

    dim = 8
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(
        "datasets:\n  news:\n    key: id\n"
        '    schema: {id: str, symbol: str, embedding: "vector[8]"}\n'
        "    indexes: {embedding: {kind: hnsw, metric: cosine}}\n"
        "bindings: [agents/]\n"
        "tracing: {prices: {connections: {news: {call: 1.0}}}}\n"
    )
    (tmp_path / "agents" / "ask.yaml").write_text(
        'binding: ask\nsession: {q: "vector[8]"}\nsources:\n  n:\n    from: dataset://news\n'
        '    nearest: {column: embedding, to: "{{session.q}}", k: 3}\nselect: [n.id]\n'
        'cache: {by: "{{session.q}}", similarity: 0.9, ttl: {dataset: 1h}}\n'
    )
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(50, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    q = vecs[0]
    near = q + 0.01 * rng.normal(size=dim).astype(np.float32)
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.dataset("news").upsert(
            pa.table(
                {
                    "id": [f"n{i}" for i in range(50)],
                    "symbol": ["X"] * 50,
                    "embedding": pa.array(vecs.tolist(), pa.list_(pa.float32(), dim)),
                }
            )
        )
        first = f.query("ask", {"q": q.tolist()}, session_id="rag-1")
        second = f.query("ask", {"q": (near / np.linalg.norm(near)).tolist()}, session_id="rag-1")
        assert first.stats["cache"]["status"] == "miss"
        assert second.stats["cache"]["status"] == "hit"
        tl = f.tracer.timeline("rag-1")
    q1, q2 = tl["queries"]
    assert q1["cost"]["source_calls"] == 1 and q1["cost"]["cache_hits"] == 0
    assert q2["cost"]["source_calls"] == 0 and q2["cost"]["cache_hits"] == 1
    assert q2["rows"] == len(second) and q2["operators"] == []
    total = tl["cost"]["total"]
    assert total["queries"] == 2 and total["cache_hits"] == 1
    assert total["price"] == pytest.approx(1.0)  # the hit fetched nothing: only one call paid
