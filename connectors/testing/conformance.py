"""The conformance suite every connector's tests subclass (after fsspec's tests/abstract).

A subclass provides the ``source`` fixture: a connector Source over the 200 merchants of
``connectors.testing.data`` (``data.table()``) on its real server. ``fabric_scan`` plays
the fabric's part: it asks ``supports_filter`` per conjunct, pushes EXACT/INEXACT ones,
pushes limit/order only when every filter is EXACT (and the source has the capability),
and re-applies non-EXACT filters with ``fabric.functions.filter_table`` (as the executor)
- so a wrong EXACT claim or a dropped filter shows up as wrong rows.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pyarrow as pa
import pytest

from connectors._util import BadValueError, typed_params
from connectors.base import (
    Capability,
    Pushdown,
    ScanMetrics,
    ScanRequest,
    Source,
    SourceLike,
    UnknownColumnError,
    as_capabilities,
)
from connectors.testing import data
from dsl.ast import Binary, Column, Expr, InList, Param, SortKey
from fabric import functions
from fabric.errors import FabricError


def _key(k: SortKey) -> str:
    assert isinstance(k.expr, Column), f"the suite orders by columns, not {k.expr}"
    return k.expr.name


def fabric_scan(
    source: Source,
    filters: list[Expr],
    params: dict[str, Any] | None = None,
    *,
    columns: list[str] | None = None,
    order_by: tuple[SortKey, ...] = (),
    limit: int | None = None,
) -> tuple[pa.Table, list[Pushdown], pa.Table]:
    """(result, answers, raw scan output) the way the planner and executor would do it."""
    params = params or {}
    answers = [source.supports_filter(f) for f in filters]
    pushed = tuple(f for f, a in zip(filters, answers) if a is not Pushdown.UNSUPPORTED)
    residual = [f for f, a in zip(filters, answers) if a is not Pushdown.EXACT]
    all_exact = not residual
    need = None
    if columns is not None:
        extra = {c.name for f in residual for c in f.columns()} | {_key(k) for k in order_by}
        need = tuple(dict.fromkeys([*columns, *sorted(extra)]))
    caps = source.capabilities
    push_order = all_exact and Capability.ORDER_BY in caps and bool(order_by)
    push_limit = all_exact and Capability.LIMIT in caps and (push_order or not order_by)
    req = ScanRequest(
        columns=need,
        filters=pushed,
        params=params,
        order_by=order_by if push_order else (),
        limit=limit if push_limit else None,
        batch_size=37,  # small batches: many of them
    )
    batches = list(source.scan(req))
    schema = (
        source.schema() if need is None else pa.schema([source.schema().field(c) for c in need])
    )
    raw = pa.Table.from_batches(batches, schema=schema)
    out = raw
    bound = typed_params(residual, params, source.schema(), source.uri)  # as the executor binds
    for f in residual:  # as the executor applies them (DuckDB for what pyarrow lacks)
        out = functions.filter_table(out, f, bound, resolve=lambda c: c.name)
    if order_by and not push_order:
        out = out.sort_by(
            [(_key(k), "descending" if k.descending else "ascending") for k in order_by]
        )
    if limit is not None and not push_limit:
        out = out.slice(0, limit)
    if columns is not None:
        out = out.select(columns)
    return out, answers, raw


def oracle_ids(pred: Any) -> list[int]:
    return sorted(r["id"] for r in data.rows() if pred(r))


class ConnectorConformance:
    """Subclasses set ``unsupported`` (case name -> reason the source cannot apply it)."""

    #: cases whose filter this source answers UNSUPPORTED, with the reason (docs/connectors.md)
    unsupported: ClassVar[dict[str, str]] = {}
    #: whether statistics().row_count is expected to be 200 exactly
    exact_row_count: ClassVar[bool] = False
    nulls_sort_native: ClassVar[bool] = True

    @pytest.fixture
    def source(self) -> Source:  # pragma: no cover - overridden
        raise NotImplementedError

    # -------------------------------------------------------------- planning view

    def test_contract(self, source: Source) -> None:
        """The shape the catalog, planner and executor rely on (``SourceLike``), with
        capabilities the fabric knows (``Capability``)."""
        assert isinstance(source, SourceLike), f"{source!r} lacks part of SourceLike"
        assert isinstance(source.uri, str) and "://" in source.uri, source.uri
        as_capabilities(source.capabilities, repr(source))  # raises naming an unknown one
        assert isinstance(source.schema(), pa.Schema)

    def test_schema(self, source: Source) -> None:
        s = source.schema()
        for f in data.SCHEMA:
            assert f.name in s.names, f"{source}: column {f.name} missing from {s}"
            assert s.field(f.name).type == f.type, (
                f"{source}: {f.name} is {s.field(f.name).type}, want {f.type}"
            )

    def test_statistics(self, source: Source) -> None:
        st = source.statistics()
        assert st.row_count is not None
        if self.exact_row_count:
            assert st.row_count == data.N and st.exact
        else:
            assert 0 < st.row_count <= 4 * data.N

    def test_watermark(self, source: Source) -> None:
        wm = source.watermark()
        assert wm is not None and wm.event_time is not None
        assert wm.event_time <= dt.datetime.now(dt.UTC).timestamp() + 5

    def test_full_scan(self, source: Source) -> None:
        out, _, _ = fabric_scan(source, [])
        assert sorted(out.column("id").to_pylist()) == list(range(1, data.N + 1))
        got = {r["id"]: r for r in out.to_pylist()}
        for want in data.rows():
            row = got[want["id"]]
            for k, v in want.items():
                assert row[k] == v, f"{source}: row {want['id']} column {k}: {row[k]!r} != {v!r}"

    def test_projection(self, source: Source) -> None:
        out, _, raw = fabric_scan(source, [], columns=["city", "id"])
        assert raw.column_names == ["city", "id"]
        assert out.num_rows == data.N

    def test_unknown_column_is_named(self, source: Source) -> None:
        with pytest.raises(UnknownColumnError) as ei:
            list(source.scan(ScanRequest(columns=("id", "ctiy"))))
        assert isinstance(ei.value, FabricError) and isinstance(ei.value, KeyError)
        assert ei.value.columns == ["ctiy"] and "city" in ei.value.existing
        assert "ctiy" in str(ei.value) and "existing: " in str(ei.value)

    # -------------------------------------------------------------- filters

    @pytest.mark.parametrize("case", data.CASES, ids=data.CASE_IDS)
    def test_filter(self, source: Source, case: data.Case) -> None:
        out, answers, raw = fabric_scan(source, [case.expr], case.params, columns=["id"])
        want = oracle_ids(case.oracle)
        assert sorted(out.column("id").to_pylist()) == want, f"{source}: {case.expr}"
        expected = Pushdown.UNSUPPORTED if case.name in self.unsupported else Pushdown.EXACT
        assert answers == [expected], (
            f"{source}: {case.expr} answered {answers[0]}, documented {expected}"
        )
        if answers[0] is Pushdown.EXACT:
            assert raw.num_rows == len(want), "an EXACT filter must not return extra rows"

    def test_unsupported_filter_is_reapplied(self, source: Source) -> None:
        """Fail closed: a filter the source cannot apply still restricts the answer."""
        if not self.unsupported:
            pytest.skip(
                f"{source} applies every filter pyarrow can (nothing is left to the fabric)"
            )
        case = next(c for c in data.CASES if c.name in self.unsupported)
        out, answers, raw = fabric_scan(source, [case.expr], case.params, columns=["id"])
        assert answers == [Pushdown.UNSUPPORTED]
        assert raw.num_rows == data.N  # the source returned everything ...
        assert sorted(out.column("id").to_pylist()) == oracle_ids(
            case.oracle
        )  # ... and the fabric filtered

    def test_several_filters(self, source: Source) -> None:
        f = [
            Binary(">=", Column("score"), Param("lo")),
            InList(Column("city"), Param("cities")),
            Binary("<", Column("id"), Param("hi")),
        ]
        p = {"lo": 40, "cities": ["Paris", "lyon"], "hi": 150}
        out, _, _ = fabric_scan(source, f, p, columns=["id"])
        want = oracle_ids(
            lambda r: (
                r["score"] is not None
                and r["score"] >= 40
                and r["city"] in ("Paris", "lyon")
                and r["id"] < 150
            )
        )
        assert sorted(out.column("id").to_pylist()) == want

    # -------------------------------------------------------------- order and limit

    def test_limit(self, source: Source) -> None:
        out, answers, raw = fabric_scan(
            source,
            [Binary("=", Column("city"), Param("c"))],
            {"c": "Berlin"},
            columns=["id", "city"],
            limit=5,
        )
        assert out.num_rows == 5 and set(out.column("city").to_pylist()) == {"Berlin"}
        if Capability.LIMIT in source.capabilities and answers == [Pushdown.EXACT]:
            assert raw.num_rows == 5, "a pushed limit must be applied by the source"

    def test_order_by_limit(self, source: Source) -> None:
        keys = (SortKey(Column("score"), descending=True), SortKey(Column("id")))
        out, _, _ = fabric_scan(source, [], columns=["id", "score"], order_by=keys, limit=12)
        rows = data.rows()
        want = sorted(
            [r for r in rows if r["score"] is not None], key=lambda r: (-r["score"], r["id"])
        )[:12]
        assert out.column("id").to_pylist() == [r["id"] for r in want]

    def test_order_strings_binary_nulls_last(self, source: Source) -> None:
        keys = (SortKey(Column("status")), SortKey(Column("id")))
        out, _, _ = fabric_scan(source, [], columns=["id", "status"], order_by=keys)
        rows = data.rows()
        want = sorted(rows, key=lambda r: (r["status"] is None, r["status"] or "", r["id"]))
        assert out.column("id").to_pylist() == [r["id"] for r in want]

    # -------------------------------------------------------------- per-scan metrics

    #: the ScanMetrics fields that say what one scan did (not how long it waited)
    METRIC_FIELDS: ClassVar[tuple[str, ...]] = (
        "statement",
        "records",
        "bad_records",
        "files_total",
        "files_read",
        "row_groups_total",
        "row_groups_read",
        "rows",
    )

    def _requests(self, source: Source) -> tuple[ScanRequest, ScanRequest]:
        """Two scans with different filters (ids below 50, ids from 150), pushed if taken."""
        out = []
        for f, p in (
            (Binary("<", Column("id"), Param("hi")), {"hi": 50}),
            (Binary(">=", Column("id"), Param("lo")), {"lo": 150}),
        ):
            pushed = (f,) if source.supports_filter(f) is not Pushdown.UNSUPPORTED else ()
            out.append(ScanRequest(columns=("id",), filters=pushed, params=p, batch_size=37))
        return out[0], out[1]

    def _measured(self, req: ScanRequest, rows: int) -> dict[str, Any]:
        m = req.metrics
        assert isinstance(m, ScanMetrics), f"request.metrics is {type(m).__name__}, not ScanMetrics"
        assert m.rows is None or m.rows == rows, f"metrics.rows {m.rows}, the scan returned {rows}"
        m.as_dict()  # renders
        return {k: getattr(m, k) for k in self.METRIC_FIELDS}

    def _alone(self, source: Source, req: ScanRequest) -> dict[str, Any]:
        req = ScanRequest(**{**vars(req), "metrics": ScanMetrics()})
        rows = sum(b.num_rows for b in source.scan(req))
        return self._measured(req, rows)

    def test_scan_metrics_are_the_scans_own(self, source: Source) -> None:
        """A scan reports into its own ``request.metrics`` and keeps nothing per scan on
        the source, which the catalog shares between concurrent queries: scan A, held
        after its first batch while scan B (another filter) runs to its end, then
        finished, reports what A reports alone, and B what B reports alone."""
        a, b = self._requests(source)
        for r in (a, b):  # warm the source's caches (a Kafka tail), then measure alone
            self._alone(source, r)
        want_a, want_b = self._alone(source, a), self._alone(source, b)
        held = iter(source.scan(a))
        first = next(held, None)
        rows_b = sum(x.num_rows for x in source.scan(b))
        rows_a = (first.num_rows if first is not None else 0) + sum(x.num_rows for x in held)
        assert self._measured(a, rows_a) == want_a, f"{source}: scan A's metrics changed by B"
        assert self._measured(b, rows_b) == want_b, f"{source}: scan B's metrics"
        if a.filters and b.filters and want_a["statement"] is not None:
            assert want_a["statement"] != want_b["statement"], "the statement names its filter"

    def test_scan_metrics_of_concurrent_scans(self, source: Source) -> None:
        """Two threads scan the source at once, held together (a Barrier) after their
        first batches: each reports its own metrics."""
        reqs = self._requests(source)
        for r in reqs:
            self._alone(source, r)
        want = [self._alone(source, r) for r in reqs]
        barrier = threading.Barrier(2, timeout=30)
        got: dict[int, int] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                it: Iterator[pa.RecordBatch] = iter(source.scan(reqs[i]))
                first = next(it, None)
                barrier.wait()
                got[i] = (first.num_rows if first is not None else 0) + sum(x.num_rows for x in it)
            except BaseException as e:  # reported below
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        got_m = [self._measured(r, got[i]) for i, r in enumerate(reqs)]
        assert got_m == want, f"{source}: concurrent scans reported {got_m}, alone {want}"

    # -------------------------------------------------------------- bad input

    @pytest.mark.parametrize("value", data.HOSTILE, ids=lambda v: repr(v)[:20])
    def test_hostile_value_is_plain(self, source: Source, value: Any) -> None:
        out, answers, raw = fabric_scan(
            source, [Binary("=", Column("name"), Param("v"))], {"v": value}, columns=["id"]
        )
        assert out.num_rows == 0
        if answers == [Pushdown.EXACT]:
            assert raw.num_rows == 0
        out, answers, raw = fabric_scan(
            source, [InList(Column("status"), Param("v"))], {"v": [value, "nope"]}, columns=["id"]
        )
        assert out.num_rows == 0
        if answers == [Pushdown.EXACT]:
            assert raw.num_rows == 0
        after, _, _ = fabric_scan(source, [], columns=["id"])
        assert after.num_rows == data.N, "the data must be unchanged"

    @pytest.mark.parametrize("value", data.HOSTILE, ids=lambda v: repr(v)[:20])
    def test_hostile_value_for_int_column_is_rejected(self, source: Source, value: Any) -> None:
        with pytest.raises(BadValueError, match="session value 'v' compared with column 'id'"):
            fabric_scan(source, [Binary("=", Column("id"), Param("v"))], {"v": value})
        after, _, _ = fabric_scan(source, [], columns=["id"])
        assert after.num_rows == data.N
