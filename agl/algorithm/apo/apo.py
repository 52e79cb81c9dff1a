"""Automatic prompt optimization: textual gradients (critique, then edit), driven by a metric-call budget.

Each round picks parents by Pareto front over the validation tasks, runs a parent on a training minibatch
made mostly of tasks it already failed (scores are cached per prompt and task, so these cost nothing),
shows a critic the failures, asks an editor for ``branch_factor`` children, and races them: a child must
beat its parent on that minibatch, then not lose on a validation *probe* (the first part of a fixed
validation order), before it joins the pool. Full validation is spent only on contenders for the best:
the leader when the budget runs low, raced against the best fully validated score. The reported score
is always a full validation score. Every candidate is stored as a resources version (metadata ``apo``),
so the history is queryable from the store (:func:`apo_history`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl.agent.base import LitAgent
from agl.algorithm.apo.search import Candidate, diagnose_baseline, extract_prompt, leader_key, pareto_parents
from agl.algorithm.apo.trajectories import Trajectory, render_trajectories, trajectory_from_spans
from agl.algorithm.base import Algorithm, PendingRollouts, TrainingContext, score_of
from agl.algorithm.health import Failures, rollout_failures
from agl.algorithm.spec import ModelSpec
from agl.errors import AgentError, ConfigError
from agl.schemas import LLM, PromptTemplate, Resource, Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

log = logging.getLogger(__name__)

CRITIC_SYSTEM = (
    "You are a critic of prompts for an AI agent. You are shown the agent's current system prompt and "
    "trajectories where it did worst and best, with rewards and feedback. Name the systematic failures "
    "and what the prompt should say to prevent each."
)
EDITOR_SYSTEM = (
    "You improve system prompts for an AI agent. Rewrite the prompt to fix the issues in the critique. "
    "Keep every {placeholder} of the original. Return only the new prompt between <prompt> and </prompt>."
)


@dataclass(frozen=True)
class APOConfig:
    """Search shape, budget and the critic/editor endpoints (any OpenAI-compatible API).

    ``max_rollouts`` is the metric-call budget (graded task runs, validation included); it drives the
    run: with it, ``rounds`` defaults to unlimited and the search stops when the budget is spent (never
    exceeded), at a perfect validated score, or after ``patience`` rounds that accept no child.
    Without it ``rounds`` defaults to 3. ``val_probe`` is the fraction of the validation set a new
    child is first compared on (1.0 validates every accepted child fully, as GEPA does).
    ``output_dir`` gets ``metrics.csv`` and ``curve.png`` (best score against metric calls), and
    turns on the progress bar and per-round console line (``progress=False`` silences them).
    A rollout that fails for an ``infra`` or ``reward`` reason (:mod:`agl.failures`: the prompt did not
    cause it) is run again, up to ``max_resamples`` times, before it scores 0; an ``agent`` failure
    scores 0 at once, since the prompt may have caused it. Resampled runs count in the budget.
    """

    critic: LLM
    editor: LLM
    beam_width: int = 1
    branch_factor: int = 2
    rounds: int | None = None
    minibatch_size: int = 3
    val_size: int | None = None
    val_probe: float = 1 / 3
    max_rollouts: int | None = None
    max_llm_calls: int | None = None
    prompt_name: str = "prompt"
    worst_k: int = 3
    best_k: int = 1
    gate_on_minibatch: bool = True
    perfect_score: float | None = 1.0
    selection: Literal["pareto", "best"] = "pareto"
    patience: int = 8
    finalists: int = 3
    llm_retries: int = 2
    max_resamples: int = 2
    rollout_timeout_s: float = 600.0
    output_dir: str | None = None
    progress: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("beam_width", "branch_factor", "minibatch_size", "patience", "finalists"):
            if getattr(self, name) < 1:
                raise ConfigError(f"APOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_resamples < 0:
            raise ConfigError(f"APOConfig.max_resamples must be >= 0, got {self.max_resamples}")
        for name in ("rounds", "max_rollouts", "max_llm_calls", "val_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"APOConfig.{name} must be >= 1 or None (no limit), got {value}")
        if not 0 < self.val_probe <= 1:
            raise ConfigError(f"APOConfig.val_probe must be in (0, 1], got {self.val_probe}")
        if self.selection not in ("pareto", "best"):
            raise ConfigError(f"APOConfig.selection must be 'pareto' or 'best', got {self.selection!r}")


@dataclass
class APOResult:
    """The best fully validated prompt, every candidate, and where the budget went."""

    best: Candidate
    history: list[Candidate]
    rollouts_used: int
    llm_calls_used: int
    llm_calls_failed: int
    branches_skipped: int
    scores_by_round: list[float] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)
    rollouts_by_phase: dict[str, int] = field(default_factory=dict)
    stop_reason: str = ""
    rollouts_resampled: int = 0


class BudgetExhausted(Exception):
    """Raised inside the search when the next step would exceed the rollout or LLM-call budget."""


class APO(Algorithm):
    """``Trainer(algorithm=APO(config)).fit(agent, train, val)``, or ``await APO(config).run(store, train, val)``.

    Runners must be serving the store's queue (the trainer starts them). The base resources are the
    store's latest version; its ``prompt_name`` entry must be a PromptTemplate (or pass ``initial_prompt``).
    Under ``Trainer.fit`` the metrics and curve go to the trainer's output dir unless ``output_dir`` is set.
    """

    def __init__(self, config: APOConfig) -> None:
        self.config = config
        self.rollouts_used = 0
        self.rollouts_by_phase = {"minibatch": 0, "validation": 0}
        self.llm_calls_used = 0
        self.llm_calls_failed = 0
        self.branches_skipped = 0
        self.rollouts_resampled = 0
        self._round_resampled = 0
        self._round_failures: list[str] = []  # this round's failed rollouts' errors, for its console line
        self._round_rollouts = 0
        self.history: list[Candidate] = []
        self._by_template: dict[str, Candidate] = {}
        self._rng = random.Random(config.seed)
        self._scores: dict[tuple[str, str, int], tuple[str, float]] = {}
        self._trajectories: dict[str, Trajectory] = {}
        self._ancestors: dict[str, set[str]] = {}
        self._train_order: list[int] = []
        self._curve: list[tuple[int, float]] = []
        self._output_dir: str | None = config.output_dir

    def model_spec(self) -> ModelSpec | None:
        """None: APO edits prompts for the task LLM in the resources (a hosted endpoint), so fit serves no model."""
        return None

    # ----- the search ------------------------------------------------------------------------
    async def run(  # a bare store works too, for use without a trainer
        self,
        ctx: TrainingContext | LightningStore,
        train_tasks: Sequence[Any],
        val_tasks: Sequence[Any],
        *,
        initial_prompt: str | None = None,
    ) -> APOResult:
        cfg = self.config
        if isinstance(ctx, TrainingContext):
            self._output_dir = cfg.output_dir or ctx.output_dir
        else:
            ctx, self._output_dir = TrainingContext(store=ctx), cfg.output_dir
        self._ctx = ctx
        store = ctx.store
        base = await store.get_latest_resources()
        self._base: dict[str, Resource] = dict(base.resources) if base else {}
        if initial_prompt is None:
            current = self._base.get(cfg.prompt_name)
            if not isinstance(current, PromptTemplate):
                raise ConfigError(
                    f"APO needs a PromptTemplate named {cfg.prompt_name!r} in the latest resources, or initial_prompt"
                )
            initial_prompt = current.template
        self._store, self._train = store, list(train_tasks)
        self._val = list(val_tasks)[: cfg.val_size] if cfg.val_size else list(val_tasks)
        if not self._train or not self._val:
            raise ConfigError("APO needs at least one training task and one validation task")
        self._val_order = list(range(len(self._val)))
        self._rng.shuffle(self._val_order)
        self._probe = max(1, math.ceil(cfg.val_probe * len(self._val)))
        rounds = cfg.rounds if cfg.rounds is not None else (None if cfg.max_rollouts else 3)
        if cfg.max_rollouts is not None and cfg.max_rollouts < len(self._val):
            raise ConfigError(
                f"APOConfig.max_rollouts ({cfg.max_rollouts}) cannot cover one validation of the "
                f"{len(self._val)} validation tasks; raise it or pass val_size"
            )
        root = await self._store_candidate(initial_prompt, None, 0, None)
        scores_by_round: list[float] = []
        stop_reason = f"{rounds} rounds done"
        metrics = self._metrics_logger(rounds)
        try:
            try:
                await self._validate_baseline(root)
                scores_by_round.append(self._prefix_mean(self._leader()))
                self._log_round(metrics, 0)
                round_no, idle = 0, 0
                while rounds is None or round_no < rounds:
                    if await self._perfect():
                        stop_reason = "perfect validation score"
                        break
                    round_no += 1
                    accepted = 0
                    for parent in self._select_parents():
                        accepted += await self._expand(parent, round_no)
                    idle = 0 if accepted else idle + 1
                    scores_by_round.append(self._prefix_mean(self._leader()))
                    self._log_round(metrics, round_no)
                    if idle >= cfg.patience:
                        stop_reason = f"no child accepted in {cfg.patience} rounds"
                        break
            except BudgetExhausted as exc:
                stop_reason = str(exc)
            await self._finalize()
            self._log_round(metrics, len(scores_by_round))
        finally:
            if metrics is not None:
                metrics.close()
        best = self._best()
        if best is None:  # only when the budget could not cover one full validation (the reserve prevents it)
            best = self._leader()
            stop_reason += (
                f"; the best score covers {best.val_evaluated} of {len(self._val)} validation tasks"
            )
        if scores_by_round:
            scores_by_round[-1] = best.score or 0.0  # the last round includes the final validation
        log.info(
            "APO stopped (%s): best %.3f after %d metric calls",
            stop_reason,
            best.score or 0.0,
            self.rollouts_used,
        )
        return APOResult(
            best=best,
            history=self.history,
            rollouts_used=self.rollouts_used,
            llm_calls_used=self.llm_calls_used,
            llm_calls_failed=self.llm_calls_failed,
            branches_skipped=self.branches_skipped,
            scores_by_round=scores_by_round,
            curve=self._curve,
            rollouts_by_phase=dict(self.rollouts_by_phase),
            stop_reason=stop_reason,
            rollouts_resampled=self.rollouts_resampled,
        )

    async def evaluate(
        self,
        store: LightningStore,
        template: str,
        tasks: Sequence[Any],
        *,
        agent: LitAgent | None = None,
        max_concurrency: int = 4,
        claim_timeout_s: float = 30.0,
    ) -> float:
        """Mean reward of ``template`` on held-out ``tasks`` (mode ``test``; not counted in the budget).

        With ``agent`` the rollouts run on an in-process runner started for the call (after
        ``Trainer.fit`` returns, its runners are gone); without it, runners attached to ``store`` must
        serve them.

        Raises:
            AgentError: no runner claimed any rollout within ``claim_timeout_s``, or some were still
                unfinished after ``rollout_timeout_s``; the message counts them by status.
        """
        base = await store.get_latest_resources()
        resources: dict[str, Resource] = dict(base.resources) if base else {}
        version = await store.add_resources(
            {**resources, self.config.prompt_name: PromptTemplate(template=template)}
        )
        ctx = TrainingContext(store=store)
        pending = await ctx.start_rollouts(tasks, mode="test", resources_id=version.resources_id)
        runner = None
        if agent is not None:
            from agl.runner.runner import Runner

            runner = Runner(agent, store, max_concurrency=max_concurrency, poll_interval_s=0.02)
            runner_task = asyncio.create_task(runner.run())
        try:
            await self._wait_served(pending, claim_timeout_s if runner is None else None)
        finally:
            if runner is not None:
                runner.stop()
                await runner_task
                runner.close()
        return score_of(await pending.collect(timeout_s=0)) if pending.ids else 0.0

    async def _wait_served(self, pending: PendingRollouts, claim_timeout_s: float | None) -> None:
        """Wait for every rollout to finish; fail fast when nothing claims them, never return early."""
        store, ids = pending.ctx.store, pending.ids
        total = self.config.rollout_timeout_s
        waited = 0.0
        if claim_timeout_s is not None and claim_timeout_s < total:
            done = await pending.wait(claim_timeout_s)
            waited = claim_timeout_s
            if len(done) < len(ids):
                statuses = [(await store.get_rollout(i)).status for i in ids]
                if all(s == RolloutStatus.QUEUING for s in statuses):
                    raise AgentError(
                        f"APO.evaluate: no runner claimed any of the {len(ids)} test rollouts in "
                        f"{claim_timeout_s:g} s (Trainer.fit's runners stop when fit returns); pass "
                        "agent=your_agent to run them in-process, or attach runners to the store "
                        "(agl runner --store URL --agent module:attr)"
                    )
        done = await pending.wait(max(total - waited, 0.0))
        if len(done) < len(ids):
            counts = Counter([(await store.get_rollout(i)).status.value for i in ids])
            unfinished = len(ids) - len(done)
            raise AgentError(
                f"APO.evaluate: {unfinished} of {len(ids)} test rollouts were not served within "
                f"rollout_timeout_s={total:g} s (by status: {dict(sorted(counts.items()))}); raise "
                "APOConfig.rollout_timeout_s or add runners"
            )

    def _full(self) -> list[Candidate]:
        return [c for c in self.history if c.val_evaluated == len(self._val)]

    def _best(self) -> Candidate | None:
        """The best fully validated candidate (None until one is)."""
        return max(self._full(), key=lambda c: (c.score or 0.0, -c.round), default=None)

    def _best_score(self) -> float | None:
        best = self._best()
        return None if best is None else best.score

    def _prefix_mean(self, c: Candidate) -> float:
        rewards = self._val_rewards(c, self._probe)
        return sum(rewards) / len(rewards)

    def _leader(self) -> Candidate:
        pool = [c for c in self.history if c.val_evaluated >= self._probe]
        return max(pool, key=lambda c: leader_key(c, self._prefix_mean(c)))

    def _remaining(self) -> float:
        cfg = self.config
        return math.inf if cfg.max_rollouts is None else cfg.max_rollouts - self.rollouts_used

    async def _perfect(self) -> bool:
        """True once a fully validated candidate is perfect; validates a leader perfect on the probe."""
        if self.config.perfect_score is None:
            return False
        leader = self._leader()
        missing = len(self._val) - leader.val_evaluated
        if 0 < missing <= self._remaining() and self._prefix_mean(leader) >= self.config.perfect_score:
            await self._validate(leader, len(self._val), beat=self._best_score())
        return (self._best_score() or 0.0) >= self.config.perfect_score

    def _select_parents(self) -> list[Candidate]:
        cfg = self.config
        pool = [c for c in self.history if c.val_evaluated >= self._probe]
        if cfg.selection == "best":
            ranked = sorted(pool, key=lambda c: leader_key(c, self._prefix_mean(c)), reverse=True)
            return ranked[: cfg.beam_width]
        per_task = {c.resources_id: self._val_rewards(c, self._probe) for c in pool}
        return pareto_parents(pool, per_task, self._ancestors, cfg.beam_width, self._rng)

    async def _validate_baseline(self, root: Candidate) -> None:
        """Probe the starting prompt (fully validated later only if it stays a contender); stop with a
        clear error if those first rollouts all fail."""
        await self._validate(root, self._probe)
        trajectories = [
            self._trajectories[rid] for rid, _ in self._results(root, "val", self._val_order[: self._probe])
        ]
        problem = diagnose_baseline(trajectories, self._val)
        if problem is not None:
            raise AgentError(f"APO cannot start: {problem}")

    async def _finalize(self) -> None:
        """Fully validate the strongest partly validated candidates, raced against the best validated score."""
        cfg = self.config
        partial = [c for c in self.history if self._probe <= c.val_evaluated < len(self._val)]
        partial.sort(key=lambda c: leader_key(c, self._prefix_mean(c)), reverse=True)
        for candidate in partial[: cfg.finalists]:
            best = self._best_score()
            if best is not None and self._bound(candidate) <= best:
                continue
            if len(self._val) - candidate.val_evaluated > self._remaining():
                continue
            await self._validate(candidate, len(self._val), beat=best)

    def _bound(self, c: Candidate) -> float:
        """The best full validation score ``c`` could still reach."""
        top = self.config.perfect_score if self.config.perfect_score is not None else math.inf
        rewards = self._val_rewards(c, c.val_evaluated)
        return (sum(rewards) + top * (len(self._val) - len(rewards))) / len(self._val)

    # ----- one parent's expansion ----------------------------------------------------------
    async def _expand(self, parent: Candidate, round_no: int) -> int:
        """Critique ``parent`` on a minibatch, race its children; returns how many joined the pool."""
        cfg = self.config
        batch = self._minibatch(parent)
        fresh = sum((parent.resources_id, "train", i) not in self._scores for i in batch)
        reserve = len(self._val) - self._probe  # kept to fully validate the final leader
        if fresh + len(batch) + self._probe + reserve > self._remaining():
            raise BudgetExhausted(
                f"rollout budget {cfg.max_rollouts} nearly spent ({self.rollouts_used} used)"
            )
        parent_results = await self._run(parent, "train", batch, "minibatch")
        parent_sum = sum(r for _, r in parent_results)
        trajectories = sorted((self._trajectories[rid] for rid, _ in parent_results), key=lambda t: t.reward)
        if cfg.perfect_score is not None and all(t.reward >= cfg.perfect_score for t in trajectories):
            return 0  # nothing to learn from this minibatch
        critique = await self._critique(parent, trajectories)
        if critique is None:
            self.branches_skipped += cfg.branch_factor
            return 0
        edits = await asyncio.gather(
            *(self._edit(parent.template, critique, round_no * 100 + b) for b in range(cfg.branch_factor))
        )
        # an edit seen before is raced again on this minibatch, paying only for tasks it has not run
        pooled = {c.template for c in self.history if c.val_evaluated > 0} | {parent.template}
        raced: list[tuple[float, Candidate]] = []
        rematched = False
        for template in edits:
            if template is None or template in pooled:
                self.branches_skipped += 1
                continue
            pooled.add(template)
            if cfg.gate_on_minibatch and len(batch) + self._probe + reserve > self._remaining():
                self.branches_skipped += 1
                continue
            child = self._by_template.get(template) or await self._store_candidate(
                template, parent, round_no, critique
            )
            if not cfg.gate_on_minibatch:
                raced.append((0.0, child))
                continue
            gain = sum(r for _, r in await self._run(child, "train", batch, "minibatch")) - parent_sum
            if gain == 0 and not rematched and 2 * len(batch) + self._probe + reserve <= self._remaining():
                # a tie may only mean the minibatch missed what the edit fixes: one more minibatch decides
                rematched = True
                extra = self._minibatch(parent, exclude=set(batch))
                parent_extra = sum(r for _, r in await self._run(parent, "train", extra, "minibatch"))
                gain = sum(r for _, r in await self._run(child, "train", extra, "minibatch")) - parent_extra
            if gain > 0:
                raced.append((gain, child))
            else:
                self.branches_skipped += 1
        accepted = 0
        for _, child in sorted(raced, key=lambda pair: -pair[0]):
            if self._probe + reserve > self._remaining():
                break
            await self._validate(child, self._probe)
            parent_probe = sum(self._val_rewards(parent, self._probe))
            if sum(self._val_rewards(child, self._probe)) >= parent_probe:
                accepted += 1
            else:
                child.val_evaluated = 0  # lost on the probe: out of the pool
        return accepted

    def _minibatch(self, parent: Candidate, exclude: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
        """Mostly tasks ``parent`` already failed (free, and what the critic should see), plus fresh ones."""
        cfg = self.config
        failed = [
            i
            for i in range(len(self._train))
            if i not in exclude
            and (key := (parent.resources_id, "train", i)) in self._scores
            and self._scores[key][1] < (cfg.perfect_score if cfg.perfect_score is not None else math.inf)
        ]
        size = min(cfg.minibatch_size, len(self._train))
        reuse = self._rng.sample(failed, min(len(failed), max(size - 1, size // 2)))
        batch = list(reuse)
        seen = {i for i in range(len(self._train)) if (parent.resources_id, "train", i) in self._scores}
        for _ in range(2 * len(self._train)):
            if len(batch) >= size:
                break
            if not self._train_order:  # a new epoch over the training set, as GEPA samples
                self._train_order = list(range(len(self._train)))
                self._rng.shuffle(self._train_order)
            i = self._train_order.pop()
            if i not in batch and i not in exclude and (i not in seen or len(seen) >= len(self._train)):
                batch.append(i)
        return batch

    # ----- rollouts ------------------------------------------------------------------------
    async def _store_candidate(
        self, template: str, parent: Candidate | None, round_no: int, critique: str | None
    ) -> Candidate:
        parent_id = parent.resources_id if parent else None
        meta = {"apo": {"parent_id": parent_id, "round": round_no, "critique": critique}}
        version = await self._store.add_resources(
            {**self._base, self.config.prompt_name: PromptTemplate(template=template)}, metadata=meta
        )
        depth = parent.depth + 1 if parent else 0
        candidate = Candidate(version.resources_id, template, None, parent_id, round_no, critique, 0, depth)
        self._ancestors[candidate.resources_id] = (
            ({parent.resources_id} | self._ancestors[parent.resources_id]) if parent else set()
        )
        self.history.append(candidate)
        self._by_template[template] = candidate
        return candidate

    def _results(self, c: Candidate, split: str, indices: Sequence[int]) -> list[tuple[str, float]]:
        return [self._scores[(c.resources_id, split, i)] for i in indices]

    def _val_rewards(self, c: Candidate, n: int) -> list[float]:
        return [r for _, r in self._results(c, "val", self._val_order[:n])]

    async def _run(
        self, c: Candidate, split: str, indices: Sequence[int], phase: str
    ) -> list[tuple[str, float]]:
        """Rollouts of ``c`` on the tasks not yet scored for it; cached scores are reused for free."""
        todo = [i for i in dict.fromkeys(indices) if (c.resources_id, split, i) not in self._scores]
        if todo:
            if len(todo) > self._remaining():
                raise BudgetExhausted(
                    f"rollout budget {self.config.max_rollouts} reached ({self.rollouts_used} used)"
                )
            self.rollouts_used += len(todo)
            self.rollouts_by_phase[phase] += len(todo)
            tasks = self._train if split == "train" else self._val
            done = await self._resampled(c, split, [tasks[i] for i in todo], phase)
            unfinished = sum(not r.status.is_terminal for r, _ in done)
            if unfinished:
                log.warning("%d of %d rollouts did not finish in time; scoring them 0", unfinished, len(done))
            trajectories = [
                trajectory_from_spans(r.rollout_id, r.input, r.status.value, spans) for r, spans in done
            ]
            for i, trajectory in zip(todo, trajectories, strict=True):
                self._round_rollouts += 1
                if trajectory.status != "succeeded":
                    self._round_failures.append((trajectory.errors or [f"rollout {trajectory.status}"])[-1])
                self._trajectories[trajectory.rollout_id] = trajectory
                self._scores[(c.resources_id, split, i)] = (trajectory.rollout_id, trajectory.reward)
        return self._results(c, split, indices)

    async def _resampled(
        self, c: Candidate, split: str, tasks: list[Any], phase: str
    ) -> list[tuple[Rollout, list[Span]]]:
        """One rollout of ``c`` per task; those that failed for an ``infra`` or ``reward`` reason run
        again (up to ``max_resamples`` times, within the budget): only the prompt is being judged."""

        async def run(inputs: list[Any]) -> list[tuple[Rollout, list[Span]]]:
            return await self._ctx.rollouts(
                inputs,
                mode="train" if split == "train" else "val",
                resources_id=c.resources_id,
                metadata={"apo_candidate": c.resources_id},
                timeout_s=self.config.rollout_timeout_s,
            )

        done = await run(tasks)
        for _ in range(self.config.max_resamples):
            spans = {r.rollout_id: s for r, s in done}
            failures = await rollout_failures(self._store, [r for r, _ in done], spans)
            retry = {f.rollout.rollout_id for f in failures.details if f.failure_class != "agent"}
            again = [n for n, (r, _) in enumerate(done) if r.rollout_id in retry]
            if not again or len(again) > self._remaining():
                break
            log.info("APO: running %d rollouts again (infra or reward failures)", len(again))
            self.rollouts_used += len(again)
            self.rollouts_by_phase[phase] += len(again)
            self.rollouts_resampled += len(again)
            self._round_resampled += len(again)
            for n, pair in zip(again, await run([tasks[n] for n in again]), strict=True):
                done[n] = pair
        return done

    async def _validate(self, c: Candidate, upto: int, *, beat: float | None = None) -> None:
        """Extend ``c``'s validation to the first ``upto`` tasks; with ``beat``, in chunks, stopping once
        ``c`` can no longer score above it."""
        chunk = self._probe if beat is not None else upto
        while c.val_evaluated < upto:
            end = min(upto, c.val_evaluated + chunk)
            await self._run(c, "val", self._val_order[c.val_evaluated : end], "validation")
            c.val_evaluated = end
            rewards = self._val_rewards(c, end)
            c.score = sum(rewards) / len(rewards)
            if beat is not None and self._bound(c) <= beat:
                break
        if c.val_evaluated == len(self._val):
            self._curve.append((self.rollouts_used, self._best_score() or 0.0))

    # ----- critique and edit ---------------------------------------------------------------
    async def _critique(self, parent: Candidate, batch: list[Trajectory]) -> str | None:
        """Show the critic the minibatch's worst, more known failures (free), and its best."""
        cfg = self.config
        worst = [t for t in batch if cfg.perfect_score is None or t.reward < cfg.perfect_score][: cfg.worst_k]
        shown = {t.rollout_id for t in worst}
        known = [
            self._trajectories[rid]
            for (cid, split, _), (rid, reward) in self._scores.items()
            if cid == parent.resources_id
            and split == "train"
            and rid not in shown
            and (cfg.perfect_score is None or reward < cfg.perfect_score)
        ]
        worst += self._rng.sample(known, min(len(known), cfg.worst_k - len(worst)))
        best = [t for t in batch[::-1][: cfg.best_k] if t.rollout_id not in {w.rollout_id for w in worst}]
        user = (
            f"Current prompt:\n<prompt>{parent.template}</prompt>\n\n"
            f"Worst trajectories:\n{render_trajectories(worst)}\n\n"
            f"Best trajectories:\n{render_trajectories(best)}"
        )
        text = await self._chat(cfg.critic, CRITIC_SYSTEM, user, seed=0)
        if text is None or len(text.strip()) < 10:
            return None
        return text.strip()

    async def _edit(self, template: str, critique: str, seed: int) -> str | None:
        user = f"Prompt:\n<prompt>{template}</prompt>\n\nCritique:\n{critique}"
        for _ in range(self.config.llm_retries + 1):
            text = await self._chat(self.config.editor, EDITOR_SYSTEM, user, seed=seed)
            candidate = extract_prompt(text or "", template)
            if candidate is not None:
                return candidate
        return None

    async def _chat(self, llm: LLM, system: str, user: str, *, seed: int) -> str | None:
        """One critic/editor call with retries; None when it keeps failing (the branch is skipped)."""
        import openai

        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "agl", max_retries=0)
        try:
            for attempt in range(self.config.llm_retries + 1):
                if self.config.max_llm_calls is not None and self.llm_calls_used >= self.config.max_llm_calls:
                    raise BudgetExhausted(f"LLM-call budget {self.config.max_llm_calls} reached")
                self.llm_calls_used += 1
                try:
                    response = await client.chat.completions.create(
                        model=llm.model,
                        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                        seed=seed,
                        **llm.sampling_parameters,
                    )
                    return response.choices[0].message.content or ""
                except openai.OpenAIError as exc:
                    self.llm_calls_failed += 1
                    log.warning("%s call failed (try %d): %s", llm.model, attempt + 1, exc)
                    await asyncio.sleep(0.05 * 2**attempt)
            return None
        finally:
            await client.close()

    # ----- progress ------------------------------------------------------------------------
    def _metrics_logger(self, rounds: int | None) -> Any:
        cfg = self.config
        if self._output_dir is None:
            return None
        from agl.metrics import MetricsLogger

        budget = cfg.max_rollouts
        return MetricsLogger(
            Path(self._output_dir),
            total_steps=budget or rounds,
            progress=cfg.progress,
            console=cfg.progress,
            shown=("metric_calls", "best_val_score", "leader_probe_score", "candidates"),
            label="metric calls" if budget else "round",
            step_name="round",
            progress_key="metric_calls" if budget else None,
            plot_x="metric_calls",
            plot_y=("best_val_score", "leader_probe_score"),
            title="APO",
            tensorboard=False,
        )

    def _log_round(self, metrics: Any, round_no: int) -> None:
        best, leader = self._best_score(), self._leader()
        row = {
            "round": round_no,
            "metric_calls": self.rollouts_used,
            "validation_calls": self.rollouts_by_phase["validation"],
            **({"best_val_score": best} if best is not None else {}),
            "leader_probe_score": self._prefix_mean(leader),
            "candidates": len([c for c in self.history if c.val_evaluated >= self._probe]),
            "llm_calls": self.llm_calls_used,
            "rollouts": self._round_rollouts,
            "failed_rollouts": len(self._round_failures),
            "resampled_rollouts": self._round_resampled,
        }
        log.info("APO round %d: %s", round_no, row)
        if metrics is not None:
            failures = Failures(
                len(self._round_failures), self._round_rollouts, next(iter(self._round_failures), None)
            )
            metrics.log(round_no, {**row, **failures.console()})
        self._round_failures, self._round_rollouts, self._round_resampled = [], 0, 0


def _extract_prompt(text: str, original: str) -> str | None:
    return extract_prompt(text, original)
