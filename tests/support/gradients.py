"""The gradient a policy accumulates for a batch, for tests that compare two ways of computing it."""

from __future__ import annotations

import torch

from agl.adapter import Sample
from agl.algorithm.policy.model import Policy


def batch_gradient(
    policy: Policy, samples: list[Sample], advantages: list[float], index: list[int]
) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of one ``accumulate`` over the batch (``.grad`` is left empty after)."""
    policy.optimizer.zero_grad(set_to_none=True)
    policy.accumulate(samples, advantages, index)
    grads = {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.optimizer.zero_grad(set_to_none=True)
    return grads
