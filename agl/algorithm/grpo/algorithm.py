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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl.algorithm.base import Algorithm, TrainingContext, validate
from agl.algorithm.export import BEST_DIR, BestExport, export_outputs
from agl.algorithm.grpo.async_loop import train_steps
from agl.algorithm.grpo.batch import StepBatch, build_batch
from agl.algorithm.grpo.loss import LossConfig
from agl.algorithm.grpo.warm_start import WarmStart, train_warm_start
from agl.algorithm.health import Failures, LearningCheck, check_not_all_failed
from agl.algorithm.memory import check_settings
from agl.errors import ConfigError
from agl.schemas import ModelWeights, Rollout, Span

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
    # memory: "auto" sizes micro-batches to memory_budget_gb (None: a share of the free RAM or VRAM) and
    # recomputes activations in backward on CPU, where it is no slower (agl/algorithm/memory.py)
    micro_batch_tokens: int | Literal["auto"] = "auto"
    activation_checkpointing: bool | Literal["auto"] = "auto"
    memory_budget_gb: float | None = None
    lora_rank: int = 0
    scale_by_std: bool = True  # False: Dr. GRPO (no std division)
    level: Literal["trajectory", "transition"] = "trajectory"
    max_sample_tokens: int = 2048
    agent: str | None = None  # train only this agent's calls (agl.agent_scope, agent endpoint, or span name)
    credit: Literal["final", "per_call"] = "final"  # per_call: emit_reward(response_id=...) shapes its call
    call_reward_weight: float = 1.0  # per_call: a call's return = final reward + weight * its own reward
    warm_start: WarmStart | None = None  # SFT on known-good conversations before the first GRPO step
    loss: LossConfig = field(default_factory=LossConfig)
    kl_coef: float = 0.0
    eval_every: int = 5
    rollout_timeout_s: float = 600.0
    checkpoint_every: int = 0
    resume: bool = False  # continue from the newest checkpoint under the output dir (full fine-tuning)
    # the final policy as a Hugging Face folder in OUT/model (LoRA merged), the best-validation one in
    # OUT/model-best; export_adapter also keeps a LoRA run's bare adapter in OUT/model-adapter
    export_model: bool = True
    export_adapter: bool = False
    seed: int = 0
    # async: rollouts of the next max_staleness steps run while a step trains (off-policy by at most
    # max_staleness weight versions; the loss's ratio is against the engine's logprobs). Sync ignores it.
    async_rollouts: bool = False
    max_staleness: int = 1
    world_size: int = 1  # > 1: data-parallel policy steps over torch.distributed (grpo/distributed.py)
    # "fsdp": the world_size ranks shard parameters, gradients and optimizer state with FSDP2 (bf16
    # compute on CUDA) instead of each holding the full model (agl/algorithm/sharding.py)
    sharding: Literal["none", "fsdp"] = "none"
    device: str = "cpu"  # where the policy trains ("cuda" for a GPU); the engine's is Serving(engine=BuiltinEngine(...))
    # every rollout of the baseline evaluation or the first step failed: stop with the first error
    stop_on_all_failed: bool = True

    def __post_init__(self) -> None:
        check_settings(self.micro_batch_tokens, self.memory_budget_gb)
        if self.group_size < 2:
            raise ConfigError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.steps < 0 or self.tasks_per_step < 1:
            raise ConfigError(
                f"steps >= 0 and tasks_per_step >= 1 needed, got {self.steps}, {self.tasks_per_step}"
            )
        if self.max_staleness < 0 or self.world_size < 1:
            raise ConfigError(
                f"max_staleness >= 0 and world_size >= 1 needed, got {self.max_staleness}, {self.world_size}"
            )
        if self.sharding not in ("none", "fsdp"):
            raise ConfigError(f"GRPOConfig(sharding=...) must be 'none' or 'fsdp', got {self.sharding!r}")
        if self.sharding == "fsdp" and self.world_size < 2:
            raise ConfigError(
                f'GRPOConfig(sharding="fsdp") shards over ranks: set world_size >= 2, got {self.world_size}'
            )
        if self.credit not in ("final", "per_call"):
            raise ConfigError(f"credit must be 'final' or 'per_call', got {self.credit!r}")
        if self.kl_coef > 0 and self.loss.kl_coef == 0:
            object.__setattr__(self, "loss", LossConfig(**{**self.loss.__dict__, "kl_coef": self.kl_coef}))


class GRPO(Algorithm):
    """``Trainer(algorithm=GRPO(GRPOConfig(model_path=...))).fit(agent, train, val)``."""

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.history: list[dict[str, float]] = []
        self.policy: Any = None  # made on first run unless set (e.g. after an SFT warm start)
        self.version = "v0"  # the engine's weights version when run starts
        self.initial_val: float | None = None  # skip the first validation when already known
        self.warm_start_history: list[dict[str, float]] = []
        self.learning = LearningCheck()  # warns once per run when nothing can be learned
        self.baseline_failures = Failures(0, 0)

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
                device=cfg.device,
                memory_budget_gb=cfg.memory_budget_gb,
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

    async def _warm_start(
        self, ctx: TrainingContext, val: Sequence[Any], resources_id: str, phases: dict[str, float]
    ) -> tuple[str, str]:
        """Held-out reward of the base model, the SFT warm start, the new weights published and measured."""
        assert self.config.warm_start is not None and ctx.sync_weights is not None
        phases["base"] = (
            self.initial_val
            if self.initial_val is not None
            else (await self._baseline(ctx, val, resources_id))[0]
        )
        self.warm_start_history = await asyncio.to_thread(
            train_warm_start, self.policy, self.config.warm_start
        )
        version = await ctx.sync_weights(await asyncio.to_thread(self.policy.engine_weights))
        resources_id = await self._publish(ctx, version)
        phases["after_warm_start"] = await self.evaluate(ctx, val, resources_id)
        log.info(
            "held-out reward: base %.3f, after warm start %.3f", phases["base"], phases["after_warm_start"]
        )
        return version, resources_id

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
        return (await validate(ctx, val, resources_id, timeout_s=self.config.rollout_timeout_s))[0]

    async def _baseline(
        self, ctx: TrainingContext, val: Sequence[Any], resources_id: str
    ) -> tuple[float, Failures]:
        """The first validation; stops the run when every rollout of it failed (``stop_on_all_failed``)."""
        score, failures = await validate(ctx, val, resources_id, timeout_s=self.config.rollout_timeout_s)
        check_not_all_failed(
            failures,
            "the baseline evaluation",
            stop=self.config.stop_on_all_failed,
            option="GRPOConfig(stop_on_all_failed=False)",
        )
        self.baseline_failures = failures
        return score, failures

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> dict[str, Any]:
        from agl.metrics import MetricsLogger

        cfg = self.config
        if ctx.sync_weights is None:
            raise ConfigError("GRPO needs an engine to push weights to: run it through Trainer.fit")
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
        phases: dict[str, float] = {}
        self.learning, self.baseline_failures = LearningCheck(), Failures(0, 0)
        if cfg.warm_start is not None and checkpoint is None:
            version, resources_id = await self._warm_start(ctx, val, resources_id, phases)
        val_before = (
            phases["after_warm_start"]
            if "after_warm_start" in phases
            else self.initial_val
            if self.initial_val is not None
            else (await self._baseline(ctx, val, resources_id))[0]
        )
        phases.setdefault("base", val_before)
        best = BestExport(
            out / BEST_DIR,
            enabled=cfg.export_model and bool(val) and cfg.eval_every > 0,
            base_path=cfg.model_path,
        )
        await asyncio.to_thread(best.offer, self.policy, val_before, step=first_step - 1)
        if checkpoint is None:
            failed = self.baseline_failures
            metrics.log(0, {"val_reward": val_before, **failed.metrics("val_"), **failed.console()})
            self.learning.at_start(val_before, phases, failed)
        val_after = await train_steps(  # the step loop, sync or async, on one rank or several
            self,
            ctx,
            train,
            val,
            first_step=first_step,
            version=version,
            resources_id=resources_id,
            val_after=val_before,
            metrics=metrics,
            checkpoint=None if checkpoint is None else str(checkpoint),
            best=best,
        )
        metrics.close()
        exported = await asyncio.to_thread(
            export_outputs,
            self.policy,
            out,
            enabled=cfg.export_model,
            adapter=cfg.export_adapter,
            base_path=cfg.model_path,
            best=best,
            info={"algorithm": "GRPO", "steps": cfg.steps},
        )
        return {
            "val_reward_before": val_before,
            "val_reward_after": val_after,
            "steps": cfg.steps,
            "history": self.history,
            "phases": {**phases, "after_grpo": val_after},
            "warm_start": self.warm_start_history,
            **exported,  # model_path, best_model_path, adapter_path
        }


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest ``checkpoints/step-N`` with a trainer state under ``out_dir``, if any."""
    found = [p for p in (out_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").exists()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


__all__ = ["GRPO", "GRPOConfig", "StepBatch", "WarmStart", "build_batch", "latest_checkpoint"]
