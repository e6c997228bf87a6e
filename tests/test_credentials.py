"""Credentials never reach a user (issue 13, finding 8).

Every connection kind is configured with the password ``s3cr3t-marker`` (a URL's password,
S3 access/secret keys, a Kafka SASL password), errors are provoked (server down, wrong
password, unknown table, bad filter) through ``query_text``, ``explain``, ``validate``,
``freshness()`` and the CLI, and the marker must appear nowhere: not in the message, the
hint, the repr, the whole chained traceback, a diagnostic, or the CLI's stdout/stderr.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

import fabric
from connectors.credentials import mask, mask_url, secrets_of

ROOT = Path(__file__).resolve().parents[1]
MARKER = "s3cr3t-marker"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _everything(exc: BaseException) -> str:
    """All a user could see of an exception: its text, repr and the whole chain."""
    parts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    for d in getattr(exc, "diagnostics", ()):
        parts += [d.format(), json.dumps(d.to_dict())]
    return "\n".join(parts)


def _fails_clean(fn: Callable[[], Any]) -> str:
    with pytest.raises(Exception) as info:
        fn()
    text = _everything(info.value)
    assert MARKER not in text, text
    return text


# ---------------------------------------------------------------------- the helper


def test_mask_by_shape() -> None:
    assert mask_url(f"mongodb://fabric:{MARKER}@127.0.0.1:27017/?x=1") == (
        "mongodb://fabric:***@127.0.0.1:27017/?x=1"
    )
    assert mask(f"postgresql+psycopg://:{MARKER}@h/db") == "postgresql+psycopg://:***@h/db"
    assert mask(f"{{'sasl.password': '{MARKER}', 'x': 1}}") == "{'sasl.password': '***', 'x': 1}"
    assert mask(f"dsn: host=h password={MARKER} user=u") == "dsn: host=h password=*** user=u"
    # ordinary words that only look like key names are left alone
    text = "unexpected token: 'where'; Access denied (using password: YES); fabric.yaml"
    assert mask(text) == text


def test_secrets_of_every_kind() -> None:
    found = secrets_of(
        {
            "url": f"mysql+pymysql://u:{MARKER}%21@h/db",
            "access_key": "AK" + MARKER,
            "secret_key": "SK" + MARKER,
            "security": {"sasl.password": "K" + MARKER, "sasl.username": "bob"},
        }
    )
    assert {f"{MARKER}%21", f"{MARKER}!", "AK" + MARKER, "SK" + MARKER, "K" + MARKER} <= found
    assert "bob" not in found


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def mysql_user(mariadb_url: str) -> Iterator[str]:
    """A MariaDB user whose password is the marker, on this run's database."""
    import sqlalchemy as sa

    user = f"fsec_{uuid.uuid4().hex[:8]}"
    url = make_url(mariadb_url)
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as con:
        con.exec_driver_sql(f"CREATE USER '{user}'@'%%' IDENTIFIED BY '{MARKER}'")
        con.exec_driver_sql(f"GRANT ALL ON `{url.database}`.* TO '{user}'@'%%'")
        con.exec_driver_sql("CREATE TABLE IF NOT EXISTS sec_t (id INT, name VARCHAR(20))")
        con.exec_driver_sql("INSERT INTO sec_t VALUES (1, 'a')")
    try:
        yield url.set(username=user, password=MARKER).render_as_string(hide_password=False)
    finally:
        with engine.connect() as con:
            con.exec_driver_sql(f"DROP USER '{user}'@'%%'")
        engine.dispose()


@pytest.fixture(scope="module")
def mongo_user(mongo_url: str, mongo_db: Any) -> Iterator[str]:
    """A MongoDB user whose password is the marker."""
    user = f"fsec_{uuid.uuid4().hex[:8]}"
    mongo_db.client.admin.command("createUser", user, pwd=MARKER, roles=["root"])
    mongo_db["sec_c"].insert_one({"code": "x", "n": 1})
    try:
        yield mongo_url.replace("mongodb://", f"mongodb://{user}:{MARKER}@", 1)
    finally:
        mongo_db.client.admin.command("dropUser", user)


@pytest.fixture
def env(
    mysql_user: str, mongo_user: str, pg_url: str, mongo_db: Any, servers: Any
) -> dict[str, str]:
    port = _closed_port()
    return {
        "SEC_MYSQL_URL": mysql_user,
        "SEC_MYSQL_DOWN_URL": str(make_url(mysql_user).set(port=port).render_as_string(False)),
        "SEC_PG_URL": str(make_url(pg_url).set(password=MARKER).render_as_string(False)),
        "SEC_MONGO_URL": mongo_user,
        "SEC_MONGO_DOWN_URL": f"mongodb://fabric:{MARKER}@127.0.0.1:{port}/?directConnection=true",
        "SEC_MONGO_DB": mongo_db.name,
        "SEC_S3_ENDPOINT": servers.s3_endpoint,
        "SEC_KAFKA_DOWN": f"127.0.0.1:{port}",
        "SEC_MARKER": MARKER,
    }


CONFIG = """\
connections:
  shop: {kind: mysql, url: "${SEC_MYSQL_URL}", connect_timeout: 2}
  shopdown: {kind: mysql, url: "${SEC_MYSQL_DOWN_URL}", connect_timeout: 1}
  pg: {kind: postgres, url: "${SEC_PG_URL}", connect_timeout: 2}
  crm: {kind: mongo, url: "${SEC_MONGO_URL}", database: "${SEC_MONGO_DB}", timeout: 2}
  crmdown: {kind: mongo, url: "${SEC_MONGO_DOWN_URL}", database: crm, timeout: 1}
  lake: {kind: s3, endpoint: "${SEC_S3_ENDPOINT}", bucket: nosuch,
         access_key: "ak-${SEC_MARKER}", secret_key: "${SEC_MARKER}"}
  bus:
    kind: kafka
    bootstrap: "${SEC_KAFKA_DOWN}"
    timeout: 1
    security: {security.protocol: SASL_PLAINTEXT, sasl.mechanism: PLAIN,
               sasl.username: fabric, sasl.password: "${SEC_MARKER}"}
bindings: [agents/]
"""

#: one binding per failure; validate must report each without the marker
BINDINGS = {
    "my_unknown_table": "from: mysql://shop/nosuch",
    "my_down": "from: mysql://shopdown/sec_t",
    "pg_auth": "from: postgres://pg/sec_t",
    "mongo_unknown": "from: mongo://crm/nosuch",
    "mongo_down": "from: mongo://crmdown/coupons",
    "s3_denied": "from: s3://lake/x/*.parquet",
    "kafka_down": "from: kafka://bus/topic",
}

QUERIES = [
    "from mysql://shop/nosuch as t select t.id",
    "from mysql://shop/sec_t as t where t.nosuch = 1 select t.id",
    "from mysql://shop/sec_t as t where t.name > 1 select t.id",
    "from mysql://shopdown/sec_t as t select t.id",
    "from postgres://pg/sec_t as t select t.id",
    "from mongo://crm/nosuch as c select c.code",
    "from mongo://crm/sec_c as c where c.nosuch = 'x' select c.code",
    "from mongo://crmdown/coupons as c select c.code",
    "from s3://lake/x/*.parquet as o select o.id",
    "from kafka://bus/topic as k select k.id",
]


@pytest.fixture
def root(tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Path:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "fabric.yaml").write_text(CONFIG)
    agents = tmp_path / "agents"
    agents.mkdir()
    for name, source in BINDINGS.items():
        (agents / f"{name}.yaml").write_text(
            f"binding: {name}\nsources:\n  t:\n    {source}\nselect: [t.id]\n"
        )
    return tmp_path


def test_query_explain_validate_never_show_the_password(root: Path) -> None:
    with fabric.open(root / "fabric.yaml", ingest=False, watch=False) as fab:
        assert MARKER not in repr(fab.config) + repr(fab) + repr(fab.catalog._connections)
        texts = []
        for q in QUERIES:
            texts.append(_fails_clean(lambda q=q: fab.query_text(q)))
            texts.append(_fails_clean(lambda q=q: fab.explain_text(q)))
        # the finding: the Mongo hint names the server, with the password masked
        down = "\n".join(texts)
        assert "mongodb://fabric:***@127.0.0.1" in down
        for name in BINDINGS:
            _fails_clean(lambda name=name: fab.query(name))
            _fails_clean(lambda name=name: fab.explain(name, analyze=True))
        diags = fab.validate()
        assert {Path(d.span.file).stem for d in diags if d.span} == set(BINDINGS)
        shown = "\n".join(d.format() + json.dumps(d.to_dict()) for d in diags)
        assert MARKER not in shown, shown
        fresh = json.dumps(fab.freshness(), default=str)
        assert MARKER not in fresh
        for conn in fab.catalog._connections.values():
            assert MARKER not in repr(conn)


@pytest.mark.slow
def test_cli_never_shows_the_password(root: Path, env: dict[str, str]) -> None:
    cmds = [
        ["validate", "--config", "fabric.yaml"],
        *(["query", "--text", q, "--config", "fabric.yaml"] for q in QUERIES[:9:2]),
        ["query", "mongo_down", "--config", "fabric.yaml"],
        ["explain", "my_down", "--analyze", "--config", "fabric.yaml"],
    ]
    for cmd in cmds:
        out = subprocess.run(
            [sys.executable, "-m", "fabric", *cmd],
            cwd=root,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0, (cmd, out.stdout, out.stderr)
        assert out.stderr.strip() or out.stdout.strip()
        assert MARKER not in out.stdout + out.stderr, (cmd, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr, (cmd, out.stderr)


SERVE = """\
connections:
  shopdown: {kind: mysql, url: "${SEC_MYSQL_DOWN_URL}", connect_timeout: 1}
  crmdown: {kind: mongo, url: "${SEC_MONGO_DOWN_URL}", database: crm, timeout: 1}
  bus:
    kind: kafka
    bootstrap: "${SEC_KAFKA_DOWN}"
    timeout: 1
    security: {security.protocol: SASL_PLAINTEXT, sasl.mechanism: PLAIN,
               sasl.username: fabric, sasl.password: "${SEC_MARKER}"}
datasets:
  m: {from: mysql://shopdown/merchants, key: id, schema: {id: int, name: str}}
  c: {from: mongo://crmdown/coupons, key: id, schema: {id: int, name: str}}
  k: {from: kafka://bus/topic, key: id, schema: {id: int, name: str}}
bindings: []
server: {port: PORT}
signals:
  heartbeat: 1s
  targets: ["http://hook:${SEC_MARKER}@127.0.0.1:${SEC_HOOK}/x?token=${SEC_MARKER}"]
"""


@pytest.mark.slow
def test_serve_log_freshness_and_metrics_never_show_the_password(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Datasets whose sources are down and a webhook target with credentials: the errors
    reach the log, /v1/freshness, /healthz and /metrics, the password does not."""
    import time
    import urllib.request

    port = _closed_port()
    env = {**env, "SEC_HOOK": str(_closed_port())}  # the webhook is down: errors
    (tmp_path / "fabric.yaml").write_text(SERVE.replace("PORT", str(port)))
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fabric", "serve", "--config", "fabric.yaml"],
            cwd=tmp_path,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            body = ""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and '"last_error"' not in body:
                time.sleep(0.5)
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/freshness") as r:
                        body = r.read().decode()
                except OSError:
                    assert proc.poll() is None, log.read_text()
            assert '"last_error"' in body, body
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                metrics = r.read().decode()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as r:
                health = r.read().decode()
            assert "http://hook:***@127.0.0.1" in health and "token=***" in health
        finally:
            proc.terminate()
            proc.wait(20)
    text = log.read_text()
    assert "refresh from mysql://shopdown/merchants failed" in text  # the errors are logged
    assert "mongodb://fabric:***@127.0.0.1" in text
    for shown in (text, body, metrics, health):
        assert MARKER not in shown
