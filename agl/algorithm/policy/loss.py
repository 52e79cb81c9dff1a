"""The GRPO loss: clipped policy gradient against the engine's logprobs, with truncated IS and optional KL.

Three objectives share it: ``grpo`` (PPO's clip on each token's ratio), ``gspo`` (the clip on one ratio
per sequence, the geometric mean of its tokens' ratios) and ``cispo`` (every token's log-prob gradient,
weighted by its clipped ratio held constant). With a teacher's log-probs, on-policy distillation adds
``-distill_coef * (old logprob - teacher logprob)`` (a per-token reverse-KL estimate) to each token's
advantage. Pure tensor math: (logprobs, old logprobs, advantages, mask, config) in, (loss, metrics) out.
Shapes: B samples, T tokens. ``mask`` is 1 on model tokens that carry loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from agl.errors import ConfigError

Aggregation = Literal["token_mean", "sequence_mean", "rollout_mean"]
Objective = Literal["grpo", "gspo", "cispo"]
OBJECTIVES = ("grpo", "gspo", "cispo")


@dataclass(frozen=True)
class LossConfig:
    """The objective, clip range of the importance ratio, the truncated-IS cap, the KL weight and the
    aggregation."""

    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO's "clip higher"
    tis_cap: float | None = 3.0  # truncated IS (dual clip) for engine/trainer mismatch; None: off
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    # "gspo": clip one ratio per sequence (GSPO clips far tighter, e.g. clip_low=3e-4, clip_high=4e-4);
    # "cispo": clip the ratio as a constant weight on every token's log-prob gradient (MiniMax-M1; there
    # clip_low may be >= 1: no lower bound on the weight, as the paper runs it)
    objective: Objective = "grpo"
    # on-policy distillation (GRPOConfig.teacher): each token's advantage gets -distill_coef times its
    # reverse-KL estimate to the teacher, log pi_sampler(t) - log pi_teacher(t); 0: off. GRPOConfig sets it
    # from its teacher and distill_coef
    distill_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.objective!r}; use one of {list(OBJECTIVES)}")
        low_ok = self.clip_low > 0 and (self.clip_low < 1 or self.objective == "cispo")
        if not (low_ok and self.clip_high > 0):
            raise ConfigError(
                f"clip_low must be in (0, 1) (cispo: > 0) and clip_high > 0, got {self.clip_low}, "
                f"{self.clip_high}; 0.2 for both is the usual choice"
            )
        if self.tis_cap is not None and self.tis_cap <= 1 + self.clip_high:
            cispo = " (cispo's weight never exceeds 1 + clip_high, so the cap does nothing there)"
            raise ConfigError(
                f"tis_cap must exceed 1 + clip_high = {1 + self.clip_high} (or be None), got {self.tis_cap}"
                + (cispo if self.objective == "cispo" else "")
            )
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.distill_coef < 0:
            raise ConfigError(f"LossConfig.distill_coef must be >= 0, got {self.distill_coef}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"unknown aggregation {self.aggregation!r}; use one of {sorted(AGGREGATIONS)}")


def _token_mean(mask: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    return mask / mask.sum().clamp(min=1)  # (B, T)


def _sequence_mean(mask: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    return mask / (mask.sum(-1, keepdim=True).clamp(min=1) * mask.shape[0])  # (B, T)


def _rollout_mean(mask: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
    """Token mean within each rollout, then mean over rollouts: a rollout split into many samples
    weighs as much as one kept whole. ``groups[b]`` is the rollout index of sample b."""
    if groups is None:
        return _token_mean(mask, groups)
    n = int(groups.max().item()) + 1
    per_rollout = torch.zeros(n, dtype=mask.dtype).index_add(0, groups, mask.sum(-1))  # (R,)
    rollouts = (per_rollout > 0).sum().clamp(min=1)
    return mask / (per_rollout[groups].clamp(min=1).unsqueeze(-1) * rollouts)  # (B, T)


#: aggregation name -> per-token weights (B, T) that sum to the loss when multiplied with per-token terms.
#: Weights are computed over the whole batch, so micro-batches that sum their parts give the same loss.
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "token_mean": _token_mean,
    "sequence_mean": _sequence_mean,
    "rollout_mean": _rollout_mean,
}


def token_weights(
    mask: torch.Tensor, aggregation: str, rollout_index: torch.Tensor | None = None
) -> torch.Tensor:
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown aggregation {aggregation!r}; use one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[aggregation](mask, rollout_index)


def _ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, objective: str
) -> torch.Tensor:
    """pi_theta / pi_old per token (B, T); for ``gspo`` each sequence's ratio on all its tokens:
    exp of the mean log-ratio over its model tokens, so long and short sequences clip on one scale."""
    log_ratio = (logprobs - old_logprobs) * mask  # (B, T)
    if objective == "gspo":
        per_sequence = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        return torch.exp(per_sequence).expand_as(log_ratio)
    return torch.exp(log_ratio)


def distill_advantages(
    old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's per-token advantage (B, T) and the mean reverse KL to the teacher (a scalar).

    Per sampled token t, ``k = log pi_sampler(t) - log pi_teacher(t)`` estimates the reverse KL
    KL(student || teacher) (Thinking Machines' on-policy distillation); ``-coef * k`` rewards the tokens the
    teacher finds likelier than the student did. Constant in the gradient, like a reward.
    """
    reverse_kl = (old_logprobs - teacher_logprobs).detach() * mask  # (B, T)
    return -coef * reverse_kl, reverse_kl.sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    rollout_index: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimize and its metrics, for ``config.objective``.

    Args:
        logprobs: (B, T) trainer log-probs of the taken tokens (with grad).
        old_logprobs: (B, T) the engine's log-probs of the same tokens (behaviour policy).
        advantages: (B,) one advantage per sample, or (B, T) per token (per-call credit).
        mask: (B, T) 1.0 on model tokens.
        ref_logprobs: (B, T) reference-model log-probs, for the KL penalty.
        teacher_logprobs: (B, T) the teacher's log-probs of the same tokens, for on-policy distillation
            (``config.distill_coef``): the metrics then carry ``distill_kl``.
        rollout_index: (B,) rollout of each sample, for ``rollout_mean``.
        weights: (B, T) precomputed aggregation weights (for micro-batches of a larger batch).
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)  # (B, T) or (B, 1)
    distill_kl = None
    if teacher_logprobs is not None and config.distill_coef > 0:
        distill_adv, distill_kl = distill_advantages(
            old_logprobs, teacher_logprobs, mask, config.distill_coef
        )
        adv = adv + distill_adv  # (B, T): the reward's advantage plus the teacher's per-token one
    ratio = _ratio(logprobs, old_logprobs, mask, config.objective)  # (B, T)
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)  # (B, T)
    if config.objective == "cispo":
        # the clipped ratio is a constant weight: every token keeps its gradient, A * weight * grad(logprob).
        # exp(lp - sg(lp)) is 1 with lp's gradient, so the loss reads -weight * A like the clipped surrogate
        per_token = -clipped.detach() * adv * torch.exp(logprobs - logprobs.detach())  # (B, T)
    else:
        per_token = -torch.minimum(ratio * adv, clipped * adv)  # (B, T)
    if config.tis_cap is not None and config.objective != "cispo":
        # truncated IS (dual clip): where the engine made a token far less likely than the trainer does
        # and the advantage is negative, the unclipped term grows with the ratio; cap it at tis_cap * |A|
        per_token = torch.where(
            adv < 0, torch.minimum(per_token, config.tis_cap * (-adv)), per_token
        )  # (B, T)
    kl = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None and config.kl_coef > 0:
        delta = (ref_logprobs - logprobs) * mask  # (B, T)
        kl_token = torch.exp(delta) - delta - 1  # (B, T), the k3 estimator, >= 0
        per_token = per_token + config.kl_coef * kl_token
        kl = (kl_token * mask).sum() / mask.sum().clamp(min=1)
    if weights is None:
        weights = token_weights(mask, config.aggregation, rollout_index)  # (B, T)
    loss = (per_token * weights).sum()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        low, high = ratio < 1 - config.clip_low, ratio > 1 + config.clip_high
        # grpo/gspo: where the clip took the token's gradient away; cispo: where its weight was clipped
        is_clipped = low | high if config.objective == "cispo" else (low & (adv < 0)) | (high & (adv > 0))
        metrics = {
            "loss": float(loss.item()),
            "clip_fraction": float((is_clipped.to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "kl": float(kl.item()),
        }
        if distill_kl is not None:
            metrics["distill_kl"] = float(distill_kl.item())
    return loss, metrics
