"""docs/contributing.md's complete connector package, run as a third party would: its
``pyproject.toml``, ``fabric_feather.py`` and ``tests/test_fabric_feather.py`` blocks
are written into a throwaway package outside this repository (the module and the
``*.dist-info/entry_points.txt`` that ``pip install`` leaves, put on ``sys.path``), and
its tests run in a fresh pytest: ``connectors.testing.ConnectorConformance`` over the
new kind, found through the ``agent_data_fabric.connectors`` entry point, and a query
through ``fabric.open``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "contributing.md"


def _files() -> dict[str, str]:
    """The doc's blocks whose first line is ``# <file name>``, by file name."""
    out = {}
    for body in re.findall(r"^```\w+\n(.*?)^```", DOC.read_text(), flags=re.S | re.M):
        first, _, rest = body.partition("\n")
        if m := re.fullmatch(r"# ([\w/.-]+\.(?:py|toml))", first.strip()):
            out[m.group(1)] = rest
    return out


def test_the_contributing_connector_package_passes_the_conformance_kit(tmp_path: Path) -> None:
    files = _files()
    assert {"pyproject.toml", "fabric_feather.py", "tests/test_fabric_feather.py"} <= set(files)
    project = tomllib.loads(files["pyproject.toml"])["project"]
    site = tmp_path / "site"
    dist = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project["entry-points"]
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
            for group, eps in groups.items()
        )
    )
    (site / "fabric_feather.py").write_text(files["fabric_feather.py"])
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "tests" / "test_fabric_feather.py").write_text(files["tests/test_fabric_feather.py"])
    env = {**os.environ, "PYTHONPATH": str(site)}  # the repository itself is not on it
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=pkg,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) >= 50, out.stdout[-2000:]
