"""Per-call credit: a call's own reward shapes the advantage of that call's tokens, and the gradient."""

from __future__ import annotations

import pytest
import torch

from agl.algorithm.grpo import GRPOConfig, LossConfig, build_batch, grpo_loss
from agl.algorithm.policy.model import collate
from agl.errors import ConfigError
from agl.schemas import Rollout, RolloutStatus, Span
from tests.adapter.spans import SpanMaker


def _rollout(rid: str, group: str) -> Rollout:
    return Rollout(
        rollout_id=rid, group_id=group, status=RolloutStatus.SUCCEEDED, created_at=0.0, updated_at=0.0
    )


def _two_calls(rid: str, first_reward: float | None, final: float) -> list[Span]:
    """One merged trajectory: call a (tokens 3, 4), then call b (token 5); a per-call reward on a."""
    m = SpanMaker(rollout_id=rid)
    spans = [
        m.call([1, 2], [3, 4], response_id=f"{rid}-a"),
        m.call([1, 2, 3, 4, 9], [5], response_id=f"{rid}-b"),
    ]
    if first_reward is not None:
        spans.append(m.reward(first_reward, response_id=f"{rid}-a"))
    return [*spans, m.reward(final)]


def test_final_credit_ignores_call_rewards_per_call_credit_uses_them() -> None:
    spans = {"r1": _two_calls("r1", -5.0, 1.0), "r2": _two_calls("r2", None, 1.0)}
    rollouts = [_rollout(r, "g") for r in spans]
    final = build_batch(rollouts, spans, GRPOConfig(model_path="unused", group_size=2))
    assert final.samples == []  # equal final rewards: no signal, the -5 is lost
    batch = build_batch(rollouts, spans, GRPOConfig(model_path="unused", group_size=2, credit="per_call"))
    by_rollout = {s.rollout_id: s for s in batch.samples}
    r1, r2 = by_rollout["r1"], by_rollout["r2"]
    assert r1.token_advantages is not None and r2.token_advantages is not None
    a1, b1 = r1.token_advantages[2], r1.token_advantages[5]
    assert r1.token_advantages[3] == a1 and a1 < 0 < b1  # the call rewarded -5 is pushed down
    assert r2.token_advantages[2] > 0 and r2.token_advantages[5] > 0
    # returns -4, 1, 1, 1 over the group's calls, normalised: mean -0.25, std 2.165
    assert a1 == pytest.approx((-4 + 0.25) / 2.1651, abs=1e-3)
    assert [r1.token_advantages[i] for i in (0, 1, 4)] == [0.0, 0.0, 0.0]  # prompt and tool tokens


def test_per_call_credit_weight_and_validation() -> None:
    spans = {"r1": _two_calls("r1", -5.0, 1.0), "r2": _two_calls("r2", None, 1.0)}
    rollouts = [_rollout(r, "g") for r in spans]
    off = GRPOConfig(model_path="unused", group_size=2, credit="per_call", call_reward_weight=0.0)
    assert build_batch(rollouts, spans, off).samples == []  # weight 0: back to the final reward alone
    with pytest.raises(ConfigError, match="credit"):
        GRPOConfig(model_path="unused", credit="per_token")  # type: ignore[arg-type]


def test_gradient_sign_follows_each_calls_advantage() -> None:
    spans = {"r1": _two_calls("r1", -5.0, 1.0), "r2": _two_calls("r2", None, 1.0)}
    batch = build_batch(
        [_rollout(r, "g") for r in spans],
        spans,
        GRPOConfig(model_path="unused", group_size=2, credit="per_call"),
    )
    full = collate(batch.samples, batch.advantages, batch.rollout_index, pad_id=0)
    assert full.advantages.shape == full.mask.shape  # (B, T-1): per token, shifted like the mask
    logprobs = full.old_logprobs.clone().requires_grad_(True)
    loss, _ = grpo_loss(logprobs, full.old_logprobs, full.advantages, full.mask, LossConfig())
    loss.backward()
    assert logprobs.grad is not None
    i = [s.rollout_id for s in batch.samples].index("r1")
    grad = logprobs.grad[i]  # position t predicts token t+1: call a's tokens at 1, 2; call b's at 4
    # minimizing the loss moves logprobs against the gradient: down for call a, up for call b
    assert grad[1] > 0 and grad[2] > 0 and grad[4] < 0
    assert torch.all(grad[[0, 3]] == 0)
