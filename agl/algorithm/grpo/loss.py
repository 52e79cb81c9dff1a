"""GRPO's loss: it lives with the policy that steps on it (:mod:`agl.algorithm.policy.loss`)."""

from agl.algorithm.policy.loss import LossConfig, grpo_loss, token_weights

__all__ = ["LossConfig", "grpo_loss", "token_weights"]
