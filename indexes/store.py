"""Saving a dataset to a directory and reopening it without rebuilding any index.

Layout of ``<dir>``:

- ``meta.json``: name, key, index specs, row-id counters, format version;
- ``schema.arrow``: the Arrow schema (IPC);
- ``rows.arrow``: every stored row's scalar columns (IPC file, row id == position);
- ``live.roaring``: the live row ids;
- ``vectors.<col>.npy`` + ``hnsw.<col>.bin``: vectors and the hnswlib graph (save_index);
- ``btree.<col>.npz`` (+ ``btree.<col>.{keys,by_rowid}.arrow`` for string keys): the merged B-tree;
- ``inverted.<col>.json`` + ``inverted.<col>.bin``: terms and their serialized bitmaps.

Writes go to ``<dir>.tmp`` and are renamed into place, so a crash leaves the old copy.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from indexes.btree import array_of
from indexes.spec import DatasetError, IndexSpec

FORMAT_VERSION = 1


def save(ds: Any, directory: str) -> None:
    directory = os.path.abspath(directory)
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {
        "format": FORMAT_VERSION,
        "name": ds.name,
        "key": ds.key,
        "indexes": {c: s.to_json() for c, s in ds.specs.items()},
        "n": ds.n,
        "vectors": {
            c: {"n": v.n, "folded": v.folded, "in_graph": v.in_graph, "fold_rows": v.fold_rows}
            for c, v in ds.vectors.items()
        },
    }
    with open(os.path.join(tmp, "schema.arrow"), "wb") as f:
        f.write(ds.schema.serialize().to_pybytes())
    with (
        pa.OSFile(os.path.join(tmp, "rows.arrow"), "wb") as f,
        pa.ipc.new_file(f, ds.scalar_schema) as w,
    ):
        for b in ds._batches:
            w.write_batch(b)
    with open(os.path.join(tmp, "live.roaring"), "wb") as f:
        f.write(ds.live.serialize())
    for vi in ds.vectors.values():
        vi.save(tmp)
    for c, bt in ds.btrees.items():
        st = bt.state()
        if bt.kind == "str":
            for part in ("keys", "by_rowid"):
                vals = [v if isinstance(v, str) else None for v in st.pop(part)]
                _write_table(
                    os.path.join(tmp, f"btree.{c}.{part}.arrow"),
                    pa.table({part: pa.array(vals, pa.string())}),
                )
        np.savez(os.path.join(tmp, f"btree.{c}.npz"), **st)
    for c, inv in ds.inverted.items():
        toks, blob, sizes = inv.state()
        with open(os.path.join(tmp, f"inverted.{c}.json"), "w") as jf:
            json.dump({"terms": toks, "sizes": sizes}, jf)
        with open(os.path.join(tmp, f"inverted.{c}.bin"), "wb") as bf:
            bf.write(blob)
    if ds.cost_model is not None:
        ds.cost_model.save(os.path.join(tmp, "costs.json"))
    with open(os.path.join(tmp, "meta.json"), "w") as mf:
        json.dump(meta, mf, indent=1)
    if os.path.exists(directory):
        old = directory + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
        os.rename(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, directory)


def load(cls: Any, directory: str) -> Any:
    path = os.path.join(directory, "meta.json")
    if not os.path.exists(path):
        raise DatasetError(
            f"{directory} is not a saved dataset (no meta.json); save one with Dataset.save(directory)"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise DatasetError(
            f"{directory}: dataset format {meta.get('format')} is not supported (expected {FORMAT_VERSION})"
        )
    with open(os.path.join(directory, "schema.arrow"), "rb") as f:
        schema = pa.ipc.read_schema(pa.py_buffer(f.read()))
    specs = {c: IndexSpec(**s) for c, s in meta["indexes"].items()}
    fold = next(iter(meta["vectors"].values()))["fold_rows"] if meta["vectors"] else 2048
    ds = cls(meta["name"], schema, meta["key"], specs, fold_rows=fold)
    with pa.memory_map(os.path.join(directory, "rows.arrow")) as src:
        table = pa.ipc.open_file(src).read_all()
    ds._batches = table.combine_chunks().to_batches() if table.num_rows else []
    ds.n = meta["n"]
    with open(os.path.join(directory, "live.roaring"), "rb") as f:
        ds.live = BitMap.deserialize(f.read())
    ds.alive = np.zeros(max(ds.n, 1024), dtype=bool)
    ds.alive[array_of(ds.live).astype(np.int64)] = True
    keys = table.column(ds.key)
    live_ids = array_of(ds.live).astype(np.int64)
    ds.rowid_of = dict(zip(keys.take(pa.array(live_ids)).to_pylist(), live_ids.tolist()))
    for c, vi in ds.vectors.items():
        m = meta["vectors"][c]
        vi.load(directory, m["n"], m["folded"], m["in_graph"])
    for c, bt in ds.btrees.items():
        with np.load(os.path.join(directory, f"btree.{c}.npz"), allow_pickle=False) as z:
            st = {k: z[k] for k in z.files}
        if bt.kind == "str":
            for part in ("keys", "by_rowid"):
                with pa.memory_map(os.path.join(directory, f"btree.{c}.{part}.arrow")) as src:
                    st[part] = np.array(
                        pa.ipc.open_file(src).read_all().column(part).to_pylist(), dtype=object
                    )
        bt.restore(st)
    for c, inv in ds.inverted.items():
        with open(os.path.join(directory, f"inverted.{c}.json")) as f:
            j = json.load(f)
        with open(os.path.join(directory, f"inverted.{c}.bin"), "rb") as f:
            inv.restore(j["terms"], f.read(), j["sizes"])
        # BM25 statistics are recomputed from the live rows' text (exact by construction)
        inv.rebuild_stats(live_ids, table.column(c).take(pa.array(live_ids)))
    cpath = os.path.join(directory, "costs.json")
    if os.path.exists(cpath):
        from indexes.cost import CostModel

        ds.cost_model = CostModel.load(cpath)
    ds.directory = os.path.abspath(directory)
    return ds


def _write_table(path: str, table: pa.Table) -> None:
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
