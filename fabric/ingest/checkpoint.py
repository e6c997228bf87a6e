"""Checkpoints: a dataset snapshot plus the offsets it reflects, written atomically.

Layout of a state directory (``.fabric/state/<dataset>`` by default)::

    CURRENT                 # the name of the newest complete checkpoint, e.g. "ckpt-000012"
    ckpt-000012/
        dataset/            # Dataset.save()
        offsets.json        # {"topic": ..., "offsets": {"0": 1234, ...}, ...}

A checkpoint is written into ``.tmp-ckpt-<seq>-<pid>/``, fsynced, renamed to
``ckpt-<seq>`` (atomic), and only then named in ``CURRENT`` (written to a temp file and
``os.replace``-d: atomic too). A crash at any point, ``kill -9`` included, leaves either the
previous checkpoint or the new one, never a mix. ``offsets[p]`` is the next offset to apply
in partition ``p``: everything below it is in the snapshot, nothing at or above it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_CKPT = re.compile(r"^ckpt-(\d{6,})$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    seq: int
    offsets: Mapping[int, int]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dataset_dir(self) -> Path:
        return self.path / "dataset"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(path: Path) -> bool:
    return (path / "offsets.json").is_file() and (path / "dataset").is_dir()


def latest(state_dir: Path) -> Checkpoint | None:
    """The checkpoint named by CURRENT, else the newest complete one, else None."""
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        return None
    candidates: list[Path] = []
    cur = state_dir / "CURRENT"
    if cur.is_file():
        candidates.append(state_dir / cur.read_text().strip())
    candidates += sorted(
        (p for p in state_dir.iterdir() if _CKPT.match(p.name)),
        key=lambda p: int(p.name[5:]),
        reverse=True,
    )
    for path in candidates:
        if _CKPT.match(path.name) and _complete(path):
            raw = json.loads((path / "offsets.json").read_text())
            offsets = {int(p): int(o) for p, o in raw.get("offsets", {}).items()}
            return Checkpoint(path, int(path.name[5:]), offsets, raw)
    return None


def write(
    state_dir: Path,
    save_dataset: Callable[[str], None],
    offsets: Mapping[int, int],
    meta: Mapping[str, Any] | None = None,
    *,
    keep: int = 1,
    fsync: bool = True,
) -> Checkpoint:
    """Write a new checkpoint (``save_dataset(dir)`` writes the snapshot); returns it."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    prev = latest(state_dir)
    seq = (prev.seq if prev else 0) + 1
    tmp = state_dir / f".tmp-ckpt-{seq:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_dataset(str(tmp / "dataset"))
    body = {
        **(meta or {}),
        "offsets": {str(p): int(o) for p, o in sorted(offsets.items())},
        "saved_at": time.time(),
    }
    (tmp / "offsets.json").write_text(json.dumps(body, indent=1, sort_keys=True))
    if fsync:
        _fsync_tree(tmp)
    final = state_dir / f"ckpt-{seq:06d}"
    shutil.rmtree(final, ignore_errors=True)  # a leftover from a crash before CURRENT moved
    os.rename(tmp, final)
    cur_tmp = state_dir / f".CURRENT.{os.getpid()}"
    with open(cur_tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(cur_tmp, state_dir / "CURRENT")
    if fsync:
        _fsync_dir(state_dir)
    _prune(state_dir, seq, keep)
    return Checkpoint(final, seq, dict(offsets), body)


def _prune(state_dir: Path, seq: int, keep: int) -> None:
    for p in state_dir.iterdir():
        m = _CKPT.match(p.name)
        if (m and int(m.group(1)) <= seq - keep) or (
            p.name.startswith(".tmp-ckpt-") and not p.name.endswith(f"-{os.getpid()}")
        ):
            shutil.rmtree(p, ignore_errors=True)
