"""fabric.yaml: strict parsing into dataclasses, env substitution, positioned errors."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dsl.errors import DslError
from fabric.config import load_config

FULL = """\
connections:
  shop: {kind: mysql, url: "mysql+pymysql://fabric:${SHOP_PASSWORD}@127.0.0.1:3306/shop"}
  crm:
    kind: mongo
    url: "mongodb://127.0.0.1:27017"
    database: crm
    schemas:
      coupons: {merchant_id: int, code: str, discount: float, tags: "list[str]"}
  lake: {kind: s3, endpoint: "http://127.0.0.1:8333", bucket: lake,
         access_key: "${S3_ACCESS_KEY}", secret_key: "${S3_SECRET_KEY:-dev}"}
  bus:  {kind: kafka, bootstrap: "127.0.0.1:9092"}
datasets:
  news:
    from: kafka://bus/news
    key: id
    schema:
      id: str
      published_at: timestamp
      symbol: str
      body: str
      embedding: vector[384]
    indexes: {embedding: hnsw, published_at: btree, body: inverted}
  docs:
    schema: {id: int, embedding: "vector[8]"}
    indexes: {embedding: {kind: hnsw, metric: l2, M: 32, ef_construction: 100, ef: 50}}
bindings: [agents/, "more/*.yaml"]
signals:
  stale_when: {lag_messages: 1000, lag_seconds: 30}
  heartbeat: 5s
  targets: ["udp://127.0.0.1:9999", "http://127.0.0.1:8080/fabric-signals"]
  sources: {"kafka://bus/news": {lag_messages: 100}}
crypto: {public_context: agent.pub}
sandbox: {cpu_seconds: 1, wall_seconds: 3s, memory_mb: 256, allowed_imports: [re, json]}
"""
ENV = {"SHOP_PASSWORD": "pw", "S3_ACCESS_KEY": "ak"}


def _load(text: str, tmp_path: Path, env=ENV):
    p = tmp_path / "fabric.yaml"
    p.write_text(text)
    return load_config(p, env=env)


def test_full_config(tmp_path: Path) -> None:
    cfg = _load(FULL, tmp_path)
    assert cfg.connections["shop"].options["url"] == "mysql+pymysql://fabric:pw@127.0.0.1:3306/shop"
    assert cfg.connections["shop"].kind == "mysql"
    assert cfg.connections["lake"].options["secret_key"] == "dev"
    assert cfg.connections["crm"].schemas["coupons"].field("tags").type == pa.list_(pa.string())
    news = cfg.datasets["news"]
    assert news.from_uri == "kafka://bus/news" and news.key == "id"
    assert news.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert news.schema.field("published_at").type == pa.timestamp("us", tz="UTC")
    assert [(i.column, i.kind) for i in news.indexes] == [
        ("embedding", "hnsw"),
        ("published_at", "btree"),
        ("body", "inverted"),
    ]
    assert news.index("embedding").metric == "cosine"
    docs = cfg.datasets["docs"]
    assert docs.from_uri is None
    assert docs.index("embedding").options == {
        "metric": "l2",
        "M": 32,
        "ef_construction": 100,
        "ef": 50,
    }
    assert cfg.signals.heartbeat_seconds == 5.0
    assert cfg.signals.threshold("kafka://bus/news").lag_messages == 100
    assert cfg.signals.threshold("kafka://bus/other").lag_messages == 1000
    assert cfg.signals.targets[0] == "udp://127.0.0.1:9999"
    assert cfg.crypto.public_context == tmp_path.resolve() / "agent.pub"
    assert cfg.sandbox.wall_seconds == 3.0 and cfg.sandbox.allowed_imports == ("re", "json")


def test_binding_files_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "agents" / "sub").mkdir(parents=True)
    (tmp_path / "more").mkdir()
    (tmp_path / "agents" / "a.yaml").write_text("binding: a\n")
    (tmp_path / "agents" / "sub" / "b.yml").write_text("binding: b\n")
    (tmp_path / "agents" / "notes.txt").write_text("not a binding")
    (tmp_path / "more" / "c.yaml").write_text("binding: c\n")
    cfg = _load(FULL, tmp_path)
    names = sorted(p.name for p in cfg.binding_files())
    assert names == ["a.yaml", "b.yml", "c.yaml"]


def _error(text: str, tmp_path: Path, env=ENV) -> str:
    with pytest.raises(DslError) as info:
        _load(text, tmp_path, env)
    assert all(d.span is not None for d in info.value.diagnostics)
    return info.value.format()


def test_missing_env_variable_is_named_with_its_position(tmp_path: Path) -> None:
    msg = _error(FULL, tmp_path, env={"SHOP_PASSWORD": "pw"})
    assert "fabric.yaml:10:22:" in msg and "environment variable S3_ACCESS_KEY is not set" in msg
    assert "export S3_ACCESS_KEY=" in msg


def test_unknown_keys_with_did_you_mean(tmp_path: Path) -> None:
    msg = _error("conections: {}\n", tmp_path)
    assert "fabric.yaml:1:1: unknown key 'conections' in fabric.yaml" in msg
    assert "did you mean 'connections'?" in msg
    msg = _error("connections:\n  shop: {kind: mysql, uri: x}\n", tmp_path)
    assert (
        "2:23: unknown key 'uri' in connection 'shop' (mysql)" in msg
        and "did you mean 'url'?" in msg
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("connections:\n  shop: {kind: mysq}\n", "2:16: unknown connection kind 'mysq'"),
        ("connections:\n  shop: {url: x}\n", "connection 'shop' needs 'kind'"),
        ("datasets:\n  d: {schema: {id: integer2}}\n", "unknown type 'integer2'"),
        ("datasets:\n  d: {schema: {v: vector}}\n", "type 'vector' needs a positive size"),
        (
            "datasets:\n  d: {schema: {id: int}, indexes: {idx: btree}}\n",
            "index on unknown column 'idx'",
        ),
        (
            "datasets:\n  d: {schema: {id: int}, indexes: {id: hnsw}}\n",
            "hnsw index needs a vector[N] column; 'id' is int",
        ),
        (
            "datasets:\n  d: {schema: {id: int}, indexes: {id: bitmap}}\n",
            "unknown index kind 'bitmap'",
        ),
        (
            "datasets:\n  d: {schema: {id: int}, key: uid}\n",
            "key column 'uid' is not in the schema",
        ),
        (
            "datasets:\n  d: {from: kafka://nobus/t, schema: {id: int}}\n",
            "unknown connection 'nobus' in dataset 'd'",
        ),
        (
            "datasets:\n  d: {from: kafka:/bad, schema: {id: int}}\n",
            "malformed source 'kafka:/bad'",
        ),
        ("datasets:\n  d: {schema: {v: 'encrypted[3]'}}\n", "encrypted[N] is a session type"),
        ("signals: {heartbeat: often}\n", "heartbeat must be a duration"),
        ("signals: {targets: ['tcp://x:1']}\n", "signal target must be udp://host:port"),
        ("signals: {stale_when: {lag_msgs: 5}}\n", "did you mean 'lag_messages'?"),
        ("sandbox: {memory_mb: 0}\n", "memory_mb must be an integer >= 1"),
        ("bindings: [1]\n", "bindings must list directories, globs or files"),
        ("connections: [a]\n", "connections must be a mapping"),
    ],
)
def test_config_errors(text: str, expected: str, tmp_path: Path) -> None:
    assert expected in _error(text, tmp_path)


def test_every_problem_is_reported(tmp_path: Path) -> None:
    msg = _error(
        "conections: {}\nsignals: {heartbeat: often}\ndatasets:\n  d: {schema: {id: integr}}\n",
        tmp_path,
    )
    assert "conections" in msg and "heartbeat" in msg and "integr" in msg


def test_config_from_dict_and_empty() -> None:
    cfg = load_config({"connections": {"mem": {"kind": "memory", "schemas": {"t": {"a": "int"}}}}})
    assert cfg.connections["mem"].schemas["t"].names == ["a"]
    assert load_config(None).connections == {}


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 10_000),
    st.integers(0, 4),
    st.sampled_from(["", " ", "x", ":", "{", "}", "'", "\n", "-", "[", "\t", "${", "$", ",", "#"]),
)
def test_fuzz_mutated_config_yields_config_or_positioned_error(
    pos: int, delete: int, insert: str
) -> None:
    i = pos % (len(FULL) + 1)
    text = FULL[:i] + insert + FULL[i + delete :]
    try:
        load_config(text, env=ENV)
    except DslError as e:
        assert e.diagnostics and all(d.span is not None for d in e.diagnostics), e.format()
