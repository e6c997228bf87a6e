"""Embeddings computed by the fabric (issue 17): at ingest (``embed:`` of a dataset, for
upserts and Kafka feeds) and of a session value (``{{embed(session.question)}}``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import Producer

import fabric
from dsl.errors import DslError
from fabric.config import load_config
from fabric.datasets import DatasetDecl, DatasetManager
from fabric.embed import NGRAMS, EmbedSpec, embed, hash_embed

DIM = 64
SCHEMA = pa.schema(
    [("id", pa.string()), ("body", pa.string()), ("embedding", pa.list_(pa.float32(), DIM))]
)
WORDS = [
    "fed",
    "rates",
    "inflation",
    "earnings",
    "guidance",
    "merger",
    "bank",
    "bond",
    "yield",
    "oil",
    "gold",
    "chip",
]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))) + f" #{i}" for i in range(n)]


M64 = (1 << 64) - 1


def reference_hash_embed(text: str, dim: int) -> np.ndarray:
    """The hash model written out one n-gram at a time with Python integers (the oracle
    of the vectorized ``hash_embed``)."""

    def mix(h: int) -> int:
        h ^= h >> 30
        h = (h * 0xBF58476D1CE4E5B9) & M64
        h ^= h >> 27
        h = (h * 0x94D049BB133111EB) & M64
        return h ^ (h >> 31)

    b = f" {text.lower()} ".encode()
    v = np.zeros(dim, np.float64)
    for g in NGRAMS:
        for i in range(len(b) - g + 1):
            h = 0
            for c in b[i : i + g]:
                h = (h * 1099511628211 + c) & M64
            h = mix(h ^ ((g * 0x9E3779B97F4A7C15) & M64))
            v[((h >> 33) * dim) >> 31] += -1.0 if h >> 63 else 1.0
    n = np.sqrt(v @ v)
    return (v / (n if n else 1.0)).astype(np.float32)


def vectors(ds) -> tuple[list[str], np.ndarray]:
    t = ds.to_table(["id", "body", "embedding"]).sort_by("id")
    mat = np.asarray(t.column("embedding").to_pylist(), dtype=np.float32)
    return t.column("body").to_pylist(), mat


def test_hash_model_equals_its_reference_and_does_not_depend_on_the_batch() -> None:
    ts = [*texts(40), "", "ab", "Ünïcode — naïve café", "FED Rates"]
    got = hash_embed(ts, DIM)
    want = np.stack([reference_hash_embed(t, DIM) for t in ts])
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(got, np.concatenate([hash_embed(ts[:7], DIM), hash_embed(ts[7:], DIM)]))
    assert np.array_equal(got[-1], hash_embed(["fed rates"], DIM)[0])  # case-folded
    assert not got[-4].any()  # the empty text is the zero vector
    norms = np.linalg.norm(got[:-4], axis=1)
    assert np.allclose(norms, 1.0, atol=1e-6)
    # near texts are near, unrelated ones are not
    a, b, c = hash_embed(["the fed raised rates", "fed raised its rates", "gold miners"], 256)
    assert a @ b > 0.5 > a @ c


def test_upserts_compute_missing_embeddings_equal_to_the_model_offline(tmp_path: Path) -> None:
    decl = DatasetDecl(
        "docs", SCHEMA, "id", {"embedding": "hnsw"}, embed=(EmbedSpec("body", "embedding"),)
    )
    m = DatasetManager([decl], state_dir=tmp_path).open()
    ds = m.dataset("docs")
    ts = texts(300)
    ids = [f"d{i:04d}" for i in range(300)]
    ds.upsert(pa.table({"id": ids[:200], "body": ts[:200]}))  # no embedding column at all
    given = np.full(DIM, 0.125, np.float32)
    emb = pa.array(
        [None if i != 250 else given.tolist() for i in range(200, 300)], pa.list_(pa.float32(), DIM)
    )
    ds.upsert(pa.table({"id": ids[200:], "body": ts[200:], "embedding": emb}))  # nulls + one given
    ds.upsert(pa.table({"id": ["d0003"], "body": ["replaced text"]}))  # an update re-embeds
    ts[3] = "replaced text"
    bodies, mat = vectors(ds)
    assert bodies == ts
    want = hash_embed(ts, DIM)
    want[250] = given  # a row that carries a vector keeps it
    assert np.array_equal(mat, want)
    m.stop(checkpoint_now=False)


def produce(bootstrap: str, topic: str, ts: list[str]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i, t in enumerate(ts):
        p.produce(topic, key=f"k{i:04d}", value=json.dumps({"id": f"k{i:04d}", "body": t}).encode())
    assert p.flush(30) == 0


def test_a_kafka_fed_dataset_embeds_messages_as_they_arrive(
    kafka_bootstrap, new_topic, tmp_path
) -> None:
    topic = new_topic(partitions=2, prefix="embed")
    ts = texts(500, seed=3)
    produce(kafka_bootstrap, topic, ts)
    decl = DatasetDecl(
        "news",
        SCHEMA,
        "id",
        {"embedding": "hnsw"},
        f"kafka://bus/{topic}",
        embed=(EmbedSpec("body", "embedding", "hash"),),
    )
    m = DatasetManager(
        [decl],
        connections={"bus": {"kind": "kafka", "bootstrap": kafka_bootstrap}},
        state_dir=tmp_path,
        checkpoint_interval=0,
    ).start()
    try:
        assert m.wait_caught_up(30)
        bodies, mat = vectors(m.dataset("news"))
        assert bodies == ts and m.ingestors["news"].stats.dead_letters == 0
        assert np.array_equal(mat, hash_embed(ts, DIM))
    finally:
        m.stop()


FABRIC = """\
datasets:
  docs:
    key: id
    schema: {id: str, body: str, embedding: "vector[64]"}
    indexes: {embedding: {kind: hnsw, metric: cosine}}
    embed: {from: body, into: embedding, model: hash}
bindings: [b.yaml]
"""
BINDING = """\
binding: ask
session:
  question: str
sources:
  d:
    from: dataset://docs
    nearest: {column: embedding, to: "{{embed(session.question)}}", k: 10}
select: [d.id]
"""


def test_nearest_to_an_embedded_session_question_equals_brute_force(tmp_path: Path) -> None:
    (tmp_path / "fabric.yaml").write_text(FABRIC)
    (tmp_path / "b.yaml").write_text(BINDING)
    ts = texts(400, seed=7)
    ids = [f"d{i:04d}" for i in range(len(ts))]
    x = hash_embed(ts, DIM)
    with fabric.open(tmp_path / "fabric.yaml", ingest=False, watch=False) as fab:
        fab.dataset("docs").upsert(pa.table({"id": ids, "body": ts}))
        for q in ["fed rates inflation", "oil gold merger bank", "chip earnings guidance"]:
            res = fab.query("ask", session={"question": q})
            qv = hash_embed([q], DIM)[0].astype(np.float64)
            sims = x.astype(np.float64) @ qv / np.linalg.norm(x, axis=1)
            want = [ids[i] for i in np.argsort(-sims, kind="stable")[:10]]
            got = res.table.column(0).to_pylist()
            assert set(got) == set(want), (q, got, want)
        plan = fab.explain("ask")
        assert "embed(" in str(plan)


@pytest.mark.parametrize(
    ("embed", "expected"),
    [
        ("{from: text, into: embedding}", "7:19: embed from column 'text' is not in the schema"),
        ("{from: body, into: emb}", "embed into column 'emb' is not in the schema"),
        ("{from: n, into: embedding}", "embed from column 'n' is int; it must be str"),
        ("{from: body, into: body}", "embed into column 'body' is str; it must be vector[N]"),
        ("{from: body, into: embedding, model: hsah}", "unknown embedding model 'hsah'"),
        ("{from: body}", "embed needs 'into"),
        ("{from: body, into: embedding, modle: hash}", "did you mean 'model'?"),
        (
            "[{from: body, into: embedding}, {from: body, into: embedding}]",
            "column 'embedding' is already computed by another embed",
        ),
        ("body", "embed must be a mapping"),
    ],
)
def test_embed_config_errors_are_positioned(embed: str, expected: str, tmp_path: Path) -> None:
    p = tmp_path / "fabric.yaml"
    p.write_text(
        "datasets:\n  docs:\n    key: id\n"
        '    schema: {id: str, n: int, body: str, embedding: "vector[8]"}\n'
        "    indexes: {embedding: hnsw}\n"
        "\n"
        f"    embed: {embed}\n"
    )
    with pytest.raises(DslError) as ei:
        load_config(p, env={})
    msg = str(ei.value)
    assert expected in msg and "fabric.yaml:7:" in msg, msg


def test_embed_config_is_read_and_a_list_is_allowed(tmp_path: Path) -> None:
    p = tmp_path / "fabric.yaml"
    p.write_text(
        "datasets:\n  docs:\n    key: id\n"
        '    schema: {id: str, body: str, title: str, e1: "vector[8]", e2: "vector[4]"}\n'
        "    embed: [{from: body, into: e1}, {from: title, into: e2, model: 'mod:fn'}]\n"
    )
    d = load_config(p, env={}).datasets["docs"]
    assert [(e.source, e.into, e.model) for e in d.embed] == [
        ("body", "e1", "hash"),
        ("title", "e2", "mod:fn"),
    ]


def test_a_python_callable_model_by_dotted_path(tmp_path: Path) -> None:
    ts = texts(10)
    got = embed(ts, DIM, "tests.test_embed:double_hash")
    assert np.array_equal(got, 2 * hash_embed(ts, DIM))
    with pytest.raises(ValueError, match="returned shape"):
        embed(ts, 8, "tests.test_embed:double_hash")


def double_hash(ts: list[str]) -> np.ndarray:
    return 2 * hash_embed(ts, DIM)


@pytest.mark.parametrize(
    ("session", "to", "expected"),
    [
        ("question: int", "{{embed(session.question)}}", "embed() needs text; session value"),
        ("question: str", "{{embed(session.other)}}", "unknown session value 'other' in embed()"),
    ],
)
def test_embed_of_a_session_value_errors_are_positioned(
    session: str, to: str, expected: str, tmp_path: Path
) -> None:
    (tmp_path / "fabric.yaml").write_text(FABRIC)
    (tmp_path / "b.yaml").write_text(
        BINDING.replace("question: str", session).replace("{{embed(session.question)}}", to)
    )
    with (
        fabric.open(tmp_path / "fabric.yaml", ingest=False, watch=False) as fab,
        pytest.raises(DslError) as ei,
    ):
        fab.binding("ask")
    msg = str(ei.value)
    assert expected in msg and "b.yaml:7:" in msg, msg


def test_a_refreshed_dataset_embeds_the_rows_it_reads(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    ts = texts(120, seed=11)
    ids = [f"r{i:04d}" for i in range(len(ts))]
    pq.write_table(pa.table({"id": ids, "body": ts}), data / "docs.parquet")
    (tmp_path / "fabric.yaml").write_text(
        f"connections:\n  files: {{kind: file, root: {data}}}\n"
        "datasets:\n  docs:\n    from: file://files/docs.parquet\n    key: id\n"
        '    schema: {id: str, body: str, embedding: "vector[64]"}\n'
        "    indexes: {embedding: hnsw}\n"
        "    embed: {from: body, into: embedding}\n"
    )
    with fabric.open(tmp_path / "fabric.yaml", watch=False) as fab:
        bodies, mat = vectors(fab.dataset("docs"))
        assert bodies == ts and np.array_equal(mat, hash_embed(ts, DIM))
        ts[5] = "a changed text"
        pq.write_table(pa.table({"id": ids, "body": ts}), data / "docs.parquet")
        fab.refresh("docs")
        bodies, mat = vectors(fab.dataset("docs"))
        assert bodies == ts and np.array_equal(mat, hash_embed(ts, DIM))


def test_the_text_form_embeds_a_session_question_too(tmp_path: Path) -> None:
    (tmp_path / "fabric.yaml").write_text(FABRIC)
    (tmp_path / "b.yaml").write_text(BINDING)
    ts = texts(200, seed=5)
    with fabric.open(tmp_path / "fabric.yaml", ingest=False, watch=False) as fab:
        fab.dataset("docs").upsert(pa.table({"id": [f"t{i}" for i in range(200)], "body": ts}))
        q = {"question": "bank bond yield"}
        text = fab.query_text(
            "from dataset://docs as d nearest embedding to {{embed(session.question)}} k 10 "
            "select d.id",
            session=q,
        )
        assert text.table.column(0).to_pylist() == fab.query("ask", q).table.column(0).to_pylist()
