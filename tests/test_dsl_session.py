"""Session types and bind_session: missing / extra / mistyped values, vectors, encrypted."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from dsl.parser import parse_type
from dsl.types import SessionError, bind_session, infer_type, parse_cli_value

T = {
    name: parse_type(text)
    for name, text in {
        "user_id": "int",
        "score": "float",
        "name": "str",
        "vip": "bool",
        "since": "timestamp",
        "tags": "list[str]",
        "ids": "list[int]",
        "q": "vector[3]",
        "ctx": "encrypted[3]",
    }.items()
}


class FakeCiphertext:
    """Stands in for crypto.EncryptedVector: a size and serialize()."""

    def __init__(self, size: int):
        self.size = size

    def serialize(self) -> bytes:
        return b"ct"


def _values(**over):
    v = {
        "user_id": 42,
        "score": 1,
        "name": "ann",
        "vip": True,
        "since": "2024-05-01T09:30:00Z",
        "tags": ("a", "b"),
        "ids": [1, np.int64(2)],
        "q": [0.1, 0.2, 0.3],
        "ctx": FakeCiphertext(3),
    }
    v.update(over)
    return v


def test_binding_normalizes_values() -> None:
    out = bind_session(T, _values())
    assert out["user_id"] == 42 and out["score"] == 1.0 and isinstance(out["score"], float)
    assert out["since"] == dt.datetime(2024, 5, 1, 9, 30, tzinfo=dt.UTC)
    assert out["tags"] == ["a", "b"] and out["ids"] == [1, 2]
    assert out["q"].dtype == np.float32 and out["q"].shape == (3,)
    assert out["ctx"].size == 3


def test_numpy_vector_and_naive_datetime() -> None:
    out = bind_session(T, _values(q=np.arange(3, dtype=np.float64), since=dt.datetime(2024, 1, 1)))
    assert out["q"].dtype == np.float32 and list(out["q"]) == [0.0, 1.0, 2.0]
    assert out["since"].tzinfo is not None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"user_id": "42"}, "binding 'b': session value 'user_id': expected int, got str '42'"),
        ({"user_id": True}, "expected int, got bool"),
        ({"score": "x"}, "expected float, got str"),
        ({"vip": 1}, "expected bool, got int"),
        ({"since": "yesterday"}, "expected an ISO-8601 timestamp, got 'yesterday'"),
        ({"tags": "a,b"}, "expected list[str] (a list), got str"),
        ({"ids": [1, "2"]}, "item 1: expected int, got str"),
        ({"q": [0.1, 0.2]}, "expected vector[3], got a vector of shape (2,)"),
        ({"q": np.zeros((3, 1))}, "got a vector of shape (3, 1)"),
        ({"q": ["a", "b", "c"]}, "values must be numbers"),
        ({"ctx": [0.7, 0.2, 0.9]}, "expected encrypted[3] (an encrypted vector"),
        ({"ctx": FakeCiphertext(4)}, "expected encrypted[3], got an encrypted vector of size 4"),
    ],
)
def test_mistyped_values(override, expected) -> None:
    with pytest.raises(SessionError) as info:
        bind_session(T, _values(**override), binding="b")
    assert expected in info.value.format()


def test_missing_and_extra_values_are_all_reported() -> None:
    vals = _values(extra=1)
    del vals["user_id"]
    with pytest.raises(SessionError) as info:
        bind_session(T, vals, binding="b")
    text = info.value.format()
    assert "binding 'b': session value 'user_id' (int) is missing" in text
    assert "binding 'b': unexpected session value 'extra'" in text
    assert len(info.value.diagnostics) == 2


def test_no_session() -> None:
    assert bind_session({}, None) == {}
    with pytest.raises(SessionError, match="unexpected session value 'x'"):
        bind_session({}, {"x": 1})


def test_infer_and_cli_values() -> None:
    assert str(infer_type(np.zeros(4, dtype=np.float32))) == "vector[4]"
    assert str(infer_type(["a"])) == "list[str]"
    assert str(infer_type(FakeCiphertext(3))) == "encrypted[3]"
    assert parse_cli_value(T["user_id"], "42") == 42
    assert parse_cli_value(T["tags"], "a,b") == ["a", "b"]
    assert parse_cli_value(T["tags"], '["a", "b"]') == ["a", "b"]
    assert parse_cli_value(T["q"], "[1, 2, 3]") == [1, 2, 3]


def test_decimal_session_values_are_never_rounded_quietly() -> None:
    """decimal(15,2) takes 0.06 and 6 exactly; 0.065 (three places) is an error naming the
    value and the type, not 0.06 (TPC-H Q6 answered for 0.06 when asked for 0.065)."""
    import decimal

    types = {"disc": parse_type("decimal(15,2)")}
    assert bind_session(types, {"disc": "0.06"})["disc"] == decimal.Decimal("0.06")
    assert bind_session(types, {"disc": 6})["disc"] == decimal.Decimal("6.00")
    assert bind_session(types, {"disc": decimal.Decimal("0.0600")})["disc"] == decimal.Decimal(
        "0.06"
    )
    for v in ("0.065", 0.065, decimal.Decimal("0.065")):
        with pytest.raises(
            SessionError, match=r"disc.*more than 2 decimal places.*decimal\(15,2\)"
        ):
            bind_session(types, {"disc": v})
    with pytest.raises(SessionError, match="does not fit"):
        bind_session(types, {"disc": "12345678901234.5"})
