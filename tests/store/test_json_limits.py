"""``check_json`` (the door every stored free-form value passes) accepts exactly what JSON stores round-trip."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import given, settings

from agl.schemas._base import MAX_JSON_DEPTH, check_json
from tests.support.json_values import values


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def storable(value: Any) -> bool:
    """The reference: orjson writes it, it reads back equal (so no NaN/Infinity turned null), not too deep."""
    if depth(value) > MAX_JSON_DEPTH:
        return False
    try:
        return bool(orjson.loads(orjson.dumps(value)) == value)
    except (TypeError, orjson.JSONEncodeError):
        return False


@settings(max_examples=400, deadline=None)
@given(values)
def test_accepts_exactly_what_round_trips(value: Any) -> None:
    try:
        check_json(value, "input")
        accepted = True
    except ValueError as exc:
        accepted = False
        assert str(exc).startswith("input"), exc  # names the path
    assert accepted == storable(value), value


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"a": [1, {"b": math.nan}]}, "input.a[1].b is nan"),
        ([0] * 10 + [math.inf], "input[10] is inf"),
        ({"k": 2**64}, "input.k is 18446744073709551616"),
        ({"x": {1: "a"}}, "input.x has the non-string key 1"),
        ({"s": "\ud800"}, "input.s holds an unpaired surrogate"),
        ({"t": {1, 2}}, "input.t is a set"),
    ],
)
def test_the_message_names_the_path(value: Any, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_json(value, "input")
