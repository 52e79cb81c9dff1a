"""PlainAttributes stores what the OTel SDK's BoundedAttributes stores, and its JSON equals the validated Span's.

Every case runs the same calls on the SDK's class, on a PlainAttributes and on an adopted BoundedAttributes,
and compares what each holds (values, their exact types, key order), what it dropped and what it raised.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan

from agl.schemas import Attempt, Rollout, Span
from agl.tracer import tracer_provider
from agl.tracer.context import RolloutContext, rollout_context
from agl.tracer.otel import PlainAttributes


class Text(str):
    pass


class Level(enum.IntEnum):
    HIGH = 2


Call = Callable[[BoundedAttributes], None]


def bulk(attributes: Any) -> Call:
    return lambda held: held._set_items(attributes)


def one(key: Any, value: Any) -> Call:
    def call(held: BoundedAttributes) -> None:
        held[key] = value

    return call


PLAIN = {"s": "text", "i": -3, "f": 1.5, "b": True, "ints": [1, 2], "strs": ("a", "b"), "empty": []}
CASES: dict[str, tuple[dict[str, Any], list[Call]]] = {
    "plain": ({}, [bulk(PLAIN)]),
    "plain then more": ({}, [bulk(PLAIN), bulk({"n": 2.5, "l": [True, 1.0, "x"]})]),
    "key set again moves to the end": ({}, [bulk(PLAIN), bulk({"i": 4, "new": 1, "s": [1]})]),
    "full: oldest dropped": ({"maxlen": 5}, [bulk(PLAIN), bulk({"x": 1, "y": [2]})]),
    "over the limit at once": ({"maxlen": 3}, [bulk(PLAIN)]),
    "no room at all": ({"maxlen": 0}, [bulk(PLAIN)]),
    "text cut to max_value_len": ({"max_value_len": 2}, [bulk(PLAIN)]),
    "nested mapping": ({}, [bulk({"m": {"a": [1, 2], "b": None}, "s": "x"})]),
    "None and bytes": ({}, [bulk({"none": None, "bytes": b"ab", "list": [None, b"c"]})]),
    "nested list": ({}, [bulk({"ll": [[1, 2], [3]], "s": "x"})]),
    "subclasses": ({}, [bulk({"t": Text("x"), "e": Level.HIGH, "l": [Text("y")]})]),
    "empty key": ({}, [bulk({"": 1, "a": 2})]),
    "non-str key": ({}, [bulk({1: "one", "a": 2})]),
    "other object": ({}, [bulk({"o": object(), "d": 1})]),
    "mapping proxy": ({}, [bulk(MappingProxyType({"a": [1], "b": "x"}))]),
    "single sets": ({}, [one("a", [1, 2]), one("b", "x"), one("a", 3), one("", 1), one("c", None)]),
    "bulk then single then bulk": ({"maxlen": 4}, [bulk(PLAIN), one("s", "again"), bulk({"z": (1,)})]),
    "nan and infinity kept": ({}, [bulk({"nan": math.nan, "inf": [1.0, -math.inf]})]),
}


def _run(held: BoundedAttributes, calls: list[Call]) -> Any:
    try:
        for call in calls:
            call(held)
    except Exception as exc:  # the SDK's own errors must come out the same
        return type(exc)
    return None


def _state(held: BoundedAttributes) -> tuple[Any, ...]:
    typed = [(k, type(k), v, type(v)) for k, v in held._dict.items()]
    return typed, held.dropped


def _adopted(**kw: Any) -> BoundedAttributes:
    held = BoundedAttributes(immutable=False, **kw)
    PlainAttributes.adopt(held)
    assert type(held) is PlainAttributes
    return held


@pytest.mark.parametrize("case", sorted(CASES))
def test_it_stores_what_the_sdk_stores(case: str) -> None:
    kw, calls = CASES[case]
    sdk = BoundedAttributes(immutable=False, **kw)
    sdk_raised = _run(sdk, calls)
    for made in (PlainAttributes(immutable=False, **kw), _adopted(**kw)):
        assert _run(made, calls) is sdk_raised
        assert _state(made) == _state(sdk)


def test_an_immutable_one_refuses_as_the_sdks_does() -> None:
    for made in (BoundedAttributes(immutable=True), PlainAttributes(immutable=True)):
        with pytest.raises(TypeError):
            made._set_items({"a": 1})


def _expected_json(held: BoundedAttributes) -> dict[str, Any] | None:
    """What validation makes of the held values (None if it refuses them), independent of PlainAttributes."""
    attributes = {k: list(v) if type(v) is tuple else v for k, v in held._dict.items()}
    try:
        return Span.new("ro", "at", "x", attributes).attributes
    except ValueError:
        return None


JSON_CASES: dict[str, list[Call]] = {
    "plain": [bulk(PLAIN)],
    "non-ascii": [bulk({"t": "héllo ✓", "k✓": ["ü"]})],
    "64-bit bounds": [bulk({"lo": -(2**63), "hi": 2**64 - 1, "l": [2**63]})],
    "int beyond 64 bits": [bulk({"big": 2**64})],
    "int beyond 64 bits in a list": [bulk({"l": [1, -(2**63) - 1]})],
    "nan": [bulk({"a": 1, "nan": math.nan})],
    "infinity in a list": [bulk({"l": [1.0, math.inf]})],
    "nan set alone": [bulk(PLAIN), one("x", math.nan)],
    "surrogate": [bulk({"s": "a\ud800"})],
    "surrogate in a key": [bulk({"\ud800": 1})],
    "list replaced by text": [bulk({"a": [1, 2]}), bulk({"a": "ab"})],
    "list replaced by a single value": [bulk({"a": [1, 2]}), one("a", "ab")],
    "list set alone": [one("a", [1, 2])],
    "nested mapping": [bulk({"m": {"a": 1}})],
    "None": [bulk({"n": None})],
    "evicted list": [bulk({"a": [1]}), bulk({f"k{i}": i for i in range(128)})],
}


def _check_json(held: PlainAttributes) -> None:
    got, expected = held.json(), _expected_json(held)
    if got is not None:  # None sends the span the validating way, which has the final word
        assert expected is not None
        assert got == expected and [type(v) for v in got.values()] == [type(v) for v in expected.values()]
        assert list(got) == list(held._dict) and got is not held._dict


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_json_is_what_validation_makes_of_it(case: str) -> None:
    held = PlainAttributes(128, immutable=False)
    _run(held, JSON_CASES[case])
    _check_json(held)
    if case in {"plain", "non-ascii", "64-bit bounds", "list replaced by text", "evicted list"}:
        assert held.json() is not None  # these take the quick way


def test_plain_values_take_the_quick_way() -> None:
    held = PlainAttributes(immutable=False)
    held._set_items(PLAIN)
    assert held.plain and held.json() is not None
    held["ok"] = "still"
    assert held.plain
    held["m"] = [1]  # a single set of a list goes the SDK's way and ends the quick path
    assert not held.plain and held.json() is None


@pytest.mark.parametrize(
    "given", [{"a": [1], "s": "x"}, {"nan": math.nan}, {"m": {"a": 1}}, {"big": 2**64}, {}]
)
def test_adopting_looks_at_what_the_sdk_already_holds(given: dict[str, Any]) -> None:
    held = BoundedAttributes(attributes=given, immutable=False)  # a span started with attributes
    PlainAttributes.adopt(held)
    assert isinstance(held, PlainAttributes)
    _check_json(held)
    assert (held.json() is not None) is (given in ({"a": [1], "s": "x"}, {}))


def test_only_spans_of_a_rollout_are_adopted() -> None:
    rollout = Rollout(rollout_id="ro-1", created_at=0.0, updated_at=0.0)
    attempt = Attempt(attempt_id="at-1", rollout_id="ro-1", attempt_number=1, started_at=0.0)
    ctx = RolloutContext(rollout=rollout, attempt=attempt)
    tracer = tracer_provider().get_tracer("test-plain")
    with tracer.start_as_current_span("outside") as outside:
        outside.set_attributes({"a": [1]})
    with rollout_context(ctx), tracer.start_as_current_span("inside") as inside:
        inside.set_attributes({"a": [1]})
    assert isinstance(outside, ReadableSpan) and isinstance(inside, ReadableSpan)  # the SDK's spans
    assert type(outside._attributes) is BoundedAttributes
    assert type(inside._attributes) is PlainAttributes
    assert inside.attributes and outside.attributes
    assert inside.attributes["a"] == (1,) and outside.attributes["a"] == (1,)
    (span,) = ctx.buffer.take()
    assert span.attributes["a"] == [1]
