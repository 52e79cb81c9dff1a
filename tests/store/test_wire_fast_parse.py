"""``parse_spans_request`` (the span route's orjson parser) gives what pydantic's own parse gives, or
nothing: every body it takes must come out equal, and every body pydantic refuses it must refuse too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agl.schemas import Span
from agl.schemas._base import MAX_JSON_DEPTH
from agl.store._wire import SpansRequest, parse_spans_request
from tests.support.json_values import values


def body(attributes: Any = None, resource: Any = None, **change: Any) -> bytes:
    """A one-span body; ``json`` writes NaN, Infinity and any integer as they are, as a client might."""
    span = Span.new("ro-1", "at-1", "step").model_dump(mode="json")
    span["attributes"] = {} if attributes is None else attributes
    span["resource"] = {} if resource is None else resource
    return json.dumps({"spans": [{**span, **change}]}, allow_nan=True).encode()


def assert_same(raw: bytes) -> SpansRequest | None:
    """The fast parse equals pydantic's (same stored JSON), or it declined; None when pydantic refuses."""
    fast = parse_spans_request(raw)
    try:
        slow = SpansRequest.model_validate_json(raw)
    except ValidationError:
        assert fast is None, raw
        return None
    if fast is not None:
        assert all(type(span) is Span for span in fast.spans)
        assert fast == slow
        assert [s.model_dump_json() for s in fast.spans] == [s.model_dump_json() for s in slow.spans]
    return slow


@settings(max_examples=300, deadline=None)
@given(attributes=st.dictionaries(st.text(max_size=4), values, max_size=4), resource=values)
def test_the_fast_parse_agrees_with_pydantic(attributes: dict[str, Any], resource: Any) -> None:
    assert_same(body(attributes=attributes, resource=resource))


def nested(levels: int) -> Any:
    """Containers ``levels`` deep below an attributes dict (which is level 0)."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
@pytest.mark.parametrize("field", ["attributes", "resource"])
def test_nesting_at_the_limit(levels: int, field: str) -> None:
    allowed = levels < MAX_JSON_DEPTH  # check_json's own limit, counted from the attributes dict
    result = assert_same(body(**{field: {"deep": nested(levels)}}))
    assert (result is not None) == allowed
    if allowed:  # the fast parse took it, not only pydantic
        assert parse_spans_request(body(**{field: {"deep": nested(levels)}})) is not None


@pytest.mark.parametrize(
    "raw",
    [
        body(attributes={"n": 2**64}),  # orjson would read a float
        body(attributes={"n": -(2**63) - 1}),
        body(attributes={"n": 2**64 - 1}),  # the largest that fits: taken by both
        body(attributes={"x": float("nan")}),
        body(attributes={"x": float("inf")}),
        body(attributes={"x": 1e300}),
        body(start_time_ns=10**30, end_time_ns=10**30),
        body(sequence_id=2**62 + 1),
        body(attributes={"s": "nul\u0000 and \u2028"}),
        body(span_id="XYZ"),
        b'{"spans": [{"rollout_id": "ro-1", "attributes": {"s": "\\ud800"}}]}',
        b"{nope",
        b"[]",
        b"null",
        b"true",
        b"5",
        b"1e999",
        b'"spans"',
        b'{"spans": null}',
        b'{"spans": [null, 1, "x", []]}',
    ],
)
def test_edge_cases_agree(raw: bytes) -> None:
    assert_same(raw)


def test_a_plain_batch_takes_the_fast_path() -> None:
    batch = [Span.new("ro-1", "at-1", "llm.call", {"a": {"b": [1, 2.5, "c", None, True]}}) for _ in range(3)]
    raw = SpansRequest(spans=batch).model_dump_json().encode()
    parsed = parse_spans_request(raw)
    assert parsed is not None and parsed.spans == batch
