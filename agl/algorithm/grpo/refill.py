"""A GRPO step's rollouts settled, and topped up with groups that carry signal (``GRPOConfig(refill=True)``).

A group whose rewards all tie has zero advantage everywhere: it costs rollouts and trains nothing. With
``refill`` (DAPO's dynamic sampling, verl's ``filter_groups``), such groups are set aside and more tasks
are drawn, a round at a time, until the step holds ``tasks_per_step`` groups with signal, the extra
rollouts reach ``refill_max_rollouts`` or every training task has been drawn at this step. Extra tasks
come from a generator seeded by (seed, step), so the main task sequence (and a resumed run's) does not
depend on how much a step refilled; they run under the step's resources version and go through the same
failure settling, staleness check and judge as the first draw.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.algorithm.base import TrainingContext
from agl.algorithm.grpo.async_loop import VersionLog, drop_stale
from agl.algorithm.grpo.batch import build_batch
from agl.algorithm.grpo.config import GRPOConfig
from agl.algorithm.grpo.failures import TaskIndex, failure_rows, settle_failures, write_dropped
from agl.algorithm.grpo.judging import judge_step
from agl.algorithm.health import Failures
from agl.schemas import Rollout, Span
from agl.seeding import derive_seed


@dataclass
class Round:
    """Rollouts once settled: those that train (``zeroed`` ones at reward 0), the failures among all
    that ran, the indices of the tasks drawn, and the counts for the step's metrics row."""

    rollouts: list[Rollout]
    spans: dict[str, list[Span]]
    zeroed: set[str]
    failures: Failures
    drawn: set[int | None] = field(default_factory=set)
    metrics: dict[str, float] = field(default_factory=dict)

    def merged(self, other: Round) -> Round:
        """This round followed by ``other``: counts add up (staleness is 0 in both: refill is
        synchronous), the first failure's error stays the earliest."""
        metrics = dict(self.metrics)
        for key, value in other.metrics.items():
            keep_max = key.startswith("staleness_")
            metrics[key] = max(metrics.get(key, value), value) if keep_max else metrics.get(key, 0.0) + value
        return Round(
            self.rollouts + other.rollouts,
            {**self.spans, **other.spans},
            self.zeroed | other.zeroed,
            self.failures + other.failures,
            self.drawn | other.drawn,
            metrics,
        )


@dataclass
class StepRollouts:
    """How a step's rollouts become the ones it trains on, the same for its first draw and its refills."""

    ctx: TrainingContext
    config: GRPOConfig
    train: Sequence[Any]
    versions: VersionLog
    max_staleness: int
    out: Path

    def __post_init__(self) -> None:
        self.task_index = TaskIndex(self.train)

    async def settle(
        self, rollouts: Sequence[Rollout], spans: dict[str, list[Span]], *, step: int, enqueued_version: int
    ) -> Round:
        """Failures settled by class (``dropped.jsonl`` written), rollouts past the staleness bound
        dropped, the unrewarded ones judged."""
        cfg = self.config
        settled = await settle_failures(
            self.ctx,
            rollouts,
            spans,
            on_failure=cfg.on_failure,
            max_resamples=cfg.max_resamples,
            timeout_s=cfg.rollout_timeout_s,
            step=step,
            task_index=self.task_index,
        )
        write_dropped(self.out, settled.dropped)
        kept, stale = drop_stale(
            settled.rollouts,
            settled.spans,
            self.versions,
            fallback=enqueued_version,
            max_staleness=self.max_staleness,
            zeroed=settled.zeroed,
            agents=cfg.agents,
        )
        kept, judged_spans, judged, misjudged = await judge_step(
            self.ctx.store, cfg.judge, kept, settled.spans
        )
        write_dropped(self.out, failure_rows(misjudged, step, self.task_index, "the judge gave no score"))
        drawn = {self.task_index(r.input) for r in rollouts}
        metrics = {**settled.metrics, **stale, **judged}
        if misjudged.failed:  # a judge that gives no score is a reward failure: counted, never trained
            metrics["failed_rollouts"] = metrics.get("failed_rollouts", 0.0) + misjudged.failed
            metrics["failed_reward"] = metrics.get("failed_reward", 0.0) + misjudged.failed
            metrics["dropped_rollouts"] = metrics.get("dropped_rollouts", 0.0) + misjudged.failed
        return Round(kept, judged_spans, settled.zeroed, settled.failures + misjudged, drawn, metrics)

    async def refill(self, first: Round, *, step: int, resources_id: str | None) -> Round:
        """``first`` topped up with rounds of new tasks until ``tasks_per_step`` groups carry signal or
        the extra rollouts' cap is reached; the groups with signal past ``tasks_per_step`` are left out,
        so every step trains on the same number of groups."""
        cfg = self.config
        cap = refill_cap(cfg)
        rng = random.Random(derive_seed(cfg.seed, "refill", step))
        current, extra, rounds = first, 0, 0
        while True:
            signal = signal_groups(current, cfg)
            missing = cfg.tasks_per_step - len(signal)
            pool = [i for i in range(len(self.train)) if i not in current.drawn]
            # as many tasks as the step's share of groups with signal so far says will fill it
            want = math.ceil(missing * max(len(current.drawn), 1) / max(len(signal), 1))
            count = min(want, len(pool), (cap - extra) // cfg.group_size)
            if missing <= 0 or count <= 0:
                break
            rounds += 1
            picked = rng.sample(pool, count)
            pending = await self.ctx.start_rollouts(
                [self.train[i] for i in picked],
                group_size=cfg.group_size,
                resources_id=resources_id,
                metadata={"step": step, "refill_round": rounds},
                sampling_seed=derive_seed(cfg.seed, step, "refill", rounds) if cfg.deterministic else None,
            )
            done = await pending.collect(cfg.rollout_timeout_s)
            extra += len(done)
            more = await self.settle(
                [r for r, _ in done],
                {r.rollout_id: s for r, s in done},
                step=step,
                enqueued_version=self.versions.current,
            )
            more.drawn |= set(picked)
            current = current.merged(more)
        surplus = set(signal[cfg.tasks_per_step :])
        current.rollouts = [r for r in current.rollouts if _group(r) not in surplus]
        current.metrics.update(
            refill_rollouts=float(extra),
            refill_rounds=float(rounds),
            groups_with_signal=float(min(len(signal), cfg.tasks_per_step)),
        )
        return current


def refill_cap(config: GRPOConfig) -> int:
    """The most extra rollouts one step may run: ``refill_max_rollouts``, by default twice the step's."""
    if config.refill_max_rollouts is not None:
        return config.refill_max_rollouts
    return 2 * config.tasks_per_step * config.group_size


def signal_groups(trained: Round, config: GRPOConfig) -> list[str]:
    """The groups of ``trained``, in draw order, whose rewards (with per-call credit, whose calls'
    returns) do not all tie for at least one agent: those with a non-zero advantage to train on."""
    groups: dict[str, list[Rollout]] = defaultdict(list)
    for r in trained.rollouts:
        groups[_group(r)].append(r)
    signal = []
    for group, members in groups.items():
        counts = build_batch(members, trained.spans, config, trained.zeroed).metrics
        if counts["groups"] > counts["zero_variance_groups"]:
            signal.append(group)
    return signal


def _group(rollout: Rollout) -> str:
    return rollout.group_id or rollout.rollout_id


__all__ = ["Round", "StepRollouts", "refill_cap", "signal_groups"]
