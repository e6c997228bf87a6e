"""Docs that are true (issue 19): every fenced block of README.md and docs/*.md that is a
binding, a fabric.yaml (or a fragment of one) or a `fabric` command is checked here.

- ```yaml blocks: a binding (top-level ``binding:``) is parsed and checked for its own
  consistency (dsl.selfcheck); a fabric.yaml (top-level keys of fabric.yaml) is loaded
  with every ``${VAR}`` it names set; ``name: {kind: ...}`` lines are loaded as
  ``connections:``. Other YAML (a Prometheus or Kubernetes file) is left alone.
- ```sh blocks: each line starting with ``fabric `` must parse with the CLI's parser.
- A block right after ``<!-- docs-test: run -->`` is run with bash in a fresh directory,
  in order per file (docs/quickstart.md), and must exit 0.
- ``<!-- docs-test: skip -->`` before a block leaves it out (say why next to it).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
CONFIG_KEYS = {
    "connections", "datasets", "bindings", "signals", "ingest", "crypto", "sandbox",
    "server", "agents", "functions", "tracing", "executor",
}  # fmt: skip
DELEGATED = {"serve", "demo", "mcp"}


def _blocks():
    for f in FILES:
        text = f.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip().splitlines()[-1:] or [""]
            marker = re.match(r"<!-- docs-test: (\w+)", before[0].strip())
            line = text[: m.start()].count("\n") + 1
            yield pytest.param(
                m.group(1), m.group(2), marker.group(1) if marker else None,
                id=f"{f.relative_to(ROOT)}:{line}",
            )  # fmt: skip


BLOCKS = list(_blocks())


# Stand-in connections for a fragment of fabric.yaml that names sources of connections it
# does not declare (a ``datasets:`` example): one per ``<kind>://<name>/`` it mentions.
STAND_INS = {
    "mysql": '{kind: mysql, url: "mysql+pymysql://u:p@127.0.0.1:1/db"}',
    "postgres": '{kind: postgres, url: "postgresql+psycopg://u:p@127.0.0.1:1/db"}',
    "mongo": '{kind: mongo, url: "mongodb://127.0.0.1:1", database: db}',
    "s3": "{kind: s3, bucket: b}",
    "file": "{kind: file, root: .}",
    "kafka": '{kind: kafka, bootstrap: "127.0.0.1:1"}',
}


def _with_stand_ins(body: str) -> str:
    """``body`` with a ``connections:`` of stand-ins prepended when it has none."""
    if re.search(r"^connections:", body, re.M):
        return body
    uris = re.findall(r"\b(" + "|".join(STAND_INS) + r")://(\w+)/", body)
    named = {name: kind for kind, name in uris}
    if not named:
        return body
    lines = [f"  {name}: {STAND_INS[kind]}" for name, kind in named.items()]
    return "connections:\n" + "\n".join(lines) + "\n" + body


def _top_keys(body: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_][\w-]*):", body, re.M)}


@pytest.mark.parametrize(("lang", "body", "marker"), [b for b in BLOCKS if b.values[0] == "yaml"])
def test_yaml_block(lang, body, marker, tmp_path):
    from dsl import loader, selfcheck
    from fabric.config import load_config

    if marker == "skip":
        pytest.skip("marked docs-test: skip")
    keys = _top_keys(body)
    if "binding" in keys:
        for spec in loader.load_text(body, "<doc>"):
            assert selfcheck.check(spec) == [], [d.format() for d in selfcheck.check(spec)]
        return
    if keys and all(re.search(rf"^{k}:\s*\{{\s*kind:", body, re.M) for k in keys):
        body = "connections:\n" + "".join(f"  {line}\n" for line in body.splitlines())
        keys = {"connections"}
    if not keys or not keys <= CONFIG_KEYS:
        pytest.skip(f"not a fabric.yaml or a binding (top-level keys {sorted(keys)})")
    env = {name: f"{name}-{'x' * 32}" for name in re.findall(r"\$\{(\w+)", body)}  # distinct
    for name in re.findall(r"^\s*token_file:\s*([\w./-]+)", body, re.M):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("t" * 32 + "\n")  # the file a token_file: names
    load_config(_with_stand_ins(body), root=tmp_path, env={**os.environ, **env})


@pytest.mark.parametrize(("lang", "body", "marker"), [b for b in BLOCKS if b.values[0] == "sh"])
def test_fabric_commands_parse(lang, body, marker):
    from fabric.cli import _parser

    if marker == "skip":
        pytest.skip("marked docs-test: skip")
    for line in body.splitlines():
        cmd = line.split("#", 1)[0].strip()
        for part in re.split(r"&&|\|\||\||;", cmd):
            words = shlex.split(re.split(r"[<>]", part)[0].strip())
            if not words or words[0] != "fabric" or len(words) < 2 or words[1] in DELEGATED:
                continue
            try:
                _parser().parse_args(words[1:])
            except SystemExit as e:
                if e.code:
                    raise AssertionError(f"the docs' command does not parse: {line}") from None


RUN = [b for b in BLOCKS if b.values[2] == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted({b.id.rsplit(":", 1)[0] for b in RUN}))
def test_runnable_blocks(doc, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(ROOT)
    for b in (b for b in RUN if b.id.startswith(doc + ":")):
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", b.values[1]],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, (
            f"{b.id}:\n{b.values[1]}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )


def test_the_docs_have_runnable_blocks():
    for doc in ("docs/quickstart.md", "README.md"):
        assert any(b.id.startswith(doc + ":") for b in RUN), doc
