"""GRPO with a reward judge (``GRPOConfig(judge=...)``): rewards for the rollouts that returned none.

A step's groups are judged side by side, one call per group; a group the judge fails on leaves the
step (counted as ``judge_failures``), never trained with a reward of 0. Validation rollouts are judged
alone, each a group of one with the same rubric, so the held-out score does not depend on which
rollouts share a step; one the judge fails on is left out of the mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from agl.algorithm.base import Evaluation, rewarded_score
from agl.rewards import judge_rollouts
from agl.schemas import Rollout, Span

if TYPE_CHECKING:
    from agl.rewards import Judge
    from agl.store import LightningStore


async def judge_step(
    store: LightningStore, judge: Judge | None, rollouts: Sequence[Rollout], spans: Mapping[str, list[Span]]
) -> tuple[list[Rollout], dict[str, list[Span]], dict[str, float]]:
    """The rollouts to train on (without the groups the judge failed on), their spans with the judge's
    rewards, and the step's judge metrics."""
    if judge is None:
        return list(rollouts), dict(spans), {}
    judged = await judge_rollouts(store, judge, rollouts, spans)
    kept = [r for r in rollouts if r.rollout_id not in judged.dropped]
    return (
        kept,
        judged.spans,
        {"judged_groups": float(judged.groups), "judge_failures": float(judged.failures)},
    )


async def judge_evaluation(store: LightningStore, judge: Judge | None, result: Evaluation) -> Evaluation:
    """A validation with the judge's rewards for its unrewarded rollouts, each judged alone."""
    if judge is None:
        return result
    spans = {r.rollout_id: s for r, s in result.results}
    judged = await judge_rollouts(store, judge, [r for r, _ in result.results], spans, alone=True)
    done = [(r, judged.spans[r.rollout_id]) for r, _ in result.results if r.rollout_id not in judged.dropped]
    return Evaluation(rewarded_score(done), result.failures, done)  # failures counted, never scored


__all__ = ["judge_evaluation", "judge_step"]
