"""GRPO: group-relative policy optimization over agent rollouts."""

from agl.algorithm.grpo.advantages import group_advantages, zero_variance_groups
from agl.algorithm.grpo.algorithm import GRPO
from agl.algorithm.grpo.batch import StepBatch, build_batch
from agl.algorithm.grpo.config import GRPOConfig
from agl.algorithm.grpo.warm_start import WarmStart
from agl.algorithm.policy.loss import LossConfig, grpo_loss, token_weights

__all__ = [
    "GRPO",
    "GRPOConfig",
    "LossConfig",
    "StepBatch",
    "WarmStart",
    "build_batch",
    "group_advantages",
    "grpo_loss",
    "token_weights",
    "zero_variance_groups",
]
