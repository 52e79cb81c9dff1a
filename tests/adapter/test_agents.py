"""Which agent made each call: own tag, the tracer record of the same response, or an enclosing span."""

from __future__ import annotations

from agl import semconv as sc
from agl.adapter import llm_calls
from agl.adapter.calls import call_agents, filter_calls
from tests.adapter.spans import SpanMaker


def test_a_gateway_call_takes_the_agent_of_its_traced_twin() -> None:
    m = SpanMaker()
    scope = m.span("writer", {sc.AGENT_NAME: "writer"})
    traced = m.call(
        [], [], response_id="r1", source="openinference", parent=scope, attrs={sc.AGENT_NAME: "writer"}
    )
    gateway = m.call([1, 2], [3], response_id="r1")
    other = m.call([5], [6], response_id="r2", attrs={sc.AGENT_NAME: "critic"})
    calls = llm_calls([scope, traced, gateway, other])
    assert [c.span_id for c in calls] == [gateway.span_id, other.span_id]  # the gateway record wins
    assert [c.agent_name for c in calls] == ["writer", "critic"]
    assert [c.span_id for c in filter_calls(calls, "writer", [scope, traced, gateway, other])] == [
        gateway.span_id
    ]


def test_an_untagged_twin_still_places_the_call_under_its_scope_span() -> None:
    m = SpanMaker()
    scope = m.span("solver", {sc.AGENT_NAME: "solver"})
    traced = m.call([], [], response_id="r1", source="openinference", parent=scope)
    gateway = m.call([1, 2], [3], response_id="r1")
    spans = [scope, traced, gateway]
    calls = llm_calls(spans)
    assert call_agents(calls, spans) == ["solver"]
    assert filter_calls(calls, "solver", spans) == calls
    assert call_agents(calls, [gateway]) == [None]  # without the tracer's spans nothing names it


def test_the_innermost_scope_wins() -> None:
    m = SpanMaker()
    outer = m.span("team", {sc.AGENT_NAME: "team"})
    inner = m.span("critic", {sc.AGENT_NAME: "critic"}, parent=outer)
    call = m.call([1], [2], parent=inner)
    assert call_agents(llm_calls([outer, inner, call]), [outer, inner, call]) == ["critic"]


def test_samples_record_each_calls_completion_span() -> None:
    from agl.adapter import to_samples

    m = SpanMaker()
    first, second = m.call([1, 2], [3, 4], response_id="a"), m.call([1, 2, 3, 4, 9], [5], response_id="b")
    (sample,), _ = to_samples(llm_calls([first, second]), 1.0)
    assert sample.input_ids == (1, 2, 3, 4, 9, 5)
    assert sample.call_spans == ((2, 4), (5, 6)) and sample.call_response_ids == ("a", "b")
    assert [sample.input_ids[a:b] for a, b in sample.call_spans] == [(3, 4), (5,)]
