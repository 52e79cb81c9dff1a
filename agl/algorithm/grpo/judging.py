"""GRPO with a reward judge (``GRPOConfig(judge=...)``): rewards for the rollouts that returned none.

A step's groups are judged side by side, one call per group; a group the judge fails on leaves the
step (counted as ``judge_failures``), never trained with a reward of 0: its rollouts are ``reward``
failures (:mod:`agl.failures`), counted with the step's failures and written to ``dropped.jsonl``.
Validation rollouts are judged alone, each a group of one with the same rubric, so the held-out score
does not depend on which rollouts share a step; one the judge fails on is a ``reward`` failure, reported
apart from the score.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from agl.algorithm.base import Evaluation, rewarded_score
from agl.algorithm.health import Failure, Failures
from agl.rewards import judge_rollouts
from agl.rewards.rollouts import Judged
from agl.schemas import Rollout, Span

if TYPE_CHECKING:
    from agl.rewards import Judge
    from agl.store import LightningStore


def judge_failures(rollouts: Sequence[Rollout], judged: Judged) -> Failures:
    """The rollouts of the groups the judge failed on, as ``reward`` failures (already counted in the
    step's total, so ``total`` is 0 here)."""
    details = tuple(
        Failure(r, "reward", judged.errors.get(r.rollout_id, "JudgeError"), r.num_attempts)
        for r in rollouts
        if r.rollout_id in judged.dropped
    )
    first = details[0].error if details else None
    return Failures(len(details), 0, first, {"reward": len(details)} if details else {}, details)


async def judge_step(
    store: LightningStore, judge: Judge | None, rollouts: Sequence[Rollout], spans: Mapping[str, list[Span]]
) -> tuple[list[Rollout], dict[str, list[Span]], dict[str, float], Failures]:
    """The rollouts to train on (without the groups the judge failed on), their spans with the judge's
    rewards, the step's judge metrics, and the judge's failures (``reward`` class)."""
    if judge is None:
        return list(rollouts), dict(spans), {}, Failures(0, 0)
    judged = await judge_rollouts(store, judge, rollouts, spans)
    kept = [r for r in rollouts if r.rollout_id not in judged.dropped]
    metrics = {"judged_groups": float(judged.groups), "judge_failures": float(judged.failures)}
    return kept, judged.spans, metrics, judge_failures(rollouts, judged)


async def judge_evaluation(store: LightningStore, judge: Judge | None, result: Evaluation) -> Evaluation:
    """A validation with the judge's rewards for its unrewarded rollouts, each judged alone."""
    if judge is None:
        return result
    spans = {r.rollout_id: s for r, s in result.results}
    judged = await judge_rollouts(store, judge, [r for r, _ in result.results], spans, alone=True)
    done = [(r, judged.spans[r.rollout_id]) for r, _ in result.results if r.rollout_id not in judged.dropped]
    failed = judge_failures([r for r, _ in result.results], judged)
    return Evaluation(rewarded_score(done), result.failures + failed, done)  # counted apart, never scored


__all__ = ["judge_evaluation", "judge_failures", "judge_step"]
