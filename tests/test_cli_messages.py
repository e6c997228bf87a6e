"""What the CLI says, as fixture files (issue 19): files named relative to the working
directory wherever the command runs from (also for the problems the catalog finds, which
it names relative to fabric.yaml's directory), each problem once, and counts in words
("1 problem", "2 problems"). ``tests/fixtures/cli/*.txt``: blocks of ``$ [cd DIR &&]
fabric ARGS`` followed by the expected output (stdout, then stderr), run in a scaffold
``s/`` (``fabric init``) with two broken bindings and a second scaffold ``ok/``;
``FABRIC_UPDATE_FIXTURES=1`` rewrites the expected parts."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from fabric.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "cli"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-messages")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for name in ("s", "ok", "bad"):
            assert main(["init", name]) == 0
    finally:
        os.chdir(cwd)
    agents = root / "s" / "agents"
    good = (agents / "top_products.yaml").read_text()
    (agents / "typo.yaml").write_text(
        good.replace("{{session.min_qty}}", "{{session.min_qt}}").replace(
            "binding: top_products", "binding: typo"
        )
    )
    (agents / "missing.yaml").write_text(
        good.replace("products.parquet", "product.parquet").replace(
            "binding: top_products", "binding: missing"
        )
    )
    config = root / "bad" / "fabric.yaml"
    text = re.sub(r'root: ("[^"]*"|[^,}\s]+)', 'root: "${NO_SUCH_VARIABLE_X}"', config.read_text())
    config.write_text(text)
    return root


def _cases(path: Path) -> list[tuple[str, str]]:
    text = path.read_text()
    parts = re.split(r"^\$ (.*)\n", text, flags=re.M)
    return [(parts[i], parts[i + 1].rstrip("\n")) for i in range(1, len(parts), 2)]


def _run(root: Path, command: str, capsys) -> str:
    cwd = root
    m = re.match(r"cd (\S+) && (.*)", command)
    if m:
        cwd, command = root / m.group(1), m.group(2)
    words = shlex.split(command)
    assert words[0] == "fabric"
    old = os.getcwd()
    os.chdir(cwd)
    try:
        capsys.readouterr()
        code = main(words[1:])
    finally:
        os.chdir(old)
    out = capsys.readouterr()
    return f"{out.out}{out.err}[exit {code}]"


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.txt")), ids=lambda p: p.stem)
def test_cli_messages(fixture, tree, capsys, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VARIABLE_X", raising=False)
    got = [(cmd, _run(tree, cmd, capsys)) for cmd, _ in _cases(fixture)]
    if os.environ.get("FABRIC_UPDATE_FIXTURES"):
        fixture.write_text("".join(f"$ {cmd}\n{out}\n\n" for cmd, out in got).rstrip() + "\n")
    for (cmd, want), (_, out) in zip(_cases(fixture), got):
        assert out == want, f"$ {cmd}"


def test_the_counts_are_words_everywhere():
    """No 'N thing(s)' left in what the CLI and the demo print."""
    root = Path(__file__).resolve().parents[1] / "fabric"
    for f in [root / "cli.py", *root.glob("demo*.py")]:
        found = re.findall(r"\w+(?<!len)\(s\)(?=[ \"'])", f.read_text())
        assert found == [], f
