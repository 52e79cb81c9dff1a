"""The objective menu against hand references on the fixed batch of ``test_grpo_loss``: GSPO's sequence
ratio, CISPO's clipped constant weight, std scaling by group/batch/none and the batch (RLOO) baseline."""

from __future__ import annotations

import math

import pytest
import torch

from agl.algorithm.grpo import GRPOConfig, build_batch, group_advantages
from agl.algorithm.policy.loss import Aggregation, LossConfig, grpo_loss
from agl.cli.train import ConfigProblem, build
from agl.errors import ConfigError
from agl.schemas import Rollout, RolloutStatus, Span
from tests.adapter.spans import SpanMaker
from tests.algorithm.test_grpo_loss import ADV, LOGPROBS, MASK, OLD, REF, ROLLOUT, _t, ref_weights

# GSPO clips far tighter than GRPO: with these bounds the fixed batch's sequences land in every branch
GSPO = LossConfig(clip_low=0.05, clip_high=0.1, tis_cap=1.3, objective="gspo")
CISPO = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=3.0, objective="cispo")


def _sequence_ratio(b: int) -> float:
    """exp of the mean log-ratio over sequence b's model tokens."""
    picked = [LOGPROBS[b][t] - OLD[b][t] for t in range(len(MASK[b])) if MASK[b][t]]
    return math.exp(sum(picked) / len(picked))


def ref_gspo(
    aggregation: str, kl_coef: float, cfg: LossConfig = GSPO
) -> tuple[float, list[list[float]], set[str]]:
    """GSPO by hand: one clipped term per sequence on each of its tokens. d s_b / d lp_t = s_b / n_b, and
    the term sits on every token, so each token's gradient is d(term)/d lp_t times the sequence's weight."""
    w = ref_weights(aggregation)
    loss, grad, branches = 0.0, [], set()
    for b, row_mask in enumerate(MASK):
        a, s, n = ADV[b], _sequence_ratio(b), sum(row_mask)
        c = min(max(s, 1 - cfg.clip_low), 1 + cfg.clip_high)
        if s * a <= c * a:
            term, d_term, branch = -s * a, -s * a / n, "in_range" if s == c else "unclipped"
        else:
            term, d_term, branch = -c * a, 0.0, "clipped"
        if cfg.tis_cap is not None and a < 0 and term > cfg.tis_cap * -a:
            term, d_term, branch = cfg.tis_cap * -a, 0.0, "tis"
        branches.add(branch)
        seq_weight = sum(w[b])
        loss += term * seq_weight
        row = []
        for t in range(len(row_mask)):
            g = d_term * seq_weight if row_mask[t] else 0.0
            if row_mask[t] and kl_coef:
                d = REF[b][t] - LOGPROBS[b][t]
                loss += kl_coef * (math.exp(d) - d - 1) * w[b][t]
                g += kl_coef * (1 - math.exp(d)) * w[b][t]
            row.append(g)
        grad.append(row)
    return loss, grad, branches


def ref_cispo(aggregation: str, kl_coef: float) -> tuple[float, list[list[float]], float]:
    """CISPO by hand (MiniMax-M1): -sg(clip(r)) * A * logprob per token, so every token's gradient is
    -clip(r) * A, clipped or not; the loss value is -clip(r) * A. Also the share of clipped tokens."""
    w = ref_weights(aggregation)
    loss, grad, clipped, tokens = 0.0, [], 0, 0
    for b, row_mask in enumerate(MASK):
        a, row = ADV[b], []
        for t in range(len(row_mask)):
            if not row_mask[t]:
                row.append(0.0)
                continue
            r = math.exp(LOGPROBS[b][t] - OLD[b][t])
            weight = min(max(r, 1 - CISPO.clip_low), 1 + CISPO.clip_high)
            clipped, tokens = clipped + (weight != r), tokens + 1
            term, g = -weight * a, -weight * a
            if kl_coef:
                d = REF[b][t] - LOGPROBS[b][t]
                term += kl_coef * (math.exp(d) - d - 1)
                g += kl_coef * (1 - math.exp(d))
            loss += term * w[b][t]
            row.append(g * w[b][t])
        grad.append(row)
    return loss, grad, clipped / tokens


def _run(
    cfg: LossConfig, advantages: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    lp = _t(LOGPROBS).requires_grad_(True)
    adv = _t(ADV) if advantages is None else advantages
    loss, metrics = grpo_loss(
        lp, _t(OLD), adv, _t(MASK), cfg, ref_logprobs=_t(REF), rollout_index=_t(ROLLOUT, torch.long)
    )
    loss.backward()
    assert lp.grad is not None
    return loss, lp.grad, metrics


def test_the_fixed_batch_puts_gspo_sequences_in_every_branch() -> None:
    # sequence ratios 1.08 (A > 0), 0.94 (A < 0), 0.86 (A > 0), 1.42 (A < 0: over the cap of 1.3)
    assert ref_gspo("token_mean", 0.0)[2] == {"in_range", "clipped", "unclipped", "tis"}


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "rollout_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_gspo_loss_and_gradient_match_the_hand_reference(aggregation: Aggregation, kl_coef: float) -> None:
    cfg = LossConfig(
        clip_low=0.05,
        clip_high=0.1,
        tis_cap=1.3,
        kl_coef=kl_coef,
        aggregation=aggregation,
        objective="gspo",
    )
    loss, grad, metrics = _run(cfg)
    want_loss, want_grad, _ = ref_gspo(aggregation, kl_coef, cfg)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    torch.testing.assert_close(grad, _t(want_grad), atol=1e-6, rtol=0)
    n = sum(map(sum, MASK))
    want_ratio = sum(_sequence_ratio(b) * sum(MASK[b]) for b in range(4)) / n
    assert metrics["ratio_mean"] == pytest.approx(want_ratio, abs=1e-9)  # each token carries its sequence's
    assert metrics["clip_fraction"] == pytest.approx(sum(MASK[1]) / n)  # sequence 1's tokens


def test_gspo_without_the_cap_and_with_per_token_advantages() -> None:
    uncapped = LossConfig(clip_low=0.05, clip_high=0.1, tis_cap=None, objective="gspo")
    assert "tis" not in ref_gspo("token_mean", 0.0, uncapped)[2]  # sequence 3 goes unclipped
    loss, grad, _ = _run(uncapped)
    want_loss, want_grad, _ = ref_gspo("token_mean", 0.0, uncapped)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    torch.testing.assert_close(grad, _t(want_grad), atol=1e-6, rtol=0)
    # per-call credit hands (B, T) advantages: the same numbers on every token give the same loss
    per_token = _t([[a] * 5 for a in ADV])
    same, same_grad, _ = _run(uncapped, per_token)
    assert same.item() == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(same_grad, grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "rollout_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_cispo_loss_and_gradient_match_the_hand_reference(aggregation: Aggregation, kl_coef: float) -> None:
    cfg = LossConfig(
        clip_low=0.2, clip_high=0.28, kl_coef=kl_coef, aggregation=aggregation, objective="cispo"
    )
    loss, grad, metrics = _run(cfg)
    want_loss, want_grad, clipped = ref_cispo(aggregation, kl_coef)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    torch.testing.assert_close(grad, _t(want_grad), atol=1e-6, rtol=0)
    assert metrics["clip_fraction"] == pytest.approx(clipped) and clipped > 0


def test_cispo_keeps_the_gradient_of_tokens_grpo_clips_away() -> None:
    _, grpo_grad, _ = _run(LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=3.0))
    _, cispo_grad, _ = _run(CISPO)
    # sequence 0, token 1: ratio e^.4 = 1.49 > 1.28 with A > 0; sequence 3, token 1: ratio e^1.4 with A < 0
    assert grpo_grad[0, 1] == 0 and cispo_grad[0, 1] < 0  # weight 1.28, pushed up
    assert grpo_grad[3, 1] == 0 and cispo_grad[3, 1] > 0  # GRPO's dual clip zeroes it; CISPO weighs it 1.28


def test_bad_objective_settings_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="objective"):
        LossConfig(objective="ppo")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cispo's weight never exceeds"):
        LossConfig(clip_high=4.0, objective="cispo")  # a wide CISPO bound needs tis_cap=None or higher
    assert LossConfig(clip_high=4.0, tis_cap=None, objective="cispo").clip_high == 4.0
    with pytest.raises(ConfigError, match="clip_low"):
        LossConfig(clip_low=1.0)  # a ratio clipped at 0 from below would never stop a PPO-style update


def test_cispo_without_a_lower_bound_weighs_small_ratios_as_they_are() -> None:
    cfg = LossConfig(clip_low=1.0, clip_high=0.28, objective="cispo")  # MiniMax-M1: only the upper bound
    lp = _t(LOGPROBS).requires_grad_(True)
    loss, _ = grpo_loss(lp, _t(OLD), _t(ADV), _t(MASK), cfg)
    loss.backward()
    assert lp.grad is not None
    n = sum(map(sum, MASK))
    for b, t in [(2, 1), (0, 3)]:  # ratios e^-.3 = 0.74 and e^-.1 = 0.90: below 0.8 and above it
        r = math.exp(LOGPROBS[b][t] - OLD[b][t])
        assert lp.grad[b, t].item() == pytest.approx(-r * ADV[b] / n, abs=1e-9)


def test_std_scaling_by_group_batch_or_none_by_hand() -> None:
    rewards, groups = [1.0, 0.0, 0.5, 0.5, 2.0], ["a", "a", "b", "b", "c"]
    # group "a": mean 0.5, std 0.5; the batch: mean 0.8, variance (.04 + .64 + .09 + .09 + 1.44) / 5 = .46
    batch_std = math.sqrt(0.46)
    by_group = group_advantages(rewards, groups, scale_by_std="group")
    assert by_group == group_advantages(rewards, groups, scale_by_std=True)
    assert by_group[:2] == pytest.approx([1.0, -1.0], abs=1e-5)
    by_batch = group_advantages(rewards, groups, scale_by_std="batch")
    assert by_batch == pytest.approx([0.5 / batch_std, -0.5 / batch_std, 0.0, 0.0, 0.0], abs=1e-5)
    plain = group_advantages(rewards, groups, scale_by_std="none")
    assert plain == group_advantages(rewards, groups, scale_by_std=False) == [0.5, -0.5, 0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="scale_by_std"):
        group_advantages(rewards, groups, scale_by_std="rank")  # type: ignore[arg-type]


def test_leave_one_out_over_the_batch_by_hand() -> None:
    rewards = [1.0, 0.0, 3.0]
    one = [""] * 3
    # each reward minus the mean of the other two
    assert group_advantages(rewards, one, scale_by_std="none", leave_one_out=True) == [-0.5, -2.0, 2.5]
    std = math.sqrt(((1 - 4 / 3) ** 2 + (4 / 3) ** 2 + (3 - 4 / 3) ** 2) / 3)
    scaled = group_advantages(rewards, one, scale_by_std="batch", leave_one_out=True)
    assert scaled == pytest.approx([-0.5 / std, -2.0 / std, 2.5 / std], abs=1e-5)
    assert group_advantages([2.0], [""], scale_by_std="none", leave_one_out=True) == [
        0.0
    ]  # nobody to compare


def _one_call(rid: str, reward: float) -> list[Span]:
    m = SpanMaker(rollout_id=rid)
    return [m.call([1, 2], [3, 4]), m.reward(reward)]


def test_a_batch_baseline_trains_groups_of_one() -> None:
    rewards = {"r1": 1.0, "r2": 0.0, "r3": 3.0}
    spans = {rid: _one_call(rid, reward) for rid, reward in rewards.items()}
    rollouts = [  # each rollout its own task group: group_size=1
        Rollout(
            rollout_id=rid, group_id=f"task-{rid}", status=RolloutStatus.SUCCEEDED, created_at=0, updated_at=0
        )
        for rid in rewards
    ]
    cfg = GRPOConfig(model_path="unused", group_size=1, baseline="batch", scale_by_std="none")
    batch = build_batch(rollouts, spans, cfg)
    assert [s.rollout_id for s in batch.samples] == ["r1", "r2", "r3"]
    assert batch.advantages == [-0.5, -2.0, 2.5]
    assert batch.metrics["groups"] == 1.0 and batch.metrics["zero_variance_groups"] == 0.0
    # the group baseline finds three groups of one, none with signal
    grouped = build_batch(rollouts, spans, GRPOConfig(model_path="unused", group_size=2))
    assert grouped.samples == [] and grouped.metrics["zero_variance_groups"] == 3.0
    # a batch that scored alike has no signal either
    flat = build_batch(rollouts, {rid: _one_call(rid, 1.0) for rid in rewards}, cfg)
    assert flat.samples == [] and flat.metrics["zero_variance_groups"] == 1.0


def test_baseline_and_scale_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="scale_by_std='batch'"):
        GRPOConfig(model_path="m", group_size=1, baseline="batch")  # True means a group's std: none here
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        GRPOConfig(model_path="m", group_size=1)
    with pytest.raises(ConfigError, match="baseline"):
        GRPOConfig(model_path="m", baseline="global")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="scale_by_std"):
        GRPOConfig(model_path="m", scale_by_std="std")  # type: ignore[arg-type]
    assert GRPOConfig(model_path="m", group_size=1, baseline="batch", scale_by_std=False).group_size == 1


def test_a_run_config_file_spells_the_options_as_strings() -> None:
    value = {"model_path": "m", "scale_by_std": "batch", "loss": {"objective": "gspo", "clip_high": 0.0004}}
    built = build(GRPOConfig, value, "grpo")
    assert built.scale_by_std == "batch" and built.loss.objective == "gspo"
    assert build(GRPOConfig, {"model_path": "m", "scale_by_std": False}, "grpo").scale_by_std is False
    with pytest.raises(ConfigProblem, match="objective"):
        build(GRPOConfig, {"model_path": "m", "loss": {"objective": "ppo"}}, "grpo")
