"""What a GRPO step does with the rollouts that yielded no reward, per failure class (``GRPOConfig.on_failure``).

Each failed rollout is classed (:mod:`agl.failures`), then by its class's action: ``resample`` runs the
task again in the same group under the same resources version (the policy it was enqueued with), up to
``max_resamples`` times, then drops the group; ``drop_group`` discards its whole group; ``train_survivors``
trains the rest of the group when at least 2 remain; ``zero`` keeps it to train with reward 0. Every
rollout that does not train because of a failure is written to ``OUT/dropped.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl.algorithm.base import PendingRollouts, TrainingContext
from agl.algorithm.health import Failure, Failures, rollout_failures
from agl.errors import AglError
from agl.failures import FAILURE_CLASSES, FailureClass
from agl.schemas import Rollout, RolloutCreate, RolloutStatus, Span

DROPPED_FILE = "dropped.jsonl"


@dataclass
class Settled:
    """A step's rollouts once failures are handled: what trains (``rollouts``, with ``zeroed`` ids
    training at reward 0), the failures left, the rows for ``dropped.jsonl`` and the step's counts."""

    rollouts: list[Rollout]
    spans: dict[str, list[Span]]
    zeroed: set[str]
    failures: Failures
    dropped: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class TaskIndex:
    """A task's position in the training set, found from a rollout's stored input (JSON, as the store
    keeps it); the first position for a task listed twice, None for one not in the set."""

    def __init__(self, tasks: Sequence[Any]) -> None:
        self._index: dict[str, int] = {}
        for i, task in enumerate(tasks):
            self._index.setdefault(_key(task), i)

    def __call__(self, task: Any) -> int | None:
        return self._index.get(_key(task))


def _key(task: Any) -> str:
    return json.dumps(task, sort_keys=True, default=repr)


async def settle_failures(
    ctx: TrainingContext,
    rollouts: Sequence[Rollout],
    spans: dict[str, list[Span]],
    *,
    on_failure: Mapping[FailureClass, str],
    max_resamples: int,
    timeout_s: float,
    step: int,
    task_index: TaskIndex,
) -> Settled:
    """Resample, drop or zero the failed rollouts of one step as ``on_failure`` says for their class."""
    current, spans = list(rollouts), dict(spans)
    failures = await rollout_failures(ctx.store, current, spans)
    await _cancel_unfinished(ctx, failures)
    dropped: list[dict[str, Any]] = []
    resampled = 0
    for _ in range(max_resamples):
        redo = [f for f in failures.details if on_failure[f.failure_class] == "resample"]
        if not redo:
            break
        fresh = await _resample(ctx, [f.rollout for f in redo], timeout_s)
        resampled += len(fresh)
        position = {r.rollout_id: i for i, r in enumerate(current)}
        for failure, (rollout, rollout_spans) in zip(redo, fresh, strict=True):
            dropped.append(_row(failure, step, task_index, "resampled"))
            current[position[failure.rollout.rollout_id]] = rollout
            spans[rollout.rollout_id] = rollout_spans
        failures = await rollout_failures(ctx.store, current, spans)
        await _cancel_unfinished(ctx, failures)
    keep, zeroed, groups_dropped = _apply(current, failures.details, on_failure, step, task_index, dropped)
    counts = {c: float(failures.by_class.get(c, 0)) for c in FAILURE_CLASSES}
    metrics = {
        "rollouts": float(len(current)),
        "failed_rollouts": float(failures.failed),
        **{f"failed_{c}": n for c, n in counts.items()},
        "resampled_rollouts": float(resampled),
        "zeroed_rollouts": float(len(zeroed)),
        "dropped_rollouts": float(sum(row["reason"] != "resampled" for row in dropped)),
        "dropped_groups": float(groups_dropped),
    }
    return Settled(keep, spans, zeroed, failures, dropped, metrics)


async def _cancel_unfinished(ctx: TrainingContext, failures: Failures) -> None:
    """Cancel the rollouts still running when the wait ended: they will not train, and their runners
    see the cancellation at their next heartbeat and stop."""
    for f in failures.details:
        if not f.rollout.status.is_terminal:
            with contextlib.suppress(AglError):  # it may have finished meanwhile
                await ctx.store.cancel_rollout(f.rollout.rollout_id)


async def _resample(
    ctx: TrainingContext, failed: Sequence[Rollout], timeout_s: float
) -> list[tuple[Rollout, list[Span]]]:
    """Each failed rollout's task again, in its group, under its resources version; waits for them."""
    requests = [
        RolloutCreate(
            input=r.input,
            mode=r.mode,
            resources_id=r.resources_id,
            group_id=r.group_id,
            metadata={**r.metadata, "resample_of": r.metadata.get("resample_of", r.rollout_id)},
        )
        for r in failed
    ]
    ids = [r.rollout_id for r in await ctx.store.enqueue_rollouts(requests)]
    return await PendingRollouts(ctx, ids).collect(timeout_s)


def _apply(
    rollouts: list[Rollout],
    failed: Sequence[Failure],
    on_failure: Mapping[FailureClass, str],
    step: int,
    task_index: TaskIndex,
    dropped: list[dict[str, Any]],
) -> tuple[list[Rollout], set[str], int]:
    """Apply each failure's action to its group; returns the rollouts that train, the zeroed ids and
    the number of groups dropped (a ``resample`` left failing after its last try drops its group)."""
    by_id = {f.rollout.rollout_id: f for f in failed}
    groups: dict[str, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_id or r.rollout_id].append(r)
    keep: list[str] = []
    zeroed: set[str] = set()
    groups_dropped = 0
    for members in groups.values():
        actions = {
            r.rollout_id: on_failure[by_id[r.rollout_id].failure_class]
            for r in members
            if r.rollout_id in by_id
        }
        if any(a in ("drop_group", "resample") for a in actions.values()):
            cause = next(by_id[i] for i, a in actions.items() if a in ("drop_group", "resample"))
            groups_dropped += 1
            for r in members:
                failure = by_id.get(r.rollout_id)
                reason = "failed" if failure is not None else "dropped with its group"
                dropped.append(_row(failure or cause, step, task_index, reason, rollout=r))
            continue
        survivors = [r for r in members if actions.get(r.rollout_id) in (None, "zero")]
        for r in members:
            if actions.get(r.rollout_id) == "train_survivors":
                dropped.append(_row(by_id[r.rollout_id], step, task_index, "failed"))
        if len(survivors) < 2 and len(members) > len(survivors):
            groups_dropped += 1
            for r in survivors:
                failure = by_id.get(r.rollout_id)
                dropped.append(_row(failure, step, task_index, "fewer than 2 survivors", rollout=r))
            continue
        keep += [r.rollout_id for r in survivors]
        zeroed |= {r.rollout_id for r in survivors if r.rollout_id in actions}
    kept = set(keep)
    return [r for r in rollouts if r.rollout_id in kept], zeroed, groups_dropped


def _row(
    failure: Failure | None,
    step: int,
    task_index: TaskIndex,
    reason: str,
    *,
    rollout: Rollout | None = None,
) -> dict[str, Any]:
    """One line of ``dropped.jsonl``; a healthy rollout dropped with its group carries no class or error
    of its own (``group_class`` says why its group went)."""
    r = rollout if rollout is not None else failure.rollout if failure is not None else None
    assert r is not None
    own = failure is not None and failure.rollout.rollout_id == r.rollout_id
    return {
        "step": step,
        "mode": r.mode,
        "rollout_id": r.rollout_id,
        "group_id": r.group_id,
        "task_index": task_index(r.input),
        "class": failure.failure_class if own and failure is not None else None,
        "error": failure.error if own and failure is not None else None,
        "attempts": failure.attempts if own and failure is not None else r.num_attempts,
        "reason": reason,
        **({} if own or failure is None else {"group_class": failure.failure_class}),
        "succeeded": r.status == RolloutStatus.SUCCEEDED,
    }


def write_dropped(out_dir: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append ``rows`` to ``OUT/dropped.jsonl`` (one JSON object a line)."""
    if not rows:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / DROPPED_FILE).open("a") as f:
        for row in rows:
            f.write(json.dumps(row, default=repr) + "\n")


def failure_rows(
    failures: Failures, step: int, task_index: TaskIndex, reason: str = "failed"
) -> list[dict[str, Any]]:
    """``dropped.jsonl`` rows for every failure in ``failures`` (a validation's, say)."""
    return [_row(f, step, task_index, reason) for f in failures.details]


__all__ = ["DROPPED_FILE", "Settled", "TaskIndex", "failure_rows", "settle_failures", "write_dropped"]
