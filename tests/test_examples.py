"""The per-scenario examples (examples/<scenario>/, issue 19) run as a user runs them, on
embedded defaults (SQLite, a local directory, noida-db / SecantusDB started by the
example), and their answers equal an independent reference over the same data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ["ecommerce", "finance", "analytics", "risk", "incident"]


def test_every_scenario_has_an_example_with_a_readme():
    for name in SCENARIOS:
        here = ROOT / "examples" / name
        assert (here / "agent.py").is_file() and (here / "fabric.yaml").is_file(), name
        readme = (here / "README.md").read_text()
        assert f"python examples/{name}/agent.py" in readme, name  # says how to run it


def test_the_core_packages_do_not_import_the_examples():
    """The demo lives in examples/ (issue 20): no module of the core packages imports it;
    the CLI only names ``examples.demo`` to delegate `fabric demo` to it."""
    import ast

    assert not list((ROOT / "fabric").glob("demo*.py"))
    for pkg in ("fabric", "dsl", "connectors", "indexes", "crypto"):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n.split(".")[0] == "examples" for n in names), f


def test_the_generator_is_seeded_and_sized():
    from examples.embedded import generate

    a, b, c = generate(5, 0.5), generate(5, 0.5), generate(6, 0.5)
    assert a["orders"].num_rows == 10_000 and generate(5, 2)["orders"].num_rows == 40_000
    assert a["orders"]["amount"].equals(b["orders"]["amount"])
    assert not a["orders"]["amount"].equals(c["orders"]["amount"])
    assert generate(5, 10)["risk_policies"].num_rows == 30
    # the three named policies are the same whatever the size
    assert generate(5, 10)["risk_policies"].slice(0, 3).equals(a["risk_policies"])


def test_analytics_answers_equal_duckdb_for_several_users():
    from examples.analytics import agent
    from examples.embedded import embedded, generate

    data = generate(13, 0.3)
    with embedded("analytics", agent.HERE, data) as (fab, _):
        answers = {user: agent.ask(fab, user) for user in (1, 2, 3, 4)}
    for user, got in answers.items():
        assert got and got == agent.reference(data, user), user
    assert len({tuple(a) for a in answers.values()}) > 1  # the users' answers differ


def test_risk_scores_decrypt_to_numpy_for_generated_policies():
    from crypto import KeyRing
    from examples.embedded import embedded, generate
    from examples.risk import agent

    data = generate(13, 4)  # 12 policies, some inactive
    ring = KeyRing.generate()
    pub = Path(os.environ.get("TMPDIR", "/tmp")) / f"fabric-test-risk-{os.getpid()}.pub"
    pub.write_bytes(ring.public_context())
    try:
        with embedded("risk", agent.HERE, data, FABRIC_AGENT_PUBLIC_CONTEXT=str(pub)) as (fab, _):
            got = agent.ask(fab, ring, [0.3, 0.8, 0.1])
    finally:
        pub.unlink()
    ref = agent.reference(data, [0.3, 0.8, 0.1])
    assert got.keys() == ref.keys() and len(ref) < 12  # the inactive ones are left out
    assert all(abs(got[k] - ref[k]) < agent.BOUND for k in ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("analytics", ["--seed", "11", "--scale", "0.5", "--user", "5"]),
        ("risk", ["--seed", "11", "--scale", "3", "--context", "0.1,0.9,0.4"]),
        ("ecommerce", ["--seed", "11", "--scale", "0.5"]),
        ("finance", ["--seed", "11", "--scale", "0.5", "--symbols", "TSLA,MSFT"]),
        ("incident", []),
    ],
)
def test_example_runs_as_its_readme_says(name, args, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name / "agent.py"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "[ok]" in text and "MISMATCH" not in text, text[-4000:]
    left = [p.name for p in tmp_path.glob("fabric-*")]  # (lark's grammar cache may stay)
    assert left == [], f"the example left files behind: {left}"


def test_the_incident_plot_draws_a_recorded_run(tmp_path):
    pytest.importorskip("matplotlib")
    from examples.incident.plot import plot

    def agents(parked: bool) -> dict[str, str]:
        a = {"analyst-1": "parked", "analyst-2": "parked"} if parked else {
            "analyst-1": "GPU 0", "analyst-2": "GPU 1"}  # fmt: skip
        return {**a, "shopper-1": "GPU 0" if parked else "waiting", "shopper-2": "waiting"}

    record = [
        {"t": 0.0, "lag": 0, "event": None, "agents": agents(False)},
        {"t": 1.0, "lag": 1500, "event": "data_stale", "agents": agents(True)},
        {"t": 2.0, "lag": 9000, "event": None, "agents": agents(True)},
        {"t": 4.0, "lag": 0, "event": "data_fresh", "agents": agents(False)},
    ]
    out = plot(record, tmp_path / "incident.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
