"""``grpo_loss`` and ``token_weights`` against a reference written out token by token, gradients included."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from agl.algorithm.grpo import LossConfig, group_advantages, grpo_loss, token_weights, zero_variance_groups
from agl.errors import ConfigError

# 4 samples x 5 tokens. Rows: (logprob, old logprob) chosen so that every branch of the loss is hit:
# in the clip range, clipped above (A > 0), clipped below (A < 0), and dual-clipped by TIS (A < 0, ratio > 3).
LOGPROBS = [
    [-1.0, -0.5, -2.0, -0.3, -1.1],
    [-0.2, -1.0, -0.4, -0.9, -2.2],
    [-0.7, -1.3, -0.6, -1.5, -0.8],
    [-0.4, -0.6, -1.2, -0.5, -0.9],
]
OLD = [
    [-1.1, -0.9, -2.0, -0.2, -1.1],  # ratios e^.1, e^.4 (clipped, A>0), 1, e^-.1
    [-1.8, -1.05, -0.2, -0.9, -2.2],  # e^1.6 = 4.95 > 3 with A<0: TIS cap; e^-.2 = .82 (clip low, A<0)
    [-0.8, -1.0, -0.6, -1.4, -0.8],
    [-0.35, -2.0, -1.25, -0.5, -0.9],  # e^1.4 = 4.06 > 3 with A<0: TIS cap
]
MASK = [
    [0, 1, 1, 1, 1],
    [0, 0, 1, 1, 1],
    [0, 1, 1, 0, 0],
    [1, 1, 1, 1, 0],
]
REF = [
    [-0.9, -0.6, -1.8, -0.4, -1.0],
    [-0.3, -1.1, -0.5, -0.7, -2.0],
    [-0.6, -1.2, -0.9, -1.5, -0.8],
    [-0.5, -0.5, -1.0, -0.6, -0.9],
]
ADV = [1.0, -0.5, 2.0, -1.5]
ROLLOUT = [0, 0, 1, 2]
CFG = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=3.0)


def ref_weights(aggregation: str) -> list[list[float]]:
    """Aggregation weights by hand: each rule as a formula over the mask."""
    total = sum(map(sum, MASK))
    rows = len(MASK)
    per_rollout: dict[int, int] = {}
    for b, row in enumerate(MASK):
        per_rollout[ROLLOUT[b]] = per_rollout.get(ROLLOUT[b], 0) + sum(row)
    live = sum(1 for n in per_rollout.values() if n > 0)
    out = []
    for b, row in enumerate(MASK):
        if aggregation == "token_mean":
            out.append([m / total for m in row])
        elif aggregation == "sequence_mean":
            out.append([m / (sum(row) * rows) for m in row])
        else:  # rollout_mean
            out.append([m / (per_rollout[ROLLOUT[b]] * live) for m in row])
    return out


def ref_loss_and_grad(
    aggregation: str, kl_coef: float, cfg: LossConfig = CFG
) -> tuple[float, list[list[float]]]:
    """PPO-clip with dual-clip TIS and k3 KL, token by token; the gradient w.r.t. each logprob by hand."""
    w = ref_weights(aggregation)
    loss, grad = 0.0, []
    for b in range(len(MASK)):
        a, row = ADV[b], []
        for t in range(len(MASK[b])):
            if not MASK[b][t]:
                row.append(0.0)
                continue
            r = math.exp(LOGPROBS[b][t] - OLD[b][t])
            c = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            if r * a <= c * a:  # the unclipped surrogate is the smaller: d(-rA)/dlp = -rA
                term, g = -r * a, -r * a
            else:  # the clipped one is constant in lp
                term, g = -c * a, 0.0
            if cfg.tis_cap is not None and a < 0 and term > cfg.tis_cap * -a:
                term, g = cfg.tis_cap * -a, 0.0
            if kl_coef:
                d = REF[b][t] - LOGPROBS[b][t]
                term += kl_coef * (math.exp(d) - d - 1)
                g += kl_coef * (1 - math.exp(d))
            loss += term * w[b][t]
            row.append(g * w[b][t])
        grad.append(row)
    return loss, grad


def _t(rows: Sequence[Sequence[float]] | Sequence[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def _branches() -> set[str]:
    seen = set()
    for b in range(4):
        for t in range(5):
            if MASK[b][t]:
                r, a = math.exp(LOGPROBS[b][t] - OLD[b][t]), ADV[b]
                if a < 0 and r > CFG.tis_cap:  # type: ignore[operator]
                    seen.add("tis")
                elif r > 1 + CFG.clip_high and a > 0 or r < 1 - CFG.clip_low and a < 0:
                    seen.add("clipped")
                else:
                    seen.add("in_range")
    return seen


def test_the_fixed_batch_exercises_every_branch() -> None:
    assert _branches() == {"tis", "clipped", "in_range"}


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "rollout_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_loss_and_gradient_match_the_hand_reference(aggregation: str, kl_coef: float) -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=3.0, kl_coef=kl_coef, aggregation=aggregation)  # type: ignore[arg-type]
    lp = _t(LOGPROBS).requires_grad_(True)
    loss, metrics = grpo_loss(
        lp, _t(OLD), _t(ADV), _t(MASK), cfg, ref_logprobs=_t(REF), rollout_index=_t(ROLLOUT, torch.long)
    )
    loss.backward()
    want_loss, want_grad = ref_loss_and_grad(aggregation, kl_coef)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, _t(want_grad), atol=1e-5, rtol=0)
    assert metrics["loss"] == pytest.approx(want_loss, abs=1e-5)
    if kl_coef:
        assert metrics["kl"] > 0
    else:
        assert metrics["kl"] == 0.0


def test_without_tis_the_negative_advantage_term_is_unbounded() -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=None)
    lp = _t(LOGPROBS).requires_grad_(True)
    loss, _ = grpo_loss(lp, _t(OLD), _t(ADV), _t(MASK), cfg)
    loss.backward()
    want_loss, want_grad = ref_loss_and_grad("token_mean", 0.0, cfg)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5)
    torch.testing.assert_close(lp.grad, _t(want_grad), atol=1e-5, rtol=0)
    capped, _ = grpo_loss(_t(LOGPROBS), _t(OLD), _t(ADV), _t(MASK), CFG)
    assert loss.item() > capped.item()  # the TIS cap removed loss mass, never added it


def test_float32_inputs_agree_with_the_float64_reference() -> None:
    lp = _t(LOGPROBS, torch.float32).requires_grad_(True)
    f = torch.float32
    loss, _ = grpo_loss(lp, _t(OLD, f), _t(ADV, f), _t(MASK, f), CFG)
    loss.backward()
    want_loss, want_grad = ref_loss_and_grad("token_mean", 0.0)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5)
    torch.testing.assert_close(lp.grad, _t(want_grad, f), atol=1e-5, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "rollout_mean"])
def test_token_weights_follow_their_formulas_and_sum_to_one(aggregation: str) -> None:
    w = token_weights(_t(MASK), aggregation, _t(ROLLOUT, torch.long))
    torch.testing.assert_close(w, _t(ref_weights(aggregation)), atol=1e-12, rtol=0)
    assert w.sum().item() == pytest.approx(1.0)
    assert (w[_t(MASK) == 0] == 0).all()


def test_rollout_mean_weighs_a_split_rollout_like_a_whole_one() -> None:
    mask = _t([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    w = token_weights(mask, "rollout_mean", _t([0, 0, 1], torch.long))
    assert w[:2].sum().item() == pytest.approx(0.5) and w[2].sum().item() == pytest.approx(0.5)


def test_precomputed_weights_let_micro_batches_sum_to_the_full_loss() -> None:
    lp, old, adv, mask = _t(LOGPROBS), _t(OLD), _t(ADV), _t(MASK)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="sequence_mean")
    w = token_weights(mask, "sequence_mean")
    full, _ = grpo_loss(lp, old, adv, mask, cfg)
    parts = [
        grpo_loss(lp[s], old[s], adv[s], mask[s], cfg, weights=w[s])[0] for s in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-12)
    # each part on its own (weights from the part only) would not add up: the batch-wide weights matter
    alone = sum(grpo_loss(lp[s], old[s], adv[s], mask[s], cfg)[0].item() for s in (slice(0, 1), slice(1, 4)))
    assert alone != pytest.approx(full.item(), abs=1e-3)


def test_bad_loss_settings_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="token_mean"):
        token_weights(_t(MASK), "per_token")
    with pytest.raises(ConfigError, match="aggregation"):
        LossConfig(aggregation="per_token")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tis_cap"):
        LossConfig(tis_cap=1.1)


def test_group_advantages_by_hand() -> None:
    rewards, groups = [1.0, 0.0, 0.5, 0.5, 2.0], ["a", "a", "b", "b", "c"]
    adv = group_advantages(rewards, groups)
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5)
    assert adv[2:] == [0.0, 0.0, 0.0]
    assert group_advantages(rewards, groups, scale_by_std=False)[:2] == [0.5, -0.5]
    assert zero_variance_groups(rewards, groups) == {"b", "c"}
