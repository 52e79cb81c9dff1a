"""Agent filtering of model calls, one call recorded several times counted once, and the messages adapter."""

from __future__ import annotations

import re

from agl import semconv as sc
from agl.adapter import filter_calls, llm_calls, to_messages, to_samples
from agl.adapter.calls import duplicates
from agl.adapter.trajectory import UNTRAINABLE, untrainable_reason
from agl.schemas import LLMCall
from tests.adapter.spans import SpanMaker


def test_filter_by_agent_tag_exact_and_regex() -> None:
    m = SpanMaker()
    spans = [
        m.call([1], [2], attrs={sc.AGENT_NAME: "planner"}),
        m.call([3], [4], attrs={sc.AGENT_NAME: "coder-1"}),
        m.call([5], [6]),
    ]
    calls = llm_calls(spans)
    assert [c.prompt_token_ids for c in filter_calls(calls, "planner")] == [[1]]
    assert [c.prompt_token_ids for c in filter_calls(calls, re.compile(r"^coder"))] == [[3]]
    assert len(filter_calls(calls, None)) == 3


def test_filter_by_enclosing_agent_span_name() -> None:
    m = SpanMaker()
    outer = m.span("solver", {})
    inner = m.span("step", {}, parent=outer)
    spans = [outer, inner, m.call([1], [2], parent=inner), m.call([3], [4])]
    calls = filter_calls(llm_calls(spans), "solver", spans)
    assert [c.prompt_token_ids for c in calls] == [[1]]


def test_messages_keep_tool_calls_and_the_final_reply() -> None:
    m = SpanMaker()
    tool_call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    spans = [
        m.call([1], [2], attrs={sc.LLM_REQUEST_MESSAGES: history[:1]}),
        m.call(
            [1, 2, 3],
            [4],
            attrs={
                sc.LLM_REQUEST_MESSAGES: history,
                sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": "Answer: 4", "tool_calls": None},
            },
        ),
    ]
    messages = to_messages(llm_calls(spans))
    assert messages[:3] == history
    assert messages[3] == {"role": "assistant", "content": "Answer: 4"}
    assert to_messages([]) == []


def test_tracer_calls_without_a_gateway_twin_are_kept_in_sequence_order() -> None:
    m = SpanMaker()
    spans = [
        m.call([1], [2], response_id="r1"),
        m.call([1], [2], response_id="r1", source="openinference"),  # duplicate of the gateway's r1
        m.call([3], [4], response_id="r2", source="openinference"),  # only the tracer saw r2
    ]
    calls = llm_calls(list(reversed(spans)))
    assert [(c.response_id, c.source) for c in calls] == [("r1", "gateway"), ("r2", "openinference")]


def test_non_call_spans_are_ignored() -> None:
    m = SpanMaker()
    spans = [m.span("agent.step", {}), m.reward(1.0), m.call([1], [2])]
    assert [c.prompt_token_ids for c in llm_calls(spans)] == [[1]]


def test_filter_by_regex_on_the_enclosing_span_name() -> None:
    m = SpanMaker()
    outer = m.span("agent:writer", {})
    other = m.span("agent:reviewer", {})
    spans = [outer, other, m.call([1], [2], parent=outer), m.call([3], [4], parent=other)]
    calls = filter_calls(llm_calls(spans), re.compile(r"writer$"), spans)
    assert [c.prompt_token_ids for c in calls] == [[1]]
    assert filter_calls(llm_calls(spans), "writer", spans) == []  # a plain string must match exactly


def test_messages_keep_tool_calls_of_the_final_reply() -> None:
    m = SpanMaker()
    tool_call = {"id": "c9", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    reply = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    spans = [
        m.call(
            [1],
            [2],
            attrs={
                sc.LLM_REQUEST_MESSAGES: [{"role": "user", "content": "find x"}],
                sc.LLM_RESPONSE_MESSAGE: reply,
            },
        )
    ]
    messages = to_messages(llm_calls(spans))
    assert messages == [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "tool_calls": [tool_call]},
    ]


def test_a_traced_record_without_a_response_id_is_paired_by_its_reply() -> None:
    m = SpanMaker()
    reply = {sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": "same"}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    tool_reply = {sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": None}, sc.LLM_TOOL_CALLS: [call]}
    spaced = {**call, "function": {"name": "f", "arguments": '{"a": 1}'}}
    spans = [
        m.call([1], [2], response_id="g1", attrs=reply),
        m.call([1], [2], response_id="g2", attrs=reply),  # the same text again: paired in call order
        m.call([3], [4], response_id="g3", attrs=tool_reply),
        # LangChain's streamed records: no response id, no token ids
        m.span(sc.SPAN_LLM_CALL, {sc.LLM_SOURCE: "openinference", sc.LLM_API: "chat.completions", **reply}),
        m.span(sc.SPAN_LLM_CALL, {sc.LLM_SOURCE: "openinference", sc.LLM_API: "chat.completions", **reply}),
        m.span(
            sc.SPAN_LLM_CALL,
            {
                sc.LLM_SOURCE: "openinference",
                sc.LLM_API: "chat.completions",
                sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": ""},
                sc.LLM_TOOL_CALLS: [spaced],  # the same arguments, serialised with other spacing
            },
        ),
    ]
    dupes = duplicates([c for c in (LLMCall.from_span(s) for s in spans) if c is not None])
    assert dupes == {
        spans[3].span_id: spans[0].span_id,
        spans[4].span_id: spans[1].span_id,
        spans[5].span_id: spans[2].span_id,
    }
    assert [c.response_id for c in llm_calls(spans)] == ["g1", "g2", "g3"]


def test_two_tracers_recording_one_call_past_the_gateway_count_it_once() -> None:
    m = SpanMaker()
    reply = {sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": "hosted"}}
    spans = [
        m.span(  # the openai instrumentor's record of a call to a hosted API: its id, no token ids
            sc.SPAN_LLM_CALL,
            {
                sc.LLM_SOURCE: "openinference",
                sc.LLM_API: "chat.completions",
                sc.LLM_RESPONSE_ID: "x1",
                **reply,
            },
        ),
        m.span(  # LangChain's record of it, streamed: no id
            sc.SPAN_LLM_CALL, {sc.LLM_SOURCE: "openinference", sc.LLM_API: "chat.completions", **reply}
        ),
        m.span(  # another call to it that only one tracer saw, with another reply
            sc.SPAN_LLM_CALL,
            {
                sc.LLM_SOURCE: "openinference",
                sc.LLM_API: "chat.completions",
                sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": "other"},
            },
        ),
    ]
    calls = llm_calls(spans)
    assert [c.span_id for c in calls] == [spans[0].span_id, spans[2].span_id]
    _, report = to_samples(calls, 1.0)
    assert report.untrainable == {"not_through_gateway": 2}


def test_each_untrainable_call_says_why() -> None:
    m = SpanMaker()
    spans = [
        m.call([1], [2]),
        m.span(sc.SPAN_LLM_CALL, {sc.LLM_API: "chat.completions"}),  # a hosted API through the gateway
        m.span(sc.SPAN_LLM_CALL, {sc.LLM_API: "chat.completions", sc.LLM_ERROR: "upstream 400"}),
        m.call([1], [2, 3], [-0.1]),  # one logprob for two tokens
    ]
    calls = llm_calls(spans)
    assert [untrainable_reason(c) for c in calls] == [None, "no_token_ids", "failed", "logprobs_mismatch"]
    assert all(reason in UNTRAINABLE for reason in ("no_token_ids", "failed", "logprobs_mismatch"))
    _, report = to_samples(calls, 1.0)
    assert report.untrainable == {"no_token_ids": 1, "failed": 1, "logprobs_mismatch": 1}
    assert report.skipped_no_token_ids == 3
