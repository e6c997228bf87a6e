"""docs/contributing.md's retrieval-strategy recipe, run as a contributor would: its
``key_lookup.py`` and ``tests/test_key_lookup.py`` blocks are written into a directory
outside this repository and the test runs in a fresh pytest -- the strategy registered
from the test module, chosen by the optimizer for a ``fab.query``, shown in explain,
forced by name after a delete."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contributing.md"


def _files() -> dict[str, str]:
    """The doc's blocks whose first line is ``# <file name>``, by file name."""
    out = {}
    for body in re.findall(r"^```\w+\n(.*?)^```", DOC.read_text(), flags=re.S | re.M):
        first, _, rest = body.partition("\n")
        if m := re.fullmatch(r"# ([\w/.-]+\.py)", first.strip()):
            out[m.group(1)] = rest
    return out


def test_the_contributing_retrieval_strategy_is_chosen_by_a_query(tmp_path: Path) -> None:
    files = _files()
    assert {"key_lookup.py", "tests/test_key_lookup.py"} <= set(files)
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "key_lookup.py").write_text(files["key_lookup.py"])
    (pkg / "tests" / "test_key_lookup.py").write_text(files["tests/test_key_lookup.py"])
    env = {**os.environ, "PYTHONPATH": str(pkg)}  # the repository itself is not on it
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=pkg,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"\b1 passed", out.stdout), out.stdout[-2000:]
