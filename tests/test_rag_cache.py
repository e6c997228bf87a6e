"""The semantic cache of a binding (``cache:``, fabric/semantic_cache.py), issue 17.

Paraphrase-like vectors (cosine 0.95) hit, unrelated ones (0.5) miss, a source update
(a dataset upsert, an API whose Last-Modified advanced) invalidates, TTL expiry, other
session values differing miss, LRU eviction, an untracked source without a TTL is never
reused; and the binding errors of ``cache:`` are positioned.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import fabric
from dsl.errors import DslError
from dsl.loader import load_text
from tests.rest_api import ENDPOINT, running

DIM = 8
FABRIC = """\
datasets:
  news:
    key: id
    schema: {id: str, symbol: str, body: str, embedding: "vector[8]"}
    indexes: {embedding: {kind: hnsw, metric: cosine}}
bindings: [agents/]
"""


def binding(cache: str, name: str = "ask") -> str:
    return f"""\
binding: {name}
session: {{q: "vector[8]", symbol: str}}
sources:
  n:
    from: dataset://news
    where: n.symbol = {{{{session.symbol}}}}
    nearest: {{column: embedding, to: "{{{{session.q}}}}", k: 5}}
select: [n.id]
cache: {cache}
"""


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v)).astype(np.float32)


def at_cosine(q: np.ndarray, c: float, seed: int) -> np.ndarray:
    """A unit vector with cosine ``c`` to unit ``q``."""
    r = np.random.default_rng(seed).normal(size=q.shape)
    u = unit(r - (r @ q) * q)
    return unit(c * q + np.sqrt(1 - c * c) * u)


def rows(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    vecs = [unit(rng.normal(size=DIM)).tolist() for _ in range(n)]
    return pa.table(
        {
            "id": [f"n{i:03d}" for i in range(n)],
            "symbol": ["ACME" if i % 2 else "INIT" for i in range(n)],
            "body": [f"story {i}" for i in range(n)],
            "embedding": pa.array(vecs, type=pa.list_(pa.float32(), DIM)),
        }
    )


@pytest.fixture
def fab(tmp_path: Path) -> Iterator[Any]:
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(FABRIC)
    (tmp_path / "agents" / "ask.yaml").write_text(
        binding('{by: "{{session.q}}", similarity: 0.92, ttl: {dataset: 1h}}')
    )
    (tmp_path / "agents" / "short.yaml").write_text(
        binding('{by: "{{session.q}}", similarity: 0.92, ttl: {dataset: 300ms}}', "short")
    )
    (tmp_path / "agents" / "small.yaml").write_text(
        binding('{by: "{{session.q}}", similarity: 0.92, max_entries: 2}', "small")
    )
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.dataset("news").upsert(rows(200))
        yield f


Q = unit(np.random.default_rng(42).normal(size=DIM))


def ask(fab: Any, q: np.ndarray, symbol: str = "ACME", name: str = "ask") -> Any:
    return fab.query(name, {"q": q.tolist(), "symbol": symbol})


def test_paraphrase_hits_and_unrelated_misses(fab: Any) -> None:
    first = ask(fab, Q)
    assert first.stats["cache"]["status"] == "miss" and first.stats["cache"]["stored"]
    assert first.stats["sources"]["n"]["rows"] == 5
    near = ask(fab, at_cosine(Q, 0.95, 1))
    c = near.stats["cache"]
    assert c["status"] == "hit" and abs(c["similarity"] - 0.95) < 1e-3, c
    assert near.table.equals(first.table)
    assert near.stats["sources"] == {}  # nothing was read
    far = ask(fab, at_cosine(Q, 0.5, 2))
    assert far.stats["cache"]["status"] == "miss"
    assert far.stats["cache"]["reason"] == "no similar question"
    assert far.stats["sources"]["n"]["rows"] == 5
    m = fab.cache_metrics("ask")
    assert m["hits"] == 1 and m["misses"] == 2 and m["entries"] == 2


def test_other_session_values_differing_miss(fab: Any) -> None:
    ask(fab, Q, "ACME")
    other = ask(fab, Q, "INIT")
    assert other.stats["cache"] == {
        "status": "miss",
        "reason": "other session values differ",
        "stored": True,
    }
    assert set(other.table.column("id").to_pylist()).isdisjoint(
        ask(fab, Q, "ACME").table.column("id").to_pylist()
    )


def test_a_source_update_invalidates(fab: Any) -> None:
    before = ask(fab, Q)
    # a story right at the question's vector arrives: the fresh answer must contain it
    fab.dataset("news").upsert(
        pa.table(
            {
                "id": ["fresh"],
                "symbol": ["ACME"],
                "body": ["breaking"],
                "embedding": pa.array([Q.tolist()], type=pa.list_(pa.float32(), DIM)),
            }
        )
    )
    after = ask(fab, at_cosine(Q, 0.99, 3))
    assert after.stats["cache"]["status"] == "miss"
    assert after.stats["cache"]["reason"] == "source advanced: dataset://news"
    assert "fresh" in after.table.column("id").to_pylist()
    assert "fresh" not in before.table.column("id").to_pylist()
    assert fab.cache_metrics("ask")["invalidations"] == 1


def test_ttl_expiry(fab: Any) -> None:
    ask(fab, Q, name="short")
    assert ask(fab, Q, name="short").stats["cache"]["status"] == "hit"
    time.sleep(0.4)
    res = ask(fab, Q, name="short")
    assert res.stats["cache"]["status"] == "miss"
    assert res.stats["cache"]["reason"] == "expired (ttl 0.3 s for dataset)"


def test_lru_eviction(fab: Any) -> None:
    qs = [unit(np.random.default_rng(s).normal(size=DIM)) for s in (10, 11, 12)]
    for q in qs:
        ask(fab, q, name="small")
    assert fab.cache_metrics("small")["evictions"] == 1
    assert ask(fab, qs[2], name="small").stats["cache"]["status"] == "hit"
    assert ask(fab, qs[0], name="small").stats["cache"]["status"] == "miss"  # evicted


def test_embedded_question_text_keys_the_cache(tmp_path: Path) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(FABRIC)
    (tmp_path / "agents" / "t.yaml").write_text(
        """\
binding: t
session: {question: str, symbol: str}
sources:
  n: {from: dataset://news, where: "n.symbol = {{session.symbol}}"}
select: [n.id]
order_by: [n.id]
limit: 3
cache: {by: "{{embed(session.question)}}", similarity: 0.97, ttl: 1h}
"""
    )
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.dataset("news").upsert(rows(20))
        a = fab.query("t", {"question": "how did ACME open today?", "symbol": "ACME"})
        b = fab.query("t", {"question": "how did ACME open today?", "symbol": "ACME"})
        c = fab.query("t", {"question": "bond yields in Europe", "symbol": "ACME"})
        assert a.stats["cache"]["status"] == "miss" and b.stats["cache"]["status"] == "hit"
        assert b.stats["cache"]["similarity"] >= 0.9999
        assert c.stats["cache"]["status"] == "miss"


REST_FABRIC = """\
connections:
  crm:
    kind: rest
    base_url: "{url}"
    endpoints:
      merchants: {endpoint}
    schemas:
      merchants: {{id: int, name: str, status: str, rating: float, score: int, created_at: timestamp, city: str}}
  mem: {{kind: memory, schemas: {{t: {{id: int}}}}}}
bindings: [agents/]
"""
REST_BINDING = """\
binding: r
session: {{q: "vector[8]", city: str}}
sources:
  m: {{from: rest://crm/merchants, where: "m.city = {{{{session.city}}}}"}}
select: [m.id]
cache: {{by: "{{{{session.q}}}}", similarity: 0.9{ttl}}}
"""


@pytest.mark.parametrize("ttl", ["", ", ttl: {rest: 1h}"], ids=["no_ttl", "ttl"])
def test_an_api_whose_last_modified_advanced_invalidates(tmp_path: Path, ttl: str) -> None:
    import json

    with running() as api:
        (tmp_path / "agents").mkdir()
        (tmp_path / "fabric.yaml").write_text(
            REST_FABRIC.format(url=api.url, endpoint=json.dumps(ENDPOINT))
        )
        (tmp_path / "agents" / "r.yaml").write_text(REST_BINDING.format(ttl=ttl))
        with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab:
            s = {"q": Q.tolist(), "city": "Paris"}
            assert fab.query("r", s).stats["cache"]["status"] == "miss"
            n = len(api.requests("/v1/merchants"))
            hit = fab.query("r", s)
            # the API says (Last-Modified) it has not changed: no TTL is needed to reuse
            assert hit.stats["cache"]["status"] == "hit", hit.stats["cache"]
            assert len(api.requests("/v1/merchants")) - n <= 1  # the probe, no scan
            api.touch()
            api.modified += 2  # Last-Modified has one-second resolution
            time.sleep(0.3)  # past the 0.25 s a response's Last-Modified answers for
            res = fab.query("r", s)
            assert res.stats["cache"]["reason"] == "source advanced: rest://crm/merchants"
            assert res.table.num_rows == 40


def test_an_untracked_source_without_ttl_is_never_reused(tmp_path: Path) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(
        "connections:\n  mem: {kind: memory, schemas: {t: {id: int}}}\nbindings: [agents/]\n"
    )
    (tmp_path / "agents" / "m.yaml").write_text(
        """\
binding: m
session: {q: "vector[8]"}
sources:
  t: {from: memory://mem/t}
select: [t.id]
cache: {by: "{{session.q}}"}
"""
    )
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as fab:
        fab.catalog.connection("mem").add("t", pa.table({"id": [1, 2]}))
        fab.query("m", {"q": Q.tolist()})
        res = fab.query("m", {"q": Q.tolist()})
        assert res.stats["cache"]["status"] == "miss"
        assert res.stats["cache"]["reason"] == "untracked source without ttl: memory://mem/t"


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ('{by: "{{session.question}}"}', "cache by names session.question, which the binding's"),
        ('{by: "{{session.symbol}}"}', "cache by: session.symbol is str, not a vector"),
        ('{by: "{{embed(session.q)}}"}', "embed() takes a str session value; session.q is"),
        ('{by: "session.q"}', "cache by must be a session vector or an embedded session text"),
        ('{by: "{{session.q}}", similarity: 1.5}', "cache similarity must be a number in (0, 1]"),
        ('{by: "{{session.q}}", ttl: {kafka: soon}}', "cache ttl kafka"),
        ('{by: "{{session.q}}", simlarity: 0.9}', "did you mean 'similarity'?"),
        ("{similarity: 0.9}", "cache needs 'by'"),
        ('{by: "{{session.q}}", max_mb: 0}', "cache max_mb must be a positive number"),
        ('{by: "{{session.q}}", prewarm: 3}', "cache prewarm must be the path of a JSON Lines"),
    ],
)
def test_cache_errors_are_positioned(cache: str, expected: str) -> None:
    text = binding(cache)
    with pytest.raises(DslError) as ei:
        load_text(text, "agents/ask.yaml")
    msg = str(ei.value)
    assert expected in msg and "agents/ask.yaml:9:" in msg, msg


def test_prewarm_fills_the_cache_from_representative_sessions(fab: Any) -> None:
    qs = [unit(np.random.default_rng(s).normal(size=DIM)) for s in (20, 21)]
    m = fab.prewarm("ask", [{"q": q.tolist(), "symbol": "ACME"} for q in qs])
    assert m["stored"] == 2 and m["entries"] == 2 and m["hits"] == 0
    res = ask(fab, at_cosine(qs[1], 0.96, 5))
    assert res.stats["cache"]["status"] == "hit"
    assert fab.cache_metrics("ask")["hits"] == 1


def test_max_mb_bounds_the_cache_in_bytes(fab: Any, tmp_path: Path) -> None:
    qs = [unit(np.random.default_rng(s).normal(size=DIM)) for s in (30, 31, 32)]
    ask(fab, qs[0])
    one = fab.cache_metrics("ask")["bytes"]  # one answer of 5 ids, its vector and values
    assert one > 512
    mb = 2.5 * one / (1024 * 1024)  # room for two such answers, not three
    (tmp_path / "agents" / "capped.yaml").write_text(
        binding(f'{{by: "{{{{session.q}}}}", ttl: {{dataset: 1h}}, max_mb: {mb:.9f}}}', "capped")
    )
    (tmp_path / "agents" / "tiny.yaml").write_text(
        binding('{by: "{{session.q}}", ttl: {dataset: 1h}, max_mb: 0.0001}', "tiny")
    )
    fab.bindings.scan()
    for q in qs:
        assert ask(fab, q, name="capped").stats["cache"]["stored"]
    m = fab.cache_metrics("capped")
    assert m["entries"] == 2 and m["evictions"] == 1 and m["bytes"] <= m["max_bytes"], m
    assert m["max_bytes"] == int(mb * 1024 * 1024)
    assert ask(fab, qs[0], name="capped").stats["cache"]["status"] == "miss"  # the oldest
    assert ask(fab, qs[2], name="capped").stats["cache"]["status"] == "hit"
    # an answer larger than the whole bound (105 bytes) is not kept, and says why
    c = ask(fab, qs[0], name="tiny").stats["cache"]
    assert c["stored"] is False and c["not_stored"].startswith("larger than max_mb"), c
    assert fab.cache_metrics("tiny")["entries"] == 0


WARM = binding(
    '{by: "{{session.q}}", similarity: 0.92, ttl: {dataset: 1h}, prewarm: sessions.jsonl}',
    "warm",
)


def _warm_world(tmp_path: Path, sessions: str) -> Path:
    (tmp_path / "agents").mkdir()
    (tmp_path / "fabric.yaml").write_text(FABRIC)
    with fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False) as f:
        f.dataset("news").upsert(rows(200))  # kept in the dataset's checkpoint
    (tmp_path / "agents" / "warm.yaml").write_text(WARM)
    (tmp_path / "agents" / "sessions.jsonl").write_text(sessions)
    return tmp_path / "fabric.yaml"


def test_prewarm_file_is_run_when_the_fabric_opens(tmp_path: Path) -> None:
    import json

    qs = [unit(np.random.default_rng(s).normal(size=DIM)) for s in (40, 41)]
    lines = [json.dumps({"q": q.tolist(), "symbol": "ACME"}) for q in qs]
    path = _warm_world(tmp_path, "\n".join(lines) + "\n\n")
    with fabric.open(path, watch=False, ingest=False) as fab:
        m = fab.cache_metrics("warm")
        assert m["prewarmed"] == 2 and m["stored"] == 2 and m["entries"] == 2, m
        res = fab.query("warm", {"q": at_cosine(qs[1], 0.96, 8).tolist(), "symbol": "ACME"})
        assert res.stats["cache"]["status"] == "hit" and res.table.num_rows == 5


@pytest.mark.parametrize(
    ("sessions", "expected"),
    [
        (None, "agents/warm.yaml:9:"),
        (
            '{"q": [1, 0, 0, 0, 0, 0, 0, 0], "symbol": "ACME"}\n{"q": [1, 0,\n',
            "agents/sessions.jsonl:2:",
        ),
        (
            '["ACME"]\n',
            "agents/sessions.jsonl:1:1: cache prewarm: a line must be a JSON object",
        ),
        (
            '{"symbol": "ACME", "q": "hello"}\n',
            "agents/sessions.jsonl:1:20: cache prewarm: binding 'warm': session value 'q'",
        ),
        (
            '{"q": [1, 0, 0, 0, 0, 0, 0, 0]}\n',
            "agents/sessions.jsonl:1:1: cache prewarm: binding 'warm': session value 'symbol'",
        ),
    ],
    ids=["missing_file", "not_json", "not_an_object", "wrong_type", "missing_value"],
)
def test_prewarm_file_errors_are_positioned(
    tmp_path: Path, sessions: str | None, expected: str
) -> None:
    path = _warm_world(tmp_path, sessions or "")
    if sessions is None:
        (tmp_path / "agents" / "sessions.jsonl").unlink()
    with pytest.raises(DslError) as ei:
        fabric.open(path, watch=False, ingest=False)
    assert expected in str(ei.value), str(ei.value)


def test_cache_series_on_fabric_serve_metrics(tmp_path: Path) -> None:
    """``fabric serve`` prewarms at start-up and exports the caches' counters: after the
    prewarm, a hit, misses, an invalidation (an upsert) and an eviction, /metrics says so."""
    import json
    import os
    import re

    from tests.test_service import Served

    qs = [unit(np.random.default_rng(s).normal(size=DIM)) for s in (50, 51)]
    lines = [json.dumps({"q": q.tolist(), "symbol": "ACME"}) for q in qs]
    path = _warm_world(tmp_path, "\n".join(lines) + "\n")
    (tmp_path / "agents" / "one.yaml").write_text(
        binding('{by: "{{session.q}}", ttl: {dataset: 1h}, max_entries: 1}', "one")
    )
    token = "rag-cache-token-0123456789"
    path.write_text(
        FABRIC + 'agents:\n  a: {token: "${RAG_TOKEN}", bindings: ["*"], datasets: [news]}\n'
    )
    served = Served(path, {**os.environ, "RAG_TOKEN": token})
    try:

        def series(name: str, **labels: str) -> float:
            want = ",".join(f'{k}="{v}"' for k, v in labels.items())
            m = re.search(rf"^{name}\{{{want}\}} (\S+)$", served.metrics(), re.M)
            return float(m[1]) if m else 0.0

        assert series("fabric_cache_stored_total", binding="warm") == 2  # the prewarm
        assert series("fabric_cache_entries", binding="warm") == 2
        assert series("fabric_cache_bytes", binding="warm") > 0
        remote = fabric.connect(served.grpc, token=token)
        s = {"q": at_cosine(qs[0], 0.96, 9).tolist(), "symbol": "ACME"}
        assert remote.query("warm", s).stats["cache"]["status"] == "hit"
        remote.query("warm", {"q": at_cosine(qs[0], 0.3, 10).tolist(), "symbol": "ACME"})
        remote.dataset("news").upsert(rows(1, seed=5))
        assert remote.query("warm", s).stats["cache"]["reason"] == "source advanced: dataset://news"
        for q in qs:
            remote.query("one", {"q": q.tolist(), "symbol": "ACME"})
        assert series("fabric_cache_hits_total", binding="warm") == 1
        # the prewarm's two misses (empty, then no similar question) and the far question
        assert series("fabric_cache_misses_total", binding="warm", reason="empty") == 1
        assert (
            series("fabric_cache_misses_total", binding="warm", reason="no similar question") == 2
        )
        assert series("fabric_cache_misses_total", binding="warm", reason="source advanced") == 1
        assert series("fabric_cache_invalidations_total", binding="warm") == 1
        assert series("fabric_cache_evictions_total", binding="one") == 1
        assert series("fabric_cache_misses_total", binding="one", reason="empty") == 1
    finally:
        served.stop()


@pytest.mark.parametrize("offline", [False, True], ids=["live", "offline"])
@pytest.mark.parametrize(
    ("sessions", "expected"),
    [
        (None, "agents/warm.yaml:9:"),
        ("", "agents/warm.yaml:9:"),  # a directory where the file should be
        ('{"q": [1, 0,\n', "agents/sessions.jsonl:1:"),
        (
            '{"symbol": "ACME", "q": "hello"}\n',
            "agents/sessions.jsonl:1:20: cache prewarm: binding 'warm': session value 'q'",
        ),
    ],
    ids=["missing_file", "unreadable", "not_json", "wrong_type"],
)
def test_validate_reports_a_bad_prewarm_file(
    tmp_path: Path, capsys: Any, offline: bool, sessions: str | None, expected: str
) -> None:
    """``fabric validate`` (live and --offline) and ``fab.validate()`` check each binding's
    ``cache: {prewarm: FILE}`` without running it: a missing or unreadable file at the
    binding's ``prewarm:``, a bad line at its line and column, each with what would fix
    it, next to the other problems (a binding with an unknown column here)."""
    from fabric.cli import main

    path = _warm_world(tmp_path, sessions or "")
    if sessions is None:
        (tmp_path / "agents" / "sessions.jsonl").unlink()
    elif sessions == "":
        (tmp_path / "agents" / "sessions.jsonl").unlink()
        (tmp_path / "agents" / "sessions.jsonl").mkdir()
    (tmp_path / "agents" / "other.yaml").write_text(
        "binding: other\nsources:\n  n: {from: dataset://news}\nselect: [n.nope]\n"
    )
    argv = ["validate", "--config", str(path), *(["--offline"] if offline else [])]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert expected in out, out
    after = out.split(expected, 1)[1]
    assert "hint:" in after.split("agents/other.yaml")[0], out  # what would fix it
    assert "agents/other.yaml:4:" in out, out  # the other binding's problem is reported too
    if not offline:  # the Python API says the same, on an open fabric
        (tmp_path / "agents" / "other.yaml").unlink()
        with fabric.open(path, watch=False, ingest=False, prewarm=False) as fab:
            found = [
                f"{d.span.file}:{d.span.line}:{d.span.col}: {d.message}" for d in fab.validate()
            ]
        assert any(expected.split(": ", 1)[0] in f for f in found), found


def test_validate_does_not_run_the_prewarm_sessions(tmp_path: Path, capsys: Any) -> None:
    """A good prewarm file validates (OK) and is not run by ``fabric validate``."""
    import json

    from fabric.cli import main

    q = unit(np.random.default_rng(40).normal(size=DIM))
    path = _warm_world(tmp_path, json.dumps({"q": q.tolist(), "symbol": "ACME"}) + "\n")
    assert main(["validate", "--config", str(path)]) == 0, capsys.readouterr()
    assert "OK: 1 binding valid" in capsys.readouterr().out
    with fabric.open(path, watch=False, ingest=False, prewarm=False) as fab:
        assert fab.validate() == []
        assert fab.cache_metrics("warm").get("prewarmed", 0) == 0, fab.cache_metrics("warm")
