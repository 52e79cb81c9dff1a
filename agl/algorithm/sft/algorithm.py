"""Iterated SFT (rejection-sampling fine-tuning / expert iteration) as an agl Algorithm.

Each iteration: run ``samples_per_task`` rollouts per training task with the current weights, keep
the good ones (``min_reward`` and/or ``top_k_per_task``), train on their engine token ids with the
loss masked to model tokens, push the weights to the engine, and measure validation reward.
With ``from_store`` it trains offline instead, on rollouts already in a store (:mod:`agl.algorithm.sft.offline`).
The final policy goes to ``OUT/model`` as a Hugging Face folder (:mod:`agl.algorithm.export`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agl.algorithm.base import Algorithm, TrainingContext, validate
from agl.algorithm.export import BEST_DIR, BestExport, export_outputs
from agl.algorithm.health import Failures, check_not_all_failed, rollout_failures
from agl.algorithm.memory import check_settings, step_peaks
from agl.algorithm.sft.offline import TimeBound, parse_time
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    export_jsonl,
    samples_from_messages,
    samples_from_spans,
    select_rollouts,
)
from agl.errors import ConfigError
from agl.schemas import ModelWeights

if TYPE_CHECKING:
    from agl.store.base import LightningStore


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
    micro_batch_tokens: int | Literal["auto"] = "auto"  # "auto": the largest that fits memory_budget_gb
    activation_checkpointing: bool | Literal["auto"] = "auto"  # "auto": on for CPU, where it is no slower
    memory_budget_gb: float | None = None  # None: a share of the RAM (or VRAM) this process could have
    export_jsonl: bool = True
    # offline: train `epochs` passes on succeeded rollouts already in this store (a URL for open_store, or a
    # LightningStore) instead of generating any; chosen by min_reward/top_k_per_task, agent and finish time
    from_store: str | LightningStore | None = None
    agent: str | None = None  # only this agent's calls (agl.agent_scope name, agent endpoint or span name)
    since: TimeBound = None  # finished at or after: Unix seconds, datetime or ISO 8601 (from_store only)
    until: TimeBound = None  # finished at or before
    # the final policy as a Hugging Face folder in OUT/model (LoRA merged), the best-validation one in
    # OUT/model-best; export_adapter also keeps a LoRA run's bare adapter in OUT/model-adapter
    export_model: bool = True
    export_adapter: bool = False
    # > 1: the policy trains on world_size ranks (spawned processes, or torchrun: see
    # agl.algorithm.grpo.distributed); SFT over ranks shards with FSDP2, so sharding="fsdp" is required
    world_size: int = 1
    sharding: Literal["none", "fsdp"] = "none"
    # a progress bar and a console line per step (metrics.csv and curve.png are always written)
    progress: bool = True
    rollout_timeout_s: float = 600.0
    # every rollout of the baseline evaluation or the first iteration failed: stop with the first error
    stop_on_all_failed: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_settings(self.micro_batch_tokens, self.memory_budget_gb)
        if self.iterations < 1 or self.samples_per_task < 1 or self.batch_size < 1:
            raise ConfigError("SFTConfig needs iterations, samples_per_task and batch_size >= 1")
        if self.epochs < 1:
            raise ConfigError(f"SFTConfig needs epochs >= 1, got {self.epochs}")
        if self.sharding not in ("none", "fsdp"):
            raise ConfigError(f"SFTConfig(sharding=...) must be 'none' or 'fsdp', got {self.sharding!r}")
        if self.world_size < 1 or (self.sharding == "fsdp") != (self.world_size > 1):
            raise ConfigError(
                f"SFTConfig(world_size={self.world_size}, sharding={self.sharding!r}): SFT over ranks shards "
                "with FSDP2, so set world_size >= 2 with sharding=\"fsdp\", or world_size=1 with sharding='none'"
            )
        since, until = parse_time(self.since, "since"), parse_time(self.until, "until")
        if since is not None and until is not None and since > until:
            raise ConfigError(f"since ({self.since!r}) is after until ({self.until!r}): no rollout can match")
        if (since is not None or until is not None) and self.from_store is None:
            raise ConfigError("since/until select rollouts already in a store: set from_store too")


class SFT(Algorithm):
    """``Trainer(algorithm=SFT(SFTConfig(model_path=...))).fit(agent, train, val)``."""

    def __init__(self, config: SFTConfig) -> None:
        self.config = config
        self.policy: Any = None
        self.history: list[dict[str, float]] = []
        self.best: BestExport | None = None

    def policy_config(self) -> Any:
        """The trainer-side policy's settings (a GRPO ``PolicyConfig``) from this config."""
        from agl.algorithm.grpo.policy import PolicyConfig

        cfg = self.config
        return PolicyConfig(
            model_path=cfg.model_path,
            lr=cfg.lr,
            lora_rank=cfg.lora_rank,
            micro_batch_tokens=cfg.micro_batch_tokens,
            activation_checkpointing=cfg.activation_checkpointing,
            seed=cfg.seed,
        )

    @contextlib.asynccontextmanager
    async def ranks(self) -> AsyncIterator[None]:
        """With ``world_size > 1``, ``self.policy`` steps on every rank (sharded) inside the block;
        afterwards rank 0 holds a plain policy with the trained weights again."""
        cfg = self.config
        if cfg.world_size < 2:
            yield
            return
        from agl.algorithm.grpo.distributed import DistributedPolicy

        self.policy = await asyncio.to_thread(
            DistributedPolicy.start, self.policy, cfg.world_size, None, cfg.sharding
        )
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            await asyncio.to_thread(self.policy.close, not failed)
            self.policy = self.policy.policy

    async def evaluate(self, ctx: TrainingContext, val: Sequence[Any], resources_id: str) -> float:
        """Mean final reward of one validation rollout per task under ``resources_id``; failures score 0."""
        return (await validate(ctx, val, resources_id, timeout_s=self.config.rollout_timeout_s))[0]

    async def run(
        self,
        ctx: TrainingContext,
        train: Sequence[Any],
        val: Sequence[Any],
        *,
        warm_start: Sequence[list[dict[str, Any]]] = (),
    ) -> dict[str, Any]:
        """Expert iterations; ``warm_start`` conversations (rendered with the chat template) train first.

        With ``from_store`` set, trains offline on the store's rollouts instead (no engine needed).
        """
        from agl.algorithm.grpo.loss import LossConfig
        from agl.algorithm.grpo.policy import Policy

        cfg = self.config
        if cfg.from_store is not None:
            from agl.algorithm.sft.offline import run_offline

            return await run_offline(self, ctx, val)
        if ctx.llm is None or ctx.sync_weights is None:
            raise ConfigError("SFT trains a local model: run it through Trainer.fit, which serves the model")
        self.policy = await asyncio.to_thread(Policy, self.policy_config(), LossConfig())
        async with self.ranks():  # world_size > 1: every step on every rank (FSDP2 shards)
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
            before, failures = await validate(ctx, val, resources_id, timeout_s=cfg.rollout_timeout_s)
            self._check(failures, "the baseline evaluation")
            after = before
            out = Path(ctx.output_dir)
            self.best = BestExport(
                out / BEST_DIR, enabled=cfg.export_model and bool(val), base_path=cfg.model_path
            )
            await asyncio.to_thread(self.best.offer, self.policy, before, iteration=0)
            metrics = self._metrics_logger(ctx)
            if val:
                metrics.log(
                    0,
                    {"iteration": 0, "val_reward": before, **failures.metrics("val_"), **failures.console()},
                )
            try:
                after = await self._iterate(ctx, train, val, rng, resources_id, version, metrics, after)
            finally:
                metrics.close()
        exported = await asyncio.to_thread(
            export_outputs,
            self.policy,
            out,
            enabled=cfg.export_model,
            adapter=cfg.export_adapter,
            base_path=cfg.model_path,
            best=self.best,
            info={"algorithm": "SFT", "iterations": cfg.iterations},
        )
        return {
            "val_reward_before": before,
            "val_reward_after": after,
            "warm_start_samples": len(seed),
            "history": self.history,
            **exported,  # model_path, best_model_path, adapter_path
        }

    def _check(self, failures: Failures, where: str) -> None:
        check_not_all_failed(
            failures, where, stop=self.config.stop_on_all_failed, option="SFTConfig(stop_on_all_failed=False)"
        )

    def _metrics_logger(self, ctx: TrainingContext) -> Any:
        """Progress over iterations, a console line per gradient step, metrics.csv and a loss curve."""
        from agl.metrics import MetricsLogger

        return MetricsLogger(
            Path(ctx.output_dir),
            total_steps=self.config.iterations,
            progress=self.config.progress,
            console=self.config.progress,
            shown=("iteration", "sft_loss", "val_reward", "kept_rollouts", "samples"),
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
            failures = await rollout_failures(ctx.store, rollouts, spans)
            if iteration == 1:
                self._check(failures, "the first iteration")
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
                **failures.metrics(),
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
                    at = iteration - 1 + finished / batches
                    metrics.log(step, {"iteration": at, "sft_loss": stats["sft_loss"], **step_peaks()})
            if samples:
                version = await ctx.sync_weights(await asyncio.to_thread(self.policy.engine_weights))
                resources_id = await ctx.publish(
                    {"llm": ctx.llm, "weights": ModelWeights(uri=cfg.model_path, version=version)},
                    model_version=version,
                )
            if val:
                after = await self.evaluate(ctx, val, resources_id)
                row["val_reward"] = after
                if self.best is not None:
                    await asyncio.to_thread(self.best.offer, self.policy, after, iteration=iteration)
            self.history.append(row)
            metrics.log(
                step,
                {
                    **{k: v for k, v in row.items() if k != "sft_loss"},
                    "iteration": iteration,
                    **failures.console(),
                },
            )
        return after
