"""Embeddings computed by the fabric: at ingest (``embed:`` of a dataset) and of session
values (``{{embed(session.question)}}`` in ``nearest.to``).

A dataset in fabric.yaml declares ``embed: {from: body, into: embedding, model: hash}`` (or
a list of them): as rows arrive (Kafka feeds, refreshes, upserts) the fabric computes the
``into`` vector column from the ``from`` text column for every row that does not carry
one (the column absent, or null), in batches of ``BATCH`` (1024) texts, before the rows reach
the indexes. A row that carries a vector keeps it. A null text embeds as the empty text.

Models are named; ``embedder(name)`` resolves one:

- ``hash`` (the default; offline, no weights): hashed character n-grams. Each text is
  lower-cased and padded with one space each side; every 3-, 4- and 5-gram of its UTF-8
  bytes is hashed (64-bit polynomial hash, splitmix64 finalizer, salted by n) into one of
  the vector's N buckets (``(h >> 33) * N >> 31``) with a sign from the hash's top bit
  (signed feature hashing); the
  counts are L2-normalized (an empty text is the zero vector). Deterministic across
  processes and machines, and a text's vector does not depend on the batch it is in.
- ``module:function``: a Python callable taking a list of texts and returning an
  ``(n, N)`` array-like (N the column's width).
- ``sentence-transformers:<model name or path>``: a SentenceTransformer loaded from the
  local cache only (``local_files_only``), when the package is installed.
- any name given to ``register(name, fn)``.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dsl.errors import FabricError, Span

#: texts -> (n, dim) float32 vectors
Embedder = Callable[[Sequence[str], int], np.ndarray]

BATCH = 1024  # texts embedded per call (a 384-d batch's counts: 3 MB)
NGRAMS = (3, 4, 5)
DEFAULT_MODEL = "hash"
_PRIME = np.uint64(1099511628211)  # FNV-64 prime, as the polynomial base
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class EmbedError(FabricError, ValueError):
    """A model that cannot be found or loaded, or returned vectors of the wrong shape."""


@dataclass(frozen=True)
class EmbedSpec:
    """``embed: {from: body, into: embedding, model: hash}`` of one dataset."""

    source: str
    into: str
    model: str = DEFAULT_MODEL
    span: Span | None = field(default=None, compare=False)


# ---------------------------------------------------------------- the built-in model


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 arithmetic wraps)."""
    h = h ^ (h >> np.uint64(30))
    h = h * _M1
    h = h ^ (h >> np.uint64(27))
    h = h * _M2
    return h ^ (h >> np.uint64(31))


def hash_embed(texts: Sequence[str | None], dim: int) -> np.ndarray:
    """Signed hashed character 3-5-grams into ``dim`` buckets, L2-normalized, float32."""
    n = len(texts)
    if n == 0:
        return np.zeros((0, dim), dtype=np.float32)
    encoded = [f" {(t or '').lower()} ".encode() for t in texts]
    lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=n)
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.uint64)
    owner = np.repeat(np.arange(n, dtype=np.int64), lengths)  # text of each byte
    total = len(data)
    cells: list[np.ndarray] = []  # row * dim + bucket of every n-gram
    signs: list[np.ndarray] = []
    with np.errstate(over="ignore"):
        for g in NGRAMS:
            if total < g:
                continue
            m = total - g + 1
            h = np.zeros(m, dtype=np.uint64)
            for j in range(g):
                h = h * _PRIME + data[j : j + m]
            ok = owner[:m] == owner[g - 1 :]  # the window lies inside one text
            h = _mix(h[ok] ^ np.uint64(g * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF))
            # bucket: the top 31 bits scaled to [0, dim) (multiply-shift, no 64-bit modulo)
            bucket = ((h >> np.uint64(33)) * np.uint64(dim)) >> np.uint64(31)
            cells.append(owner[:m][ok] * dim + bucket.astype(np.int64))
            signs.append(np.where((h >> np.uint64(63)) == 1, -1.0, 1.0))
    flat = (
        np.bincount(np.concatenate(cells), weights=np.concatenate(signs), minlength=n * dim)
        if cells
        else np.zeros(n * dim)
    )
    out = flat.reshape(n, dim)
    norms = np.sqrt(np.einsum("ij,ij->i", out, out))
    norms[norms == 0] = 1.0
    return (out / norms[:, None]).astype(np.float32)


# ---------------------------------------------------------------- the registry

_REGISTRY: dict[str, Embedder] = {"hash": hash_embed}
_LOADED: dict[str, Embedder] = {}
_LOCK = threading.Lock()


def register(name: str, fn: Embedder) -> None:
    """Name a model: ``fn(texts, dim) -> (n, dim)`` vectors."""
    _REGISTRY[name] = fn


def check_model(name: str) -> str | None:
    """Why ``name`` cannot name a model (without loading it), or None."""
    if name in _REGISTRY:
        return None
    kind, sep, rest = name.partition(":")
    if sep and kind and rest:
        return None
    return (
        f"unknown embedding model '{name}'; models: {', '.join(sorted(_REGISTRY))}, "
        "'module:function' (a Python callable) or 'sentence-transformers:<model>'"
    )


def _callable(path: str) -> Embedder:
    mod, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise EmbedError(
            f"embedding model '{path}': cannot import {attr} from {mod} ({e}); "
            "give module:function of an importable callable"
        ) from None

    def run(texts: Sequence[str], dim: int) -> np.ndarray:
        return np.asarray(fn(list(texts)), dtype=np.float32)

    return run


def _sentence_transformers(model: str) -> Embedder:
    try:
        from sentence_transformers import SentenceTransformer  # type: ignore[import-not-found]
    except ImportError:
        raise EmbedError(
            f"embedding model 'sentence-transformers:{model}' needs the sentence-transformers "
            "package: pip install sentence-transformers (and the model in the local cache)"
        ) from None
    try:
        st = SentenceTransformer(model, local_files_only=True)
    except Exception as e:
        raise EmbedError(
            f"embedding model 'sentence-transformers:{model}' is not available offline ({e}); "
            "download it once into the Hugging Face cache or give a local path"
        ) from None

    def run(texts: Sequence[str], dim: int) -> np.ndarray:
        return np.asarray(st.encode(list(texts), batch_size=256), dtype=np.float32)

    return run


def embedder(name: str) -> Embedder:
    """The model named ``name`` (loaded once per process)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    with _LOCK:
        if name not in _LOADED:
            problem = check_model(name)
            if problem:
                raise EmbedError(problem)
            kind, _, rest = name.partition(":")
            _LOADED[name] = (
                _sentence_transformers(rest) if kind == "sentence-transformers" else _callable(name)
            )
        return _LOADED[name]


def embed(texts: Sequence[str | None], dim: int, model: str = DEFAULT_MODEL) -> np.ndarray:
    """``(len(texts), dim)`` float32 vectors of ``model``, computed BATCH texts at a time."""
    fn = embedder(model)
    strs = ["" if t is None else str(t) for t in texts]
    parts = [fn(strs[i : i + BATCH], dim) for i in range(0, len(strs), BATCH)]
    out = np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)
    if out.shape != (len(strs), dim):
        raise EmbedError(
            f"embedding model '{model}' returned shape {out.shape}; the column needs "
            f"({len(strs)}, {dim}): one vector[{dim}] per text"
        )
    return out.astype(np.float32, copy=False)


def embed_one(text: Any, model: str, dim: int) -> list[float]:
    """One session value's vector (``{{embed(session.q)}}``)."""
    if not isinstance(text, str):
        raise EmbedError(f"embed() needs text, got {type(text).__name__}")
    return embed([text], dim, model)[0].tolist()


# ---------------------------------------------------------------- at ingest


def filler(specs: Iterable[EmbedSpec], schema: pa.Schema) -> Callable[[Any], pa.Table] | None:
    """``fill(rows) -> rows`` computing each spec's missing vectors; None without specs."""
    specs = tuple(specs)
    if not specs:
        return None
    dims = {s.into: schema.field(s.into).type.list_size for s in specs}
    types = {s.into: schema.field(s.into).type for s in specs}

    def fill(table: pa.Table | pa.RecordBatch) -> pa.Table:
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        for s in specs:
            if table.num_rows == 0 or s.source not in table.column_names:
                continue  # the schema check names what is missing
            if s.into in table.column_names:
                have = table.column(s.into)
                if not have.null_count:
                    continue
                need = np.flatnonzero(pc.is_null(have).to_numpy(zero_copy_only=False))
            else:
                have, need = None, np.arange(table.num_rows)
            texts = table.column(s.source).take(pa.array(need)).to_pylist()
            vecs = embed(texts, dims[s.into], s.model)
            if have is None or len(need) == table.num_rows:
                col = pa.FixedSizeListArray.from_arrays(
                    pa.array(vecs.reshape(-1), pa.float32()), dims[s.into]
                ).cast(types[s.into])
            else:
                full = np.zeros((table.num_rows, dims[s.into]), np.float32)
                keep = np.flatnonzero(pc.is_valid(have).to_numpy(zero_copy_only=False))
                old = have.take(pa.array(keep)).combine_chunks().flatten()
                full[keep] = old.to_numpy(zero_copy_only=False).reshape(-1, dims[s.into])
                full[need] = vecs
                col = pa.FixedSizeListArray.from_arrays(
                    pa.array(full.reshape(-1), pa.float32()), dims[s.into]
                ).cast(types[s.into])
            if have is None:
                table = table.append_column(s.into, col)
            else:
                table = table.set_column(table.column_names.index(s.into), s.into, col)
        return table

    return fill
