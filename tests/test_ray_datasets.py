"""Sharded datasets declared in fabric.yaml (``datasets: {x: {shards: N, shard_by: ...}}``).

Config errors are positioned (file:line:col) and name the fix; a fabric with
``executor: ray`` runs each sharded dataset as N shard actors (fabric.ray.shards), serves
it as ``dataset://x`` to bindings, and reports a binding fresh only if every shard it
reads is: a shard whose feed stopped makes the answer stale, naming the shard."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from dsl.errors import DslError
from fabric.config import load_config
from tests import ray_support
from tests.test_ray_shards import SCHEMA, doc, produce

pytestmark = [pytest.mark.ray]

ray_cluster = ray_support.ray_cluster

HEAD = """\
connections:
  bus: {kind: kafka, bootstrap: "127.0.0.1:9092"}
  shop: {kind: mysql, url: "mysql+pymysql://u:p@127.0.0.1:3306/shop"}
datasets:
  docs:
"""


def error_of(body: str, tmp_path) -> str:
    path = tmp_path / "fabric.yaml"
    path.write_text(HEAD + textwrap.indent(textwrap.dedent(body), "    "))
    with pytest.raises(DslError) as info:
        load_config(path)
    assert all(d.span is not None for d in info.value.diagnostics)
    return info.value.format()


SCHEMA_YAML = "schema: {id: str, n: int, vec: 'vector[8]'}\nkey: id\n"


@pytest.mark.parametrize(
    ("body", "where", "says"),
    [
        ("shards: 0\n", "fabric.yaml:8:13", "shards must be an integer >= 1, got 0"),
        ("shards: two\n", "fabric.yaml:8:13", "shards must be an integer >= 1"),
        ("shard_by: key\n", "fabric.yaml:8:5", "add shards: N"),
        (
            "from: kafka://bus/docs\nshards: 2\nshard_by: keys\n",
            "fabric.yaml:10:15",
            "unknown shard_by 'keys'",
        ),
        (
            "from: kafka://bus/docs\nshards: 2\nshard_by: key\n",
            "fabric.yaml:10:15",
            "sharded by partition",
        ),
        ("shards: 2\nshard_by: partition\n", "fabric.yaml:9:15", "use shard_by: key"),
        (  # rows expire by a time (was: refused on shards; ignored locally)
            "shards: 2\nretention: 1h\ntime_column: n\n",
            "fabric.yaml:10:18",
            "time_column 'n' is int64; retention compares it",
        ),
        ("retention: 1h\n", "fabric.yaml:8:5", "retention needs time_column:"),
    ],
)
def test_sharding_config_errors_are_positioned(tmp_path, body, where, says) -> None:
    msg = error_of(SCHEMA_YAML + body, tmp_path)
    assert where + ":" in msg and says in msg, msg


def test_a_sharded_dataset_cannot_follow_a_change_stream(tmp_path) -> None:
    path = tmp_path / "fabric.yaml"
    path.write_text(
        'connections:\n  crm: {kind: mongo, url: "mongodb://127.0.0.1:1", database: crm}\n'
        "datasets:\n  docs:\n"
        + textwrap.indent(
            SCHEMA_YAML + "from: mongo://crm/docs\nrefresh: {mode: changes}\nshards: 2\n", "    "
        )
    )
    with pytest.raises(DslError) as info:
        load_config(path)
    msg = info.value.format()
    assert "fabric.yaml:9:5:" in msg and "cannot follow a change stream" in msg, msg
    assert "mode: full" in msg, msg


def test_shards_parse_with_their_natural_unit(tmp_path) -> None:
    path = tmp_path / "fabric.yaml"
    path.write_text(
        HEAD
        + textwrap.indent(SCHEMA_YAML + "from: kafka://bus/docs\nshards: 4\n", "    ")
        + "  notes:\n"
        + textwrap.indent(SCHEMA_YAML + "shards: 2\n", "    ")
    )
    cfg = load_config(path)
    assert (cfg.datasets["docs"].shards, cfg.datasets["docs"].shard_by) == (4, "partition")
    assert (cfg.datasets["notes"].shards, cfg.datasets["notes"].shard_by) == (2, "key")


def test_shards_need_executor_ray_said_at_the_dataset(tmp_path) -> None:
    import fabric

    path = tmp_path / "fabric.yaml"
    path.write_text("datasets:\n  notes:\n" + textwrap.indent(SCHEMA_YAML + "shards: 2\n", "    "))
    with pytest.raises(DslError) as info:
        fabric.open(str(path), ingest=False, watch=False)
    msg = info.value.format()
    assert "fabric.yaml:5:5:" in msg and "executor: local" in msg and "executor: ray" in msg, msg


BINDING = """\
binding: near
session:
  q: vector[8]
sources:
  d:
    from: dataset://docs
    nearest: {column: vec, to: "{{session.q}}", k: 5}
    freshness: {max_lag_messages: 50, on_stale: flag}
select: [d.id, d.n]
"""


def _fabric_yaml(tmp_path, kafka_bootstrap, topic: str, shards: int) -> str:
    (tmp_path / "agents").mkdir(exist_ok=True)
    (tmp_path / "agents" / "near.yaml").write_text(BINDING)
    path = tmp_path / "fabric.yaml"
    path.write_text(
        f"connections:\n  bus: {{kind: kafka, bootstrap: {json.dumps(kafka_bootstrap)}}}\n"
        "datasets:\n  docs:\n"
        f"    from: kafka://bus/{topic}\n"
        "    schema: {id: str, n: int, vec: 'vector[8]'}\n"
        "    key: id\n"
        "    indexes: {vec: hnsw, n: btree}\n"
        f"    shards: {shards}\n"
        "executor: ray\n"
        "bindings: [agents/]\n"
    )
    return str(path)


@pytest.mark.servers
@pytest.mark.kafka
@pytest.mark.slow
def test_a_kafka_fed_dataset_with_shards_serves_bindings_and_is_fresh_only_if_every_shard_is(
    ray_cluster, kafka_bootstrap, new_topic, tmp_path
) -> None:
    import ray

    import fabric
    from fabric.ray.shards import ShardedDataset

    topic = new_topic(partitions=4, prefix="ray_yaml")
    docs = [doc(i) for i in range(1000)]
    produce(kafka_bootstrap, topic, docs)
    with fabric.open(_fabric_yaml(tmp_path, kafka_bootstrap, topic, 2), watch=False) as fab:
        ds = fab.dataset("docs")
        assert isinstance(ds, ShardedDataset) and ds.n == 2
        assert ds.wait_caught_up(120)
        assert [i["partitions"] for i in ds.info()] == [[0, 2], [1, 3]]
        assert ds.count() == 1000
        q = np.asarray(docs[7]["vec"], np.float32)
        res = fab.query("near", session={"q": q})
        assert res.table.column("id")[0].as_py() == "k7"
        assert res.freshness["d"]["status"] == "fresh", res.freshness
        assert res.freshness["d"]["lag_messages"] == 0
        ray.get(ds.actors[1].stop.remote())  # shard 1 stops consuming its partitions
        res = fab.query("near", session={"q": q})
        f = res.freshness["d"]
        assert f["status"] == "stale" and "shard(s) [1]" in f.get("error", ""), f
        assert res.table.column("id")[0].as_py() == "k7"  # still answered, flagged
    with pytest.raises(DslError) as info:  # more shards than the topic has partitions
        fabric.open(_fabric_yaml(tmp_path, kafka_bootstrap, topic, 8), watch=False)
    msg = info.value.format()
    assert "fabric.yaml:9:5:" in msg and "4 partition(s)" in msg and "shards: 4" in msg, msg


@pytest.mark.slow
def test_an_upsert_fed_dataset_with_shards_splits_rows_by_key(ray_cluster, tmp_path) -> None:
    import fabric

    path = tmp_path / "fabric.yaml"
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "near.yaml").write_text(BINDING.replace("    freshness:", "#"))
    path.write_text(
        "datasets:\n  docs:\n"
        + textwrap.indent(SCHEMA_YAML + "indexes: {vec: hnsw}\nshards: 3\n", "    ")
        + "executor: ray\nbindings: [agents/]\n"
    )
    with fabric.open(str(path), watch=False) as fab:
        ds = fab.dataset("docs")
        rows = [doc(i) for i in range(600)]
        assert ds.upsert(pa.Table.from_pylist(rows, schema=SCHEMA)) == 600
        keys = ds.keys_per_shard()
        assert len(keys) == 3 and all(keys) and sum(map(len, keys)) == 600
        assert len(set().union(*map(set, keys))) == 600
        res = fab.query("near", session={"q": np.asarray(rows[123]["vec"], np.float32)})
        assert res.table.column("id")[0].as_py() == "k123"
        assert res.freshness["d"]["status"] == "fresh"


SECURE = """\
connections:
  bus:
    kind: kafka
    bootstrap: {bootstrap}
    timeout: 7
    group_prefix: sec16
    security:
      security.protocol: PLAINTEXT
      sasl.mechanism: PLAIN
      sasl.username: fabric
      sasl.password: not-a-secret
      ssl.endpoint.identification.algorithm: none
    config: {{client.id: fabric-issue-16, fetch.wait.max.ms: 50}}
datasets:
  loc:
    from: kafka://bus/{topic}
    schema: {{id: str, n: int, vec: 'vector[8]'}}
    key: id
    indexes: {{vec: hnsw}}
  shd:
    from: kafka://bus/{topic}
    schema: {{id: str, n: int, vec: 'vector[8]'}}
    key: id
    indexes: {{vec: hnsw}}
    shards: 2
executor: ray
"""


def _plain(cfg: dict) -> dict:
    """A consumer's librdkafka settings without its Python callbacks."""
    return {k: v for k, v in cfg.items() if not callable(v) and k != "logger"}


@pytest.mark.servers
@pytest.mark.kafka
@pytest.mark.slow
def test_shard_consumers_get_the_connections_security_and_config(
    ray_cluster, kafka_bootstrap, new_topic, tmp_path
) -> None:
    """A Kafka connection with security: (SASL/TLS settings), config: and group_prefix:
    feeds a local dataset and a 2-shard one: every shard's consumer gets the settings
    the local consumer gets (the connection's client_config), only its group differing
    by the dataset's name; and both ingest the topic."""
    import ray

    import fabric

    topic = new_topic(partitions=4, prefix="ray_sec")
    produce(kafka_bootstrap, topic, [doc(i) for i in range(200)])
    path = tmp_path / "fabric.yaml"
    path.write_text(SECURE.format(bootstrap=json.dumps(kafka_bootstrap), topic=topic))
    with fabric.open(str(path), watch=False) as fab:
        shd = fab.dataset("shd")
        assert shd.wait_caught_up(120) and fab.service.manager.wait_caught_up(60)
        assert shd.count() == fab.dataset("loc").count() == 200
        ing = fab.service.manager.ingestors["loc"]
        local = _plain(ing.options.connection.client_config(ing._consumer_config()))
        assert local["sasl.username"] == "fabric" and local["client.id"] == "fabric-issue-16"
        assert local["socket.timeout.ms"] == 7000
        for i, got in enumerate(ray.get([a.consumer_config.remote() for a in shd.actors])):
            assert got["group.id"] == local["group.id"].replace(".loc", ".shd"), i
            assert {**got, "group.id": None} == {**local, "group.id": None}, i
