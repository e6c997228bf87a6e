"""A ``file://`` connection reads only below its root (issue 13, finding 9).

A marker file sits next to the root; every way of naming it through the connection
(``..``, ``..`` in a glob, URL-encoded dots, a symlinked file or directory, an absolute
path) must fail with a positioned error and the marker must never be read.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fabric
from dsl.errors import DslError

MARKER = "marker-outside-the-root"

ESCAPES = [
    "../secret/creds.csv",
    "sub/../../secret/creds.csv",
    "./../secret/creds.csv",
    "sub/../ok.csv",  # inside, but '..' is refused whatever it resolves to
    "../secret/*.csv",
    "sub/../../secret/",
    "%2e%2e/secret/creds.csv",
    "%2E%2E%2Fsecret%2Fcreds.csv",
    "link.csv",
    "linkdir/creds.csv",
    "linkdir/",
]


@pytest.fixture
def fab(tmp_path: Path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "ok.csv").write_text("id,name\n1,a\n2,b\n")
    (root / "sub" / "in.csv").write_text("id,name\n3,c\n")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "creds.csv").write_text(f"id,name\n9,{MARKER}\n")
    (root / "link.csv").symlink_to(secret / "creds.csv")
    (root / "linkdir").symlink_to(secret, target_is_directory=True)
    config = {"connections": {"conn": {"kind": "file", "root": str(root)}}}
    with fabric.open(config, ingest=False, watch=False) as f:
        yield f


@pytest.mark.parametrize("obj", ESCAPES)
def test_no_object_outside_the_root(fab, obj: str) -> None:
    text = f"from file://conn/{obj} as t select t.id, t.name"
    with pytest.raises(DslError) as info:
        fab.query_text(text)
    err = info.value
    assert MARKER not in str(err)
    assert err.span is not None and (err.span.line, err.span.col) == (1, 6)
    assert "root" in str(err), str(err)


def test_a_directory_with_an_escaping_symlink_is_refused(fab) -> None:
    """A glob over the root lists link.csv and linkdir/: refused, not read and not skipped."""
    for obj in ("*.csv", "**/*.csv", "."):
        with pytest.raises(DslError) as info:
            fab.query_text(f"from file://conn/{obj} as t select t.id, t.name")
        assert MARKER not in str(info.value)
        assert "outside" in str(info.value), str(info.value)


def test_absolute_paths_stay_below_the_root(fab, tmp_path: Path) -> None:
    target = str(tmp_path / "secret" / "creds.csv")
    with pytest.raises(DslError) as info:
        fab.query_text(f"from file://conn/{target} as t select t.id, t.name")
    assert MARKER not in str(info.value)


def test_inside_the_root_still_reads(fab) -> None:
    assert fab.query_text("from file://conn/ok.csv as t select t.id").table.num_rows == 2
    assert fab.query_text("from file://conn/sub/ as t select t.id").table.num_rows == 1
    assert fab.query_text("from file://conn/./sub/in.csv as t select t.id").table.num_rows == 1


def test_the_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "ok.csv").write_text("id\n1\n")
    os.symlink(real, tmp_path / "alias")
    config = {"connections": {"conn": {"kind": "file", "root": str(tmp_path / "alias")}}}
    with fabric.open(config, ingest=False, watch=False) as f:
        assert f.query_text("from file://conn/ok.csv as t select t.id").table.num_rows == 1


def test_s3_objects_stay_below_the_prefix(s3) -> None:
    """The same rule on S3: '..' does not leave the connection's bucket/prefix."""
    with s3.fs.open_output_stream(f"{s3.bucket}/outer/creds.csv") as f:
        f.write(f"id,name\n9,{MARKER}\n".encode())
    with s3.fs.open_output_stream(f"{s3.bucket}/inner/ok.csv") as f:
        f.write(b"id,name\n1,a\n")
    conn = {
        "kind": "s3",
        "endpoint": s3.endpoint,
        "bucket": s3.bucket,
        "prefix": "inner",
        "access_key": s3.access_key,
        "secret_key": s3.secret_key,
    }
    with fabric.open({"connections": {"lake": conn}}, ingest=False, watch=False) as f:
        assert f.query_text("from s3://lake/ok.csv as t select t.id").table.num_rows == 1
        for obj in ("../outer/creds.csv", "%2e%2e/outer/creds.csv", "../outer/*.csv"):
            with pytest.raises(DslError) as info:
                f.query_text(f"from s3://lake/{obj} as t select t.id, t.name")
            assert MARKER not in str(info.value)
            assert "'..'" in str(info.value), str(info.value)
