"""Each objective-menu option through ``Trainer.fit``: one GRPO step on the tiny model, real engine,
gateway and store; the step trains and the option reaches the batch or the policy's loss."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.algorithm.policy.loss import LossConfig
from agl.models import tiny_model

pytestmark = pytest.mark.slow
_count = itertools.count()


@agl.rollout
async def counting_agent(task: str, llm: agl.LLM) -> float:
    """One short completion; every rollout scores differently, so every group (or batch) has signal."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
        )
    finally:
        await client.close()
    return float(next(_count) % 7) / 7


OPTIONS: dict[str, dict[str, Any]] = {
    "gspo": {"loss": LossConfig(objective="gspo", clip_low=3e-4, clip_high=4e-4)},
    "cispo": {"loss": LossConfig(objective="cispo", clip_low=1.0, clip_high=0.28)},
    "batch_std": {"scale_by_std": "batch"},
    "batch_baseline": {"baseline": "batch", "scale_by_std": "none", "group_size": 1, "tasks_per_step": 3},
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_one_step_trains_with_the_option(option: str, tmp_path: Path) -> None:
    settings: dict[str, Any] = {"group_size": 2, "tasks_per_step": 2, **OPTIONS[option]}
    config = GRPOConfig(
        model_path=str(tiny_model()), steps=1, lr=1e-3, eval_every=0, export_model=False, **settings
    )
    algorithm = GRPO(config)
    result = agl.Trainer(algorithm=algorithm, n_runners=4, output_dir=str(tmp_path)).fit(
        counting_agent, ["a", "b", "c"], []
    )
    (row,) = result["history"]
    rollouts = settings["group_size"] * settings["tasks_per_step"]
    assert row["failed_rollouts"] == 0 and row["samples"] == rollouts, row
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
    assert algorithm.policy is not None and algorithm.policy.loss_config == config.loss
    if option == "batch_baseline":  # groups of one, compared across the batch: one key, with signal
        assert row["groups"] == 1 and row["zero_variance_groups"] == 0
    else:
        assert row["groups"] == settings["tasks_per_step"]
