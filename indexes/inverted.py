"""Inverted index: token -> roaring bitmap of row ids, with exact document frequencies.

Text columns are tokenized like ``match()`` in ``connectors.arrow_expr`` (lower-cased
``\\w+`` words), so an indexed ``match(body, 'fed rates')`` and the same predicate applied
by pyarrow agree row for row. List columns (tags) index every word of every element.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from pyroaring import BitMap

from connectors.arrow_expr import match_tokens
from indexes.btree import bitmap_of
from indexes.spec import DatasetError


def check_type(column: str, t: pa.DataType) -> None:
    ok = pa.types.is_string(t) or pa.types.is_large_string(t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        ok = pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)
    if not ok:
        raise DatasetError(
            f"an inverted index needs a string or list<string> column; {column!r} is {t}"
        )


def doc_tokens(value: Any) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, str):
        return set(match_tokens(value))
    out: set[str] = set()
    for v in value:  # list column
        if v is not None:
            out.update(match_tokens(v))
    return out


class InvertedIndex:
    def __init__(self, column: str, type_: pa.DataType):
        check_type(column, type_)
        self.column = column
        self.type = type_
        self.postings: dict[str, BitMap] = {}

    def add(self, rowids: np.ndarray, values: pa.Array | pa.ChunkedArray) -> None:
        acc: dict[str, list[int]] = defaultdict(list)
        for rid, v in zip(rowids.tolist(), values.to_pylist()):
            for t in doc_tokens(v):
                acc[t].append(rid)
        for t, ids in acc.items():
            bm = self.postings.get(t)
            new = bitmap_of(np.array(ids, dtype=np.uint32))
            if bm is None:
                self.postings[t] = new
            else:
                bm |= new

    def remove(self, rowids: Iterable[int], values: Sequence[object]) -> None:
        for rid, v in zip(rowids, values):
            for t in doc_tokens(v):
                bm = self.postings.get(t)
                if bm is not None:
                    bm.discard(int(rid))
                    if not bm:
                        del self.postings[t]

    def df(self, token: str) -> int:
        """Document frequency of one token (exact)."""
        bm = self.postings.get(token.lower())
        return len(bm) if bm is not None else 0

    def match(self, tokens: Sequence[str]) -> BitMap:
        """Rows containing every token (an empty query matches nothing)."""
        if not tokens:
            return BitMap()
        bms = sorted((self.postings.get(t, BitMap()) for t in tokens), key=len)
        out = bms[0].copy()
        for b in bms[1:]:
            out &= b
        return out

    def match_count(self, tokens: Sequence[str]) -> int:
        if not tokens:
            return 0
        bms = sorted((self.postings.get(t, BitMap()) for t in tokens), key=len)
        if len(bms) == 1:
            return len(bms[0])
        if len(bms) == 2:
            return bms[0].intersection_cardinality(bms[1])
        return len(self.match(tokens))

    def nbytes(self) -> int:
        return sum(len(b.serialize()) + 64 + len(t) for t, b in self.postings.items())

    # persistence: tokens in one list, bitmaps concatenated
    def state(self) -> tuple[list[str], bytes, list[int]]:
        toks = list(self.postings)
        blobs = [self.postings[t].serialize() for t in toks]
        return toks, b"".join(blobs), [len(b) for b in blobs]

    def restore(self, toks: list[str], blob: bytes, sizes: list[int]) -> None:
        self.postings, off = {}, 0
        for t, n in zip(toks, sizes):
            self.postings[t] = BitMap.deserialize(blob[off : off + n])
            off += n
