"""What the one-search path (fabric.execute.search) computes more cheaply than the general
path must be what the general path computes: now() bound only when a filter uses it, the
answer's bytes from its row width, the session check's shortcut for a bound vector.
Each is checked against the general computation (issue 12)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import fabric
import fabric.execute as ex
from connectors.dataset import DatasetSource
from dsl.parser import parse_type
from dsl.types import SessionError, bind_session, coerce_value
from fabric.execute import execute
from fabric.execute.search import answer_bytes, row_width
from indexes import Dataset, IndexSpec

N, DIM, K = 800, 8, 10
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def src() -> DatasetSource:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    # half the rows stamped in the past, half far in the future: ts < now() keeps the first
    ts = [T0 + dt.timedelta(days=int(d)) for d in rng.integers(-300, 300, N)]
    ts = [t if i % 2 else t + dt.timedelta(days=365 * 50) for i, t in enumerate(ts)]
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("cl", pa.int64()),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("emb", pa.list_(pa.float32(), DIM)),
        ]
    )
    table = pa.table(
        {
            "id": np.arange(N, dtype=np.int64),
            "cl": rng.integers(0, 5, N),
            "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
        },
        schema=schema,
    )
    ds = Dataset.create(
        "ev", schema, "id", {"emb": IndexSpec("hnsw", metric="l2"), "cl": "btree", "ts": "btree"}
    )
    ds.upsert(table)
    ds.flush()
    return DatasetSource("dataset://ev", ds)


def _open(tmp_path: Path, src: DatasetSource, name: str, where: str, session: str = "") -> Any:
    (tmp_path / f"{name}.yaml").write_text(
        f"binding: {name}\nsession:\n  q: vector[{DIM}]\n{session}sources:\n  n:\n"
        f'    from: dataset://ev\n    nearest: {{column: emb, to: "{{{{session.q}}}}", k: {K}}}'
        f'\n    where: "{where}"\nselect: [n.id, n.ts, n._distance]\n'
    )
    return fabric.open(
        {"bindings": [str(tmp_path)]}, ingest=False, watch=False, dataset_sources={"ev": src}
    )


def _masked(res: Any) -> tuple:
    stats = dict(res.stats)
    stats["total_ms"] = None
    stats["operators"] = [dict(o, time_ms=None) for o in stats["operators"]]
    stats["sources"] = {a: dict(s, time_ms=None) for a, s in stats["sources"].items()}
    return (res.table, stats, res.freshness, res.explain, res.waited, res.partial)


@pytest.mark.parametrize(
    "where, session, values",
    [
        ("ts < now()", "", {}),  # now() bound for the search
        ("cl = {{session.c}} and ts < now()", "  c: int\n", {"c": 2}),
        ("cl in (1, 3)", "", {}),  # no now(): the search is not given one
    ],
)
def test_now_is_bound_when_a_filter_uses_it(
    src: DatasetSource,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    session: str,
    values: dict,
) -> None:
    seen: list[dict] = []
    real = src.search

    def spy(*args: Any, **kw: Any) -> Any:  # exact: the same rows whatever was learned
        seen.append(dict(kw["params"]))
        return real(*args, **kw, strategy="exact")

    monkeypatch.setattr(src, "search", spy)
    rng = np.random.default_rng(9)
    with _open(tmp_path, src, "b", where, session) as fab:
        compiled = fab.binding("b")
        assert ex._search_shape(compiled.runnable) is not None
        for _ in range(4):
            q = rng.standard_normal(DIM).astype(np.float32)
            params = compiled.bind({"q": q, **values})
            for now in (None, T0):  # now passed: that instant for every path
                fast = execute(compiled.runnable, params, fab.catalog, binding="b", now=now)
                with monkeypatch.context() as m:
                    m.setattr(ex, "_search_shape", lambda pp: None)
                    slow = execute(compiled.runnable, params, fab.catalog, binding="b", now=now)
                a, b = _masked(fast), _masked(slow)
                assert a[0].equals(b[0]) and a[1:] == b[1:], (where, now)
                assert a[0].num_rows > 0
                got, general = seen[-2], seen[-1]
                assert "__now" in general  # the general path binds it for every search
                if "now()" in where:
                    cutoff = now or dt.datetime.now(dt.UTC)
                    assert all(t < cutoff for t in a[0].column("ts").to_pylist())
                    assert "__now" in got and (now is None or got["__now"] == now)
                else:
                    assert "__now" not in got


def _fresh_array(t: pa.DataType, n: int, rng: np.random.Generator) -> pa.Array:
    if pa.types.is_fixed_size_list(t):
        return pa.FixedSizeListArray.from_arrays(
            _fresh_array(t.value_type, n * t.list_size, rng), t.list_size
        )
    if pa.types.is_decimal(t):
        return pa.array(rng.integers(0, 999, n).tolist(), t)
    if pa.types.is_string(t):
        return pa.array([str(i) * int(i % 4) for i in rng.integers(0, 100, n)], t)
    if pa.types.is_boolean(t):
        return pa.array(rng.random(n) < 0.5)
    if pa.types.is_timestamp(t):
        return pa.array(rng.integers(0, 10**12, n), pa.int64()).cast(t)
    np_type = t.to_pandas_dtype()
    return pa.array(rng.integers(0, 100, n).astype(np_type), t)


TYPES = [
    pa.int64(),
    pa.int32(),
    pa.int8(),
    pa.uint16(),
    pa.float32(),
    pa.float64(),
    pa.timestamp("us"),
    pa.timestamp("ns", tz="UTC"),
    pa.decimal128(12, 2),
    pa.list_(pa.float32(), 7),
    pa.list_(pa.int16(), 3),
    pa.string(),
    pa.bool_(),
]


def test_answer_bytes_is_the_buffers_total_of_a_fresh_answer() -> None:
    """Fresh, unsliced arrays without NULLs (what a search's answer is): rows x row width
    is ``get_total_buffer_size``; a variable-width or bit-packed column: that total."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        types = [TYPES[i] for i in rng.integers(0, len(TYPES), rng.integers(1, 5))]
        n = int(rng.integers(0, 40))
        cols = [_fresh_array(t, n, rng) for t in types]
        table = pa.table(cols, names=[f"c{i}" for i in range(len(cols))])
        fixed = not any(pa.types.is_string(t) or pa.types.is_boolean(t) for t in types)
        assert (row_width(table.schema) is not None) == fixed, types
        assert answer_bytes(table) == table.get_total_buffer_size(), (types, n)
        assert answer_bytes(table, row_width(table.schema)) == answer_bytes(table)


def test_bind_session_shortcut_is_coerce_value() -> None:
    """The session check's common case (every value given) is each value's coerce_value,
    a float32 vector of the declared size taken as it is; anything else goes the long
    way and lists every problem."""
    types = {"q": parse_type("vector[4]"), "n": parse_type("int"), "s": parse_type("str")}
    rng = np.random.default_rng(1)
    for _ in range(50):
        values = {
            "q": [
                rng.standard_normal(4).astype(np.float32),
                rng.standard_normal(4),
                list(rng.standard_normal(4)),
            ][int(rng.integers(0, 3))],
            "n": int(rng.integers(-5, 5)),
            "s": "x",
        }
        out = bind_session(types, values)
        want = {k: coerce_value(types[k], v, k) for k, v in values.items()}
        assert out.keys() == want.keys()
        assert out["n"] == want["n"] and out["s"] == want["s"]
        assert out["q"].dtype == np.float32 and np.array_equal(out["q"], want["q"])
        if isinstance(values["q"], np.ndarray) and values["q"].dtype == np.float32:
            assert out["q"] is values["q"]  # as coerce_value gives it back
    for bad, message in [
        ({"q": np.zeros(3, np.float32), "n": 1, "s": "x"}, "got a vector of shape (3,)"),
        ({"q": np.zeros((4, 1), np.float32), "n": 1, "s": "x"}, "shape (4, 1)"),
        ({"q": np.zeros(4, np.float32), "n": "1", "s": "x"}, "expected int, got str"),
        ({"q": np.zeros(4, np.float32), "n": 1, "t": "x"}, "unexpected session value 't'"),
    ]:
        with pytest.raises(SessionError) as e:
            bind_session(types, bad, binding="b")
        assert message in e.value.format()
    vals = {"q": np.zeros(4, np.float32), "n": 1, "t": "x"}  # one missing, one extra
    with pytest.raises(SessionError) as e:
        bind_session(types, vals, binding="b")
    assert len(e.value.diagnostics) == 2 and "'s' (str) is missing" in e.value.format()
