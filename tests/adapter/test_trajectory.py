"""Trajectory-level merging, masks, mismatch classification and reward assignment."""

from __future__ import annotations

import pytest

from agl import semconv as sc
from agl.adapter import Sample, call_rewards, final_reward, llm_calls, to_samples
from tests.adapter.spans import SpanMaker


def test_consecutive_calls_merge_with_inserted_tokens_masked() -> None:
    m = SpanMaker()
    spans = [
        m.call([1, 2, 3], [10, 11], [-0.1, -0.2]),
        m.call([1, 2, 3, 10, 11, 50, 51], [12], [-0.3]),  # 50, 51: a tool result
        m.call([1, 2, 3, 10, 11, 50, 51, 12, 60], [13, 14], [-0.4, -0.5]),
        m.reward(1.0),
    ]
    samples, report = to_samples(llm_calls(spans), final_reward(spans) or 0.0)
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == (1, 2, 3, 10, 11, 50, 51, 12, 60, 13, 14)
    assert s.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1)
    assert s.old_logprobs == (0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5)
    assert s.reward == 1.0 and s.num_calls == 3 and s.num_model_tokens == 5
    assert report.merged_fraction == 1.0 and report.samples_per_rollout == 1.0
    assert not report.mismatches


def test_transition_level_gives_one_sample_per_call() -> None:
    m = SpanMaker()
    spans = [m.call([1, 2], [3]), m.call([1, 2, 3, 4], [5, 6])]
    samples, report = to_samples(llm_calls(spans), 0.5, level="transition")
    assert [s.input_ids for s in samples] == [(1, 2, 3), (1, 2, 3, 4, 5, 6)]
    assert [s.loss_mask for s in samples] == [(0, 0, 1), (0, 0, 0, 0, 1, 1)]
    assert all(s.reward == 0.5 for s in samples)
    assert report.samples == 2 and not report.mismatches


@pytest.mark.parametrize(
    ("second_prompt", "why"),
    [
        ([1, 9, 3, 10, 11, 50], "template_change"),  # the earlier prompt itself changed
        ([1, 2, 3, 77, 50, 60], "retokenization"),  # the reply came back as different ids
        ([1, 2, 3, 10], "other"),  # shorter than prompt + reply: truncated history
    ],
)
def test_prefix_mismatch_starts_a_new_sample_and_says_why(second_prompt: list[int], why: str) -> None:
    m = SpanMaker()
    spans = [m.call([1, 2, 3], [10, 11]), m.call(second_prompt, [12])]
    samples, report = to_samples(llm_calls(spans), 1.0)
    assert len(samples) == 2
    assert samples[1].input_ids == (*second_prompt, 12)
    assert samples[1].loss_mask == (0,) * len(second_prompt) + (1,)
    assert report.mismatches == {why: 1}
    assert report.merged_fraction == 0.0 and report.samples_per_rollout == 2.0


def test_calls_without_token_ids_are_skipped_and_counted_never_retokenized() -> None:
    m = SpanMaker()
    spans = [m.call([1, 2], [3]), m.span("agl.llm.call", {"agl.llm.api": "chat.completions"})]
    samples, report = to_samples(llm_calls(spans), 1.0)
    assert len(samples) == 1 and report.skipped_no_token_ids == 1


def test_logprob_count_must_match_the_reply_or_the_call_is_skipped() -> None:
    m = SpanMaker()
    samples, report = to_samples(llm_calls([m.call([1], [2, 3], [-0.1])]), 1.0)
    assert samples == [] and report.skipped_no_token_ids == 1


def test_calls_are_ordered_by_sequence_id_not_list_order() -> None:
    m = SpanMaker()
    first, second = m.call([1], [2]), m.call([1, 2, 3], [4])
    samples, _ = to_samples(llm_calls([second, first]), 1.0)
    assert samples[0].input_ids == (1, 2, 3, 4)


def test_gateway_record_wins_over_a_client_side_duplicate() -> None:
    m = SpanMaker()
    spans = [
        m.call([1], [2], response_id="r1", source="openinference"),
        m.call([1], [2], response_id="r1"),
    ]
    calls = llm_calls(spans)
    assert len(calls) == 1 and calls[0].source == "gateway"


def test_final_reward_is_the_last_unlinked_reward() -> None:
    m = SpanMaker()
    spans = [m.reward(0.2), m.reward(0.7, response_id="r1"), m.reward(0.4)]
    assert final_reward(spans) == 0.4
    assert call_rewards(spans) == {"r1": 0.7}
    assert final_reward([m.call([1], [2])]) is None


def test_per_call_rewards_go_to_the_sample_ending_with_that_call() -> None:
    m = SpanMaker()
    spans = [
        m.call([1], [2], response_id="a"),
        m.call([5], [6], response_id="b"),  # not a continuation: its own sample
        m.reward(0.9, response_id="a"),
        m.reward(0.1),
    ]
    samples, _ = to_samples(llm_calls(spans), final_reward(spans) or 0.0, call_rewards=call_rewards(spans))
    assert [s.reward for s in samples] == [0.9, 0.1]


def test_samples_are_frozen_and_slotted() -> None:
    s = Sample("r", None, (1,), (1,), None, 1.0)
    with pytest.raises(AttributeError):
        s.reward = 2.0  # type: ignore[misc]
    assert not hasattr(s, "__dict__")


def test_after_a_mismatch_later_calls_extend_the_new_sample() -> None:
    m = SpanMaker()
    spans = [
        m.call([1, 2], [3]),
        m.call([7, 2, 3, 4], [5]),  # template change: a new sample starts here
        m.call([7, 2, 3, 4, 5, 6], [8]),  # extends the second sample
    ]
    samples, report = to_samples(llm_calls(spans), 1.0)
    assert [s.num_calls for s in samples] == [1, 2]
    assert samples[1].input_ids == (7, 2, 3, 4, 5, 6, 8)
    assert samples[1].loss_mask == (0, 0, 0, 0, 1, 0, 1)
    assert report.mismatches == {"template_change": 1} and report.merged_calls == 1
    assert report.merged_fraction == 0.5


def test_a_merged_call_without_logprobs_drops_the_samples_old_logprobs() -> None:
    m = SpanMaker()
    first = m.call([1], [2], [-0.1])
    second = m.span(
        sc.SPAN_LLM_CALL,
        {
            sc.LLM_API: "chat.completions",
            sc.LLM_PROMPT_TOKEN_IDS: [1, 2, 3],
            sc.LLM_COMPLETION_TOKEN_IDS: [4],
        },
    )
    samples, report = to_samples(llm_calls([first, second]), 1.0)
    assert len(samples) == 1 and samples[0].old_logprobs is None
    assert samples[0].loss_mask == (0, 1, 0, 1) and report.skipped_no_token_ids == 0


def test_a_per_call_reward_on_the_last_merged_call_covers_the_whole_trajectory() -> None:
    m = SpanMaker()
    spans = [
        m.call([1], [2], response_id="t1"),
        m.call([1, 2, 3], [4], response_id="t2"),
        m.reward(0.3, response_id="t2"),
        m.reward(0.8),
    ]
    merged, _ = to_samples(llm_calls(spans), final_reward(spans) or 0.0, call_rewards=call_rewards(spans))
    assert [s.reward for s in merged] == [0.3]
    split, _ = to_samples(
        llm_calls(spans), final_reward(spans) or 0.0, call_rewards=call_rewards(spans), level="transition"
    )
    assert [s.reward for s in split] == [0.8, 0.3]


def test_group_id_and_model_version_travel_with_the_sample() -> None:
    m = SpanMaker()
    spans = [m.call([1], [2], attrs={sc.LLM_MODEL_VERSION: "v3"})]
    samples, _ = to_samples(llm_calls(spans), 1.0, group_id="g1")
    assert samples[0].group_id == "g1" and samples[0].model_version == "v3"


def test_no_usable_calls_give_no_samples() -> None:
    samples, report = to_samples([], 1.0)
    assert samples == [] and report.samples == 0 and report.merged_fraction == 1.0


# ChatML-like ids: 1 <|im_start|>, 2 <|im_end|>, 5 "\n", 9 "assistant", 30 "tool"
P1 = [1, 7, 8, 2, 5, 1, 9, 5]  # a user turn, then the generation prompt
COMPACT = [20, 21, 22, 2]  # the model's tool call, ending its turn
RE_RENDERED = [20, 23, 24, 22, 2]  # the same call as the template renders it from the parsed tool_calls
TOOL_TURN = [5, 1, 30, 5, 40, 2, 5, 1, 9, 5]  # the tool's result, then the generation prompt


def test_a_re_rendered_reply_is_reconciled_with_the_models_own_tokens_trained() -> None:
    m = SpanMaker()
    p2 = P1 + RE_RENDERED + TOOL_TURN
    p3 = p2 + [41, 2] + TOOL_TURN  # the second reply came back exactly: a plain extension
    spans = [
        m.call(P1, COMPACT, [-0.1, -0.2, -0.3, -0.4], attrs={sc.LLM_FINISH_REASON: "tool_calls"}),
        m.call(p2, [41, 2], [-0.5, -0.6]),
        m.call(p3, [42, 2], [-0.7, -0.8]),
    ]
    (s,), report = to_samples(llm_calls(spans), 1.0)
    assert s.input_ids == (*P1, *COMPACT, *TOOL_TURN, 41, 2, *TOOL_TURN, 42, 2)
    assert s.loss_mask == (0,) * 8 + (1,) * 4 + (0,) * 10 + (1, 1) + (0,) * 10 + (1, 1)
    gap = (0.0,) * len(TOOL_TURN)
    assert s.old_logprobs == (0.0,) * 8 + (-0.1, -0.2, -0.3, -0.4) + gap + (-0.5, -0.6) + gap + (-0.7, -0.8)
    assert s.call_spans == ((8, 12), (22, 24), (34, 36)) and s.reconciled_calls == 1
    assert report.merged_calls == 2 and report.reconciled_calls == 1 and not report.mismatches
    assert report.merged_fraction == 1.0


@pytest.mark.parametrize(
    ("first_reply", "finish", "second_prompt", "why"),
    [
        # the earlier prompt itself changed: nothing to reconcile
        (COMPACT, "stop", [1, 6, 8, 2, 5, 1, 9, 5, *RE_RENDERED, *TOOL_TURN], "template_change"),
        # cut by max_tokens: the reply has no end-of-turn token to find again
        ([20, 21, 22], "length", P1 + RE_RENDERED + TOOL_TURN, "retokenization"),
        # the reply ends with a token that closes no turn of the prompt
        ([20, 21, 22, 23], "stop", P1 + [20, 24, 22, 23, 2] + TOOL_TURN, "retokenization"),
        # the end token is found, but the template's turn separator does not follow it
        (COMPACT, "stop", P1 + RE_RENDERED + [6, 1, 30, 5, 40, 2, 5, 1, 9, 5], "retokenization"),
    ],
)
def test_what_cannot_be_reconciled_stays_a_mismatch(
    first_reply: list[int], finish: str, second_prompt: list[int], why: str
) -> None:
    m = SpanMaker()
    spans = [m.call(P1, first_reply, attrs={sc.LLM_FINISH_REASON: finish}), m.call(second_prompt, [41, 2])]
    samples, report = to_samples(llm_calls(spans), 1.0)
    assert [s.input_ids for s in samples] == [(*P1, *first_reply), (*second_prompt, 41, 2)]
    assert report.mismatches == {why: 1} and report.reconciled_calls == 0 and report.merged_calls == 0


def test_a_reply_that_thought_is_never_reconciled() -> None:
    """Qwen3's template drops an earlier reply's <think> block: the next call saw a context a whole block
    shorter than the merged sample would give it, so each call trains alone, classified."""
    m = SpanMaker()
    thinking = {sc.LLM_FINISH_REASON: "stop", sc.LLM_REASONING: "so 2 + 3 = 5"}
    spans = [m.call(P1, COMPACT, attrs=thinking), m.call(P1 + RE_RENDERED + TOOL_TURN, [41, 2])]
    samples, report = to_samples(llm_calls(spans), 1.0)
    assert len(samples) == 2 and report.reconciled_calls == 0
    assert report.mismatches == {"thinking_stripped": 1}


def test_transition_level_never_reconciles() -> None:
    m = SpanMaker()
    spans = [m.call(P1, COMPACT), m.call(P1 + RE_RENDERED + TOOL_TURN, [41, 2])]
    samples, report = to_samples(llm_calls(spans), 1.0, level="transition")
    assert len(samples) == 2 and report.reconciled_calls == 0
