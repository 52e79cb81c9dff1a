"""OTel span -> agl Span: the fast path builds exactly what validation builds, and refuses what it refuses.

Spans come from agl's real tracer provider inside a rollout context; each converted span is compared
with ``Span(**its fields)`` (the validating path) and its JSON with pydantic's; the client's span body
is compared with pydantic's serializer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
from opentelemetry.trace import Link, Status, StatusCode
from pydantic import TypeAdapter, ValidationError

from agl import semconv as sc
from agl.schemas import Attempt, Rollout, Span
from agl.schemas.span import spans_json
from agl.store.client import _spans_body
from agl.tracer import tracer_provider
from agl.tracer.context import RolloutContext, rollout_context

CASES: dict[str, dict[str, Any]] = {
    "flat": {"a": "text", "n": 1.5, "i": -3, "b": True, "ints": [1, 2, 3], "floats": [0.5, 1e300]},
    "bounds": {"lo": -(2**63), "hi": 2**64 - 1, "empty": [], "bools": [True, False]},
    "non_ascii": {"text": "héllo ✓ 日本", "list": ["ü", "x"]},
    "null_in_text": {"text": "it is null", "json": '{"a": null}'},
    "json_keys": {sc.OPERATION_INPUT: json.dumps({"q": [1, {"deep": None}]}), sc.TAGS: '["x", "y"]'},
    "bad_json_key": {sc.OPERATION_OUTPUT: "not json {"},
    "openinference": {
        "openinference.span.kind": "LLM",
        "llm.model_name": "m",
        "input.value": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        "output.value": json.dumps(
            {"id": "r", "choices": [{"message": {"role": "assistant", "content": "yo"}}]}
        ),
        "llm.token_count.prompt": 3,
    },
    "none_in_list": {"list": ["a", None]},
}


@pytest.fixture
def ctx() -> RolloutContext:
    rollout = Rollout(rollout_id="ro-1", created_at=0.0, updated_at=0.0)
    attempt = Attempt(attempt_id="at-1", rollout_id="ro-1", attempt_number=1, started_at=0.0)
    return RolloutContext(rollout=rollout, attempt=attempt, agent_name="agent")


def _convert(ctx: RolloutContext, attributes: dict[str, Any], **extra: Any) -> Span:
    tracer = tracer_provider().get_tracer("test-convert")
    name, links = extra.pop("name", "step"), extra.pop("links", ())
    with rollout_context(ctx), tracer.start_as_current_span(name, links=links) as span:
        span.set_attributes(attributes)
        if "event" in extra:
            span.add_event(extra["event"], {"k": 1})
        if "status" in extra:
            span.set_status(extra["status"])
    (converted,) = ctx.buffer.take()
    return converted


def _same_as_validated(span: Span) -> None:
    fields = {name: getattr(span, name) for name in Span.model_fields if name != "sequence_id"}
    validated = Span(**fields)
    assert span == validated
    assert span.model_fields_set == validated.model_fields_set
    assert span.model_dump_json() == validated.model_dump_json()
    assert all(type(v) is not tuple for v in span.attributes.values())  # OTel tuples arrive as lists


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_span_equals_the_validated_one(ctx: RolloutContext, case: str) -> None:
    span = _convert(ctx, CASES[case])
    _same_as_validated(span)
    assert span.rollout_id == "ro-1" and span.attempt_id == "at-1"
    assert span.attributes[sc.ROLLOUT_ID] == "ro-1" and span.attributes[sc.AGENT_NAME] == "agent"
    for key, value in CASES[case].items():
        if key in {sc.OPERATION_INPUT, sc.TAGS}:
            assert span.attributes[key] == json.loads(value)
        else:
            assert span.attributes[key] == (list(value) if isinstance(value, (list, tuple)) else value)


def test_openinference_span_gets_canonical_keys(ctx: RolloutContext) -> None:
    span = _convert(ctx, CASES["openinference"])
    assert span.attributes[sc.LLM_MODEL] == "m"
    assert span.attributes[sc.LLM_REQUEST_MESSAGES] == [{"role": "user", "content": "hi"}]


def test_events_links_and_status_take_the_validating_path(ctx: RolloutContext) -> None:
    tracer = tracer_provider().get_tracer("test-convert")
    with tracer.start_as_current_span("outside") as other:  # no rollout: not filed
        link = Link(other.get_span_context(), {"why": "because"})
    span = _convert(
        ctx, {"a": 1}, event="happened", links=[link], status=Status(StatusCode.ERROR, "it broke")
    )
    _same_as_validated(span)
    assert span.events[0].name == "happened" and span.events[0].attributes == {"k": 1}
    assert span.links[0].attributes == {"why": "because"}
    assert span.status.code.value == "error" and span.status.description == "it broke"


@pytest.mark.parametrize(
    "attributes",
    [
        {"nan": math.nan},
        {"inf": [1.0, math.inf]},
        {sc.OPERATION_INPUT: '{"x": NaN}'},  # parsed JSON text is checked too
        {"surrogate": "a\ud800"},
    ],
)
def test_values_json_cannot_keep_are_refused_as_before(
    ctx: RolloutContext, attributes: dict[str, Any]
) -> None:
    tracer = tracer_provider().get_tracer("test-convert")
    with rollout_context(ctx), tracer.start_as_current_span("bad") as span:
        span.set_attributes(attributes)
    (build,) = ctx.buffer._spans  # the buffer holds the deferred conversion; take() logs and drops it
    with pytest.raises(ValidationError):
        build() if callable(build) else None
    assert ctx.buffer.take() == [] and ctx.buffer.dropped == 1


def test_a_name_with_nul_is_refused(ctx: RolloutContext) -> None:
    tracer = tracer_provider().get_tracer("test-convert")
    with rollout_context(ctx), tracer.start_as_current_span("a\x00b"):
        pass
    assert ctx.buffer.take() == [] and ctx.buffer.dropped == 1


def test_client_span_body_matches_pydantic(ctx: RolloutContext) -> None:
    spans = [_convert(ctx, CASES[case]) for case in sorted(CASES)]
    spans.append(_convert(ctx, {"a": 1}, event="e", status=Status(StatusCode.OK)))
    spans.append(Span.new("ro-1", "at-1", "made", {"nested": {"x": [1, None, "y"]}}, sequence_id=7))
    expected = TypeAdapter(dict[str, list[Span]]).dump_json({"spans": spans})
    assert orjson.loads(_spans_body(spans)) == orjson.loads(expected)

    class MySpan(Span):
        pass

    mine: list[Span] = [MySpan(**spans[0].model_dump())]
    assert orjson.loads(_spans_body(mine)) == orjson.loads(
        TypeAdapter(dict[str, list[Span]]).dump_json({"spans": mine})
    )


def test_stored_span_json_matches_pydantic_and_keeps_to_span_fields(ctx: RolloutContext) -> None:
    """The SQL stores write each span as ``spans_json`` does: what ``model_dump_json`` writes."""
    spans = [_convert(ctx, CASES[case]) for case in sorted(CASES)]
    spans.append(_convert(ctx, {"a": 1}, event="e", status=Status(StatusCode.OK)))
    assert [orjson.loads(data) for data in spans_json(spans)] == [
        orjson.loads(span.model_dump_json()) for span in spans
    ]

    class Annotated(Span):
        note: str = "mine"

    (data,) = spans_json([Annotated(**spans[0].model_dump())])
    assert Span.model_validate_json(data) == spans[0]  # read back as a Span: no extra field written
