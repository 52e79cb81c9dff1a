"""Iterated SFT (rejection-sampling fine-tuning / expert iteration) as an agl Algorithm.

Each iteration: run ``samples_per_task`` rollouts per training task with the current weights, keep
the good ones (``min_reward`` and/or ``top_k_per_task``), train on their engine token ids with the
loss masked to model tokens, push the weights to the engine, and measure validation reward.
With ``from_store`` it trains offline instead, on rollouts already in a store (selected by
:mod:`agl.algorithm.sft.offline`).
The final policy goes to ``OUT/model`` as a Hugging Face folder (:mod:`agl.algorithm.export`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from agl.adapter import Sample
from agl.algorithm.base import Algorithm, TrainingContext, evaluate
from agl.algorithm.export import BEST_DIR, BestExport, export_trained
from agl.algorithm.health import Failures, check_not_all_failed, rollout_failures
from agl.algorithm.sft.config import SFTConfig
from agl.algorithm.sft.offline import load_selection
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    export_jsonl,
    samples_from_messages,
    samples_from_spans,
    select_rollouts,
    tools_from_spans,
)
from agl.algorithm.spec import ModelSpec
from agl.algorithm.teacher import Teacher, teach
from agl.compute.memory import step_peaks
from agl.compute.thread import run_compute
from agl.errors import ConfigError

log = logging.getLogger(__name__)


class SFT(Algorithm):
    """``Trainer(algorithm=SFT(SFTConfig(model_path=...))).fit(agent, train, val)``."""

    def __init__(self, config: SFTConfig) -> None:
        self.config = config
        self.policy: Any = None
        self.history: list[dict[str, float]] = []
        self.best: BestExport | None = None
        self.teacher_rows: list[dict[str, float]] = []
        self.teacher_counts: dict[str, float] = {}

    def model_spec(self) -> ModelSpec:
        """The base model fit serves (offline too, to score ``val`` before and after), with the LoRA rank
        and precision the policy trains with; SFT trains on the CPU."""
        cfg = self.config
        teacher = cfg.teacher.spec() if cfg.teacher is not None else None
        return ModelSpec(
            cfg.model_path, lora_rank=cfg.lora_rank, precision=cfg.precision, device="cpu", teacher=teacher
        )

    def policy_config(self) -> Any:
        """The trainer-side policy's settings (a :class:`~agl.algorithm.policy.PolicyConfig`) from this config."""
        from agl.algorithm.policy import PolicyConfig

        cfg = self.config
        return PolicyConfig(
            model_path=cfg.model_path,
            lr=cfg.lr,
            lora_rank=cfg.lora_rank,
            micro_batch_tokens=cfg.micro_batch_tokens,
            activation_checkpointing=cfg.activation_checkpointing,
            memory_budget_gb=cfg.memory_budget_gb,
            precision=cfg.precision,
            share_prefixes=cfg.share_prefixes,
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
        from agl.algorithm.policy.distributed import DistributedPolicy

        self.policy = await run_compute(
            DistributedPolicy.start, self.policy, cfg.world_size, None, cfg.sharding
        )
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            await run_compute(self.policy.close, not failed)
            self.policy = self.policy.policy

    async def evaluate(self, ctx: TrainingContext, val: Sequence[Any], resources_id: str) -> float:
        """Mean final reward of one validation rollout per task under ``resources_id``; failures score 0."""
        return (await evaluate(ctx, val, resources_id, timeout_s=self.config.rollout_timeout_s)).score

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
        from agl.algorithm.policy import LossConfig, Policy

        cfg = self.config
        if cfg.from_store is not None:
            return await self._run_offline(ctx, val)
        if ctx.llm is None or ctx.engines is None:
            raise ConfigError("SFT trains a local model: run it through Trainer.fit, which serves the model")
        self.policy = await run_compute(Policy, self.policy_config(), LossConfig())
        phases: dict[str, float] = {}
        if cfg.teacher is not None:  # before the ranks start: the teacher's steps run on this policy
            await self._teach(ctx, cfg.teacher, train, val, phases)
        async with self.ranks():  # world_size > 1: every step on every rank (FSDP2 shards)
            rng = random.Random(cfg.seed)
            seed = []
            if warm_start:
                seed = samples_from_messages(self.policy.tokenizer, list(warm_start), ctx.tools)
                for start in range(0, len(seed), cfg.batch_size):
                    await run_compute(self.policy.sft_step, seed[start : start + cfg.batch_size])
            trained = bool(warm_start) or cfg.teacher is not None
            resources_id = (await ctx.publish_policy(self.policy if trained else None)).resources_id
            baseline = await evaluate(ctx, val, resources_id, timeout_s=cfg.rollout_timeout_s)
            before, failures = baseline.score, baseline.failures
            if cfg.teacher is not None:
                phases["after_warm_start"] = before
            self._check(failures, "the baseline evaluation")
            after = before
            out = Path(ctx.output_dir)
            self.best = BestExport(
                out / BEST_DIR, enabled=cfg.export_model and bool(val), base_path=cfg.model_path
            )
            await run_compute(self.best.offer, self.policy, before, iteration=0)
            metrics = self._metrics_logger(ctx)
            if val:
                metrics.log(
                    0,
                    {"iteration": 0, "val_reward": before, **failures.metrics("val_"), **failures.console()},
                )
            try:
                after = await self._iterate(ctx, train, val, rng, resources_id, metrics, after)
            finally:
                metrics.close()
        exported = await export_trained(
            self.policy, cfg, out, best=self.best, info={"algorithm": "SFT", "iterations": cfg.iterations}
        )
        return {
            "val_reward_before": before,
            "val_reward_after": after,
            "warm_start_samples": len(seed),
            "history": self.history,
            **(
                {"phases": {**phases, "after_sft": after}, "teacher": self.teacher_counts}
                if cfg.teacher is not None
                else {}
            ),
            **exported,  # model_path, best_model_path, adapter_path
        }

    async def _teach(
        self,
        ctx: TrainingContext,
        teacher: Teacher,
        train: Sequence[Any],
        val: Sequence[Any],
        phases: dict[str, float],
    ) -> None:
        """The student's held-out base score, then the teacher's (``phases``), and SFT on its kept traces."""
        timeout_s = self.config.rollout_timeout_s
        if val:
            phases["base"] = await self.evaluate(ctx, val, (await ctx.publish_policy()).resources_id)
        self.teacher_rows, self.teacher_counts = await teach(
            ctx, teacher, self.policy, train, val, phases, timeout_s=timeout_s
        )
        log.info(
            "held-out reward: teacher %.3f, base %.3f; the student trained on %d teacher samples",
            phases.get("teacher", float("nan")),
            phases.get("base", float("nan")),
            self.teacher_counts["teacher_samples"],
        )

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
        metrics: Any,
        after: float,
    ) -> float:
        cfg = self.config
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
                    tools=tools_from_spans(kept, spans),
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
                    stats = await run_compute(self.policy.sft_step, samples[start : start + cfg.batch_size])
                    row["sft_loss"] = stats["sft_loss"]
                    step += 1
                    finished = epoch * math.ceil(len(samples) / cfg.batch_size) + start // cfg.batch_size + 1
                    at = iteration - 1 + finished / batches
                    metrics.log(step, {"iteration": at, "sft_loss": stats["sft_loss"], **step_peaks()})
            if samples:
                resources_id = (await ctx.publish_policy(self.policy)).resources_id
            if val:
                after = await self.evaluate(ctx, val, resources_id)
                row["val_reward"] = after
                if self.best is not None:
                    await run_compute(self.best.offer, self.policy, after, iteration=iteration)
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

    async def _run_offline(self, ctx: TrainingContext, val: Sequence[Any]) -> dict[str, Any]:
        """Train ``epochs`` epochs on the store's selected rollouts; validate when an engine serves.

        Under ``Trainer.fit`` the new weights go to the engine and ``val`` is scored before and after
        (those are the only rollouts run). Without an engine (``ctx.engines`` None) it only trains
        and exports.
        """
        from agl.algorithm.policy import LossConfig, Policy
        from agl.metrics import MetricsLogger

        cfg = self.config
        selection = await load_selection(cfg)
        if not selection.samples:
            raise ConfigError(selection.explain(str(cfg.from_store)))
        out = Path(ctx.output_dir)
        if cfg.export_jsonl:
            export_jsonl(selection.conversations, out / "sft-from-store.jsonl", tools=selection.tools)
        self.policy = await run_compute(Policy, self.policy_config(), LossConfig())
        serving = ctx.llm is not None and ctx.engines is not None
        best = BestExport(
            out / BEST_DIR, enabled=cfg.export_model and bool(val) and serving, base_path=cfg.model_path
        )
        metrics = MetricsLogger(
            out,
            total_steps=cfg.epochs,
            progress=cfg.progress,
            console=cfg.progress,
            shown=("epoch", "sft_loss", "val_reward", "samples"),
            label="epoch",
            step_name="step",
            progress_key="epoch",
            plot_y=("sft_loss", "val_reward"),
            title="SFT from a store",
            tensorboard=False,
        )
        before = after = float("nan")
        async with self.ranks():  # world_size > 1: every step on every rank (FSDP2 shards)
            try:
                if serving and val:
                    before = after = await self.evaluate(ctx, val, (await ctx.publish_policy()).resources_id)
                    metrics.log(0, {"epoch": 0, "val_reward": before, **selection.counts})
                    await run_compute(best.offer, self.policy, before, epoch=0)
                await self._train_epochs(selection.samples, metrics)
                if serving:
                    resources_id = (await ctx.publish_policy(self.policy)).resources_id
                    if val:
                        after = await self.evaluate(ctx, val, resources_id)
                        self.history[-1]["val_reward"] = after
                        metrics.log(len(self.history), {"epoch": cfg.epochs, "val_reward": after})
                        await run_compute(best.offer, self.policy, after, epoch=cfg.epochs)
            finally:
                metrics.close()
        exported = await export_trained(
            self.policy,
            cfg,
            out,
            best=best,
            info={"algorithm": "SFT", "from_store": str(cfg.from_store), "epochs": cfg.epochs},
        )
        return {
            "val_reward_before": before,
            "val_reward_after": after,
            "warm_start_samples": 0,
            "history": self.history,
            "selected": selection.counts,
            **exported,
        }

    async def _train_epochs(self, samples: list[Sample], metrics: Any) -> None:
        """``epochs`` passes over ``samples`` in shuffled batches; a history row (mean loss) per epoch."""
        cfg = self.config
        rng = random.Random(cfg.seed)
        batches = math.ceil(len(samples) / cfg.batch_size)
        step = 0
        for epoch in range(1, cfg.epochs + 1):
            order = list(samples)
            rng.shuffle(order)
            losses = []
            for b in range(batches):
                stats = await run_compute(
                    self.policy.sft_step, order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
                )
                losses.append(stats["sft_loss"])
                step += 1
                metrics.log(step, {"epoch": epoch - 1 + (b + 1) / batches, "sft_loss": stats["sft_loss"]})
            self.history.append(
                {
                    "epoch": float(epoch),
                    "sft_loss": sum(losses) / len(losses),
                    "samples": float(len(samples)),
                    "model_tokens": float(sum(s.num_model_tokens for s in samples)),
                }
            )


def train_from_store(config: SFTConfig, output_dir: str | Path = "results") -> dict[str, Any]:
    """Offline SFT without an engine or agent (``config.from_store`` must be set): train, export, return.

    What a command line needs: ``train_from_store(SFTConfig(model_path=..., from_store=URL), OUT)``.
    """
    from agl.store.memory import InMemoryLightningStore

    if config.from_store is None:
        raise ConfigError("train_from_store needs SFTConfig(from_store=URL)")

    async def main() -> dict[str, Any]:
        store = InMemoryLightningStore()  # the context needs one; offline training never uses it
        try:
            return await SFT(config).run(TrainingContext(store=store, output_dir=str(output_dir)), [], [])
        finally:
            await store.aclose()

    return asyncio.run(main())


__all__ = ["SFT", "SFTConfig", "train_from_store"]
