"""The algorithm seam: ``Algorithm.run(ctx, train, val)`` with a ``TrainingContext`` to reach the loop.

An algorithm reaches runners only through the store: it enqueues rollouts, waits for them, reads
their spans through adapters, and publishes new resources (or weights through ``ctx.sync_weights``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.adapter import final_reward
from agl.algorithm.health import Failures, rollout_failures
from agl.schemas import LLM, Resource, Rollout, RolloutCreate, RolloutStatus, Span, new_id
from agl.store.base import LightningStore


async def _no_flush() -> None:
    return None


@dataclass
class TrainingContext:
    """What the trainer hands an algorithm.

    Args:
        store: the LightningStore the runners serve.
        llm: the LLM resource agents should call (the gateway's rollout-scoped endpoint).
        flush: makes every recorded model call visible in the store (the gateway batches its writes).
        sync_weights: pushes a state dict to the engine and returns the new model version; None when the
            trainer serves no local engine (APO against a hosted model).
        output_dir: where checkpoints, metrics and plots go.
    """

    store: LightningStore
    llm: LLM | None = None
    flush: Callable[[], Awaitable[None]] = _no_flush
    sync_weights: Callable[[dict[str, Any]], Awaitable[str]] | None = None
    output_dir: str = "results"
    extra: dict[str, Any] = field(default_factory=dict)

    async def publish(self, resources: dict[str, Resource], **metadata: Any) -> str:
        """Store a new resources version (rollouts enqueued with its id run with it); returns the id."""
        published = await self.store.add_resources(resources, metadata=metadata or None)
        return published.resources_id

    async def rollouts(
        self,
        tasks: Sequence[Any],
        *,
        mode: str = "train",
        group_size: int = 1,
        resources_id: str | None = None,
        timeout_s: float = 600.0,
    ) -> list[tuple[Rollout, list[Span]]]:
        """Run ``group_size`` rollouts per task (one ``group_id`` per task), wait for all, return them with spans.

        Waiting goes through ``store.wait_for_rollouts``; rollouts still unfinished at ``timeout_s`` come
        back in their current (non-succeeded) state, so callers drop them rather than train on them.
        """
        requests = []
        for task in tasks:
            group = new_id("gr")
            requests += [
                RolloutCreate(input=task, mode=mode, resources_id=resources_id, group_id=group)
                for _ in range(group_size)
            ]
        ids = [r.rollout_id for r in await self.store.enqueue_rollouts(requests)]
        done = {r.rollout_id: r for r in await self.store.wait_for_rollouts(ids, timeout_s=timeout_s)}
        await self.flush()
        out = []
        for rollout_id in ids:
            rollout = done.get(rollout_id) or await self.store.get_rollout(rollout_id)
            out.append((rollout, await rollout_spans(self.store, rollout_id)))
        return out


async def validate(
    ctx: TrainingContext, val: Sequence[Any], resources_id: str, *, timeout_s: float = 600.0
) -> tuple[float, Failures]:
    """Mean final reward of one ``mode="val"`` rollout per task (a failed one scores 0), and the failures."""
    if not val:
        return float("nan"), Failures(0, 0)
    done = await ctx.rollouts(val, mode="val", resources_id=resources_id, timeout_s=timeout_s)
    rewards = [(final_reward(spans) or 0.0) if succeeded(r) else 0.0 for r, spans in done]
    failures = await rollout_failures(ctx.store, [r for r, _ in done], {r.rollout_id: s for r, s in done})
    return sum(rewards) / len(rewards), failures


async def rollout_spans(store: LightningStore, rollout_id: str) -> list[Span]:
    """Every span of the rollout's latest attempt, across pages."""
    spans: list[Span] = []
    cursor = None
    while True:
        page = await store.query_spans(rollout_id=rollout_id, attempt_id="latest", cursor=cursor)
        spans += page.items
        cursor = page.next_cursor
        if cursor is None:
            return spans


def succeeded(rollout: Rollout) -> bool:
    return rollout.status == RolloutStatus.SUCCEEDED


class Algorithm:
    """Subclass and implement :meth:`run`; ``Trainer.fit`` calls it once with the wired context."""

    @property
    def model_path(self) -> str | None:
        """The local model this algorithm trains; the trainer serves it (engine + gateway) when set."""
        path = getattr(getattr(self, "config", None), "model_path", None)
        return None if path is None else str(path)

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx, train, val)")


class FunctionAlgorithm(Algorithm):
    def __init__(self, fn: Callable[[TrainingContext, Sequence[Any], Sequence[Any]], Awaitable[Any]]) -> None:
        self.fn = fn

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        return await self.fn(ctx, train, val)


def as_algorithm(fn: Callable[[TrainingContext, Sequence[Any], Sequence[Any]], Awaitable[Any]]) -> Algorithm:
    """Make an ``async def fn(ctx, train, val)`` an Algorithm (the function form)."""
    return FunctionAlgorithm(fn)
