"""A reasoning model's later prompt that drops an earlier turn's thinking: a classified mismatch, one
sample per call, never a silent merge."""

from __future__ import annotations

from agl import semconv as sc
from agl.adapter import llm_calls, to_samples
from tests.adapter.spans import SpanMaker

OPEN, CLOSE = 900, 901


def test_a_prompt_without_the_previous_thinking_is_thinking_stripped() -> None:
    m = SpanMaker()
    thought = {sc.LLM_REASONING: "so 5"}
    spans = [
        m.call([1, 2, 3], [OPEN, 10, CLOSE, 11, 2], attrs=thought),
        m.call([1, 2, 3, 11, 2, 60], [12, 2]),  # the template re-rendered turn one as its answer alone
    ]
    samples, report = to_samples(llm_calls(spans), 1.0)
    assert report.mismatches == {"thinking_stripped": 1}
    assert [s.input_ids for s in samples] == [(1, 2, 3, OPEN, 10, CLOSE, 11, 2), (1, 2, 3, 11, 2, 60, 12, 2)]
    assert [s.num_model_tokens for s in samples] == [5, 2]


def test_thinking_left_in_the_content_is_recognised_too() -> None:
    m = SpanMaker()  # a vLLM without a reasoning parser: the think block stays in the content
    reply = {sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": "<think>so 5</think>5"}}
    spans = [m.call([1, 2], [OPEN, 10, CLOSE, 11], attrs=reply), m.call([1, 2, 11, 60], [12])]
    _, report = to_samples(llm_calls(spans), 1.0)
    assert report.mismatches == {"thinking_stripped": 1}


def test_without_thinking_the_mismatch_keeps_its_old_class() -> None:
    m = SpanMaker()
    spans = [m.call([1, 2], [10, 11]), m.call([1, 2, 10, 99, 60], [12])]
    _, report = to_samples(llm_calls(spans), 1.0)
    assert report.mismatches == {"retokenization": 1}
