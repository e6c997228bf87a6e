"""An ordered index for one column: exact range counts and range row sets.

Layout (an LSM-style ordered structure, not a re-sort per query):

- ``main``: two sorted numpy arrays (``keys``, ``rowids``), searched by binary search;
- ``dead``: a roaring bitmap of *positions* in ``main`` whose rows were deleted, so a
  range count is ``(hi - lo) - dead.range_cardinality(lo, hi)``, exact in O(log n);
- ``delta``: a ``SortedList`` of ``(key, rowid)`` for rows added since the last merge;
- ``by_rowid``: the key of every row by row id, to test a range on a small candidate set
  without touching the tree.

A float (or decimal) key is an order-preserving int64 (``float_keys``): NaN one key above
+inf whatever its bits, -0.0 the key of 0.0, as DuckDB orders and compares them (and the
fabric's pyarrow filters). IEEE floats in the arrays had no place for NaN: numpy sorts it
last, a ``SortedList`` of (key, rowid) nowhere, and ``f > 1`` missed rows that were not NaN.

The delta is merged into ``main`` (one argsort) when it outgrows an eighth of ``main`` or
when a quarter of ``main`` is dead: amortized O(log n) per insert.
"""

from __future__ import annotations

import array
import datetime as _dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyroaring import BitMap
from sortedcontainers import SortedList

from indexes.spec import DatasetError

_INF = float("inf")
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_US = _dt.timedelta(microseconds=1)
_LOW63 = np.int64(0x7FFFFFFFFFFFFFFF)


def float_keys(x: np.ndarray) -> np.ndarray:
    """Floats -> int64 keys in DuckDB's order: -inf < ... < -0.0 = 0.0 < ... < +inf < NaN,
    every NaN one key. A negative float's bits order backwards, so its 63 low bits are
    flipped; -0.0 + 0.0 is 0.0, and NaN is replaced by numpy's (positive) NaN first."""
    x = np.asarray(x, dtype=np.float64)
    x = np.where(np.isnan(x), np.nan, x) + 0.0
    i = x.view(np.int64)
    return np.where(i < 0, i ^ _LOW63, i)


def float_values(k: np.ndarray) -> np.ndarray:
    """The inverse of ``float_keys`` (NaN and 0.0 for the folded keys)."""
    k = np.asarray(k, dtype=np.int64)
    return np.where(k < 0, k ^ _LOW63, k).view(np.float64)


@dataclass(frozen=True)
class Range:
    """``lo <(=) key <(=) hi``; None means unbounded."""

    lo: Any = None
    hi: Any = None
    lo_inclusive: bool = True
    hi_inclusive: bool = True

    @staticmethod
    def point(v: Any) -> Range:
        return Range(v, v, True, True)


def key_kind(t: pa.DataType) -> str:
    if (
        pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_duration(t)
    ):
        return "int"
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "int"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    raise DatasetError(
        f"a btree index needs an ordered scalar column (number, timestamp, date, string), not {t}"
    )


def bitmap_of(rowids: np.ndarray) -> BitMap:
    """A BitMap from a uint32-compatible numpy array (fast path through array.array)."""
    a = array.array("I")
    a.frombytes(np.ascontiguousarray(rowids, dtype=np.uint32).tobytes())
    return BitMap(a)


def array_of(bm: BitMap) -> np.ndarray:
    return np.frombuffer(bm.to_array(), dtype=np.uint32)


BULK_ROWS = 1024  # non-null rows of one add() that bypass the delta


class BTreeIndex:
    def __init__(self, column: str, type_: pa.DataType):
        self.column = column
        self.type = type_
        self.kind = key_kind(type_)
        self.dtype: Any = {"int": np.int64, "float": np.int64, "str": object}[self.kind]
        self.keys = np.empty(0, dtype=self.dtype)
        self.rowids = np.empty(0, dtype=np.uint32)
        self.dead = BitMap()
        self.delta: SortedList = SortedList()
        self.by_rowid = np.zeros(0, dtype=self.dtype)
        self.main_pos = np.zeros(0, dtype=np.int64)  # rowid -> position in main, -1 if not there
        self.nulls = BitMap()
        self.live = 0

    # ------------------------------------------------------------------ keys
    def to_keys(self, values: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """Column values -> (key array, null mask)."""
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
        nulls = (
            values.is_null().to_numpy(zero_copy_only=False)
            if values.null_count
            else np.zeros(len(values), bool)
        )
        t = values.type
        if (
            pa.types.is_timestamp(t)
            or pa.types.is_duration(t)
            or pa.types.is_time(t)
            or pa.types.is_date(t)
        ):
            if pa.types.is_timestamp(t):
                values = values.cast(pa.timestamp("us", t.tz))
            values = (
                values.view(pa.int64())
                if values.type.bit_width == 64
                else values.cast(pa.int32()).cast(pa.int64())
            )
        elif pa.types.is_boolean(t):
            values = values.cast(pa.int64())
        if self.kind == "str":
            keys = np.array(values.to_pylist(), dtype=object)
        elif self.kind == "float":
            keys = float_keys(values.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64))
        else:
            keys = values.fill_null(0).to_numpy(zero_copy_only=False).astype(self.dtype, copy=False)
        return keys, nulls

    def key_of(self, v: Any) -> Any:
        """A query constant -> a comparable key (timestamps to epoch microseconds)."""
        if self.kind == "str":
            if not isinstance(v, str):
                raise DatasetError(
                    f"column {self.column!r} holds strings; cannot compare it with {v!r}"
                )
            return v
        if (
            isinstance(v, int | float)
            and not isinstance(v, bool)
            and not pa.types.is_timestamp(self.type)
            and not pa.types.is_date(self.type)
        ):
            if self.kind != "float":
                return v
            try:
                f = float(v)
            except OverflowError:  # an int past float's range: beyond every finite key
                f = _INF if v > 0 else -_INF
            return int(float_keys(np.array([f]))[0])
        if isinstance(v, _dt.datetime) and pa.types.is_timestamp(self.type):
            if v.tzinfo is None:
                v = v.replace(tzinfo=_dt.UTC)
            return (v - _EPOCH) // _US
        try:
            arr = pa.array([v]).cast(self.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise DatasetError(
                f"cannot compare column {self.column!r} ({self.type}) with {v!r}: {e}"
            ) from None
        return self.to_keys(arr)[0][0].item() if self.kind != "str" else arr[0].as_py()

    def _norm(self, r: Range) -> tuple[Any, bool, Any, bool]:
        lo = None if r.lo is None else self.key_of(r.lo)
        hi = None if r.hi is None else self.key_of(r.hi)
        lo_inc, hi_inc = r.lo_inclusive, r.hi_inclusive
        if self.kind == "int":  # float bounds on integer keys: round inward
            if isinstance(lo, float):
                lo, lo_inc = (int(lo), lo_inc) if lo.is_integer() else (math.ceil(lo), True)
            if isinstance(hi, float):
                hi, hi_inc = (int(hi), hi_inc) if hi.is_integer() else (math.floor(hi), True)
        return lo, lo_inc, hi, hi_inc

    # ------------------------------------------------------------------ updates
    def _grow(self, n: int) -> None:
        if n > len(self.by_rowid):
            cap = max(n, 2 * len(self.by_rowid), 1024)
            b = np.zeros(cap, dtype=self.dtype)
            b[: len(self.by_rowid)] = self.by_rowid
            p = np.full(cap, -1, dtype=np.int64)
            p[: len(self.main_pos)] = self.main_pos
            self.by_rowid, self.main_pos = b, p

    def add(self, rowids: np.ndarray, values: pa.Array | pa.ChunkedArray) -> None:
        keys, nulls = self.to_keys(values)
        rowids = np.asarray(rowids, dtype=np.int64)
        self._grow(int(rowids.max()) + 1 if len(rowids) else 0)
        self.by_rowid[rowids] = keys
        self.main_pos[rowids] = -1
        if nulls.any():
            self.nulls.update(rowids[nulls].tolist())
        ok = ~nulls
        nok = int(ok.sum())
        self.live += nok
        if nok >= BULK_ROWS and self.kind != "str":
            self._insert_sorted(keys[ok], rowids[ok])
            return
        self.delta.update(zip(keys[ok].tolist(), rowids[ok].tolist()))
        if len(self.delta) > max(1024, len(self.keys) // 8):
            self.merge()

    def _insert_sorted(self, keys: np.ndarray, rowids: np.ndarray) -> None:
        """A large batch goes straight into the main arrays (a sort of the batch and a
        linear merge in numpy) instead of through the SortedList delta."""
        if self.dead or self.delta:
            self.merge()
        order = np.argsort(keys, kind="stable")
        keys, rowids = keys[order], rowids[order].astype(np.uint32)
        pos = np.searchsorted(self.keys, keys, side="right")  # after equal keys, like merge()
        self.keys = np.insert(self.keys, pos, keys)
        self.rowids = np.insert(self.rowids, pos, rowids)
        self.main_pos[self.rowids.astype(np.int64)] = np.arange(len(self.rowids), dtype=np.int64)

    def remove(self, rowids: Iterable[int]) -> None:
        for r in rowids:
            r = int(r)
            if r in self.nulls:
                self.nulls.discard(r)
                continue
            p = int(self.main_pos[r])
            if p >= 0:
                self.dead.add(p)
                self.main_pos[r] = -1
            else:
                k = self.by_rowid[r]
                self.delta.discard((k.item() if hasattr(k, "item") else k, r))
            self.live -= 1
        if len(self.dead) > max(1024, len(self.keys) // 4):
            self.merge()

    def merge(self) -> None:
        """Fold the delta and drop dead entries: one stable argsort over live keys."""
        keep = np.ones(len(self.keys), dtype=bool)
        if self.dead:
            keep[array_of(self.dead)] = False
        dk = (
            np.array([k for k, _ in self.delta], dtype=self.dtype)
            if self.delta
            else np.empty(0, self.dtype)
        )
        dr = np.array([r for _, r in self.delta], dtype=np.uint32)
        keys = np.concatenate([self.keys[keep], dk])
        rowids = np.concatenate([self.rowids[keep], dr])
        order = np.argsort(keys, kind="stable")
        self.keys, self.rowids = keys[order], rowids[order]
        self.dead = BitMap()
        self.delta = SortedList()
        self.main_pos[self.rowids.astype(np.int64)] = np.arange(len(self.rowids), dtype=np.int64)

    # ------------------------------------------------------------------ queries
    def _bounds(self, lo: Any, lo_inc: bool, hi: Any, hi_inc: bool) -> tuple[int, int]:
        a = 0 if lo is None else int(np.searchsorted(self.keys, lo, "left" if lo_inc else "right"))
        b = (
            len(self.keys)
            if hi is None
            else int(np.searchsorted(self.keys, hi, "right" if hi_inc else "left"))
        )
        return a, max(a, b)

    def _delta_slice(self, lo: Any, lo_inc: bool, hi: Any, hi_inc: bool) -> tuple[int, int]:
        d = self.delta
        a = 0 if lo is None else d.bisect_left((lo, -1) if lo_inc else (lo, _INF))
        b = len(d) if hi is None else d.bisect_left((hi, _INF) if hi_inc else (hi, -1))
        return a, max(a, b)

    def _points(self, ranges: Sequence[Range]) -> np.ndarray | None:
        """The keys, when every range is a single value (an ``in`` list) over a numeric
        column: counted and tested in one vectorized pass instead of range by range."""
        if len(ranges) < 4 or self.kind == "str":
            return None
        pts = []
        for r in ranges:
            if r.lo is None or r.hi is None:
                return None
            lo, lo_inc, hi, hi_inc = self._norm(r)  # keys: NaN is a point too
            if lo == hi and lo_inc and hi_inc:
                pts.append(lo)
            elif not (lo > hi or (lo == hi and not (lo_inc and hi_inc))):
                return None
        return np.unique(np.array(pts, dtype=self.dtype))

    def count(self, ranges: Sequence[Range]) -> int:
        """Exact number of live rows whose key falls in any of ``ranges`` (assumed disjoint)."""
        pts = self._points(ranges)
        if pts is not None and not self.dead and not self.delta:
            left = np.searchsorted(self.keys, pts, "left")
            return int((np.searchsorted(self.keys, pts, "right") - left).sum())
        total = 0
        # a range given twice counts once: in (NaN, NaN) holds two NaNs of other objects
        for lo, lo_inc, hi, hi_inc in dict.fromkeys(self._norm(r) for r in ranges):
            a, b = self._bounds(lo, lo_inc, hi, hi_inc)
            total += (b - a) - (self.dead.range_cardinality(a, b) if self.dead and b > a else 0)
            if self.delta:
                da, db = self._delta_slice(lo, lo_inc, hi, hi_inc)
                total += db - da
        return total

    def rows(self, ranges: Sequence[Range]) -> BitMap:
        out = BitMap()
        for r in ranges:
            lo, lo_inc, hi, hi_inc = self._norm(r)
            a, b = self._bounds(lo, lo_inc, hi, hi_inc)
            ids = self.rowids[a:b]
            if self.dead and self.dead.range_cardinality(a, b):
                mask = np.ones(b - a, dtype=bool)
                dp = array_of(self.dead).astype(np.int64)
                dp = dp[(dp >= a) & (dp < b)]
                mask[dp - a] = False
                ids = ids[mask]
            out |= bitmap_of(np.sort(ids))  # sorted input builds roaring containers ~2x faster
            if self.delta:
                da, db = self._delta_slice(lo, lo_inc, hi, hi_inc)
                if db > da:
                    out.update([rid for _, rid in self.delta.islice(da, db)])
        return out

    def test(self, rowids: np.ndarray, ranges: Sequence[Range]) -> np.ndarray:
        """Boolean mask: which of ``rowids`` (live rows) have a key inside ``ranges``."""
        keys = self.by_rowid[rowids.astype(np.int64)]
        pts = self._points(ranges)
        if pts is not None:
            mask = np.isin(keys, pts)
            if self.nulls:
                mask &= ~np.isin(rowids, array_of(self.nulls))
            return mask
        mask = np.zeros(len(rowids), dtype=bool)
        for r in ranges:
            lo, lo_inc, hi, hi_inc = self._norm(r)
            m = np.ones(len(rowids), dtype=bool)
            if lo is not None:
                m &= (keys >= lo) if lo_inc else (keys > lo)
            if hi is not None:
                m &= (keys <= hi) if hi_inc else (keys < hi)
            mask |= m
        if self.nulls:
            mask &= ~np.isin(rowids, array_of(self.nulls))
        return mask

    def min_max(self) -> tuple[Any, Any]:
        """Smallest and largest live key (read-only: skips dead positions, looks at the delta)."""
        lo = hi = None
        n = len(self.keys)
        i, j = 0, n - 1
        while i < n and i in self.dead:
            i += 1
        while j >= 0 and j in self.dead:
            j -= 1
        if i <= j:
            lo, hi = self.keys[i], self.keys[j]
        if self.delta:
            dlo, dhi = self.delta[0][0], self.delta[-1][0]
            lo = dlo if lo is None or dlo < lo else lo
            hi = dhi if hi is None or dhi > hi else hi
        if lo is None:
            return None, None
        return self._to_py(lo), self._to_py(hi)

    def _to_py(self, k: Any) -> Any:
        if self.kind == "str":
            return k
        if self.kind == "float":
            return float(float_values(np.array([k]))[0])
        if pa.types.is_timestamp(self.type):
            return pa.scalar(int(k), pa.int64()).cast(pa.timestamp("us", self.type.tz)).as_py()
        return k.item() if hasattr(k, "item") else k

    def nbytes(self) -> int:
        per = 8 if self.kind != "str" else 8 + 50
        return (
            (len(self.keys) + len(self.by_rowid)) * per
            + len(self.rowids) * 4
            + len(self.main_pos) * 8
            + len(self.delta) * 80
        )

    # ------------------------------------------------------------------ persistence
    def state(self) -> dict[str, np.ndarray]:
        self.merge()
        return {
            "keys": self.keys,
            "rowids": self.rowids,
            "by_rowid": self.by_rowid,
            "main_pos": self.main_pos,
            "nulls": np.frombuffer(self.nulls.serialize(), dtype=np.uint8),
        }

    def restore(self, st: dict[str, np.ndarray]) -> None:
        self.keys = st["keys"]
        self.rowids = st["rowids"]
        self.by_rowid = st["by_rowid"]
        self.main_pos = st["main_pos"]
        if self.kind == "float" and self.keys.dtype.kind == "f":  # saved before float_keys
            order = np.argsort(float_keys(self.keys), kind="stable")
            self.keys, self.rowids = float_keys(self.keys)[order], self.rowids[order]
            self.by_rowid = float_keys(self.by_rowid)
            self.main_pos[self.rowids.astype(np.int64)] = np.arange(len(self.rowids))
        self.nulls = BitMap.deserialize(st["nulls"].tobytes())
        self.live = len(self.keys)
        self.dead, self.delta = BitMap(), SortedList()


def not_nulls(values: pa.Array) -> np.ndarray:
    return pc.is_valid(values).to_numpy(zero_copy_only=False)
