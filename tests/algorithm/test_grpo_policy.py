"""The trainer side on the tiny model: merged-vs-split and micro-batched gradients agree, engine logprobs agree."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agl.adapter import Sample, llm_calls, to_samples
from agl.algorithm.grpo import LossConfig
from agl.algorithm.policy.model import Policy, PolicyConfig, collate
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import Span
from tests.adapter.spans import SpanMaker
from tests.algorithm.engine_gaps import engine_logprob_gaps
from tests.support.gradients import batch_gradient


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def policy(tiny: Path) -> Iterator[Policy]:
    yield Policy(PolicyConfig(model_path=str(tiny), lr=0.0, max_grad_norm=1e9), LossConfig())


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(n)]


def multi_turn_rollout(rollout_id: str, seed: int, turns: int) -> list[Span]:
    """Spans of ``turns`` calls whose prompts extend each other (tool results inserted between replies)."""
    rng = random.Random(seed)
    m = SpanMaker(rollout_id=rollout_id)
    spans = []
    context = _ids(rng, 6)
    for _ in range(turns):
        reply = _ids(rng, rng.randrange(2, 6))
        old = [-6.9 + rng.uniform(-0.1, 0.1) for _ in reply]  # near the tiny model's own, so ratios stay ~1
        spans.append(m.call(list(context), reply, old))
        context += reply + _ids(rng, rng.randrange(1, 4))
    return spans


def _batch(level: str) -> tuple[list[Sample], list[float], list[int]]:
    samples, advantages, index = [], [], []
    for n, (turns, adv) in enumerate([(3, 1.0), (2, -0.7), (4, 0.4)]):
        made, report = to_samples(llm_calls(multi_turn_rollout(f"ro-{n}", n, turns)), 1.0, level=level)  # type: ignore[arg-type]
        assert report.samples == (1 if level == "trajectory" else turns)
        samples += made
        advantages += [adv] * len(made)
        index += [n] * len(made)
    return samples, advantages, index


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-7, msg=name)
    assert max(float(g.abs().max()) for g in a.values()) > 1e-4  # a real gradient, not zeros on both sides


@pytest.mark.parametrize("aggregation", ["token_mean", "rollout_mean"])
def test_a_merged_trajectory_gives_the_gradient_of_its_transitions(policy: Policy, aggregation: str) -> None:
    # token_mean and rollout_mean normalise by model-token counts, which merging does not change
    policy.loss_config = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    merged = _batch("trajectory")
    split = _batch("transition")
    assert sum(s.num_model_tokens for s in merged[0]) == sum(s.num_model_tokens for s in split[0])
    assert sum(len(s.input_ids) for s in merged[0]) < sum(len(s.input_ids) for s in split[0])
    _assert_same(batch_gradient(policy, *merged), batch_gradient(policy, *split))
    policy.loss_config = LossConfig()


def test_sequence_mean_is_not_merge_invariant(policy: Policy) -> None:
    # the control for the test above: per-sample normalisation must see the different split
    policy.loss_config = LossConfig(aggregation="sequence_mean")
    a, b = batch_gradient(policy, *_batch("trajectory")), batch_gradient(policy, *_batch("transition"))
    policy.loss_config = LossConfig()
    assert any(not torch.allclose(a[n], b[n], rtol=1e-3, atol=1e-6) for n in a)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "rollout_mean"])
def test_micro_batches_give_the_gradient_of_one_batch(tiny: Path, aggregation: str) -> None:
    loss = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    whole = Policy(PolicyConfig(model_path=str(tiny), lr=0.0, micro_batch_tokens=100_000), loss)
    small = Policy(PolicyConfig(model_path=str(tiny), lr=0.0, micro_batch_tokens=40), loss)
    samples, adv, index = _batch("transition")
    assert len(whole.micro_batches(samples)) == 1
    assert len(small.micro_batches(samples)) >= 4
    _assert_same(batch_gradient(whole, samples, adv, index), batch_gradient(small, samples, adv, index))


def _checkpointing(model: torch.nn.Module) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):  # transformers >= 5
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_activation_checkpointing_gives_the_same_gradient(tiny: Path, lora_rank: int) -> None:
    config = PolicyConfig(model_path=str(tiny), lr=0.0, lora_rank=lora_rank, activation_checkpointing=False)
    plain = Policy(config, LossConfig())
    recomputed = Policy(dataclasses.replace(config, activation_checkpointing=True), LossConfig())
    assert _checkpointing(recomputed.model) and not _checkpointing(plain.model)
    batch = _batch("trajectory")
    _assert_same(batch_gradient(plain, *batch), batch_gradient(recomputed, *batch))


def test_collate_shifts_masks_to_the_predicted_token() -> None:
    s = Sample("r", None, (5, 6, 7, 8), (0, 0, 1, 1), (0.0, 0.0, -1.0, -2.0), 1.0)
    short = Sample("r", None, (5, 9), (0, 1), None, 0.0)
    batch = collate([s, short], [1.0, -1.0], [0, 1], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0.0, -1.0, -2.0], [0.0, 0.0, 0.0]]
    assert batch.has_old.tolist() == [True, False]


def test_an_empty_batch_is_a_clear_error(policy: Policy) -> None:
    with pytest.raises(ConfigError, match="at least one sample"):
        policy.step([], [], [])


async def test_engine_and_trainer_logprobs_agree_on_sampled_tokens(tiny: Path, policy: Policy) -> None:
    from agl.engines.builtin import Engine

    (gap,) = await engine_logprob_gaps(Engine(tiny, max_batch_size=8), policy.model, policy.pad_id, ["fp32"])
    worst = float(gap.max())
    print(f"engine vs trainer logprobs: max abs diff {worst:.2e} over {gap.numel()} tokens")
    assert worst < 1e-4


def test_short_rows_take_eager_attention_with_the_same_gradient(
    policy: Policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of a few dozen tokens run plain attention (cheaper than SDPA's CPU backward there): same gradient,
    and the model is back on SDPA after the step."""
    from agl.algorithm.policy import model as policy_model

    seen: list[str] = []
    attention = policy.model.model.layers[0].self_attn
    hook = attention.register_forward_pre_hook(lambda m, _a: seen.append(m.config._attn_implementation))
    batch = _batch("trajectory")
    assert max(len(s.input_ids) for s in batch[0]) <= policy_model.EAGER_ATTENTION_MAX_LEN
    try:
        eager = batch_gradient(policy, *batch)
        monkeypatch.setattr(policy_model, "EAGER_ATTENTION_MAX_LEN", 0)
        sdpa = batch_gradient(policy, *batch)
    finally:
        hook.remove()
    assert "eager" in seen and "sdpa" in seen
    assert policy.model.config._attn_implementation == "sdpa"
    _assert_same(eager, sdpa)
