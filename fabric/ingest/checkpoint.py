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

``offsets.json`` also lists every file of the checkpoint with its size and CRC-32
(``files``): ``load`` checks them and, if a checkpoint is damaged (a bad ``offsets.json``,
a truncated ``rows.arrow``, a flipped bit in ``live.roaring``) or its dataset fails to
load, says which file and falls back to the previous checkpoint (two are kept). Files are
0600 in 0700 directories: a checkpoint holds every row of the dataset.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsl.errors import FabricError

_CKPT = re.compile(r"^ckpt-(\d{6,})$")
log = logging.getLogger("fabric.ingest.checkpoint")


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


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _manifest(root: Path) -> dict[str, list[int]]:
    """relative path -> [size, CRC-32] of every file under ``root`` but offsets.json."""
    out: dict[str, list[int]] = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel != "offsets.json":
                out[rel] = [p.stat().st_size, _crc(p)]
    return out


def _candidates(state_dir: Path) -> list[Path]:
    """CURRENT's checkpoint first, then every other, newest first."""
    out: list[Path] = []
    cur = state_dir / "CURRENT"
    if cur.is_file():
        try:
            named = cur.read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = ""
        if _CKPT.match(named):
            out.append(state_dir / named)
    for p in sorted(
        (p for p in state_dir.iterdir() if _CKPT.match(p.name)),
        key=lambda p: int(p.name[5:]),
        reverse=True,
    ):
        if p not in out:
            out.append(p)
    return out


def read(path: Path) -> Checkpoint:
    """The checkpoint in ``path``, its files checked against its manifest; raises
    ``CheckpointError`` naming the file that is missing, truncated or damaged."""
    if not _complete(path):
        raise CheckpointError(f"{path}: incomplete (no offsets.json or dataset/)")
    f = path / "offsets.json"
    try:
        raw = json.loads(f.read_text())
        offsets = {int(p): int(o) for p, o in raw["offsets"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{f}: unreadable ({type(exc).__name__}: {exc})") from exc
    for rel, (size, crc) in (raw.get("files") or {}).items():
        fp = path / rel
        if not fp.is_file():
            raise CheckpointError(f"{fp}: missing")
        if fp.stat().st_size != size:
            raise CheckpointError(f"{fp}: {fp.stat().st_size} bytes, {size} when written")
        if _crc(fp) != crc:
            raise CheckpointError(f"{fp}: damaged (CRC-32 differs from when it was written)")
    return Checkpoint(path, int(path.name[5:]), offsets, raw)


class CheckpointError(FabricError):
    """A checkpoint that cannot be used; the message names the file."""


def latest(state_dir: Path) -> Checkpoint | None:
    """The checkpoint named by CURRENT, else the newest usable one, else None."""
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        return None
    for path in _candidates(state_dir):
        try:
            return read(path)
        except CheckpointError as exc:
            log.warning("checkpoint %s", exc)
    return None


@dataclass
class Loaded:
    """What ``load`` found: the checkpoint used (None: none was usable), what ``loader``
    made of it, and one line per checkpoint that could not be used (naming the file)."""

    checkpoint: Checkpoint | None
    value: Any
    problems: list[str]

    def report(self) -> str | None:
        """One sentence for the log and freshness, or None if the newest one was used."""
        if not self.problems:
            return None
        bad = "; ".join(self.problems)
        if self.checkpoint is None:
            return f"no usable checkpoint ({bad}): rebuilding from the beginning"
        return f"fell back to {self.checkpoint.path.name} ({bad})"


def load(state_dir: Path, loader: Callable[[Checkpoint], Any]) -> Loaded:
    """Newest checkpoint first: check its files, ``loader(checkpoint)`` it; on any failure
    try the previous one. Never raises for a damaged checkpoint."""
    state_dir = Path(state_dir)
    problems: list[str] = []
    if not state_dir.is_dir():
        return Loaded(None, None, problems)
    for path in _candidates(state_dir):
        try:
            ck = read(path)
            value = loader(ck)
        except Exception as exc:  # damaged or unloadable: name it, try the previous
            msg = (
                str(exc)
                if isinstance(exc, CheckpointError)
                else (f"{path}: {type(exc).__name__}: {exc}")
            )
            log.error("checkpoint %s is unusable: %s", path.name, msg)
            problems.append(msg)
            continue
        return Loaded(ck, value, problems)
    return Loaded(None, None, problems)


def _private(root: Path) -> None:
    """Every file under ``root`` 0600, every directory 0700."""
    os.chmod(root, 0o700)
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o700)
        for name in files:
            p = os.path.join(dirpath, name)
            if stat.S_IMODE(os.lstat(p).st_mode) != 0o600:
                os.chmod(p, 0o600)


def write(
    state_dir: Path,
    save_dataset: Callable[[str], None],
    offsets: Mapping[int, int],
    meta: Mapping[str, Any] | None = None,
    *,
    keep: int = 2,
    fsync: bool = True,
) -> Checkpoint:
    """Write a new checkpoint (``save_dataset(dir)`` writes the snapshot); returns it.
    If anything fails (a full disk ...), the partial copy is removed and it raises."""
    state_dir = Path(state_dir)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    seq = 1 + max((int(p.name[5:]) for p in state_dir.iterdir() if _CKPT.match(p.name)), default=0)
    tmp = state_dir / f".tmp-ckpt-{seq:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    try:
        save_dataset(str(tmp / "dataset"))
        _private(tmp)
        body = {
            **(meta or {}),
            "offsets": {str(p): int(o) for p, o in sorted(offsets.items())},
            "saved_at": time.time(),
            "files": _manifest(tmp),
        }
        fd = os.open(tmp / "offsets.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as jf:
            jf.write(json.dumps(body, indent=1, sort_keys=True))
        if fsync:
            _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # do not leave a full disk fuller
        raise
    final = state_dir / f"ckpt-{seq:06d}"
    shutil.rmtree(final, ignore_errors=True)  # a leftover from a crash before CURRENT moved
    os.rename(tmp, final)
    cur_tmp = state_dir / f".CURRENT.{os.getpid()}"
    with open(os.open(cur_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
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
