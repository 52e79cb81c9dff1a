"""The SFT warm start before GRPO: trains on the conversations with its own lr, then restores GRPO's."""

from __future__ import annotations

import pytest
import torch

from agl.algorithm.grpo import GRPOConfig, WarmStart
from agl.algorithm.grpo.warm_start import train_warm_start
from agl.errors import ConfigError
from agl.models import tiny_model

CONVERSATION = [
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "Answer: 5"},
]


def test_warm_start_trains_and_restores_the_grpo_learning_rate() -> None:
    from agl.algorithm.policy.model import Policy, PolicyConfig

    path = str(tiny_model())
    config = GRPOConfig(model_path=path, lr=1e-6, warm_start=WarmStart([CONVERSATION], steps=6, lr=3e-2))
    assert isinstance(config.warm_start, WarmStart)
    policy = Policy(PolicyConfig(model_path=path, lr=config.lr), config.loss)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    rows = train_warm_start(policy, config.warm_start)
    assert [r["warm_start_step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["sft_loss"] < rows[0]["sft_loss"] * 0.7  # it learns the one reply
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
    assert [g["lr"] for g in policy.optimizer.param_groups] == [1e-6] * len(policy.optimizer.param_groups)


def test_warm_start_rejects_empty_or_bad_schedules() -> None:
    with pytest.raises(ConfigError, match="at least one conversation"):
        WarmStart([])
    with pytest.raises(ConfigError, match="steps and batch_size"):
        WarmStart([CONVERSATION], steps=0)
    with pytest.raises(ConfigError, match="lr"):
        WarmStart([CONVERSATION], lr=-1.0)
