"""GRPO as an agl Algorithm: groups of rollouts through the store, samples from spans, a policy step, weight sync.

Each step: enqueue ``group_size`` rollouts per task (one ``group_id`` per task), wait for them, turn
their spans into samples (trajectory-level by default), settle failed rollouts by their class
(``GRPOConfig.on_failure``: resampled, dropped or trained as 0; grpo/failures.py), drop what must not be
trained on (zero-variance groups, over-long samples; each counted; ``refill`` draws more tasks in place of
the tied groups, grpo/refill.py), compute group-relative advantages
per rollout, take one optimizer step, push the new weights to the engine and publish them as a new
resources version, so the next rollouts record the version they ran with.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.adapter.behaviour import step_behaviour
from agl.adapter.thinking import think_token_ids
from agl.algorithm.base import Algorithm, Evaluation, TrainingContext, evaluate
from agl.algorithm.export import BEST_DIR, BestExport, export_trained
from agl.algorithm.grpo.agents import check_agents_called, step_agents
from agl.algorithm.grpo.async_loop import RolloutPipeline, VersionLog
from agl.algorithm.grpo.batch import StepBatch, build_batch
from agl.algorithm.grpo.config import GRPOConfig
from agl.algorithm.grpo.failures import TaskIndex, failure_rows, write_dropped
from agl.algorithm.grpo.judging import judge_evaluation
from agl.algorithm.grpo.record import step_records, write_records
from agl.algorithm.grpo.refill import StepRollouts
from agl.algorithm.grpo.warm_start import WarmStart, train_warm_start
from agl.algorithm.health import Failures, LearningCheck, check_not_all_failed
from agl.algorithm.spec import AdapterSpec, ModelSpec
from agl.algorithm.teacher import Teacher, teach
from agl.compute.memory import release_free_memory, step_peaks
from agl.compute.thread import run_compute
from agl.errors import ConfigError
from agl.seeding import derive_seed, seed_everything

if TYPE_CHECKING:
    from agl.metrics import MetricsLogger

log = logging.getLogger(__name__)


class GRPO(Algorithm):
    """``Trainer(algorithm=GRPO(GRPOConfig(model_path=...))).fit(agent, train, val)``."""

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.history: list[dict[str, float]] = []
        self.policy: Any = None  # made on first run unless set (e.g. after an SFT warm start)
        self.version = "v0"  # the engine's weights version (the latest one published)
        self.initial_val: float | None = None  # skip the first validation when already known
        self.warm_start_history: list[dict[str, float]] = []
        self.teacher_counts: dict[str, float] = {}  # a Teacher warm start's rollouts, kept ones, samples
        self.learning = LearningCheck()  # warns once per run when nothing can be learned
        # on-policy distillation from an endpoint: scores each step's samples before the update
        self._scoring_teacher: Any = None  # a policy.distill.EndpointTeacher
        self.baseline_failures = Failures(0, 0)
        self.val_failures_after = Failures(0, 0)  # the latest validation's
        # the latest validation's behaviour (calls, tool calls, replies cut off at max_tokens), and by phase
        self.val_behaviour: dict[str, float] = {}
        self.phase_behaviour: dict[str, dict[str, float]] = {}

    def model_spec(self) -> ModelSpec:
        """The base model fit serves, with the LoRA rank, precision and device the policy trains with;
        with several ``agents``, one LoRA adapter per agent, served under the agent's name."""
        cfg = self.config
        teacher = cfg.warm_start.spec() if isinstance(cfg.warm_start, Teacher) else None
        adapters = {agent: AdapterSpec(agent, cfg.lora_rank) for agent in self._adapters}
        return ModelSpec(
            cfg.model_path,
            lora_rank=0 if adapters else cfg.lora_rank,
            precision=cfg.precision,
            device=cfg.device,
            adapters=adapters,
            teacher=teacher,
        )

    @property
    def _adapters(self) -> tuple[str, ...]:
        """The agents that train an adapter each (several ``agents``; none for one or every agent)."""
        return self.config.agents if len(self.config.agents) > 1 else ()

    async def _resume(self, ctx: TrainingContext, checkpoint: Path) -> int:
        """Load weights and optimizer from ``checkpoint`` (``run`` pushes them to the engine); returns the next step."""
        if self.config.lora_rank:
            raise ConfigError("resume supports full fine-tuning checkpoints; set lora_rank=0 or start afresh")
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        self.policy = await run_compute(self._make_policy, str(checkpoint))
        await run_compute(self.policy.load_optimizer, checkpoint)
        log.info("resumed from %s (step %d)", checkpoint, state["step"])
        return int(state["step"]) + 1

    def _make_policy(self, model_path: str | None = None) -> Any:
        from agl.algorithm.policy import Policy, PolicyConfig

        cfg = self.config
        return Policy(
            PolicyConfig(
                model_path=model_path or cfg.model_path,
                lr=cfg.lr,
                max_grad_norm=cfg.max_grad_norm,
                micro_batch_tokens=cfg.micro_batch_tokens,
                activation_checkpointing=cfg.activation_checkpointing,
                lora_rank=cfg.lora_rank,
                adapters=self._adapters,
                kl_coef=cfg.loss.kl_coef,
                teacher_path=cfg.teacher.path if cfg.teacher is not None else None,
                teacher_scored=cfg.teacher is not None and cfg.teacher.endpoint is not None,
                seed=cfg.seed,
                device=cfg.device,
                memory_budget_gb=cfg.memory_budget_gb,
                precision=cfg.precision,
                share_prefixes=cfg.share_prefixes,
            ),
            cfg.loss,
        )

    def _resolve_thinking(self) -> None:
        """``train_thinking=False``: the ids of ``<think>``/``</think>`` from the policy's tokenizer, unless given."""
        cfg = self.config
        if cfg.train_thinking or cfg.think_token_ids is not None:
            return
        ids = think_token_ids(self.policy.tokenizer)
        if ids is None:
            raise ConfigError(
                f"GRPOConfig(train_thinking=False): the tokenizer of {cfg.model_path} has no single-token "
                "<think> and </think>, so its thinking cannot be found in token ids; set think_token_ids="
                "(open_id, close_id) for other tags, or train_thinking=True"
            )
        self.config = dataclasses.replace(cfg, think_token_ids=ids)

    async def _publish(self, ctx: TrainingContext, policy: Any = None) -> str:
        """Push ``policy`` (None: no new weights) to the engines and publish them; returns the resources id."""
        published = await ctx.publish_policy(policy)
        self.version = published.version
        return published.resources_id

    async def _warm_start(
        self,
        ctx: TrainingContext,
        train: Sequence[Any],
        val: Sequence[Any],
        resources_id: str,
        phases: dict[str, float],
    ) -> str:
        """Held-out reward of the base model, the SFT warm start (on the given conversations, or on the
        teacher's kept rollouts, whose own score goes to ``phases["teacher"]``), the new weights
        published and measured."""
        warm = self.config.warm_start
        assert warm is not None
        phases["base"] = (
            self.initial_val
            if self.initial_val is not None
            else (await self._baseline(ctx, val, resources_id))[0]
        )
        self.phase_behaviour["base"] = self.val_behaviour
        if isinstance(warm, Teacher):
            self.warm_start_history, self.teacher_counts = await teach(
                ctx, warm, self.policy, train, val, phases, timeout_s=self.config.rollout_timeout_s
            )
        else:
            if ctx.engines is not None:  # nothing generates while it trains, and its weights replace these
                await ctx.engines.free_for_update()
            self.warm_start_history = await run_compute(train_warm_start, self.policy, warm)
            release_free_memory()  # its optimizer state and activations, which GRPO's steps never reuse
        resources_id = await self._publish(ctx, self.policy)
        phases["after_warm_start"] = await self.evaluate(ctx, val, resources_id)
        self.phase_behaviour["after_warm_start"] = self.val_behaviour
        log.info(
            "held-out reward: %sbase %.3f, after warm start %.3f",
            f"teacher {phases['teacher']:.3f}, " if "teacher" in phases else "",
            phases["base"],
            phases["after_warm_start"],
        )
        return resources_id

    @property
    def _val_seed(self) -> int | None:
        """Validation rollouts' sampling seed: the same at every evaluation of a deterministic run, so
        scores before and after training differ by the weights, not by the draws."""
        return derive_seed(self.config.seed, "val") if self.config.deterministic else None

    async def evaluate(self, ctx: TrainingContext, val: Sequence[Any], resources_id: str) -> float:
        """Mean final reward over the validation rollouts that yielded one (failures are counted apart)."""
        return (await self._validation(ctx, val, resources_id, 0)).score

    async def _validation(
        self, ctx: TrainingContext, val: Sequence[Any], resources_id: str, step: int
    ) -> Evaluation:
        """One validation rollout per task; its failures go to ``dropped.jsonl`` (``mode`` ``val``)."""
        result = await evaluate(
            ctx, val, resources_id, timeout_s=self.config.rollout_timeout_s, sampling_seed=self._val_seed
        )
        # with a judge, a rollout without a reward is judged alone; one the judge fails on is left out
        result = await judge_evaluation(ctx.store, self.config.judge, result)
        self.val_behaviour = {
            f"val_{k}": v for k, v in step_behaviour({r.rollout_id: s for r, s in result.results}).items()
        }
        write_dropped(Path(ctx.output_dir), failure_rows(result.failures, step, TaskIndex(val)))
        if result.failures.failed:
            log.info("validation at step %d: %s", step, result.summary())
        return result

    async def _baseline(
        self, ctx: TrainingContext, val: Sequence[Any], resources_id: str
    ) -> tuple[float, Failures]:
        """The first validation; stops the run when every rollout of it failed (``stop_on_all_failed``)."""
        result = await self._validation(ctx, val, resources_id, 0)
        check_not_all_failed(
            result.failures,
            "the baseline evaluation",
            stop=self.config.stop_on_all_failed,
            option="GRPOConfig(stop_on_all_failed=False)",
        )
        self.baseline_failures = self.val_failures_after = result.failures
        return result.score, result.failures

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> dict[str, Any]:
        from agl.metrics import MetricsLogger

        cfg = self.config
        if ctx.engines is None:
            raise ConfigError("GRPO needs an engine to push weights to: run it through Trainer.fit")
        out = Path(ctx.output_dir)
        if cfg.deterministic:
            seed_everything(cfg.seed)
        first_step = 1
        checkpoint = latest_checkpoint(out) if cfg.resume else None
        if checkpoint is not None:
            first_step = await self._resume(ctx, checkpoint)
        elif self.policy is None:
            self.policy = await run_compute(self._make_policy)
        self._resolve_thinking()
        metrics = MetricsLogger(out, total_steps=cfg.steps, resume=checkpoint is not None)
        resources_id = await self._publish(ctx, None if checkpoint is None else self.policy)
        phases: dict[str, float] = {}
        self.learning = LearningCheck(distilling=cfg.teacher is not None)
        if cfg.teacher is not None and cfg.teacher.endpoint is not None:
            from agl.algorithm.policy.distill import EndpointTeacher

            self._scoring_teacher = EndpointTeacher(
                cfg.teacher.endpoint,
                cfg.teacher.model or "teacher",
                self.policy.tokenizer,
                cfg.teacher.api_key,
            )
        self.baseline_failures = Failures(0, 0)
        self.val_failures_after = Failures(0, 0)
        if cfg.warm_start is not None and checkpoint is None:
            resources_id = await self._warm_start(ctx, train, val, resources_id, phases)
        val_before = (
            phases["after_warm_start"]
            if "after_warm_start" in phases
            else self.initial_val
            if self.initial_val is not None
            else (await self._baseline(ctx, val, resources_id))[0]
        )
        phases.setdefault("base", val_before)
        self.phase_behaviour.setdefault("base", self.val_behaviour)
        best = BestExport(
            out / BEST_DIR,
            enabled=cfg.export_model and bool(val) and cfg.eval_every > 0,
            base_path=cfg.model_path,
        )
        await run_compute(best.offer, self.policy, val_before, step=first_step - 1)
        if checkpoint is None:
            failed = self.baseline_failures
            metrics.log(
                0,
                {  # with the peaks of all before the first step: validations, the warm start
                    "val_reward": val_before,
                    **self.val_behaviour,
                    **failed.metrics("val_"),
                    **step_peaks(),
                    **failed.console(),
                },
            )
            self.learning.at_start(val_before, phases, failed)
        val_after = await self._train_steps(  # the step loop, sync or async, on one rank or several
            ctx,
            train,
            val,
            first_step=first_step,
            resources_id=resources_id,
            val_after=val_before,
            metrics=metrics,
            checkpoint=None if checkpoint is None else str(checkpoint),
            best=best,
        )
        metrics.close()
        log.info(
            "held-out reward: %s",
            ", ".join(f"{k} {v:.3f}" for k, v in {**phases, "after_grpo": val_after}.items()),
        )
        exported = await export_trained(
            self.policy, cfg, out, best=best, info={"algorithm": "GRPO", "steps": cfg.steps}
        )
        return {
            "val_reward_before": val_before,
            "val_reward_after": val_after,
            # failed validation rollouts per class, apart from the rewards above (which leave them out)
            "val_failures_before": dict(self.baseline_failures.by_class),
            "val_failures_after": dict(self.val_failures_after.by_class),
            "steps": cfg.steps,
            # what "auto" resolved to on this machine (bf16 only where the CPU has native bf16)
            "precision": getattr(self.policy, "precision", cfg.precision),
            "history": self.history,
            "phases": {**phases, "after_grpo": val_after},
            # held-out behaviour at each phase: calls per rollout, tool-call share, replies cut off at max_tokens
            "phase_behaviour": {**self.phase_behaviour, "after_grpo": self.val_behaviour},
            "warm_start": self.warm_start_history,
            **({"teacher": self.teacher_counts} if self.teacher_counts else {}),
            **exported,  # model_path, best_model_path, adapter_path
        }

    def _update(self, batch: StepBatch) -> dict[str, float]:
        """Blocking: the policy's step on ``batch`` (with an adapter per agent, one step per agent)."""
        if self._adapters:
            return step_agents(self.policy, batch, self._adapters)
        return dict(self.policy.step(batch.samples, batch.advantages, batch.rollout_index))

    async def _checkpoint(self, path: Path, step: int) -> None:
        """The policy and the step it reached, for ``resume=True``."""
        await run_compute(self.policy.save, path)
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "version": self.version}))

    async def _train_steps(
        self,
        ctx: TrainingContext,
        train: Sequence[Any],
        val: Sequence[Any],
        *,
        first_step: int,
        resources_id: str,
        val_after: float,
        metrics: MetricsLogger,
        checkpoint: str | None,
        best: BestExport,
    ) -> float:
        """Steps ``first_step..steps``: rollouts (ahead of training when async), batch, update, publish.

        Returns the last validation reward; ``best`` writes the policy to disk whenever a validation
        beats the best so far. With ``world_size > 1`` the policy steps on every rank for the duration
        of the loop (:mod:`agl.algorithm.policy.distributed`); the ranks stop when it ends.
        """
        cfg = self.config
        rng = random.Random(cfg.seed)
        count = min(cfg.tasks_per_step, len(train))
        for _ in range(1, first_step):
            rng.sample(list(train), count)  # the same task draws as the first run
        pipeline = RolloutPipeline(
            ctx,
            lambda: rng.sample(list(train), count),
            group_size=cfg.group_size,
            depth=cfg.max_staleness if cfg.async_rollouts else 0,
            last_step=cfg.steps,
            timeout_s=cfg.rollout_timeout_s,
            seed=cfg.seed if cfg.deterministic else None,
        )
        versions = VersionLog(self.version)
        if cfg.world_size > 1:
            from agl.algorithm.policy.distributed import DistributedPolicy

            self.policy = await run_compute(
                DistributedPolicy.start, self.policy, cfg.world_size, checkpoint, cfg.sharding
            )
        step_rollouts = StepRollouts(ctx, cfg, train, versions, pipeline.depth, Path(ctx.output_dir))
        failed = False
        # what exists now (model, engine, frameworks' modules) lives as long as the run: frozen, it is left
        # out of the per-step collections below, which then scan only what the steps allocate
        gc.collect()
        gc.freeze()
        try:
            for step in range(first_step, cfg.steps + 1):
                started, cpu_started = time.perf_counter(), time.process_time()
                fetched = await pipeline.take(step, resources_id, versions.current)
                drawn = await step_rollouts.settle(
                    fetched.rollouts, fetched.spans, step=step, enqueued_version=fetched.enqueued_version
                )
                if step == first_step:  # a run whose first rollouts all fail would train nothing, silently
                    check_not_all_failed(
                        drawn.failures,
                        f"the first step ({step})",
                        stop=cfg.stop_on_all_failed,
                        option="GRPOConfig(stop_on_all_failed=False)",
                    )
                if cfg.refill:  # groups whose rewards tie train nothing: draw more tasks in their place
                    drawn = await step_rollouts.refill(drawn, step=step, resources_id=resources_id)
                batch = build_batch(drawn.rollouts, drawn.spans, cfg, drawn.zeroed)
                if step == first_step:
                    check_agents_called(batch, cfg.agents, step)
                if cfg.deterministic == "exact":  # the engine's logprobs' last bits depend on its batching
                    batch.samples = [dataclasses.replace(s, old_logprobs=None) for s in batch.samples]
                if self._scoring_teacher is not None:  # an endpoint teacher scores the samples' tokens
                    batch.samples = await self._scoring_teacher.score(batch.samples)
                rollout_s = time.perf_counter() - started
                await write_records(ctx.store, step_records(step, drawn.rollouts, batch, cfg))
                row = {**batch.metrics, **drawn.metrics}
                row.update(step_behaviour({r.rollout_id: drawn.spans[r.rollout_id] for r in drawn.rollouts}))
                row["trainer_idle_s"] = fetched.wait_s
                row["gc_time_s"] = collect_step_garbage()  # before the update's peak
                if batch.samples:
                    if not pipeline.depth and ctx.engines is not None:
                        # nothing is generating, and the update makes the engine's cached prefixes and
                        # weights stale: freed now, their memory serves the update's own peak
                        await ctx.engines.free_for_update()
                    row.update(await run_compute(self._update, batch))
                    resources_id = await self._publish(ctx, self.policy)
                    versions.advance(self.version)
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    result = await self._validation(ctx, val, resources_id, step)
                    val_after = result.score
                    row.update(val_reward=val_after, **self.val_behaviour, **result.failures.metrics("val_"))
                    self.val_failures_after = result.failures
                    await run_compute(
                        best.offer, self.policy, val_after, step=step, model_version=self.version
                    )
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    saving, cpu_saving = time.perf_counter(), time.process_time()
                    await self._checkpoint(step_rollouts.out / "checkpoints" / f"step-{step}", step)
                    row["checkpoint_time_s"] = time.perf_counter() - saving
                    row["checkpoint_cpu_s"] = time.process_time() - cpu_saving
                row.update(
                    step_time_s=time.perf_counter() - started,
                    # every thread of this process: rollouts, the in-process engine, the update
                    cpu_time_s=time.process_time() - cpu_started,
                    rollout_time_s=rollout_s,
                    **step_peaks(),
                )
                metrics.log(step, {**row, **drawn.failures.console()})
                self.learning.after_step(step, row, first=step == first_step)
                self.history.append(row)
        except BaseException:
            failed = True
            raise
        finally:
            await pipeline.close()
            gc.unfreeze()
            if cfg.world_size > 1:
                await run_compute(self.policy.close, not failed)
                self.policy = self.policy.policy
        return float(val_after)


def collect_step_garbage() -> float:
    """One full garbage collection; returns its seconds. A step's finished rollouts leave garbage in reference
    cycles (framework clients, graph state) that Python's full collection, scaled to a heap holding a model,
    reaches only rarely: RSS climbed step after step until each step collected it."""
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest ``checkpoints/step-N`` with a trainer state under ``out_dir``, if any."""
    found = [p for p in (out_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").exists()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


__all__ = ["GRPO", "GRPOConfig", "StepBatch", "WarmStart", "build_batch", "latest_checkpoint"]
