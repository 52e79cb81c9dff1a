"""GRPO as an agl Algorithm: groups of rollouts through the store, samples from spans, a policy step, weight sync.

Each step: enqueue ``group_size`` rollouts per task (one ``group_id`` per task), wait for them, turn
their spans into samples (trajectory-level by default), drop what must not be trained on (failed
rollouts, zero-variance groups, over-long samples; each counted), compute group-relative advantages
per rollout, take one optimizer step, push the new weights to the engine and publish them as a new
resources version, so the next rollouts record the version they ran with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl.adapter import MergeReport, Sample, call_rewards, final_reward, llm_calls, to_samples
from agl.adapter.calls import filter_calls
from agl.algorithm.base import Algorithm, TrainingContext, succeeded
from agl.algorithm.grpo.advantages import group_advantages, zero_variance_groups
from agl.algorithm.grpo.loss import LossConfig
from agl.errors import ConfigError
from agl.schemas import ModelWeights, Rollout, RolloutStatus, Span

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's knobs; every field has a default, cross-field checks run on construction."""

    model_path: str
    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    lora_rank: int = 0
    scale_by_std: bool = True  # False: Dr. GRPO (no std division)
    level: Literal["trajectory", "transition"] = "trajectory"
    max_sample_tokens: int = 2048
    agent: str | None = None  # train only calls tagged with this agent name
    loss: LossConfig = field(default_factory=LossConfig)
    kl_coef: float = 0.0
    eval_every: int = 5
    rollout_timeout_s: float = 600.0
    checkpoint_every: int = 0
    resume: bool = False  # continue from the newest checkpoint under the output dir (full fine-tuning)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.steps < 0 or self.tasks_per_step < 1:
            raise ConfigError(
                f"steps >= 0 and tasks_per_step >= 1 needed, got {self.steps}, {self.tasks_per_step}"
            )
        if self.kl_coef > 0 and self.loss.kl_coef == 0:
            object.__setattr__(self, "loss", LossConfig(**{**self.loss.__dict__, "kl_coef": self.kl_coef}))


@dataclass
class StepBatch:
    samples: list[Sample]
    advantages: list[float]
    rollout_index: list[int]
    metrics: dict[str, float]


def build_batch(rollouts: Sequence[Rollout], spans: dict[str, list[Span]], config: GRPOConfig) -> StepBatch:
    """Pure: rollouts and their spans to samples with advantages, and the filter counts."""
    ok = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
    rewards = {r.rollout_id: final_reward(spans[r.rollout_id]) or 0.0 for r in ok}
    groups = {r.rollout_id: r.group_id or r.rollout_id for r in ok}
    ids = list(rewards)
    flat = zero_variance_groups([rewards[i] for i in ids], [groups[i] for i in ids])
    advantages = dict(
        zip(
            ids,
            group_advantages(
                [rewards[i] for i in ids], [groups[i] for i in ids], scale_by_std=config.scale_by_std
            ),
            strict=True,
        )
    )
    report = MergeReport()
    samples: list[Sample] = []
    advs: list[float] = []
    index: list[int] = []
    too_long = 0
    for n, rid in enumerate(ids):
        if groups[rid] in flat:
            continue
        calls = filter_calls(llm_calls(spans[rid]), config.agent, spans[rid])
        made, rep = to_samples(
            calls,
            rewards[rid],
            level=config.level,
            call_rewards=call_rewards(spans[rid]),
            group_id=groups[rid],
        )
        report.add(rep)
        for s in made:
            if len(s.input_ids) > config.max_sample_tokens:
                too_long += 1
                continue
            samples.append(s)
            advs.append(advantages[rid])
            index.append(n)
    reward_values = list(rewards.values())
    mean = sum(reward_values) / len(reward_values) if reward_values else 0.0
    std = (sum((r - mean) ** 2 for r in reward_values) / len(reward_values)) ** 0.5 if reward_values else 0.0
    metrics = {
        "reward_mean": mean,
        "reward_std": std,
        "rollouts": float(len(rollouts)),
        "failed_rollouts": float(len(rollouts) - len(ok)),
        "zero_variance_groups": float(len(flat)),
        "overlong_samples": float(too_long),
        "samples": float(len(samples)),
        "samples_per_rollout": report.samples_per_rollout,
        "merged_fraction": report.merged_fraction,
        "calls_without_token_ids": float(report.skipped_no_token_ids),
        **{f"mismatch_{k}": float(v) for k, v in report.mismatches.items()},
    }
    return StepBatch(samples, advs, index, metrics)


class GRPO(Algorithm):
    """``Trainer(algorithm=GRPO(GRPOConfig(model_path=...))).fit(agent, train, val)``."""

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.history: list[dict[str, float]] = []
        self.policy: Any = None  # made on first run unless set (e.g. after an SFT warm start)
        self.version = "v0"  # the engine's weights version when run starts
        self.initial_val: float | None = None  # skip the first validation when already known

    async def _resume(self, ctx: TrainingContext, checkpoint: Path) -> int:
        """Load weights and optimizer from ``checkpoint``, push them to the engine; returns the next step."""
        if self.config.lora_rank:
            raise ConfigError("resume supports full fine-tuning checkpoints; set lora_rank=0 or start afresh")
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        self.policy = await asyncio.to_thread(self._make_policy, str(checkpoint))
        await asyncio.to_thread(self.policy.load_optimizer, checkpoint)
        assert ctx.sync_weights is not None
        self.version = await ctx.sync_weights(await asyncio.to_thread(self.policy.engine_weights))
        log.info("resumed from %s (step %d)", checkpoint, state["step"])
        return int(state["step"]) + 1

    def _make_policy(self, model_path: str | None = None) -> Any:
        from agl.algorithm.grpo.policy import Policy, PolicyConfig

        cfg = self.config
        return Policy(
            PolicyConfig(
                model_path=model_path or cfg.model_path,
                lr=cfg.lr,
                max_grad_norm=cfg.max_grad_norm,
                micro_batch_tokens=cfg.micro_batch_tokens,
                activation_checkpointing=cfg.activation_checkpointing,
                lora_rank=cfg.lora_rank,
                kl_coef=cfg.loss.kl_coef,
                seed=cfg.seed,
            ),
            cfg.loss,
        )

    async def _publish(self, ctx: TrainingContext, version: str) -> str:
        if ctx.llm is None:
            raise ConfigError(
                "GRPO needs ctx.llm: Trainer.fit wires it to the gateway in front of the engine"
            )
        weights = ModelWeights(uri=self.config.model_path, version=version)
        return await ctx.publish({"llm": ctx.llm, "weights": weights}, model_version=version)

    async def _run_group(
        self, ctx: TrainingContext, tasks: Sequence[Any], resources_id: str, mode: str, group_size: int
    ) -> tuple[list[Rollout], dict[str, list[Span]]]:
        done = await ctx.rollouts(
            tasks,
            mode=mode,
            group_size=group_size,
            resources_id=resources_id,
            timeout_s=self.config.rollout_timeout_s,
        )
        return [r for r, _ in done], {r.rollout_id: spans for r, spans in done}

    async def evaluate(self, ctx: TrainingContext, val: Sequence[Any], resources_id: str) -> float:
        """Mean final reward over one validation rollout per task; failed rollouts count as 0."""
        if not val:
            return float("nan")
        done = await ctx.rollouts(
            val, mode="val", resources_id=resources_id, timeout_s=self.config.rollout_timeout_s
        )
        rewards = [(final_reward(spans) or 0.0) if succeeded(r) else 0.0 for r, spans in done]
        return sum(rewards) / len(rewards)

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> dict[str, Any]:
        from agl.metrics import MetricsLogger

        cfg = self.config
        if ctx.sync_weights is None:
            raise ConfigError("GRPO needs an engine to push weights to: run it through Trainer.fit")
        rng = random.Random(cfg.seed)
        out = Path(ctx.output_dir)
        first_step = 1
        checkpoint = latest_checkpoint(out) if cfg.resume else None
        if checkpoint is not None:
            first_step = await self._resume(ctx, checkpoint)
        elif self.policy is None:
            self.policy = await asyncio.to_thread(self._make_policy)
        metrics = MetricsLogger(out, total_steps=cfg.steps, resume=checkpoint is not None)
        version = self.version
        resources_id = await self._publish(ctx, version)
        val_before = (
            self.initial_val if self.initial_val is not None else await self.evaluate(ctx, val, resources_id)
        )
        if checkpoint is None:
            metrics.log(0, {"val_reward": val_before})
        val_after = val_before
        for _ in range(1, first_step):
            rng.sample(
                list(train), min(cfg.tasks_per_step, len(train))
            )  # the same task draws as the first run
        for step in range(first_step, cfg.steps + 1):
            started = time.perf_counter()
            tasks = rng.sample(list(train), min(cfg.tasks_per_step, len(train)))
            rollouts, spans = await self._run_group(ctx, tasks, resources_id, "train", cfg.group_size)
            batch = build_batch(rollouts, spans, cfg)
            rollout_s = time.perf_counter() - started
            row = dict(batch.metrics)
            if batch.samples:
                row.update(
                    await asyncio.to_thread(
                        self.policy.step, batch.samples, batch.advantages, batch.rollout_index
                    )
                )
                version = await ctx.sync_weights(await asyncio.to_thread(self.policy.engine_weights))
                resources_id = await self._publish(ctx, version)
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                val_after = await self.evaluate(ctx, val, resources_id)
                row["val_reward"] = val_after
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                path = out / "checkpoints" / f"step-{step}"
                await asyncio.to_thread(self.policy.save, path)
                (path / "trainer_state.json").write_text(json.dumps({"step": step, "version": version}))
            row.update(step_time_s=time.perf_counter() - started, rollout_time_s=rollout_s)
            metrics.log(step, row)
            self.history.append(row)
        metrics.close()
        return {
            "val_reward_before": val_before,
            "val_reward_after": val_after,
            "steps": cfg.steps,
            "history": self.history,
        }


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest ``checkpoints/step-N`` with a trainer state under ``out_dir``, if any."""
    found = [p for p in (out_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").exists()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


__all__ = ["GRPO", "GRPOConfig", "build_batch", "latest_checkpoint"]
