"""`fabric validate` checks a binding's own consistency always: without a fabric.yaml, and
when the catalog cannot be reached (issue 19)."""

from __future__ import annotations

from pathlib import Path

from fabric.cli import main

BAD = """\
binding: orders_of
session:
  user_id: int
sources:
  o:
    from: mysql://shop/orders
    where: user_id = {{session.customer}}
select: [o.id, x.amount]
order_by: o.id
pushdown:
  params: [user]
  python: |
    def run(table, user):
        return table
"""


def test_without_fabric_yaml(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "b.yaml").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "b.yaml"]) == 1
    out = capsys.readouterr().out
    assert "b.yaml:7:22: session value 'customer' is not declared" in out, out
    assert "b.yaml:8:16: unknown alias 'x' in x.amount" in out, out
    assert "pushdown parameter 'user' is not a declared session value" in out, out


def test_catalog_unreachable_still_reports_the_bindings_own_problems(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "b.yaml").write_text(BAD)
    (tmp_path / "fabric.yaml").write_text(
        "connections:\n"
        '  shop: {kind: mysql, url: "mysql+pymysql://u:p@127.0.0.1:1/shop", connect_timeout: 1}\n'
        "bindings: [agents/]\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["validate"]) == 1
    out = capsys.readouterr().out
    assert "session value 'customer' is not declared" in out, out
    assert "unknown alias 'x' in x.amount" in out, out


def test_consistent_binding_passes_syntax_only(tmp_path: Path, monkeypatch, capsys) -> None:
    good = (
        BAD.replace("customer", "user_id")
        .replace("x.amount", "o.amount")
        .replace("params: [user]", "params: [user_id]")
        .replace("run(table, user)", "run(table, user_id)")
    )
    (tmp_path / "b.yaml").write_text(good)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "b.yaml"]) == 0, capsys.readouterr().out
