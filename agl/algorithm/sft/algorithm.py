"""Iterated SFT (rejection-sampling fine-tuning / expert iteration) as an agl Algorithm.

Each iteration: run ``samples_per_task`` rollouts per training task with the current weights, keep
the good ones (``min_reward`` and/or ``top_k_per_task``), train on their engine token ids with the
loss masked to model tokens, push the weights to the engine, and measure validation reward.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.adapter import final_reward
from agl.algorithm.base import Algorithm, TrainingContext, succeeded
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    export_jsonl,
    samples_from_messages,
    samples_from_spans,
    select_rollouts,
)
from agl.errors import ConfigError
from agl.schemas import ModelWeights


@dataclass(frozen=True)
class SFTConfig:
    model_path: str
    iterations: int = 2
    samples_per_task: int = 4
    tasks_per_iteration: int = 16
    min_reward: float | None = 1.0
    top_k_per_task: int | None = 1
    epochs: int = 1
    batch_size: int = 8
    lr: float = 1e-5
    lora_rank: int = 0
    micro_batch_tokens: int = 4096
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    export_jsonl: bool = True
    # a progress bar and a console line per step (metrics.csv and curve.png are always written)
    progress: bool = True
    rollout_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.samples_per_task < 1 or self.batch_size < 1:
            raise ConfigError("SFTConfig needs iterations, samples_per_task and batch_size >= 1")


class SFT(Algorithm):
    """``Trainer(algorithm=SFT(SFTConfig(model_path=...))).fit(agent, train, val)``."""

    def __init__(self, config: SFTConfig) -> None:
        self.config = config
        self.policy: Any = None
        self.history: list[dict[str, float]] = []

    async def evaluate(self, ctx: TrainingContext, val: Sequence[Any], resources_id: str) -> float:
        """Mean final reward of one validation rollout per task under ``resources_id``; failures score 0."""
        done = await ctx.rollouts(
            val, mode="val", resources_id=resources_id, timeout_s=self.config.rollout_timeout_s
        )
        rewards = [(final_reward(spans) or 0.0) if succeeded(r) else 0.0 for r, spans in done]
        return sum(rewards) / max(len(rewards), 1)

    async def run(
        self,
        ctx: TrainingContext,
        train: Sequence[Any],
        val: Sequence[Any],
        *,
        warm_start: Sequence[list[dict[str, Any]]] = (),
    ) -> dict[str, Any]:
        """Expert iterations; ``warm_start`` conversations (rendered with the chat template) train first."""
        from agl.algorithm.grpo.loss import LossConfig
        from agl.algorithm.grpo.policy import Policy, PolicyConfig

        cfg = self.config
        if ctx.llm is None or ctx.sync_weights is None:
            raise ConfigError("SFT trains a local model: run it through Trainer.fit, which serves the model")
        policy_config = PolicyConfig(
            model_path=cfg.model_path,
            lr=cfg.lr,
            lora_rank=cfg.lora_rank,
            micro_batch_tokens=cfg.micro_batch_tokens,
            activation_checkpointing=cfg.activation_checkpointing,
        )
        self.policy = await asyncio.to_thread(Policy, policy_config, LossConfig())
        rng = random.Random(cfg.seed)
        version = "v0"
        seed = []
        if warm_start:
            seed = samples_from_messages(self.policy.tokenizer, list(warm_start), ctx.extra.get("tools"))
            for start in range(0, len(seed), cfg.batch_size):
                await asyncio.to_thread(self.policy.sft_step, seed[start : start + cfg.batch_size])
            version = await ctx.sync_weights(await asyncio.to_thread(self.policy.engine_weights))
        resources_id = await ctx.publish(
            {"llm": ctx.llm, "weights": ModelWeights(uri=cfg.model_path, version=version)}
        )
        before = await self.evaluate(ctx, val, resources_id) if val else float("nan")
        after = before
        metrics = self._metrics_logger(ctx)
        if val:
            metrics.log(0, {"iteration": 0, "val_reward": before})
        try:
            after = await self._iterate(ctx, train, val, rng, resources_id, version, metrics, after)
        finally:
            metrics.close()
        return {
            "val_reward_before": before,
            "val_reward_after": after,
            "warm_start_samples": len(seed),
            "history": self.history,
        }

    def _metrics_logger(self, ctx: TrainingContext) -> Any:
        """Progress over iterations, a console line per gradient step, metrics.csv and a loss curve."""
        from agl.metrics import MetricsLogger

        return MetricsLogger(
            Path(ctx.output_dir),
            total_steps=self.config.iterations,
            progress=self.config.progress,
            console=self.config.progress,
            shown=("iteration", "sft_loss", "val_reward", "samples"),
            label="iteration",
            step_name="step",
            progress_key="iteration",
            plot_y=("sft_loss", "val_reward"),
            title="SFT",
            tensorboard=False,
        )

    async def _iterate(
        self,
        ctx: TrainingContext,
        train: Sequence[Any],
        val: Sequence[Any],
        rng: random.Random,
        resources_id: str,
        version: str,
        metrics: Any,
        after: float,
    ) -> float:
        cfg = self.config
        if ctx.llm is None or ctx.sync_weights is None:  # run() checked this; narrows the types here
            raise ConfigError("SFT trains a local model: run it through Trainer.fit, which serves the model")
        step = 0
        for iteration in range(1, cfg.iterations + 1):
            tasks = rng.sample(list(train), min(cfg.tasks_per_iteration, len(train)))
            done = await ctx.rollouts(
                tasks,
                group_size=cfg.samples_per_task,
                resources_id=resources_id,
                timeout_s=cfg.rollout_timeout_s,
            )
            rollouts = [r for r, _ in done]
            spans = {r.rollout_id: s for r, s in done}
            kept = select_rollouts(
                rollouts, spans, min_reward=cfg.min_reward, top_k_per_task=cfg.top_k_per_task
            )
            if cfg.export_jsonl:
                export_jsonl(
                    conversations_from_spans(kept, spans),
                    Path(ctx.output_dir) / f"sft-iteration-{iteration}.jsonl",
                )
            samples = samples_from_spans(kept, spans)
            row: dict[str, float] = {
                "iteration": iteration,
                "kept_rollouts": len(kept),
                "samples": len(samples),
            }
            batches = cfg.epochs * math.ceil(len(samples) / cfg.batch_size)
            for epoch in range(cfg.epochs):
                rng.shuffle(samples)
                for start in range(0, len(samples), cfg.batch_size):
                    stats = await asyncio.to_thread(
                        self.policy.sft_step, samples[start : start + cfg.batch_size]
                    )
                    row["sft_loss"] = stats["sft_loss"]
                    step += 1
                    finished = epoch * math.ceil(len(samples) / cfg.batch_size) + start // cfg.batch_size + 1
                    metrics.log(
                        step, {"iteration": iteration - 1 + finished / batches, "sft_loss": stats["sft_loss"]}
                    )
            if samples:
                version = await ctx.sync_weights(await asyncio.to_thread(self.policy.engine_weights))
                resources_id = await ctx.publish(
                    {"llm": ctx.llm, "weights": ModelWeights(uri=cfg.model_path, version=version)},
                    model_version=version,
                )
            if val:
                after = await self.evaluate(ctx, val, resources_id)
                row["val_reward"] = after
            self.history.append(row)
            metrics.log(step, {**{k: v for k, v in row.items() if k != "sft_loss"}, "iteration": iteration})
        return after
