"""The JSON decoders of ingestion accept exactly what ``json.loads`` of each message accepts
(one JSON object per message, fields of the declared types) and attribute every error to
its message. The oracle is written here, from ``json.loads``, independently of the code."""

from __future__ import annotations

import json
import math

import pyarrow as pa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from connectors.json_decode import decode_json_messages
from fabric.ingest.decode import JsonDecoder

SCHEMA = pa.schema([("id", pa.string()), ("v", pa.int64()), ("f", pa.float64()), ("b", pa.bool_())])
I64 = (-(2**63), 2**63 - 1)


def test_two_objects_in_one_message_and_an_empty_message_are_both_rejected():
    schema = pa.schema([("id", pa.string()), ("v", pa.int64())])
    batch, errors = JsonDecoder(schema).decode([b'{"id":"a","v":1}\n{"id":"b","v":2}', b""])
    assert batch.num_rows == 0, batch.to_pylist()
    assert [i for i, _ in errors] == [0, 1]
    # the same with good neighbours: only the two bad ones go, each under its own index
    good = [json.dumps({"id": f"g{i}", "v": i}).encode() for i in range(100)]
    values = [*good[:50], b'{"id":"a","v":1}\n{"id":"b","v":2}', b"", *good[50:]]
    for decode in (JsonDecoder(schema).decode, lambda v: decode_json_messages(v, schema)):
        batch, errors = decode(values)
        assert [i for i, _ in errors] == [50, 51]
        assert batch.column("id").to_pylist() == [f"g{i}" for i in range(100)]


def test_invalid_utf8_deep_nesting_and_out_of_range_values_are_errors_not_rows_or_crashes():
    schema = pa.schema([("id", pa.string()), ("v", pa.int64()), ("f", pa.float64())])
    good = [json.dumps({"id": f"g{i}", "v": i, "f": 0.5}).encode() for i in range(100)]
    bad = [
        b'{"id":"a\xff","v":1}',  # not UTF-8 (Arrow's reader takes it into a string column)
        b'{"id":"a","v":1,"x":"\xfe"}',  # not UTF-8 in a field the schema ignores
        b'{"id":"a","v":1,"x":' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # RecursionError
        b'{"id":"a","v":99999999999999999999}',  # beyond int64
        b'{"id":"a","v":1e300}',  # integral float beyond int64
        b'{"id":"a","f":' + b"9" * 400 + b"}",  # int too large for a float
        b'{"id":"a\\ud800","v":1}',  # a lone surrogate: no UTF-8 form
        b'{"id":"a","v":1} {"id":"b","v":2}',  # two objects on one line
    ]
    values = good[:30] + bad + good[30:]
    for decode in (
        JsonDecoder(schema, min_chunk=4).decode,
        lambda v: decode_json_messages(v, schema),
    ):
        batch, errors = decode(values)
        assert [i for i, _ in errors] == list(range(30, 30 + len(bad))), errors
        assert batch.column("id").to_pylist() == [f"g{i}" for i in range(100)]


# ----------------------------------------------------------------- the oracle


def oracle(raw: bytes) -> dict | None:
    """The row ``raw`` must give, or None when it must be rejected."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    row: dict = {}
    for name, kind in (("id", "str"), ("v", "int"), ("f", "float"), ("b", "bool")):
        v = doc.get(name)
        if v is None:
            row[name] = None
        elif kind == "str":
            if not isinstance(v, str):
                return None
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return None
            row[name] = v
        elif kind == "int":
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or not I64[0] <= v <= I64[1]:
                return None
            row[name] = v
        elif kind == "float":
            if isinstance(v, bool) or not isinstance(v, int | float):
                return None
            try:
                row[name] = float(v)
            except OverflowError:
                return None
        else:
            if not isinstance(v, bool):
                return None
            row[name] = v
    return row


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
nested = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3)
    ),
    max_leaves=8,
)
valid_doc = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=10),
        "v": st.integers(*I64) | st.sampled_from([1.0, -3.0, 2.0**62]),
        "f": st.floats(allow_nan=False) | st.integers(-(2**60), 2**60),
        "b": st.booleans(),
        "extra": nested,
    },
)


@st.composite
def message(draw: st.DrawFn) -> bytes:
    doc = draw(valid_doc)
    raw = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode()
    kind = draw(
        st.sampled_from(
            ["ok"] * 6
            + ["two", "two_line", "empty", "truncated", "wrong_type", "nesting", "not_utf8"]
            + ["garbage", "array", "dup", "spaces", "pretty"]
        )
    )
    if kind == "two":
        return raw + b" " + raw
    if kind == "two_line":
        return raw + b"\n" + raw
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n", b"null", b"{}"]))
    if kind == "truncated":
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if kind == "wrong_type":
        field = draw(st.sampled_from(["id", "v", "f", "b"]))
        return json.dumps(doc | {field: draw(nested)}).encode()
    if kind == "nesting":
        return json.dumps(doc | {"v": {"deep": [doc]}}).encode()
    if kind == "not_utf8":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[at:]
    if kind == "garbage":
        return raw + draw(st.sampled_from([b"x", b"}", b",", b"]"]))
    if kind == "array":
        return b"[" + raw + b"]"
    if kind == "dup" and doc:
        k = next(iter(doc))
        return raw[:-1] + (b", " if len(doc) else b"") + json.dumps({k: 1}).encode()[1:]
    if kind == "spaces":
        return b" \t" + raw + b" "
    if kind == "pretty":
        return json.dumps(doc, indent=1).encode()
    return raw


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(message(), min_size=1, max_size=150), min_chunk=st.sampled_from([1, 4, 64]))
@example(values=[b"{}", b""], min_chunk=1)  # the joined batch ends with a line break
def test_decoders_accept_exactly_what_json_loads_accepts_per_message(values, min_chunk):
    expect = [oracle(v) for v in values]
    bad = [i for i, e in enumerate(expect) if e is None]
    rows = [e for e in expect if e is not None]
    for name, decode in (
        ("JsonDecoder", JsonDecoder(SCHEMA, min_chunk=min_chunk).decode),
        ("decode_json_messages", lambda v: decode_json_messages(v, SCHEMA)),
    ):
        batch, errors = decode(values)
        assert [i for i, _ in errors] == bad, (name, [values[i] for i, _ in errors])
        got = batch.to_pylist()
        assert len(got) == len(rows), name
        for g, r in zip(got, rows):
            assert all(_same(g[k], r[k]) for k in r), (name, g, r)
