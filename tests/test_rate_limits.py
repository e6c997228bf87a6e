"""``rate_limit`` and ``retries`` on a connection of any kind (connectors/ratelimit.py's
LimitedSource, applied by the catalog; ``rest`` limits each HTTP request itself, see
tests/test_rest.py).

A real SQLite database through ``kind: sql`` under 8 concurrent callers; a third-party
kind registered the documented way (``register_connection``) whose source records when
each scan reached it and can fail with a retriable error, so the limit and the retries are
observed at the source, not inside the limiter.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import fabric
from connectors import registry
from connectors.base import Connection, ScanRequest, Source, SourceError, UnknownObjectError
from connectors.memory import MemorySource
from dsl.errors import DslError
from fabric.config import load_config


class ClockedSource(MemorySource):
    """An in-memory table that records when each scan arrived and fails the first
    ``fail`` scans as a server that is down would (retriable) or refuses (not)."""

    def __init__(self, uri: str, table: pa.Table):
        super().__init__(uri, table)
        self.arrivals: list[float] = []
        self.fail = 0
        self.retriable = True
        self._lock = threading.Lock()

    def scan(self, request: ScanRequest) -> Iterator[pa.RecordBatch]:
        with self._lock:
            self.arrivals.append(time.monotonic())
            failing = self.fail > 0
            self.fail -= failing
        if failing:
            raise SourceError(self.uri, "connection refused", retriable=self.retriable)
        yield from super().scan(request)


SOURCES: dict[str, ClockedSource] = {}


class ClockedConnection(Connection):
    kind = "clocked"

    def source(self, obj: str, options: Mapping[str, Any] | None = None) -> Source:
        if obj != "t":
            raise UnknownObjectError(f"clocked://{self.name}/{obj}", ["t"])
        src = SOURCES.get(self.name)
        if src is None:
            src = SOURCES[self.name] = ClockedSource(
                f"clocked://{self.name}/t", pa.table({"id": list(range(10))})
            )
        return src


@pytest.fixture(autouse=True, scope="module")
def clocked_kind() -> Iterator[None]:
    registry.register_connection("clocked", ClockedConnection, replace=True)
    yield


def open_fab(tmp_path: Path, connection: str, binding: str) -> Any:
    (tmp_path / "agents").mkdir(exist_ok=True)
    (tmp_path / "fabric.yaml").write_text(f"connections:\n  {connection}\nbindings: [agents/]\n")
    (tmp_path / "agents" / "b.yaml").write_text(binding)
    return fabric.open(tmp_path / "fabric.yaml", watch=False, ingest=False)


CLOCKED_BINDING = """\
binding: b
sources:
  t: {from: clocked://c/t}
select: [t.id]
"""


def test_rate_limit_holds_under_8_concurrent_callers(tmp_path: Path) -> None:
    SOURCES.clear()
    with open_fab(
        tmp_path, "c: {kind: clocked, rate_limit: {per_second: 10, burst: 2}}", CLOCKED_BINDING
    ) as fab:
        errors: list[BaseException] = []

        def caller() -> None:
            try:
                for _ in range(3):
                    assert fab.query("b").table.num_rows == 10
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=caller) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        times = sorted(SOURCES["c"].arrivals)
        assert len(times) == 24
        for i, t in enumerate(times):  # any 1 s window: at most burst + rate
            assert sum(1 for u in times[i:] if u - t < 1.0) <= 12, times
        assert (len(times) - 2) / (times[-1] - times[0]) <= 10.5
        res = fab.query("b")
        assert res.stats["sources"]["t"]["source"]["requests"] == 1
        assert "requests=1 retries=0 throttled=" in fab.explain("b", analyze=True)


def test_without_rate_limit_the_same_callers_go_faster(tmp_path: Path) -> None:
    """The previous test could fail: unlimited, the 24 scans arrive far above 10/s."""
    SOURCES.clear()
    with open_fab(tmp_path, "c: {kind: clocked}", CLOCKED_BINDING) as fab:
        threads = [
            threading.Thread(target=lambda: [fab.query("b") for _ in range(3)]) for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times = sorted(SOURCES["c"].arrivals)
        assert len(times) == 24
        assert max(sum(1 for u in times[i:] if u - t < 1.0) for i, t in enumerate(times)) > 12


def test_a_retriable_failure_is_retried_with_backoff(tmp_path: Path) -> None:
    SOURCES.clear()
    with open_fab(
        tmp_path,
        "c: {kind: clocked, retries: {max: 3, base: 0.05, max_delay: 0.2}}",
        CLOCKED_BINDING,
    ) as fab:
        fab.query("b")  # the source exists now
        SOURCES["c"].fail = 2
        res = fab.query("b")
        assert res.table.num_rows == 10
        m = res.stats["sources"]["t"]["source"]
        assert m["retries"] == 2 and m["requests"] == 3
        SOURCES["c"].fail, SOURCES["c"].retriable = 1, False  # refused for good: no retry
        with pytest.raises(Exception, match="connection refused"):
            fab.query("b")
        assert SOURCES["c"].fail == 0 and len(SOURCES["c"].arrivals) == 1 + 3 + 1
        SOURCES["c"].fail, SOURCES["c"].retriable = 9, True  # down longer than the retries
        with pytest.raises(Exception, match="connection refused"):
            fab.query("b")


def test_a_sql_connection_is_limited_too(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    with sqlite3.connect(db) as c:
        c.execute("create table m (id integer primary key, city text)")
        c.executemany(
            "insert into m values (?, ?)", [(i, "Paris" if i % 2 else "lyon") for i in range(50)]
        )
    binding = """\
binding: b
session: {city: str}
sources:
  m: {from: "sql://shop/m", where: "m.city = {{session.city}}"}
select: [m.id]
"""
    conn = f'shop: {{kind: sql, url: "sqlite:///{db}", rate_limit: {{per_second: 5, burst: 1}}}}'
    with open_fab(tmp_path, conn, binding) as fab:
        t0 = time.monotonic()
        results = []

        def caller() -> None:
            results.append(fab.query("b", {"city": "Paris"}))

        threads = [threading.Thread(target=caller) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        assert [r.table.num_rows for r in results] == [25] * 8
        assert elapsed >= 1.35  # 8 scans at 5/s after a burst of 1: 7 / 5 s at least
        waits = [r.stats["sources"]["m"]["source"]["throttle_wait_ms"] for r in results]
        assert sum(w > 0 for w in waits) >= 1, waits  # the stats say who waited, and how long


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("rate_limit: {burst: 3}", "connection 'c': rate_limit needs per_second"),
        ("rate_limit: {per_second: 5, brust: 3}", "rate_limit has unknown key(s) brust"),
        ("rate_limit: {per_second: -1}", "rate_limit.per_second must be a non-negative number"),
        ("retries: {max: two}", "retries.max must be a non-negative integer"),
    ],
)
def test_bad_limits_are_positioned(tmp_path: Path, option: str, expected: str) -> None:
    p = tmp_path / "fabric.yaml"
    p.write_text(
        f'connections:\n  c:\n    kind: mysql\n    url: "mysql+pymysql://u:p@h/db"\n    {option}\n'
    )
    with pytest.raises(DslError) as ei:
        load_config(p, env={})
    msg = str(ei.value)
    assert expected in msg and "fabric.yaml:5:" in msg, msg


def test_retries_as_a_number_is_the_count(tmp_path: Path) -> None:
    SOURCES.clear()
    with open_fab(tmp_path, "c: {kind: clocked, retries: 2}", CLOCKED_BINDING) as fab:
        fab.query("b")
        SOURCES["c"].fail = 2
        assert fab.query("b").stats["sources"]["t"]["source"]["retries"] == 2
        SOURCES["c"].fail = 3
        with pytest.raises(Exception, match="connection refused"):
            fab.query("b")
