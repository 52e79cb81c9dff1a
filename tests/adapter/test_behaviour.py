"""Behaviour numbers per step from spans: calls, tool use, reply length, cut-off replies, emitted values."""

from __future__ import annotations

import pytest

from agl import semconv as sc
from agl.adapter.behaviour import MAX_EMITTED, emitted_numbers, rollout_behaviour, step_behaviour
from tests.adapter.spans import SpanMaker

TOOL_CALL = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]


def _rollout(rid: str, *, tool: bool, cut: bool, emitted: object) -> list:
    make = SpanMaker(rid)
    first = make.call([1, 2], [3, 4, 5], attrs={sc.LLM_TOOL_CALLS: TOOL_CALL} if tool else None)
    second = make.call([1, 2, 3, 4, 5, 6], [7], attrs={sc.LLM_FINISH_REASON: "length" if cut else "stop"})
    return [first, second, make.span(sc.SPAN_OBJECT, {sc.OBJECT_VALUE: emitted}), make.reward(1.0)]


def test_a_step_s_behaviour_is_counted_per_call_and_per_rollout() -> None:
    a = _rollout("ro-a", tool=True, cut=False, emitted={"recursion_limit_hit": True, "note": "x", "depth": 3})
    b = _rollout("ro-b", tool=False, cut=True, emitted={"recursion_limit_hit": False})
    assert rollout_behaviour(a) == {"calls": 2.0, "tool_calls": 1.0, "completion_tokens": 4.0, "cut_off": 0.0}
    got = step_behaviour({"ro-a": a, "ro-b": b})
    assert got == {
        "behaviour_calls_per_rollout": 2.0,
        "behaviour_tool_call_rate": 0.25,
        "behaviour_completion_tokens": 2.0,
        "behaviour_cut_off_rate": 0.25,
        "emitted_depth": 3.0,  # the mean over the rollouts that emitted it
        "emitted_recursion_limit_hit": 0.5,  # a flag's share of rollouts
    }
    assert step_behaviour({}) == {}


def test_emitted_values_keep_numbers_and_flags_only_with_safe_names() -> None:
    make = SpanMaker()
    spans = [
        make.span(sc.SPAN_OBJECT, {sc.OBJECT_VALUE: 0.25}),
        make.span(sc.SPAN_OBJECT, {sc.OBJECT_VALUE: {"tool calls/turn": 2, "list": [1], "text": "x"}}),
        make.span(sc.SPAN_OBJECT, {sc.OBJECT_VALUE: {"tool calls/turn": 4}}),  # the last value counts
        make.span(sc.SPAN_MESSAGE, {sc.MESSAGE_TEXT: "not an object"}),
    ]
    assert emitted_numbers(spans) == {"value": 0.25, "tool_calls_turn": 4.0}


def test_emitted_names_are_capped_so_curves_stay_readable() -> None:
    make = SpanMaker()
    spans = [make.span(sc.SPAN_OBJECT, {sc.OBJECT_VALUE: {f"k{i:02d}": i for i in range(MAX_EMITTED + 5)}})]
    got = step_behaviour({"ro-1": spans})
    assert len([k for k in got if k.startswith("emitted_")]) == MAX_EMITTED
    assert got["behaviour_calls_per_rollout"] == 0.0 and got["behaviour_tool_call_rate"] == pytest.approx(0.0)
