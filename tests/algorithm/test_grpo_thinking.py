"""``GRPOConfig(train_thinking=False)``: a reasoning model's ``<think>`` blocks leave the loss, nothing else does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agl.adapter.thinking import think_token_ids
from agl.algorithm.grpo import GRPO, GRPOConfig, build_batch
from agl.algorithm.policy.model import collate
from agl.errors import ConfigError
from agl.schemas import Rollout, RolloutStatus, Span
from tests.adapter.spans import SpanMaker

OPEN, CLOSE = 900, 901
TAGS = (OPEN, CLOSE)


def _rollout(rid: str) -> Rollout:
    return Rollout(
        rollout_id=rid, group_id="g", status=RolloutStatus.SUCCEEDED, created_at=0.0, updated_at=0.0
    )


def _thinking_rollout(rid: str, reward: float) -> list[Span]:
    """Two merged turns; each completion thinks (OPEN .. CLOSE) and then answers."""
    m = SpanMaker(rollout_id=rid)
    first = [OPEN, 10, 11, CLOSE, 12, 2]
    second = [OPEN, 13, CLOSE, 14, 2]
    return [
        m.call([1, 2, 3], first),
        m.call([1, 2, 3, *first, 50], second),  # 50: a tool result
        m.reward(reward),
    ]


def _batch(config: GRPOConfig) -> tuple[list[tuple[int, ...]], dict[str, float]]:
    spans = {"r1": _thinking_rollout("r1", 1.0), "r2": _thinking_rollout("r2", 0.0)}
    batch = build_batch([_rollout(r) for r in spans], spans, config)
    return [s.loss_mask for s in batch.samples], batch.metrics


def test_train_thinking_false_masks_the_think_blocks_of_each_turn_and_counts_them() -> None:
    trained, metrics = _batch(GRPOConfig(model_path="unused", group_size=2))
    prompt, first, tool, second = (0,) * 3, (1,) * 6, (0,), (1,) * 5
    assert trained == [prompt + first + tool + second] * 2  # the default trains every model token
    assert "thinking_tokens_masked" not in metrics

    masked, metrics = _batch(
        GRPOConfig(model_path="unused", group_size=2, train_thinking=False, think_token_ids=TAGS)
    )
    first, second = (0, 0, 0, 0, 1, 1), (0, 0, 0, 1, 1)  # <think> .. </think> inclusive: out; the answer: in
    assert masked == [prompt + first + tool + second] * 2
    assert metrics["thinking_tokens_masked"] == 2 * (4 + 3)


def test_a_completion_that_starts_inside_its_prompts_block_is_masked_up_to_the_close() -> None:
    m = SpanMaker(rollout_id="r1")
    n = SpanMaker(rollout_id="r2")
    spans = {  # a template that opens <think> in the generation prompt: the completion starts thinking
        "r1": [m.call([1, 2, OPEN], [10, 11, CLOSE, 12, 2]), m.reward(1.0)],
        "r2": [n.call([1, 2, OPEN], [10, CLOSE, 12, 2]), n.reward(0.0)],
    }
    config = GRPOConfig(model_path="unused", group_size=2, train_thinking=False, think_token_ids=TAGS)
    batch = build_batch([_rollout(r) for r in spans], spans, config)
    assert [s.loss_mask for s in batch.samples] == [(0, 0, 0, 0, 0, 0, 1, 1), (0, 0, 0, 0, 0, 1, 1)]
    # the masked tokens carry no loss in the policy's batch (position t describes token t + 1)
    collated = collate(batch.samples, batch.advantages, batch.rollout_index, pad_id=0)
    assert collated.mask[0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_thinking_settings_are_checked() -> None:
    spans = {"r1": _thinking_rollout("r1", 1.0), "r2": _thinking_rollout("r2", 0.0)}
    with pytest.raises(ConfigError, match="think_token_ids"):
        build_batch(
            [_rollout(r) for r in spans],
            spans,
            GRPOConfig(model_path="u", group_size=2, train_thinking=False),
        )
    for bad in ((5, 5), (1,), (-1, 2), ("a", "b")):
        with pytest.raises(ConfigError, match="think_token_ids"):
            GRPOConfig(model_path="u", think_token_ids=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="train_thinking"):
        GRPOConfig(model_path="u", train_thinking="no")  # type: ignore[arg-type]


def test_grpo_reads_the_think_ids_from_the_policys_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agl.models import tiny_model

    thinking = tiny_model(cache_dir=tmp_path, thinking=True)
    algo = GRPO(GRPOConfig(model_path=str(thinking), train_thinking=False))
    algo.policy = algo._make_policy()
    algo._resolve_thinking()
    tokenizer: Any = AutoTokenizer.from_pretrained(thinking)
    expected = tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    assert algo.config.think_token_ids == expected == think_token_ids(tokenizer)

    plain = tiny_model(cache_dir=tmp_path)  # ChatML, no think tokens: the setting cannot be honoured
    algo = GRPO(GRPOConfig(model_path=str(plain), train_thinking=False))
    algo.policy = algo._make_policy()
    with pytest.raises(ConfigError, match="train_thinking"):
        algo._resolve_thinking()
