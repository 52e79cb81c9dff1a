"""Pure parts of APO's search: Pareto parent selection, the leader, prompt extraction, baseline diagnosis."""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agl.algorithm.apo.trajectories import Trajectory
from agl.schemas import PromptTemplate


@dataclass
class Candidate:
    """One prompt in the search, stored as the resources version ``resources_id``.

    ``score`` is the mean reward over the first ``val_evaluated`` tasks of the (fixed, shuffled)
    validation order; a candidate is *fully validated* when that covers the whole validation set.
    """

    resources_id: str
    template: str
    score: float | None = None
    parent_id: str | None = None
    round: int = 0
    critique: str | None = None
    val_evaluated: int = 0
    depth: int = 0


def pareto_parents(
    pool: Sequence[Candidate],
    per_task: dict[str, list[float]],
    ancestors: dict[str, set[str]],
    k: int,
    rng: random.Random,
) -> list[Candidate]:
    """Up to ``k`` distinct parents, sampled by how many validation tasks each is best on (as GEPA does).

    ``per_task`` holds each candidate's rewards on the shared validation prefix. A candidate is dropped
    when another is at least as good on every task and better on one, or is its descendant (children
    are only accepted after beating their parent on a minibatch, so a tie on the prefix favours them).
    """
    live = [c for c in pool if c.resources_id in per_task]
    if not live:
        return []

    def dominates(d: Candidate, c: Candidate) -> bool:
        a, b = per_task[d.resources_id], per_task[c.resources_id]
        if any(x < y for x, y in zip(a, b, strict=True)):
            return False
        return any(x > y for x, y in zip(a, b, strict=True)) or c.resources_id in ancestors.get(
            d.resources_id, set()
        )

    front = [c for c in live if not any(d is not c and dominates(d, c) for d in live)]
    n_tasks = len(per_task[live[0].resources_id])
    wins: Counter[str] = Counter()
    for t in range(n_tasks):
        top = max(per_task[c.resources_id][t] for c in front)
        for c in front:
            if per_task[c.resources_id][t] == top:
                wins[c.resources_id] += 1
    chosen: list[Candidate] = []
    remaining = list(front)
    while remaining and len(chosen) < k:
        weights = [wins[c.resources_id] + 1e-3 for c in remaining]
        pick = rng.choices(remaining, weights=weights)[0]
        chosen.append(pick)
        remaining.remove(pick)
    return chosen


def leader_key(candidate: Candidate, prefix_mean: float) -> tuple[float, int, int]:
    """Rank by score on the shared validation prefix, then depth (a tie favours the refined child)."""
    return (prefix_mean, candidate.depth, candidate.val_evaluated)


def extract_prompt(text: str, original: str) -> str | None:
    """The prompt between <prompt> tags, if it is non-empty, sane in size and keeps the placeholders."""
    match = re.search(r"<prompt>(.*?)</prompt>", text, re.S)
    if match is None:
        return None
    prompt = match.group(1).strip()
    if not prompt or len(prompt) > 20 * max(len(original), 200):
        return None
    needed = set(PromptTemplate(template=original).placeholders)
    have = set(PromptTemplate(template=prompt).placeholders)
    return prompt if needed <= have else None


def diagnose_baseline(trajectories: Sequence[Trajectory], tasks: Sequence[Any]) -> str | None:
    """A message when every baseline rollout failed (the search would learn nothing); None otherwise.

    A ``KeyError`` (a placeholder or task field under the wrong name) is named with the task's keys.
    """
    if not trajectories or any(t.status == "succeeded" for t in trajectories):
        return None
    errors = Counter(e for t in trajectories for e in t.errors[-1:])
    if not errors:
        return (
            f"all {len(trajectories)} rollouts of the baseline prompt failed without a recorded error; "
            "check the agent and its runners before optimizing the prompt"
        )
    error, count = errors.most_common(1)[0]
    message = (
        f"all {len(trajectories)} rollouts of the baseline prompt failed "
        f"({count} with the same error: {error})"
    )
    key = re.match(r"KeyError: \W*'?\"?(\w+)", error)
    if key is not None:
        keys = sorted({k for t in tasks if isinstance(t, dict) for k in t})
        message += (
            f"; the prompt or agent asks for the key {key.group(1)!r}, but the tasks have the keys {keys}: "
            "rename the placeholder or the task field so they match"
        )
    return message
