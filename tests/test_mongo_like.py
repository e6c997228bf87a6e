"""LIKE reaches MongoDB only as a regex that cannot backtrack catastrophically (issue 13,
finding 10): a session pattern such as ``%a%b%c...%m`` (26 characters) took 5-13 s of
server CPU as ``^.*a.*b.*c...$``. A pushed regex holds at most one unbounded wildcard
(an unanchored start counts as one); a pattern past that is applied by the connector on
the rows (a bounded literal prefilter narrows the read), never dropped. Results are
checked against DuckDB's LIKE on the same data.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from connectors.base import Pushdown, ScanRequest, to_table
from connectors.mongo import MongoConnection, like_regex
from dsl.ast import Column, Like, Param

EVIL = "%a%b%c%d%e%f%g%h%i%j%k%l%m"  # 26 characters, 13 wildcards


def _regexes(doc: Any) -> list[str]:
    """Every $regex inside a find() filter."""
    if isinstance(doc, dict):
        out = [doc["$regex"]] if "$regex" in doc else []
        for v in doc.values():
            out += _regexes(v)
        return out
    if isinstance(doc, list):
        return [r for v in doc for r in _regexes(v)]
    return []


def _unbounded(rx: str) -> int:
    """Unbounded wildcards a backtracking engine may retry: '.*' and an unanchored start."""
    return rx.count(".*") + (0 if rx.startswith("^") else 1)


@pytest.fixture(scope="module")
def strings() -> list[str | None]:
    rng = random.Random(13)
    alphabet = "ab%_\\\nA"
    out: list[str | None] = [None, "", "abcdefghijklm", "xaxbxcxdxexfxgxhxixjxkxlxmx", "a" * 30]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9))) for _ in range(300)]
    return out


@pytest.fixture(scope="module")
def src(mongo_db: Any, mongo_url: str, strings: list[str | None]) -> Any:
    coll = mongo_db["like_t"]
    coll.delete_many({})
    coll.insert_many([{"i": i, "s": s} for i, s in enumerate(strings)])
    conn = MongoConnection("crm", {"url": mongo_url, "database": mongo_db.name})
    yield conn.source("like_t")
    conn.close()


SENT: dict[str, Any] = {}  # the filter document the latest _fabric scan sent


def _fabric(src: Any, pattern: str, negated: bool = False, ci: bool = False) -> list[int]:
    f = Like(Column("s"), Param("p"), negated=negated, case_insensitive=ci)
    assert src.supports_filter(f) is Pushdown.EXACT
    req = ScanRequest(columns=("i",), filters=(f,), params={"p": pattern})
    out = to_table(src.scan(req), pa.schema([("i", pa.int64())]))
    SENT["filter"] = json.loads(req.metrics.statement)  # the scan's own (ScanMetrics)
    return sorted(out.column("i").to_pylist())


def _duckdb(strings: list[str | None], pattern: str, negated: bool = False) -> list[int]:
    t = pa.table({"i": list(range(len(strings))), "s": strings})  # noqa: F841 (DuckDB reads it)
    op = "NOT LIKE" if negated else "LIKE"
    rows = duckdb.sql(f"SELECT i FROM t WHERE s {op} $p ESCAPE '\\'", params={"p": pattern})
    return sorted(r[0] for r in rows.fetchall())


def test_the_reported_pattern_is_not_a_backtracking_regex(src: Any, strings: list) -> None:
    assert like_regex(EVIL) is None
    got = _fabric(src, EVIL)
    assert got == _duckdb(strings, EVIL) and got  # the filter was applied, not dropped
    pushed = _regexes(SENT["filter"])
    assert pushed == ["a"]  # the longest literal piece narrows the read; bounded
    assert all(_unbounded(rx) <= 1 for rx in pushed)


@pytest.mark.parametrize("negated", [False, True])
def test_like_agrees_with_duckdb(src: Any, strings: list, negated: bool) -> None:
    rng = random.Random(10 + negated)
    pieces = ["a", "b", "%", "_", "\\%", "\\_", "\\\\", "A", "ab"]
    patterns = ["", "%", "%%", "_", "a", "a%", "%a", "%a%", "a%b", "%a%b%", "a%b%a", EVIL]
    patterns += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 6))) for _ in range(80)]
    for p in patterns:
        got = _fabric(src, p, negated)
        assert got == _duckdb(strings, p, negated), p
        for rx in _regexes(SENT["filter"]):
            assert _unbounded(rx) <= 1, (p, rx)


def test_ilike_past_the_bound_is_applied_case_insensitively(src: Any, strings: list) -> None:
    pattern = "%A%B%"
    expect = sorted(
        i for i, s in enumerate(strings) if s is not None and re.search("a.*b", s, re.I | re.S)
    )
    assert _fabric(src, pattern, ci=True) == expect
    assert all(_unbounded(rx) <= 1 for rx in _regexes(SENT["filter"]))
